"""Measured peak tensor bytes per rank against precision.param_memory, for every memory combination.

    python scripts/bench_memory.py                 # the table: schedule x precision x weight_dtype x sharded, w=1,2,4
    python scripts/bench_memory.py --time          # 4 ranks (d=2 x w=2): sharded vs unsharded samples/s, 2bw and flush

Memory: one stage (``pipeline.num_stages=1``) on w data-parallel ranks of a tiny GPT whose parameters dwarf its
activations, AdamW, a few steps per combination; all combinations of one w run in one launch (one torchrun, one
rendezvous store). Each rank measures the peak tensor bytes of its training loop (CUDA: max allocated; CPU:
``memprobe.tensor_peak``, torch.profiler's memory events); the table gives the largest over the ranks, in bytes
per parameter beside ``param_memory``'s total, and, for a sharded run, how far its peak fell below the unsharded
run's (measured) against the fall ``param_memory`` predicts. The measured peak also holds activations, the flat
gradient copy of the all-reduce or reduce-scatter and the optimizer's temporaries, which param_memory leaves out.

Time (``--time``): 4 ranks, sharded and unsharded under 2bw and flush, ``--repeats`` rounds alternating the four,
median samples/s of each and the sharded / unsharded ratios, with the all-gather time forwards waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pipedream2bw import comm  # noqa: E402
from pipedream2bw.config import (  # noqa: E402
    Config,
    DataConfig,
    DistConfig,
    GPTConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    WandbConfig,
)
from pipedream2bw.precision import param_memory  # noqa: E402

MEMORY_MODEL = dict(num_layers=2, d_model=128, num_heads=4, seq_len=16, microbatch_size=1, num_microbatches=2)
TIME_MODEL = dict(num_layers=4, d_model=128, num_heads=4, seq_len=64, microbatch_size=2, num_microbatches=4)
COMBINATIONS = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "compute")]  # (precision, weight_dtype)


def job(
    *,
    schedule: str,
    d: int,
    w: int,
    precision: str,
    weight_dtype: str,
    sharded: bool,
    steps: int,
    model: dict,
    bucket_mb,
):
    return dict(
        bucket_mb=bucket_mb,
        schedule=schedule,
        d=d,
        w=w,
        precision=precision,
        weight_dtype=weight_dtype,
        sharded=sharded,
        steps=steps,
        model=model,
    )


def make_config(j: dict, *, cuda: bool) -> Config:
    m = j["model"]
    return Config(
        pipeline=PipelineConfig(
            schedule=j["schedule"],
            num_stages=j["d"],
            data_parallel=j["w"],
            num_microbatches=m["num_microbatches"],
            microbatch_size=m["microbatch_size"],
            bucket_mb=j["bucket_mb"],
        ),
        model=GPTConfig(
            num_layers=m["num_layers"], d_model=m["d_model"], num_heads=m["num_heads"], seq_len=m["seq_len"]
        ),
        optim=OptimConfig(name="adamw", lr=1e-4, sharded=j["sharded"]),
        data=DataConfig(),
        train=TrainConfig(
            num_steps=j["steps"],
            log_every=10**6,
            warmup_steps=min(3, j["steps"] - 2),
            precision=j["precision"],
            weight_dtype=j["weight_dtype"],
            resume="never",
        ),
        wandb=WandbConfig(mode="disabled"),
        dist=DistConfig(backend="nccl" if cuda else "gloo"),
    )


def worker(args) -> None:
    """One rank: every job in order, one rendezvous store; writes its figures per job."""
    from pipedream2bw.memprobe import tensor_peak
    from pipedream2bw.runner import TRAIN_RANGE, run

    rank, world_size, local_rank = comm.env_rank()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    store = comm.make_store(rank=rank, world_size=world_size, timeout_s=120)
    jobs = json.loads(Path(args.jobs).read_text())
    for k, j in enumerate(jobs):
        run_dir = Path(args.out, f"job{k}")
        cfg = make_config(j, cuda=cuda)
        if args.memory:
            if cuda:
                torch.cuda.empty_cache()
            with tensor_peak(device, within=TRAIN_RANGE) as peak:
                summary = run(cfg, run_dir, store=store)
        else:
            peak, summary = {}, run(cfg, run_dir, store=store)
        record = {"rank": rank, "peak_bytes": peak.get("bytes")}
        if summary is not None:  # rank 0
            record.update(
                samples_per_s=summary["samples_per_s"],
                allgather_exposed_s=[r.get("allgather_exposed_s", 0.0) for r in summary["ranks"]],
                params=sum(p.numel() for p in _stage_params(cfg)),
            )
        Path(args.out, f"job{k}_rank{rank}.json").write_text(json.dumps(record))


def _stage_params(cfg: Config):
    """The parameters of one stage (d=1: the whole GPT)."""
    from pipedream2bw.models import build_gpt_layers

    return [p for layer in build_gpt_layers(cfg.model, seed=cfg.seed) for p in layer.parameters()]


def launch(jobs: list, *, nproc: int, memory: bool) -> list:
    """Runs ``jobs`` on ``nproc`` ranks in one torchrun; per job, its ranks' records."""
    with tempfile.TemporaryDirectory() as out:
        Path(out, "jobs.json").write_text(json.dumps(jobs))
        cmd = [*comm.torchrun_command(nproc), __file__, "--worker", "--jobs", str(Path(out, "jobs.json")), "--out", out]
        proc = subprocess.run(cmd + (["--memory"] if memory else []), capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"a run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return [
            [json.loads(Path(out, f"job{k}_rank{r}.json").read_text()) for r in range(nproc)] for k in range(len(jobs))
        ]


