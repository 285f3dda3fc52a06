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

Sequence parallelism (pipeline.sequence_parallel): between the split regions each rank holds its (B, T/t, C) slice
of the sequence (the norms and the residual adds run on it); a region's pre-hook gathers its input whole
(``gather_columns``: the input's gradient reduce-scattered), its row-split layer reduce-scatters the partial outputs
into the slices (``reduce_scatter_sequence``), the two norms' weights and any row-split bias (whole, seeing 1/t of the
tokens) have their gradients summed over the tensor group in one all-reduce a layer (``copy_many``), and the rotary
angles cover the whole sequence. The embedding's output is sliced and the final norm's input gathered
(``gpt_tensor.SequenceEnds``), as the GPT's. The whole input a region gathers is saved by its column-split layers
(not only the slice, as the GPT's ``gathered_linear`` does): the saving is the norms' inputs and outputs, the residual
stream and the stage boundary.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pipedream2bw.models.gpt_tensor import SequenceEnds, VocabKinds
from pipedream2bw.models.hf import DecoderLayer, TokenEmbedding
from pipedream2bw.models.hf_gpt2 import Head
from pipedream2bw.pipeline.tensor import (
    SharedGroup,
    Split,
    column_linear,
    copy_many,
    copy_to,
    gather_columns,
    reduce_from,
    reduce_scatter_sequence,
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
    sequence: bool  # pipeline.sequence_parallel: the sum reduce-scattered into each rank's slice of the sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = reduce_scatter_sequence if self.sequence else reduce_from
        out = total(F.linear(x, self.weight), self.tensor_group.group)  # (B, T, C) or (B, T/t, C)
        return out if self.bias is None else out + self.bias.to(out.dtype)  # as autocast casts an unsplit one's


class _RegionInput:
    """A forward pre-hook: the region's input (``hidden_states``, by position or keyword) through ``copy_to`` (its
    gradient summed over the tensor group once for the whole region) or, under sequence parallelism, gathered whole
    from the ranks' slices (``gather_columns``)."""

    def __init__(self, group: Any, *, sequence: bool):
        self.tensor_group = SharedGroup(group)
        self.enter = gather_columns if sequence else copy_to

    def __call__(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        group = self.tensor_group.group
        if args:
            return (self.enter(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.enter(kwargs["hidden_states"], group)}


class SequenceDecoderLayer(DecoderLayer):
    """A ``DecoderLayer`` on its tensor rank's slice of the sequence, (B, T/t, C) in and out (the module
    docstring), set on a split layer by class: the rotary angles of the whole sequence's positions, and the layer's
    whole parameters that see the slice only (``WHOLE_ON_SLICES``) passed through ``copy_many``."""

    tensor_group: SharedGroup
    tensor_size: int

    WHOLE_ON_SLICES = (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.bias",
        "mlp.down_proj.bias",
    )

    def forward(self, x: Any) -> Any:
        if not torch.is_tensor(x):
            raise TypeError("pipeline.sequence_parallel splits a (B, T, C) tensor, not packed documents' tuples")
        positions = torch.arange(x.shape[1] * self.tensor_size, device=x.device)[None]  # (1, T): the whole sequence
        cos_sin = self.rotary(x, positions)
        names = [n for n in self.WHOLE_ON_SLICES if _has_parameter(self.layer, n)]
        summed = copy_many(self.tensor_group.group, *(self.layer.get_parameter(n) for n in names))
        kwargs = dict(attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        out = functional_call(self.layer, dict(zip(names, summed)), (x,), kwargs)
        return out[0] if isinstance(out, tuple) else out


def _split_layer(layer: nn.Module, *, group: Any, rank: int, size: int, sequence: bool) -> Dict[str, Split]:
    """Splits one transformers decoder layer in place; returns its split parameters (local names)."""
    for region, row in ((layer.self_attn, layer.self_attn.o_proj), (layer.mlp, layer.mlp.down_proj)):
        region.register_forward_pre_hook(_RegionInput(group, sequence=sequence), with_kwargs=True)
        row.__class__ = RowLinear
        row.tensor_group, row.sequence = SharedGroup(group), sequence
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


def split_decoder_layers(
    module: nn.Module, *, group: Any, rank: int, size: int, sequence_parallel: bool = False
) -> Dict[str, Split]:
    """Splits each Llama-family ``DecoderLayer`` among ``module``'s children for tensor rank ``rank`` (of ``size``);
    with ``sequence_parallel`` each on its slice of the sequence (a ``SequenceDecoderLayer``), the embedding's output
    sliced and the final norm's input gathered.

    Returns:
        The split parameters of ``module`` by name (``module.named_parameters()``'s), with their splits.
    """
    splits: Dict[str, Split] = {}
    ends = SequenceEnds(group, rank=rank, size=size)
    for name, child in module._modules.items():
        if isinstance(child, DecoderLayer):
            local = _split_layer(child.layer, group=group, rank=rank, size=size, sequence=sequence_parallel)
            splits.update({f"{name}.layer.{k}": v for k, v in local.items()})
            if sequence_parallel:
                child.__class__ = SequenceDecoderLayer
                child.tensor_group, child.tensor_size = SharedGroup(group), size
        elif sequence_parallel and isinstance(child, TokenEmbedding):
            child.register_forward_hook(ends.scatter)
        elif sequence_parallel and is_final_norm(child):
            child.register_forward_pre_hook(ends.gather)
    return splits


def is_final_norm(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Llama family's RMSNorm (a layer of its own: the final norm)."""
    return type(layer).__name__.endswith("RMSNorm")


def holds_decoder_layers(module: nn.Module) -> bool:
    """Whether ``module``'s children are model=hf's Llama family's layers (not the built-in GPT's)."""
    return any(isinstance(c, (TokenEmbedding, DecoderLayer, Head)) or is_final_norm(c) for c in module.children())


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
