"""The GPT's blocks split across a tensor group (pipeline.tensor_parallel): attention by heads, the MLP by width.

Megatron's split: ``qkv`` and ``fc`` column-wise (tensor rank k holds heads k*H/t .. (k+1)*H/t - 1 of q, k and v,
and rows k*4C/t .. of ``fc``), ``proj`` and ``fc_proj`` row-wise (the matching input columns); their biases are
added once, after the sum. Where t divides the vocabulary, the embedding and the head split by it (Megatron's
VocabParallelEmbedding and column-parallel head: tensor rank k holds rows k*V/t .. (k+1)*V/t - 1 of each, so a tied
pair stays tied piece by piece) and ``VocabLoss`` takes the place of ``lm_loss`` on the head's split logits; else they
stay whole on every rank. Norms stay whole, and so do the activations between layers: each rank's dropout draws the
same mask as an unsplit run (one random stream per layer and microbatch).

With sequence parallelism (pipeline.sequence_parallel, ``SequenceSplitBlock``) the activations between the split
matrices are split too, along the sequence: tensor rank k holds tokens k*T/t .. (k+1)*T/t - 1 of each block's input
and output (B, T/t, C), runs the norms, dropout (its slice of the whole mask an unsplit run draws) and the residual
adds on them, gathers the sequence before qkv and fc and reduce-scatters after proj and fc_proj. The stage's
embedding output is sliced, the final norm's input gathered whole (``SequenceEnds``), so what crosses a stage
boundary between them is each tensor rank's slice.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pipedream2bw.models.gpt import Block, Embedding, LMHead, Norm
from pipedream2bw.pipeline.tensor import (
    SharedGroup,
    Split,
    column_linear,
    copy_many,
    copy_to,
    gather_sequence,
    gathered_linear,
    reduce_from,
    reduce_scatter_sequence,
    scatter_sequence,
    sequence_slice,
    shard,
    vocab_embedding,
    vocab_parallel_cross_entropy,
    vocab_range,
)


class SplitBlock(Block):
    """A ``Block`` holding tensor rank ``rank``'s pieces (of ``size``) of its matrices; parameter names unchanged."""

    SPLITS: Dict[str, Split] = {
        "qkv.weight": (0, 3),
        "qkv.bias": (0, 3),
        "proj.weight": (1, 1),
        "fc.weight": (0, 1),
        "fc.bias": (0, 1),
        "fc_proj.weight": (1, 1),
    }
    """Each split parameter's (dim, chunks) (pipeline.tensor.Split): the rest is whole on every rank."""

    def __init__(self, block: Block, *, group: Any, rank: int, size: int):
        nn.Module.__init__(self)
        self.num_heads, self.head_dim, self.dropout = block.num_heads // size, block.head_dim, block.dropout
        self.ln1, self.qkv, self.proj, self.ln2, self.fc, self.fc_proj = (
            block.ln1,
            block.qkv,
            block.proj,
            block.ln2,
            block.fc,
            block.fc_proj,
        )
        self.tensor_group = SharedGroup(group)
        with torch.no_grad():
            for name, split in self.SPLITS.items():
                p = self.get_parameter(name)
                p.data = shard(p.data, split, rank=rank, size=size)

    def attention(self, h: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        group = self.tensor_group.group
        y = self.heads(copy_to(h, group), positions)  # (B, T, C/t): this rank's heads
        out = reduce_from(F.linear(y, self.proj.weight), group)  # (B, T, C), in autocast's dtype
        return out + self.proj.bias.to(out.dtype)  # the bias as autocast casts it for an unsplit F.linear

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        group = self.tensor_group.group
        y = F.gelu(self.fc(copy_to(h, group)))  # (B, T, 4C/t)
        out = reduce_from(F.linear(y, self.fc_proj.weight), group)
        return out + self.fc_proj.bias.to(out.dtype)


class SequenceSplitBlock(SplitBlock):
    """A ``SplitBlock`` on tensor rank ``rank``'s slice of the sequence (pipeline.sequence_parallel): (B, T/t, C) in
    and out. The norms' and the row-split biases' parameters are whole on every rank but see 1/t of the tokens: their
    gradients are summed over the tensor group (``copy_many``: one all-reduce a block, once backward has made all six),
    so each rank steps them as an unsplit run does."""

    def __init__(self, block: Block, *, group: Any, rank: int, size: int):
        super().__init__(block, group=group, rank=rank, size=size)
        self.tensor_rank, self.tensor_size = rank, size

    def forward(self, x: Any) -> Any:
        if not torch.is_tensor(x):
            raise TypeError("pipeline.sequence_parallel splits a (B, T, C) tensor, not packed documents' tuples")
        ln1, ln2 = self.ln1, self.ln2
        w1, b1, proj_b, w2, b2, fc_proj_b = copy_many(
            self.tensor_group.group, ln1.weight, ln1.bias, self.proj.bias, ln2.weight, ln2.bias, self.fc_proj.bias
        )
        h = F.layer_norm(x, ln1.normalized_shape, w1, b1, ln1.eps)  # (B, T/t, C)
        x = x + self.drop(self.attention(h, bias=proj_b))
        h = F.layer_norm(x, ln2.normalized_shape, w2, b2, ln2.eps)
        return x + self.drop(self.mlp(h, bias=fc_proj_b))

    def attention(
        self, h: torch.Tensor, positions: Optional[torch.Tensor] = None, *, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        g = self.tensor_group.group
        y = self.attend(gathered_linear(_compute(h), self.qkv.weight, self.qkv.bias, g))  # (B, T, C/t)
        out = reduce_scatter_sequence(F.linear(y, self.proj.weight), g)  # (B, T/t, C)
        return _add_bias(out, self.proj.bias if bias is None else bias)

    def mlp(self, h: torch.Tensor, *, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        g = self.tensor_group.group
        y = F.gelu(gathered_linear(_compute(h), self.fc.weight, self.fc.bias, g))  # (B, T, 4C/t)
        out = reduce_scatter_sequence(F.linear(y, self.fc_proj.weight), g)  # (B, T/t, C)
        return _add_bias(out, self.fc_proj.bias if bias is None else bias)

    def drop(self, y: torch.Tensor) -> torch.Tensor:
        """Dropout with this rank's slice of the mask an unsplit run draws for the whole (B, T, C) from the layer's
        stream (the same draws, so the same masks at any t)."""
        if not (self.dropout > 0 and self.training):
            return y
        B, Tk = y.shape[:2]
        ones = torch.ones((B, Tk * self.tensor_size, *y.shape[2:]), dtype=y.dtype, device=y.device)
        mask = F.dropout(ones, self.dropout, True)  # (B, T, C): 0 or 1/(1-p), as F.dropout scales an unsplit input
        return y * sequence_slice(mask, rank=self.tensor_rank, size=self.tensor_size)


def _add_bias(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``out`` + a row-split layer's whole ``bias``, added in float32 and rounded once to ``out``'s dtype: the bias's
    gradient then sums this rank's tokens in float32 (summed in bf16, the ranks' partial sums would each round, and
    their sum stray from the unsplit one by more than bf16's tolerance: measured 1.9e-3 on a proj bias)."""
    return (out.float() + bias).to(out.dtype)


def _compute(h: torch.Tensor) -> torch.Tensor:
    """``h`` in autocast's dtype where autocast runs (as an unsplit ``nn.Linear`` casts its input), else as it is."""
    kind = h.device.type
    return h.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else h


GPT_LAYERS = (Embedding, Block, Norm, LMHead)
"""The layers a sequence-parallel stage may hold: the blocks run on slices, the embedding's output is sliced, the
final norm's input gathered, and the head sees the whole sequence after it."""


class SequenceEnds:
    """Forward hooks that bound a stage's sequence-parallel region (parameter names unchanged): the embedding's whole
    output is sliced (``scatter``), the final norm's input gathered whole (``gather``). Shared, not copied, by the
    2bw weight versions' deep copies."""

    def __init__(self, group: Any, *, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def __deepcopy__(self, memo: Dict[int, Any]) -> "SequenceEnds":
        return self

    def scatter(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(output, self.group, rank=self.rank, size=self.size)

    def gather(self, module: nn.Module, args: Any) -> Any:
        return (gather_sequence(args[0], self.group, rank=self.rank, size=self.size), *args[1:])


def split_blocks(
    module: nn.Module, *, group: Any, rank: int, size: int, sequence_parallel: bool = False
) -> Dict[str, Split]:
    """Replaces each GPT ``Block`` among ``module``'s children by its ``SplitBlock`` for tensor rank ``rank`` (a
    ``SequenceSplitBlock`` with ``sequence_parallel``, the embedding's output then sliced and the final norm's input
    gathered: ``SequenceEnds``).

    Returns:
        The split parameters of ``module`` by name (``module.named_parameters()``'s), with their splits.
    """
    splits: Dict[str, Split] = {}
    cls = SequenceSplitBlock if sequence_parallel else SplitBlock
    odd = [f"{n} ({type(c).__name__})" for n, c in module._modules.items() if not isinstance(c, GPT_LAYERS)]
    if sequence_parallel and odd:  # a layer it does not know would see slices where it expects the whole sequence
        raise TypeError(f"pipeline.sequence_parallel splits the built-in GPT's layers only; this stage holds {odd}")
    ends = SequenceEnds(group, rank=rank, size=size)
    for name, child in list(module._modules.items()):
        if type(child) is Block:
            module._modules[name] = cls(child, group=group, rank=rank, size=size)
            splits.update({f"{name}.{k}": v for k, v in SplitBlock.SPLITS.items()})
        elif sequence_parallel and isinstance(child, Embedding):
            child.register_forward_hook(ends.scatter)
        elif sequence_parallel and isinstance(child, Norm):
            child.register_forward_pre_hook(ends.gather)
    return splits


class VocabParallelEmbedding(Embedding):
    """An ``Embedding`` whose token rows are tensor rank ``rank``'s ids [start, end): an id outside them looks up
    zeros, and the partial embeddings are summed over the tensor group (exact: one of the t terms is nonzero); the
    position embedding whole. Parameter names unchanged."""

    def __init__(self, embedding: Embedding, *, group: Any, rank: int, size: int):
        nn.Module.__init__(self)
        self.tok, self.pos, self.dropout = embedding.tok, embedding.pos, embedding.dropout
        self.start = vocab_range(embedding.tok.num_embeddings, rank=rank, size=size)[0]
        self.tensor_group = SharedGroup(group)

    def tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) whole ids -> (B, T, C) token embeddings, summed over the tensor group."""
        return vocab_embedding(idx, self.tok.weight, start=self.start, group=self.tensor_group.group)


class VocabParallelHead(LMHead):
    """An ``LMHead`` holding tensor rank ``rank``'s rows (vocabulary ids [start, end)): (B, T, C) -> (B, T, V/t), the
    logits of its ids only (``VocabLoss`` reads them); its input's gradient summed over the tensor group."""

    def __init__(self, head: LMHead, *, group: Any, rank: int, size: int):
        nn.Module.__init__(self)
        self.out = head.out
        self.tensor_group = SharedGroup(group)

    def forward(self, x: Any) -> torch.Tensor:
        x = x[0] if isinstance(x, (tuple, list)) else x  # packed documents: the positions end here
        return column_linear(x, self.out.weight, self.tensor_group.group)  # (B, T, V/t)


class VocabLoss:
    """``lm_loss`` on logits split by the vocabulary (``VocabParallelHead``'s): the mean next-token cross entropy over
    targets other than -100 (``F.cross_entropy``'s ignore index), or with (ids, weights) their weighted sum; the
    same value on every rank of the tensor group."""

    def __init__(self, group: Any, *, vocab_size: int, rank: int, size: int):
        self.group, self.start = group, vocab_range(vocab_size, rank=rank, size=size)[0]

    def __call__(self, logits: torch.Tensor, targets: Any) -> torch.Tensor:
        ids, weights = targets if isinstance(targets, (tuple, list)) else (targets, None)
        ids = ids.flatten()
        kept = ids != -100
        losses = vocab_parallel_cross_entropy(
            logits.flatten(0, 1).float(), torch.where(kept, ids, -1), start=self.start, group=self.group
        )
        if weights is not None:
            return (losses * weights.flatten()).sum()
        return (losses * kept).sum() / kept.sum()


VocabKinds = Dict[type, Tuple[type, str, bool]]
"""A layer class -> (its vocabulary split's class, taking (layer, group=, rank=, size=); the local name of its (V, C)
weight; whether it is the head)."""

GPT_VOCAB: VocabKinds = {
    Embedding: (VocabParallelEmbedding, "tok.weight", False),
    LMHead: (VocabParallelHead, "out.weight", True),
}


def split_vocab(
    module: nn.Module, *, group: Any, rank: int, size: int, head: bool = True, kinds: Optional[VocabKinds] = None
) -> Tuple[Dict[str, Split], Optional[int]]:
    """Replaces the embedding and (with ``head``) the LM head among ``module``'s children (``kinds``: the GPT's by
    default) by their vocabulary splits for tensor rank ``rank``, where ``size`` divides the vocabulary; a weight the
    two share (tied) is cut once.

    Returns:
        (the split parameters by name, every name of a shared one included; the vocabulary size when the head was
        split, whose logits then need ``VocabLoss``, else None).
    """
    splits: Dict[str, Split] = {}
    cut, head_vocab = set(), None
    for name, child in list(module._modules.items()):
        cls, local, is_head = (kinds or GPT_VOCAB).get(type(child), (None, "", False))
        if cls is None or (is_head and not head):
            continue
        weight = child.get_parameter(local)
        vocab = weight.shape[0] * (size if id(weight) in cut else 1)  # a tied weight may be cut already
        if vocab % size:
            continue
        module._modules[name] = cls(child, group=group, rank=rank, size=size)
        splits[f"{name}.{local}"] = (0, 1)
        head_vocab = vocab if is_head else head_vocab
        if id(weight) not in cut:  # (V, C) -> (V/t, C)
            cut.add(id(weight))
            with torch.no_grad():
                weight.data = shard(weight.data, (0, 1), rank=rank, size=size)
    return splits, head_vocab
