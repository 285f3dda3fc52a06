"""Weight streaming (swap.weights) on one stage of GPT blocks: device bytes, bytes moved, stall, speed, bit identity.

    python scripts/bench_stream.py                       # CUDA if available, else CPU with small defaults
    python scripts/bench_stream.py --layers 8 --d-model 256 --window 2 --json out.json

The stage is ``--layers`` GPT blocks (equal layers) run as stage 0 of a 2-stage pipeline runs them
(``schedule.stage_actions``: forwards of the next batch before the step of this one under 2bw), with
AdamW, the squared mean of the output as each microbatch's loss. It runs once with its weights on the
device (``WeightVersions``) and once streamed (``StreamedVersions`` + ``WeightStream``, a prefetch window of
``--window`` layers), each from the same weights; on a GPU a third run keeps the weights on the device and steps
the optimizer on the host (``HostOptimizerVersions``, swap.optimizer=host), as the streamed run does: a CUDA
AdamW rounds differently from the host's, so that run is the bit-for-bit reference there. The first
``--warmup`` batches are not timed. It reports for each:

- peak device tensor bytes: CUDA, the allocator's peak over the run (weights built on the device for the
  plain run; streamed, in pinned host memory); CPU, torch.profiler's live tensor bytes while the stage
  computes (forwards and backwards; host buffers come from outside torch's allocator, as pinned memory is
  outside CUDA's; the host step's temporaries, host memory on a GPU, are left out), in a separate untimed run;
- the memory model's figure for the streamed stage (``stream.device_bytes_model``) and the layers' bytes;
- bytes moved to the device (weights) and to the host (gradients), the stall (compute waiting for a weight
  copy; on CUDA measured on the compute stream; with a background step, also a copy waiting for its layer's step),
  the training thread's wait for gradients still being copied or added to the host accumulators (``grad_wait_s``:
  on CUDA gradients leave on the offload stream, off compute; a worker thread adds them, on the CPU too), the copy
  streams' busy time each way (these four over the timed batches), the seconds in the optimizer step calls on the
  training thread, and with ``--host-step background`` (2bw, the default: swap.host_step=auto's choice) the seconds
  the host step ran on its thread and training waited for of it, samples/s over the timed batches and the
  streamed run's time over the plain run's;
- whether the streamed run's losses and final weights are bit for bit the plain run's;
- with ``--predict`` (CPU), what the planner's cost model predicts for the plain and the streamed run (``predict``),
  and the streamed run's samples per second of the process's CPU time beside the wall clock's.

With ``--data-parallel w`` (CPU) the stage runs on w processes (gloo, one thread each, as torchrun's ranks), each
replica on microbatches of its own, their gradients all-reduced as the trainer does it (``comm.GradReducer``: the
plain run's by autograd's hooks; the streamed run's a bucket per layer, started once the batch's last microbatch has
added that layer's gradients to the host sums, ``WeightStream.on_grad``, and waited for at the step); the figures are
rank 0's, samples/s the replicas' together; ``*_allreduce_wait_s`` is the step's wait for the all-reduce summed over
every batch (the warm-up's included), ``*_allreduce_wait_per_batch_s`` that wait per timed batch.

AdamW steps with the host's kernel (``memory/host_optim.py::host_kernel``: fused where torch has one on the CPU)
wherever it steps host memory, and in the CPU's plain run. On a CPU the "device" is host memory and copies are
worker-thread memcpys: the bytes and the bit check are what the CPU shows; speed and stall need a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pickle
import threading
import time
import types
from typing import Any, Dict, List

import torch
from torch import nn

from pipedream2bw.config import GPTConfig, OptimConfig
from pipedream2bw.memory.host_optim import (
    HostOptimizerVersions,
    free_cores,
    host_kernel,
    host_threads,
    node_cores,
)
from pipedream2bw.memory.memprobe import tensor_peak
from pipedream2bw.memory.stream import StreamedVersions, WeightStream, device_bytes_model
from pipedream2bw.memory.swap import CpuBackend, make_backend
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD, STEP, stage_actions
from pipedream2bw.pipeline.versions import WeightVersions

GPU_DEFAULTS = dict(d_model=2048, num_heads=16, seq_len=256, microbatch_size=2, layers=8)
CPU_DEFAULTS = dict(d_model=256, num_heads=4, seq_len=8, microbatch_size=1, layers=8)  # small activations


def _blocks(args: argparse.Namespace) -> List[nn.Module]:
    cfg = GPTConfig(num_layers=args.layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len)
    return build_gpt_layers(cfg, seed=0, indices=range(1, args.layers + 1))  # the blocks: no embedding or head


def _replicas(versions, ws, *, rank: int, group) -> Any:
    """``--data-parallel``: the trainer's all-reduce of this replica's gradients (run/build.py, run/stage.py)."""
    from pipedream2bw.pipeline.comm import GradReducer

    ctx = types.SimpleNamespace(rank=rank, timeout=datetime.timedelta(seconds=600))  # what wait_work reads
    replicas = [list(r.parameters()) for r in versions.replicas]
    reducer = GradReducer(ctx, group=group, replicas=replicas, buckets=versions.buckets, autograd_hooks=ws is None)
    return reducer


def _schedstat(task: str = "thread-self") -> List[float]:
    """[CPU s, run-queue wait s] of a thread of this process (Linux's /proc/<task>/schedstat; zeros elsewhere): the
    time it ran on a core and the time it was ready to run and waited for one."""
    try:
        with open(f"/proc/{task}/schedstat") as f:
            cpu, wait = f.read().split()[:2]
    except OSError:
        return [0.0, 0.0]
    return [int(cpu) / 1e9, int(wait) / 1e9]


def _threads_now() -> Dict[str, List[float]]:
    """This process's threads by name (Python's, a pool's without its number; native ones, gloo's, by their comm):
    [CPU s, run-queue wait s] each, summed over the threads of a name."""
    names = {t.native_id: t.name.rsplit("_", 1)[0] for t in threading.enumerate()}
    out: Dict[str, List[float]] = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = names.get(int(tid), "native " + f.read().strip())
        except OSError:  # ended meanwhile
            continue
        acc = out.setdefault(name, [0.0, 0.0])
        for k, v in enumerate(_schedstat(f"self/task/{tid}")):
            acc[k] += v
    return out


def _clock_host_steps(versions: Any) -> List[float]:
    """``--thread-times``: [CPU s, run-queue wait s] of the background host steps' threads, summed as they end."""
    total, work_of = [0.0, 0.0], versions._host_work

    def timed(*a: Any) -> Any:
        fn = work_of(*a)

        def run() -> None:
            before = _schedstat()
            try:
                fn()
            finally:
                for k, (b, e) in enumerate(zip(before, _schedstat())):
                    total[k] += e - b

        return run

    versions._host_work = timed
    return total


