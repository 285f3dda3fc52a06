"""Measured peak tensor bytes per rank against precision.param_memory, for every memory combination.

    python scripts/bench_memory.py                 # the table: schedule x precision x weight_dtype x sharded,
                                                   # one stage on w = 1, 2, 4 ranks and d=2 x w=4 (8 ranks)
    python scripts/bench_memory.py --time          # 4 ranks (d=2 x w=2): sharded vs unsharded samples/s, 2bw and flush
    python scripts/bench_memory.py --tensor        # pipeline.tensor_parallel: one rank's bytes per parameter of its
                                                   # stage at t = 1 and 2 against the planner's (partitioner/tensor.py)
    python scripts/bench_memory.py --optimizers    # each rank's peak against the planner's predicted peak, per
                                                   # optimizer and delay correction (the step's transients),
                                                   # and its optimizer state against the planner's
    python scripts/bench_memory.py --sequence      # pipeline.sequence_parallel: a rank's activations at d=2 x t=2,
                                                   # without and with it, against the planner's; and samples/s
    python scripts/bench_memory.py --ties          # tied embeddings held by one rank (zbv's rank 0, d = 1): its
                                                   # peak and weight state against the planner's plan for it

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

Tensor (``--tensor``, layouts d x w x t, fp32, AdamW): per rank, what its stage's run held (the summary's weight
versions and optimizer state, counted from the tensors; a float32 gradient per parameter held) and its peak tensor
bytes, each divided by the stage's whole parameters, against the planner's figures for that rank
(``segment_costs`` on ``tensor.split_layers`` of the analytic costs): weights + gradients + optimizer state, and the
rest (the peak less them) against its activations + buffers + workspace.

Sequence (``--sequence``, d=2 x w=1 x t=2, 2bw, fp32, AdamW, ``SEQUENCE_MODEL``: activations dwarf the parameters;
its vocabulary, 257, is odd, so the planner too keeps the embedding and the head whole, as this runtime does): per
rank, without and with pipeline.sequence_parallel, what autograd saved for a microbatch times the most microbatches
held (the summary's ``peak_stash_bytes``) against the planner's saved activations (``saved_bytes`` of
``tensor.split_layers`` times ``schedule.in_flight``), and the peak tensor bytes less the weight state (the run's
tensors) against the planner's activations + buffers + workspace; then samples/s of each, ``--repeats`` rounds
alternating the two (``--steps`` each, no profiler).

Ties (``--ties``, ``TIE_MODEL``: a GPT with model.tie_embeddings whose vocabulary dwarfs its blocks, fp32, AdamW):
``partition.costs=analytic`` plans each of ``TIE_LAYOUTS`` (schedule, d) with runtime bytes 0 (``plan_config``, the
planner's own search, its depth and microbatch size pinned), runs the plan's balance and reports per rank the measured
peak tensor bytes and weight state (the run's versions, a float32 gradient each, its optimizer state) against the
plan's predicted peak and weights + gradients + optimizer. One parameter where one rank holds both the embedding and
the head (zbv's rank 0, chunks 0 and 2d-1; any schedule at d = 1).

Time (``--time``): 4 ranks, sharded and unsharded under 2bw and flush, ``--repeats`` rounds alternating the four,
median samples/s of each and the sharded / unsharded ratios, with the all-gather time forwards waited for.
"""

from __future__ import annotations

