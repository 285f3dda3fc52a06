"""Measured peak tensor bytes per rank against precision.param_memory, for every memory combination.

    python scripts/bench_memory.py                 # the table: schedule x precision x weight_dtype x sharded,
                                                   # one stage on w = 1, 2, 4 ranks and d=2 x w=4 (8 ranks)
    python scripts/bench_memory.py --time          # 4 ranks (d=2 x w=2): sharded vs unsharded samples/s, 2bw and flush

Memory: a GPT whose parameters dwarf its activations (32 blocks of d_model 64, 4 tokens a microbatch) and whose
largest parameter, like each gradient bucket (``--bucket-mb``), is 1% of a stage, as a 25 MB bucket is of a large
stage: what is per parameter shows, what is per bucket or per layer (the bucket being flattened, gloo's all-gather
output, activations) stays small. AdamW, a few steps per combination; all combinations of one layout run in one
launch (one torchrun, one rendezvous store). Each rank measures the peak tensor bytes of its training loop (CUDA:
max allocated; CPU: ``memprobe.tensor_peak``, torch.profiler's memory events with every thread's frees counted),
divided by its stage's parameters; a row gives the largest over the ranks beside what the model says:
``param_memory``'s total plus, under bf16 with float32 versions, autocast's weight casts (``cast_per_microbatch``
per matmul parameter and microbatch in flight). ``rest`` is the difference (activations, the backward's
temporaries, a bucket or two in flight). For a sharded run: its optimizer state against the unsharded run's, per
rank (1/w), and how far its peak fell below the unsharded run's, against the fall ``param_memory`` predicts.

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
from pipedream2bw.memory.precision import needs_agreement, param_memory, step_waits  # noqa: E402
from pipedream2bw.pipeline import comm  # noqa: E402
from pipedream2bw.pipeline.schedule import in_flight  # noqa: E402

MEMORY_MODEL = dict(num_layers=32, d_model=64, num_heads=4, seq_len=4, microbatch_size=1, num_microbatches=2)
# On a GPU the caching allocator holds ~69 MB more, whatever the model (H200, 2026-11-26: a 101.8 MB peak against
# param_memory's 32.7 MB for the 1.6M parameters above; cuBLAS's workspaces, most likely): 42 B a parameter against
# param_memory's 20. A 100M-parameter GPT of the same shape keeps that near 3%, and its largest parameter (4 MiB)
# sets the bucket at the same 1% of a stage.
MEMORY_MODEL_CUDA = dict(MEMORY_MODEL, d_model=512, num_heads=8)
MEMORY_BUCKET_MB = {False: 0.0625, True: 4.0}  # CUDA or not
MEMORY_LAYOUTS = ("1x1", "1x2", "1x4", "2x4")  # d x w
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
    clip=None,
):
    return dict(
        clip=clip,
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
        optim=OptimConfig(name="adamw", lr=1e-4, sharded=j["sharded"], clip_grad_norm=j.get("clip")),
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
    from pipedream2bw.memory.memprobe import tensor_peak
    from pipedream2bw.run.runner import TRAIN_RANGE, run

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
                balance=summary["balance"],
                ranks=[{f: r[f] for f in ("rank", "stage", "optimizer_state_bytes")} for r in summary["ranks"]],
            )
        Path(args.out, f"job{k}_rank{rank}.json").write_text(json.dumps(record))


def stage_params(model: dict, balance: list) -> list:
    """Per stage of ``balance``: (parameters, parameters that autocast casts: nn.Linear weights)."""
    from pipedream2bw.models import build_gpt_layers

    m = model
    gpt = GPTConfig(num_layers=m["num_layers"], d_model=m["d_model"], num_heads=m["num_heads"], seq_len=m["seq_len"])
    layers = build_gpt_layers(gpt, seed=0)
    out, start = [], 0
    for n in balance:
        mods = layers[start : start + n]
        start += n
        params = sum(p.numel() for m in mods for p in m.parameters())
        matmul = sum(x.weight.numel() for m in mods for x in m.modules() if isinstance(x, torch.nn.Linear))
        out.append((params, matmul))
    return out


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


def _predicted(j: dict, stage_index: int):
    waits = step_waits(
        j["schedule"],
        agreement=needs_agreement(j["precision"], clip_grad_norm=j.get("clip"), on_nonfinite="stop"),
        tied_across_stages=False,
        sharded=j["sharded"] and j["w"] > 1,
        stage_index=stage_index,
    )
    return param_memory(
        j["precision"],
        schedule=j["schedule"],
        optimizer="adamw",
        weight_dtype_name=j["weight_dtype"],
        sharded=j["sharded"],
        data_parallel=j["w"],
        waits=waits,
    )


def measure(j: dict, ranks: list) -> dict:
    """One run's row: per rank its stage, parameters, peak, modelled bytes and optimizer state."""
    info = ranks[0]  # rank 0's record carries the summary's figures
    per_stage = stage_params(j["model"], info["balance"])
    summary = {r["rank"]: r for r in info["ranks"]}
    out = []
    for r in ranks:
        stage = summary[r["rank"]]["stage"]
        params, matmul = per_stage[stage]
        pm = _predicted(j, stage)
        casts = (
            pm.cast_per_microbatch * matmul * in_flight(j["schedule"], stage, j["d"], j["model"]["num_microbatches"])
        )
        out.append(
            dict(
                rank=r["rank"],
                stage=stage,
                params=params,
                peak_bytes=r["peak_bytes"],
                modelled_bytes=pm.total * params + casts,
                optimizer_state_bytes=summary[r["rank"]]["optimizer_state_bytes"],
            )
        )
    worst = max(out, key=lambda r: r["peak_bytes"] / r["params"])
    return {**j, "peak_bytes": worst["peak_bytes"], "params": worst["params"], "ranks": out}


