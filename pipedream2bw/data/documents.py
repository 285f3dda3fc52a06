"""Packed documents (``data.packing=documents``): JSONL or a token file with a document index, packed whole into
rows of ``model.seq_len`` tokens by a deterministic packer, fed as (ids, positions) and (targets, loss weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from pipedream2bw.errors import ConfigError

DOCUMENTS_SUFFIX = ".jsonl"
INDEX_SUFFIX = ".docs.npy"
"""``<token file>.docs.npy``: the document index ``scripts/prepare_tokens.py --documents`` writes beside its tokens."""
SHIPPED_DOCUMENTS = Path(__file__).parent / "python_docs_qa.jsonl"
"""The shipped example documents (``data.packing=documents`` without ``data.path``)."""
PAD_ID = 0  # the id padding slots hold; their targets weigh nothing and their positions start a document of their own


def index_path(path: Union[str, Path]) -> Path:
    """A document token file's index: ``<file>.docs.npy``, int64 (num_documents, 3): start, end, prompt tokens."""
    return Path(str(path) + INDEX_SUFFIX)


@dataclass(frozen=True)
class Documents:
    """Documents as one flat id array and an index: document i is ``tokens[start:end]`` (``index[i]`` = start,
    end, prompt tokens), whose first ``prompt`` tokens are never a target of the loss."""

    tokens: np.ndarray  # 1-D ids (a memmap for a token file)
    index: np.ndarray  # (num_documents, 3) int64

    def __len__(self) -> int:
        return len(self.index)

    def split(self, val_fraction: float) -> Tuple["Documents", Optional["Documents"]]:
        """(training, held-out): the last ``val_fraction`` of the documents (by count) held out, None without."""
        num_val = int(len(self) * val_fraction)
        if num_val == 0:
            return self, None
        cut = len(self) - num_val
        return Documents(self.tokens, self.index[:cut]), Documents(self.tokens, self.index[cut:])


def parse_line(record: object, where: str) -> Tuple[str, str]:
    """(prompt, text after it) of one JSONL record: ``{"text": ...}`` or ``{"prompt": ..., "response": ...}``.

    Raises:
        ConfigError: any other record, naming ``where`` (file and line).
    """
    if isinstance(record, dict) and isinstance(record.get("text"), str) and "prompt" not in record:
        return "", record["text"]
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return record["prompt"], record["response"]
    raise ConfigError(
        f'{where} is not {{"text": str}} or {{"prompt": str, "response": str}}; write one JSON object of either '
        "kind per line"
    )


def tokenize_jsonl(
    path: Union[str, Path], encode: Callable[[bytes], Sequence[int]] = lambda raw: np.frombuffer(raw, np.uint8)
) -> Documents:
    """The documents of a JSONL file, tokenized by ``encode`` (UTF-8 bytes -> ids; byte-level by default): a
    prompt's tokens first, masked from the loss. Empty lines are skipped.

    Raises:
        ConfigError: a line that is not JSON or not a document, naming the file and line.
    """
    pieces: List[np.ndarray] = []
    index: List[Tuple[int, int, int]] = []
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{where} is not JSON ({e}); one JSON object per line") from e
            prompt, response = parse_line(record, where)
            head = np.asarray(encode(prompt.encode()), dtype=np.int64)
            tail = np.asarray(encode(response.encode()), dtype=np.int64)
            pieces += [head, tail]
            index.append((offset, offset + len(head) + len(tail), len(head)))
            offset += len(head) + len(tail)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return Documents(tokens, np.asarray(index, dtype=np.int64).reshape(-1, 3))


def load_documents(path: Optional[str], open_tokens: Callable[[str], np.ndarray]) -> Documents:
    """A JSONL file (byte-level, tokenized here; the shipped example for None) or a token file with its
    ``.docs.npy`` index, its tokens opened by ``open_tokens`` (memory-mapped)."""
    if path is None or Path(path).suffix == DOCUMENTS_SUFFIX:
        return tokenize_jsonl(path or SHIPPED_DOCUMENTS)
    return Documents(open_tokens(path), np.load(index_path(path)))