import argparse
import dataclasses
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
TENSOR_LAYOUTS = ("1x1x1", "1x1x2", "2x1x2")  # d x w x t
# --optimizers: docs/planner.md's GPT that fits only at t = 2, whose matrices are large against its activations
OPTIM_MODEL = dict(num_layers=2, d_model=256, num_heads=4, seq_len=64, microbatch_size=2, num_microbatches=4)
OPTIM_LAYOUTS = ("1x1x1", "1x1x2", "2x1x2")  # d x w x t
OPTIMIZERS = {  # label: (optim.name, optim.delay_correction under 2bw; flush runs none)
    "default": ("muon", "error_feedback"),
    "adamw": ("adamw", "none"),
    "sgd": ("sgd", "none"),
    "muon": ("muon", "none"),
    "predict": ("muon", "predict"),
    "predict_ef": ("muon", "predict_error_feedback"),  # Muon's 'auto' where the prediction composes (t > 1 too)
}
SEQUENCE_MODEL = dict(
    num_layers=4, d_model=64, num_heads=4, seq_len=128, microbatch_size=4, num_microbatches=2, vocab_size=257
)
TIE_MODEL = dict(
    num_layers=2, d_model=64, num_heads=4, seq_len=16, microbatch_size=2, num_microbatches=4, vocab_size=4096
)
TIE_LAYOUTS = (("zbv", 2), ("flush", 1), ("2bw", 1))  # (schedule, d)
RANK_FIELDS = ("rank", "stage", "optimizer_state_bytes", "weight_bytes", "peak_stash_bytes")  # the summary's, per rank
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
    t: int = 1,
    sp: bool = False,
):
    return dict(
        t=t,
        sp=sp,
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
            tensor_parallel=j.get("t", 1),
            recompute=j.get("recompute", False),
            sequence_parallel=j.get("sp", False),
            balance=j.get("balance"),
        ),
        model=GPTConfig(
            num_layers=m["num_layers"],
            d_model=m["d_model"],
            num_heads=m["num_heads"],
            seq_len=m["seq_len"],
            vocab_size=m.get("vocab_size", 256),
            tie_embeddings=j.get("tie", False),
        ),
        optim=OptimConfig(
            name=j.get("optim", "adamw"),
            delay_correction=j.get("correction", "auto"),
            lr=1e-4,
            sharded=j["sharded"],
            clip_grad_norm=j.get("clip"),
        ),
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
                ranks=[{f: r[f] for f in RANK_FIELDS} for r in summary["ranks"]],
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


def planner_ranks(j: dict, balance: list) -> list:
    """Per stage of ``balance``: the planner's memory figures (bytes) for one of its ranks, the analytic costs of
    ``j``'s GPT split ``j['t']`` ways (``tensor.split_layers``, as the planner's search evaluates a candidate)."""
    from partitioner.auto import tensor_request
    from partitioner.cost import Segments, segment_costs
    from partitioner.planner import group_topology, stage_contexts
    from partitioner.profile import analytic_gpt
    from partitioner.tensor import split_layers
    from partitioner.topology import intra_link
    from pipedream2bw.config.optimizers import correction_in_effect

    cfg, t, d, w = make_config(j, cuda=False), j["t"], j["d"], j["w"]
    # the correction the runtime runs under this schedule (none under flush), as partition=auto plans it
    cfg.optim = dataclasses.replace(cfg.optim, delay_correction=correction_in_effect(cfg.optim, j["schedule"]))
    b, m = j["model"]["microbatch_size"], j["model"]["num_microbatches"]
    layers = analytic_gpt(cfg.model, cfg.optim, b, cfg.topology, precision=j["precision"])
    shape = tensor_request(cfg, j["precision"], search=True)["tensor"]
    link = intra_link(cfg.topology)
    seg = Segments(split_layers(layers, shape, t, b=b, link=link, sequence_parallel=j.get("sp", False)))
    rank_map = [[s * w + r for r in range(w)] for s in range(d)]
    waits = [_predicted(j, s).held_gradient > 0 for s in range(d)]
    contexts = stage_contexts(
        group_topology(cfg.topology, t),
        rank_map,
        schedule=j["schedule"],
        num_microbatches=m,
        recompute=j.get("recompute", False),
        swap=False,
        swap_resident=0,
        runtime_bytes=0,
        bucket_bytes=j["bucket_mb"] * 2**20,
        waits=waits,
    )
    bounds = [sum(balance[:s]) for s in range(d + 1)]
    keys = ("weights", "gradients", "optimizer", "activations", "buffers", "workspace", "step", "memory")
    keys += ("steady_memory", "step_memory")
    out = [
        {k: float(v) for k, v in segment_costs(seg, bounds[s], bounds[s + 1], contexts[s]).items() if k in keys}
        for s in range(d)
    ]
    for s in range(d):  # what autograd saves: the stage's layers' saved bytes times the microbatches in flight
        out[s]["saved"] = float(seg.A[bounds[s + 1]] - seg.A[bounds[s]]) * in_flight(j["schedule"], s, d, m)
    return out


