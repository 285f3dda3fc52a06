"""Training data (byte-level text or memory-mapped token files), its checks, and the deterministic microbatch feed."""

from __future__ import annotations

import functools
import gzip
import json
import logging
import mmap
import os
import pickle
import time
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np
import torch

from pipedream2bw.config import DataConfig, require_file
from pipedream2bw.data import documents
from pipedream2bw.errors import ConfigError

log = logging.getLogger(__name__)

SHIPPED_CORPUS = Path(__file__).parent / "python_docs.txt.gz"
TOKEN_SUFFIX = ".bin"
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
BYTE_VOCAB = 256
TRAIN, VALIDATION = 0, 1  # MicrobatchFeed streams: the training draw and the fixed held-out windows
# The largest page-cache folio a fault may map whole (a PMD: 2 MiB with 4 KiB pages): what is
# unmapped around each window read, so that no pages stay in the process (see read_windows).
_DROP_BYTES = mmap.PAGESIZE * (mmap.PAGESIZE // 8)
_SCAN_TOKENS = 1 << 24  # tokens per chunk when checking a token file's ids (32 MiB of uint16: page-aligned)

Array = Union[np.ndarray, torch.Tensor]
WINDOWS, DOCUMENTS = "windows", "documents"  # data.packing


def is_token_file(path: Optional[str]) -> bool:
    """Whether ``path`` names a token file (``.bin``: a flat array of token ids) rather than text."""
    return path is not None and Path(path).suffix == TOKEN_SUFFIX


def meta_path(path: Union[str, Path]) -> Path:
    """The description ``scripts/prepare_tokens.py`` writes next to a token file: ``<file>.json``."""
    return Path(str(path) + ".json")


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers): no class or function is ever
    looked up, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: only plain data (dicts, strings, numbers) is read")


def describe_tokens(path: Union[str, Path]) -> Tuple[Dict[str, Any], Optional[Path]]:
    """What a token file's description says (``{}`` without one), and the file that says it:
    ``<file>.json`` (``scripts/prepare_tokens.py``: dtype, num_tokens, vocab_size), else nanoGPT's
    ``meta.pkl`` in the same directory (vocab_size; plain data only, read without running code).

    Raises:
        ConfigError: a description that cannot be read, naming it.
    """
    meta, nano = meta_path(path), Path(path).parent / "meta.pkl"
    try:
        if meta.is_file():
            described = json.loads(meta.read_text())
            source = meta
        elif nano.is_file():
            with open(nano, "rb") as f:
                described = _PlainUnpickler(f).load()
            source = nano
        else:
            return {}, None
    except (ValueError, pickle.UnpicklingError, EOFError) as e:
        raise ConfigError(
            f"{meta if meta.is_file() else nano} (the description of {path}) cannot be read: {e}; write it again "
            "with scripts/prepare_tokens.py, or delete it to train without its checks"
        ) from e
    if not isinstance(described, dict):
        raise ConfigError(f"{source} (the description of {path}) holds {type(described).__name__}, not a mapping")
    return described, source


def load_bytes(path: Optional[str] = None) -> torch.Tensor:
    """Reads a text file (plain or .gz) as a uint8 tensor of bytes; the shipped corpus by default.

    Raises:
        ConfigError: the file cannot be read (a corrupt or truncated .gz, no permission), naming it.
    """
    return torch.frombuffer(bytearray(read_text_bytes(path)), dtype=torch.uint8)


def read_text_bytes(path: Optional[str], key: str = "data.path") -> bytes:
    """The bytes of text file ``path`` (decompressed if .gz; the shipped corpus for None).

    Raises:
        ConfigError: the file cannot be read, naming it (as ``key``) and why: a .gz that is not gzip
            (``BadGzipFile``), corrupt (``zlib.error``) or cut short (``EOFError``), or an OSError.
    """
    p = Path(path) if path else SHIPPED_CORPUS  # config.validate checked that it exists
    try:
        return gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        what = "gzip-compressed text (.gz)" if p.suffix == ".gz" else "text"
        name = "zlib.error" if isinstance(e, zlib.error) else type(e).__name__
        raise ConfigError(
            f"{key} ({p}) cannot be read as {what}: {name}: {e}; point {key} at an intact file"
            + (" (gzip -t tests one; a .gz name is read as gzip)" if p.suffix == ".gz" else "")
        ) from e


AUTO_DTYPE = "auto"
"""``data.token_dtype=auto``: the dtype a token file's ``<file>.json`` names (prepare_tokens writes it), else uint16."""


