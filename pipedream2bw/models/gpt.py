"""A decoder-only GPT written as a flat list of layers (embedding, pre-LN blocks, norm, head)."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipedream2bw.config import GPTConfig, model_num_layers


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal attention over packed documents: positions (B, T), restarting at 0 with each
    document -> (B, 1, T, T) bool, True where query i may attend to key j (j <= i, both in one document)."""
    doc = torch.cumsum(positions == 0, dim=1)  # (B, T): the document each token belongs to
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


class Embedding(nn.Module):
    """Token plus learned position embedding: (B, T) int64 -> (B, T, C); packed documents
    (data.packing=documents): (ids, positions), both (B, T) -> ((B, T, C), positions), which the blocks need."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = cfg.dropout

    def tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, C) token embeddings (a tensor rank's vocabulary split overrides it)."""
        return self.tok(idx)

    def forward(self, idx: Any) -> Any:
        if isinstance(idx, (tuple, list)):  # packed documents: the positions restart with each one
            idx, positions = idx
            return _dropout(self.tokens(idx) + self.pos(positions), self.dropout, self.training), positions
        positions = torch.arange(idx.shape[1], device=idx.device)
        return _dropout(self.tokens(idx) + self.pos(positions), self.dropout, self.training)  # (B, T, C)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``x`` with dropout ``p`` (model.dropout) in training; p = 0 draws nothing (the random streams stay put)."""
    return F.dropout(x, p, training) if p > 0 and training else x


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)); shape-preserving. Given (x, positions)
    (packed documents), each token attends only to its own document's tokens (``document_mask``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Any) -> Any:
        positions = None
        if isinstance(x, (tuple, list)):  # packed documents: (x, positions)
            x, positions = x
        x = x + _dropout(self.attention(self.ln1(x), positions), self.dropout, self.training)
        x = x + _dropout(self.mlp(self.ln2(x)), self.dropout, self.training)
        return x if positions is None else (x, positions)

    def heads(self, h: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal self-attention (within each packed document with ``positions``) of the heads ``qkv`` holds (all,
        or a tensor rank's): (B, T, C) -> (B, T, H'*C/H)."""
        return self.attend(self.qkv(h), positions)

    def attend(self, qkv: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``heads`` from the heads' q, k and v: (B, T, 3*H'*C/H) -> (B, T, H'*C/H)."""
        B, T, _ = qkv.shape
        width = qkv.shape[-1] // 3  # H' heads of C/H
        # (B, H', T, C/H) for each of q, k, v
        q, k, v = (t.view(B, T, width // self.head_dim, self.head_dim).transpose(1, 2) for t in qkv.split(width, 2))
        if positions is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))
        return y.transpose(1, 2).reshape(B, T, width)

    def attention(self, h: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention branch of the normed input: (B, T, C) -> (B, T, C)."""
        return self.proj(self.heads(h, positions))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP branch of the normed input: (B, T, C) -> (B, T, C)."""
        return self.fc_proj(F.gelu(self.fc(h)))


class Norm(nn.LayerNorm):
    """The final LayerNorm: (B, T, C) -> (B, T, C), or (x, positions) -> (norm(x), positions)."""

    def forward(self, x: Any) -> Any:
        if isinstance(x, (tuple, list)):
            return super().forward(x[0]), x[1]
        return super().forward(x)


class LMHead(nn.Module):
    """Projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Any) -> torch.Tensor:
        return self.out(x[0] if isinstance(x, (tuple, list)) else x)  # packed documents: the positions end here


LAYER_KINDS = {"embedding": Embedding, "block": Block, "norm": lambda cfg: Norm(cfg.d_model), "head": LMHead}


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


def lm_loss(logits: torch.Tensor, targets: Any) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar. Packed documents: targets are
    (ids, weights), both (B, T), and the loss is the weighted sum (``data.documents.DocumentFeed``'s weights make
    the mean over a batch's unmasked tokens; a token of weight 0 contributes nothing)."""
    if isinstance(targets, (tuple, list)):
        ids, weights = targets
        losses = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="none")
        return (losses * weights.flatten()).sum()
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