def tensor_table(args) -> None:
    """One rank's bytes per parameter of its stage at each d x w x t of ``args.tensor_layouts``, 2bw and flush,
    against the planner's (the module docstring)."""
    rows = []
    for layout in args.tensor_layouts:
        d, w, t = (int(x) for x in layout.split("x"))
        jobs = [
            job(schedule=s, d=d, w=w, t=t, precision="fp32", weight_dtype="fp32", sharded=False, steps=args.steps,
                model=MEMORY_MODEL, bucket_mb=args.bucket_mb)
            for s in ("2bw", "flush")
        ]  # fmt: skip
        for j, ranks in zip(jobs, launch(jobs, nproc=d * w * t, memory=True)):
            rows += _tensor_rows(j, ranks)
        print(f"  d={d} x w={w} x t={t}: {len(jobs)} runs done", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(
        "\nper rank, bytes / its stage's whole parameters. held: weight versions + optimizer state (the run's tensors)"
        " + a float32 gradient per parameter held; planner: weights + gradients + optimizer of segment_costs on "
        "tensor.split_layers; rest: peak tensor bytes (torch.profiler) - held, against the planner's activations + "
        "buffers + workspace"
    )
    print(
        "| d x w x t | schedule | stage | tensor rank | parameters held / stage's | held B/param | planner B/param "
        "| held / planner | peak B/param | rest B/param | planner's rest B/param |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['schedule']} | {r['stage']} | {r['tensor_rank']} | {r['held_fraction']:.4f} "
            f"| {r['held']:.2f} | {r['planner']:.2f} | {r['held'] / r['planner']:.3f} | {r['peak']:.2f} "
            f"| {r['peak'] - r['held']:.2f} | {r['planner_rest']:.2f} |"
        )
    print(f"\n(GPT {MEMORY_MODEL}: AdamW, fp32, {args.steps} steps, pipeline.bucket_mb={args.bucket_mb})")


def _tensor_rows(j: dict, ranks: list) -> list:
    """``tensor_table``'s rows of one run: one per rank."""
    info = ranks[0]
    whole = [params for params, _ in stage_params(j["model"], info["balance"])]
    planned = planner_ranks(j, info["balance"])
    summary = {r["rank"]: r for r in info["ranks"]}
    versions = 2 if j["schedule"] == "2bw" else 1
    out = []
    for r in ranks:
        st = summary[r["rank"]]
        stage, weights = st["stage"], st["weight_bytes"]
        held = weights + weights / versions + st["optimizer_state_bytes"]  # + one float32 gradient per parameter
        plan = planned[stage]
        n = whole[stage]
        out.append(
            dict(
                layout=f"{j['d']} x {j['w']} x {j['t']}",
                schedule=j["schedule"],
                stage=stage,
                tensor_rank=r["rank"] % j["t"],
                held_fraction=weights / versions / 4 / n,
                held=held / n,
                planner=(plan["weights"] + plan["gradients"] + plan["optimizer"]) / n,
                peak=r["peak_bytes"] / n,
                planner_rest=(plan["activations"] + plan["buffers"] + plan["workspace"]) / n,
            )
        )
    return out


def optim_table(args) -> None:
    """Each rank's measured peak tensor bytes against the planner's predicted peak (``segment_costs``' memory on
    ``tensor.split_layers`` of the analytic costs, runtime 0), per optimizer of ``OPTIMIZERS``, 2bw and flush, at
    ``args.optim_layouts`` (d x w x t) on ``OPTIM_MODEL``: the step's transients (Muon's whole matrices, error
    feedback's and the weight prediction's copies) against the steady state's activations; and each rank's optimizer
    state (the summary's, counted from its tensors: error feedback's u and the prediction's d included) against the
    planner's. ``args.optim_labels``: which of ``OPTIMIZERS``."""
    rows = []
    for layout in args.optim_layouts:
        d, w, t = (int(x) for x in layout.split("x"))
        jobs = [
            dict(job(schedule=s, d=d, w=w, t=t, precision="fp32", weight_dtype="fp32", sharded=False, steps=args.steps,
                     model=OPTIM_MODEL, bucket_mb=PipelineConfig().bucket_mb), optim=name, correction=corr, label=label)
            for label, (name, corr) in OPTIMIZERS.items()
            if label in args.optim_labels
            for s in ("2bw", "flush")
        ]  # fmt: skip
        for j, ranks in zip(jobs, launch(jobs, nproc=d * w * t, memory=True)):
            planned = planner_ranks(j, ranks[0]["balance"])
            summary = {r["rank"]: r for r in ranks[0]["ranks"]}
            for r in ranks:
                st = summary[r["rank"]]
                rows.append(dict(layout=layout, label=j["label"], schedule=j["schedule"], rank=r["rank"],
                                 stage=st["stage"], peak=r["peak_bytes"], state=st["optimizer_state_bytes"],
                                 **planned[st["stage"]]))  # fmt: skip
        print(f"  {layout}: {len(jobs)} runs done", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print("| d x w x t | optimizer | schedule | rank | stage | measured peak B | predicted peak B "
          "| predicted / measured | steady B | at the step B | step's transients B | optimizer state B "
          "| predicted state B |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['label']} | {r['schedule']} | {r['rank']} | {r['stage']} | {r['peak']:,} "
            f"| {r['memory']:,.0f} | {r['memory'] / r['peak']:.3f} | {r['steady_memory']:,.0f} "
            f"| {r['step_memory']:,.0f} | {r['step']:,.0f} | {r['state']:,} | {r['optimizer']:,.0f} |"
        )
    print(f"\n(GPT {OPTIM_MODEL}: fp32, {args.steps} steps; {', '.join(f'{k}: {v}' for k, v in OPTIMIZERS.items())})")


def sequence_table(args) -> None:
    """A rank's activations at d=2 x t=2 without and with pipeline.sequence_parallel against the planner's, and the
    samples/s of each (the module docstring)."""
    jobs = [
        job(schedule="2bw", d=2, w=1, t=2, sp=sp, precision="fp32", weight_dtype="fp32", sharded=False,
            steps=args.steps, model=SEQUENCE_MODEL, bucket_mb=args.bucket_mb)
        for sp in (False, True)
    ]  # fmt: skip
    rows = []
    for j, ranks in zip(jobs, launch(jobs, nproc=4, memory=True)):
        info = ranks[0]
        planned = planner_ranks(j, info["balance"])
        for r in info["ranks"]:
            plan, versions = planned[r["stage"]], 2
            held = r["weight_bytes"] * (1 + 1 / versions) + r["optimizer_state_bytes"]
            peak = next(x["peak_bytes"] for x in ranks if x["rank"] == r["rank"])
            rest = plan["activations"] + plan["buffers"] + plan["workspace"]
            rows.append(dict(sp=j["sp"], rank=r["rank"], stage=r["stage"], saved=r["peak_stash_bytes"],
                             planner_saved=plan["saved"], rest=peak - held, planner_rest=rest))  # fmt: skip
    timed = [dict(j, steps=args.time_steps) for _ in range(args.repeats) for j in jobs]
    rates = {False: [], True: []}
    for j, ranks in zip(timed, launch(timed, nproc=4, memory=False)):
        rates[j["sp"]].append(ranks[0]["samples_per_s"])
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "samples_per_s": rates}, indent=1) + "\n")
    print(f"\nd=2 x w=1 x t=2, 2bw, fp32, AdamW, GPT {SEQUENCE_MODEL}, {args.steps} steps (bytes per rank)")
    print("| sequence parallel | rank | stage | saved x in flight | planner | meas / planner | peak - weight state "
          "| planner (activations + buffers + workspace) | meas / planner |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'yes' if r['sp'] else 'no'} | {r['rank']} | {r['stage']} | {r['saved']:,} | {r['planner_saved']:,.0f} "
            f"| {r['saved'] / r['planner_saved']:.3f} | {r['rest']:,.0f} | {r['planner_rest']:,.0f} "
            f"| {r['rest'] / r['planner_rest']:.3f} |"
        )
    for sp in (False, True):
        mine = [r for r in rows if r["sp"] == sp]
        most = max(r["saved"] for r in mine)
        print(f"sequence parallel {'on ' if sp else 'off'}: saved x in flight, most of a rank {most:,}")
    print(f"samples/s ({args.time_steps} steps, {args.repeats} rounds alternating): " + ", ".join(
        f"{'with' if sp else 'without'} {statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})"
        for sp, v in rates.items()
    ))  # fmt: skip