def file_dtype(path: Union[str, Path], dtype: str) -> str:
    """The dtype of token file ``path``'s ids: ``dtype``, or for ``auto`` what its ``<file>.json`` says (uint16
    without one, or where it names no dtype this package reads)."""
    if dtype != AUTO_DTYPE:
        return dtype
    meta = meta_path(path)
    if meta.is_file():
        described, _ = describe_tokens(path)
        if described.get("dtype") in TOKEN_DTYPES:
            return described["dtype"]
    return "uint16"


def open_tokens(path: Union[str, Path], dtype: str) -> np.memmap:
    """A token file as a read-only ``np.memmap``: pages are read when a window touches them, never the whole file."""
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[file_dtype(path, dtype)], mode="r")
    # Windows are drawn at random: read only the pages a window touches, not the kernel's
    # read-around (up to 128 KiB per fault) that suits sequential reads.
    raw = getattr(tokens, "_mmap", None)
    if raw is not None and hasattr(mmap, "MADV_RANDOM"):
        raw.madvise(mmap.MADV_RANDOM)
    return tokens


def _open(path: Optional[str], dtype: str, key: str) -> np.ndarray:
    """One file's tokens as a 1-D array: a memmap of a token file, or the bytes of a text file (``key`` names it)."""
    if is_token_file(path):
        return open_tokens(path, dtype)
    return np.frombuffer(bytearray(read_text_bytes(path, key)), dtype=np.uint8)


def split_sizes(num_tokens: int, val_fraction: float) -> Tuple[int, int]:
    """(training, held-out) token counts when the last ``val_fraction`` of a file is held out."""
    num_val = int(num_tokens * val_fraction)
    return num_tokens - num_val, num_val


def load_splits(data: DataConfig) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """The training tokens and the held-out ones (None without ``data.val_fraction`` or ``data.val_path``).

    With ``val_fraction`` the held-out part is the file's tail: contiguous, so that no training
    window (drawn inside the training part) overlaps it. Token files stay memory-mapped.
    """
    tokens = _open(data.path, data.token_dtype, "data.path")
    if data.val_path is not None:
        return tokens, _open(data.val_path, data.token_dtype, "data.val_path")
    if data.val_fraction > 0:
        num_train, _ = split_sizes(len(tokens), data.val_fraction)
        return tokens[:num_train], tokens[num_train:]
    return tokens, None


def make_feeds(
    data: DataConfig,
    *,
    seq_len: int,
    microbatch_size: int,
    num_microbatches: int,
    seed: int,
    num_replicas: int,
    replica: int,
) -> Tuple["MicrobatchFeed", Optional["MicrobatchFeed"]]:
    """This replica's training feed and validation feed (None without held-out data); packed documents under
    ``data.packing=documents`` (``documents.DocumentFeed``), else windows."""
    kwargs = dict(
        seq_len=seq_len,
        microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
        seed=seed,
        num_replicas=num_replicas,
        replica=replica,
    )
    if data.packing == DOCUMENTS:
        opener = functools.partial(open_tokens, dtype=data.token_dtype)
        return documents.make_document_feeds(data.path, data.val_path, data.val_fraction, opener, **kwargs)
    train, val = load_splits(data)
    return MicrobatchFeed(train, **kwargs), None if val is None else MicrobatchFeed(val, stream=VALIDATION, **kwargs)


@dataclass(frozen=True)
class DataInfo:
    """What ``check_data`` found: the file's kind, its size in tokens and (token files) its largest id."""

    kind: str  # "text" (byte-level) or "tokens"
    num_tokens: int
    max_id: Optional[int] = None
    vocab_size: Optional[int] = None  # the data's vocabulary: 256 for text, else as described (or max_id + 1)
    vocab_source: str = ""  # what says so: a description file, 'byte-level text' or 'the largest id'


