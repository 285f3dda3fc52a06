"""The checks of a run that need its model or its data files, on every rank before any process group:
``config.validate`` checks all the rest and runs first."""

from __future__ import annotations

from typing import Any, List, Optional

from pipedream2bw.config import Config, GPTConfig, HFModelConfig, LayerListConfig, validate
from pipedream2bw.data import check_data
from pipedream2bw.errors import ConfigError


def check(
    cfg: Config,
    *,
    world_size: int,
    num_layers: Optional[int] = None,
    local_world_size: int = 1,
    layers_vocab_size: Optional[int] = None,
) -> List[int]:
    """``validate``, then the data files against the model's vocabulary and sequence length.

    Args:
        cfg, world_size, num_layers, local_world_size: as ``validate`` takes them.
        layers_vocab_size: a layer list's vocabulary as read from its layers (``read_vocab_size``).

    Returns:
        The balance (layers per stage) the run will use, as ``validate`` returns it.

    Raises:
        ConfigError: naming the value, why it is wrong and how to fix it.
    """
    balance = validate(cfg, world_size=world_size, num_layers=num_layers, local_world_size=local_world_size)
    mdl, t = cfg.model, cfg.train
    if cfg.data.packing == "documents" and isinstance(mdl, HFModelConfig):
        _check_hf_documents(mdl)
    if cfg.pipeline.tensor_parallel > 1 and isinstance(mdl, HFModelConfig):
        _check_hf_tensor_parallel(mdl, cfg.pipeline.tensor_parallel, precision=cfg.train.precision)
    vocab = _model_vocab(mdl, layers_vocab_size)
    read = isinstance(mdl, LayerListConfig) and mdl.vocab_size is None and vocab is not None
    vocab_from = "the vocabulary of the model's layers (embedding rows, head outputs)" if read else "model.vocab_size"
    check_data(cfg.data, vocab_size=vocab, seq_len=mdl.seq_len, need_val=t.eval_every > 0, vocab_from=vocab_from)
    return balance


def _check_hf_documents(mdl: HFModelConfig) -> None:
    """data.packing=documents with model=hf: the Llama family (Llama, Mistral, Qwen2).

    Raises:
        ConfigError: GPT-2, in one line with the fix.
    """
    from pipedream2bw.models.hf import resolve_config  # transformers: only for model=hf

    hf = resolve_config(mdl)
    why = "data.packing=documents is proven with model=hf's Llama family (llama, mistral, qwen2), not"
    if hf.model_type == "gpt2":
        raise ConfigError(f"{why} gpt2 (its blocks take no positions or mask here); use llama or data.packing=windows")


def _check_hf_tensor_parallel(mdl: HFModelConfig, t: int, *, precision: str) -> None:
    """pipeline.tensor_parallel = t > 1 with model=hf: the Llama family (models/hf_tensor.py), t dividing its
    attention heads, key-value heads and MLP width, no attention dropout (its masks would be drawn per rank), fp32.

    Raises:
        ConfigError: what does not fit, in one line with the fix.
    """
    from pipedream2bw.models.hf import resolve_config  # transformers: only for model=hf

    c = resolve_config(mdl).config
    key = f"pipeline.tensor_parallel ({t})"
    if c.model_type == "gpt2":
        raise ConfigError(
            f"{key} splits model=hf's Llama family (llama, mistral, qwen2), not gpt2; set pipeline.tensor_parallel=1"
        )
    sizes = {
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % t}
    if bad:
        raise ConfigError(
            f"{key} must divide the model's {', '.join(f'{k} ({v})' for k, v in bad.items())}: ranks split attention "
            "by heads (each its query heads' key-value heads) and the MLP by width; pick a divisor of "
            f"{', '.join(f'{k} ({v})' for k, v in sizes.items())}"
        )
    import torch

    if precision == "bf16" or (precision == "auto" and torch.cuda.is_available()):
        raise ConfigError(
            f"{key} with train.precision ({precision}) and model=hf: the split's partial products, rounded to bf16 "
            "apart, left bf16's tolerance of the reference on a Llama (tests/test_tensor_hf.py); set "
            "train.precision=fp32"
        )
    if getattr(c, "attention_dropout", 0.0):
        raise ConfigError(
            f"{key} with attention dropout ({c.attention_dropout}): each rank would draw the masks of its own heads, "
            "unlike an unsplit run; set model.dropout=0"
        )


def hf_vocab_size(mdl: HFModelConfig) -> int:
    """The vocabulary size of model=hf: its transformers config's ``vocab_size``."""
    from pipedream2bw.models.hf import resolve_config  # transformers: only for model=hf

    return resolve_config(mdl).config.vocab_size


def _model_vocab(mdl: Any, from_layers: Optional[int]) -> Optional[int]:
    """The vocabulary the data must fit: the GPT's ``vocab_size``; a layer list's ``model.vocab_size``, which
    may not exceed what its layers take, else what they take (None: unknown)."""
    if isinstance(mdl, GPTConfig):
        return mdl.vocab_size
    given = hf_vocab_size(mdl) if isinstance(mdl, HFModelConfig) else getattr(mdl, "vocab_size", None)
    if given is not None and given < 1:
        raise ConfigError(f"model.vocab_size ({given}) must be >= 1, or null to read it from the model's layers")
    if given is not None and from_layers is not None and given > from_layers:
        raise ConfigError(
            f"model.vocab_size ({given}) is more than the model's layers take ({from_layers}: its embedding rows or "
            f"head outputs); ids from {from_layers} on would fail inside the model; set model.vocab_size<={from_layers}"
        )
    return given if given is not None else from_layers
