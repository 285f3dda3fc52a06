"""transformers causal LMs as layer lists (model=hf): Llama, Mistral, Qwen2 and GPT-2, random or pretrained.

The layer list is ``[embedding, decoder layers..., final norm, head]`` (``num_hidden_layers + 3``
layers) built from transformers' own decoder-layer classes, so a stage computes what the
transformers model computes. ``HFModel`` holds the config and the name map between the layer
list's names (``nn.Sequential(*layers)``: ``"3.layer.mlp.up_proj.weight"``) and the Hugging Face
checkpoint's (``"model.layers.2.mlp.up_proj.weight"``), which runs both ways: loading a
``save_pretrained`` directory (``pipedream2bw.models.hf_io``) and exporting to one. With
``tie_word_embeddings`` the head's weight is the token embedding's parameter (one tensor in the
file, ``embed_tokens.weight`` / ``wte.weight``), which the runtime keeps tied across stages.

Rotary embeddings: each decoder layer computes its cos/sin from the positions 0..T-1 itself,
as transformers' model does once for all layers: a few microseconds against a layer's
milliseconds (docs/pretrained.md gives the measured figures), and the stage boundaries carry
the hidden states alone.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.config import HFModelConfig
from pipedream2bw.errors import ConfigError
from pipedream2bw.models import hf_gpt2
from pipedream2bw.models.gpt import document_mask

log = logging.getLogger(__name__)

LLAMA_FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
"""model_type -> class prefix in ``transformers.models.<model_type>.modeling_<model_type>``."""
MODEL_TYPES = (*LLAMA_FAMILY, "gpt2")
DROPOUT_KEYS = (
    "attention_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout",
    "summary_first_dropout",
)
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some checkpoints carry that no model parameter holds (old transformers saved them as buffers).
_IGNORED = {
    "gpt2": (r"\.attn\.bias$", r"\.attn\.masked_bias$", r"\.crossattention\."),
    "*": (r"rotary_emb\.inv_freq$",),
}


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(f"model=hf needs transformers ({e}); install the extra: pip install -e '.[hf]'") from e
    return transformers


def _looks_like_hub_name(value: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", value)) and not value.startswith((".", "/"))


def _local_config_file(model: HFModelConfig) -> Optional[Path]:
    """The config.json that ``model.pretrained`` or ``model.config_path`` names, checked to exist."""
    if model.pretrained is not None:
        directory = Path(model.pretrained)
        if not directory.is_dir():
            hub = (
                " It looks like a Hugging Face hub name: nothing is downloaded here; fetch it first "
                f"(e.g. huggingface-cli download {model.pretrained} --local-dir DIR) and set model.pretrained=DIR"
                if _looks_like_hub_name(model.pretrained)
                else " Point it at a directory written by save_pretrained (config.json + *.safetensors)"
            )
            raise ConfigError(f"model.pretrained ({model.pretrained}) is not a local directory.{hub}")
        file = directory / "config.json"
        if not file.is_file():
            raise ConfigError(f"model.pretrained ({model.pretrained}) has no config.json; is it a save_pretrained dir?")
        return file
    if model.config_path is not None:
        file = Path(model.config_path)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise ConfigError(f"model.config_path ({model.config_path}) is not a config.json file; check the path")
        return file
    return None


@dataclass
class HFModel:
    """A resolved model=hf: the transformers config the layers are built with, the one exported
    (the user's, without the run's overrides), and the name map both ways."""

    config: Any  # transformers PretrainedConfig, with the run's overrides (sdpa, dropout)
    export_config: Dict[str, Any]  # config.json of an export: the model's own config
    seq_len: int
    export_dtype: torch.dtype
    source_dir: Optional[str] = None  # model.pretrained: its tokenizer and generation config go with an export

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def num_blocks(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_layers(self) -> int:
        return self.num_blocks + 3

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def _prefixes(self, index: int) -> List[Tuple[str, str]]:
        """(local prefix in layer ``index``, Hugging Face prefix) pairs of that layer's tensors."""
        gpt2 = self.model_type == "gpt2"
        n = self.num_blocks
        if index == 0:
            return [("wte.", "transformer.wte."), ("wpe.", "transformer.wpe.")] if gpt2 else [
                ("embed_tokens.", "model.embed_tokens.")
            ]  # fmt: skip
        if index <= n:
            return [("block.", f"transformer.h.{index - 1}.")] if gpt2 else [("layer.", f"model.layers.{index - 1}.")]
        if index == n + 1:
            return [("", "transformer.ln_f." if gpt2 else "model.norm.")]
        if index == n + 2:
            return [("", "lm_head.")]
        raise IndexError(f"layer {index} of a {self.num_layers}-layer list")

    def to_hf(self, name: str) -> str:
        """Layer-list name -> Hugging Face name: ``"1.layer.mlp.up.weight"`` -> ``"model.layers.0.mlp.up.weight"``."""
        index, local = name.split(".", 1)
        for ours, theirs in self._prefixes(int(index)):
            if local.startswith(ours):
                return theirs + local[len(ours) :]
        raise KeyError(f"{name} is not a tensor of the {self.model_type} layer list")

    def from_hf(self, name: str) -> Optional[str]:
        """Hugging Face name -> layer-list name, or None for a tensor the layer list has no place for."""
        for index in range(self.num_layers):
            for ours, theirs in self._prefixes(index):
                if name.startswith(theirs) and (theirs.endswith(".") or name == theirs):
                    return f"{index}.{ours}{name[len(theirs) :]}"
        return None

    def ignorable(self, hf_name: str) -> bool:
        """Whether a checkpoint tensor is one that transformers itself ignores on loading (old buffers)."""
        patterns = (*_IGNORED.get(self.model_type, ()), *_IGNORED["*"])
        return any(re.search(p, hf_name) for p in patterns)

    def manifest(self) -> Dict[str, Any]:
        """What a checkpoint records to export itself later (``python -m pipedream2bw.checkpoint export-hf``)."""
        return {
            "config": self.export_config,
            "seq_len": self.seq_len,
            "export_dtype": str(self.export_dtype)[6:],
            "source_dir": self.source_dir,
        }

    @classmethod
    def from_manifest(cls, record: Dict[str, Any]) -> "HFModel":
        """The inverse of ``manifest``: a checkpoint's model, for exporting it."""
        hf = _resolved(
            dict(record["config"]), seq_len=record["seq_len"], dropout=None, export_dtype=record["export_dtype"]
        )
        hf.source_dir = record.get("source_dir")
        return hf


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _resolved(
    config: Dict[str, Any], *, seq_len: int, dropout: Optional[float], export_dtype: Optional[str]
) -> HFModel:
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model=hf builds model_type {list(MODEL_TYPES)}, not {model_type!r}; use one of those (or model=custom "
            "with a factory of your own)"
        )
    _transformers()
    export = _config_class(model_type).from_dict(copy.deepcopy(config))
    run = _config_class(model_type).from_dict(copy.deepcopy(config))
    if dropout is not None:
        for key in DROPOUT_KEYS:
            if hasattr(run, key):
                setattr(run, key, dropout)
    run._attn_implementation = "sdpa"  # causal attention without a mask; eager would need one
    positions = run.max_position_embeddings
    if seq_len > positions:
        raise ConfigError(
            f"model.seq_len ({seq_len}) is more than the model's max_position_embeddings ({positions}); lower "
            f"model.seq_len to {positions} or less"
        )
    window = getattr(run, "sliding_window", None)
    sliding = model_type == "mistral" or "sliding_attention" in (getattr(run, "layer_types", None) or ())
    if sliding and window is not None and seq_len > window:
        raise ConfigError(
            f"model.seq_len ({seq_len}) is more than the sliding attention window ({window}) of this {model_type} "
            f"config, which model=hf does not mask; lower model.seq_len to {window} or less"
        )
    if export_dtype is None:
        export_dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if export_dtype not in EXPORT_DTYPES:
        raise ConfigError(f"model.export_dtype ({export_dtype!r}) is unknown; use one of {list(EXPORT_DTYPES)}")
    export_dict = export.to_dict()
    export_dict["dtype"] = export_dtype
    export_dict.pop("torch_dtype", None)
    return HFModel(config=run, export_config=export_dict, seq_len=seq_len, export_dtype=EXPORT_DTYPES[export_dtype])


