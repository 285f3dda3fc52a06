"""Tensor parallelism's wire: the two regions of a split layer (Megatron's f and g) and whole tensors <-> shards.

A stage's t ranks (its tensor group) hold 1/t of each split parameter. A column-split matrix (rows of its
output) takes a replicated input through ``copy_to`` (identity forward, all-reduce of the input's gradient
in backward); a row-split matrix's partial outputs are summed by ``reduce_from`` (all-reduce forward,
identity backward). A split is ``(dim, chunks)``: the parameter's ``dim`` is ``chunks`` equal blocks (qkv's
q, k and v: 3), each divided in t, and tensor rank k holds piece k of every block.

Sequence parallelism (pipeline.sequence_parallel): between the split layers each rank holds its (B, T/t, C) slice of
the sequence; ``gathered_linear`` all-gathers the slices into a column-split matrix's input (saving only the slice,
gathered again in backward, which reduce-scatters the input's gradient), ``reduce_scatter_sequence`` sums the
row-split partial outputs into each rank's slice (backward: an all-gather), ``scatter_sequence`` and
``gather_sequence`` enter and leave the region, ``gather_columns`` gathers one input for several column-split
layers (model=hf's q, k and v), and ``copy_many`` sums the gradients of whole parameters that saw 1/t of the tokens.
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


class _CopyMany(torch.autograd.Function):
    """f for several tensors at once: their gradients summed over the group in one float32 all-reduce, when backward
    has made every one of them."""

    @staticmethod
    def forward(ctx, group: Any, *xs: torch.Tensor):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        sums = flat.split([g.numel() for g in grads])
        return (None, *(v.view_as(g).to(g.dtype) for v, g in zip(sums, grads)))


def copy_many(group: Any, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``copy_to`` of each of ``xs`` with one all-reduce of their gradients (whole parameters that see 1/t of the
    sequence under sequence parallelism: each rank's gradient is a partial sum)."""
    return _CopyMany.apply(group, *xs)


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


# ---- sequence parallelism (pipeline.sequence_parallel): activations split along the sequence, dim 1 of (B, T, C)

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch's current names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's (B, T/t, C) slice of ``group`` -> the whole (B, T, C), in rank order along the sequence."""
    t = dist.get_world_size(group)
    B, Tk = x.shape[:2]
    pieces = torch.empty((t * B, *x.shape[1:]), dtype=x.dtype, device=x.device)  # (t*B, T/t, C): slices stacked
    _ALL_GATHER(pieces, x.contiguous(), group=group)
    return pieces.view(t, B, Tk, *x.shape[2:]).transpose(0, 1).reshape(B, t * Tk, *x.shape[2:])


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's (B, T/t, C) slice of the sum over ``group`` of (B, T, C) ``x``, added in float32 (as
    ``_all_reduce_float32``), in ``x``'s dtype."""
    t = dist.get_world_size(group)
    B, T = x.shape[:2]
    rest = x.shape[2:]
    stacked = torch.empty((t, B, T // t, *rest), dtype=torch.float32, device=x.device)  # slice k at row k
    stacked.copy_(x.view(B, t, T // t, *rest).transpose(0, 1))
    out = torch.empty((B, T // t, *rest), dtype=torch.float32, device=x.device)
    _REDUCE_SCATTER(out, stacked.view(t * B, T // t, *rest), group=group)
    return out.to(x.dtype)


def sequence_slice(x: torch.Tensor, *, rank: int, size: int) -> torch.Tensor:
    """Tensor rank ``rank``'s slice (of ``size``) of ``x`` (B, T, ...) along the sequence: (B, T/size, ...), its own
    storage (a view would keep the whole tensor alive wherever autograd saves the slice)."""
    T = x.shape[1]
    if T % size:
        raise ValueError(f"a sequence of {T} tokens does not split into {size} equal slices")
    return x[:, rank * (T // size) : (rank + 1) * (T // size)].clone(memory_format=torch.contiguous_format)


class _ScatterSeq(torch.autograd.Function):
    """A replicated (B, T, C) enters the sequence-parallel region: this rank keeps its slice; the slices' gradients
    are gathered whole (every rank's replicated producer gets the whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group = group
        return sequence_slice(x, rank=rank, size=size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_seq(grad, ctx.group), None, None, None


class _GatherSeq(torch.autograd.Function):
    """The sequence-parallel region's slices gathered whole into a replicated region (the final norm and head): every
    rank computes the same whole gradient there, and keeps its slice of it (no communication)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return sequence_slice(grad, rank=ctx.rank, size=ctx.size), None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """The row-split layers' partial (B, T, C) outputs summed, each rank keeping its slice (in place of
    ``reduce_from``'s all-reduce); its gradient slices gathered whole, the input of every rank's row-split product."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_seq(grad, ctx.group), None


class _GatherColumns(torch.autograd.Function):
    """The slices gathered whole as the input of several column-split layers (model=hf's q, k and v, or gate and
    up): each rank's partial input gradient is summed into its slice (a reduce-scatter). Saves nothing: the layers
    save the whole input themselves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_seq(grad, ctx.group).to(grad.dtype), None


class _GatheredLinear(torch.autograd.Function):
    """``F.linear`` of the sequence gathered whole from every rank's slice (a column-split matrix's input), saving
    only the slice: the backward gathers it again (Megatron's sequence parallelism), and reduce-scatters the input's
    gradient. ``x`` arrives in the compute dtype (autocast's cast made outside, as an unsplit linear's input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # (B, T/t, C) and the parameter itself: nothing whole is kept
        w, b = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        return F.linear(_gather_seq(x, group), w, b)  # (B, T, N/t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        whole = _gather_seq(x, ctx.group)  # (B, T, C) again
        grad_x = _reduce_scatter_seq(grad.matmul(weight.to(grad.dtype)), ctx.group).to(x.dtype)
        grad_w = grad.flatten(0, -2).t().mm(whole.flatten(0, -2).to(grad.dtype)).to(weight.dtype)
        grad_b = grad.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def scatter_sequence(x: torch.Tensor, group: Any, *, rank: int, size: int) -> torch.Tensor:
    """This rank's sequence slice of a replicated ``x`` (B, T, C); its gradient is gathered whole."""
    return _ScatterSeq.apply(x, group, rank, size)


def gather_sequence(x: torch.Tensor, group: Any, *, rank: int, size: int) -> torch.Tensor:
    """The whole (B, T, C) from every rank's slice ``x``, entering a replicated region (its gradient: the slice)."""
    return _GatherSeq.apply(x, group, rank, size)


def reduce_scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's sequence slice of the sum over ``group`` of the row-split layers' partial outputs ``x``."""
    return _ReduceScatterSeq.apply(x, group)


def gather_columns(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole (B, T, C) from every rank's slice ``x``, entering column-split layers (its gradient: reduce-scattered
    into the slice)."""
    return _GatherColumns.apply(x, group)


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any) -> torch.Tensor:
    """A column-split ``F.linear`` of the sequence gathered from every rank's slice ``x`` (B, T/t, C) -> (B, T, N/t)."""
    return _GatheredLinear.apply(x, weight, bias, group)


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
