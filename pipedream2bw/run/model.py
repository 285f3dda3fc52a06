"""The model a run trains (the caller's layers or a source from config), a stage's module of it, and what a
checkpoint records of the model and the training for a resume to compare."""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn

from pipedream2bw.config import (
    Config,
    OptimConfig,
    optimizer_name,
)
from pipedream2bw.config.optimizers import extra_optim_settings
from pipedream2bw.data.tokens import fingerprint as data_fingerprint
from pipedream2bw.memory import precision as precisions
from pipedream2bw.models import lm_loss
from pipedream2bw.models.factory import ModelSource, model_source, read_vocab_size
from pipedream2bw.pipeline import stateful, ties


class RecomputeSequential(stateful.StageSequential):
    """``StageSequential`` that keeps only each layer's input for backward and re-runs the layer there
    (``pipeline.recompute``) on the same random stream, putting back the buffers it changes (BatchNorm
    statistics count once: ``stateful.RecomputeContexts``); parameter names are those of ``nn.Sequential``."""

    def forward(self, x: Any) -> Any:
        key = stateful.current_key()
        contexts = self.__dict__.setdefault("_recompute_contexts", {})
        for name, layer in self._modules.items():
            if name not in contexts:
                contexts[name] = stateful.RecomputeContexts(layer)
            # A tuple or dict input goes in as its tensors: checkpoint saves tensor arguments (where
            # saved-tensor hooks, i.e. swapping, see them) and keeps anything else as a Python object.
            leaves, spec = pytree.tree_flatten(x)
            x = torch.utils.checkpoint.checkpoint(
                _call_unflattened,
                layer,
                (key, int(name)),
                spec,
                *leaves,
                use_reentrant=False,
                context_fn=contexts[name],
            )
        return x


def _call_unflattened(layer: nn.Module, stream: Tuple[Any, int], spec: Any, *leaves: torch.Tensor) -> Any:
    stateful.reseed(*stream)  # the recomputation, in backward, runs outside the forward's microbatch_streams
    return layer(pytree.tree_unflatten(list(leaves), spec))


def stage_module(
    indices: Sequence[int],
    layers: Optional[Sequence[nn.Module]],
    source: Optional[ModelSource],
    *,
    recompute: bool = False,
    tied: Sequence[ties.Tie] = (),
) -> nn.Sequential:
    """The layers ``indices`` of the whole list as one stage, keyed by global layer index.

    Keys are the layers' positions in the whole list, so parameter names match those of
    ``nn.Sequential(*all_layers)``: a stage's state_dict is a slice of the full model's. Layers
    come from ``layers``, else from ``source``; the names of each of ``tied`` that this stage holds
    refer to one parameter; ``recompute`` (``pipeline.recompute``) re-runs each layer in backward.
    """
    own = [layers[i] for i in indices] if layers is not None else source.build(indices)
    cls = RecomputeSequential if recompute else stateful.StageSequential
    module = cls(OrderedDict((str(i), layer) for i, layer in zip(indices, own)))
    ties.retie(module, tied)
    return module


def build_stage_module(
    cfg: Config,
    balance: Sequence[int],
    stage_index: int,
    layers: Optional[Sequence[nn.Module]],
    *,
    tied: Sequence[ties.Tie] = (),
    source: Optional[ModelSource] = None,
) -> nn.Sequential:
    """Stage ``stage_index``'s module (``stage_module``) of the model ``cfg.model`` describes (or of
    ``layers``, or ``source``) split by ``balance``: for tools and tests that hold a config."""
    start = sum(balance[:stage_index])
    indices = range(start, start + balance[stage_index])
    if layers is None:
        source = source or model_source(cfg.model, seed=cfg.seed)
    return stage_module(indices, layers, source, recompute=cfg.pipeline.recompute, tied=tied)


