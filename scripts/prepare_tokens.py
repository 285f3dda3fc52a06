"""Tokenizes text files into a token file for ``data.path``: a flat array of ids, uint16 or uint32.

    python scripts/prepare_tokens.py corpus.txt --out data/corpus.bin                      # byte-level (vocab 256)
    python scripts/prepare_tokens.py a.txt b.txt.gz --out data/ab.bin --tokenizer tokenizers:tokenizer.json
    python scripts/prepare_tokens.py corpus.txt --out data/gpt2.bin --tokenizer tiktoken:gpt2
    python scripts/prepare_tokens.py corpus.txt --out data/ft.bin --tokenizer hf:path/to/model  # its tokenizer.json
    python scripts/prepare_tokens.py docs.jsonl --documents --out data/docs.bin  # + data/docs.bin.docs.npy

The output is what nanoGPT's prepare.py writes (ids back to back, native byte order), plus
``<out>.json`` saying its dtype, vocabulary size, token count and tokenizer, which training checks.
Text is read and tokenized in chunks of whole lines, so a corpus larger than memory works. The
tokenizer runs here only: training reads ids and never loads, let alone downloads, a tokenizer.
``tokenizers:PATH`` loads a local ``tokenizer.json`` (pip install tokenizers); ``hf:DIR`` the
``tokenizer.json`` of a Hugging Face model directory (the one model.pretrained=DIR trains from);
``tiktoken:NAME`` an encoding of tiktoken (pip install tiktoken; it downloads the encoding's file
on first use and caches it: offline, only an encoding already cached works).
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence, Tuple

import numpy as np

from pipedream2bw.data import BYTE_VOCAB, TOKEN_SUFFIX, index_path, meta_path, tokenize_jsonl
from pipedream2bw.errors import ConfigError
from pipedream2bw.io.fileio import atomic_open, atomic_write

CHUNK_BYTES = 1 << 22  # text tokenized at a time (about 4 MiB), in whole lines


def make_tokenizer(spec: str) -> Tuple[Callable[[bytes], Sequence[int]], int]:
    """(UTF-8 text -> ids, vocabulary size) for ``bytes``, ``tokenizers:PATH`` or ``tiktoken:NAME``.

    Raises:
        SystemExit: unknown spec, or the package it needs is not installed.
    """
    kind, _, arg = spec.partition(":")
    if spec == "bytes":
        return (lambda raw: np.frombuffer(raw, dtype=np.uint8)), BYTE_VOCAB  # the bytes as they are
    if kind in ("tokenizers", "hf") and arg:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            sys.exit(f"--tokenizer {kind}:... needs the tokenizers package: pip install 'pipedream2bw[tokenize]'")
        file = Path(arg) / "tokenizer.json" if kind == "hf" else Path(arg)
        if not file.is_file():
            sys.exit(
                f"--tokenizer {spec}: {file} is not a file; "
                + (
                    "the model directory needs its fast tokenizer's tokenizer.json (tokenizer.save_pretrained(DIR) "
                    "writes it), or name one with tokenizers:<tokenizer.json>"
                    if kind == "hf"
                    else "give the path of a tokenizer.json"
                )
            )
        tok = Tokenizer.from_file(str(file))
        return (lambda raw: tok.encode(_text(raw), add_special_tokens=False).ids), tok.get_vocab_size()
    if kind == "tiktoken" and arg:
        try:
            import tiktoken
        except ImportError:
            sys.exit("--tokenizer tiktoken:... needs the tiktoken package: pip install 'pipedream2bw[tokenize]'")
        try:
            enc = tiktoken.get_encoding(arg)
        except ValueError as e:  # not an encoding tiktoken knows
            sys.exit(f"--tokenizer {spec}: {e}")
        except Exception as e:  # requests' ConnectionError, an HTTP error, a proxy refusing: no file to be had
            sys.exit(
                f"--tokenizer {spec} needs the encoding's file, which tiktoken downloads on first use, and the "
                f"download failed ({type(e).__name__}); run it once where the internet is reachable (tiktoken caches "
                f"the file, in TIKTOKEN_CACHE_DIR if set), or use a local tokenizer: tokenizers:<tokenizer.json> or "
                "hf:<model directory>"
            )
        return (lambda raw: enc.encode_ordinary(_text(raw))), enc.n_vocab
    sys.exit(
        f"--tokenizer {spec!r} is unknown; use bytes, tokenizers:<tokenizer.json>, hf:<model directory> or "
        "tiktoken:<encoding, e.g. gpt2>"
    )


class _Replaced:
    """What decoding for a text tokenizer replaced: invalid UTF-8 bytes, the lines holding them, the first one."""

    def __init__(self) -> None:
        self.bytes, self.lines, self.first = 0, 0, ""
        self.chunk: Tuple[str, int] = ("", 0)  # the file being read, and the line its current chunk starts at

    def decode(self, raw: bytes) -> str:
        """``raw`` as text, each invalid byte sequence replaced with U+FFFD, counted."""
        lines = set()

        def count(e: UnicodeDecodeError) -> Tuple[str, int]:
            self.bytes += e.end - e.start
            line = e.object.count(b"\n", 0, e.start)
            lines.add(line)
            if not self.first:
                self.first = f"{self.chunk[0]} line {self.chunk[1] + line + 1}"
            return "\ufffd", e.end

        codecs.register_error(_ERRORS, count)  # (re-)registered for this chunk's set of lines
        text = raw.decode("utf-8", errors=_ERRORS)
        self.lines += len(lines)
        return text


_ERRORS = "prepare_tokens_count"
REPLACED = _Replaced()  # reset by each prepare()


def _text(raw: bytes) -> str:
    return REPLACED.decode(raw)  # a chunk ends at a newline, never inside a character


def read_chunks(paths: Sequence[Path], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The contents of ``paths`` (plain or .gz) in pieces of whole lines of about ``chunk_bytes``."""
    for path in paths:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            line = 0
            while True:
                raw = f.read(chunk_bytes)
                if not raw:
                    break
                raw += f.readline()  # end on a line boundary
                REPLACED.chunk = (str(path), line)
                yield raw
                line += raw.count(b"\n")


