"""Weight streaming (swap.weights): a stage's weights, gradients and optimizer state live in host memory and each
layer's weights visit the device only for its forward and its backward (Harmony, KARMA, LMS; docs/memory.md).

Host side (``StreamedVersions``): every weight version (two under 2bw) is one flat host buffer per layer (pinned on
CUDA; on the CPU allocated outside torch's allocator, as swap.HostPool's buffers are, so that the live tensor bytes
torch.profiler reports stand for the device's), and the replicas' parameters are views into it. Gradients accumulate
over the batch's microbatches in host buffers; the optimizer steps the host masters (``WeightVersions.step``
unchanged) and its state is moved into host buffers after its first step.

Device side (``WeightStream``): microbatch k's forward runs the stage layer by layer; before layer i it takes the
device copy of layer i's weights in the version k's batch uses (``versions.replica_for_batch``), while the copies of
the next ``window`` layers are already on their way (``swap.TransferBackend``: a copy stream on CUDA, a worker
thread on the CPU). The copy enters autograd through ``_ToDevice``, whose backward sends the layer's weight
gradients to the host accumulators: on a GPU each is copied on the offload stream once the backward that made it is
done; a worker thread adds each (on the CPU the gradient itself) once landed, in the order made, off the training
thread; the step first waits for the last (``quiesce``). What autograd saves of a weight copy is replaced by a
reference (saved-tensor hooks, chained with any already active, e.g. activation swapping's), so the copy is freed
when the layer's forward ends; the backward of k fetches the layers it needs in reverse order, ``window`` ahead, and
frees each once autograd has unpacked all it saved of it. With recomputation (``pipeline.recompute``) the layer's
recomputed forward takes its copy in the same reverse order.

Device bytes for weights, gradients and optimizer state: at most ``window`` copies in flight, the copy in use and
one layer's gradients (``device_bytes_model``); every version, accumulator and optimizer state stays on the host.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import asdict, dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from pipedream2bw.memory.host_optim import After, BackgroundStep
from pipedream2bw.memory.sharding import _float, piece_state
from pipedream2bw.memory.swap import HostPool, Transfer, TransferBackend, _Inline
from pipedream2bw.pipeline import stateful
from pipedream2bw.pipeline.versions import WeightVersions, _cpu_copy, grad_of, set_grad, version_of_batch

_ALIGN = 64  # bytes: each parameter of a layer's flat buffer starts here, so any dtype can view it


def device_bytes_model(layer_bytes: Sequence[int], *, window: int) -> int:
    """Peak device bytes of a streamed stage's weights and gradients: the ``window`` largest copies in flight,
    the copy in use and one layer's gradients (optimizer state: none; it is on the host).

    Args:
        layer_bytes: each layer's parameter bytes (as laid out: ``StreamedVersions.layer_bytes``).
        window: swap.weight_prefetch.
    """
    largest = sorted(layer_bytes, reverse=True)
    return sum(largest[: window + 1]) + (largest[0] if largest else 0)


def host_bytes_model(
    layers: Sequence[nn.Module], *, versions: int, optimizer_factor: float, weight_dtype: torch.dtype = torch.float32
) -> int:
    """Host bytes a streamed stage's buffers take once it has stepped (``StreamedVersions``' pool: pinned on CUDA):
    per weight version each layer's flat buffer (its parameters, each 64-byte aligned) and a gradient accumulator per
    parameter, and the optimizer state (``optimizer_factor`` x the parameter bytes: precision.optimizer_state_factor);
    with versions in ``weight_dtype`` other than float32 (train.weight_dtype=compute), the flat buffers in that dtype,
    the accumulators and a master per parameter in float32.

    Args:
        layers: the stage's layers, in float32 (on any device, the meta device too: only shapes are read).
        versions: weight versions held (precision.versions_held: 2 under 2bw).
        optimizer_factor: optimizer state bytes per parameter byte.
    """
    total = 0
    for layer in layers:
        nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        if not nbytes:
            continue
        flat = _layout(layer)[1]
        if weight_dtype != torch.float32:
            with torch.device("meta"):
                flat = _layout(copy.deepcopy(layer).to(device="meta", dtype=weight_dtype))[1]
            total += nbytes  # the float32 masters
        total += versions * (flat + nbytes) + math.ceil(optimizer_factor * nbytes)
    return total


@dataclass
class StreamStats:
    """What a streamed stage moved; goes to summary.json ``ranks[i].stream``."""

    window: int = 0
    layers: int = 0  # layers with parameters
    host_weight_bytes: int = 0  # all versions, in host buffers
    host_buffer_bytes: int = 0  # all host buffers: versions, gradient accumulators, optimizer state
    loads: int = 0  # layer copies to the device
    bytes_in: int = 0
    grad_bytes_out: int = 0  # gradients to the host
    dropped: int = 0  # copies fetched ahead and never used
    eval_loads: int = 0  # of ``loads``: layer copies for validation passes (forward only)
    stall_s: float = 0.0  # compute waiting for a copy (GPU: measured on the compute stream)
    grad_wait_s: float = 0.0  # the training thread waiting for gradients still being copied or added (``_adder``)
    copy_in_s: float = 0.0  # transfer busy time: weights to the device
    copy_out_s: float = 0.0  # gradients to the host (GPU; the CPU's are inline, in compute)


def _layout(layer: nn.Module) -> Tuple[List[Tuple[str, int]], int]:
    """(name, byte offset) of each parameter of ``layer`` in its flat buffer, and the buffer's size."""
    offsets, size = [], 0
    for name, p in layer.named_parameters():
        offsets.append((name, size))
        size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    return offsets, size


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    return flat[offset : offset + n].view(like.dtype).view(like.shape)