@dataclasses.dataclass(frozen=True)
class RunModel:
    """The model a run trains: the caller's layer list, else the source that builds it from config;
    its loss and its parameters shared across layers."""

    layers: Optional[Sequence[nn.Module]]
    source: Optional[ModelSource]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    tied: Sequence[ties.Tie]

    @classmethod
    def of(
        cls,
        cfg: Config,
        layers: Optional[Sequence[nn.Module]],
        loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]],
    ) -> "RunModel":
        """The caller's ``layers`` (else ``cfg.model``'s source) with ``loss_fn`` (else the model's) and the
        parameters its layers share, found on every rank before any group."""
        source = None if layers is not None else model_source(cfg.model, seed=cfg.seed)
        if loss_fn is None:
            loss_fn = source.loss_fn if source is not None else model_source(cfg.model, seed=cfg.seed).loss_fn
        if source is not None:
            source.check_by_index()  # a factory that ignores the indices it is given: refused here, not on step 1
        tied = ties.find_ties(layers if layers is not None else source.meta())  # every rank, before any group
        return cls(layers, source, loss_fn, tied)

    @property
    def num_layers(self) -> int:
        return len(self.layers) if self.layers is not None else self.source.num_layers

    def whole(self) -> Sequence[nn.Module]:
        """The whole layer list: the caller's, else built on the meta device (no memory used)."""
        return self.layers if self.layers is not None else self.source.meta()

    def param_shapes(self) -> Dict[str, List[int]]:
        """Names and shapes of the whole model's state, as a checkpoint stores them."""
        return {k: list(v.shape) for k, v in nn.Sequential(*self.whole()).state_dict().items()}

    def vocab_size(self) -> Optional[int]:
        """The vocabulary its layers take (``read_vocab_size``; the head counts under next-token loss)."""
        return read_vocab_size(self.whole(), lm_head=self.loss_fn is lm_loss)

    def settings(self, model_cfg: Any) -> Dict[str, Any]:
        """What a checkpoint records of the model beyond its shapes, for a resume to compare: each layer's
        module types (a structural fingerprint) and, for a model from config, the settings that define it
        (``model.*`` but its name and initialisation: another ``model.num_heads`` has the same shapes)."""
        layers = self.layers if self.layers is not None else self.source.meta()
        record: Dict[str, Any] = {
            "fingerprint": [
                type(layer).__name__
                + "("
                + ", ".join(f"{n}: {type(m).__name__}" for n, m in layer.named_modules() if n)
                + ")"
                for layer in layers
            ]
        }
        if self.layers is None and dataclasses.is_dataclass(model_cfg):
            # not what only starts or exports it: a name, the initialisation, the weights it was started from
            ignored = ("name", "init_std", "pretrained", "export_dtype")
            defining = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in ignored}
            record.update({f"model.{k}": v for k, v in defining.items()})
        return json.loads(json.dumps(record, default=str))  # as the manifest holds it


def training_settings(cfg: Config) -> Dict[str, Any]:
    """What a checkpoint records of the training that a resume must continue unchanged (not the layout:
    a resume at another num_stages or data_parallel is the same training)."""
    o = cfg.optim
    on_cuda = cfg.dist.backend == "nccl" or (cfg.dist.backend == "auto" and torch.cuda.is_available())
    precision = precisions.resolve(cfg.train.precision, "cuda" if on_cuda else "cpu")
    record = {
        "train.precision": precision,
        # what the forwards read: float32 versions, or versions rounded to the compute dtype (under fp32 the same).
        # The checkpoint holds float32 masters either way, but the arithmetic that follows differs, as a
        # train.precision change's does: refused, unless train.resume_strict=false
        "train.weight_dtype": "compute"
        if precisions.weight_dtype(precision, cfg.train.weight_dtype) != torch.float32
        else "fp32",
        # flush, zb1p and gpipe all train W(t+1) = W(t) - step(grad f(W(t))); 2bw uses W(t-1) (the label predates zb1p)
        "pipeline.schedule": "2bw" if cfg.pipeline.schedule == "2bw" else "flush or gpipe",
        **_weight_versions(cfg),
        **optim_settings(o),
        "seed": cfg.seed,  # the batch order: another seed trains on other batches from the resumed step on
        "data.path": data_fingerprint(cfg.data.path),
    }
    if cfg.data.val_path is not None:  # recorded where set: other held-out data makes the validation losses
        # incomparable; adding or dropping it on resume is no change to compare (nothing is recorded without it)
        record["data.val_path"] = data_fingerprint(cfg.data.val_path, key="data.val_path")
    return json.loads(json.dumps(record, default=str))


def _weight_versions(cfg: Config) -> Dict[str, Any]:
    """Under 2bw, pipeline.weight_versions ('batch' or 'newest'), and newest's prediction's optim.predict_horizon. Not
    the layout: under newest a run resumed at another one applies its own rule from the checkpoint's batch on
    (docs/concepts.md), its first early forwards on the checkpoint's previous version, as the run that wrote it would
    have. (A checkpoint written before the horizon existed records none: it is not compared.)"""
    p, o = cfg.pipeline, cfg.optim
    if p.schedule != "2bw":
        return {}
    if p.weight_versions == "newest" and o.delay_correction == "predict":
        return {"pipeline.weight_versions": p.weight_versions, "optim.predict_horizon": o.predict_horizon}
    return {"pipeline.weight_versions": p.weight_versions}


def optim_settings(o: OptimConfig) -> Dict[str, Any]:
    """What ``training_settings`` records of the optimizer (``optim`` and ``optim.*``), as the manifest holds it."""
    record = {
        "optim": optimizer_name(o),
        "optim.kwargs": dict(o.kwargs),
        "optim.no_decay_norms_and_biases": o.no_decay_norms_and_biases,
        "optim.lr": o.lr,
        "optim.scheduler": o.scheduler,
        "optim.warmup_steps": o.warmup_steps,
        "optim.min_lr": o.min_lr,
        **extra_optim_settings(o),  # Muon's and the delay correction's, where set
    }
    return json.loads(json.dumps(record, default=str))
