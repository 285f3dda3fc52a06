"""Layer lists from config: the GPT, a transformers model (model=hf) or a user's factory, built whole or by index."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from pipedream2bw.config import GPTConfig, HFModelConfig, LayerListConfig
from pipedream2bw.config.locate import locate
from pipedream2bw.errors import ConfigError
from pipedream2bw.models.gpt import build_gpt_layers, lm_loss


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@dataclass
class ModelSource:
    """How a run gets its layers: ``build(indices)`` makes real layers (all by default), ``meta()``
    the whole list on the meta device (for shapes and ties, no memory), ``loss_fn`` the loss."""

    name: str
    seq_len: int
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    _build: Callable[[Optional[Sequence[int]]], List[nn.Module]]
    by_index: bool  # builds a subset of layers without building the rest
    _meta: Optional[List[nn.Module]] = None
    hf: Any = None  # model=hf: the resolved ``models.hf.HFModel`` (config, name map), for checkpoints and exports
    target: Optional[str] = None  # a user's factory (model._target_): what it builds by index is checked

    def build(self, indices: Optional[Sequence[int]] = None) -> List[nn.Module]:
        """Layers ``indices`` (all by default), with the same weights whichever subset is asked for.

        Raises:
            ConfigError: a user's factory built, for ``indices``, layers other than the whole list's at those
                indices (another type, or other parameter shapes), naming the factory and the first such layer.
        """
        if indices is None or self.by_index:
            layers = self._build(None if indices is None else list(indices))
            if indices is not None and self.target is not None:
                self._check_subset(list(indices), layers)
            return layers
        layers = self._build(None)  # a whole-list factory: build all, keep the slice
        return [layers[i] for i in indices]

    def check_by_index(self) -> None:
        """A user's factory that takes ``indices`` builds the second half of its list on the meta device, to be
        compared with the whole list's: one that ignores them is refused before any process group starts.

        Raises:
            ConfigError: as ``build``.
        """
        n = self.num_layers
        if self.target is None or not self.by_index or n < 2:
            return
        indices = list(range(n // 2, n))
        with torch.device("meta"):
            self.build(indices)

    def _check_subset(self, indices: List[int], layers: List[nn.Module]) -> None:
        """Each of ``layers`` has the type and the tensor shapes of the whole list's layer at its index (issue 35:
        a factory that ignored ``indices`` failed on the first step with a raw shape error)."""
        whole = self.meta()
        for i, layer in zip(indices, layers):
            want, got = _signature(whole[i]), _signature(layer)
            if got != want:
                raise ConfigError(
                    f"model._target_ ({self.target}) built {got[0]} as layer {i} for indices {indices}, where its "
                    f"whole list (indices=None) has {want[0]}{'' if got[0] != want[0] else ' of other shapes'}: with "
                    f"indices, build exactly the whole list's layers at those indices, in order (docs/models.md)"
                )

    def meta(self) -> List[nn.Module]:
        """The whole layer list on the meta device (built once): shapes and shared parameters only."""
        if self._meta is None:
            with torch.device("meta"):
                self._meta = self._build(None)
        return self._meta

    @property
    def num_layers(self) -> int:
        return len(self.meta())


def _signature(layer: nn.Module) -> tuple:
    """(type name, ((tensor name, shape), ...)): what must match between a layer built alone and in the list."""
    return type(layer).__name__, tuple((k, tuple(v.shape)) for k, v in layer.state_dict(keep_vars=True).items())


def read_vocab_size(layers: Sequence[nn.Module], *, lm_head: bool) -> Optional[int]:
    """The vocabulary a layer list takes, read from its modules (meta ones will do): the rows of the
    first layer's first ``nn.Embedding`` (input ids index it) and, when the loss is next-token
    cross-entropy (``lm_head``), the outputs of the last layer's last ``nn.Linear`` (targets index
    its logits); the smaller of those found, None if neither is."""
    embedding = next((m.num_embeddings for m in layers[0].modules() if isinstance(m, nn.Embedding)), None)
    head = next((m.out_features for m in reversed(list(layers[-1].modules())) if isinstance(m, nn.Linear)), None)
    found = [v for v in (embedding, head if lm_head else None) if v is not None]
    return min(found) if found else None


def _checked(layers: Any, target: str) -> List[nn.Module]:
    if not isinstance(layers, (list, tuple, nn.Sequential, nn.ModuleList)):
        raise ConfigError(
            f"model._target_ ({target}) returned {type(layers).__name__}, not a list of nn.Module layers; "
            f"return [layer0, layer1, ...] (each layer takes the previous one's output)"
        )
    layers = list(layers)
    bad = [f"{i}: {type(x).__name__}" for i, x in enumerate(layers) if not isinstance(x, nn.Module)]
    if not layers or bad:
        raise ConfigError(
            f"model._target_ ({target}) returned a list with "
            f"{'no layers' if not layers else 'items that are not nn.Modules: ' + ', '.join(bad[:4])}; "
            f"return a non-empty list of nn.Module layers"
        )
    return layers


def _loss(cfg: LayerListConfig) -> Callable:
    if cfg.loss is None:
        return lm_loss
    obj = locate(cfg.loss, what="model.loss._target_")
    if isinstance(obj, type):
        try:
            return obj(**dict(cfg.loss_kwargs))
        except TypeError as e:
            raise ConfigError(f"model.loss ({cfg.loss}) does not take {dict(cfg.loss_kwargs)}: {e}") from e
    if not callable(obj):
        raise ConfigError(f"model.loss ({cfg.loss}) is {obj!r}, not a callable (output, targets) -> loss")
    return functools.partial(obj, **dict(cfg.loss_kwargs)) if cfg.loss_kwargs else obj


def model_source(model: Any, *, seed: int) -> ModelSource:
    """The layers that ``cfg.model`` describes.

    Raises:
        ConfigError: a factory that does not import or is not callable; ``num_layers``/``meta``
            raise it later for a factory that does not return a list of modules.
    """
    if isinstance(model, GPTConfig):
        return ModelSource(
            name=model.name,
            seq_len=model.seq_len,
            loss_fn=lm_loss,
            by_index=True,
            _build=lambda indices: build_gpt_layers(model, seed=seed, indices=indices),
        )
    if isinstance(model, HFModelConfig):
        return _hf_source(model, seed=seed)
    if not isinstance(model, LayerListConfig):
        raise ConfigError(
            f"model ({model!r}) is neither a GPT config, a model=hf config nor a layer-list factory; use model=gpt, "
            "model=hf or model=custom model._target_=..."
        )
    factory = locate(model.target, what="model._target_")
    if not callable(factory):
        raise ConfigError(
            f"model._target_ ({model.target}) is {factory!r}, not a callable that returns a list of layers"
        )
    kwargs: Dict[str, Any] = dict(model.kwargs)
    if _accepts(factory, "seq_len"):
        kwargs["seq_len"] = model.seq_len
    if _accepts(factory, "seed"):
        kwargs["seed"] = seed
    by_index = _accepts(factory, "indices")

    def build(indices: Optional[List[int]]) -> List[nn.Module]:
        extra = {"indices": indices} if by_index else {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a whole-list factory draws its initial weights in one order on every rank
            try:
                layers = factory(**kwargs, **extra)
            except TypeError as e:
                raise ConfigError(
                    f"model._target_ ({model.target}) could not be called with {sorted({**kwargs, **extra})}: {e}"
                ) from e
        layers = _checked(layers, model.target)
        if indices is not None and len(layers) != len(indices):
            raise ConfigError(
                f"model._target_ ({model.target}) returned {len(layers)} layers for the {len(indices)} indices "
                f"{indices} it was given: with indices, build exactly the whole list's layers at those indices "
                "(docs/models.md)"
            )
        return layers

    return ModelSource(
        name=model.name,
        seq_len=model.seq_len,
        loss_fn=_loss(model),
        by_index=by_index,
        _build=build,
        target=model.target,
    )


def _hf_source(model: HFModelConfig, *, seed: int) -> ModelSource:
    """model=hf: a transformers model's layers, random (seeded per layer) or from ``model.pretrained``,
    whose safetensors headers are checked against the layer list here, before any process group."""
    from pipedream2bw.models import hf_io
    from pipedream2bw.models.hf import build_hf_layers, resolve_config
    from pipedream2bw.pipeline import ties

    hf = resolve_config(model)
    meta = build_hf_layers(hf, seed=seed, meta=True)
    pretrained = None
    if model.pretrained is not None:
        pretrained = hf_io.PretrainedDir(model.pretrained)
        found = ties.find_ties(meta)
        hf_io.check_pretrained(pretrained, hf, hf_io.expected_tensors(hf, meta, found))

    def build(indices: Optional[List[int]]) -> List[nn.Module]:
        indices = list(range(hf.num_layers)) if indices is None else list(indices)
        if pretrained is None:
            return build_hf_layers(hf, seed=seed, indices=indices)
        layers = build_hf_layers(hf, seed=seed, indices=indices, meta=True)  # no memory until the tensors arrive
        hf_io.load_layers(pretrained, hf, layers, indices, ties=found)
        return layers

    return ModelSource(
        name=model.name,
        seq_len=model.seq_len,
        loss_fn=lm_loss,
        by_index=True,
        _build=build,
        _meta=meta,
        hf=hf,
    )