def _tie_plan(j: dict):
    """The planner's plan for ``j`` (``--ties``): analytic costs, runtime bytes 0, ``j``'s depth and microbatch size."""
    from partitioner.auto import plan_config

    cfg = make_config(j, cuda=False)
    m = j["model"]
    cfg.train.global_batch_size = m["microbatch_size"] * m["num_microbatches"]
    cfg.partition = dataclasses.replace(
        cfg.partition, costs="analytic", depths=[j["d"]], microbatch_sizes=[m["microbatch_size"]]
    )
    return plan_config(cfg, runtime_bytes=0, devices=j["d"] * j["w"])[0]


def ties_table(args) -> None:
    """Tied embeddings on one rank: each rank's measured peak and weight state against its plan's (the module
    docstring)."""
    rows = []
    for schedule, d in TIE_LAYOUTS:
        j = dict(job(schedule=schedule, d=d, w=1, precision="fp32", weight_dtype="fp32", sharded=False,
                     steps=args.steps, model=TIE_MODEL, bucket_mb=PipelineConfig().bucket_mb), tie=True)  # fmt: skip
        plan = _tie_plan(j)
        j["balance"] = list(plan.balance)
        ranks = launch([j], nproc=d, memory=True)[0]
        versions = 2 if schedule == "2bw" else 1
        for r in ranks[0]["ranks"]:
            peak = next(x["peak_bytes"] for x in ranks if x["rank"] == r["rank"])
            parts = plan.predicted_memory_breakdown[r["stage"]]
            held = r["weight_bytes"] * (1 + 1 / versions) + r["optimizer_state_bytes"]
            rows.append(dict(schedule=schedule, d=d, balance=j["balance"], rank=r["rank"], peak=peak, held=held,
                             planner_peak=plan.predicted_peak_memory_bytes[r["stage"]],
                             planner_held=parts["weights"] + parts["gradients"] + parts["optimizer"]))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print("| schedule | d | balance | rank | measured peak B | predicted peak B | pred / meas | weight state B "
          "| planner's B | pred / meas |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['schedule']} | {r['d']} | {r['balance']} | {r['rank']} | {r['peak']:,} | {r['planner_peak']:,} "
            f"| {r['planner_peak'] / r['peak']:.3f} | {r['held']:,.0f} | {r['planner_held']:,} "
            f"| {r['planner_held'] / r['held']:.3f} |"
        )
    print(f"\n(GPT {TIE_MODEL}, model.tie_embeddings=true: fp32, AdamW, {args.steps} steps; analytic costs)")


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
    parser.add_argument(
        "--tensor",
        action="store_true",
        help="pipeline.tensor_parallel: one rank's bytes per parameter at --tensor-layouts against the planner's",
    )
    parser.add_argument(
        "--tensor-layouts",
        nargs="+",
        default=list(TENSOR_LAYOUTS),
        help="--tensor: d x w x t layouts (d * w * t ranks each)",
    )
    parser.add_argument(
        "--optimizers",
        action="store_true",
        help="each rank's peak against the planner's per optimizer (the step's transients), at --optim-layouts",
    )
    parser.add_argument("--optim-layouts", nargs="+", default=list(OPTIM_LAYOUTS), help="--optimizers: d x w x t")
    parser.add_argument(
        "--optim-labels",
        nargs="+",
        default=list(OPTIMIZERS),
        choices=list(OPTIMIZERS),
        help="--optimizers: which optimizers (label: optim.name, 2bw's optim.delay_correction) "
        + ", ".join(f"{k}: {v[0]}, {v[1]}" for k, v in OPTIMIZERS.items()),
    )
    parser.add_argument(
        "--sequence",
        action="store_true",
        help="pipeline.sequence_parallel: a rank's activations at d=2 x t=2 without and with it against the planner's",
    )
    parser.add_argument(
        "--ties", action="store_true", help="tied embeddings on one rank: its peak and weight state against the plan's"
    )
    parser.add_argument("--time-steps", type=int, default=30, help="--sequence: steps of each timed run")
    parser.add_argument("--json", default=None, help="memory and tensor tables: also write its rows to this file")
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
    table = (
        ties_table
        if args.ties
        else sequence_table
        if args.sequence
        else time_table
        if args.time
        else tensor_table
        if args.tensor
        else optim_table
        if args.optimizers
        else None
    )
    (table or memory_table)(args)


if __name__ == "__main__":
    main()
