"""One stage of our runtime under train.precision against a plain torch.autocast training loop.

    python scripts/bench_precision.py                        # on a GPU: the issue's GPT, bf16
    python scripts/bench_precision.py --device cpu           # small defaults on the CPU

The same GPT, microbatches (m of b sequences), AdamW and data feed, in one process: our runtime
as a single stage (``pipeline.num_stages=1``, ``run()``), and a loop of ``m`` autocast
forward/backward passes, ``loss / m`` accumulated, ``opt.step()`` and ``zero_grad`` per batch.
Runs alternate between the two, ``--repeats`` times. Prints samples/s (median; steps after
``--warmup``) and peak memory per system (CUDA: max allocated; CPU: peak tensor bytes from
torch.profiler in an untimed run), our ratio to the loop, and checks the target (ours >= 0.95x),
which is set for a GPU. Without CUDA it runs a small model on the CPU and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipedream2bw.config import (  # noqa: E402
    Config,
    DataConfig,
    DistConfig,
    GPTConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    WandbConfig,
    build_optimizer,
)
from pipedream2bw.data import MicrobatchFeed, load_bytes  # noqa: E402
from pipedream2bw.memory.memprobe import tensor_peak  # noqa: E402
from pipedream2bw.memory.precision import autocast, resolve  # noqa: E402
from pipedream2bw.models import build_gpt_layers, lm_loss  # noqa: E402
from pipedream2bw.pipeline import comm  # noqa: E402
from pipedream2bw.run.runner import TRAIN_RANGE, run  # noqa: E402

TARGET = 0.95
GPU_MODEL = dict(num_layers=12, d_model=1024, num_heads=16, seq_len=1024, microbatch_size=8, num_microbatches=4)
CPU_MODEL = dict(num_layers=4, d_model=256, num_heads=4, seq_len=128, microbatch_size=8, num_microbatches=4)


def make_config(args, steps: int) -> Config:
    return Config(
        pipeline=PipelineConfig(
            schedule=args.schedule,
            num_stages=1,
            num_microbatches=args.num_microbatches,
            microbatch_size=args.microbatch_size,
        ),
        model=GPTConfig(
            num_layers=args.num_layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len
        ),
        optim=OptimConfig(name="adamw", lr=1e-4),
        data=DataConfig(),
        train=TrainConfig(
            num_steps=steps,
            log_every=10**6,
            warmup_steps=min(args.warmup, steps - 2),
            precision=args.precision,
            resume="never",
        ),
        wandb=WandbConfig(mode="disabled"),
        dist=DistConfig(backend="nccl" if args.device.type == "cuda" else "gloo"),
    )


def ours(args, *, steps: int) -> float:
    """Our runtime, one stage; its summary's samples/s."""
    os.environ["MASTER_PORT"] = str(comm.free_port())
    with tempfile.TemporaryDirectory() as tmp:
        return run(make_config(args, steps), tmp)["samples_per_s"]


def plain(args, *, steps: int) -> float:
    """A plain autocast loop: what a user writes without a pipeline. No per-step sync but the last."""
    cfg = make_config(args, steps)
    m, b, device = cfg.pipeline.num_microbatches, cfg.pipeline.microbatch_size, args.device
    precision = resolve(cfg.train.precision, device.type)
    model = nn.Sequential(*build_gpt_layers(cfg.model, seed=cfg.seed)).to(device)
    opt = build_optimizer(model.parameters(), cfg.optim)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    feed = MicrobatchFeed(
        load_bytes(None), seq_len=cfg.model.seq_len, microbatch_size=b, num_microbatches=m, seed=cfg.seed
    )
    ends = []
    with torch.profiler.record_function(TRAIN_RANGE):
        for t in range(steps):
            for j in range(m):
                x, y = (v.to(device, non_blocking=True) for v in feed.microbatch(t * m + j))
                with autocast(precision, device.type):
                    logits = model(x)
                scaler.scale(lm_loss(logits.float(), y) / m).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if t >= cfg.train.warmup_steps - 1 and device.type == "cuda":
                torch.cuda.synchronize(device)  # step boundaries for the timing (ours syncs once per step on the loss)
            ends.append(time.perf_counter())
    steady = ends[cfg.train.warmup_steps - 1 :]
    return (len(steady) - 1) * m * b / (steady[-1] - steady[0])