def check_data(
    data: DataConfig,
    *,
    vocab_size: Optional[int],
    seq_len: int,
    need_val: bool,
    vocab_from: str = "model.vocab_size",
) -> DataInfo:
    """Checks the data before any process group starts: every rank raises the same error.

    Token files: the size fits ``data.token_dtype``, the description (``describe_tokens``) agrees,
    and every id is below ``vocab_size`` (read in chunks, never the whole file at once), which
    must be known for them. Text: ``vocab_size`` covers bytes. Both: the training part and the
    held-out part each hold at least one window (``seq_len + 2``). A model vocabulary at least
    twice the data's is a warning: the head computes logits that no target uses. ``vocab_from``
    names where ``vocab_size`` comes from, for the messages.

    Raises:
        ConfigError: naming the file, what is wrong and the fix.
    """
    _check_settings(data, vocab_size=vocab_size, need_val=need_val)
    check = functools.partial(_check_file, dtype=data.token_dtype, vocab_size=vocab_size, vocab_from=vocab_from)
    if data.packing == DOCUMENTS:
        return _check_documents(data, check)
    info = check(data.path, "data.path")
    if vocab_size is not None and info.vocab_size is not None and vocab_size >= 2 * info.vocab_size:
        log.warning(
            "the model's vocabulary (%d) is %.0fx the data's (%d, from %s): its head computes logits for ids no "
            "target holds; set model.vocab_size=%d unless the model must keep its size (a pretrained head)",
            vocab_size,
            vocab_size / info.vocab_size,
            info.vocab_size,
            info.vocab_source,
            info.vocab_size,
        )
    window = seq_len + 2  # a window is seq_len + 1 tokens, drawn from starts [0, n - seq_len - 1)
    num_train, num_val = split_sizes(info.num_tokens, data.val_fraction)
    if data.val_path is not None:
        num_train, num_val = (
            info.num_tokens,
            check(data.val_path, "data.val_path").num_tokens,
        )
    unit = "bytes" if info.kind == "text" else "tokens"
    if num_train < window:
        held = f" after holding out data.val_fraction ({data.val_fraction})" if data.val_fraction else ""
        raise ConfigError(
            f"data.path ({data.path or SHIPPED_CORPUS}) has {num_train} {unit} to train on{held}, fewer than "
            f"model.seq_len + 2 ({window}); use more data or a shorter model.seq_len"
        )
    if (data.val_path is not None or data.val_fraction > 0) and num_val < window:
        where = (
            f"data.val_path ({data.val_path})"
            if data.val_path
            else f"data.val_fraction ({data.val_fraction}) of data.path"
        )
        raise ConfigError(
            f"{where} holds {num_val} {unit}, fewer than model.seq_len + 2 ({window}) for one validation window; "
            f"hold out more data"
        )
    return info


def _check_documents(data: DataConfig, check: Callable[[Optional[str], str], DataInfo]) -> DataInfo:
    """``check_data`` under data.packing=documents: each file a JSONL (byte-level) or a token file with its document
    index, and at least one document to train on and (with validation) one held out."""
    found = {}
    for key, path in (("data.path", data.path), ("data.val_path", data.val_path)):
        if key == "data.val_path" and path is None:
            continue
        if path is not None and not is_token_file(path) and Path(path).suffix != documents.DOCUMENTS_SUFFIX:
            raise ConfigError(
                f"{key} ({path}) is neither JSONL ({documents.DOCUMENTS_SUFFIX}) nor a token file ({TOKEN_SUFFIX}) "
                "with a document index, which data.packing=documents reads; write one with scripts/prepare_tokens.py "
                "--documents, or set data.packing=windows"
            )
        info = check(path if is_token_file(path) else path or str(documents.SHIPPED_DOCUMENTS), key)
        found[key] = (
            info,
            (
                documents.check_index(path, info.num_tokens, key)
                if is_token_file(path)
                else len(documents.tokenize_jsonl(path or documents.SHIPPED_DOCUMENTS))  # every line checked here
            ),
        )
    num_docs = found["data.path"][1]
    num_val = found["data.val_path"][1] if data.val_path is not None else int(num_docs * data.val_fraction)
    num_train = num_docs if data.val_path is not None else num_docs - num_val
    if num_train < 1 or ((data.val_path is not None or data.val_fraction > 0) and num_val < 1):
        raise ConfigError(
            f"data.path ({data.path or documents.SHIPPED_DOCUMENTS}) holds {num_docs} documents: {num_train} to train "
            f"on and {num_val} held out (data.val_fraction={data.val_fraction}, data.val_path={data.val_path}); each "
            "needs at least one: use more documents or another data.val_fraction"
        )
    return found["data.path"][0]


