"""model=hf's Llama family (Llama, Mistral, Qwen2) split across a tensor group (pipeline.tensor_parallel).

Megatron's split on transformers' own decoder layer, parameter names unchanged: attention by heads (``q_proj``,
``k_proj``, ``v_proj`` column-wise: tensor rank k holds query heads k*H/t .. (k+1)*H/t - 1 and key-value heads
k*KV/t .., which are the ones those query heads read under grouped-query attention, as t divides KV; ``o_proj``
row-wise), the SwiGLU MLP by width (``gate_proj``, ``up_proj`` column-wise, ``down_proj`` row-wise). Each split
region takes its replicated input through ``copy_to`` (a forward pre-hook on ``self_attn`` and ``mlp``: one
all-reduce of the input's gradient per region) and sums its row-split outputs with ``reduce_from``; a row-split
layer's bias (none in these families by default) is added once, after the sum. Where t divides the vocabulary,
``embed_tokens`` and ``lm_head`` split by it as the GPT's do (``gpt_tensor.split_vocab`` with ``HF_VOCAB``); norms
stay whole.
Attention dropout would draw its masks over a rank's heads only: refused at t > 1 (run/preflight.py).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pipedream2bw.models.gpt_tensor import VocabKinds
from pipedream2bw.models.hf import DecoderLayer, TokenEmbedding
from pipedream2bw.models.hf_gpt2 import Head
from pipedream2bw.pipeline.tensor import (
    SharedGroup,
    Split,
    column_linear,
    copy_to,
    reduce_from,
    shard,
    vocab_embedding,
    vocab_range,
)

SPLITS: Dict[str, Split] = {
    **{f"self_attn.{p}_proj.{k}": (0, 1) for p in "qkv" for k in ("weight", "bias")},
    "self_attn.o_proj.weight": (1, 1),
    **{f"mlp.{p}_proj.{k}": (0, 1) for p in ("gate", "up") for k in ("weight", "bias")},
    "mlp.down_proj.weight": (1, 1),
}
"""Each split parameter of a decoder layer (transformers' names) -> (dim, chunks); absent biases are skipped."""


class RowLinear(nn.Linear):
    """An ``nn.Linear`` holding the input columns of this tensor rank: its partial product summed over the tensor
    group, then the (whole) bias added once. Set on a loaded layer by class (``split_decoder_layers``)."""

    tensor_group: SharedGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from(F.linear(x, self.weight), self.tensor_group.group)  # (B, T, C)
        return out if self.bias is None else out + self.bias.to(out.dtype)  # as autocast casts an unsplit one's


class _CopyIn:
    """A forward pre-hook: the region's replicated input (``hidden_states``, by position or keyword) through
    ``copy_to``, so its gradient is summed over the tensor group once for the whole region."""

    def __init__(self, group: Any):
        self.tensor_group = SharedGroup(group)

    def __call__(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        group = self.tensor_group.group
        if args:
            return (copy_to(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to(kwargs["hidden_states"], group)}


def _split_layer(layer: nn.Module, *, group: Any, rank: int, size: int) -> Dict[str, Split]:
    """Splits one transformers decoder layer in place; returns its split parameters (local names)."""
    for region, row in ((layer.self_attn, layer.self_attn.o_proj), (layer.mlp, layer.mlp.down_proj)):
        region.register_forward_pre_hook(_CopyIn(group), with_kwargs=True)
        row.__class__ = RowLinear
        row.tensor_group = SharedGroup(group)
    splits = {name: split for name, split in SPLITS.items() if _has_parameter(layer, name)}
    with torch.no_grad():
        for name, split in splits.items():
            p = layer.get_parameter(name)
            p.data = shard(p.data, split, rank=rank, size=size)
    return splits


def _has_parameter(module: nn.Module, name: str) -> bool:
    try:
        return module.get_parameter(name) is not None
    except AttributeError:
        return False


def split_decoder_layers(module: nn.Module, *, group: Any, rank: int, size: int) -> Dict[str, Split]:
    """Splits each Llama-family ``DecoderLayer`` among ``module``'s children for tensor rank ``rank`` (of ``size``).

    Returns:
        The split parameters of ``module`` by name (``module.named_parameters()``'s), with their splits.
    """
    splits: Dict[str, Split] = {}
    for name, child in module._modules.items():
        if isinstance(child, DecoderLayer):
            local = _split_layer(child.layer, group=group, rank=rank, size=size)
            splits.update({f"{name}.layer.{k}": v for k, v in local.items()})
    return splits


class VocabParallelTokenEmbedding(TokenEmbedding):
    """``embed_tokens`` holding tensor rank ``rank``'s rows of the vocabulary (``vocab_embedding``); its padding row,
    where this rank holds it, gets no gradient, as in ``nn.Embedding``."""

    def __init__(self, embedding: TokenEmbedding, *, group: Any, rank: int, size: int):
        nn.Module.__init__(self)
        self.embed_tokens = embedding.embed_tokens
        self.start = vocab_range(embedding.embed_tokens.num_embeddings, rank=rank, size=size)[0]
        self.tensor_group = SharedGroup(group)

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        group, pad = self.tensor_group.group, self.embed_tokens.padding_idx
        return vocab_embedding(ids, self.embed_tokens.weight, start=self.start, group=group, padding_idx=pad)


class VocabParallelLMHead(Head):
    """``lm_head`` holding tensor rank ``rank``'s rows: (B, T, C) -> (B, T, V/t), read by ``gpt_tensor.VocabLoss``."""

    def __init__(self, head: Head, *, group: Any, rank: int, size: int):
        nn.Module.__init__(self)
        self.weight = head.weight
        self.tensor_group = SharedGroup(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.tensor_group.group)


HF_VOCAB: VocabKinds = {
    TokenEmbedding: (VocabParallelTokenEmbedding, "embed_tokens.weight", False),
    Head: (VocabParallelLMHead, "weight", True),
}
"""The Llama family's embedding and head (``gpt_tensor.split_vocab``'s kinds)."""