def check_index(path: str, num_tokens: int, key: str) -> int:
    """The number of documents a token file's index describes, after checking it against the file's tokens.

    Raises:
        ConfigError: no index, or one that is not (n, 3) int64 rows of 0 <= start <= start + prompt <= end <=
            num_tokens, naming the file and the fix.
    """
    index = index_path(path)
    fix = f"write it again with scripts/prepare_tokens.py --documents, or give {key} a {DOCUMENTS_SUFFIX} file"
    if not index.is_file():
        raise ConfigError(f"{key} ({path}) has no document index {index} (data.packing=documents); {fix}")
    try:
        rows = np.load(index, mmap_mode="r")
    except ValueError as e:
        raise ConfigError(f"{index} (the document index of {key}) cannot be read: {e}; {fix}") from e
    ok = rows.ndim == 2 and rows.shape[1] == 3 and rows.dtype == np.int64
    if ok and len(rows):
        start, end, prompt = rows[:, 0], rows[:, 1], rows[:, 2]
        ok = bool(np.all((start >= 0) & (prompt >= 0) & (start + prompt <= end) & (end <= num_tokens)))
    if not ok:
        raise ConfigError(f"{index} is not a document index of {key} ({num_tokens} tokens); {fix}")
    return len(rows)


# --- the packer --------------------------------------------------------------------------------------------------


def pack(lengths: np.ndarray, order: np.ndarray, seq_len: int) -> np.ndarray:
    """Greedy packing of documents ``order`` (their ``lengths``) into rows of ``seq_len`` slots, in that order:
    a document goes whole into the current row if it fits, else it starts the next row; one longer than
    ``seq_len`` is split into pieces of ``seq_len`` (the last shorter), each a document of its own.

    Returns:
        (num_pieces, 4) int64: row, document, offset in the document, length; rows numbered from 0.
    """
    out = []
    row, fill = 0, 0
    for doc in order.tolist():
        length = int(lengths[doc])
        for offset in range(0, max(length, 1), seq_len):
            piece = min(seq_len, length - offset)
            if fill + piece > seq_len:
                row, fill = row + 1, 0
            out.append((row, doc, offset, piece))
            fill += piece
    return np.asarray(out, dtype=np.int64).reshape(-1, 4)


