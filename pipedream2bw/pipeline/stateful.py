"""What layers keep besides parameters: random streams per (layer, microbatch), and buffers that training changes.

Random streams. In a training forward, every layer of a stage draws from torch's default generators (the
CPU's and the stage device's) reseeded just before it runs with ``stream_seed(seed, layer, microbatch)``:
``layer`` is the layer's index in the whole list, ``microbatch`` the index of the microbatch's samples in
the run (``sample_microbatch``: batch t, replica r, microbatch j of m is ``(t*w + r)*m + j``, the same
samples at every layout of the same global batch and microbatch size). The forward runs inside a fork of
the generators (``microbatch_streams``), so the process's own streams never move. Hence a dropout mask
depends on (seed, layer, samples) only, not on the order a schedule runs forwards in: 2bw's early forwards
of batch t+1, a resume, a recomputation (which reseeds the same way) or another partition cannot shift it;
stages draw independent streams (each layer its own, as Megatron offsets each pipeline rank's seed), and
so do replicas (they hold other samples). Saving the generators at the right moment instead would tie
masks to the execution order: they would differ between d=1 and d=2, and every schedule would need its own
moment. The CPU generator (a Mersenne Twister) keeps 32 bits of a seed: two of the 2^32 keys may share a
mask, which is harmless; CUDA's Philox keeps all 64.

Buffers. Which of a module's buffers training changes (BatchNorm's running statistics and counter; not
Llama's rotary caches or a constant table) is found by comparing them around the first training forward
(``BufferWatch``). A recomputed forward restores those buffers afterwards (``RecomputeContexts``), so it does
not count twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn


class StreamKey(NamedTuple):
    """The microbatch a forward runs: its generators are reseeded per layer from (seed, microbatch)."""

    seed: int
    microbatch: int  # sample_microbatch's index
    device: torch.device


_current: contextvars.ContextVar[Optional[StreamKey]] = contextvars.ContextVar("pd2bw_stream", default=None)


def stream_seed(seed: int, layer: int, microbatch: int) -> int:
    """The seed of layer ``layer``'s generators on microbatch ``microbatch`` of a run seeded ``seed``: the first
    63 bits of BLAKE2b("seed/layer/microbatch"), so nearby keys give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{layer}/{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_microbatch(k: int, *, num_microbatches: int, num_replicas: int, replica: int) -> int:
    """The run-wide index of replica ``replica``'s microbatch ``k`` (= t*m + j): ``(t*w + r)*m + j``, which
    names the same samples at every (d, w, m) with the same global batch and microbatch size (the feed's
    replica r takes windows r*m*b .. (r+1)*m*b - 1 of the batch)."""
    t, j = divmod(k, num_microbatches)
    return (t * num_replicas + replica) * num_microbatches + j


class microbatch_streams:  # noqa: N801 - used as a function: ``with microbatch_streams(seed, k, device):``
    """Runs a stage's forward on ``microbatch``: ``StageSequential`` reseeds before each layer; the
    generators (the CPU's, and ``device``'s on CUDA) are restored on exit.

    What ``torch.random.fork_rng`` does for these generators, without its per-call device lookups and
    generator-based context manager: this runs once per forward, on the hot path (issue 47).
    """

    __slots__ = ("_key", "_generators", "_states", "_token")

    def __init__(self, seed: int, microbatch: int, device: torch.device):
        self._key = StreamKey(seed, microbatch, device)
        self._generators = _generators(device)

    def __enter__(self) -> None:
        self._states = [g.get_state() for g in self._generators]
        self._token = _current.set(self._key)

    def __exit__(self, *exc: Any) -> None:
        _current.reset(self._token)
        for g, state in zip(self._generators, self._states):
            g.set_state(state)


def _generators(device: torch.device) -> Tuple[torch.Generator, ...]:
    """The default generators a forward on ``device`` draws from: the CPU's, and the CUDA device's."""
    if device.type != "cuda":
        return (torch.default_generator,)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (torch.default_generator, torch.cuda.default_generators[index])


def current_key() -> Optional[StreamKey]:
    """The microbatch whose forward is running (None outside ``microbatch_streams``: evaluation, tools)."""
    return _current.get()


def reseed(key: Optional[StreamKey], layer: int) -> None:
    """Seeds the CPU generator and ``key``'s device's with ``stream_seed`` of layer ``layer`` (nothing for None)."""
    if key is None:
        return
    s = stream_seed(key.seed, layer, key.microbatch)
    torch.default_generator.manual_seed(s)
    if key.device.type == "cuda":
        index = key.device.index if key.device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(s)


class StageSequential(nn.Sequential):
    """A stage's layers keyed by their global index (``"3"``, ``"4"``, ...): each layer runs on its own random
    stream inside ``microbatch_streams``, and as in ``nn.Sequential`` outside it."""

    def forward(self, x: Any) -> Any:
        key = current_key()
        for name, layer in self._modules.items():
            reseed(key, int(name))
            x = layer(x)
        return x


# ---- buffers


def buffer_values(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Copies of ``module``'s buffers by name (detached clones)."""
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def changed_buffers(module: nn.Module, before: Dict[str, torch.Tensor]) -> List[str]:
    """Names of ``module``'s buffers that differ from ``before`` (``buffer_values``) in value, shape or presence."""
    now = dict(module.named_buffers())
    out = []
    for n in sorted(set(now) | set(before)):
        a, b = before.get(n), now.get(n)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            out.append(n)
    return out


def get_buffer(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    owner, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module)._buffers.get(leaf)


@torch.no_grad()
def set_buffers(module: nn.Module, values: Dict[str, torch.Tensor]) -> None:
    """Writes ``values`` into ``module``'s buffers of those names, in place (tensors sharing them see it)."""
    for n, v in values.items():
        buf = get_buffer(module, n)
        if buf is not None and buf.shape == v.shape:
            buf.copy_(v)
        else:  # the forward replaced or resized it: put the old tensor back
            owner, _, leaf = n.rpartition(".")
            (module.get_submodule(owner) if owner else module)._buffers[leaf] = v


def share_buffers(dst: nn.Module, src: nn.Module) -> None:
    """Points every buffer of ``dst`` (a deep copy of ``src``) at ``src``'s tensor: under 2bw the two weight
    versions hold one set of statistics, updated by every forward in microbatch order, as in one process."""
    sources = dict(src.named_modules(remove_duplicate=False))
    for name, sub in dst.named_modules(remove_duplicate=False):
        for leaf, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[leaf] = sources[name]._buffers[leaf]


class BufferWatch:
    """Finds which buffers of a module training changes: the first training forward runs between
    ``before()`` and ``after()``; ``names`` is None until then."""

    def __init__(self) -> None:
        self.names: Optional[List[str]] = None
        self._before: Optional[Dict[str, torch.Tensor]] = None

    def before(self, module: nn.Module) -> None:
        if self.names is None and module.training:
            self._before = buffer_values(module)

    def after(self, module: nn.Module) -> None:
        if self._before is not None:
            self.names, self._before = changed_buffers(module, self._before), None

    def snapshot(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """Copies of the buffers training changes (empty when none do, or before the first forward)."""
        return {n: get_buffer(module, n).detach().clone() for n in self.names or ()}


@contextlib.contextmanager
def _watched(watch: BufferWatch, module: nn.Module) -> Iterator[None]:
    watch.before(module)
    yield
    watch.after(module)


@contextlib.contextmanager
def _restoring(watch: BufferWatch, module: nn.Module) -> Iterator[None]:
    saved = watch.snapshot(module)
    try:  # also when the recomputation stops early (torch.utils.checkpoint's early stop raises through here)
        yield
    finally:
        set_buffers(module, saved)


class RecomputeContexts:
    """``context_fn`` of ``torch.utils.checkpoint`` for one layer: the forward is watched for the buffers it
    changes (``BufferWatch``); the recomputation puts them back as they were (a BatchNorm's running
    statistics and ``num_batches_tracked`` then count each microbatch once, as without recomputation)."""

    def __init__(self, layer: nn.Module):
        self.layer, self.watch = layer, BufferWatch()

    def __call__(self) -> Tuple[Any, Any]:
        return _watched(self.watch, self.layer), _restoring(self.watch, self.layer)
