"""The optimizer a config names (``optim.name`` or ``optim._target_``), its parameter groups and state."""

from __future__ import annotations

import torch

from pipedream2bw.config.locate import locate
from pipedream2bw.config.schema import OptimConfig
from pipedream2bw.errors import ConfigError


def optimizer_class(name: str) -> type:
    """The torch.optim class called ``name`` (case-insensitive).

    Raises:
        ConfigError: no such optimizer in torch.optim.
    """
    classes = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }
    try:
        return classes[name.lower()]
    except KeyError:
        raise ConfigError(
            f"optim.name ({name!r}) is not a torch.optim optimizer; use one of {sorted(classes)}"
        ) from None


def optimizer_name(cfg: OptimConfig) -> str:
    """What a checkpoint records of the optimizer: ``optim.target`` if set, else ``optim.name`` lower-cased."""
    return cfg.target if cfg.target else cfg.name.lower()


def optimizer_of(cfg: OptimConfig) -> type:
    if not cfg.target:
        return optimizer_class(cfg.name)
    cls = locate(cfg.target, what="optim._target_")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            f"optim._target_ ({cfg.target}) is {cls!r}, not a torch.optim.Optimizer subclass; name an optimizer class"
        )
    return cls


def param_groups(params, cfg: OptimConfig) -> list:
    """``params`` as the optimizer takes them: one list, or with ``no_decay_norms_and_biases`` two groups
    (1-D parameters without weight decay). Decided by shape, never by name, so that every stage
    holding a copy of a tied weight puts it in the same group."""
    params = list(params)
    if not cfg.no_decay_norms_and_biases:
        return params
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Builds the optimizer that ``cfg`` names (``target`` or ``name``) over ``params``.

    Raises:
        ConfigError: unknown optimizer, or keyword arguments it does not take.
    """
    if uses_optimizers_module(cfg):
        from pipedream2bw.config.optimizers import build_optimizer as build_extended

        muon = not cfg.target and cfg.name.lower() == "muon"
        others = optimizer_class(cfg.muon_others) if muon else optimizer_of(cfg)
        return build_extended(param_groups(params, cfg), cfg, others=others)
    cls = optimizer_of(cfg)
    try:
        return cls(param_groups(params, cfg), lr=cfg.lr, **dict(cfg.kwargs))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"optim.kwargs ({dict(cfg.kwargs)}) are not valid for {cls.__name__}: {e}; "
            f"fix or remove them (e.g. optim.kwargs={{}})"
        ) from e


# torch.optim optimizers whose update of an element reads only that element (and scalars): they may step shards
ELEMENTWISE_OPTIMIZERS = ("sgd", "adam", "adamw", "nadam", "radam", "adamax", "rmsprop", "adagrad", "adadelta", "rprop")


def uses_optimizers_module(cfg: OptimConfig) -> bool:
    """optim.name=muon or a delay correction: built by ``config.optimizers``."""
    return (not cfg.target and cfg.name.lower() == "muon") or cfg.delay_correction != "none"