class DocumentFeed:
    """Microbatch ``k`` of one replica: inputs (ids, positions) and targets (ids, loss weights), each (b, T).

    Epoch e visits every document once, in an order drawn from ``(seed, e)`` (held-out documents: file order),
    packed by ``pack``; the epochs' rows follow each other, and batch t is rows ``t*B .. (t+1)*B - 1`` of that
    sequence (``B = w * m * b``): the same rows whatever the layout, from the batch index alone (a resumed run
    reads on where it stopped). Replica r takes rows ``r*m*b ..``, as the window feed does. A slot past a row's
    last document is padding: id 0, a target that weighs 0, positions counting from 0 (a document of its own,
    which no real token attends to). The positions restart at 0 with each document (or piece of one). A target is
    the next token of the same document; a document's last token, and every token whose next one is in the
    prompt, predicts nothing (weight 0). Every other target weighs ``w * m / N``, N the number of such targets in
    the whole global batch: the microbatch losses, averaged over the w * m microbatches as the pipeline averages
    them, make the mean over the batch's unmasked tokens.
    """

    def __init__(
        self,
        docs: Documents,
        *,
        seq_len: int,
        microbatch_size: int,
        num_microbatches: int,
        seed: int,
        num_replicas: int = 1,
        replica: int = 0,
        shuffle: bool = True,
    ):
        if len(docs) == 0:
            raise ConfigError("the data holds no documents; data.packing=documents needs at least one")
        self.docs, self.data = docs, docs.tokens  # ``data``: the token array (its mapping, its size, for the logs)
        self.seq_len, self.microbatch_size, self.num_microbatches = seq_len, microbatch_size, num_microbatches
        self.seed, self.shuffle = seed, shuffle
        self.num_replicas, self.replica = num_replicas, replica
        self._lengths = docs.index[:, 1] - docs.index[:, 0]
        self._rows_before: List[int] = [0]  # rows of the epochs before epoch e, e = 0, 1, ... as far as packed
        self._epoch = lru_cache(maxsize=4)(self._pack_epoch)
        self._batch = lru_cache(maxsize=4)(self._make_batch)

    def _pack_epoch(self, epoch: int) -> np.ndarray:
        n = len(self.docs)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return pack(self._lengths, order, self.seq_len)

    def _locate(self, row: int) -> Tuple[int, int]:
        """(epoch, row within it) of global row ``row``, packing the epochs before it once (their row counts)."""
        while self._rows_before[-1] <= row:
            epoch = len(self._rows_before) - 1
            self._rows_before.append(self._rows_before[-1] + int(self._epoch(epoch)[-1, 0]) + 1)
        epoch = int(np.searchsorted(self._rows_before, row, side="right")) - 1
        return epoch, row - self._rows_before[epoch]

    def rows(self, first: int, count: int) -> Tuple[np.ndarray, ...]:
        """Global rows ``first .. first + count - 1`` as (ids, positions, targets, masked) (count, T) arrays."""
        T = self.seq_len
        ids, targets = np.full((count, T), PAD_ID, np.int64), np.full((count, T), PAD_ID, np.int64)
        positions, keep = np.zeros((count, T), np.int64), np.zeros((count, T), bool)
        for i in range(count):
            epoch, row = self._locate(first + i)
            pieces = self._epoch(epoch)
            fill = 0
            lo, hi = np.searchsorted(pieces[:, 0], [row, row + 1])  # pieces are in row order
            for _, doc, offset, length in pieces[lo:hi].tolist():
                start, end, prompt = self.docs.index[doc].tolist()
                span = np.asarray(self.docs.tokens[start + offset : min(start + offset + length + 1, end)])
                ids[i, fill : fill + length] = span[:length]
                targets[i, fill : fill + len(span) - 1] = span[1:]
                q = offset + 1 + np.arange(length)  # the document position of each slot's target
                keep[i, fill : fill + length] = (q < end - start) & (q >= prompt)
                positions[i, fill : fill + length] = np.arange(length)
                fill += length
            positions[i, fill:] = np.arange(T - fill)  # padding: a document of its own
        return ids, positions, targets, keep

    def real_tokens(self, first: int, count: int) -> int:
        """Document tokens (not padding) in global rows ``first .. first + count - 1``."""
        total = 0
        for row in range(first, first + count):
            epoch, within = self._locate(row)
            pieces = self._epoch(epoch)
            lo, hi = np.searchsorted(pieces[:, 0], [within, within + 1])
            total += int(pieces[lo:hi, 3].sum())
        return total

    def _make_batch(self, batch_index: int) -> Tuple[torch.Tensor, ...]:
        B = self.num_replicas * self.num_microbatches * self.microbatch_size
        ids, positions, targets, keep = self.rows(batch_index * B, B)
        count = int(keep.sum())
        scale = self.num_replicas * self.num_microbatches / count if count else 0.0
        weights = torch.from_numpy(keep).to(torch.float32) * scale
        return tuple(torch.from_numpy(a) for a in (ids, positions, targets)) + (weights,)

    def _slice(self, mb_index: int) -> Tuple[torch.Tensor, ...]:
        batch_index, j = divmod(mb_index, self.num_microbatches)
        b, first = self.microbatch_size, (self.replica * self.num_microbatches + j) * self.microbatch_size
        return tuple(a[first : first + b] for a in self._batch(batch_index))

    def inputs(self, mb_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        ids, positions, _, _ = self._slice(mb_index)
        return ids, positions

    def targets(self, mb_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        _, _, targets, weights = self._slice(mb_index)
        return targets, weights

    def microbatch(self, mb_index: int) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
        return self.inputs(mb_index), self.targets(mb_index)


def make_document_feeds(
    path: Optional[str],
    val_path: Optional[str],
    val_fraction: float,
    open_tokens: Callable[[str], np.ndarray],
    **kwargs,
) -> Tuple[DocumentFeed, Optional[DocumentFeed]]:
    """The training feed and the held-out one (None without ``val_path`` or ``val_fraction``): the last
    ``val_fraction`` of the documents, or those of ``val_path``, in file order. ``kwargs``: ``DocumentFeed``'s."""
    train, val = load_documents(path, open_tokens).split(val_fraction)
    if val_path is not None:
        val = load_documents(val_path, open_tokens)
    return DocumentFeed(train, **kwargs), None if val is None else DocumentFeed(val, shuffle=False, **kwargs)
