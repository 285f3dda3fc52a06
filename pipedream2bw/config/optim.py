"""The optimizer a config names (``optim.name`` or ``optim._target_``), its parameter groups and state."""

from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

from pipedream2bw.config.corrections import concrete
from pipedream2bw.config.locate import locate
from pipedream2bw.config.optimizers import ROTATED, is_muon, is_rotated, takes_matrices
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
            f"optim.name ({name!r}) is not a torch.optim optimizer; use one of {sorted(classes)} or {ROTATED}"
        ) from None


def optimizer_name(cfg: OptimConfig) -> str:
    """What a checkpoint records of the optimizer: ``optim.target`` if set, else ``optim.name`` lower-cased."""
    return cfg.target if cfg.target else cfg.name.lower()


def optimizer_of(cfg: OptimConfig) -> type:
    """The optimizer class ``cfg`` names: optim._target_'s, optim.name's in torch.optim, or the project's
    ``RotatedAdamW`` for optim.name=adamw_rotated (which steps the hidden matrices; AdamW the rest)."""
    if is_rotated(cfg):
        from pipedream2bw.config.rotation import RotatedAdamW

        return RotatedAdamW
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

        muon = is_muon(cfg)
        others = optimizer_class(cfg.muon_others) if muon else optimizer_of(cfg)  # (unused by adamw_rotated)
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
    """optim.name=muon|adamw_rotated or a delay correction: built by ``config.optimizers``."""
    return takes_matrices(cfg) or concrete(cfg) != "none"


PROBE_KINDS = ("muon", "matrix", "vector")
"""What a parameter is to the optimizer, as ``state_keys`` probes it: a matrix Muon steps, another matrix, a vector."""


def probe_kind(param: torch.Tensor) -> str:
    """``param``'s ``PROBE_KINDS`` entry: tagged for Muon (``optimizers.tag_muon_params``), else by its shape."""
    from pipedream2bw.config.optimizers import MUON_ROLE

    if getattr(param, MUON_ROLE, False):
        return "muon"
    return "matrix" if param.dim() >= 2 else "vector"


def _probe(cfg: OptimConfig) -> Tuple[Dict[str, torch.nn.Parameter], torch.optim.Optimizer]:
    """The optimizer of ``cfg`` over one small parameter of each ``PROBE_KINDS``, each with a gradient."""
    from pipedream2bw.config.optimizers import MUON_ROLE

    params = {kind: torch.nn.Parameter(torch.ones(4, 4) if kind != "vector" else torch.ones(4)) for kind in PROBE_KINDS}
    for kind, p in params.items():
        setattr(p, MUON_ROLE, kind == "muon")
        p.grad = torch.full_like(p, 0.5)
    return params, build_optimizer(list(params.values()), cfg)


def state_misfits(cfg: OptimConfig, saved: Iterable[Tuple[str, FrozenSet[str]]]) -> Optional[Dict[str, List[str]]]:
    """Which saved per-parameter optimizer states the optimizer of ``cfg`` cannot step from: ``saved`` holds
    (``probe_kind``, the state's entries) pairs; the answer maps each kind whose state lacks an entry that a step
    reads (Adam with ``amsgrad`` reads ``max_exp_avg_sq``, which Adam without it never made) to the entries it
    lacks. Found by stepping a probe (one small parameter of each kind) from such a state, so it holds for any
    optimizer and settings; an entry a step makes when missing (error feedback's) is no misfit. None when the
    probe cannot step at all (an optimizer that needs a closure or sparse gradients): nothing can be said."""
    try:
        params, opt = _probe(cfg)
        opt.step()
    except Exception:  # noqa: BLE001 - a probe: the run's own optimizer reports its errors where it steps
        return None
    full = {kind: dict(opt.state[p]) for kind, p in params.items()}
    out: Dict[str, List[str]] = {}
    for kind, keys in sorted(set(saved)):
        missing = sorted(set(full[kind]) - set(keys))
        if not keys or not missing or kind in out:
            continue
        params, opt = _probe(cfg)
        opt.state[params[kind]] = {
            k: v.clone() if torch.is_tensor(v) else v for k, v in full[kind].items() if k in keys
        }
        try:
            opt.step()
        except Exception:  # noqa: BLE001 - KeyError ('max_exp_avg_sq'), or whatever the optimizer raises
            out[kind] = missing
    return out
