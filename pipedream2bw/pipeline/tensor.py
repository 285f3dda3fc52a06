"""Tensor parallelism's wire: the two regions of a split layer (Megatron's f and g) and whole tensors <-> shards.

A stage's t ranks (its tensor group) hold 1/t of each split parameter. A column-split matrix (rows of its
output) takes a replicated input through ``copy_to`` (identity forward, all-reduce of the input's gradient
in backward); a row-split matrix's partial outputs are summed by ``reduce_from`` (all-reduce forward,
identity backward). A split is ``(dim, chunks)``: the parameter's ``dim`` is ``chunks`` equal blocks (qkv's
q, k and v: 3), each divided in t, and tensor rank k holds piece k of every block.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

Split = Tuple[int, int]
"""(dim, chunks): how a parameter is divided among a tensor group (module docstring)."""


class SharedGroup:
    """A tensor group held by a split layer, shared (not copied) by the deep copies that hold the 2bw weight
    versions."""

    def __init__(self, group: Any):
        self.group = group

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SharedGroup":
        return self


def _all_reduce_float32(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``, a new tensor in ``x``'s dtype, added in float32: under bf16 autocast the
    unsplit matrix product that the ranks' partial products replace sums in float32 and rounds once (to within a
    rounding of each partial, the single-process reference's value)."""
    out = x.to(torch.float32, copy=True).contiguous()  # (B, T, C): a float32 copy, whatever x's dtype
    dist.all_reduce(out, group=group)
    return out.to(x.dtype)


