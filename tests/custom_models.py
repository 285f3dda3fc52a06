"""Layer-list factories a user would write, for the tests (found by import path: model._target_=custom_models...)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn


class Embed(nn.Module):
    """ids (B, T) -> (hidden (B, T, W), ids): a boundary of a float and an integer tensor."""

    def __init__(self, width: int):
        super().__init__()
        self.tok = nn.Embedding(256, width)

    def forward(self, ids):
        return self.tok(ids), ids


class Gate(nn.Module):
    """(h, ids) -> {"h", "skip", "ids"}: a dict with two float tensors, both needing gradients back."""

    def __init__(self, width: int):
        super().__init__()
        self.lin, self.gate = nn.Linear(width, width), nn.Embedding(256, width)

    def forward(self, x):
        h, ids = x
        return {"h": h + torch.tanh(self.lin(h)) * self.gate(ids), "skip": h * 0.5, "ids": ids}


class Mix(nn.Module):
    """{"h", "skip", "ids"} -> (h, ids)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(torch.nn.functional.gelu(x["h"])) + x["skip"], x["ids"]


class Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln = nn.LayerNorm(width)

    def forward(self, x):
        return self.ln(x[0]), x[1]


class Head(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.out = nn.Linear(width, 256)

    def forward(self, x):
        return self.out(x[0])


def tuple_layers(*, width: int, seed: int, indices: Optional[Sequence[int]] = None) -> List[nn.Module]:
    """[Embed, Gate, Mix, Norm, Head]: every boundary carries two or three tensors. Builds only
    ``indices`` (each layer seeded by its index), as the GPT does."""
    kinds = [Embed, Gate, Mix, Norm, Head]
    out = []
    for i in range(len(kinds)) if indices is None else indices:
        torch.manual_seed(seed * 1000 + i)
        out.append(kinds[i](width))
    return out


def all_layers_whatever_the_indices(*, width: int = 4, indices: Optional[Sequence[int]] = None) -> List[nn.Module]:
    """Takes ``indices`` and ignores them: the whole list every time (a mistake, for the tests)."""
    return tuple_layers(width=width, seed=0)


def first_layers_whatever_the_indices(*, width: int = 4, indices: Optional[Sequence[int]] = None) -> List[nn.Module]:
    """As many layers as ``indices`` holds, but the list's first ones (a mistake, for the tests)."""
    whole = tuple_layers(width=width, seed=0)
    return whole if indices is None else whole[: len(indices)]


def not_a_list(*, width: int = 4):
    return nn.Linear(width, width)


class _Shared(nn.Module):
    def __init__(self, buf: torch.Tensor):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", buf)

    def forward(self, x):
        return self.lin(x) * self.scale


def shared_buffer_layers() -> List[nn.Module]:
    """Two layers sharing one buffer: not something stages can keep in step."""
    buf = torch.ones(4)
    return [nn.Embedding(256, 4), _Shared(buf), _Shared(buf), nn.Linear(4, 256)]


class MaskedEmbed(nn.Module):
    """ids (B, T) -> (hidden (B, T, W), attention_mask (B, T) int64): a tuple boundary with an integer mask
    (0 where the id is a multiple of 4, as padding would be)."""

    def __init__(self, width: int):
        super().__init__()
        self.tok = nn.Embedding(256, width)

    def forward(self, ids):
        return self.tok(ids), (ids % 4 != 0).long()


class MaskedMix(nn.Module):
    """(h, mask) -> (h + the causal mean of tanh(lin(h)) over the unmasked positions so far, mask)."""

    def __init__(self, width: int, dropout: float = 0.0):
        super().__init__()
        self.lin, self.drop = nn.Linear(width, width), nn.Dropout(dropout)

    def forward(self, x):
        h, mask = x
        keep = mask.unsqueeze(-1).float()  # (B, T, 1)
        v = self.drop(torch.tanh(self.lin(h))).float() * keep
        return h + v.cumsum(1) / keep.cumsum(1).clamp(min=1.0), mask


def masked_layers(*, width: int, tie: bool = False, dropout: float = 0.0) -> List[nn.Module]:
    """[MaskedEmbed, MaskedMix, MaskedMix, Norm, Head]: every boundary is (hidden, integer mask), as a
    BERT-style encoder passes (hidden_states, attention_mask). ``tie``: the head's weight is the
    embedding's (a weight tied across the first and last stage); ``dropout``: each mixing layer's. A
    whole-list factory."""
    layers = [MaskedEmbed(width), MaskedMix(width, dropout), MaskedMix(width, dropout), Norm(width), Head(width)]
    if tie:
        layers[-1].out.weight = layers[0].tok.weight
    return layers


class DropBlock(nn.Module):
    """(h, ids) -> (h + dropout(tanh(lin(h))), ids): draws a mask in every training forward."""

    def __init__(self, width: int, p: float):
        super().__init__()
        self.lin, self.drop = nn.Linear(width, width), nn.Dropout(p)

    def forward(self, x):
        h, ids = x
        return h + self.drop(torch.tanh(self.lin(h))), ids


class NormBlock(nn.Module):
    """(h, ids) -> (h + BatchNorm over the features of every position, ids): running statistics change in training."""

    def __init__(self, width: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        h, ids = x  # (B, T, W)
        return h + self.bn(h.transpose(1, 2)).transpose(1, 2), ids


def stateful_layers(
    *, width: int, seed: int, p: float = 0.1, indices: Optional[Sequence[int]] = None
) -> List[nn.Module]:
    """[Embed, DropBlock, NormBlock, DropBlock, Norm, Head]: dropout on both sides of a BatchNorm (a layer with
    state besides its parameters). Builds only ``indices``, each layer seeded by its index."""
    kinds = [Embed, lambda w: DropBlock(w, p), NormBlock, lambda w: DropBlock(w, p), Norm, Head]
    out = []
    for i in range(len(kinds)) if indices is None else indices:
        torch.manual_seed(seed * 1000 + i)
        out.append(kinds[i](width))
    return out


class Resize(nn.Module):
    """(h (B, T, W_in), ids) -> (h' (B, T, W_out), ids): a boundary whose width changes along the model."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)

    def forward(self, x):
        return torch.tanh(self.lin(x[0])), x[1]


def widening_layers(*, width: int, seed: int = 0) -> List[nn.Module]:
    """[Embed, Resize W->2W, Resize 2W->2W, Resize 2W->W, Norm, Head]: under zbv at d=2 with pipeline.balance
    [1, 1, 1, 3], rank 0 sends width W to rank 1 and receives width 2W back on the same tags."""
    torch.manual_seed(seed)
    return [Embed(width), Resize(width, 2 * width), Resize(2 * width, 2 * width), Resize(2 * width, width)] + [
        Norm(width),
        Head(width),
    ]