def _check_settings(data: DataConfig, *, vocab_size: Optional[int], need_val: bool) -> None:
    """``check_data``'s checks of the settings alone, before any file is read."""
    if data.token_dtype not in (AUTO_DTYPE, *TOKEN_DTYPES):
        raise ConfigError(
            f"data.token_dtype ({data.token_dtype!r}) is unknown; use one of {[AUTO_DTYPE, *TOKEN_DTYPES]}"
        )
    if not 0 <= data.val_fraction < 1:
        raise ConfigError(
            f"data.val_fraction ({data.val_fraction}) must be in [0, 1): the share of the data held out for validation"
        )
    if data.val_path is not None and data.val_fraction > 0:
        raise ConfigError(
            f"data.val_path ({data.val_path}) and data.val_fraction ({data.val_fraction}) both choose held-out data; "
            f"set data.val_fraction=0 to validate on data.val_path, or data.val_path=null"
        )
    if need_val and data.val_path is None and data.val_fraction == 0:
        raise ConfigError(
            "train.eval_every needs held-out data: set data.val_fraction (e.g. 0.05, the tail of data.path) "
            "or data.val_path, or train.eval_every=0"
        )
    if data.val_path is not None and is_token_file(data.val_path) != is_token_file(data.path):
        raise ConfigError(
            f"data.val_path ({data.val_path}) and data.path ({data.path or 'the shipped text'}) must be of one kind, "
            f"both token files ({TOKEN_SUFFIX}) or both text"
        )
    if vocab_size is None and (is_token_file(data.path) or is_token_file(data.val_path)):
        raise ConfigError(
            f"the model's vocabulary is unknown (no nn.Embedding in its first layer), so the ids of "
            f"{data.path or data.val_path} cannot be checked against it; set model.vocab_size to the vocabulary its "
            "first layer takes (the tokenizer's: scripts/prepare_tokens.py prints it and writes it in <file>.json)"
        )


def _check_file(path: Optional[str], key: str, *, dtype: str, vocab_size: Optional[int], vocab_from: str) -> DataInfo:
    require_file(path, key)
    if not is_token_file(path):
        if vocab_size is not None and vocab_size < BYTE_VOCAB:
            raise ConfigError(f"{vocab_from} ({vocab_size}) must be >= {BYTE_VOCAB} for byte-level text")
        p = Path(path) if path else SHIPPED_CORPUS
        num_bytes = len(read_text_bytes(path, key)) if p.suffix == ".gz" else p.stat().st_size
        return DataInfo("text", num_bytes, vocab_size=BYTE_VOCAB, vocab_source="byte-level text")
    dtype = file_dtype(path, dtype)
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = Path(path).stat().st_size
    if size % itemsize:
        raise ConfigError(
            f"{key} ({path}) has {size} bytes, not a multiple of {itemsize}: not a file of {dtype} token ids; "
            f"set data.token_dtype to the dtype it was written with, or write it again with scripts/prepare_tokens.py"
        )
    num_tokens = size // itemsize
    described, meta = describe_tokens(path)
    if meta is not None and meta.suffix == ".json":
        if described.get("dtype") != dtype:
            raise ConfigError(
                f"{key} ({path}) holds {described.get('dtype')} ids (says {meta}), but data.token_dtype is {dtype}; "
                f"set data.token_dtype={described.get('dtype')}"
            )
        if described.get("num_tokens") != num_tokens:
            raise ConfigError(
                f"{key} ({path}) holds {num_tokens} tokens but {meta} says {described.get('num_tokens')}: the file "
                f"changed since it was written; write it again with scripts/prepare_tokens.py or delete {meta}"
            )
    max_id, first_bad = (
        _scan_ids(Path(path), TOKEN_DTYPES[dtype], vocab_size=vocab_size)
        if num_tokens and vocab_size is not None
        else (None, None)
    )
    if first_bad is not None:
        raise ConfigError(
            f"{key} ({path}) holds token id {max_id} (first id >= {vocab_size} at position {first_bad}), but "
            f"{vocab_from} is {vocab_size}: the data's vocabulary does not fit the model's; "
            + (
                f"set model.vocab_size={max_id + 1} or more"
                if vocab_from == "model.vocab_size"
                else f"build the model's embedding and head for {max_id + 1} or more ids"
            )
            + " (the tokenizer's vocabulary size), or check data.token_dtype"
        )
    if isinstance(described.get("vocab_size"), int) and described["vocab_size"] > 0:
        return DataInfo("tokens", num_tokens, max_id, vocab_size=described["vocab_size"], vocab_source=str(meta))
    return DataInfo(
        "tokens", num_tokens, max_id, vocab_size=None if max_id is None else max_id + 1, vocab_source="the largest id"
    )