def memory_table(args) -> None:
    rows = []
    for layout in args.layouts:
        d, w = (int(x) for x in layout.split("x"))
        jobs = [
            job(
                schedule=s,
                d=d,
                w=w,
                precision=p,
                weight_dtype=wd,
                sharded=sh,
                steps=args.steps,
                model=MEMORY_MODEL_CUDA if torch.cuda.is_available() else MEMORY_MODEL,
                bucket_mb=args.bucket_mb,
                clip=args.clip,
            )
            for s in ("2bw", "flush")
            for p, wd in COMBINATIONS
            for sh in ((False, True) if w > 1 else (False,))
        ]
        rows += [measure(j, ranks) for j, ranks in zip(jobs, launch(jobs, nproc=d * w, memory=True))]
        print(f"  d={d} x w={w}: {len(jobs)} runs done", flush=True)
    kind = "CUDA max allocated" if torch.cuda.is_available() else "peak tensor bytes (torch.profiler)"
    if args.json:
        Path(args.json).write_text(json.dumps({"memory_kind": kind, "rows": rows}, indent=1) + "\n")
    print(
        f"\nmeasured: {kind} per rank / its stage's parameters, the largest over the ranks; modelled: "
        "precision.param_memory (AdamW) + autocast's weight casts in flight"
    )
    print(
        "| schedule | precision | weight_dtype | sharded | d x w | measured B/param | modelled B/param | rest "
        "| optimizer state / unsharded | fall measured | fall predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    key = lambda r, sharded: (r["schedule"], r["precision"], r["weight_dtype"], sharded, r["d"], r["w"])  # noqa: E731
    by_key = {key(r, r["sharded"]): r for r in rows}
    for r in rows:
        worst = max(r["ranks"], key=lambda x: x["peak_bytes"] / x["params"])
        measured, modelled = worst["peak_bytes"] / worst["params"], worst["modelled_bytes"] / worst["params"]
        state = fall = predicted_fall = ""
        if r["sharded"]:
            plain = by_key[key(r, False)]
            unsharded_state = {x["rank"]: x["optimizer_state_bytes"] for x in plain["ranks"]}
            ratio = max(x["optimizer_state_bytes"] / unsharded_state[x["rank"]] for x in r["ranks"])
            state = f"{ratio:.4f} (1/{r['w']} = {1 / r['w']:.4f})"
            plain_worst = max(x["peak_bytes"] / x["params"] for x in plain["ranks"])
            predicted = _predicted(plain, worst["stage"]).total - _predicted(r, worst["stage"]).total
            fall = f"{plain_worst - measured:.2f} ({(plain_worst - measured) / predicted - 1:+.1%})"
            predicted_fall = f"{predicted:.2f}"
        print(
            f"| {r['schedule']} | {r['precision']} | {r['weight_dtype']} | {'yes' if r['sharded'] else 'no'} "
            f"| {r['d']} x {r['w']} | {measured:.2f} | {modelled:.2f} "
            f"| {measured - modelled:+.2f} ({measured / modelled - 1:+.1%}) "
            f"| {state} | {fall} | {predicted_fall} |"
        )
    params = sorted({x["params"] for r in rows for x in r["ranks"]})
    model = MEMORY_MODEL_CUDA if torch.cuda.is_available() else MEMORY_MODEL
    print(
        f"\n(GPT {model}: {', '.join(map(str, params))} parameters a stage; AdamW, {args.steps} steps, "
        f"pipeline.bucket_mb={args.bucket_mb}{f', optim.clip_grad_norm={args.clip}' if args.clip else ''})"
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
        f"\nd=2 x w=2 on {'GPU' if torch.cuda.is_available() else 'CPU'}, GPT {TIME_MODEL}, AdamW, {args.steps} steps, "
        f"pipeline.bucket_mb={args.bucket_mb}"
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
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--time", action="store_true", help="samples/s, sharded vs unsharded, 4 ranks")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=list(MEMORY_LAYOUTS),
        help="memory table: d x w layouts, d stages of w replicas (d * w ranks each)",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: 3 (memory), 60 (time)")
    parser.add_argument("--repeats", type=int, default=3, help="--time: rounds of the four runs")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="pipeline.bucket_mb. Memory table, default 0.0625 (4 on a GPU, its larger GPT): the memory GPT's largest "
        "parameter (64 KiB float32), "
        "about 1%% of its 6.5 MB, so that a bucket's temporaries (its flat copy as it starts, gloo's all-gather "
        "output) are a small part of a stage, as the default 25 MB is of a large one. Time: the run's default (25), "
        "one bucket a stage; a smaller one adds a reduce-scatter and an all-gather per bucket to a sharded step",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=None,
        help="memory table: optim.clip_grad_norm for every run (a step agreement: under 2bw the step waits and a "
        "stage holds the closed batch's gradient, param_memory's held_gradient)",
    )
    parser.add_argument("--json", default=None, help="memory table: also write its rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    args.steps = args.steps or (60 if args.time else 3)
    if args.bucket_mb is None:
        args.bucket_mb = PipelineConfig().bucket_mb if args.time else MEMORY_BUCKET_MB[torch.cuda.is_available()]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(
        f"torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}"
    )
    (time_table if args.time else memory_table)(args)


if __name__ == "__main__":
    main()
