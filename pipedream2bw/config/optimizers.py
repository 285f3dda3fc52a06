"""Muon for the hidden matrices with AdamW for the rest, and the 2bw delay corrections (error feedback, look-ahead).

Each is one ``torch.optim.Optimizer``: its ``param_groups`` and ``state`` are those of the optimizers inside it
(the same dict objects), so the weight versions, the host optimizer, checkpoints (``state_dict`` /
``load_state_dict``, keyed by position over ``param_groups``), the learning-rate schedule (it sets every group's
``lr``) and the step agreements (clip, skip, fp16: they act on the gradients before ``step`` or skip it) treat it
as any torch optimizer. docs/design.md ("Optimizers under the one-step delay") states what each computes.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.config.corrections import FEEDBACK, PREDICTING, concrete, is_muon  # noqa: F401 (re-exported)

MUON_ROLE = "_pd2bw_muon"
"""The attribute ``tag_muon_params`` sets on each parameter: True for Muon, False for the other optimizer."""

TENSOR_SPLIT = "_pd2bw_tensor_split"
"""The attribute a parameter split across a tensor group carries (pipeline.tensor_parallel; run/tensor.py sets it):
an object whose ``whole(piece)`` gathers the whole tensor from every tensor rank's piece (a collective over the group:
each of its ranks calls it, in the same order) and ``piece(whole)`` cuts this rank's piece of a whole tensor. Muon
orthogonalizes the whole matrix through it; elementwise optimizers never read it."""

PARAM_TAGS = (MUON_ROLE, TENSOR_SPLIT)
"""The attributes a parameter carries for its optimizer, which the weight versions copy onto the masters it steps."""

EF_STATE = "ef_prev_update"
"""The error-feedback state of a parameter: the update u(t-1) its optimizer made at the previous step."""

PREDICT_STATE = "predict_last_update"
"""The weight prediction's state of a parameter: d(t-1) = W(t) - W(t-1), the update its last step applied, which
the weights it holds between steps carry added (they hold the prediction W(t) + d(t-1) of W(t+1))."""

LOOKAHEAD_MOMENTUM = 0.99
"""beta1 of the look-ahead (NAdamW) and Muon's momentum under it: Ajanthan et al.'s run.bash (``--momentum 0.99
--optimizer nadamw``)."""


ROTATED = "adamw_rotated"
"""optim.name of AdamW in a rotated basis for the hidden matrices (config/rotation.py), AdamW for the rest."""


def is_rotated(cfg) -> bool:
    """Whether ``cfg`` (an ``OptimConfig``) names AdamW in a rotated basis (``optim.name=adamw_rotated``)."""
    return not cfg.target and cfg.name.lower() == ROTATED


def takes_matrices(cfg) -> bool:
    """Whether ``cfg``'s optimizer steps the hidden matrices apart (Muon, the rotation): parameters are tagged."""
    return is_muon(cfg) or is_rotated(cfg)


def correction_in_effect(cfg, schedule: str) -> str:
    """``cfg.delay_correction`` where it runs: under 2bw; ``none`` under flush and gpipe, whose gradients are taken
    at the weights they update (no delay to correct)."""
    return concrete(cfg) if schedule == "2bw" else "none"


def muon_edge_layers(num_layers: int) -> Tuple[str, ...]:
    """The names (global layer indices, as a stage module keys its layers) of the model's input and output layers:
    the first layer of the list (embeddings, an input projection) and the last (the output projection)."""
    return tuple(dict.fromkeys(("0", str(num_layers - 1))))


def muon_param_roles(module: nn.Module, exclude: Sequence[str], *, edge_layers: Sequence[str] = ()) -> Dict[int, bool]:
    """id(parameter) -> True where Muon steps it: a 2-D parameter of a hidden layer (not one of ``edge_layers``, the
    top-level children of ``module`` that are the model's first and last layers: ``muon_edge_layers``), none of
    whose names, nor the class names of the modules on its path (e.g. ``LMHead``, ``Linear``), match a pattern of
    ``exclude`` (fnmatch, case-sensitive). The rest (the input and output layers whatever their classes, norms,
    biases) go to the other optimizer: Muon is for hidden matrices only. A parameter held by several modules (a
    tie) is Muon's only if every holder says so."""
    roles: Dict[int, bool] = {}
    edges = set(edge_layers)

    def walk(mod: nn.Module, prefix: str, classes: List[str], edge: bool) -> None:
        classes = classes + [type(mod).__name__]
        for name, p in mod.named_parameters(recurse=False):
            labels = [prefix + name] + classes
            muon = p.dim() == 2 and not edge and not any(fnmatch.fnmatchcase(x, pat) for x in labels for pat in exclude)
            roles[id(p)] = roles.get(id(p), True) and muon
        for child_name, child in mod.named_children():
            walk(child, f"{prefix}{child_name}.", classes, edge or (not prefix and child_name in edges))

    walk(module, "", [], False)
    return roles