def peak_memory(args, system) -> int:
    """Peak tensor bytes of a short untimed run."""
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    with tensor_peak(args.device, within=TRAIN_RANGE) as peak:
        system(args, steps=3)
    return peak["bytes"]


def profile(args, out: Path) -> Dict[str, float]:
    """``--profile``: each system once more under torch.profiler; its busiest kernels and operators to
    ``out/<system>.txt``, and the device time against the wall time per step: where the ratio comes from
    (more device work, or a device left idle by the host)."""
    from torch.profiler import ProfilerActivity

    out.mkdir(parents=True, exist_ok=True)
    figures = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.type == "cuda" else [])
    for name, system in {"ours": ours, "plain-autocast": plain}.items():
        steps = args.warmup + 3
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            system(args, steps=steps)
            wall = time.perf_counter() - start
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        text = [
            f"{name}: {steps} steps (setup and warm-up included), wall {wall:.3f} s, "
            f"device (self) {device_us / 1e6:.3f} s",
            events.table(sort_by="self_device_time_total" if device_us else "self_cpu_time_total", row_limit=30),
            events.table(sort_by="self_cpu_time_total", row_limit=20),
        ]
        (out / f"{name}.txt").write_text("\n".join(text) + "\n")
        figures[f"{name}_device_s_per_step"] = device_us / 1e6 / steps
        print(f"  profile {name:>15}: device {device_us / 1e6 / steps * 1e3:.1f} ms a step; {out / (name + '.txt')}")
    return figures


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16", "auto"])
    parser.add_argument("--schedule", default="2bw", choices=["2bw", "flush", "gpipe"])
    for key in GPU_MODEL:
        parser.add_argument(
            f"--{key.replace('_', '-')}",
            type=int,
            default=None,
            help="default: the issue's GPT on GPU, a small one on CPU",
        )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench_precision.json")
    parser.add_argument("--profile", type=Path, default=None, help="also profile each system; tables to this folder")
    args = parser.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu")
    args.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(args.device)
    else:
        torch.set_num_threads(1)  # as our ranks run on the CPU
    for key, value in (GPU_MODEL if cuda else CPU_MODEL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 2")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    precision = resolve(args.precision, args.device.type)
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(
        f"config: {args.device} ({torch.cuda.get_device_name(args.device) if cuda else '1 thread'}), precision "
        f"{precision}, "
        f"GPT {args.num_layers} blocks d_model {args.d_model} heads {args.num_heads} seq {args.seq_len}, "
        f"m={args.num_microbatches} b={args.microbatch_size}, AdamW, ours: 1 stage, {args.schedule}; {args.steps} "
        "steps "
        f"({args.warmup} warm-up left out) x {args.repeats} repeats, alternating; torch {torch.__version__}"
    )
    if not cuda:
        print(
            "NOTE: CPU figures; the target is set for a GPU (the issue's GPT on an H200), which this run does not "
            "verify"
        )
    systems = {"ours": ours, "plain-autocast": plain}
    rates = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name, fn in systems.items():
            rates[name].append(fn(args, steps=args.steps))
            print(f"  repeat {repeat} {name:>15}: {rates[name][-1]:.2f} samples/s", flush=True)
    peaks = {name: peak_memory(args, fn) for name, fn in systems.items()}
    kind = "CUDA max allocated" if cuda else "peak tensor bytes (profiler)"
    print(f"\n{'system':>15} {'samples/s':>10} {'peak memory (MiB, ' + kind + ')':>45}")
    rows = {}
    for name in systems:
        sps = statistics.median(rates[name])
        rows[name] = {"samples_per_s": sps, "runs": rates[name], "peak_memory_bytes": peaks[name]}
        print(f"{name:>15} {sps:>10.2f} {peaks[name] / 2**20:>45.1f}")
    ratio = rows["ours"]["samples_per_s"] / rows["plain-autocast"]["samples_per_s"]
    verdict = (
        ("met" if ratio >= TARGET else "MISSED") if cuda else ("would be met" if ratio >= TARGET else "would be missed")
    )
    print(f"\nours / plain-autocast: {ratio:.3f}x   target >= {TARGET}x (set for a GPU): {verdict}")
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "precision": precision,
        "rows": rows,
        "ratio": ratio,
        "memory_kind": kind,
        "gpu": cuda,
    }
    if args.profile is not None:
        payload["profile"] = profile(args, args.profile)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
