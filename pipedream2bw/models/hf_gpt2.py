"""transformers' GPT-2 as a layer list (model=hf_gpt2): random init from a hand-written config, nothing downloaded.

Layers: token + position embedding, ``n_layer`` of transformers' ``GPT2Block``, the final
LayerNorm, the LM head; with ``tie_embeddings`` the head's weight is the token embedding's
(as GPT-2's), which the runtime keeps tied across stages. Needs the optional extra
``pip install -e '.[hf]'``. Dropout is off: the pipeline and a single-process run then see
the same numbers.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from pipedream2bw.errors import ConfigError


def _gpt2():
    try:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError as e:
        raise ConfigError(f"model=hf_gpt2 needs transformers ({e}); install the extra: pip install -e '.[hf]'") from e
    return GPT2Config, GPT2Block


class Embedding(nn.Module):
    """GPT-2's token plus learned position embedding: (B, T) int64 -> (B, T, C)."""

    def __init__(self, vocab_size: int, seq_len: int, n_embd: int, std: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        nn.init.normal_(self.wte.weight, std=std)
        nn.init.normal_(self.wpe.weight, std=std / 2)  # as transformers' GPT-2 initialises wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """One ``GPT2Block`` taking and returning hidden states (B, T, C): causal self-attention, no cache."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.block = _gpt2()[1](config, layer_idx=layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out  # transformers < 5 returns (hidden, ...)


class Head(nn.Module):
    """LM head without bias: (B, T, C) -> (B, T, V)."""

    def __init__(self, n_embd: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, n_embd))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


def build_layers(
    *,
    n_embd: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
    seq_len: int = 128,
    vocab_size: int = 256,
    tie_embeddings: bool = True,
    init_std: float = 0.02,
) -> List[nn.Module]:
    """GPT-2 of the given shape as [embedding, n_layer blocks, LayerNorm, head] (n_layer + 3 layers).

    Raises:
        ConfigError: transformers is not installed, or a shape it refuses.
    """
    GPT2Config, _ = _gpt2()
    if n_embd % n_head:
        raise ConfigError(f"model.n_head ({n_head}) must divide model.n_embd ({n_embd})")
    config = GPT2Config(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_positions=seq_len,
        vocab_size=vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"  # causal without a mask (GPT2Model would otherwise build one)
    embedding = Embedding(vocab_size, seq_len, n_embd, init_std)
    head = Head(n_embd, vocab_size)
    if tie_embeddings:
        head.weight = embedding.wte.weight
    return [
        embedding,
        *(Block(config, i) for i in range(n_layer)),
        nn.LayerNorm(n_embd, eps=config.layer_norm_epsilon),
        head,
    ]