def run_stage(
    args: argparse.Namespace,
    device: torch.device,
    *,
    stream: bool,
    probe: bool,
    host_optimizer: bool = False,
    rank: int = 0,
    group: Any = None,
) -> Dict[str, Any]:
    """One run of the stage; ``probe``: CPU memory measurement (compute spans named ``compute``);
    ``host_optimizer``: weights on the device, optimizer on the host (not with ``stream``); ``group``: the replicas'
    (``--data-parallel``), this process being replica ``rank``."""
    module = nn.Sequential(*_blocks(args))
    # AdamW, with the host step's kernel (memory/host_optim.py::host_kernel: fused) wherever it steps host memory:
    # streamed, host optimizer, and the CPU's plain run (so that the bit check compares one kernel)
    host = stream or host_optimizer or device.type == "cpu"
    kernel = host_kernel(OptimConfig(name="adamw")).kwargs if host else {}
    factory = lambda p: torch.optim.AdamW(p, lr=1e-3, **kernel)  # noqa: E731
    background = args.host_step == "background" and args.schedule == "2bw"  # swap.host_step (2bw: auto's choice)
    # the thread's intra-op threads as run/build.py chooses them: the cores the replicas' compute leaves free
    threads = host_threads(cores=node_cores(), ranks=args.data_parallel, rank_threads=torch.get_num_threads())
    ws = None
    if stream:
        if device.type == "cuda":  # only the buffers go to the device; the weights stay in host memory
            for m in module.modules():
                m._buffers.update({k: b.to(device) for k, b in m._buffers.items() if b is not None})
        versions = StreamedVersions(
            module,
            pin=device.type == "cuda",
            schedule=args.schedule,
            optimizer_factory=factory,
            background=background,
            threads=threads,
        )
        backend = CpuBackend(overlap=not probe) if device.type == "cpu" else make_backend(device)
        ws = WeightStream(versions, backend, window=args.window, recompute=False)
    elif host_optimizer:
        n = len(list(module.parameters()))
        versions = HostOptimizerVersions(
            module.to(device),
            schedule=args.schedule,
            optimizer_factory=factory,
            buckets=[list(range(n))[::-1]],
            background=background,
            threads=threads,
        )
    else:
        versions = WeightVersions(module.to(device), schedule=args.schedule, optimizer_factory=factory)
    layer_bytes = getattr(versions, "layer_bytes", None)
    del module
    threads_before = _threads_now() if args.thread_times else {}
    host_steps = _clock_host_steps(versions) if args.thread_times and background and ws is not None else None
    m, b, w = args.num_microbatches, args.microbatch_size, args.data_parallel
    reducer = _replicas(versions, ws, rank=rank, group=group) if group is not None else None
    if reducer is not None and ws is not None:  # the batch's last microbatch's gradient makes a parameter's final
        ws.on_grad = lambda k, r, i: reducer.gradient_ready(r, i) if (k + 1) % m == 0 else None
    g = torch.Generator().manual_seed(1 + rank)
    xs = [torch.randn(b, args.seq_len, args.d_model, generator=g).to(device) for _ in range(m * args.batches)]
    outs, losses = {}, []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start, step_s, cpu_start, wait_start = time.perf_counter(), 0.0, time.process_time(), 0.0
    for a in stage_actions(args.schedule, stage_index=0, num_stages=2, num_microbatches=m, num_batches=args.batches):
        k = a.index
        if a.kind == FORWARD and k == m * args.warmup:  # the first timed batch begins
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, step_s, cpu_start = time.perf_counter(), 0.0, time.process_time()
            wait_start = reducer.exposed_s if reducer is not None else 0.0  # the warm-up's all-reduce waits, left out
            if ws is not None:  # the stream's times so far (stall, gradient waits, copies): the warm-up's, left out
                warm = (ws.backend.stall_s(), ws.stats.grad_wait_s, *ws.backend.busy_s())
        with torch.profiler.record_function("compute") if probe and a.kind != STEP else contextlib.nullcontext():
            if a.kind == FORWARD:
                versions.module_for_batch(k // m)  # as the stage worker: waits for a background step writing it
                r = versions.replica_for_batch(k // m)
                if ws is not None:
                    ws.begin_forward(k, r)
                    out = ws.forward(versions.replicas[r], k, r, xs[k])
                else:
                    out = versions.replicas[r](xs[k])
                outs[k] = out.float().pow(2).mean()
                losses.append(outs[k].detach())
            elif a.kind == BACKWARD:
                if reducer is not None and (k + 1) % m == 0:  # the batch's last backward: reduce as it goes
                    reducer.arm(versions.replicas.index(versions.module_for_batch(k // m)))
                if ws is not None:
                    ws.begin_backward(k)
                outs.pop(k).backward()
                if ws is not None:
                    ws.end_backward(k)
        if a.kind == STEP:
            t0 = time.perf_counter()
            if ws is not None:
                ws.quiesce()
            wait = reducer.take().wait if reducer is not None else (lambda i: None)
            versions.step(k, grad_scale=1 / (m * w), before_bucket=wait)
            step_s += time.perf_counter() - t0
    versions.settle()  # the last background step counts in the time
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    per_thread = {  # --thread-times: each thread's CPU and wait for a core over the run
        name: [a - b for a, b in zip(v, threads_before.get(name, [0.0, 0.0]))]
        for name, v in (_threads_now() if args.thread_times else {}).items()
    }
    if host_steps is not None:
        per_thread["host-step threads"] = host_steps
    st = ws.close() if ws is not None else None
    if st is not None and args.warmup:
        for key, before in zip(("stall_s", "grad_wait_s", "copy_out_s", "copy_in_s"), warm):
            st[key] -= before
    result = {
        "samples_per_s": w * m * b * (args.batches - args.warmup) / elapsed,  # the replicas' together
        # per second of this process's CPU time (all its threads): on a shared CPU, what it gets of the cores
        # moves the wall clock's figure, far less this one
        "samples_per_cpu_s": w * m * b * (args.batches - args.warmup) / cpu_s,
        "allreduce_wait_s": reducer.exposed_s if reducer is not None else 0.0,  # the step waiting for the replicas
        # ... the same per timed batch (the sum above counts every batch, the warm-up's included)
        "allreduce_wait_per_batch_s": (reducer.exposed_s - wait_start) / (args.batches - args.warmup)
        if reducer is not None
        else 0.0,
        "step_s": step_s,
        "losses": [float(x) for x in losses],
        "weights": {n: t.detach().cpu().clone() for n, t in versions.newest().state_dict().items()},
        "stream": st,
        "layer_bytes": layer_bytes,
        "host_step_s": getattr(versions, "host_step_s", 0.0),  # background: the thread's stepping
        "host_step_wait_s": getattr(versions, "host_step_wait_s", 0.0),  # ... and what training waited for of it
        "host_step_cpu_s": getattr(versions, "host_step_cpu_s", 0.0),  # ... and ran on a core (its CPU time)
        "host_step_threads": threads if background else torch.get_num_threads(),
        "num_params": sum(p.numel() for p in versions.master),
        "threads": per_thread,
    }
    if device.type == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def predict(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """What the planner's cost model (``partitioner.cost``) predicts for the streamed run: the stage's blocks profiled
    as the planner profiles a layer (``profile_layer``, with this process's threads), this host's figures
    (``partitioner.host``, cached); on a CPU the copies are host copies and the host is the device, where the host's
    work adds to the batch, and where the replicas' compute leaves no core free (``host_free_cores``: w > 1 on one
    thread each, or one process on every core) so do the copies (a GPU's link has no measured figure here: CPU
    only)."""
    from partitioner.cost import Segments, StageContext, segment_costs
    from partitioner.host import host_profile
    from partitioner.profile import profile_layer
    from partitioner.topology import LOCAL, Link
    from pipedream2bw.config import OptimConfig

    cfg = GPTConfig(num_layers=args.layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len)
    optim = OptimConfig(name="adamw")
    w, threads = args.data_parallel, torch.get_num_threads()
    if w > 1:  # the ranks' one thread each
        torch.set_num_threads(1)
    block = profile_layer(_blocks(args)[0], cfg, optim, "block", args.microbatch_size, device=device, repeats=20)
    torch.set_num_threads(threads)
    host = host_profile()
    # the cores the replicas' compute leaves free (each on one thread where w > 1, as ``_dp_rank``)
    spare = free_cores(cores=host.cores, ranks=w, rank_threads=1 if w > 1 else threads)
    ctx = StageContext(
        stage_index=0,
        num_stages=2,
        num_microbatches=args.num_microbatches,
        data_parallel=w,
        # the replicas' all-reduce over gloo (the plain run's too: both run on this host)
        replica_link=Link("gloo", host.reduce_bytes_per_s, 0.0) if w > 1 else LOCAL,
        host_reduce_bw=host.reduce_bytes_per_s,
        host_share=max(1.0, w / host.cores),
        schedule=args.schedule,
        stream=True,
        stream_window=args.window,
        host_optimizer=True,
        host_device_bw=host.copy_bytes_per_s,
        host_step_bw=host.step_bytes_per_s,
        host_copy_bw=host.copy_bytes_per_s,
        host_step="sync",
        host_is_device=True,
        host_free_cores=spare,
    )
    seg, samples = Segments([block] * args.layers), w * args.num_microbatches * args.microbatch_size
    costs = segment_costs(seg, 0, args.layers, ctx)
    # the plain run as the planner sees it (weights and AdamW where the stage computes, stepping with this script's
    # kernel, the host's): the profile's own error, apart from the streamed terms'
    step = (3 * block.param_bytes + 2 * block.optimizer_bytes) / host.step_bytes_per_s
    plain_seg = Segments([dataclasses.replace(block, step_s=step)] * args.layers)
    plain = segment_costs(plain_seg, 0, args.layers, dataclasses.replace(ctx, stream=False, host_optimizer=False))
    return {
        "predicted_plain_samples_per_s": samples / float(plain["batch_s"]),
        "predicted_samples_per_s": samples / float(costs["batch_s"]),
        "predicted_host_step_s": float(costs["host_step_s"]),
        "predicted_host_sum_s": float(costs["host_sum_s"]),
        "predicted_stall_s": float(costs["stall_s"]),
        "predicted_allreduce_s": float(costs["allreduce_s"]),
        "predicted_exposed_s": float(costs["exposed_s"]),
        "host": host.describe(),
    }


def _dp_rank(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    """One replica of ``--data-parallel``: the plain run, then the streamed one (rank 0 puts both on ``out``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun's ranks (OMP_NUM_THREADS=1)
    store = dist.TCPStore("127.0.0.1", port, args.data_parallel, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.data_parallel)
    try:
        cpu, group = torch.device("cpu"), dist.group.WORLD
        runs = [run_stage(args, cpu, stream=s, probe=False, rank=rank, group=group) for s in (False, True)]
        if rank == 0:  # plain pickle: a queue would share the tensors' storage with a process about to exit
            out.put(pickle.dumps(runs))
    finally:
        dist.destroy_process_group()


def data_parallel_runs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``--data-parallel``: [plain, streamed], rank 0's figures, each run on ``args.data_parallel`` processes."""
    import multiprocessing

    from pipedream2bw.pipeline.comm import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_dp_rank, args=(r, port, args, out)) for r in range(args.data_parallel)]
    for p in procs:
        p.start()
    try:
        runs = pickle.loads(out.get(timeout=3600))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"--data-parallel: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return runs


def measure(args: argparse.Namespace, device: torch.device, *, stream: bool, **kw: bool) -> Dict[str, Any]:
    out = run_stage(args, device, stream=stream, probe=False, **kw)
    if device.type == "cpu":
        with tensor_peak(device, within="compute") as box:
            run_stage(args, device, stream=stream, probe=True)
        out["peak_device_bytes"] = box["bytes"]
    return out


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, help="GPT blocks in the stage (equal layers)")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--microbatch-size", type=int, default=None)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="batches run before the timing starts")
    p.add_argument("--schedule", default="2bw", choices=["2bw", "flush", "gpipe"])
    p.add_argument("--window", type=int, default=1, help="swap.weight_prefetch: layers copied ahead")
    p.add_argument(
        "--data-parallel", type=int, default=1, help="replicas (CPU: processes over gloo, their gradients all-reduced)"
    )
    p.add_argument(
        "--host-step",
        choices=["background", "sync"],
        default="background",
        help="swap.host_step of the streamed and host-optimizer runs (background: 2bw only, as swap.host_step=auto)",
    )
    p.add_argument(
        "--deterministic",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.use_deterministic_algorithms (auto: on with CUDA, whose attention backward is not deterministic "
        "otherwise; CPU kernels are)",
    )
    p.add_argument(
        "--predict",
        action="store_true",
        help="also print the planner's predicted samples/s for the streamed run (CPU only: partitioner.cost with this "
        "host's measured figures)",
    )
    p.add_argument(
        "--thread-times",
        action="store_true",
        help="also print, per thread of rank 0's plain and streamed runs, its CPU time and its wait for a core (Linux "
        "schedstat; every batch, the warm-up's included), the background host steps' threads summed",
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.deterministic == "on" or (args.deterministic == "auto" and device.type == "cuda"):
        # two runs of the same training differ on a GPU otherwise (H200, 2026-11-26: not bit for bit, as
        # scripts/bench_swap.py found for swapping); set before cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    for k, v in (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not 0 <= args.warmup < args.batches:
        raise SystemExit(f"--warmup ({args.warmup}) must be below --batches ({args.batches})")
    if args.data_parallel > 1:  # no memory probe: the figures are speed and bits
        if device.type != "cpu":
            raise SystemExit("--data-parallel: CPU only (gloo ranks; a GPU run is the trainer's, torchrun)")
        plain, streamed = data_parallel_runs(args)
        plain["peak_device_bytes"] = streamed["peak_device_bytes"] = float("nan")
    else:
        plain = measure(args, device, stream=False)
        streamed = measure(args, device, stream=True)
    # the bit-for-bit reference steps where the streamed run does: on a CPU, that is plain; on a GPU, the host
    reference = plain if device.type == "cpu" else measure(args, device, stream=False, host_optimizer=True)
    same = streamed["losses"] == reference["losses"] and all(
        torch.equal(reference["weights"][n], streamed["weights"][n]) for n in reference["weights"]
    )
    st = streamed["stream"]
    model = device_bytes_model(streamed["layer_bytes"], window=args.window)
    report = {
        "device": str(device),
        "layers": args.layers,
        "layer_bytes": streamed["layer_bytes"][0],
        "window": args.window,
        "plain_peak_device_bytes": plain["peak_device_bytes"],
        "streamed_peak_device_bytes": streamed["peak_device_bytes"],
        "reduction": plain["peak_device_bytes"] / streamed["peak_device_bytes"],
        "model_streamed_bytes": model,
        "bytes_to_device": st["bytes_in"],
        "bytes_to_host": st["grad_bytes_out"],
        "stall_s": st["stall_s"],
        "grad_wait_s": st["grad_wait_s"],
        "copy_in_s": st["copy_in_s"],
        "copy_out_s": st["copy_out_s"],
        "plain_samples_per_s": plain["samples_per_s"],
        "streamed_samples_per_s": streamed["samples_per_s"],
        "plain_step_s": plain["step_s"],
        "streamed_step_s": streamed["step_s"],
        "host_step": "background" if args.host_step == "background" and args.schedule == "2bw" else "sync",
        "streamed_host_step_s": streamed["host_step_s"],
        "streamed_host_step_wait_s": streamed["host_step_wait_s"],
        "streamed_host_step_cpu_s": streamed["host_step_cpu_s"],
        "streamed_host_step_threads": streamed["host_step_threads"],
        # the host step's parameters per second in the runtime, over the thread's wall clock and over its CPU time
        # (every batch's step, the first's, which makes the optimizer state, included)
        "streamed_host_step_params_per_s": streamed["num_params"] * args.batches / max(streamed["host_step_s"], 1e-12),
        "streamed_host_step_params_per_cpu_s": streamed["num_params"]
        * args.batches
        / max(streamed["host_step_cpu_s"], 1e-12),
        "streamed_over_plain_time": plain["samples_per_s"] / streamed["samples_per_s"],
        "data_parallel": args.data_parallel,
        "plain_allreduce_wait_s": plain["allreduce_wait_s"],
        "streamed_allreduce_wait_s": streamed["allreduce_wait_s"],
        "plain_allreduce_wait_per_batch_s": plain["allreduce_wait_per_batch_s"],
        "streamed_allreduce_wait_per_batch_s": streamed["allreduce_wait_per_batch_s"],
        "host_optimizer_samples_per_s": reference["samples_per_s"] if reference is not plain else None,
        "host_optimizer_peak_device_bytes": reference["peak_device_bytes"] if reference is not plain else None,
        "bit_for_bit": same,
    }
    if args.predict:
        if device.type != "cpu":
            raise SystemExit("--predict: CPU only (the planner has no measured figure of a GPU's link here)")
        report.update(predict(args, device))
        report["streamed_samples_per_cpu_s"] = streamed["samples_per_cpu_s"]
        report["plain_samples_per_cpu_s"] = plain["samples_per_cpu_s"]
        report["plain_predicted_over_measured"] = report["predicted_plain_samples_per_s"] / plain["samples_per_s"]
        report["predicted_over_measured"] = report["predicted_samples_per_s"] / report["streamed_samples_per_s"]
        report["predicted_over_measured_cpu"] = report["predicted_samples_per_s"] / streamed["samples_per_cpu_s"]
        plain_cpu = plain["samples_per_cpu_s"]
        report["plain_predicted_over_measured_cpu"] = report["predicted_plain_samples_per_s"] / plain_cpu
    if args.thread_times:
        for run, name in ((plain, "plain"), (streamed, "streamed")):
            report[f"{name}_threads"] = run["threads"]
            for thread, (cpu, wait) in sorted(run["threads"].items(), key=lambda kv: -kv[1][0]):
                if cpu > 0.001:
                    print(f"{name} thread {thread:<22} cpu {cpu:8.3f} s   waited for a core {wait:8.3f} s")
    width = max(map(len, report))
    for k, v in report.items():
        if isinstance(v, dict):
            continue  # printed above
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not same:
        raise SystemExit("streamed weights or losses differ from the plain run's")


if __name__ == "__main__":
    main()
