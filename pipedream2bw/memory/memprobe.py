"""Tensor memory of a block of code: its peak (CUDA allocator or torch.profiler) and what autograd saves in it."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Set

import torch

log = logging.getLogger(__name__)

_MARKER_BYTES = 7919  # an odd size no real tensor of the block is likely to have first
_EVERY_THREAD_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"  # c10's: the CPU allocator counts every thread


def process_peak_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA's max allocated on ``device``, else the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def available_host_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """Host memory a new allocation can take without swapping: ``MemAvailable`` of ``meminfo`` (Linux), or None
    where it cannot be read (then no check relies on it)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


@contextlib.contextmanager
def tensor_peak(device: torch.device, *, within: Optional[str] = None) -> Iterator[Dict[str, int]]:
    """Yields a dict whose ``bytes`` is, after the block, the most tensor bytes alive at once in it.

    CUDA: the caching allocator's max-allocated counter (reset when the block begins, so it also
    counts what was allocated before and is still alive). CPU: the largest running total of
    allocated bytes in torch.profiler's memory events, which count every tensor allocated since
    the block began (so begin it before the model is built); with ``within``, only while the
    profiler range of that name is open (e.g. a training loop, leaving out the gathering of
    results after it, which CUDA memory does not see either). ``end_bytes`` is the running total
    at the block's last memory event (CPU) or the allocated bytes when it ends (CUDA).

    CPU: the profiler records the memory events of the thread it profiles only, but each event
    carries the CPU allocator's running total, which (``_count_every_thread``) also counts what the
    other threads allocate and free: a tensor whose last reference a collective's worker thread
    drops (gloo) is counted freed, and a tensor another thread allocates is counted from this
    thread's next memory event on.

    Raises:
        RuntimeError: ``within`` names a range that the block never opened (CPU).
    """
    box: Dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield box
        torch.cuda.synchronize(device)
        box["bytes"] = torch.cuda.max_memory_allocated(device)
        box["end_bytes"] = torch.cuda.memory_allocated(device)
        return
    from torch.profiler import ProfilerActivity, profile

    with _count_every_thread(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        # The profiler's running total also counts what earlier profiled blocks of this process
        # allocated and did not free: a marker's event gives that total, which is subtracted.
        marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
        del marker
        yield box
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    spans = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if within is not None and e.get("name") == within and e.get("ph") == "X"
    ]
    if within is not None and not spans:
        raise RuntimeError(f"no profiler range {within!r} in the trace")
    memory = [e for e in sorted(events, key=lambda e: e["ts"]) if e.get("name") == "[memory]"]
    first = next(e for e in memory if e["args"]["Bytes"] == _MARKER_BYTES)
    base = first["args"]["Total Allocated"] - _MARKER_BYTES
    totals = [
        e["args"]["Total Allocated"] - base
        for e in memory
        if e["ts"] > first["ts"] and (within is None or any(a <= e["ts"] <= b for a, b in spans))
    ]
    box["bytes"] = max(totals, default=0)
    box["end_bytes"] = totals[-1] if totals else 0


@contextlib.contextmanager
def _count_every_thread() -> Iterator[None]:
    """While active, the CPU allocator's running total (the profiler's "Total Allocated") counts the
    allocations and frees of every thread. By default it counts a free only on a thread the profiler
    profiles, so a tensor freed by a gloo worker thread (the last reference to a collective's input)
    stayed counted for the rest of the block: an overcount that varied with the collectives' timing.
    c10's flag ``caffe2_report_cpu_memory_usage`` makes the allocator count on every thread; it is set
    in libc10 directly (torch has no Python setter). Without it (a build that does not export it) the
    measurement goes on as before, with a warning."""
    libs = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libc10.*"))
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(libs[0])), _EVERY_THREAD_FLAG)
    except (IndexError, OSError, ValueError) as e:
        log.warning("cannot count other threads' CPU frees (%s): tensors they free stay counted", e)
        yield
        return
    before, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = before


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> Set[int]:
    """The addresses of the storages under ``tensors`` (what ``SavedBytes`` leaves out)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """While active, counts in ``nbytes`` the bytes autograd saves for backward: each storage once,
    leaving out those at ``param_ptrs`` (the parameters', which are held anyway).

    Its ``pack_hook`` and ``unpack_hook`` may be chained by other hooks (``swap.SwapManager.forward``'s
    ``outer``), as torch applies only the innermost pair.
    """

    def __init__(self, param_ptrs: Set[int]):
        self.nbytes = 0
        seen: Dict[int, Any] = {}  # pointer -> weak reference: a swapped storage may be freed and its address reused

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in param_ptrs and (ptr not in seen or seen[ptr]() is not storage):
                seen[ptr] = weakref.ref(storage)
                self.nbytes += storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)


def saved_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor]) -> int:
    """Bytes autograd saves for backward during ``fn()`` (``SavedBytes``), ``params`` excluded."""
    saved = SavedBytes(storage_ptrs(params))
    with saved:  # (its __enter__ returns None)
        fn()
    return saved.nbytes
