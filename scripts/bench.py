"""Throughput and memory of our schedules against torch.distributed.pipelining and one process.

    python scripts/bench.py [--nproc 2] [--num-microbatches 2] [--microbatch-size 16] [--repeats 3]

Systems, on the same GPT, stage split and microbatches: our 2bw, flush and gpipe;
torch.distributed.pipelining's Schedule1F1B and ScheduleGPipe driving our stage modules; and
the whole model in one process with one thread (the physical limit: d stages on d cores can
at best run d times its throughput). Runs alternate between systems within each repeat, so
drift hits all alike. Prints the command, the configuration and one table of medians
(samples/s, pipeline efficiency = samples/s / (d x single-process samples/s), per-stage peak
resident memory, idle fraction = 1 - the stage's own compute time / wall time per step) and
writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ["ours-2bw", "ours-flush", "ours-gpipe", "torch-1f1b", "torch-gpipe", "single"]


def _config(args, schedule: str, num_stages: int):
    from pipedream2bw.config import Config, DataConfig, DistConfig, GPTConfig, OptimConfig, PipelineConfig, TrainConfig, WandbConfig

    return Config(
        pipeline=PipelineConfig(schedule=schedule, num_stages=num_stages, num_microbatches=args.num_microbatches, microbatch_size=args.microbatch_size),
        model=GPTConfig(num_layers=args.num_layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len, vocab_size=256),
        optim=OptimConfig(name="adamw", lr=1e-3),
        data=DataConfig(),
        train=TrainConfig(num_steps=args.steps, log_every=10**6, warmup_steps=args.warmup),
        wandb=WandbConfig(mode="disabled"),
        dist=DistConfig(batch_p2p={"auto": None, "on": True, "off": False}[args.batch_p2p]),
    )


def _stage_compute_s(cfg, stage_index: int, num_stages: int, *, reps: int = 5) -> float:
    """Median time of one microbatch's forward + backward through this stage, alone."""
    import torch

    from pipedream2bw.config import gpt_balance
    from pipedream2bw.models import lm_loss
    from pipedream2bw.runner import build_stage_module

    balance = gpt_balance(cfg.model, num_stages)
    module = build_stage_module(cfg, balance, stage_index, None)
    b, T, C = cfg.pipeline.microbatch_size, cfg.model.seq_len, cfg.model.d_model
    x = torch.randint(0, 256, (b, T)) if stage_index == 0 else torch.randn(b, T, C, requires_grad=True)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        out = module(x)
        if stage_index == num_stages - 1:
            lm_loss(out, torch.randint(0, 256, (b, T))).backward()
        else:
            out.backward(torch.randn_like(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _feed(cfg, *, num_microbatches: int):
    from pipedream2bw.data import MicrobatchFeed, load_bytes

    return MicrobatchFeed(load_bytes(None), seq_len=cfg.model.seq_len, microbatch_size=cfg.pipeline.microbatch_size,
                          num_microbatches=num_microbatches, seed=cfg.seed)


def worker_ours(args, schedule: str) -> dict:
    from pipedream2bw.runner import run

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = _config(args, schedule, world)
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(cfg, tmp)
    out = {"rank": rank, "compute_s": _stage_compute_s(cfg, rank, world)}
    if summary is not None:  # rank 0; per-stage peaks were taken when training ended, before gathering results
        out.update(samples_per_s=summary["samples_per_s"], step_time_s=summary["step_time_s"], peak_rss_per_stage=summary["peak_memory_bytes"])
    return out


def worker_torch(args, schedule: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from pipedream2bw.config import build_optimizer, gpt_balance
    from pipedream2bw.models import lm_loss
    from pipedream2bw.runner import build_stage_module

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    cfg = _config(args, schedule, world)
    m, b = cfg.pipeline.num_microbatches, cfg.pipeline.microbatch_size
    module = build_stage_module(cfg, gpt_balance(cfg.model, world), rank, None)  # the split ours uses
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, m, loss_fn=lm_loss)
    opt = build_optimizer(module.parameters(), cfg.optim)
    feed = _feed(cfg, num_microbatches=m)
    ends = [time.perf_counter()]
    for t in range(cfg.train.num_steps):
        x, y = (torch.cat(parts) for parts in zip(*(feed.microbatch(t * m + j) for j in range(m))))
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    peak = _peak_rss()
    dist.destroy_process_group()
    steady = ends[args.warmup:]
    steps = [b2 - a for a, b2 in zip(steady, steady[1:])]
    return {
        "rank": rank, "peak_rss": peak, "compute_s": _stage_compute_s(cfg, rank, world),
        "samples_per_s": len(steps) * m * b / (steady[-1] - steady[0]), "step_time_s": statistics.median(steps),
    }


def worker_single(args) -> dict:
    import torch
    from torch import nn

    from pipedream2bw.config import build_optimizer
    from pipedream2bw.models import build_gpt_layers, lm_loss

    torch.set_num_threads(1)
    cfg = _config(args, "flush", 1)
    m, b = cfg.pipeline.num_microbatches, cfg.pipeline.microbatch_size
    model = nn.Sequential(*build_gpt_layers(cfg.model, seed=cfg.seed))
    opt = build_optimizer(model.parameters(), cfg.optim)
    feed = _feed(cfg, num_microbatches=m)
    ends = [time.perf_counter()]
    for t in range(cfg.train.num_steps):
        for j in range(m):
            x, y = feed.microbatch(t * m + j)
            (lm_loss(model(x), y) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    steady = ends[args.warmup:]
    steps = [b2 - a for a, b2 in zip(steady, steady[1:])]
    return {"rank": 0, "peak_rss": _peak_rss(), "compute_s": 0.0,
            "samples_per_s": len(steps) * m * b / (steady[-1] - steady[0]), "step_time_s": statistics.median(steps)}


def run_worker(args) -> None:
    system = args.worker
    if system.startswith("ours-"):
        result = worker_ours(args, system.split("-", 1)[1])
    elif system.startswith("torch-"):
        result = worker_torch(args, system.split("-", 1)[1])
    else:
        result = worker_single(args)
    Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))


def launch(system: str, args, argv_model) -> dict:
    from pipedream2bw.comm import free_port

    with tempfile.TemporaryDirectory() as out:
        nproc = 1 if system == "single" else args.nproc
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               __file__, "--worker", system, "--out", out, *argv_model]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{system} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ranks = sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    r0 = ranks[0]
    idle = [1 - args.num_microbatches * r["compute_s"] / r0["step_time_s"] for r in ranks] if system != "single" else [0.0]
    peaks = r0["peak_rss_per_stage"] if "peak_rss_per_stage" in r0 else [r["peak_rss"] for r in ranks]
    return {"samples_per_s": r0["samples_per_s"], "step_time_s": r0["step_time_s"],
            "peak_rss": peaks, "idle_fraction": statistics.mean(idle)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="pipeline stages (one process each)")
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--batch-p2p", choices=["auto", "on", "off"], default="auto", help="our dist.batch_p2p")
    parser.add_argument("--json", default="bench.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)
    argv_model = [f"--{k}={v}" for k, v in [
        ("num-microbatches", args.num_microbatches), ("microbatch-size", args.microbatch_size), ("num-layers", args.num_layers),
        ("d-model", args.d_model), ("num-heads", args.num_heads), ("seq-len", args.seq_len), ("steps", args.steps),
        ("warmup", args.warmup), ("batch-p2p", args.batch_p2p)]]
    systems = args.systems.split(",")
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(f"config: {args.nproc} processes x 1 thread, GPT {args.num_layers} blocks d_model {args.d_model} heads {args.num_heads} "
          f"seq {args.seq_len} vocab 256, m={args.num_microbatches} b={args.microbatch_size}, AdamW, {args.steps} steps "
          f"({args.warmup} warm-up left out), {args.repeats} repeats, systems alternate")
    results = {s: [] for s in systems}
    for repeat in range(args.repeats):
        for system in systems:
            results[system].append(launch(system, args, argv_model))
            print(f"  repeat {repeat} {system:>12}: {results[system][-1]['samples_per_s']:.1f} samples/s", flush=True)
    single = statistics.median(r["samples_per_s"] for r in results["single"]) if "single" in results else None
    rows = []
    print(f"\n{'system':>12} {'samples/s':>10} {'efficiency':>10} {'idle':>6} {'peak RSS per stage (MiB)':>26}")
    for system, runs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in runs)
        d = 1 if system == "single" else args.nproc
        eff = sps / (d * single) if single else None
        peaks = [statistics.median(r["peak_rss"][s] for r in runs) for s in range(len(runs[0]["peak_rss"]))]
        idle = statistics.median(r["idle_fraction"] for r in runs)
        rows.append({"system": system, "samples_per_s": sps, "efficiency": eff, "idle_fraction": idle, "peak_rss_per_stage": peaks, "runs": runs})
        peaks_text = " ".join(f"{p / 2**20:.0f}" for p in peaks)
        print(f"{system:>12} {sps:>10.1f} {eff if eff is not None else float('nan'):>10.2f} {idle:>6.2f} {peaks_text:>26}")
    by = {r["system"]: r["samples_per_s"] for r in rows}
    for ours, theirs in [("ours-2bw", "torch-1f1b"), ("ours-flush", "torch-1f1b"), ("ours-gpipe", "torch-gpipe")]:
        if ours in by and theirs in by:
            print(f"{ours} / {theirs}: {by[ours] / by[theirs]:.2f}x")
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