class _CopyTo(torch.autograd.Function):
    """f: the replicated input enters the split region; its gradient is the sum of every rank's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_float32(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    """g: the ranks' partial outputs summed into the replicated output; its gradient goes to each unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce_float32(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ColumnLinear(torch.autograd.Function):
    """A column-split ``F.linear`` of a replicated input (f and the product in one): its input's gradient is each
    rank's partial product kept in float32, summed over the group and rounded once to the input's dtype, as the
    unsplit product's (under bf16, rounding each partial first would leave the reference by a rounding per rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.float() @ weight.float()  # (..., C): this rank's part, in float32
        dist.all_reduce(grad_x, group=ctx.group)
        grad_w = grad.flatten(0, -2).t() @ x.flatten(0, -2).to(grad.dtype)  # (V/t, C), as autograd's mm
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def column_linear(x: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
    """``F.linear(x, weight)`` of a column-split ``weight`` (this rank's output rows) on a replicated ``x``, in
    autocast's dtype where it is on; the input's gradient summed over ``group`` (``_ColumnLinear``)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    return _ColumnLinear.apply(x, weight, group)


def copy_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` (replicated over ``group``) as the input of column-split layers."""
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over ``group`` of the row-split layers' partial outputs ``x``."""
    return _ReduceFrom.apply(x, group)


def shard(whole: torch.Tensor, split: Split, *, rank: int, size: int) -> torch.Tensor:
    """Tensor rank ``rank``'s piece (of ``size``) of ``whole``, a copy."""
    dim, chunks = split
    return torch.cat([c.chunk(size, dim)[rank] for c in whole.chunk(chunks, dim)], dim).clone()


def unshard(pieces: Sequence[torch.Tensor], split: Split) -> torch.Tensor:
    """The whole tensor from every tensor rank's piece, in rank order (the inverse of ``shard``)."""
    dim, chunks = split
    blocks = [p.chunk(chunks, dim) for p in pieces]
    return torch.cat([torch.cat([b[c] for b in blocks], dim) for c in range(chunks)], dim)


def gather_whole(piece: torch.Tensor, split: Split, group: Any, device: torch.device) -> torch.Tensor:
    """The whole tensor, on every rank of ``group`` (on ``piece``'s device), from each rank's ``piece``: a
    collective over ``group``, run on ``device`` (its backend's: a CPU copy goes to the GPU under NCCL)."""
    on = piece.detach().to(device).contiguous()
    pieces = [torch.empty_like(on) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, on, group=group)
    return unshard(pieces, split).to(piece.device)


class WholeFromPieces:
    """A split parameter's whole tensor from its pieces over the tensor group, and this rank's piece of a whole one:
    what a parameter carries as ``config.optimizers.TENSOR_SPLIT`` (Muon orthogonalizes whole matrices). Shared,
    not copied, by deep copies (a process group does not copy)."""

    def __init__(self, split: Split, group: Any, *, rank: int, size: int, device: torch.device):
        self.split, self.group, self.rank, self.size, self.device = split, group, rank, size, device

    def __deepcopy__(self, memo: Dict[int, Any]) -> "WholeFromPieces":
        return self

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor (an all-gather over the group: each of its ranks calls it, in the same order)."""
        return gather_whole(piece, self.split, self.group, self.device)

    def piece(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole``."""
        return shard(whole, self.split, rank=self.rank, size=self.size)


def whole_state(
    state: Mapping[str, Any],
    splits: Mapping[str, Split],
    shapes: Mapping[str, torch.Size],
    group: Any,
    device: torch.device,
) -> Dict[str, Any]:
    """``state`` (name -> tensor, or name -> optimizer state dict) with every split tensor gathered whole;
    an optimizer state's tensors of its parameter's piece shape ``shapes`` (momenta) are split as the
    parameter. Every rank of ``group`` calls it with the same names in the same order."""
    out: Dict[str, Any] = {}
    for name, value in state.items():
        if name not in splits:
            out[name] = value
        elif torch.is_tensor(value):
            out[name] = gather_whole(value, splits[name], group, device)
        else:
            out[name] = {
                k: gather_whole(v, splits[name], group, device) if _is_piece(v, shapes[name]) else v
                for k, v in value.items()
            }
    return out


def _is_piece(v: Any, shape: torch.Size) -> bool:
    return torch.is_tensor(v) and tuple(v.shape) == tuple(shape)


def sharded_state(
    state: Mapping[str, Any], splits: Mapping[str, Split], shapes: Mapping[str, torch.Size], *, rank: int, size: int
) -> Dict[str, Any]:
    """``state`` of whole tensors (a checkpoint's) cut to tensor rank ``rank``'s pieces: the inverse of
    ``whole_state``; an optimizer state's tensor is cut where it has its parameter's whole shape ``shapes``."""
    out: Dict[str, Any] = {}
    for name, value in state.items():
        if name not in splits:
            out[name] = value
        elif torch.is_tensor(value):
            out[name] = shard(value, splits[name], rank=rank, size=size)
        else:
            out[name] = {
                k: shard(v, splits[name], rank=rank, size=size) if _is_piece(v, shapes[name]) else v
                for k, v in value.items()
            }
    return out


def vocab_range(vocab_size: int, *, rank: int, size: int) -> Tuple[int, int]:
    """The ids [start, end) whose rows tensor rank ``rank`` (of ``size``, dividing ``vocab_size``) holds."""
    part = vocab_size // size
    return rank * part, (rank + 1) * part


def vocab_embedding(
    idx: torch.Tensor, weight: torch.Tensor, *, start: int, group: Any, padding_idx: Optional[int] = None
) -> torch.Tensor:
    """(B, T) whole ids -> (B, T, C) rows of an embedding split by the vocabulary (this rank's ``weight`` holds ids
    ``start`` .. ``start`` + its rows - 1): an id outside them looks up zeros, and the partial embeddings are summed
    over ``group`` (exact: one term is nonzero); ``padding_idx`` (whole) gets no gradient, as in ``nn.Embedding``."""
    rows = weight.shape[0]
    outside = (idx < start) | (idx >= start + rows)
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else None
    found = F.embedding(torch.where(outside, torch.zeros_like(idx), idx - start), weight, padding_idx=pad)
    return reduce_from(found.masked_fill(outside[..., None], 0.0), group)


def _all_reduce(x: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross entropy over logits split by the vocabulary: per token, the max, the sum of exp and the target's
    logit are each all-reduced over the tensor group (three collectives of N floats), never the (N, V) logits. Its
    backward is local: softmax minus the one-hot of the target, on this rank's columns."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: Any) -> torch.Tensor:
        # logits (N, V/t) float32: columns start .. start + V/t - 1 of the whole; targets (N,) whole ids
        top = _all_reduce(logits.detach().amax(dim=-1), group, dist.ReduceOp.MAX)  # (N,)
        shifted = logits.detach() - top[:, None]
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])  # (N,): this rank holds the target's column
        index = torch.where(mine, local, torch.zeros_like(local))
        target = _all_reduce(shifted.gather(1, index[:, None]).squeeze(1) * mine, group)  # (N,)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), group)  # (N,)
        ctx.save_for_backward(exp.div_(total[:, None]), index, mine)
        return total.log() - target

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, mine = ctx.saved_tensors
        out = softmax.clone()  # (N, V/t): d loss / d logit = softmax - one-hot(target)
        out.scatter_add_(1, index[:, None], -mine.to(out.dtype)[:, None])
        return out * grad[:, None], None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, start: int, group: Any):
    """Per-token cross entropy (N,) of logits split by the vocabulary (this rank's (N, V/t), columns from ``start``)
    against whole ``targets`` (N,); every rank of ``group`` gets the same values."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)
