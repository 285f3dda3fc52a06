"""Activation swapping on one GPT stage: device memory and step time with and without, and transfer bandwidth.

    python scripts/bench_swap.py                      # CUDA if available, else CPU with small defaults
    python scripts/bench_swap.py --d-model 2048 --seq-len 1024 --microbatch-size 4 --resident 1
    python scripts/bench_swap.py --schedule gpipe --num-stages 2   # all m microbatches in flight
    python scripts/bench_swap.py --host-step-compare      # swap.optimizer=host: step time, host step sync vs background

The stage is the first of a ``--num-stages`` split of the GPT (embedding + its blocks), run
alone with its real action list (``schedule.stage_actions``; under 2bw up to d microbatches in
flight, under gpipe all m), its weight versions (``WeightVersions``), AdamW, and a fixed
gradient standing in for the one stage 1 would send. Runs alternate between "no swap" and
"swap" for ``--repeats`` rounds, each from the same weights, each after a garbage collection
(what a run leaves allocated is reported as ``leftover_bytes`` and subtracted).

Memory is the allocator's, not a count: CUDA's peak allocated bytes over the run; on a CPU,
torch.profiler's live tensor bytes, in one more untimed run of each (the profiler slows it; the
CPU backend's host buffers are outside torch's allocator, as pinned memory is outside CUDA's).
Activation memory is that peak minus weights, gradients, optimizer state and inputs. Each row
says what it should be: without swapping, what autograd saves for one microbatch times the
microbatches in flight; with swapping, the manager's own count. A large gap means memory held
that the stage does not need.

Bit identity: ``--deterministic on`` (default on CUDA) runs with
``torch.use_deterministic_algorithms(True)`` (and ``CUBLAS_WORKSPACE_CONFIG``), so that two
runs without swapping agree bit for bit and the swap run must too; with ``off`` the kernels
may differ between any two runs, and the largest weight difference of swap against no swap is
printed beside that of two runs without swapping.

Also: achieved host-device bandwidth (bytes moved / copy-stream busy time, CUDA events) against
a plain pinned copy measured the same way. On a CPU the "device" is host memory, there is no
PCIe link and copies are worker-thread memcpys: the figures then only show the mechanism
works, and the script says so. GPU target: >= 40% less activation memory for <= 10% more
step time.

``--host-step-compare`` measures swap.host_step instead (no swapping): the same stage with its optimizer on
the host (``HostOptimizerVersions``), the step on the training thread ('sync') against on a thread of its own
while the next batch computes ('background', 2bw only), alternating for ``--repeats`` rounds; it prints the
median step time of each (the median over a round's timed batches, then over rounds), the background thread's
step time and how much of it training waited for, and whether the weights are bit for bit the same.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from pipedream2bw.config import GPTConfig, gpt_balance
from pipedream2bw.io.fileio import atomic_write
from pipedream2bw.memory.host_optim import HostOptimizerVersions
from pipedream2bw.memory.memprobe import SavedBytes, tensor_peak
from pipedream2bw.memory.swap import CpuBackend, SwapManager, TransferBackend, make_backend
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD, STEP, stage_actions
from pipedream2bw.pipeline.schedule import in_flight as schedule_in_flight
from pipedream2bw.pipeline.versions import WeightVersions

GPU_DEFAULTS = dict(d_model=2048, num_heads=16, seq_len=1024, microbatch_size=4, num_layers=8)
CPU_DEFAULTS = dict(d_model=128, num_heads=4, seq_len=128, microbatch_size=8, num_layers=8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> Dict[str, float]:
    """Best GB/s of a plain copy of ``nbytes`` device -> pinned host and back (CUDA events), or of
    a host memcpy on a CPU."""
    if device.type != "cuda":
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        best = min(_timed_cpu(lambda: b.copy_(a)) for _ in range(reps))
        return {"to_host_GBps": nbytes / best / 1e9, "to_device_GBps": nbytes / best / 1e9}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("to_host_GBps", host, dev), ("to_device_GBps", dev, host)):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / min(times) / 1e9
    return out


def _timed_cpu(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_stage(args, device: torch.device) -> nn.Sequential:
    cfg = GPTConfig(num_layers=args.num_layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len)
    n = gpt_balance(cfg, args.num_stages)[0]
    return nn.Sequential(*build_gpt_layers(cfg, seed=0, indices=range(n))).to(device)


def in_flight(args) -> int:
    """Microbatches the stage (the first) holds at most: the runtime's bound, ``schedule.in_flight``."""
    return schedule_in_flight(args.schedule, 0, args.num_stages, args.num_microbatches)


