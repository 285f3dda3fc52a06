"""A byte-level model as a layer list: ``model=custom model._target_=examples.my_pkg.model.build_layers``.

``[embedding, num_blocks residual MLP blocks, final norm, head]``: each entry is one layer the pipeline
can place on any stage; the first takes ``(b, seq_len)`` byte ids, the last returns ``(b, seq_len, 256)``
logits for the default next-token cross-entropy.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

VOCAB = 256  # bytes


class Embed(nn.Module):
    def __init__(self, width: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    """A residual MLP over each position, with a causal running mean so that a position sees its past."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        past = h.cumsum(dim=1) / steps  # the mean of positions 0..t: no look-ahead
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(past))))


def build_layers(
    width: int, seq_len: int, num_blocks: int = 4, seed: int = 0, indices: Optional[Sequence[int]] = None
) -> List[nn.Module]:
    """The model's layers, or only those at ``indices`` (each rank builds its own stage's).

    Each layer is seeded by its index, so every partition of the list starts from the same weights.
    """
    makers = [
        lambda: Embed(width, seq_len),
        *[lambda: Block(width) for _ in range(num_blocks)],
        lambda: nn.LayerNorm(width),
        lambda: nn.Linear(width, VOCAB),
    ]
    layers = []
    for i in range(len(makers)) if indices is None else indices:
        torch.manual_seed(seed * 1_000_003 + i)
        layers.append(makers[i]())
    return layers
