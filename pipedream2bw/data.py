"""Byte-level text and the deterministic microbatch feed of the first and last stages."""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

import torch

from pipedream2bw.config import ConfigError

SHIPPED_CORPUS = Path(__file__).parent / "data" / "python_docs.txt.gz"


def load_bytes(path: Optional[str] = None) -> torch.Tensor:
    """Reads a text file (plain or .gz) as a uint8 tensor of bytes; the shipped corpus by default."""
    p = Path(path) if path else SHIPPED_CORPUS  # config.validate checked that it exists
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class MicrobatchFeed:
    """Microbatch ``k`` of one replica as (inputs, targets), both (b, T) int64, the same on every rank.

    Batch ``t`` draws ``w * m * b`` random windows from a generator seeded by ``(seed, t)``, so
    every rank computes the same batch order without sending batches around: the first stage
    asks for inputs, the last for targets. Replica ``r`` takes windows ``r*m*b .. (r+1)*m*b - 1``:
    the replicas' microbatches are disjoint and together make the global batch, whatever
    ``w``. Targets are the inputs shifted by one byte.
    """

    def __init__(
        self, data: torch.Tensor, *, seq_len: int, microbatch_size: int, num_microbatches: int, seed: int,
        num_replicas: int = 1, replica: int = 0,
    ):
        if data.numel() < seq_len + 2:
            raise ConfigError(f"the text has {data.numel()} bytes, fewer than model.seq_len + 2 ({seq_len + 2})")
        self.data = data
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self.num_microbatches = num_microbatches
        self.seed = seed
        self.num_replicas, self.replica = num_replicas, replica
        self._windows = lru_cache(maxsize=4)(self._batch_windows)

    def _batch_windows(self, batch_index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_index)
        global_batch = self.num_replicas * self.num_microbatches * self.microbatch_size
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (global_batch,), generator=gen)
        offsets = torch.arange(self.seq_len + 1)
        return self.data[starts[:, None] + offsets].long()  # (w*m*b, T+1)

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