def layer_buckets(module: nn.Module) -> List[List[int]]:
    """One optimizer bucket per child of ``module``, last first: the optimizer state a first step makes in
    torch's allocator before it moves to the host is then one layer's."""
    index = {id(p): i for i, p in enumerate(module.parameters())}
    buckets = [[index[id(p)] for p in layer.parameters()] for layer in module.children()]
    return [b for b in reversed(buckets) if b]


class StreamedVersions(BackgroundStep):
    """``WeightVersions`` whose replicas, gradient accumulators and optimizer state are in host memory.

    ``layers[j]``: the j-th child of the stage with parameters, as (its name, its parameter indices);
    ``flats[r][j]``: replica r's flat host buffer of that layer.

    ``background`` (``BackgroundStep``, swap.host_step): the thread copies W(t) into the replica that receives W(t+1)
    and steps it there, layer by layer in forward order, host memory only, while batch t+1 streams the other
    replica's layers; the forward of batch t+2, the first to read W(t+1), waits for each layer's step before that
    layer's copy (``layer_ready``), not for the whole step before its first layer.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        pin: bool,
        buckets: Optional[Sequence[Sequence[int]]] = None,
        weight_dtype: torch.dtype = torch.float32,
        shard_index: int = 0,
        **kwargs,
    ):
        self.pool = HostPool(pin=pin)
        if buckets is None:
            buckets = layer_buckets(module)
        self.weight_dtype, self.shard_index = weight_dtype, shard_index
        self._initial: Optional[List[torch.Tensor]] = None
        if self.float32_masters:  # the masters from the float32 module first; then the versions take their dtype
            self._initial = [p.detach().float() for p in module.parameters()]
            module.to(weight_dtype)
        super().__init__(module, buckets=buckets, **kwargs)
        self._optimizer_of = {i: opt for b, opt in zip(self.buckets, self.optimizers) for i in b}
        self._homed: set = set()  # ids of optimizer state tensors in host buffers
        # the background step's order: one bucket per layer (``layer_buckets``), stepped first layer first, each
        # layer's readiness told to the stream (``layer_ready``); other buckets: in their order, all told at the end
        bucket_of = {tuple(sorted(b)): k for k, b in enumerate(self.buckets)}
        order = [bucket_of.get(tuple(sorted(params))) for _, params in self.layers]
        self._layered = None not in order and len(order) == len(self.buckets)
        self._step_order = order if self._layered else list(range(len(self.buckets)))
        self._layer_steps: List[Future] = []
        if self.float32_masters:  # the float32 sums of each replica's gradients (``grad_of``), as ShardedVersions'
            for replica in self._params:
                for p in replica:
                    p.main_grad = None

    @property
    def float32_masters(self) -> bool:
        """The versions are stored in the compute dtype (train.weight_dtype=compute): the optimizers step float32
        masters of their own, in host buffers, and each gradient is summed in float32 (``main_grad``), as the
        unstreamed run's ``sharding.ShardedVersions`` does; a step rounds the new masters into W(t+1)'s replica."""
        return self.weight_dtype != torch.float32

    def _make_masters(self, module: nn.Module) -> List[nn.Parameter]:
        """Moves every replica's parameters into per-layer host buffers, then aliases them as
        ``WeightVersions`` does (the optimizers step the host replicas in place)."""
        index = {id(p): i for i, p in enumerate(module.parameters())}
        self.layers: List[Tuple[str, List[int]]] = []
        self.flats: List[List[torch.Tensor]] = [[] for _ in self.replicas]
        self.layer_bytes: List[int] = []
        self._offsets: List[List[Tuple[str, int]]] = []
        for name, layer in module.named_children():
            if not any(True for _ in layer.parameters()):
                continue
            offsets, size = _layout(layer)
            self.layers.append((name, [index[id(p)] for p in layer.parameters()]))
            self._offsets.append(offsets)
            self.layer_bytes.append(size)
            for r, replica in enumerate(self.replicas):
                flat = self.pool.get(size)
                for (_, off), p in zip(offsets, replica.get_submodule(name).parameters()):
                    view = _view(flat, off, p)
                    view.copy_(p.detach())
                    p.data = view
                self.flats[r].append(flat)
        # replica 0 is ``module``, whose parameters were just moved: the list of all is rebuilt from it
        self._params = [list(r.parameters()) for r in self.replicas]
        self._grads: Dict[Tuple[int, int], torch.Tensor] = {}
        if self._initial is None:
            return super()._make_masters(module)
        masters = []
        for p, initial in zip(self._params[0], self._initial):
            master = nn.Parameter(torch.empty(0), requires_grad=p.requires_grad)
            master.data = self.pool.get(initial.numel() * 4).view(torch.float32).view(initial.shape)
            master.data.copy_(initial)
            masters.append(master)
        self._initial = None
        return masters

    def step(self, batch_index: int, **kwargs: Any) -> None:
        """``BackgroundStep.step``; the first batch's step in the background is waited for at once: batch 1 runs
        with W(-1) = W(0), on the replica whose host gradient buffers (``add_grad`` reuses them) the step reads."""
        shared = self.background and self.replica_for_batch(batch_index + 1) == self.replica_for_batch(batch_index)
        super().step(batch_index, **kwargs)
        if shared:
            self.settle()

    def _host_work(self, newest: int, dst_index: int, after: After) -> Callable[[], None]:
        self._layer_steps = [Future() for _ in self.layers]  # each set once the thread has stepped that layer
        return lambda: self._host_step(newest, dst_index, after)

    @torch.no_grad()
    def _host_step(self, newest: int, dst_index: int, after: After) -> None:
        """The background thread: W(t) (replica ``newest``) into replica ``dst_index``, each bucket's step there (the
        synchronous step's ``_prepare_destination`` and ``_step_bucket``), then ``after`` on W(t+1) (the float32
        masters, where the versions are in the compute dtype: they hold W(t) and each step rounds into ``dst``)."""
        dst, steps = self._params[dst_index], self._layer_steps
        try:
            for j, b in enumerate(self._step_order):  # layer by layer, first first: as batch t+2's forward reads them
                if not self.float32_masters:
                    for i in self.buckets[b]:
                        dst[i].copy_(self._params[newest][i])
                self._step_bucket(self.buckets[b], self.optimizers[b], dst)
                if self._layered and not steps[j].done():
                    steps[j].set_result(None)
        except BaseException as e:  # the copies waiting for a layer raise it too
            for future in steps:
                if not future.done():
                    future.set_exception(e)
            raise
        for future in steps:
            if not future.done():
                future.set_result(None)
        if after is not None:
            after(self.master if self.float32_masters else dst)

    def layer_ready(self, replica: int, j: int) -> Optional[Future]:
        """What a copy of layer j of ``replica`` waits for: the background step writing that replica until it has
        stepped layer j (None: nothing writes it). Batch t+2's first forward thus takes each layer of W(t+1) as soon
        as step(t) has made it, not once the whole step is done (``module_for_batch`` does not wait)."""
        pending = self._pending
        if pending is None or pending.dst_index != replica or not self._layer_steps:
            return None
        future = self._layer_steps[j]
        return None if future.done() and future.exception() is None else future

    def module_for_batch(self, batch_index: int) -> nn.Module:
        """``WeightVersions.module_for_batch``: the replica a background step is writing is read only through the
        stream, whose copies wait for each layer's step (``layer_ready``)."""
        return WeightVersions.module_for_batch(self, batch_index)

    # -- compute-dtype versions with float32 masters (``float32_masters``) ------------------------

    def _take_gradients(
        self, bucket: Sequence[int], src: Sequence[nn.Parameter], dst: Sequence[nn.Parameter], grad_scale: float
    ) -> None:
        """``WeightVersions._take_gradients`` over the float32 sums (``grad_of``): the masters take them, scaled."""
        if not self.float32_masters:
            return super()._take_gradients(bucket, src, dst, grad_scale)
        grads = [grad_of(src[i]) for i in bucket if grad_of(src[i]) is not None]
        if grads and grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        for i in bucket:
            self.master[i].grad = grad_of(src[i])
            set_grad(src[i], None)

    def _prepare_destination(self, dst_index: int, t: int) -> None:
        """``WeightVersions``'; with float32 masters nothing: they hold W(t), and the step overwrites the replica."""
        if not self.float32_masters:
            super()._prepare_destination(dst_index, t)

    def skip(self, batch_index: int) -> None:
        """``WeightVersions.skip``; the float32 gradient sums are dropped too (the masters hold W(t))."""
        self.settle()
        for p in self.module_for_batch(batch_index).parameters():
            set_grad(p, None)
        super().skip(batch_index)

    def grad_sq_norm(self, shard_grad: Callable[[int], Any], t: int, *, excluded=(), count_whole: bool) -> torch.Tensor:
        """``ShardedVersions.grad_sq_norm`` of an unsharded stage (with float32 masters): batch t's float32 sums,
        last parameter first, the order in which the unstreamed run's buckets count them (the same norm, bit for
        bit); none unless ``count_whole`` (the stage's replica 0)."""
        from pipedream2bw.pipeline.agreement import sq_norm

        params = list(self.module_for_batch(t).parameters())
        grads = [grad_of(params[i]) for i in reversed(range(len(params))) if i not in excluded] if count_whole else []
        return sq_norm([g for g in grads if g is not None])

    def state(self) -> Dict[str, Any]:
        """``WeightVersions.state``; with float32 masters what the unstreamed weight_dtype=compute run saves
        (``ShardedVersions.state``): the versions in float32, and ``shards``, each parameter's float32 master and
        optimizer state whole (written by the stage's replica 0), so that either run resumes from the other."""
        if not self.float32_masters:
            return super().state()
        self.settle()
        newest = max(v for v in self.holds if v is not None)
        previous = None
        if self.schedule == "2bw":
            previous = _float(
                _cpu_copy(self.replicas[self._replica_holding(version_of_batch("2bw", newest))].state_dict())
            )
        return {
            "step": newest,
            "weights": _float(_cpu_copy(self.newest().state_dict())),
            "previous": previous,
            "optimizer": {},
            "shards": self._master_state() if self.shard_index == 0 else {},
        }

    def _master_state(self) -> Dict[str, Dict[str, Any]]:
        """``ShardedVersions.shard_state`` of one whole piece per parameter."""
        out = {}
        for i, ((name, _), master) in enumerate(zip(self.replicas[0].named_parameters(), self.master)):
            out[name] = piece_state(master, self._optimizer_of[i], start=0, stop=master.numel(), numel=master.numel())
        return out

    @torch.no_grad()
    def final_state(self, *, keep: bool = True) -> Optional[Dict[str, torch.Tensor]]:
        """The newest weights at full precision (``ShardedVersions.final_state``): the float32 masters in place of
        the rounded version's parameters; None unless ``keep``."""
        self.settle()
        if not keep:
            return None
        state = _float(_cpu_copy(self.newest().state_dict()))
        for (name, _), master in zip(self.replicas[0].named_parameters(), self.master):
            state[name] = master.detach().to("cpu", copy=True)
        return state

    @torch.no_grad()
    def load_state(self, **state: Any) -> None:
        """``WeightVersions.load_state`` (the versions round what they load to their dtype); with float32 masters,
        these take ``weights`` unrounded (restore hands in the checkpoint's float32 masters as its weights)."""
        super().load_state(**state)
        if self.float32_masters:
            for (name, _), master in zip(self.replicas[0].named_parameters(), self.master):
                master.copy_(state["weights"][name])

    def names(self, j: int) -> List[str]:
        """Layer j's parameter names, relative to the layer (what ``functional_call`` takes)."""
        return [name for name, _ in self._offsets[j]]

    def device_views(self, j: int, flat: torch.Tensor) -> List[torch.Tensor]:
        """Layer j's parameters as views of ``flat``, its flat buffer on the device."""
        return [_view(flat, off, self._params[0][i]) for (_, off), i in zip(self._offsets[j], self.layers[j][1])]

    def add_grad(self, replica: int, i: int, g: torch.Tensor) -> None:
        """Adds one microbatch's gradient of parameter i (on the device, or its host copy) to replica's host
        accumulator, in the order autograd's own accumulation would (the first is copied, the next added)."""
        p = self._params[replica][i]
        acc = grad_of(p)  # float32 sums (``main_grad``) of compute-dtype versions: the first cast, the next added
        if acc is None:
            buf = self._grads.get((replica, i))
            if buf is None:
                dtype = self.master[i].dtype  # the parameter's, or the float32 master's
                raw = self.pool.get(p.numel() * torch.empty(0, dtype=dtype).element_size())
                buf = self._grads[(replica, i)] = raw.view(dtype).view(p.shape)
            buf.copy_(g)
            set_grad(p, buf)
        else:
            acc.add_(g if g.device == acc.device else g.to(acc.device))

    def _detach_master(self, i: int, dst: nn.Parameter) -> None:
        """After its bucket's step: the optimizer state of parameter i moves into host buffers (once: it is
        made lazily by the first step, in torch's allocator, and updated in place afterwards)."""
        super()._detach_master(i, dst)
        if self.float32_masters:  # W(t+1) in the versions' dtype, rounded from the master
            dst.copy_(self.master[i])
        state = self._optimizer_of[i].state.get(self.master[i])
        for key, v in (state or {}).items():
            if torch.is_tensor(v) and id(v) not in self._homed and v.numel() > 0:
                home = self.pool.get(v.numel() * v.element_size()).view(v.dtype).view(v.shape)
                home.copy_(v)
                state[key] = home
                self._homed.add(id(home))

    def host_weight_bytes(self) -> int:
        return sum(f.numel() for flats in self.flats for f in flats)