_SCANNED: Dict[Tuple[Any, ...], Tuple[int, Optional[int]]] = {}
"""_scan_ids' answers in this process, by (path, size, mtime, dtype, vocab_size): the entry point's check at start
(``precheck``) and the runner's validation read a file once between them."""


def _scan_ids(path: Path, dtype: type, *, vocab_size: int) -> Tuple[int, Optional[int]]:
    """(largest id, position of the first id >= ``vocab_size`` or None), ``_SCAN_TOKENS`` at a time
    through a mapping whose pages are dropped after each chunk: this process never holds the file.
    Remembered for the file as it is (``_SCANNED``)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, np.dtype(dtype).str, vocab_size)
    if key not in _SCANNED:
        _SCANNED[key] = _scan(path, dtype, vocab_size=vocab_size)
    return _SCANNED[key]


def _scan(path: Path, dtype: type, *, vocab_size: int) -> Tuple[int, Optional[int]]:
    start, max_id, first_bad = time.perf_counter(), -1, None
    tokens = np.memmap(path, dtype=dtype, mode="r")
    raw = getattr(tokens, "_mmap", None)
    for offset in range(0, len(tokens), _SCAN_TOKENS):
        chunk = tokens[offset : offset + _SCAN_TOKENS]
        top = int(chunk.max())
        if top >= vocab_size and first_bad is None:
            first_bad = offset + int(np.argmax(chunk >= vocab_size))
        max_id = max(max_id, top)
        if raw is not None and hasattr(mmap, "MADV_DONTNEED"):  # the pages stay in the page cache, not in our RSS
            raw.madvise(mmap.MADV_DONTNEED, offset * tokens.itemsize, chunk.nbytes)
    del chunk, tokens
    log.debug("checked the ids of %s in %.2f s", path, time.perf_counter() - start)
    return max_id, first_bad


class DataFileChanged(RuntimeError):
    """A token file changed under a running feed (shrank, or was removed)."""


class MicrobatchFeed:
    """Microbatch ``k`` of one replica as (inputs, targets), both (b, T) int64, the same on every rank.

    Batch ``t`` draws ``w * m * b`` random windows from a generator seeded by ``(seed, stream, t)``,
    so every rank computes the same batch order without sending batches around: the first stage
    asks for inputs, the last for targets. Replica ``r`` takes windows ``r*m*b .. (r+1)*m*b - 1``:
    the replicas' microbatches are disjoint and together make the global batch, whatever
    ``w``. Targets are the inputs shifted by one token. ``data`` is a 1-D array of token ids (a
    memmap of a token file: only the windows drawn are read) or a tensor of text bytes.
    ``stream`` VALIDATION draws other windows than TRAIN for the same batch index.
    """

    def __init__(
        self,
        data: Array,
        *,
        seq_len: int,
        microbatch_size: int,
        num_microbatches: int,
        seed: int,
        num_replicas: int = 1,
        replica: int = 0,
        stream: int = TRAIN,
    ):
        if len(data) < seq_len + 2:
            raise ConfigError(f"the data has {len(data)} tokens, fewer than model.seq_len + 2 ({seq_len + 2})")
        self.data = data.numpy() if isinstance(data, torch.Tensor) else data
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self.num_microbatches = num_microbatches
        self.seed, self.stream = seed, stream
        self.num_replicas, self.replica = num_replicas, replica
        self._windows = lru_cache(maxsize=4)(self._batch_windows)
        # a token file's mapping: its file and size as mapped, checked before each batch's reads (check_unchanged)
        raw = getattr(self.data, "_mmap", None)
        self._file = getattr(self.data, "filename", None) if raw is not None else None
        self._mapped_bytes = len(raw) if raw is not None else 0

    def starts(self, batch_index: int) -> torch.Tensor:
        """Where the ``w * m * b`` windows of batch ``batch_index`` start in ``data``, replica 0's first."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_index + (self.stream << 40))
        global_batch = self.num_replicas * self.num_microbatches * self.microbatch_size
        return torch.randint(0, len(self.data) - self.seq_len - 1, (global_batch,), generator=gen)

    def check_unchanged(self, batch_index: int) -> None:
        """Refuses to read a token file that shrank since it was mapped: a read past its new end would kill the
        process with SIGBUS, naming nothing (issue 34). One ``stat`` per batch; a file cut between this check
        and the reads still ends in SIGBUS.

        Raises:
            DataFileChanged: naming the file and both sizes.
        """
        if self._file is None:
            return
        try:
            now = os.stat(self._file).st_size
        except OSError as e:
            raise DataFileChanged(
                f"token file {self._file} cannot be read any more at batch {batch_index} ({e.strerror or e}): it was "
                "removed or replaced while the run reads it"
            ) from e
        if now < self._mapped_bytes:
            raise DataFileChanged(
                f"token file {self._file} shrank while the run reads it: {now} bytes now, {self._mapped_bytes} when "
                f"the run opened it (batch {batch_index}); a run's data must not change under it: write new data to "
                "another file and point data.path at it"
            )

    def _batch_windows(self, batch_index: int) -> torch.Tensor:
        # (w*m*b, T+1)
        self.check_unchanged(batch_index)
        return torch.from_numpy(read_windows(self.data, self.starts(batch_index).numpy(), self.seq_len + 1))

    def _window(self, mb_index: int) -> torch.Tensor:
        batch_index, j = divmod(mb_index, self.num_microbatches)
        b, first = self.microbatch_size, (self.replica * self.num_microbatches + j) * self.microbatch_size
        return self._windows(batch_index)[first : first + b]

    def inputs(self, mb_index: int) -> torch.Tensor:
        return self._window(mb_index)[:, :-1]

    def targets(self, mb_index: int) -> torch.Tensor:
        return self._window(mb_index)[:, 1:]

    def microbatch(self, mb_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        w = self._window(mb_index)
        return w[:, :-1], w[:, 1:]


def read_windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """``data[s : s + length]`` for each start ``s``, as a (len(starts), length) int64 array.

    From a memmap, each window is copied and its pages unmapped at once (MADV_DONTNEED; they stay
    in the page cache): a fault may map a whole large folio of the page cache, megabytes around a
    window of a few hundred bytes, and pages left mapped would count in this process's memory and
    grow with every batch. So the process holds no pages of the file between reads, whatever its size.
    """
    raw = getattr(data, "_mmap", None)
    if raw is None or not hasattr(mmap, "MADV_DONTNEED"):
        return np.asarray(data[starts[:, None] + np.arange(length)], dtype=np.int64)
    out = np.empty((len(starts), length), dtype=np.int64)
    offset = data.ctypes.data - np.frombuffer(raw, dtype=np.uint8, count=1).ctypes.data  # data[0] in the mapping
    for i, start in enumerate(starts.tolist()):
        out[i] = data[start : start + length]
        lo = (offset + start * data.itemsize) // _DROP_BYTES * _DROP_BYTES
        hi = min(-(-(offset + (start + length) * data.itemsize) // _DROP_BYTES) * _DROP_BYTES, len(raw))
        raw.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return out


def mapped_resident_bytes(array: np.ndarray) -> Optional[int]:
    """Bytes of ``array``'s file mapping resident in this process (``Rss`` in /proc/self/smaps):
    the pages reads have touched. None when ``array`` is not a memmap or smaps is unavailable."""
    raw = getattr(array, "_mmap", None)
    if raw is None:
        return None
    address = np.asarray(array).__array_interface__["data"][0]
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's header: "start-end perms offset dev inode path"
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    return None


def data_resident_bytes(*feeds: Optional[MicrobatchFeed]) -> Optional[int]:
    """Resident bytes of the token-file mappings behind ``feeds`` (each mapping once); None if none is a memmap."""
    sizes = {}
    for feed in feeds:
        raw = getattr(feed.data, "_mmap", None) if feed is not None else None
        if raw is not None:
            sizes[id(raw)] = mapped_resident_bytes(feed.data)
    return None if not sizes or None in sizes.values() else sum(sizes.values())


def fingerprint(path: Optional[str], *, edge_bytes: int = 1 << 16, key: str = "data.path") -> str:
    """What a checkpoint records of its training data, to tell other data on resume: the file's name, size
    and a SHA-256 of its first and last ``edge_bytes`` (a file replaced or grown between save and resume was
    accepted unnoticed; issue 34); 'shipped text' for the default.

    Raises:
        ConfigError: the file cannot be read, naming it.
    """
    import hashlib

    if path is None:
        return "shipped text"
    file = Path(path)
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.sha256(f.read(edge_bytes))
            f.seek(max(size - edge_bytes, 0))
            digest.update(f.read(edge_bytes))
    except OSError as e:
        raise ConfigError(f"{key} ({path}) cannot be read ({e.strerror or e}); point it at a readable file") from e
    return f"{file.name}, {size} bytes, sha256 of its ends {digest.hexdigest()[:16]}"