def resolve_config(model: HFModelConfig) -> HFModel:
    """The model that ``model`` describes: its transformers config and name map.

    Raises:
        ConfigError: none or two sources given, a path that does not exist (a hub name: nothing is
            downloaded), a model_type not built here, or a seq_len the model cannot take.
    """
    file = _local_config_file(model)
    given = [k for k in ("pretrained", "config_path") if getattr(model, k) is not None]
    if len(given) > 1:
        raise ConfigError(
            "model.pretrained and model.config_path are both set; use model.pretrained alone (it has its config.json)"
        )
    if file is not None:
        if model.config or model.model_type is not None:
            raise ConfigError(
                f"model.{given[0]} gives the model's config.json, and model.model_type/model.config are set too "
                f"({model.model_type}, {dict(model.config)}); drop them (model.config={{}} model.model_type=null)"
            )
        try:
            config = json.loads(file.read_text())
        except ValueError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
    else:
        if model.model_type is None:
            raise ConfigError(
                "model=hf needs a model: model.pretrained=DIR (a save_pretrained directory), model.config_path="
                "config.json, or model.model_type (llama, mistral, qwen2, gpt2) with model.config keys"
            )
        _transformers()
        if model.model_type not in MODEL_TYPES:
            raise ConfigError(f"model.model_type ({model.model_type!r}) is not one of {list(MODEL_TYPES)}")
        try:
            config = _config_class(model.model_type)(**dict(model.config)).to_dict()
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"model.config ({dict(model.config)}) is not a valid {model.model_type} config: {e}"
            ) from e
    hf = _resolved(config, seq_len=model.seq_len, dropout=model.dropout, export_dtype=model.export_dtype)
    hf.source_dir = None if model.pretrained is None else str(Path(model.pretrained).resolve())
    return hf