class _ToDevice(torch.autograd.Function):
    """A layer's device copy as a function of its host parameters: forward hands out the copy (``box``),
    backward sends the gradients to the host accumulators (``sink``) and returns none to autograd."""

    @staticmethod
    def forward(ctx: Any, box: Tuple[Callable, List[torch.Tensor]], *hosts: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.sink = box[0]
        return tuple(v.detach() for v in box[1])  # new tensors (not views of an input) on the copy's storage

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[None, ...]:
        ctx.sink(grads)
        return (None,) * (len(grads) + 1)


class _Ref:
    """What autograd holds for a saved view of a weight copy: its layer record and how to view it again."""

    __slots__ = ("rec", "dtype", "size", "stride", "offset")

    def __init__(self, rec: "_Use", t: torch.Tensor):
        self.rec, self.dtype, self.size, self.stride = rec, t.dtype, t.size(), t.stride()
        self.offset = t.storage_offset()


class _Use:
    """Layer j's copy of replica r as microbatch k's forward used it: saved views to give back in backward."""

    __slots__ = ("key", "packs", "unpacks", "dev")

    def __init__(self, key: Tuple[int, int, int]):
        self.key, self.packs, self.unpacks, self.dev = key, 0, 0, None


class WeightStream:
    """Brings a streamed stage's layers to the device for each forward and backward (module docstring).

    Fetch order is planned per action (``begin_forward``, ``begin_backward``): the keys (k, layer, replica) in
    the order the action takes them; up to ``window`` are issued ahead of the one taken. A take that is not the
    next planned one drops the planned ones before it (a layer whose backward saved nothing), or loads at once.
    """

    def __init__(self, versions: StreamedVersions, backend: TransferBackend, *, window: int, recompute: bool):
        self.versions, self.backend, self.window, self.recompute = versions, backend, window, recompute
        self._plan: Deque[Tuple[int, int, int]] = deque()
        self._issued: Deque[Tuple[Tuple[int, int, int], Transfer]] = deque()
        self._uses: Dict[int, Dict[int, _Use]] = {}  # k -> layer -> its forward's use (no recomputation)
        self._live: Dict[int, Tuple[_Use, Any]] = {}  # storage pointer -> (use, weak ref): copies in this forward
        self._replica_of: Dict[int, int] = {}  # k -> the replica its forward used
        self._contexts: Dict[int, stateful.RecomputeContexts] = {}  # id(layer) -> its recomputation's contexts
        # (k, replica, parameter, the add's future, the host copy or None): added on ``_adder``, not yet reported
        self._grads_out: Deque[Tuple[int, int, int, Future, Optional[Transfer]]] = deque()
        # one thread adds the gradients to the host accumulators, in the order made (the training thread's time went
        # there: 2.4 s of 4 batches on an H200, docs/benchmarks.md); its FIFO keeps each parameter's sum in order
        # (inline where the backend does not overlap: memory tests, whose live bytes then do not depend on timing)
        overlap = getattr(backend, "overlap", True)
        self._adder = ThreadPoolExecutor(1, thread_name_prefix="stream-grads") if overlap else _Inline()
        # ``on_grad(k, replica, i)``: microbatch k's gradient of parameter i is in replica's host accumulator (the
        # data-parallel reduction starts a layer's bucket once the batch's last microbatch has added all of it)
        self.on_grad: Optional[Callable[[int, int, int], None]] = None
        self._eval_k = 0  # validation passes' microbatches, keyed -1, -2, ... (training's k are >= 0)
        self.stats = StreamStats(window=window, layers=len(versions.layers))

    # -- fetching ----------------------------------------------------------------------------

    def _pump(self) -> None:
        while self._plan and len(self._issued) < self.window:
            key = self._plan.popleft()
            self._issued.append((key, self._load(key)))

    def _load(self, key: Tuple[int, int, int]) -> Transfer:
        _, j, r = key
        host = self.versions.flats[r][j]
        self.stats.loads += 1
        self.stats.bytes_in += host.numel()
        ready = self.versions.layer_ready(r, j)  # a background step still writing it (batch t+2's first forward)
        return self.backend.to_device(
            self.backend.landed(host) if ready is None else self.backend.landed_after(host, ready)
        )

    def take(self, key: Tuple[int, int, int]) -> torch.Tensor:
        """The device copy (flat uint8) of layer key[1] of replica key[2] for microbatch key[0]."""
        pre = None
        if any(k == key for k, _ in self._issued):
            while pre is None:
                k, tr = self._issued.popleft()
                if k == key:
                    pre = tr
                else:
                    self._drop(tr)
        else:
            for _, tr in list(self._issued):
                self._drop(tr)
            self._issued.clear()
            if key in self._plan:
                while self._plan.popleft() != key:
                    pass
            pre = self._load(key)
        self._pump()
        return self.backend.consume(pre)

    def _drop(self, tr: Transfer) -> None:
        self.stats.dropped += 1
        self.backend.drop(tr)

    def _begin(self, keys: Sequence[Tuple[int, int, int]]) -> None:
        for _, tr in self._issued:
            self._drop(tr)
        self._issued.clear()
        self._plan = deque(keys)
        self._pump()

    def begin_forward(self, k: int, replica: int) -> None:
        """Microbatch k's forward comes next, with ``replica``'s weights: its first layers start coming."""
        self._begin([(k, j, replica) for j in range(len(self.versions.layers))])

    def begin_backward(self, k: int) -> None:
        """Microbatch k's backward comes next: the layers it needs start coming, last first."""
        if self.recompute:
            r = self._replica_of.get(k, 0)
            self._begin([(k, j, r) for j in reversed(range(len(self.versions.layers)))])
        else:
            uses = self._uses.get(k, {})
            self._begin([uses[j].key for j in sorted(uses, reverse=True) if uses[j].packs])

    def end_backward(self, k: int) -> None:
        """Microbatch k's backward is done: what is left of its copies goes."""
        self._uses.pop(k, None)
        self._replica_of.pop(k, None)
        self._begin([])

    # -- forward -----------------------------------------------------------------------------

    def forward(self, module: nn.Module, k: int, replica: int, x: Any) -> Any:
        """Microbatch k's forward through the stage ``module`` (the replica's) with streamed weights. As the stage's
        own ``StageSequential`` would, each layer runs on its own random stream (dropout masks per layer and
        microbatch) and, recomputed, puts back the buffers its forward changed (``stateful.RecomputeContexts``)."""
        self._replica_of[k] = replica
        self._uses[k] = {}
        stream = stateful.current_key() if isinstance(module, stateful.StageSequential) else None
        with self._hooks():
            j = 0
            for name, layer in module.named_children():
                if stream is not None:
                    stateful.reseed(stream, int(name))
                if j < len(self.versions.layers) and self.versions.layers[j][0] == name:
                    x = self._run_layer(k, j, replica, layer, x)
                    j += 1
                else:  # no parameters: nothing to stream
                    x = self._checkpointed(layer, layer, x) if self.recompute else layer(x)
        self._live.clear()
        return x

    def _checkpointed(self, layer: nn.Module, fn: Callable, x: Any) -> Any:
        """``fn(x)`` (``layer``'s forward) kept for recomputation in backward: on the random stream it ran on (the
        checkpoint restores it), with ``layer``'s buffers put back after the recomputation."""
        if id(layer) not in self._contexts:
            self._contexts[id(layer)] = stateful.RecomputeContexts(layer)
        leaves, spec = pytree.tree_flatten(x)
        return torch.utils.checkpoint.checkpoint(
            lambda *leaves: fn(pytree.tree_unflatten(list(leaves), spec)),
            *leaves,
            use_reentrant=False,
            context_fn=self._contexts[id(layer)],
        )

    def _run_layer(self, k: int, j: int, r: int, layer: nn.Module, x: Any) -> Any:
        key = (k, j, r)
        if self.recompute:  # the recomputation in backward takes the layer again, in backward order
            return self._checkpointed(layer, lambda x: self._call(key, layer, x), x)
        use = self._uses[k][j] = _Use(key)
        return self._call(key, layer, x, use=use)

    def _call(self, key: Tuple[int, int, int], layer: nn.Module, x: Any, *, use: Optional[_Use] = None) -> Any:
        k, j, r = key
        v = self.versions
        flat = self.take(key)
        if use is not None:
            storage = flat.untyped_storage()
            self._live[storage.data_ptr()] = (use, weakref.ref(storage))
        hosts = [v._params[r][i] for i in v.layers[j][1]]
        devs = _ToDevice.apply((lambda grads: self._sink(k, r, j, grads), v.device_views(j, flat)), *hosts)
        del flat
        return torch.func.functional_call(layer, dict(zip(v.names(j), devs)), (x,), strict=False)

    def _sink(self, k: int, r: int, j: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Layer j's gradients of microbatch k, as its backward made them, go to replica r's host accumulators: on a
        GPU each is first copied off the compute stream (``TransferBackend.grad_to_host``), on the CPU it is read
        where the backward made it; a worker thread (``_adder``) then adds each, in the order made, off the training
        thread, which reports them once added (``_settle``)."""
        submitted, held = 0, False
        for i, g in zip(self.versions.layers[j][1], grads):
            if g is None:
                continue
            self.stats.grad_bytes_out += g.numel() * g.element_size()
            copy = self.backend.grad_to_host(g)
            future = self._adder.submit(functools.partial(self._add, r, i, g if copy is None else None, copy))
            self._grads_out.append((k, r, i, future, copy))
            submitted, held = submitted + 1, held or copy is None
        if held:  # the CPU's: the adder holds the gradients themselves, "device" memory; the previous layer's are added
            # by now (the adder had this layer's backward for them): at most two layers' wait. A GPU's gradients are
            # the copy's until its event (the backend's), and the training thread never waits here for the device.
            self._settle(wait=True, keep=submitted)
        self._settle(wait=False)

    def _add(self, r: int, i: int, g: Optional[torch.Tensor], copy: Optional[Transfer]) -> None:
        """On ``_adder``: one gradient into replica r's accumulator of parameter i, once its host copy has landed."""
        with torch.no_grad():  # grad mode is per thread
            if copy is not None:
                copy.wait()
                g = copy.tensor
            self.versions.add_grad(r, i, g)

    def _settle(self, *, wait: bool, keep: int = 0) -> None:
        """Reports the gradients added to the host accumulators (``on_grad``), in the order made, recycling their
        host copies (``wait``: all but the last ``keep``, waiting for the adds still queued): with ``keep`` 0 what
        the host step reads is then complete. An add's error is raised here."""
        while len(self._grads_out) > keep and (wait or self._grads_out[0][3].done()):
            k, r, i, future, copy = self._grads_out.popleft()
            if not future.done():
                t0 = time.perf_counter()
                wait_for([future])
                self.stats.grad_wait_s += time.perf_counter() - t0
            future.result()
            if copy is not None:
                self.backend.recycle(copy, None)
            if self.on_grad is not None:
                self.on_grad(k, r, i)

    # -- validation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, module: nn.Module, x: Any) -> Any:
        """A validation microbatch's forward through the stage ``module`` (the newest replica: ``Evaluator.run``
        hands it in, in eval mode) with streamed weights: each layer's copy comes in ``window`` ahead as in
        training, under no_grad, so nothing is saved, no gradient made and no weight version, accumulator or
        optimizer state touched; the copies are freed as the pass leaves each layer."""
        replica = next(r for r, m in enumerate(self.versions.replicas) if m is module)
        self._eval_k -= 1
        k, v = self._eval_k, self.versions
        self._begin([(k, j, replica) for j in range(len(v.layers))])
        j = 0
        for name, layer in module.named_children():
            if j < len(v.layers) and v.layers[j][0] == name:
                weights = dict(zip(v.names(j), v.device_views(j, self.take((k, j, replica)))))
                x = torch.func.functional_call(layer, weights, (x,), strict=False)
                del weights
                j += 1
            else:
                x = layer(x)
        self._begin([])
        self.stats.eval_loads += j
        return x

    # -- saved-tensor hooks ------------------------------------------------------------------

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        """Saved views of weight copies become ``_Ref``s; anything else goes to the hooks active before
        (activation swapping's, the saved-bytes probe's), as torch applies only the innermost pair."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor) -> Any:
            if type(t) is torch.Tensor and t.layout == torch.strided:
                storage = t.untyped_storage()
                held = self._live.get(storage.data_ptr())
                if held is not None and held[1]() is storage:
                    held[0].packs += 1
                    return _Ref(held[0], t)
            return outer_pack(t) if outer_pack is not None else t

        def unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, _Ref):
                return outer_unpack(packed) if outer_unpack is not None else packed
            use = packed.rec
            if use.dev is None:
                use.dev = self.take(use.key)
            out = torch.empty(0, dtype=packed.dtype, device=use.dev.device).set_(
                use.dev.untyped_storage(), packed.offset, packed.size, packed.stride
            )
            use.unpacks += 1
            if use.unpacks == use.packs:
                use.dev = None  # autograd holds the views it needs; the stream lets go
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def grads_landed(self) -> None:
        """Every gradient copy has landed and been added to the host accumulators: what a norm or finite check of
        the gradients (the step agreement at CLOSE) reads is then whole."""
        self._settle(wait=True)

    def quiesce(self) -> None:
        """Before the host step reads the gradients and writes a replica: every gradient copy has landed and been
        added, and no weight copy from a replica is still in flight."""
        self._settle(wait=True)
        self._begin([])
        if self.backend.device.type == "cuda":
            torch.cuda.synchronize(self.backend.device)

    def close(self) -> Dict[str, Any]:
        """Stops the backend; returns the stats as a dict."""
        self._settle(wait=True)
        self._adder.shutdown(wait=True)
        st = self.stats
        st.host_weight_bytes = self.versions.host_weight_bytes()
        st.host_buffer_bytes = self.versions.pool.allocated_bytes
        st.stall_s = self.backend.stall_s()
        st.copy_out_s, st.copy_in_s = self.backend.busy_s()
        self.backend.close()
        return asdict(st)
