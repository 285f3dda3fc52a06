"""The host as the planner sees it: how fast its optimizer step and its copies run, measured once and cached.

Two figures of this machine's CPU (the step: the median of 7 steps; the copy: the fastest of 7; cached for good),
measured on one thread as a rank runs (torchrun starts several ranks with
OMP_NUM_THREADS=1; ``profile.py`` times CPU layers the same way) and cached on disk as the layer profile is
(``profile.default_cache_dir``), keyed by the CPU, its cores and the torch version:

- ``step_params_per_s``: float32 parameters per second that a host AdamW step takes, with torch's fused CPU kernel
  (``fused=True``) where this torch has one (``host_kernel``: what swap.optimizer=host's step runs with). A step
  reads the gradient and reads and writes the weight and both moments: 28 bytes a parameter
  (``host_optim.adam_step_bytes``), so ``step_bytes_per_s`` is the host's bandwidth for elementwise optimizer
  work, and any optimizer's host step takes the bytes it reads and writes over it (``cost.py``'s host step);
- ``copy_bytes_per_s``: bytes per second one large host tensor copy moves (``dst.copy_(src)``): what a CPU "device"
  copy of a streamed layer costs, and (reading one buffer and writing another, about as an add does) the host's
  sums of a streamed stage's gradients over the microbatches;
- ``reduce_bytes_per_s``: the bus bandwidth (``2 (w-1)/w`` of the bytes over the time) of a gloo all-reduce of a
  large float32 tensor between two processes of this host (loopback; two processes spawned once): what a streamed
  stage's replicas all-reduce their host gradient sums with (run/build.py: gloo groups), capped by the topology's
  link between the replicas (``cost._stream_reduce_s``);
- ``cores``: the CPU cores this process may use. A node's ranks step on their own threads: more ranks than cores
  take turns (``HostFigures.cores``), fewer run side by side (the memory bandwidth a server's host has for a few
  threads is not measured: this machine's are what there is); where the ranks' compute leaves no core free, a rank's
  host step takes turns with its compute (``HostFigures.free_cores``, the runtime's ``host_optim.host_threads``).

The step is timed by the runtime's own measurement (``memory/host_optim.py::measure_host_step``), the one place
that times it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pipedream2bw.io.fileio import atomic_write_text

CACHE_VERSION = 4  # 4: the gloo all-reduce figure (3: the step timed by the runtime's measurement; 2: the fastest
# of 7; 1: their median)


@dataclass(frozen=True)
class HostProfile:
    """This host's optimizer step and copy speed (module docstring)."""

    step_params_per_s: float  # float32 AdamW parameters stepped per second
    copy_bytes_per_s: float  # bytes per second of one large host copy
    kernel: str  # the AdamW implementation timed: 'fused' or 'foreach'
    cores: int  # CPU cores this process may use
    reduce_bytes_per_s: float = math.inf  # gloo all-reduce bus bandwidth between two processes (inf: not measured)

    @property
    def step_bytes_per_s(self) -> float:
        """Bytes per second an elementwise host optimizer step reads and writes (AdamW's, measured)."""
        from pipedream2bw.memory.host_optim import adam_step_bytes

        return self.step_params_per_s * adam_step_bytes()

    def describe(self) -> str:
        gloo = self.reduce_bytes_per_s
        return (
            f"host step {self.step_params_per_s / 1e6:.3g} M parameters/s (AdamW {self.kernel}, one thread), "
            f"copies {self.copy_bytes_per_s / 1e9:.3g} GB/s, {self.cores} cores"
            + (f", gloo all-reduce {gloo / 1e9:.3g} GB/s" if gloo < math.inf else "")
        )


def _fastest_s(fn, *, warmup: int, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after ``warmup``: the figure is cached for good, so it should be
    the machine's speed, not a moment's load on a shared one (other jobs only ever slow a call down)."""
    times = []
    for r in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        if r >= warmup:
            times.append(time.perf_counter() - start)
    return min(times)


def adamw_kernel() -> str:
    """The AdamW kernel the runtime's host step takes (``memory/host_optim.py::host_kernel``): 'fused' where this
    torch has its fused CPU kernel, else 'default'."""
    from pipedream2bw.config import OptimConfig
    from pipedream2bw.memory.host_optim import host_kernel

    return "fused" if host_kernel(OptimConfig(name="adamw")).kwargs.get("fused") else "default"


def measure_host_step(*, repeats: int = 7) -> float:
    """Float32 parameters per second of a host AdamW step as the runtime's host optimizer runs it: the runtime's own
    measurement (``memory/host_optim.py::measure_host_step``: its kernel, 2**23 parameters in 8 tensors, larger than
    the CPU's caches), with the calling thread's settings."""
    from pipedream2bw.memory.host_optim import measure_host_step as runtime_measure

    return runtime_measure(repeats=repeats).params_per_s


def measure_copy(*, nbytes: int = 2**27, warmup: int = 2, repeats: int = 7) -> float:
    """Bytes per second of one host tensor copy of ``nbytes``."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return src.numel() * 4 / _fastest_s(lambda: dst.copy_(src), warmup=warmup, repeats=repeats)


def _reduce_rank(rank: int, port: int, nbytes: int, repeats: int, out) -> None:
    """One of ``measure_reduce``'s two processes: times gloo all-reduces of ``nbytes`` (rank 0 puts the fastest)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        x = torch.ones(nbytes // 4)
        best = _fastest_s(lambda: dist.all_reduce(x), warmup=2, repeats=repeats)
        if rank == 0:
            out.put(best)
    finally:
        dist.destroy_process_group()


def measure_reduce(*, nbytes: int = 2**24, repeats: int = 5, timeout_s: float = 120.0) -> float:
    """Bus bandwidth (bytes/s) of a gloo all-reduce of ``nbytes`` of float32 between two fresh processes of this
    host, one thread each (for w = 2 the bus bytes are the tensor's: ``2 (w-1)/w`` of it)."""
    import multiprocessing

    from pipedream2bw.pipeline.comm import free_port

    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no threads or locks of this one forked
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_reduce_rank, args=(r, port, nbytes, repeats, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        best = out.get(timeout=timeout_s)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        what = f"the host's gloo all-reduce figure: no result in {timeout_s} s (exit codes {codes})"
        raise RuntimeError(what) from None
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
    return nbytes / best


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    from pipedream2bw.memory.host_optim import node_cores

    return node_cores()


def _cache_path(cache_dir: Optional[Path]) -> Path:
    from partitioner.profile import default_cache_dir

    desc = json.dumps(
        {
            "v": CACHE_VERSION,
            "cpu": _cpu_name(),
            "cores": _cores(),
            "torch": torch.__version__,
            "kernel": adamw_kernel(),
        },
        sort_keys=True,
    )
    return Path(cache_dir or default_cache_dir()) / f"host-{hashlib.sha256(desc.encode()).hexdigest()[:20]}.json"


def host_profile(*, cache_dir: Optional[Path] = None, use_cache: bool = True) -> HostProfile:
    """This host's figures, from the cache if there, else measured (a few seconds) and cached."""
    path = _cache_path(cache_dir)
    if use_cache and path.is_file():
        try:
            return HostProfile(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a corrupt or old entry: measure again
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step, copy = measure_host_step(), measure_copy()
    finally:
        torch.set_num_threads(threads)
    host = HostProfile(
        step_params_per_s=step,
        copy_bytes_per_s=copy,
        kernel=adamw_kernel(),
        cores=_cores(),
        reduce_bytes_per_s=measure_reduce(),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(dataclasses.asdict(host), indent=1))
    return host