def memory_table(args) -> None:
    rows = []
    for w in args.w:
        jobs = [
            job(
                schedule=s,
                d=1,
                w=w,
                precision=p,
                weight_dtype=wd,
                sharded=sh,
                steps=args.steps,
                model=MEMORY_MODEL,
                bucket_mb=args.bucket_mb,
            )
            for s in ("2bw", "flush")
            for p, wd in COMBINATIONS
            for sh in ((False, True) if w > 1 else (False,))
        ]
        for j, ranks in zip(jobs, launch(jobs, nproc=w, memory=True)):
            rows.append((j, max(r["peak_bytes"] for r in ranks), ranks[0]["params"]))
        print(f"  w={w}: {len(jobs)} runs done", flush=True)
    kind = "CUDA max allocated" if torch.cuda.is_available() else "peak tensor bytes (torch.profiler)"
    if args.json:
        records = [{**j, "peak_bytes": peak, "params": params} for j, peak, params in rows]
        Path(args.json).write_text(json.dumps({"memory_kind": kind, "rows": records}, indent=1) + "\n")
    print(f"\nmeasured: {kind} per rank (largest over the ranks); predicted: precision.param_memory (AdamW)")
    header = "| schedule | precision | weight_dtype | sharded | w | measured B/param | predicted B/param | fall measured | fall predicted |"  # noqa: E501
    print(header)
    print("|---|---|---|---|---|---|---|---|---|")
    peaks = {(j["schedule"], j["precision"], j["weight_dtype"], j["sharded"], j["w"]): peak for j, peak, _ in rows}
    for j, peak, params in rows:
        pm = param_memory(
            j["precision"],
            schedule=j["schedule"],
            optimizer="adamw",
            weight_dtype_name=j["weight_dtype"],
            sharded=j["sharded"],
            data_parallel=j["w"],
        )
        fall_measured = fall_predicted = ""
        if j["sharded"]:
            plain = peaks[(j["schedule"], j["precision"], j["weight_dtype"], False, j["w"])]
            unsharded = param_memory(
                j["precision"],
                schedule=j["schedule"],
                optimizer="adamw",
                weight_dtype_name=j["weight_dtype"],
                data_parallel=j["w"],
            )
            fall_measured = f"{(plain - peak) / params:.2f}"
            fall_predicted = f"{unsharded.total - pm.total:.2f}"
        print(
            f"| {j['schedule']} | {j['precision']} | {j['weight_dtype']} | {'yes' if j['sharded'] else 'no'} "
            f"| {j['w']} | {peak / params:.2f} | {pm.total:.2f} | {fall_measured} | {fall_predicted} |"
        )
    print(
        f"\n(GPT {MEMORY_MODEL}, {rows[0][2]} parameters, one stage, AdamW, {args.steps} steps, "
        f"pipeline.bucket_mb={args.bucket_mb})"
    )


def time_table(args) -> None:
    kinds = [(s, sh) for s in ("2bw", "flush") for sh in (False, True)]
    jobs = [
        job(
            schedule=s,
            d=2,
            w=2,
            precision="fp32",
            weight_dtype="fp32",
            sharded=sh,
            steps=args.steps,
            model=TIME_MODEL,
            bucket_mb=args.bucket_mb,
        )
        for _ in range(args.repeats)
        for s, sh in kinds
    ]
    results = launch(jobs, nproc=4, memory=False)
    rates = {k: [] for k in kinds}
    exposed = {k: [] for k in kinds}
    for j, ranks in zip(jobs, results):
        key = (j["schedule"], j["sharded"])
        rates[key].append(ranks[0]["samples_per_s"])
        exposed[key].append(max(ranks[0]["allgather_exposed_s"]) / args.steps * 1e3)
    print(
        f"\nd=2 x w=2 on {'GPU' if torch.cuda.is_available() else 'CPU'}, GPT {TIME_MODEL}, AdamW, {args.steps} steps"
    )
    print("| schedule | sharded | samples/s (median) | runs | all-gather waited, ms/step (most of a rank) |")
    print("|---|---|---|---|---|")
    for s, sh in kinds:
        print(
            f"| {s} | {'yes' if sh else 'no'} | {statistics.median(rates[(s, sh)]):.1f} | "
            f"{', '.join(f'{r:.1f}' for r in rates[(s, sh)])} | {statistics.median(exposed[(s, sh)]):.2f} |"
        )
    for s in ("2bw", "flush"):
        ratio = statistics.median(rates[(s, True)]) / statistics.median(rates[(s, False)])
        print(f"{s}: sharded / unsharded = {ratio:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="samples/s, sharded vs unsharded, 4 ranks")
    parser.add_argument("--w", type=int, nargs="+", default=[1, 2, 4], help="data-parallel widths (memory table)")
    parser.add_argument("--steps", type=int, default=None, help="default: 3 (memory), 12 (time)")
    parser.add_argument("--repeats", type=int, default=3, help="--time: rounds of the four runs")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=0.125,
        help="pipeline.bucket_mb: 1/15 of the tiny GPT's 1.8 MB, so that the collectives' temporaries (per bucket: "
        "gloo's copies) are a small part of a stage, as the default 25 MB is of a large one",
    )
    parser.add_argument("--json", default=None, help="memory table: also write its rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    args.steps = args.steps or (12 if args.time else 3)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(
        f"torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
    )
    (time_table if args.time else memory_table)(args)


if __name__ == "__main__":
    main()
