"""The GPT's blocks split across a tensor group (pipeline.tensor_parallel): attention by heads, the MLP by width.

Megatron's split: ``qkv`` and ``fc`` column-wise (tensor rank k holds heads k*H/t .. (k+1)*H/t - 1 of q, k and v,
and rows k*4C/t .. of ``fc``), ``proj`` and ``fc_proj`` row-wise (the matching input columns); their biases are
added once, after the sum. Where t divides the vocabulary, the embedding and the head split by it (Megatron's
VocabParallelEmbedding and column-parallel head: tensor rank k holds rows k*V/t .. (k+1)*V/t - 1 of each, so a tied
pair stays tied piece by piece) and ``VocabLoss`` takes the place of ``lm_loss`` on the head's split logits; else they
stay whole on every rank. Norms stay whole, and so do the activations between layers: each rank's dropout draws the
same mask as an unsplit run (one random stream per layer and microbatch).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pipedream2bw.models.gpt import Block, Embedding, LMHead, _dropout
from pipedream2bw.pipeline.tensor import (
    SharedGroup,
    Split,
    column_linear,
    copy_to,
    reduce_from,
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


def split_blocks(module: nn.Module, *, group: Any, rank: int, size: int) -> Dict[str, Split]:
    """Replaces each GPT ``Block`` among ``module``'s children by its ``SplitBlock`` for tensor rank ``rank``.

    Returns:
        The split parameters of ``module`` by name (``module.named_parameters()``'s), with their splits.
    """
    splits: Dict[str, Split] = {}
    for name, child in list(module._modules.items()):
        if type(child) is Block:
            module._modules[name] = SplitBlock(child, group=group, rank=rank, size=size)
            splits.update({f"{name}.{k}": v for k, v in SplitBlock.SPLITS.items()})
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

    def forward(self, idx: Any) -> Any:
        if isinstance(idx, (tuple, list)):  # packed documents: the positions restart with each one
            idx, positions = idx
            return _dropout(self.tokens(idx) + self.pos(positions), self.dropout, self.training), positions
        positions = torch.arange(idx.shape[1], device=idx.device)
        return _dropout(self.tokens(idx) + self.pos(positions), self.dropout, self.training)  # (B, T, C)


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
