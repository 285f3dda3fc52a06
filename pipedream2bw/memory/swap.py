"""Activation offload: the saved tensors of microbatches waiting for their backward go to host memory and back.

Under 1F1B, stage ``s`` holds what autograd saved for up to ``d - s`` microbatches that wait
for their backward. A ``SwapManager`` packs those saved tensors (``saved_tensors_hooks``),
copies the large ones to pooled host buffers while the forward goes on, and brings them back
ahead of their backward: backwards run in microbatch order, so when the backward of ``k``
starts, the next ``resident`` microbatches to be backwarded are fetched (docs/design.md section 5).

Transfers go through a ``TransferBackend``: ``CudaBackend`` (pinned buffers, one copy stream
each way, events) or ``CpuBackend`` (worker threads, so that the whole mechanism, overlap
included, runs and is tested on a machine without a GPU).

Units of transfer are storages, not tensors: the saved tensors that share one storage (q, k
and v are views of one qkv output) move once, and come back as views with their original
offset and strides, so the backward reads the same bytes in the same layout and results are
bit for bit those of a run without swapping.

Memory: the manager holds no strong reference to a device storage it sends out: the forward
code and autograd drop it as they would without swapping, and the backend keeps it only until
its copy has read it (a worker thread's reference on the CPU) or, on CUDA, until the manager
releases it: when its copy has landed, or when the budget wants its bytes, with the compute
stream then waiting for the copy on the GPU (no host wait: the GPU's queue is never drained). A
copy back is dropped by the manager once autograd has unpacked every tensor of it, so it lives
exactly as long as the backward nodes that read it. Nothing of a record outlives its
microbatch's backward (no reference cycles: the cyclic garbage collector, which runs rarely,
would otherwise decide when device memory is freed). Bytes are moved as flat uint8, whatever
the dtype (float32, bf16 or fp16 under ``torch.autocast``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

log = logging.getLogger(__name__)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of ``t``'s storage (what a transfer moves)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostPool:
    """Host buffers for reuse, by exact size: a stage's microbatches save the same shapes every
    time, so after the first microbatches every offload finds a free buffer (pinning is slow)."""

    def __init__(self, *, pin: bool):
        self.pin = pin
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self.allocated_bytes += nbytes
        if not self.pin:
            # Host buffers of the CPU backend come from Python, not torch's allocator: as pinned
            # memory is outside the CUDA allocator's counts, they are then outside the live tensor
            # bytes that torch.profiler reports, which stand for the device's.
            return (
                torch.frombuffer(bytearray(nbytes), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class Transfer:
    """A copy in progress: ``ready()`` polls, ``wait()`` blocks until it is done."""

    def ready(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError


class TransferBackend:
    """Asynchronous copies of flat uint8 tensors between the device and pooled host buffers.

    ``to_host(src)`` returns a transfer with ``.host`` (the buffer it fills); the backend keeps
    ``src``'s storage alive until the copy has read it, and no longer: the transfer does not
    hold it. ``to_device(off)`` starts the copy back (ordered after ``off``) and returns a
    transfer whose ``consume()`` gives the device tensor, ready for use on the caller's stream.
    ``recycle(off, pre)`` returns ``off.host`` to the pool once ``pre`` no longer reads it,
    holding neither transfer's device tensor meanwhile. ``stall_s()`` is how long compute
    waited on transfers.
    """

    device: torch.device
    pool: HostPool

    def to_host(self, src: torch.Tensor) -> Transfer:
        raise NotImplementedError

    def to_device(self, off: Transfer) -> Transfer:
        raise NotImplementedError

    def consume(self, pre: Transfer) -> torch.Tensor:
        raise NotImplementedError

    def recycle(self, off: Transfer, pre: Optional[Transfer]) -> None:
        raise NotImplementedError

    def landed(self, host: torch.Tensor) -> Transfer:
        """A transfer whose ``.host`` is ``host``, already there: ``to_device`` of it loads a host buffer that
        nothing writes meanwhile (stream.py's weights)."""
        raise NotImplementedError

    def landed_after(self, host: torch.Tensor, ready: Future) -> Transfer:
        """``landed(host)`` for a buffer that another host thread is still writing until ``ready`` is done (a
        background host step's layer, stream.py): here the caller waits for it first, as a copy engine cannot
        wait for a host thread; the CPU's copy worker waits instead. What ``ready`` raised is raised."""
        ready.result()
        return self.landed(host)

    def drop(self, pre: Transfer) -> None:
        """Forgets a copy back that will not be consumed; its device buffer may be reused once it lands."""
        raise NotImplementedError

    def release(self, offs: List[Transfer]) -> bool:
        """Lets the device originals of the offloads ``offs`` (in issue order) go once their copies have read them.
        True: their bytes are free for the compute queued from now on (CUDA: that compute waits for the copies on
        the device, the host does not); False: the backend holds them until the copies are done (``wait()``)."""
        raise NotImplementedError

    def grad_to_host(self, g: torch.Tensor) -> Optional[Transfer]:
        """Starts copying ``g`` (a gradient the backward just made, any dtype and shape) to the host, off the
        compute stream. The transfer's ``.tensor`` is the host copy, to read once ``ready()``/``wait()``;
        ``recycle(it, None)`` then gives its buffer back. None: this backend does not (the CPU's: its device is
        the host; the caller reads ``g`` itself)."""
        return None

    def stall_s(self) -> float:
        raise NotImplementedError

    def busy_s(self) -> Tuple[float, float]:
        """Seconds spent copying (to host, to device)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _FutureTransfer(Transfer):
    def __init__(self, future: Future, *, host: Optional[torch.Tensor] = None, device: Optional[torch.Tensor] = None):
        self.future, self.host, self.device = future, host, device

    def ready(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


class _Inline:
    """An executor that runs each task in the caller, at once."""

    def submit(self, fn) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 -- handed to whoever waits, as a worker thread would
            future.set_exception(e)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


class CpuBackend(TransferBackend):
    """The device is the CPU: copies run on two worker threads (one each way) so that they
    overlap compute as a GPU's copy streams do; the source is dropped once copied.

    ``overlap=False`` runs each copy in the caller when it is issued: no overlap, but the live
    tensor bytes at every moment no longer depend on thread timing (memory tests).
    """

    def __init__(self, *, overlap: bool = True):
        self.device = torch.device("cpu")
        self.overlap = overlap
        self.pool = HostPool(pin=False)
        self._out = ThreadPoolExecutor(1, thread_name_prefix="swap-out") if overlap else _Inline()
        self._in = ThreadPoolExecutor(1, thread_name_prefix="swap-in") if overlap else _Inline()
        self._stall = 0.0
        self._busy = [0.0, 0.0]
        self._recycle: Deque[Tuple[torch.Tensor, Future]] = deque()  # (host buffer, the last copy reading it)

    def to_host(self, src: torch.Tensor) -> Transfer:
        while self._recycle and self._recycle[0][1].done():
            self.pool.put(self._recycle.popleft()[0])
        host = self.pool.get(src.numel())
        keep = [src]  # the task drops it once copied, like the device tensor after its event

        def copy() -> None:
            t0 = time.perf_counter()
            host.copy_(keep.pop())
            self._busy[0] += time.perf_counter() - t0

        return _FutureTransfer(self._out.submit(copy), host=host)

    def to_device(self, off: Transfer) -> Transfer:
        dev = self._empty(off.host.numel())  # allocated now, as on a GPU; filled by the worker

        host, landed = off.host, off.future  # not ``off`` itself: the task holds what it needs only

        def copy() -> None:
            landed.result()
            t0 = time.perf_counter()
            self._copy_in(dev, host)
            self._busy[1] += time.perf_counter() - t0

        return _FutureTransfer(self._in.submit(copy), device=dev)

    def _empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _copy_in(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        dev.copy_(host)

    def consume(self, pre: Transfer) -> torch.Tensor:
        if not pre.ready():
            t0 = time.perf_counter()
            pre.wait()
            self._stall += time.perf_counter() - t0
        pre.wait()  # raises what the worker raised
        return pre.device

    def recycle(self, off: Transfer, pre: Optional[Transfer]) -> None:
        # Back to the pool once the last copy from it is done; the future, not the transfer, is
        # kept: the transfer holds the device copy, which must go as soon as autograd is done.
        self._recycle.append((off.host, (pre or off).future))

    def release(self, offs: List[Transfer]) -> bool:
        return all(off.ready() for off in offs)  # the worker drops each source once copied

    def landed(self, host: torch.Tensor) -> Transfer:
        done: Future = Future()
        done.set_result(None)
        return _FutureTransfer(done, host=host)

    def landed_after(self, host: torch.Tensor, ready: Future) -> Transfer:
        return _FutureTransfer(ready, host=host)  # ``to_device``'s copy waits for it, on the copy worker

    def drop(self, pre: Transfer) -> None:
        pass  # the worker holds the buffer it fills; Python frees it after

    def stall_s(self) -> float:
        return self._stall

    def busy_s(self) -> Tuple[float, float]:
        return self._busy[0], self._busy[1]

    def close(self) -> None:
        self._out.shutdown(wait=True)
        self._in.shutdown(wait=True)


class _CudaTransfer(Transfer):
    def __init__(
        self, event: "torch.cuda.Event", *, host: Optional[torch.Tensor] = None, device: Optional[torch.Tensor] = None
    ):
        self.event, self.host, self.device = event, host, device
        self.tensor: Optional[torch.Tensor] = None  # grad_to_host: the host copy, typed
        self.src: Optional[torch.Tensor] = None  # to_host: the device original, until ``release``

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class CudaBackend(TransferBackend):
    """Pinned host buffers, a copy stream for offloads and another for prefetches, events.

    An offload waits (on the GPU) for the kernels that produced its tensor; the transfer holds the
    device original until ``release``, which drops it at once and, if the copy may still be
    reading it, first makes the compute stream wait for the copy's event: the block goes back to
    compute's pool stream-ordered, reused by the very next allocation and never overwritten
    before the copy has read it, and the host never waits. (``record_stream`` instead leaves
    the block unusable until the allocator sees the copy's event complete on the host: with the
    host queueing ahead of the GPU, as it does, that is late, and each forward took fresh blocks.)

    A prefetch allocates its buffer from the compute stream's pool, so copies back reuse the
    blocks the offloaded originals freed (a side-stream allocation draws on a pool of its own,
    which compute never reuses: reserved memory doubles). The copy stream therefore first waits
    for the compute work queued so far (which may still use that block), and compute waits for
    the copy's event (GPU-side, no host stall) before reading it. When ``timing``, events
    around that wait measure how long the compute stream really stalled, and events around each
    copy their busy time.
    """

    def __init__(self, device: torch.device, *, timing: bool = True):
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.pool = HostPool(pin=True)
        self._out_stream = torch.cuda.Stream(device)
        self._in_stream = torch.cuda.Stream(device)
        self.timing = timing
        self._stalls: List[Tuple[Any, Any]] = []
        self._copies: List[List[Tuple[Any, Any]]] = [[], []]
        self._recycle: Deque[Tuple[torch.Tensor, Any]] = deque()

    def _event(self) -> "torch.cuda.Event":
        return torch.cuda.Event(enable_timing=self.timing)

    def _copy(self, stream, direction: int, dst: torch.Tensor, src: torch.Tensor) -> "torch.cuda.Event":
        with torch.cuda.stream(stream):
            start = self._event() if self.timing else None
            if start is not None:
                start.record(stream)
            dst.copy_(src, non_blocking=True)
            done = self._event()
            done.record(stream)
        if start is not None:
            self._copies[direction].append((start, done))
        return done

    def to_host(self, src: torch.Tensor) -> Transfer:
        self._reclaim()
        host = self.pool.get(src.numel())
        self._out_stream.wait_stream(torch.cuda.current_stream(self.device))  # the kernels that wrote src
        transfer = _CudaTransfer(self._copy(self._out_stream, 0, host, src), host=host)
        transfer.src = src  # until ``release``
        return transfer

    def release(self, offs: List[Transfer]) -> bool:
        pending = [off for off in offs if off.src is not None]
        busy = [off.event for off in pending if not off.event.query()]
        if busy:
            self._compute_waits(busy)
        for off in pending:
            off.src = None
        return True

    def to_device(self, off: Transfer) -> Transfer:
        compute = torch.cuda.current_stream(self.device)
        dev = torch.empty(off.host.numel(), dtype=torch.uint8, device=self.device)  # compute's pool
        self._in_stream.wait_stream(compute)  # the block may be one that queued compute still uses
        self._in_stream.wait_event(off.event)
        return _CudaTransfer(self._copy(self._in_stream, 1, dev, off.host), device=dev)

    def _compute_waits(self, events: List["torch.cuda.Event"]) -> None:
        """The compute stream waits (on the GPU) for ``events``; timed as a stall when ``timing``."""
        stream = torch.cuda.current_stream(self.device)
        before = self._event() if self.timing else None
        if before is not None:
            before.record(stream)
        for event in events:
            stream.wait_event(event)
        if before is not None:
            after = self._event()
            after.record(stream)
            self._stalls.append((before, after))

    def consume(self, pre: Transfer) -> torch.Tensor:
        if not pre.event.query():
            self._compute_waits([pre.event])
        return pre.device

    def recycle(self, off: Transfer, pre: Optional[Transfer]) -> None:
        if pre is not None:
            # A copy back that was never consumed: its block returns to compute's pool when
            # Python drops it, so compute must not run past the copy still writing it.
            torch.cuda.current_stream(self.device).wait_event(pre.event)
        self._recycle.append((off.host, (pre or off).event))
        self._reclaim()

    def landed(self, host: torch.Tensor) -> Transfer:
        event = self._event()
        event.record(torch.cuda.current_stream(self.device))
        return _CudaTransfer(event, host=host)

    def drop(self, pre: Transfer) -> None:
        torch.cuda.current_stream(self.device).wait_event(pre.event)  # its block returns to compute's pool

    def grad_to_host(self, g: torch.Tensor) -> Transfer:
        # On the offload stream, after the compute work queued so far (the backward that made g); record_stream
        # keeps g's block from reuse until the copy has read it, whenever autograd drops g.
        self._reclaim()
        host = self.pool.get(g.numel() * g.element_size())
        tensor = host.view(g.dtype).view(g.shape)
        self._out_stream.wait_stream(torch.cuda.current_stream(self.device))
        transfer = _CudaTransfer(self._copy(self._out_stream, 0, tensor, g), host=host)
        g.record_stream(self._out_stream)
        transfer.tensor = tensor
        return transfer

    def _reclaim(self) -> None:
        while self._recycle and self._recycle[0][1].query():
            self.pool.put(self._recycle.popleft()[0])

    def stall_s(self) -> float:
        torch.cuda.synchronize(self.device)
        return sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3

    def busy_s(self) -> Tuple[float, float]:
        torch.cuda.synchronize(self.device)
        out, into = (sum(a.elapsed_time(b) for a, b in pairs) / 1e3 for pairs in self._copies)
        return out, into


def make_backend(device: torch.device) -> TransferBackend:
    """The backend for ``device``: CUDA streams on a GPU, worker threads on the CPU."""
    return CudaBackend(device) if device.type == "cuda" else CpuBackend()


@dataclass
class SwapStats:
    """What a stage's swapping did; goes to summary.json ``ranks[i].swap``."""

    resident: int = 0  # the budget: waiting microbatches whose activations may stay on the device
    min_bytes: int = 0
    swapped_out: int = 0  # storages copied to host
    swapped_out_bytes: int = 0
    swapped_in: int = 0  # storages copied back
    swapped_in_bytes: int = 0
    kept_bytes: int = 0  # swappable bytes kept on the device (microbatches within the budget)
    unswapped_bytes: int = 0  # saved bytes below min_bytes, never moved
    unused: int = 0  # storages brought back that backward never unpacked
    peak_device_bytes: int = 0  # saved activations on the device at once, all microbatches, small ones included
    peak_waiting_bytes: int = 0  # swappable bytes on the device of microbatches other than the current one
    microbatch_bytes: int = 0  # swappable bytes one microbatch saves (the largest seen)
    stall_s: float = 0.0  # compute waiting for prefetches (GPU: measured on the compute stream)
    offload_wait_s: float = 0.0  # the stage waiting for offloads to finish, to stay within the budget
    copy_out_s: float = 0.0  # transfer busy time, to host
    copy_in_s: float = 0.0  # and back
    host_pool_bytes: int = 0  # host buffers allocated


class _Record:
    """One saved storage of one microbatch and where its bytes are."""

    __slots__ = ("id", "micro", "nbytes", "kept", "sending", "off", "pre", "dev", "packs", "unpacks", "released")

    def __init__(self, micro: "_Micro", nbytes: int, id: int):
        self.id, self.micro, self.nbytes = id, micro, nbytes
        self.kept = False  # on the device until the backward: autograd holds the tensor itself
        self.sending = False  # its offload is in flight: counted on the device (the backend holds the storage)
        self.off: Optional[Transfer] = None
        self.pre: Optional[Transfer] = None
        self.dev: Optional[torch.Tensor] = None  # the copy back, once consumed
        self.packs = self.unpacks = 0
        self.released = False


class _Packed:
    """What autograd holds for one swapped saved tensor: its record and how to view it again."""

    __slots__ = ("record", "dtype", "size", "stride", "offset")

    def __init__(self, record: _Record, t: torch.Tensor):
        self.record, self.dtype, self.size, self.stride, self.offset = (
            record,
            t.dtype,
            t.size(),
            t.stride(),
            t.storage_offset(),
        )


class _Micro:
    __slots__ = ("k", "keep", "records", "device_bytes", "saved_bytes", "small_bytes", "unfetched", "sending", "phase")

    def __init__(self, k: int, keep: bool):
        self.k, self.keep = k, keep
        self.records: List[_Record] = []
        self.device_bytes = 0  # swappable bytes on the device (kept, offloads in flight, copies back)
        self.saved_bytes = 0  # swappable bytes saved in all
        self.small_bytes = 0
        self.unfetched = 0  # records sent to host and not yet asked back
        self.sending = 0  # records whose offload has not landed yet
        self.phase = "F"  # F (forward running), W (waiting for backward), B (backward started)


class SwapManager:
    """Swaps the saved activations of one stage's waiting microbatches to host memory.

    Policy, with R = ``resident``: the microbatch being computed (forward or backward) has its
    activations on the device; of the microbatches waiting for their backward, at most R (the
    next R to be backwarded) do. A forward keeps its saved tensors on the device when fewer
    than R microbatches are waiting, else sends every saved storage of at least ``min_bytes``
    to host as soon as it is saved. When a backward starts, the next R waiting microbatches are
    fetched back. An offload still in flight counts as on the device: a fetch that would exceed
    R is deferred until it lands (checked on every hook call), as is the fetch of a microbatch
    whose own offloads have not all landed, and an action that begins over budget waits for it
    (``offload_wait_s``). Parameters, buffers and the stage's own inputs (held by the stage
    anyway) are never swapped.

    Not supported: ``retain_graph`` (a second unpack of a released tensor) and double backward.
    """

    def __init__(
        self,
        backend: TransferBackend,
        *,
        min_bytes: int,
        resident: int,
        exclude: Iterable[torch.Tensor] = (),
        trace: bool = False,
    ):
        assert min_bytes >= 0 and resident >= 0
        self.backend, self.min_bytes, self.resident = backend, min_bytes, resident
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._micros: Dict[int, _Micro] = {}
        self._current: Optional[_Micro] = None
        # This forward's storages by data pointer, with a weak reference that tells a storage from
        # a later one at the same address: a strong one would keep every offloaded storage on
        # the device until the forward ends.
        self._by_ptr: Dict[int, Tuple[_Record, "weakref.ref[torch.UntypedStorage]"]] = {}
        self._outgoing: Deque[_Record] = deque()  # offloads in flight, in issue order
        self._ids = itertools.count()
        self._device_total = 0  # swappable + small bytes on the device, all microbatches
        self.stats = SwapStats(resident=resident, min_bytes=min_bytes)
        self.trace: Optional[List[Tuple[str, int, int]]] = [] if trace else None  # (event, k, record id)

    # -- accounting --------------------------------------------------------------------------

    def _add_device(self, micro: _Micro, nbytes: int, *, small: bool = False) -> None:
        if small:
            micro.small_bytes += nbytes
        else:
            micro.device_bytes += nbytes
        self._device_total += nbytes
        if nbytes > 0:  # peaks come with increments (a new current microbatch first waits its budget)
            st = self.stats
            st.peak_device_bytes = max(st.peak_device_bytes, self._device_total)
            st.peak_waiting_bytes = max(st.peak_waiting_bytes, self._waiting_device_bytes())

    def _waiting_device_bytes(self) -> int:
        return sum(m.device_bytes for m in self._micros.values() if m is not self._current)

    def _event(self, what: str, rec: _Record) -> None:
        if self.trace is not None:
            self.trace.append((what, rec.micro.k, rec.id))

    # -- transfers ---------------------------------------------------------------------------

    def _poll(self) -> None:
        """Takes note of offloads that have landed: their device originals go."""
        while self._outgoing and self._outgoing[0].off.ready():
            rec = self._outgoing.popleft()
            self.backend.release([rec.off])
            self._landed(rec)

    def _landed(self, rec: _Record) -> None:
        if rec.sending:
            rec.sending = False
            rec.micro.sending -= 1
            self._add_device(rec.micro, -rec.nbytes)

    def _fetch(self, micro: _Micro) -> None:
        if not micro.unfetched:
            return
        micro.unfetched = 0
        for rec in micro.records:
            if rec.off is not None and rec.pre is None:
                rec.pre = self.backend.to_device(rec.off)
                self._add_device(micro, rec.nbytes)
                self.stats.swapped_in += 1
                self.stats.swapped_in_bytes += rec.nbytes
                self._event("in", rec)

    def _waiting(self) -> List[_Micro]:
        return sorted((m for m in self._micros.values() if m.phase == "W"), key=lambda m: m.k)

    def _pump(self) -> None:
        """Fetches the next R waiting microbatches, in backward order, as the budget allows.

        Offloads still in flight would make a copy back exceed the budget: its own (its bytes twice, the original
        and the copy) and other microbatches' (they count as on the device). Where the backend lets their originals
        go on the device (``release``: later compute waits for the copies, the host does not) they go now, so that
        the prefetch overlaps the backward that comes before; else a later hook call retries."""
        self._poll()
        for micro in self._waiting()[: self.resident]:
            if not micro.unfetched:
                continue
            if micro.sending and not self._let_go([r for r in self._outgoing if r.micro is micro]):
                return
            if len(self._others_on_device()) >= self.resident:
                leaving = [r for r in self._outgoing if r.micro is not self._current]
                if not leaving or not self._let_go(leaving) or len(self._others_on_device()) >= self.resident:
                    return
            self._fetch(micro)

    def _others_on_device(self) -> List[_Micro]:
        """The microbatches besides the current one with swappable bytes on the device (what the budget counts)."""
        return [m for m in self._micros.values() if m is not self._current and m.device_bytes > 0]

    def _let_go(self, recs: List[_Record]) -> bool:
        """Lets the originals of the offloads ``recs`` (in flight, in issue order) go, if the backend can now."""
        if not self.backend.release([r.off for r in recs]):
            return False
        for rec in recs:
            self._outgoing.remove(rec)
            self._landed(rec)
        return True

    def _enforce_budget(self) -> None:
        """Lets offloads' originals go until at most R microbatches besides the current one are on the device:
        on a GPU the compute queued from now on waits for their copies (``TransferBackend.release``), the host
        does not; where the backend holds them until copied (the CPU's worker), the host waits for the copy."""
        while True:
            self._poll()
            others = self._others_on_device()
            if len(others) <= self.resident:
                return
            leaving = next(
                (r for r in self._outgoing if r.micro in others and r.pre is None and not r.micro.keep), None
            )
            assert leaving is not None, "swap budget exceeded by kept or fetched microbatches"
            if self._let_go([r for r in self._outgoing if r.micro is leaving.micro and r.pre is None]):
                continue
            t0 = time.perf_counter()
            leaving.off.wait()
            self.stats.offload_wait_s += time.perf_counter() - t0
            self._outgoing.remove(leaving)
            self._landed(leaving)

    # -- the hooks ---------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        micro = self._current
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.backend.device:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude or storage.nbytes() == 0:
            return t
        held = self._by_ptr.get(ptr)
        if held is None or held[1]() is not storage:  # new, or a freed storage's address reused
            nbytes = storage.nbytes()
            rec = _Record(micro, nbytes, next(self._ids))
            self._by_ptr[ptr] = (rec, weakref.ref(storage))
            if nbytes < self.min_bytes:
                rec.released = True  # never moved; counted until the backward ends
                self.stats.unswapped_bytes += nbytes
                self._add_device(micro, nbytes, small=True)
            else:
                micro.records.append(rec)
                micro.saved_bytes += nbytes
                self.stats.microbatch_bytes = max(self.stats.microbatch_bytes, micro.saved_bytes)
                self._add_device(micro, nbytes)
                if micro.keep:
                    rec.kept = True
                    self.stats.kept_bytes += nbytes
                else:
                    rec.sending = True
                    micro.sending += 1
                    rec.off = self.backend.to_host(storage_bytes(t))
                    micro.unfetched += 1
                    self._outgoing.append(rec)
                    self.stats.swapped_out += 1
                    self.stats.swapped_out_bytes += nbytes
                    self._event("out", rec)
            self._poll()
        else:
            rec = held[0]
        if rec.released or rec.kept:
            return t
        rec.packs += 1
        self._event("pack", rec)
        return _Packed(rec, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        rec = packed.record
        assert not rec.released, "a swapped tensor was unpacked after its backward released it (retain_graph?)"
        if rec.pre is None:  # not fetched ahead (resident=0, or a budget wait): fetch now
            self._fetch(rec.micro)
        if rec.dev is None:
            rec.dev = self.backend.consume(rec.pre)
        self._event("unpack", rec)
        rec.unpacks += 1
        out = torch.empty(0, dtype=packed.dtype, device=rec.dev.device).set_(
            rec.dev.untyped_storage(), packed.offset, packed.size, packed.stride
        )
        if rec.unpacks == rec.packs:
            self._release(rec)  # autograd holds what it needs; the manager lets go
        self._pump()
        return out

    def _release(self, rec: _Record) -> None:
        """Lets go of ``rec``'s bytes: autograd holds the views it unpacked, for as long as the
        backward nodes need them, and nothing else holds the copy back or the host buffer."""
        rec.released = True
        rec.dev = None
        if rec.kept:
            self._add_device(rec.micro, -rec.nbytes)
        if rec.sending:
            rec.sending = False
            rec.micro.sending -= 1
            self._add_device(rec.micro, -rec.nbytes)
        if rec.pre is not None:
            self._add_device(rec.micro, -rec.nbytes)
        if rec.off is not None:
            if rec in self._outgoing:
                self._outgoing.remove(rec)
            self.backend.release([rec.off])
            self.backend.recycle(rec.off, rec.pre)
        rec.off = rec.pre = None

    # -- what the stage calls ----------------------------------------------------------------

    @contextlib.contextmanager
    def forward(self, k: int, *, inputs: Iterable[torch.Tensor] = (), outer: Optional[Any] = None) -> Iterator[None]:
        """Context for microbatch ``k``'s forward: its saved tensors go through the swap hooks.

        ``inputs``: tensors the stage holds until the backward anyway (never swapped).
        ``outer``: a ``saved_tensors_hooks`` to apply first (torch applies only the innermost
        pair of nested hooks, so they are chained here); its pack hook must return the tensor.
        """
        waiting = sum(m.phase == "W" for m in self._micros.values())
        micro = self._micros[k] = _Micro(k, keep=waiting < self.resident)
        self._current = micro
        self._enforce_budget()
        self._pump()
        input_ptrs = {t.untyped_storage().data_ptr() for t in inputs} - self._exclude
        self._exclude |= input_ptrs
        pack, unpack = self._pack, self._unpack
        if outer is not None:
            pack = lambda t: self._pack(outer.pack_hook(t))  # noqa: E731
            unpack = lambda p: outer.unpack_hook(self._unpack(p))  # noqa: E731
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._exclude -= input_ptrs
            self._by_ptr.clear()
            micro.phase = "W"
            # It waits now: its offloads still in flight count against the budget, not as the
            # current microbatch's (which let a fetch go ahead with both on the device).
            self._current = None
            self._pump()

    def begin_backward(self, k: int) -> None:
        """Microbatch ``k``'s backward starts: its activations are fetched now if they are not
        already, and the next ``resident`` waiting microbatches start coming back."""
        micro = self._micros[k]
        micro.phase, self._current = "B", micro
        self._enforce_budget()
        self._fetch(micro)
        self._pump()

    def end_backward(self, k: int) -> None:
        """Microbatch ``k``'s backward is done: whatever of it is left goes."""
        micro = self._micros.pop(k)
        self._current = None
        for rec in micro.records:
            if not rec.released:
                self.stats.unused += rec.off is not None and rec.unpacks < rec.packs
                self._release(rec)
        micro.records.clear()  # records point at their microbatch: no cycle may outlive it
        self._device_total -= micro.small_bytes
        assert micro.device_bytes == 0, micro.device_bytes
        self._pump()

    def close(self) -> Dict[str, Any]:
        """Waits for the transfers, stops the backend and returns the stats as a dict."""
        assert not self._micros, f"microbatches {sorted(self._micros)} never finished their backward"
        st = self.stats
        st.stall_s = self.backend.stall_s()
        st.copy_out_s, st.copy_in_s = self.backend.busy_s()
        st.host_pool_bytes = self.backend.pool.allocated_bytes
        self.backend.close()
        return asdict(st)
