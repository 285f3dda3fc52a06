"""Parameters shared by layers on different stages (tied embeddings): detection, naming, gradient exchange.

A tie is one parameter that several layers use (GPT-2's LM head and token embedding). A layer
lives on one stage, so each stage holding a layer that uses the tie keeps a copy of it. The
copies start equal (the first holder's is broadcast), their gradients are summed across the
holder stages and all replicas by one all-reduce before the step (the usual grad_scale
1/(m*w) then gives "summed over stages, averaged over replicas"), and each holder steps its
copy with its own optimizer on the same gradient and state, so the copies stay bit-identical,
as Megatron's embedding group does.

Names: a tie's canonical name is its first in ``nn.Sequential(*layers).state_dict()`` order
(the first holder stage owns it). Checkpoints store one tensor per tie under that name; final
weights and ``consolidate`` list every name of the tie on that one tensor, as torch's own
``state_dict`` of the tied model does.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tie:
    """One parameter used by several layers: its names in layer order (``names[0]`` canonical)."""

    names: Tuple[str, ...]
    shape: Tuple[int, ...]

    @property
    def canonical(self) -> str:
        return self.names[0]

    @property
    def layers(self) -> Tuple[int, ...]:
        return tuple(sorted({layer_of(n) for n in self.names}))


def layer_of(name: str) -> int:
    """ "5.out.weight" -> 5."""
    return int(name.split(".", 1)[0])


def find_ties(layers: Sequence[nn.Module]) -> List[Tie]:
    """Parameters shared (by identity) by two or more layers of the list, in order of first use.

    Raises:
        ConfigError: sharing the runtime cannot honour: a buffer shared by layers (buffers are
            not exchanged between stages), or distinct parameters of different layers on one
            storage (views of each other; seen on real tensors only, not on the meta device).
    """
    by_param: Dict[int, List[str]] = defaultdict(list)
    params: Dict[int, torch.Tensor] = {}
    buffers: Dict[int, List[str]] = defaultdict(list)
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            by_param[id(p)].append(f"{i}.{name}")
            params[id(p)] = p
        for name, b in layer.named_buffers(remove_duplicate=False):
            buffers[id(b)].append(f"{i}.{name}")
    shared_buffers = [names for names in buffers.values() if len({layer_of(n) for n in names}) > 1]
    if shared_buffers:
        raise ConfigError(
            f"buffers shared by layers ({'; '.join(', '.join(n) for n in shared_buffers[:4])}) cannot be kept in step "
            "across pipeline stages; give each layer its own buffer, or share parameters instead"
        )
    storages: Dict[int, List[str]] = defaultdict(list)
    for key, p in params.items():
        if p.device.type != "meta" and p.numel() > 0:
            storages[p.untyped_storage().data_ptr()].append(by_param[key][0])
    views = [names for names in storages.values() if len({layer_of(n) for n in names}) > 1]
    if views:
        raise ConfigError(
            f"distinct parameters of different layers share memory ({'; '.join(', '.join(n) for n in views[:4])}): "
            "views of one tensor cannot be tied across stages; share the nn.Parameter object itself "
            "(head.weight = embedding.weight)"
        )
    return [
        Tie(tuple(names), tuple(params[key].shape))
        for key, names in by_param.items()
        if len({layer_of(n) for n in names}) > 1
    ]


def holders(tie: Tie, balance: Sequence[int], *, v_schedule: bool = False) -> List[int]:
    """The stages whose layers use ``tie``, first stage first. ``v_schedule`` (zbv): ``balance`` lists 2d chunks and
    rank r runs chunks r and 2d-1-r, so the stages are the ranks' (the GPT's tie, chunks 0 and 2d-1: stage 0 alone,
    one parameter there that both chunks use)."""
    starts = [sum(balance[:s]) for s in range(len(balance))]
    stage_of = lambda layer: max(s for s, start in enumerate(starts) if start <= layer)  # noqa: E731
    found = {stage_of(layer) for layer in tie.layers}
    if v_schedule:
        found = {min(v, len(balance) - 1 - v) for v in found}
    return sorted(found)


def retie(module: nn.Module, ties: Sequence[Tie]) -> None:
    """Makes every name of a tie that ``module`` holds (a stage, keyed by global layer index) refer to
    one parameter: layers built apart (each rank its own) come with copies of their own."""
    for tie in ties:
        here = [n for n in tie.names if n.split(".", 1)[0] in module._modules]
        if len(here) < 2:
            continue
        keep = module.get_parameter(here[0])
        for name in here[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, keep)


def drop_aliases(state: Mapping[str, Any], ties: Sequence[Tie]) -> Dict[str, Any]:
    """``state`` (name -> value) without the non-canonical names of ties: one entry per tie."""
    aliases = {n for tie in ties for n in tie.names[1:]}
    return {k: v for k, v in state.items() if k not in aliases}


def add_aliases(state: Dict[str, Any], ties: Sequence[Tie], *, names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Every name of each tie (or those in ``names``) bound to the canonical entry's value, as the tied
    model's own ``state_dict`` lists them (one tensor, several names)."""
    wanted = None if names is None else set(names)
    for tie in ties:
        if tie.canonical not in state:
            continue
        for alias in tie.names[1:]:
            if wanted is None or alias in wanted:
                state[alias] = state[tie.canonical]
    return state