class TokenEmbedding(nn.Module):
    """The Llama family's token embedding: (B, T) int64 -> (B, T, C); packed documents (data.packing=documents):
    (ids, positions) -> ((B, T, C), positions), which the decoder layers need."""

    def __init__(self, vocab_size: int, hidden_size: int, padding_idx: Optional[int] = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, padding_idx)

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, C) (a tensor rank's vocabulary split overrides it)."""
        return self.embed_tokens(ids)

    def forward(self, idx: Any) -> Any:
        if isinstance(idx, (tuple, list)):
            return self.tokens(idx[0]), idx[1]
        return self.tokens(idx)


class DecoderLayer(nn.Module):
    """One decoder layer of the Llama family on hidden states (B, T, C): rotary cos/sin for positions
    0..T-1 computed here (as transformers' model computes them once), causal attention, no cache. Packed documents:
    (x, positions), the positions (B, T) restarting with each document, give the rotary angles and the
    block-diagonal causal mask (``gpt.document_mask``) as transformers' ``position_ids`` and 4-D
    ``attention_mask``; the positions go on to the next layer, except from the last decoder layer (``last``)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, last: bool = False):
        super().__init__()
        self.layer, self.rotary, self.last = layer, rotary, last

    def forward(self, x: Any) -> Any:
        mask = None
        if isinstance(x, (tuple, list)):
            x, positions = x
            mask = document_mask(positions)  # (B, 1, T, T) bool
        else:
            positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
        cos_sin = self.rotary(x, positions)  # two (B or 1, T, head_dim) in x's dtype, computed in float32
        out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return out if mask is None or self.last else (out, positions)


def _family(model_type: str) -> Dict[str, Any]:
    prefix = LLAMA_FAMILY[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return {k: getattr(module, prefix + k) for k in ("DecoderLayer", "RotaryEmbedding", "RMSNorm")}


def _make_layer(hf: HFModel, index: int, rotary_device: torch.device) -> nn.Module:
    """Layer ``index`` of the list, its parameters on the current default device (meta: no memory)."""
    c, n = hf.config, hf.num_blocks
    if hf.model_type == "gpt2":
        if index == 0:
            return hf_gpt2.Embedding(c.vocab_size, c.n_positions, c.n_embd, c.initializer_range)
        if index <= n:
            return hf_gpt2.Block(c, index - 1)
        if index == n + 1:
            return nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        return hf_gpt2.Head(c.n_embd, c.vocab_size)
    family = _family(hf.model_type)
    if index == 0:
        return TokenEmbedding(c.vocab_size, c.hidden_size, c.pad_token_id)
    if index <= n:
        with torch.device(rotary_device):  # a buffer computed at construction: never on the meta device
            rotary = family["RotaryEmbedding"](c)
        return DecoderLayer(family["DecoderLayer"](c, index - 1), rotary, last=index == n)
    if index == n + 1:
        return family["RMSNorm"](c.hidden_size, eps=c.rms_norm_eps)
    return hf_gpt2.Head(c.hidden_size, c.vocab_size)


def _init(layer: nn.Module, std: float) -> None:
    """transformers-like random init: matrices N(0, std), biases 0, norm scales as constructed (1)."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)


def tie(hf: HFModel, layers: Sequence[nn.Module], indices: Sequence[int]) -> None:
    """With tie_word_embeddings, the head (if built) uses the embedding's weight (if built alongside)."""
    last = hf.num_layers - 1
    if hf.tied and 0 in indices and last in indices:
        emb = layers[list(indices).index(0)]
        layers[list(indices).index(last)].weight = (
            emb.wte.weight if hf.model_type == "gpt2" else emb.embed_tokens.weight
        )


def build_hf_layers(
    hf: HFModel, *, seed: int, indices: Optional[Sequence[int]] = None, meta: bool = False
) -> List[nn.Module]:
    """Layers ``indices`` (all by default) of the model, each randomly initialised from its own seed
    (so any partition starts from the same weights), or with ``meta`` on the meta device, uninitialised
    (for shapes and names, or to be filled by ``pipedream2bw.models.hf_io.load_layers``).

    Returns:
        The layers, in order; with ``tie_word_embeddings`` the head shares the embedding's weight
        when both are built.
    """
    indices = list(range(hf.num_layers) if indices is None else indices)
    layers = []
    for i in indices:
        if meta:
            with torch.device("meta"):
                layer = _make_layer(hf, i, rotary_device=torch.device("cpu"))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + i)
                layer = _make_layer(hf, i, rotary_device=torch.device("cpu"))
                _init(layer, hf.config.initializer_range)
        layers.append(layer)
    tie(hf, layers, indices)
    return layers
