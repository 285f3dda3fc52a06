"""Tiny transformers models saved with save_pretrained into a directory (nothing downloaded), for model=hf tests."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

import torch

VOCAB = 300  # above the byte-level 256: the shipped corpus's ids fit


def tiny_hf_config(kind: str, *, tied: bool = True):
    """A transformers config of a few KiB of weights: 'llama', 'mistral', 'qwen2' or 'gpt2'."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2Config(
            n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64, tie_word_embeddings=tied,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
    return cls[kind](
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip


def save_tiny(directory: Path, kind: str, *, tied: bool = True, dtype=torch.float32, shard: str = "30KB", seed=0):
    """A random ``kind`` model saved into ``directory`` (sharded at ``shard``); returns the model (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, tied=tied)).to(dtype).eval()
    model.save_pretrained(directory, max_shard_size=shard)
    return model


def read_dir(directory: Path) -> Tuple[Dict[str, torch.Tensor], set]:
    """Every tensor of a save_pretrained directory (all its safetensors files) and the files' names."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out, {f.name for f in files}


class Frozen(torch.optim.Optimizer):
    """An optimizer whose step changes nothing (lr = 0): a run then ends with the weights it loaded."""

    def __init__(self, params, lr: float = 1.0):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None
