"""A decoder-only GPT written as a flat list of layers (embedding, pre-LN blocks, norm, head)."""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipedream2bw.config import GPTConfig, model_num_layers


class Embedding(nn.Module):
    """Token plus learned position embedding: (B, T) int64 -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return _dropout(self.tok(idx) + self.pos(positions), self.dropout, self.training)  # (B, T, C)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``x`` with dropout ``p`` (model.dropout) in training; p = 0 draws nothing (the random streams stay put)."""
    return F.dropout(x, p, training) if p > 0 and training else x


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)); shape-preserving."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _dropout(self.attention(self.ln1(x)), self.dropout, self.training)
        return x + _dropout(self.mlp(self.ln2(x)), self.dropout, self.training)

    def heads(self, h: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of the heads ``qkv`` holds (all, or a tensor rank's): (B, T, C) -> (B, T, H'*C/H)."""
        B, T, _ = h.shape
        qkv = self.qkv(h)
        width = qkv.shape[-1] // 3  # H' heads of C/H
        # (B, H', T, C/H) for each of q, k, v
        q, k, v = (t.view(B, T, width // self.head_dim, self.head_dim).transpose(1, 2) for t in qkv.split(width, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, width)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        """The attention branch of the normed input: (B, T, C) -> (B, T, C)."""
        return self.proj(self.heads(h))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP branch of the normed input: (B, T, C) -> (B, T, C)."""
        return self.fc_proj(F.gelu(self.fc(h)))


class LMHead(nn.Module):
    """Projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


LAYER_KINDS = {"embedding": Embedding, "block": Block, "norm": lambda cfg: nn.LayerNorm(cfg.d_model), "head": LMHead}


def layer_kind(cfg: GPTConfig, index: int) -> str:
    """Which kind of layer (a key of ``LAYER_KINDS``) index ``index`` of the GPT's layer list is:
    the embedding first, then the blocks, the final norm and the LM head last."""
    last = model_num_layers(cfg) - 1
    return {0: "embedding", last - 1: "norm", last: "head"}.get(index, "block")


def _make_layer(cfg: GPTConfig, index: int) -> nn.Module:
    return LAYER_KINDS[layer_kind(cfg, index)](cfg)


def _init_weights(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def build_gpt_layers(cfg: GPTConfig, *, seed: int, indices: Optional[Iterable[int]] = None) -> List[nn.Module]:
    """Builds the GPT's layers ``indices`` (all by default), each seeded by its own index.

    Layer ``i`` gets the same weights whichever stage builds it, so a stage can build only
    its own slice and every partition of the model starts from identical weights.

    Args:
        cfg: model shape.
        seed: run seed.
        indices: which layers of the list to build. With ``cfg.tie_embeddings``, the head shares
            the embedding's weight when both are built.

    Returns:
        The layers, in order.
    """
    indices = list(range(model_num_layers(cfg)) if indices is None else indices)
    layers = []
    for i in indices:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + i)
            layer = _make_layer(cfg, i)
            _init_weights(layer, cfg.init_std)
        layers.append(layer)
    last = model_num_layers(cfg) - 1
    if cfg.tie_embeddings and 0 in indices and last in indices:
        # The head's weight is the token embedding's (V, C) parameter itself. A rank building the
        # head alone gets a weight of its own, which the runtime ties (pipedream2bw.pipeline.ties).
        layers[indices.index(last)].out.weight = layers[indices.index(0)].tok.weight
    return layers


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
