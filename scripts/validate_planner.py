"""Planner predictions against real runs on this machine: per-stage peak memory and samples/s.

    python scripts/validate_planner.py [--plans 1x4,2x8,4x16] [--global-batch 64] [--steps 12] [overrides ...]

For each plan ``DxB`` (pipeline depth D, microbatch size B, one replica, 2bw):
1. the runtime baseline eps per stage: the same command (torchrun, same d, m, steps, optimizer)
   training a GPT of a few kilobytes (d_model 8, seq 8, b=1): the torch runtime, the kernels' code
   paged in, gloo, Hydra, the corpus, with no model to speak of (measured, not fitted); and once,
   loopback p2p bandwidth and latency between two gloo ranks, which the topology then uses;
2. the planner profiles the GPT (cached) and plans with d=D, b=B fixed (boundaries by the DP);
3. the real command runs the plan: torchrun -m pipedream2bw.train partition=file partition.path=...;
4. a table: predicted vs measured peak memory per stage (summary.json ``peak_memory_bytes``, the
   process peak RSS on CPU) and samples/s, with ratios. Targets: memory within 15%, samples/s 20%.
Every launch runs its ranks with one thread each (OMP_NUM_THREADS=1, as torchrun sets it for more
than one process and as the profiler measures). ``--fixed-mmap-threshold`` sets glibc's
MALLOC_MMAP_THRESHOLD_=131072 for every launch (baseline and runs alike): glibc otherwise raises
its mmap threshold as large tensors are freed, so later activations come from the heap and freed
memory stays resident, allocator slack the model does not count. Timings are as noisy as the
machine; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(nproc: int, args, timeout_s: float = 900) -> subprocess.CompletedProcess:
    from pipedream2bw.pipeline.comm import torchrun_command

    cmd = [*torchrun_command(nproc), *args]
    env = {
        **os.environ,
        "WANDB_SILENT": "true",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **EXTRA_ENV,
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def link_rank(out_dir: str) -> None:
    """One of two ranks measuring loopback p2p with gloo: latency (4-byte messages) and bandwidth (4 MiB)."""
    import torch
    import torch.distributed as dist

    from pipedream2bw.pipeline import comm

    rank, world_size, local_rank = comm.env_rank()
    store = comm.make_store(rank=rank, world_size=world_size, timeout_s=120)
    ctx = comm.init(store=store, rank=rank, world_size=world_size, local_rank=local_rank, backend="gloo", timeout_s=120)
    result = {}
    for name, numel, reps in (("latency", 1, 200), ("bandwidth", 2**20, 20)):
        t = torch.zeros(numel)
        dist.barrier(group=ctx.control)
        start = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        one_way = (time.perf_counter() - start) / (2 * reps)
        result[name] = one_way if name == "latency" else t.numel() * 4 / one_way
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    comm.shutdown(ctx)


def measure_link(work: Path) -> dict:
    out = work / "link"
    out.mkdir(parents=True, exist_ok=True)
    _torchrun(2, [str(Path(__file__).resolve()), "--link-rank", str(out)])
    return json.loads((out / "rank0.json").read_text())


EXTRA_ENV: dict = {}
TINY = ["model.num_layers=1", "model.d_model=8", "model.num_heads=2", "model.seq_len=8"]


def measure_baseline(d: int, m: int, steps: int, overrides, work: Path) -> list:
    """eps per stage: the real trainer, same d, m, optimizer and steps, on a GPT of a few kilobytes
    (b=1, seq 8, d_model 8): what the runtime itself holds (torch, kernels' code, gloo, Hydra, the
    corpus) with no model to speak of. Measured, not fitted: it knows nothing of the plan's model."""
    run_dir = work / f"baseline-{d}"
    keep = [o for o in overrides if o.startswith("optim.")]
    _torchrun(
        d,
        [
            "-m",
            "pipedream2bw.train",
            *keep,
            *TINY,
            f"pipeline.num_stages={d}",
            f"pipeline.num_microbatches={m}",
            "pipeline.microbatch_size=1",
            f"train.num_steps={steps}",
            "train.warmup_steps=1",
            "wandb.mode=disabled",
            f"hydra.run.dir={run_dir}",
        ],
    )
    return json.loads((run_dir / "summary.json").read_text())["peak_memory_bytes"]


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--plans", default="1x4,2x8,4x16", help="comma-separated DxB: pipeline depth x microbatch size")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--json", default="validate_planner.json")
    parser.add_argument("--cache-dir", help="reuse this profile cache (default: profile afresh in this run)")
    parser.add_argument(
        "--fixed-mmap-threshold", action="store_true", help="MALLOC_MMAP_THRESHOLD_=131072 for every launch"
    )
    parser.add_argument("--link-rank", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the model/optimizer, e.g. model.d_model=64")
    args = parser.parse_args()
    if args.link_rank:
        return link_rank(args.link_rank)

    sys.path.insert(0, str(ROOT))
    from partitioner.__main__ import compose
    from partitioner.auto import plan_config, runtime_topology
    from partitioner.planner import save_plan, stage_table

    if args.fixed_mmap_threshold:
        EXTRA_ENV["MALLOC_MMAP_THRESHOLD_"] = "131072"
    print("command:", " ".join(["python", "scripts/validate_planner.py", *sys.argv[1:]]))
    plans = [tuple(int(x) for x in item.split("x")) for item in args.plans.split(",")]
    work = Path(tempfile.mkdtemp(prefix="validate_planner-"))
    link = measure_link(work)
    print(f"loopback p2p (gloo, 2 ranks): {link['bandwidth'] / 1e9:.2f} GB/s, {link['latency'] * 1e6:.0f} us one way")
    rows, stage_rows = [], []
    for d, b in plans:
        eps = measure_baseline(d, args.global_batch // b, args.steps, args.overrides, work)
        cfg = compose([*args.overrides, f"train.global_batch_size={args.global_batch}"])
        cfg.partition.depths, cfg.partition.microbatch_sizes = [d], [b]
        cfg.partition.recompute, cfg.partition.swap = False, False
        cfg.partition.cache_dir = args.cache_dir or str(work / "profile-cache")  # profiled now, under today's load
        cfg.topology.intra_node_bw_gbps = link["bandwidth"] / 1e9
        cfg.topology.intra_node_latency_us = link["latency"] * 1e6
        topo = runtime_topology(cfg.topology, world_size=d, local_world_size=d)
        plan = plan_config(cfg, devices=d, topology=topo, runtime_bytes=eps, runners_up=0)[0]
        path = save_plan(plan, work / f"plan-{d}x{b}.yaml")
        print(
            f"\nplan {d}x{b}: balance {plan.balance}, m={plan.num_microbatches}, eps (runtime baseline RSS per stage) "
            f"{[round(e / 2**20) for e in eps]} MiB\n{stage_table(plan)}"
        )
        run_dir = work / f"run-{d}x{b}"
        _torchrun(
            d,
            [
                "-m",
                "pipedream2bw.train",
                *args.overrides,
                "partition=file",
                f"partition.path={path}",
                f"train.num_steps={args.steps}",
                f"train.warmup_steps={args.warmup_steps}",
                "wandb.mode=disabled",
                f"hydra.run.dir={run_dir}",
            ],
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        for s in range(d):
            pred, meas = plan.predicted_peak_memory_bytes[s], summary["peak_memory_bytes"][s]
            stage_rows.append(
                dict(plan=f"{d}x{b}", stage=s, predicted_mib=pred / 2**20, measured_mib=meas / 2**20, ratio=pred / meas)
            )
        rows.append(
            dict(
                plan=f"{d}x{b}",
                d=d,
                b=b,
                m=plan.num_microbatches,
                balance=plan.balance,
                predicted_samples_per_s=plan.predicted_samples_per_s,
                measured_samples_per_s=summary["samples_per_s"],
                ratio=plan.predicted_samples_per_s / summary["samples_per_s"],
                baseline_rss_mib=[e / 2**20 for e in eps],
            )
        )
    print("\npeak memory per stage (MiB; measured = process peak RSS from summary.json)")
    print(f"{'plan':>6} {'stage':>5} {'predicted':>10} {'measured':>10} {'pred/meas':>9}  within 15%")
    for r in stage_rows:
        print(
            f"{r['plan']:>6} {r['stage']:>5} {r['predicted_mib']:>10.1f} {r['measured_mib']:>10.1f} {r['ratio']:>9.3f} "
            " "
            f"{'yes' if abs(r['ratio'] - 1) <= 0.15 else 'NO':>10}"
        )
    print("\nthroughput (samples/s)")
    print(f"{'plan':>6} {'m':>3} {'balance':>14} {'predicted':>10} {'measured':>10} {'pred/meas':>9}  within 20%")
    for r in rows:
        print(
            f"{r['plan']:>6} {r['m']:>3} {str(r['balance']):>14} {r['predicted_samples_per_s']:>10.1f} "
            f"{r['measured_samples_per_s']:>10.1f} {r['ratio']:>9.3f}  {'yes' if abs(r['ratio'] - 1) <= 0.2 else 'NO'}"
        )
    Path(args.json).write_text(json.dumps({"link": link, "plans": rows, "stages": stage_rows}, indent=2) + "\n")
    print(f"\nwritten to {args.json}; run files in {work}")


if __name__ == "__main__":
    main()