def tag_muon_params(module: nn.Module, exclude: Sequence[str], *, edge_layers: Sequence[str] = ()) -> None:
    """Marks each parameter of ``module`` for Muon (True) or the other optimizer (False): ``muon_param_roles``."""
    roles = muon_param_roles(module, exclude, edge_layers=edge_layers)
    for p in module.parameters():
        setattr(p, MUON_ROLE, roles[id(p)])


class CompositeOptimizer(torch.optim.Optimizer):
    """An optimizer made of ``children``: its ``param_groups`` are theirs, in order, and all of them share its
    ``state`` (keyed by parameter, so they never collide). ``state_dict``/``load_state_dict`` are torch's over
    that union; a load replaces the group dicts and the state, which are then handed back to the children."""

    def __init__(self, children: Sequence[torch.optim.Optimizer]):
        self._children = list(children)
        groups = [g for c in self._children for g in c.param_groups]
        super().__init__(groups, defaults={})  # appends the same group dicts
        for c in self._children:
            self.state.update(c.state)
        self._link()

    def _link(self) -> None:
        i = 0
        for c in self._children:
            n = len(c.param_groups)
            c.param_groups = self.param_groups[i : i + n]
            c.state = self.state
            if isinstance(c, CompositeOptimizer):
                c._link()
            i += n

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def _inner_step(self) -> None:
        for c in self._children:
            c.step()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "closures are not supported"
        self._inner_step()


NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
"""Muon's ``ns_dtype`` (optim.muon_kwargs.ns_dtype): the dtype of its Newton-Schulz iteration; 'auto' is bfloat16 on a
GPU (torch.optim.Muon's, always) and float32 elsewhere."""


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the dtype of its Newton-Schulz iteration chosen per gradient (``ns_dtype``): torch's
    runs it in bfloat16 everywhere, which a CPU without bfloat16 matrix units emulates at 10 to 20 times float32's
    cost (a 128 x 512 gradient: 93 ms against 4 ms, one thread, this project's 2-core machine, 2026-11-26). 'auto'
    keeps torch's bfloat16 on CUDA and takes float32 elsewhere; 'bfloat16' is torch's step bit for bit (tested).
    The state (``momentum_buffer``) and the update are torch's.

    ``ns_device`` (``orthogonalize_on``): where the Newton-Schulz iteration runs when the parameters and their state
    live in host memory (swap.optimizer=host, swap.weights): each momentum matrix goes to that device, is
    orthogonalized there (in the dtype 'auto' picks for it) and comes back, so that the host never runs the matrix
    iterations; None: where the parameter is."""

    def __init__(self, params: Iterable, *, ns_dtype: str = "auto", **kwargs: Any):
        if ns_dtype != "auto" and ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype {ns_dtype!r} is not one of {['auto', *NS_DTYPES]}")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.ns_device: Any = None

    def _dtype(self, grad: torch.Tensor) -> torch.dtype:
        if self.ns_dtype == "auto":
            return torch.bfloat16 if grad.is_cuda else torch.float32
        return NS_DTYPES[self.ns_dtype]

    def _orthogonalized(self, update: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
        """torch's _zeropower_via_newtonschulz of ``update`` in ``_dtype``'s dtype, on ``ns_device`` if set."""
        a, b, c = group["ns_coefficients"]
        if self.ns_device is not None:  # host-resident state: the matrix iterations run on the device
            update = update.to(self.ns_device)
        x = update.to(self._dtype(update))
        if update.size(0) > update.size(1):
            x = x.T
        x = x.div(x.norm().clamp(min=group["eps"]))
        for _ in range(group["ns_steps"]):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if update.size(0) > update.size(1):
            x = x.T
        return x

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch's)
        assert closure is None, "closures are not supported"
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                split = getattr(p, TENSOR_SPLIT, None)
                if split is not None:  # a piece of a matrix split over a tensor group: orthogonalize the whole one
                    update = split.whole(update)  # an all-gather; every tensor rank then computes the same x
                x = self._orthogonalized(update, group).to(p.device)  # (back to the host: the device step adds it)
                rows, cols = update.shape[:2]  # torch's _adjust_lr, on the whole matrix's shape
                ratio = {
                    "original": math.sqrt(max(1, rows / cols)),
                    "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
                }
                if split is not None:
                    x = split.piece(x)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(x, alpha=-lr * ratio.get(group["adjust_lr_fn"] or "original", 1.0))
        return None


def orthogonalize_on(optimizer: torch.optim.Optimizer, device: Any) -> int:
    """Sets ``Muon.ns_device`` of every ``Muon`` inside ``optimizer`` (through ``CompositeOptimizer`` children) to
    ``device``; returns how many it set."""
    if isinstance(optimizer, Muon):
        optimizer.ns_device = device
        return 1
    return sum(orthogonalize_on(c, device) for c in getattr(optimizer, "_children", ()))


class MuonWithOthers(CompositeOptimizer):
    """``Muon`` (torch.optim.Muon's step) for the parameters tagged for it (``tag_muon_params``), ``others`` for the
    rest; both at the same ``lr`` (Muon with ``adjust_lr_fn='match_rms_adamw'`` by default, so an AdamW learning
    rate suits both: Moonlight's scaling, update RMS 0.2 * sqrt(max(rows, cols)) times Muon's)."""

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float,
        muon_kwargs: Dict[str, Any],
        others: type,
        others_kwargs: Dict[str, Any],
    ):
        muon_groups, other_groups = split_by_role(params)
        kw = {"adjust_lr_fn": "match_rms_adamw", **muon_kwargs}
        children = []
        if muon_groups:
            children.append(Muon(muon_groups, lr=lr, **kw))
        if other_groups:
            children.append(others(other_groups, lr=lr, **others_kwargs))
        super().__init__(children)


def split_by_role(params: Iterable) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``params`` (params or param groups) as (groups of the matrices tagged for Muon or the rotation, groups of the
    rest), each group keeping its other settings."""
    tagged_groups, other_groups = [], []
    for g in _groups(params):
        untagged = [p for p in g["params"] if p.dim() == 2 and not hasattr(p, MUON_ROLE)]
        assert not untagged, "optim.name=muon|adamw_rotated: tag the parameters first (optimizers.tag_muon_params)"
        extra = {k: v for k, v in g.items() if k != "params"}
        tagged = [p for p in g["params"] if getattr(p, MUON_ROLE, False)]
        rest = [p for p in g["params"] if not getattr(p, MUON_ROLE, False)]
        if tagged:
            tagged_groups.append({"params": tagged, **extra})
        if rest:
            other_groups.append({"params": rest, **extra})
    return tagged_groups, other_groups


class RotatedWithAdamW(CompositeOptimizer):
    """``RotatedAdamW`` (config/rotation.py) for the matrices tagged as Muon's would be (``tag_muon_params``: the
    hidden matrices, not optim.muon_exclude's), torch's AdamW for the rest; one ``lr`` and optim.kwargs for both."""

    def __init__(self, params: Iterable, *, lr: float, kwargs: Dict[str, Any], rotation: Dict[str, Any]):
        from pipedream2bw.config.rotation import RotatedAdamW

        tagged_groups, other_groups = split_by_role(params)
        children: List[torch.optim.Optimizer] = []
        if tagged_groups:
            children.append(RotatedAdamW(tagged_groups, lr=lr, **kwargs, **rotation))
        if other_groups:
            children.append(torch.optim.AdamW(other_groups, lr=lr, **kwargs))
        super().__init__(children)


class ErrorFeedback(CompositeOptimizer):
    """Error feedback on the one-step delay (after Zmushko et al., arXiv 2606.30634, section 3), around any
    optimizer ``inner``: with u(t) the update ``inner`` makes at step t (W(t) -> W(t) + u(t)), from a gradient
    taken at W(t-1), the update applied is

        W(t+1) = W(t) + u(t) + beta * (u(t) - u(t-1))

    u(t) - u(t-1) estimates the error of the previous step: u(t) is computed from a gradient at W(t-1), the point
    step t-1 should have used. u(-1) is taken as u(0) (no correction at the first step). Per parameter it keeps
    u(t-1) (float32, the master's size: ``EF_STATE`` in the optimizer state, saved in checkpoints); a step that is
    skipped (``step`` not called) leaves it as it was. Elementwise, so it shards with the masters."""

    def __init__(self, inner: torch.optim.Optimizer, *, beta: float):
        self.beta = beta
        self.correcting = True  # off: the step records u(t) but adds no correction (``delay_corrected``)
        super().__init__([inner])

    def _inner_step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        # One full-size temporary (three made the step's peak 8 B a parameter higher): it becomes -u(t), then u(t)
        before = [p.detach().clone() for p in params]
        self._children[0].step()
        if not params:
            return
        data = [p.detach() for p in params]
        neg_updates = before
        torch._foreach_sub_(neg_updates, data)  # -u(t) = W(t) - (W(t) + u(t)), exactly -(u(t))
        prev = [self.state[p].get(EF_STATE) for p in params]
        # u(-1) = u(0): nothing at the first step; nothing at a step without delay (pipeline.sync_warmup_steps)
        corrected = [(p, q) for p, q in zip(data, prev) if q is not None and self.correcting]
        if corrected:
            # W += beta * (u(t) - u(t-1)), as W -= beta * (u(t-1) - u(t)): the same bits (a sign flip is exact), with
            # u(t-1)'s buffer holding the difference (it is replaced below)
            q_list = [q for _, q in corrected]
            torch._foreach_add_(q_list, [n for n, q in zip(neg_updates, prev) if q is not None])
            torch._foreach_add_([p for p, _ in corrected], q_list, alpha=-self.beta)
        torch._foreach_neg_(neg_updates)
        for p, u in zip(params, neg_updates):
            self.state[p][EF_STATE] = u


class WeightPrediction(CompositeOptimizer):
    """Weight prediction for the forward (PipeMare, SpecTrain; PipeOptim, arXiv 2312.00839), around any optimizer
    ``inner``: between steps its parameters hold a prediction of the next weights, P(t) = W(t) + d(t-1), with
    d(t-1) = W(t) - W(t-1) the update the last step applied (the last applied update taken as the next one). Under
    2bw the version batch t+1 reads is then P(t), a prediction of the W(t+1) its gradient is applied to, in the
    replica that held W(t): no more weight memory. A step recovers W(t) = P(t) - d(t-1), steps it to W(t+1),
    keeps d(t) = W(t+1) - W(t) and leaves P(t+1) = W(t+1) + d(t) (float32 round-off in both, which the reference
    repeats). Costs 4 bytes per parameter (d, ``PREDICT_STATE``, saved in checkpoints), three elementwise passes and
    one full-size temporary per step. ``predicting`` false (the version the step makes is read by a batch without
    delay: pipeline.sync_warmup_steps) leaves W(t+1) and keeps no d. ``weights`` gives W from P."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.predicting = True
        super().__init__([inner])

    def _inner_step(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        data = [p.detach() for p in params]
        held = [(p, self.state[q][PREDICT_STATE]) for p, q in zip(data, params) if PREDICT_STATE in self.state[q]]
        if held:  # P(t) -> W(t)
            torch._foreach_sub_([p for p, _ in held], [d for _, d in held])
        before = [p.clone() for p in data]
        self._children[0].step()
        if not params:
            return
        if not self.predicting:
            for q in params:
                self.state[q].pop(PREDICT_STATE, None)
            return
        torch._foreach_sub_(before, data)  # -d(t) = W(t) - W(t+1)
        torch._foreach_neg_(before)
        torch._foreach_add_(data, before)  # P(t+1) = W(t+1) + d(t)
        for q, d in zip(params, before):
            self.state[q][PREDICT_STATE] = d


def predicts(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds a ``WeightPrediction`` (through ``CompositeOptimizer`` children)."""
    return isinstance(optimizer, WeightPrediction) or any(predicts(c) for c in getattr(optimizer, "_children", ()))


def predicted_offsets(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[nn.Parameter]) -> List[Any]:
    """d(t-1) of each of ``params`` (the optimizers' own parameter objects), or None where its weights hold no
    prediction: W = P - d."""
    state: Dict[Any, Any] = {}
    for opt in optimizers:
        state.update({k: v for k, v in opt.state.items() if PREDICT_STATE in v})
    return [state[p][PREDICT_STATE] if p in state else None for p in params]


def delay_corrected(optimizer: torch.optim.Optimizer, *, now: bool, next: bool) -> None:
    """Turns the delay corrections inside ``optimizer`` (through ``CompositeOptimizer`` children) on or off for its
    next step: error feedback with ``now`` (batch t's gradient was delayed: off on the synchronous steps of
    pipeline.sync_warmup_steps, where it still records u(t), the u(t-1) of the first corrected step); the weight
    prediction with ``next`` (the version the step makes is read by delayed batches only)."""
    if isinstance(optimizer, ErrorFeedback):
        optimizer.correcting = now
    if isinstance(optimizer, WeightPrediction):
        optimizer.predicting = next
    for child in getattr(optimizer, "_children", ()):
        delay_corrected(child, now=now, next=next)


def _groups(params: Iterable) -> List[Dict[str, Any]]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def build_optimizer(groups: List[Any], cfg, *, others: type) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` (an ``OptimConfig``) with Muon and/or a delay correction over ``groups`` (params or
    param groups, as ``config.optim.param_groups`` gives them): ``others`` is the torch optimizer class for what
    Muon does not take (optim.muon_others), or the one optim.name names. ``config.optim.build_optimizer`` calls it.

    Raises:
        ConfigError: keyword arguments the optimizers do not take.
    """
    from pipedream2bw.errors import ConfigError

    correction = concrete(cfg)
    lookahead = correction == "lookahead"
    kwargs = dict(cfg.kwargs)
    muon = is_muon(cfg)
    if lookahead:  # AdamW -> NAdamW with beta1 0.99 (validated: others is AdamW)
        others = torch.optim.NAdam
        betas = tuple(kwargs.pop("betas", (LOOKAHEAD_MOMENTUM, 0.999)))
        kwargs = {
            "betas": (LOOKAHEAD_MOMENTUM, betas[1]),
            "weight_decay": kwargs.pop("weight_decay", 1e-2),  # AdamW's default
            "decoupled_weight_decay": True,
            **kwargs,
        }
    try:
        if is_rotated(cfg):
            rotation = {"rotation_every": cfg.rotation_every, "rotation_beta": cfg.rotation_beta}
            opt = RotatedWithAdamW(groups, lr=cfg.lr, kwargs=kwargs, rotation=rotation)
        elif muon:
            muon_kwargs = dict(cfg.muon_kwargs)
            if lookahead:
                muon_kwargs.update(momentum=LOOKAHEAD_MOMENTUM, nesterov=True)
            Muon([torch.zeros(2, 2)], lr=cfg.lr, **muon_kwargs)  # its kwargs, checked even with no matrix
            opt: torch.optim.Optimizer = MuonWithOthers(
                groups, lr=cfg.lr, muon_kwargs=muon_kwargs, others=others, others_kwargs=kwargs
            )
        else:
            opt = others(groups, lr=cfg.lr, **kwargs)
    except (TypeError, ValueError) as e:
        if not muon:  # the message config.optim.build_optimizer gives without a correction
            raise ConfigError(
                f"optim.kwargs ({dict(cfg.kwargs)}) are not valid for "
                f"{cfg.name if is_rotated(cfg) else others.__name__}: {e}; "
                f"fix or remove them (e.g. optim.kwargs={{}})"
            ) from e
        raise ConfigError(
            f"optim.kwargs ({dict(cfg.kwargs)}) or optim.muon_kwargs ({dict(cfg.muon_kwargs)}) are not valid for "
            f"{cfg.target or cfg.name}: {e}; fix or remove them"
        ) from e
    if correction in FEEDBACK:
        opt = ErrorFeedback(opt, beta=cfg.error_feedback_beta)
    if correction in PREDICTING:  # around error feedback: d(t) is the update it applied, corrected
        opt = WeightPrediction(opt)
    return opt


def extra_optim_settings(cfg) -> Dict[str, Any]:
    """What a checkpoint records of Muon and the delay correction, beside the optimizer's name and kwargs: only
    what differs from the default, so checkpoints written before these settings existed still match (a reader takes
    an unrecorded correction as ``corrections.RECORDED_OFF_DEFAULT`` says)."""
    out: Dict[str, Any] = {}
    if concrete(cfg) != "none":
        out["optim.delay_correction"] = cfg.delay_correction
        if cfg.delay_correction in FEEDBACK:
            out["optim.error_feedback_beta"] = cfg.error_feedback_beta
    if is_rotated(cfg):
        out.update(
            {
                "optim.rotation_every": cfg.rotation_every,
                "optim.rotation_beta": cfg.rotation_beta,
                "optim.muon_exclude": list(cfg.muon_exclude),
            }
        )
    if is_muon(cfg):
        out.update(
            {
                "optim.muon_kwargs": dict(cfg.muon_kwargs),
                "optim.muon_others": cfg.muon_others.lower(),
                "optim.muon_exclude": list(cfg.muon_exclude),
            }
        )
    return out