def run_stage(args, device: torch.device, *, swap: bool, memory: bool, timed: bool = True) -> Dict[str, Any]:
    """Runs stage 0's actions for warm-up + timed batches; returns its figures.

    ``memory``: measure the peak tensor bytes of the whole run (CUDA: allocator counters, no
    cost; CPU: the profiler, so such a run is not ``timed``).
    """
    gc.collect()  # earlier runs' cycles must not count in this run's peak
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with tensor_peak(device) if memory else contextlib.nullcontext({}) as peak:
        # On a CPU the profiler would not see frees on the backend's worker threads: copies run inline then.
        backend = CpuBackend(overlap=False) if memory and device.type == "cpu" else make_backend(device)
        out, versions, data = _train_stage(args, device, backend=backend if swap else None, timed=timed)
    if memory:
        static = _static_bytes(versions, data)
        out.update(
            leftover_bytes=leftover,
            peak_memory_bytes=peak["bytes"] - leftover,
            static_bytes=static,
            activation_peak_bytes=peak["bytes"] - leftover - static,
        )
    return out


def _train_stage(
    args, device: torch.device, *, backend: Optional[TransferBackend], timed: bool, host_step: Optional[str] = None
):
    """``host_step`` ('sync' or 'background'): the optimizer on the host (swap.optimizer=host, swap.host_step)."""
    torch.manual_seed(0)
    factory = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    module = build_stage(args, device)
    if host_step is None:
        versions = WeightVersions(module, schedule=args.schedule, optimizer_factory=factory)
    else:
        versions = HostOptimizerVersions(
            module, schedule=args.schedule, optimizer_factory=factory, background=host_step == "background"
        )
    m, b, T, C = args.num_microbatches, args.microbatch_size, args.seq_len, args.d_model
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, 256, (b, T), generator=gen).to(device) for _ in range(m)]
    grad_out = torch.randn(b, T, C, generator=gen).to(device) * 1e-3  # what stage 1 would send back
    manager: Optional[SwapManager] = None
    if backend is not None:
        held = [t for r in versions.replicas for t in (*r.parameters(), *r.buffers())]
        manager = SwapManager(backend, min_bytes=args.min_bytes, resident=args.resident, exclude=held)
    params = {p.untyped_storage().data_ptr() for r in versions.replicas for p in r.parameters()}
    actions = stage_actions(
        args.schedule,
        stage_index=0,
        num_stages=args.num_stages,
        num_microbatches=m,
        num_batches=args.warmup + args.batches,
    )
    stash, step_times, saved_one = {}, [], None
    t0 = 0.0
    for a in actions:
        if a.kind == FORWARD:
            x = inputs[a.index % m]
            measure = SavedBytes(params) if saved_one is None else None
            ctx = (
                manager.forward(a.index, inputs=(x,), outer=measure)
                if manager
                else (measure or contextlib.nullcontext())
            )
            with ctx:
                stash[a.index] = versions.module_for_batch(a.index // m)(x)
            if measure is not None:
                saved_one = measure.nbytes
        elif a.kind == BACKWARD:
            if manager:
                manager.begin_backward(a.index)
            stash.pop(a.index).backward(grad_out)
            if manager:
                manager.end_backward(a.index)
        elif a.kind == STEP:
            versions.step(a.index, grad_scale=1.0 / m)
            _sync(device)
            now = time.perf_counter()
            if a.index >= args.warmup:
                step_times.append(now - t0)
            t0 = now
    versions.settle()  # a background host step still running
    out: Dict[str, Any] = {
        "host_step_s": getattr(versions, "host_step_s", 0.0),
        "host_step_wait_s": getattr(versions, "host_step_wait_s", 0.0),
        "step_time_s": statistics.median(step_times) if timed else None,
        "saved_bytes_per_microbatch": saved_one,
        "weights": {k: v.detach().cpu() for k, v in versions.newest().state_dict().items()},
    }
    if manager:
        out["swap"] = manager.close()
    return out, versions, [*inputs, grad_out]


def _static_bytes(versions: WeightVersions, data) -> int:
    """What the stage holds besides activations: both weight versions, one set of gradients
    (alive from a batch's first backward to its step), optimizer state, inputs, the fixed
    gradient. (Memory allocated at a step is no base: under 2bw the next batch's first
    microbatches are already in flight then.)"""
    weights = sum(p.numel() * p.element_size() for r in versions.replicas for p in r.parameters())
    grads = sum(p.numel() * p.element_size() for p in versions.replicas[0].parameters())
    state = sum(
        v.numel() * v.element_size()
        for o in versions.optimizers
        for st in o.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    return weights + grads + state + sum(t.numel() * t.element_size() for t in data)


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    parser.add_argument("--schedule", choices=["2bw", "flush", "gpipe"], default="2bw")
    parser.add_argument("--num-stages", type=int, default=4, help="the split whose first stage is run")
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int)
    parser.add_argument("--num-layers", type=int, help="transformer blocks of the whole GPT")
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--min-bytes", type=int, default=65536, help="swap.min_bytes")
    parser.add_argument("--resident", type=int, default=1, help="swap.resident")
    parser.add_argument("--warmup", type=int, default=2, help="batches before timing")
    parser.add_argument("--batches", type=int, default=3, help="timed batches per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, alternating no-swap and swap")
    parser.add_argument(
        "--deterministic",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.use_deterministic_algorithms for every run (auto: on with CUDA; CPU kernels are deterministic)",
    )
    parser.add_argument(
        "--host-step-compare",
        action="store_true",
        help="measure swap.host_step (sync against background, optimizer on the host) instead of swapping",
    )
    parser.add_argument("--json", default="bench_swap.json")
    args = parser.parse_args()
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    for k, v in (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.deterministic == "on" or (args.deterministic == "auto" and device.type == "cuda"):
        # Before cuBLAS starts; deterministic matmuls need it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Strict: mem-efficient attention's backward then runs deterministically
        torch.use_deterministic_algorithms(True)
        args.deterministic = "on"
    if device.type == "cpu":
        torch.set_num_threads(1)
        print(
            "NOTE: no CUDA device: CPU-only figures (the 'device' is host memory, copies are memcpys on worker threads;"
            " they show the mechanism runs, not what a GPU gains)"
        )
    print("config:", {k: v for k, v in vars(args).items()})
    if args.host_step_compare:
        return compare_host_step(args, device)

    cuda = device.type == "cuda"
    runs = {"no_swap": [], "swap": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(run_stage(args, device, swap=name == "swap", memory=cuda))
    if not cuda:  # the profiler slows a run: memory comes from one more, untimed run of each
        for name in runs:
            runs[name][0].update(
                {
                    k: v
                    for k, v in run_stage(args, device, swap=name == "swap", memory=True, timed=False).items()
                    if k.endswith("_bytes")
                }
            )
    base_w = runs["no_swap"][0]["weights"]
    rows = {name: _summarize(rs, args) for name, rs in runs.items()}
    sw = runs["swap"][-1]["swap"]
    link = copy_bandwidth(device, max(sw["microbatch_bytes"], 1 << 20))
    base, swapped = rows["no_swap"], rows["swap"]
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "cpu_only": not cuda,
        "args": vars(args),
        "weights_identical": all(torch.equal(r["weights"][k], base_w[k]) for r in runs["swap"] for k in base_w),
        "no_swap_runs_identical": all(torch.equal(r["weights"][k], base_w[k]) for r in runs["no_swap"] for k in base_w),
        "max_weight_diff_swap": max(_max_diff(r["weights"], base_w) for r in runs["swap"]),
        "max_weight_diff_no_swap": max(_max_diff(r["weights"], base_w) for r in runs["no_swap"]),
        "rows": rows,
        "swap_stats": sw,
        "achieved_to_host_GBps": sw["swapped_out_bytes"] / sw["copy_out_s"] / 1e9 if sw["copy_out_s"] else None,
        "achieved_to_device_GBps": sw["swapped_in_bytes"] / sw["copy_in_s"] / 1e9 if sw["copy_in_s"] else None,
        "plain_copy": link,
        "step_time_increase": swapped["step_time_s"] / base["step_time_s"] - 1,
        "activation_memory_reduction": 1 - swapped["activation_peak_bytes"] / base["activation_peak_bytes"],
        # The manager's count against what the stage holds without swapping (one microbatch's saved bytes x in flight).
        "counted_activation_reduction": 1 - sw["peak_device_bytes"] / base["expected_activation_bytes"],
    }
    _print(result)
    atomic_write(Path(args.json), (json.dumps(result, indent=2) + "\n").encode())
    print(f"wrote {args.json}")


def compare_host_step(args, device: torch.device) -> None:
    """--host-step-compare: the stage with its optimizer on the host, the step sync against background."""
    runs: Dict[str, list] = {"sync": [], "background": []}
    for _ in range(args.repeats):
        for mode in runs:
            gc.collect()
            runs[mode].append(_train_stage(args, device, backend=None, timed=True, host_step=mode)[0])
    base_w = runs["sync"][0]["weights"]
    rows = {
        mode: {
            "step_time_s": statistics.median(r["step_time_s"] for r in rs),
            "host_step_s_per_run": statistics.median(r["host_step_s"] for r in rs),
            "host_step_wait_s_per_run": statistics.median(r["host_step_wait_s"] for r in rs),
        }
        for mode, rs in runs.items()
    }
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "args": vars(args),
        "rows": rows,
        "weights_identical": all(
            torch.equal(r["weights"][k], base_w[k]) for rs in runs.values() for r in rs for k in base_w
        ),
        "speedup": rows["sync"]["step_time_s"] / rows["background"]["step_time_s"],
    }
    for mode, row in rows.items():
        print(
            f"  host step {mode:10s} step {row['step_time_s'] * 1e3:8.2f} ms  (background thread "
            f"{row['host_step_s_per_run'] * 1e3:.1f} ms a run, training waited "
            f"{row['host_step_wait_s_per_run'] * 1e3:.1f} ms)"
        )
    print(
        f"  sync / background step time: {result['speedup']:.3f}x; weights bit-identical: {result['weights_identical']}"
    )
    atomic_write(Path(args.json), (json.dumps(result, indent=2) + "\n").encode())
    print(f"wrote {args.json}")


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _summarize(rs, args) -> Dict[str, Any]:
    """Medians over a configuration's runs; ``expected_activation_bytes`` is what the stage should
    hold: autograd's saved bytes x in flight without swapping, the manager's count with."""
    measured = [r for r in rs if "peak_memory_bytes" in r]
    row = {
        "step_time_s": statistics.median(r["step_time_s"] for r in rs),
        "saved_bytes_per_microbatch": rs[0]["saved_bytes_per_microbatch"],
        "leftover_bytes": max(r["leftover_bytes"] for r in measured),
    }
    for key in ("peak_memory_bytes", "activation_peak_bytes"):
        row[key] = statistics.median(r[key] for r in measured)
    row["expected_activation_bytes"] = (
        statistics.median(r["swap"]["peak_device_bytes"] for r in rs)
        if "swap" in rs[0]
        else rs[0]["saved_bytes_per_microbatch"] * in_flight(args)
    )
    return row


def _print(res: Dict[str, Any]) -> None:
    mib = 2**20
    ident = "deterministic kernels" if res["args"]["deterministic"] == "on" else "default kernels"
    print(
        f"\ndevice: {res['device']}{'  (CPU-ONLY FIGURES)' if res['cpu_only'] else ''}; {ident}; weights bit-identical "
        f"with and without swap: {res['weights_identical']} (no-swap runs among themselves: "
        f"{res['no_swap_runs_identical']}; largest difference "
        f"{res['max_weight_diff_swap']:.3g} with swap, {res['max_weight_diff_no_swap']:.3g} between no-swap runs)"
    )
    what = {"no_swap": "saved x in flight", "swap": "manager's count"}
    for name, row in res["rows"].items():
        left = f"  (earlier runs left {row['leftover_bytes'] / mib:.1f} MiB allocated)" if row["leftover_bytes"] else ""
        print(
            f"  {name:8s} step {row['step_time_s'] * 1e3:9.2f} ms  peak allocated "
            f"{row['peak_memory_bytes'] / mib:9.1f} MiB  "
            f"activations {row['activation_peak_bytes'] / mib:9.1f} MiB (should be "
            f"{row['expected_activation_bytes'] / mib:.1f} MiB: "
            f"{what[name]}){left}"
        )
    sw = res["swap_stats"]
    print(
        f"  swap: {sw['swapped_out_bytes'] / mib:.1f} MiB out, {sw['swapped_in_bytes'] / mib:.1f} MiB in per run; "
        f"peak counted activations {sw['peak_device_bytes'] / mib:.1f} MiB (one microbatch "
        f"{sw['microbatch_bytes'] / mib:.1f} MiB); "
        f"stall {sw['stall_s'] * 1e3:.2f} ms, offload waits {sw['offload_wait_s'] * 1e3:.2f} ms"
    )
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    print(
        f"  bandwidth GB/s: achieved to host {fmt(res['achieved_to_host_GBps'])}, to device "
        f"{fmt(res['achieved_to_device_GBps'])}; "
        f"plain copy to host {res['plain_copy']['to_host_GBps']:.2f}, to device "
        f"{res['plain_copy']['to_device_GBps']:.2f}"
    )
    print(
        f"  step time {res['step_time_increase'] * 100:+.1f}%, counted activation bytes "
        f"{-res['counted_activation_reduction'] * 100:+.1f}%, "
        f"measured activation memory {-res['activation_memory_reduction'] * 100:+.1f}% "
        "(target <= -40% for <= +10% time)"
    )


if __name__ == "__main__":
    main()