def prepare(inputs: Sequence[Path], out: Path, *, tokenizer: str) -> dict:
    """Writes ``out`` (token ids) and ``<out>.json``; returns the description.

    Raises:
        SystemExit: bad arguments.
    """
    if out.suffix != TOKEN_SUFFIX:
        sys.exit(f"--out ({out}) must end in {TOKEN_SUFFIX}: training reads data.path as token ids only then")
    encode, vocab_size = make_tokenizer(tokenizer)
    REPLACED.__init__()
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with atomic_open(out) as f:
        for raw in read_chunks(inputs):
            ids = np.asarray(encode(raw), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                sys.exit(f"tokenizer {tokenizer} produced id {int(ids.max())} outside its vocabulary of {vocab_size}")
            ids.astype(dtype).tofile(f)
            count += ids.size
    meta = {
        "format": 1,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "num_tokens": count,
        "tokenizer": tokenizer,
        "sources": [str(p) for p in inputs],
        "replaced_bytes": REPLACED.bytes,  # invalid UTF-8 a text tokenizer saw as U+FFFD
    }
    atomic_write(meta_path(out), (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def prepare_documents(inputs: Sequence[Path], out: Path, *, tokenizer: str) -> dict:
    """Writes ``out`` (the documents' ids back to back), ``<out>.docs.npy`` (each document's start, end and prompt
    tokens: what data.packing=documents packs and masks) and ``<out>.json``; returns the description.

    Raises:
        SystemExit: bad arguments, or a line that is not a document (naming the file and line).
    """
    if out.suffix != TOKEN_SUFFIX:
        sys.exit(f"--out ({out}) must end in {TOKEN_SUFFIX}: training reads data.path as token ids only then")
    encode, vocab_size = make_tokenizer(tokenizer)
    REPLACED.__init__()
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    try:
        parts = [tokenize_jsonl(path, encode) for path in inputs]
    except ConfigError as e:
        sys.exit(str(e))
    offsets = np.cumsum([0] + [len(p.tokens) for p in parts])
    index = np.concatenate([p.index + [o, o, 0] for p, o in zip(parts, offsets)])
    tokens = np.concatenate([p.tokens for p in parts])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        sys.exit(f"tokenizer {tokenizer} produced id {int(tokens.max())} outside its vocabulary of {vocab_size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out) as f:
        tokens.astype(dtype).tofile(f)
    with atomic_open(index_path(out)) as f:
        np.save(f, index.astype(np.int64))
    meta = {
        "format": 1,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "num_tokens": int(tokens.size),
        "num_documents": len(index),
        "tokenizer": tokenizer,
        "sources": [str(p) for p in inputs],
        "replaced_bytes": REPLACED.bytes,
    }
    atomic_write(meta_path(out), (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="text files (.txt or .gz), concatenated in order")
    parser.add_argument("--out", type=Path, required=True, help=f"token file to write ({TOKEN_SUFFIX})")
    parser.add_argument(
        "--tokenizer", default="bytes", help="bytes (default), tokenizers:<tokenizer.json> or tiktoken:<name>"
    )
    parser.add_argument(
        "--documents",
        action="store_true",
        help='inputs are JSONL documents ({"text"} or {"prompt", "response"}): also write <out>.docs.npy, the '
        "document index data.packing=documents reads",
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        sys.exit(f"not a file: {', '.join(missing)}")
    meta = (prepare_documents if args.documents else prepare)(args.inputs, args.out, tokenizer=args.tokenizer)
    if REPLACED.bytes:
        print(
            f"prepare_tokens.py: {REPLACED.bytes} bytes of invalid UTF-8 on {REPLACED.lines} "
            f"line{'s' if REPLACED.lines != 1 else ''} (the first: {REPLACED.first}) were tokenized as U+FFFD; "
            "convert the text to UTF-8 first (iconv -f <its encoding> -t utf-8), or use --tokenizer bytes, "
            "which keeps the bytes as they are",
            file=sys.stderr,
        )
    model = (
        f"model=hf model.pretrained={args.tokenizer[3:]}"
        if args.tokenizer.startswith("hf:")
        else f"model.vocab_size={meta['vocab_size']}"
    )
    docs = f", {meta['num_documents']} documents" if args.documents else ""
    print(
        f"{args.out}: {meta['num_tokens']} tokens ({meta['dtype']}){docs}, vocabulary {meta['vocab_size']}; train on "
        "it with\n"
        f"  data.path={args.out} data.token_dtype={meta['dtype']} {model}"
        + (" data.packing=documents" if args.documents else "")
    )


if __name__ == "__main__":
    main()