def describe(ties: Sequence[Tie], balance: Sequence[int], *, v_schedule: bool = False) -> List[Dict[str, Any]]:
    """For logs and summary.json: each tie's names, shape and holder stages (``holders``)."""
    return [
        {"names": list(t.names), "shape": list(t.shape), "stages": holders(t, balance, v_schedule=v_schedule)}
        for t in ties
    ]


class TieExchange:
    """Sums the gradients of this rank's tied copies across every rank holding a copy.

    ``start(t)``: launch the asynchronous all-reduce of batch ``t``'s tied gradients (once its last
    backward is done); ``finish(t)``: wait for it (with the run's timeout) and write the sums back
    into the gradients, right before batch ``t``'s optimizer step. One collective per group of
    ranks (ties with the same holders share it), started in the same order on every member.

    Args:
        comm: module with ``all_reduce_async`` and ``wait_work`` (pipedream2bw.pipeline.comm).
        versions: the stage's ``WeightVersions``; batch t's gradients are in ``module_for_batch(t)``.
        groups: [(process group, [parameter index in the stage module per tie])], in tie order.
        norm_excluded: indices of this stage's tied copies whose canonical copy is on another
            stage: once summed they equal it, so the global gradient norm counts them there only.
    """

    def __init__(
        self,
        comm: Any,
        ctx: Any,
        versions: Any,
        groups: Sequence[Tuple[Any, Sequence[int]]],
        *,
        norm_excluded: Sequence[int] = (),
    ):
        self.comm, self.ctx, self.versions = comm, ctx, versions
        self.norm_excluded = frozenset(norm_excluded)
        self.groups = [(g, list(idx)) for g, idx in groups]
        self._started: Dict[int, List[Tuple[Any, torch.Tensor, List[torch.nn.Parameter]]]] = {}
        self.num_collectives = 0
        self.exposed_s = 0.0  # time finish waited: exchange not hidden behind other work

    def start(self, t: int) -> None:
        params = list(self.versions.module_for_batch(t).parameters())
        started = []
        for group, idx in self.groups:
            ps = [params[i] for i in idx]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
            started.append((self.comm.all_reduce_async(flat, group=group), flat, ps))
            self.num_collectives += 1
        self._started[t] = started

    def finish(self, t: int) -> None:
        start = time.perf_counter()
        for work, flat, ps in self._started.pop(t):
            self.comm.wait_work(self.ctx, work, "tied-parameter gradient all-reduce")
            offset = 0
            for p in ps:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.exposed_s += time.perf_counter() - start


def digest(tensor: torch.Tensor) -> int:
    """A 63-bit digest of the tensor's bytes: equal digests mean bit-identical copies (up to SHA-256 collisions)."""
    data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


class TieChecker:
    """``pipeline.check_ties``: after every step, compares the digests of each tie's copies across all
    ranks holding one (a MIN and a MAX all-reduce); raises on the first step where they differ."""

    def __init__(self, comm: Any, ctx: Any, versions: Any, groups: Sequence[Tuple[Any, Sequence[int], Sequence[str]]]):
        self.comm, self.ctx, self.versions = comm, ctx, versions
        self.groups = [(g, list(idx), list(names)) for g, idx, names in groups]
        self.steps_checked = 0

    def __call__(self, t: int) -> None:
        params = list(self.versions.newest().parameters())
        for group, idx, names in self.groups:
            values = torch.tensor([digest(params[i]) for i in idx], dtype=torch.int64, device=self.ctx.device)
            low, high = self.comm.all_reduce_min_max(values, group=group)
            bad = [n for n, lo, hi in zip(names, low.tolist(), high.tolist()) if lo != hi]
            if bad:
                raise RuntimeError(
                    f"after step {t + 1}: the copies of tied parameters {bad} differ between the stages holding them"
                )
        self.steps_checked += 1
