"""Throughput and memory of our schedules against torch.distributed.pipelining and one process.

    python scripts/bench.py [--nproc 2] [--num-microbatches 2] [--microbatch-size 16] [--repeats 3]

Systems, on the same GPT and microbatches: our 2bw, flush, zb1p, zbv and gpipe (zbv: two chunks a rank, the GPT
split into 2d as torch's V schedules split it); torch.distributed.pipelining's
Schedule1F1B and ScheduleGPipe driving our stage modules (our split), and its strongest schedules,
which hold two stages per rank (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV:
the GPT split into 2d stages, looped or V-shaped; a schedule that refuses the shape shows n/a); and
the whole model in one process with one thread (the physical limit: d stages on d cores can
at best run d times its throughput). A system may name its optimizer and, for ours-2bw, a delay
correction: SYSTEM@OPTIMIZER[+CORRECTION], e.g. ours-2bw@muon+error_feedback, torch-zbv@muon (AdamW with no
correction otherwise); ours-2bw and ours-flush may end in :lead=N (pipeline.forward_lead=N, e.g.
ours-2bw:lead=1), and ours-2bw in :newest (pipeline.weight_versions=newest, e.g. ours-2bw@muon+predict:newest). Runs
alternate between systems within each repeat, so drift hits all alike.
Prints the command, the configuration and one table of medians
(samples/s, pipeline efficiency = samples/s / (d x single-process samples/s), idle fraction =
1 - the stage's own compute time / wall time per step, per-stage peak resident memory and
per-stage peak tensor memory), checks the issue's targets and writes it all as JSON.

Peak tensor memory comes from one more, untimed run of each system: on CUDA the allocator's
max-allocated counter; on the CPU the running total of live tensor bytes that torch.profiler's
memory profiling reports at every allocation (the profiler slows that run, hence untimed). It
is exact where peak RSS also counts allocator fragmentation and libraries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from pipedream2bw.config.corrections import DELAY_CORRECTIONS

# torch.distributed.pipelining's schedules by our name: (class, stages per rank, how ranks hold stages)
TORCH_SCHEDULES = {
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),  # rank r: stages r and r + d
    "interleavedzb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),  # rank r: stages r and 2d - 1 - r
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
OURS = ["ours-2bw", "ours-flush", "ours-zb1p", "ours-zbv", "ours-gpipe"]
SYSTEMS = [*OURS, *(f"torch-{name}" for name in TORCH_SCHEDULES), "single"]
STRONGEST = [f"torch-{name}" for name, (_, per_rank, _) in TORCH_SCHEDULES.items() if per_rank == 2]
OPTIMIZERS = ("adamw", "muon")
CORRECTIONS = DELAY_CORRECTIONS  # every optim.delay_correction but auto (a run names what it measures)


def forward_lead(spec: str) -> tuple:
    """``SPEC[:lead=N]`` -> (SPEC, N): pipeline.forward_lead of an ours-2bw or ours-flush system (0 without).

    Raises:
        ValueError: N not a count, or a lead on another system.
    """
    spec, sep, lead = spec.partition(":lead=")
    if not sep:
        return spec, 0
    if not lead.isdigit() or spec.partition("@")[0] not in ("ours-2bw", "ours-flush"):
        raise ValueError(f"{spec}:lead={lead}: a forward lead is a count (:lead=1) of ours-2bw or ours-flush")
    return spec, int(lead)


def weight_versions(spec: str) -> tuple:
    """``SPEC[:newest]`` -> (SPEC, pipeline.weight_versions): ``newest`` for an ours-2bw system that ends in
    ``:newest`` (before or after a ``:lead=N``), else ``batch``.

    Raises:
        ValueError: ``:newest`` on another system.
    """
    head, *options = spec.split(":")
    if "newest" not in options:
        return spec, "batch"
    if head.partition("@")[0] != "ours-2bw":
        raise ValueError(f"{spec}: ':newest' (pipeline.weight_versions=newest) is a rule of ours-2bw")
    return ":".join([head] + [o for o in options if o != "newest"]), "newest"


def parse_system(spec: str) -> tuple:
    """``SYSTEM[@OPTIMIZER[+CORRECTION]]`` (e.g. ``ours-2bw@muon+error_feedback``, ``torch-zbv@muon``) ->
    (system, optimizer, correction); AdamW with no correction by default. A delay correction only applies to 2bw
    (the one schedule with a delay).

    Raises:
        ValueError: an unknown system, optimizer or correction, or a correction on another system.
    """
    system, _, optim = forward_lead(weight_versions(spec)[0])[0].partition("@")
    optimizer, _, correction = (optim or "adamw").partition("+")
    correction = correction or "none"
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r} in {spec!r}; choose from {SYSTEMS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r} in {spec!r}; choose from {list(OPTIMIZERS)}")
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown delay correction {correction!r} in {spec!r}; choose from {list(CORRECTIONS)}")
    if correction != "none" and system != "ours-2bw":
        raise ValueError(f"{spec!r}: a delay correction applies to ours-2bw only (the other schedules have no delay)")
    return system, optimizer, correction


def _uses_cuda(args) -> bool:
    import torch

    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def _device(args):
    import torch

    if _uses_cuda(args):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_probe(args, device, *, within: Optional[str] = None):
    """``memprobe.tensor_peak`` on a memory pass, else a no-op that yields an empty dict."""
    from pipedream2bw.memory.memprobe import tensor_peak

    return tensor_peak(device, within=within) if args.memory_pass else contextlib.nullcontext({})


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _config(
    args,
    schedule: str,
    num_stages: int,
    *,
    optimizer: str = "adamw",
    correction: str = "none",
    lead: int = 0,
    versions: str = "batch",
):
    from pipedream2bw.config import (
        Config,
        DataConfig,
        DistConfig,
        GPTConfig,
        OptimConfig,
        PipelineConfig,
        TrainConfig,
        WandbConfig,
    )

    return Config(
        pipeline=PipelineConfig(
            schedule=schedule,
            num_stages=num_stages,
            num_microbatches=args.num_microbatches,
            microbatch_size=args.microbatch_size,
            forward_lead=lead,
            weight_versions=versions,
        ),
        model=GPTConfig(
            num_layers=args.num_layers,
            d_model=args.d_model,
            num_heads=args.num_heads,
            seq_len=args.seq_len,
            vocab_size=256,
        ),
        optim=OptimConfig(name=optimizer, lr=1e-3, delay_correction=correction),
        data=DataConfig(),
        train=TrainConfig(num_steps=args.steps, log_every=10**6, warmup_steps=args.warmup, precision=args.precision),
        wandb=WandbConfig(mode="disabled"),
        dist=DistConfig(
            backend="nccl" if _uses_cuda(args) else "gloo",
            batch_p2p={"auto": None, "on": True, "off": False}[args.batch_p2p],
        ),
    )


class _Autocast:
    """A stage module run as ours runs it under ``train.precision`` (the torch and single systems):
    forward under autocast, float32 outputs of inner stages in the compute dtype (as they travel),
    received reduced-precision activations continued in float32."""

    def __init__(self, cfg, device):
        from pipedream2bw.memory.precision import compute_dtype, resolve

        self.precision = resolve(cfg.train.precision, device.type)
        self.dtype, self.device_type = compute_dtype(self.precision), device.type

    def wrap(self, module, *, last: bool):
        import torch

        outer = self

        class Stage(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = module

            def forward(self, x):
                from pipedream2bw.memory.precision import autocast

                if x.is_floating_point():
                    x = x.float()
                with autocast(outer.precision, outer.device_type):
                    out = self.inner(x)
                return out if last or out.dtype != torch.float32 else out.to(outer.dtype)

        return Stage() if self.precision != "fp32" else module


def _loss(logits, targets):
    from pipedream2bw.models import lm_loss

    return lm_loss(logits.float(), targets)


def _stage_compute_s(cfg, stage_index: int, num_stages: int, device, *, reps: int = 5) -> float:
    """Median time of one microbatch's forward + backward through this stage, alone."""
    import torch

    from pipedream2bw.config import gpt_balance
    from pipedream2bw.models import lm_loss
    from pipedream2bw.run.model import build_stage_module

    balance = gpt_balance(cfg.model, num_stages)
    module = _Autocast(cfg, device).wrap(
        build_stage_module(cfg, balance, stage_index, None).to(device), last=stage_index == num_stages - 1
    )
    b, T, C = cfg.pipeline.microbatch_size, cfg.model.seq_len, cfg.model.d_model
    x = (
        torch.randint(0, 256, (b, T), device=device)
        if stage_index == 0
        else torch.randn(b, T, C, device=device, requires_grad=True)
    )
    y = torch.randint(0, 256, (b, T), device=device)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        start = time.perf_counter()
        out = module(x)
        if stage_index == num_stages - 1:
            lm_loss(out, y).backward()
        else:
            out.backward(torch.randn_like(out))
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _feed(cfg, *, num_microbatches: int):
    from pipedream2bw.data import MicrobatchFeed, load_bytes

    return MicrobatchFeed(
        load_bytes(None),
        seq_len=cfg.model.seq_len,
        microbatch_size=cfg.pipeline.microbatch_size,
        num_microbatches=num_microbatches,
        seed=cfg.seed,
    )


def _timing(ends, *, warmup: int, samples_per_step: int) -> dict:
    steady = ends[warmup:]
    steps = [b - a for a, b in zip(steady, steady[1:])]
    return {
        "samples_per_s": len(steps) * samples_per_step / (steady[-1] - steady[0]),
        "step_time_s": statistics.median(steps),
    }


def _stage_weight_bytes(cfg, stage_index: int, num_stages: int) -> int:
    """Bytes of one copy of this stage's parameters (what a second 2bw version costs)."""
    from pipedream2bw.config import gpt_balance
    from pipedream2bw.run.model import build_stage_module

    return _param_bytes(build_stage_module(cfg, gpt_balance(cfg.model, num_stages), stage_index, None))


def worker_ours(
    args, schedule: str, device, *, optimizer: str, correction: str, lead: int = 0, versions: str = "batch"
) -> dict:
    from pipedream2bw.run.runner import TRAIN_RANGE, run

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = _config(args, schedule, world, optimizer=optimizer, correction=correction, lead=lead, versions=versions)
    if not args.memory_pass:  # the timed steps traced: where each rank's time goes (a few clock reads per action)
        cfg.pipeline.trace, cfg.pipeline.trace_first_step = True, args.warmup
        cfg.pipeline.trace_steps = args.steps - args.warmup
    with tempfile.TemporaryDirectory() as tmp, _memory_probe(args, device, within=TRAIN_RANGE) as peak:
        summary = run(cfg, tmp)
    # zbv: this rank's two chunks of the GPT split into 2d (as torch's V schedules hold them); else its stage
    held, num_parts = (_torch_stage_indices(rank, world, 2, "v"), 2 * world) if schedule == "zbv" else ([rank], world)
    if args.memory_pass:
        return {
            "rank": rank,
            "peak_tensor_bytes": peak["bytes"],
            "stage_weight_bytes": sum(_stage_weight_bytes(cfg, s, num_parts) for s in held),
        }
    out = {"rank": rank, "compute_s": sum(_stage_compute_s(cfg, s, num_parts, device) for s in held)}
    if summary is not None:  # rank 0; per-stage peaks were taken when training ended, before gathering results
        out.update(
            samples_per_s=summary["samples_per_s"],
            step_time_s=summary["step_time_s"],
            peak_rss_per_stage=summary["peak_memory_bytes"],
            breakdown_per_rank=summary["trace"]["breakdown_per_rank"],
            cpu_s_per_step=[r["cpu_s_per_step"] for r in summary["ranks"]],
        )
    return out


def _torch_stage_indices(rank: int, world: int, per_rank: int, style: str) -> list:
    """The stages rank ``rank`` holds of ``world * per_rank``: looped (r, r + d, ...) or V-shaped (r, 2d - 1 - r)."""
    if style == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + i * world for i in range(per_rank)]


def worker_torch(args, schedule: str, device, *, optimizer: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    from pipedream2bw.config import build_optimizer, gpt_balance
    from pipedream2bw.config.optimizers import tag_muon_params
    from pipedream2bw.run.model import build_stage_module

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = _config(args, "flush", world, optimizer=optimizer)
    m, b = cfg.pipeline.num_microbatches, cfg.pipeline.microbatch_size
    name, per_rank, style = TORCH_SCHEDULES[schedule]
    num_stages = world * per_rank
    held = _torch_stage_indices(rank, world, per_rank, style)
    with _memory_probe(args, device) as peak:
        balance = gpt_balance(cfg.model, num_stages)  # with one stage per rank, the split ours uses
        modules = [build_stage_module(cfg, balance, s, None).to(device) for s in held]
        stages = [
            PipelineStage(_Autocast(cfg, device).wrap(mod, last=s == num_stages - 1), s, num_stages, device)
            for s, mod in zip(held, modules)
        ]
        cls = getattr(schedules, name)
        sched = cls(stages[0] if per_rank == 1 else stages, m, loss_fn=_loss)
        for mod in modules:  # Muon's split, as ours makes it (a no-op tag for AdamW)
            tag_muon_params(mod, cfg.optim.muon_exclude)
        params = [p for mod in modules for p in mod.parameters()]
        opt = build_optimizer(params, cfg.optim)
        feed = _feed(cfg, num_microbatches=m)
        ends, cpu = [time.perf_counter()], [time.process_time()]
        for t in range(cfg.train.num_steps):
            x, y = (torch.cat(parts).to(device) for parts in zip(*(feed.microbatch(t * m + j) for j in range(m))))
            first, last = 0 in held, num_stages - 1 in held
            sched.step(*([x] if first else []), **({"target": y} if last else {}))
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            ends.append(time.perf_counter())
            cpu.append(time.process_time())
    peak_rss = _peak_rss()
    dist.destroy_process_group()
    if args.memory_pass:
        return {
            "rank": rank,
            "peak_tensor_bytes": peak["bytes"],
            "stage_weight_bytes": sum(_param_bytes(mod) for mod in modules),
        }
    return {
        "rank": rank,
        "peak_rss": peak_rss,
        "compute_s": sum(_stage_compute_s(cfg, s, num_stages, device) for s in held),
        "cpu_s": (cpu[-1] - cpu[args.warmup]) / (len(cpu) - 1 - args.warmup),  # as ours' summary counts it
        **_timing(ends, warmup=args.warmup, samples_per_step=m * b),
    }


def worker_single(args, device, *, optimizer: str) -> dict:
    import torch
    from torch import nn

    from pipedream2bw.config import build_optimizer
    from pipedream2bw.config.optimizers import tag_muon_params
    from pipedream2bw.models import build_gpt_layers

    torch.set_num_threads(1)
    cfg = _config(args, "flush", 1, optimizer=optimizer)
    m, b = cfg.pipeline.num_microbatches, cfg.pipeline.microbatch_size
    with _memory_probe(args, device) as peak:
        model = nn.Sequential(*build_gpt_layers(cfg.model, seed=cfg.seed)).to(device)
        run_model = _Autocast(cfg, device).wrap(model, last=True)
        tag_muon_params(model, cfg.optim.muon_exclude)
        opt = build_optimizer(model.parameters(), cfg.optim)
        feed = _feed(cfg, num_microbatches=m)
        ends = [time.perf_counter()]
        for t in range(cfg.train.num_steps):
            for j in range(m):
                x, y = (v.to(device) for v in feed.microbatch(t * m + j))
                (_loss(run_model(x), y) / m).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            ends.append(time.perf_counter())
    if args.memory_pass:
        return {"rank": 0, "peak_tensor_bytes": peak["bytes"], "stage_weight_bytes": _param_bytes(model)}
    return {
        "rank": 0,
        "peak_rss": _peak_rss(),
        "compute_s": 0.0,
        **_timing(ends, warmup=args.warmup, samples_per_step=m * b),
    }


def run_worker(args) -> None:
    (system, optimizer, correction), device = parse_system(args.worker), _device(args)
    if system.startswith("ours-"):
        spec, versions = weight_versions(args.worker)
        schedule, lead = system.split("-", 1)[1], forward_lead(spec)[1]
        result = worker_ours(
            args, schedule, device, optimizer=optimizer, correction=correction, lead=lead, versions=versions
        )
    elif system.startswith("torch-"):
        result = worker_torch(args, system.split("-", 1)[1], device, optimizer=optimizer)
    else:
        result = worker_single(args, device, optimizer=optimizer)
    Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))


class SystemFailed(Exception):
    """A system's run exited non-zero (a torch schedule may refuse a shape, e.g. too few microbatches)."""

    def __init__(self, system: str, output: str):
        super().__init__(f"{system} failed:\n{output[-3000:]}")
        # the rank's own exception ("ValueError: ..."), not torchrun's summary of it, which came last and said
        # only "ChildFailedError:" (the dualpipev column read "n/a (ChildFailedError:)", issue 43)
        errors = [
            line.strip()
            for line in output.splitlines()
            if re.search(r"\b\w*(Error|Exception): \S", line) and "ChildFailedError" not in line
        ]
        self.system, self.reason = system, (errors[-1] if errors else output.strip()[-200:])


def launch(system: str, args, argv_model, *, memory_pass: bool = False) -> dict:
    """One run of ``system``; its figures, or with ``memory_pass`` its per-stage peak tensor bytes."""
    from pipedream2bw.pipeline.comm import torchrun_command

    with tempfile.TemporaryDirectory() as out:
        nproc = 1 if parse_system(system)[0] == "single" else args.nproc
        extra = ["--memory-pass", f"--steps={args.memory_steps}", "--warmup=0"] if memory_pass else []
        cmd = [
            *torchrun_command(nproc),
            __file__,
            "--worker",
            system,
            "--out",
            out,
            *argv_model,
            *extra,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemFailed(system, proc.stdout + proc.stderr)
        ranks = sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    if memory_pass:
        return {
            "peak_tensor_bytes": [r["peak_tensor_bytes"] for r in ranks],
            "stage_weight_bytes": [r["stage_weight_bytes"] for r in ranks],
        }
    r0 = ranks[0]
    idle = (
        [1 - args.num_microbatches * r["compute_s"] / r0["step_time_s"] for r in ranks]
        if parse_system(system)[0] != "single"
        else [0.0]
    )
    peaks = r0["peak_rss_per_stage"] if "peak_rss_per_stage" in r0 else [r["peak_rss"] for r in ranks]
    return {
        "samples_per_s": r0["samples_per_s"],
        "step_time_s": r0["step_time_s"],
        "peak_rss": peaks,
        "idle_fraction": statistics.mean(idle),
        **({"breakdown_per_rank": r0["breakdown_per_rank"]} if "breakdown_per_rank" in r0 else {}),
        "cpu_s_per_step": r0["cpu_s_per_step"] if "cpu_s_per_step" in r0 else [r.get("cpu_s") for r in ranks],
    }


def print_breakdowns(rows: dict) -> None:
    """Each system's process CPU seconds per step per rank, and our systems' per-rank wall time per step by what it
    went to (timeline.BREAKDOWN), medians over repeats."""
    from pipedream2bw.io.timeline import BREAKDOWN

    timed = [s for s, row in rows.items() if None not in row["runs"][0].get("cpu_s_per_step", [None])]
    if timed:  # the work of a step, which a loaded machine inflates less than its wall time
        print("\nprocess CPU seconds per step (all threads), per rank, median of repeats:")
    for system in timed:
        runs = rows[system]["runs"]
        cpu = [statistics.median(r["cpu_s_per_step"][k] for r in runs) for k in range(len(runs[0]["cpu_s_per_step"]))]
        rows[system]["cpu_s_per_step"] = cpu
        print(f"{system:>21}  " + " ".join(f"{c:.3f}" for c in cpu))
    ours = [s for s, row in rows.items() if "breakdown_per_rank" in row["runs"][0]]
    if not ours:
        return
    print(f"\nwhere each rank's time goes, ms per step (median of repeats; traced timed steps):\n{'':>17}", end="")
    print("".join(f"{k:>10}" for k in (*BREAKDOWN, "total")))
    for system in ours:
        runs = rows[system]["runs"]
        per_rank = []
        for rank in range(len(runs[0]["breakdown_per_rank"])):
            parts = {k: statistics.median(r["breakdown_per_rank"][rank][k] for r in runs) for k in BREAKDOWN}
            per_rank.append(parts)
            cells = "".join(f"{parts[k] * 1e3:>10.2f}" for k in BREAKDOWN)
            print(f"{system:>12} r{rank:<3}{cells}{sum(parts.values()) * 1e3:>10.2f}")
        rows[system]["breakdown_per_rank"] = per_rank


def check_targets(rows: dict, args) -> list:
    """The issue's targets, each with the configuration it is set for and whether this run meets it.

    Throughput targets are set for 2 processes at one (m, b) on the default GPT (8 blocks, d_model
    256, 4 heads, seq 128). The memory target holds at any configuration: a stage under 2bw
    holds one more copy of its weights than under flush, and nothing else, when m exceeds its
    microbatches in flight (d - s); otherwise flush's peak comes at a batch's first backward,
    before its gradients exist, while 2bw, which never drains, has them then, so the bound is
    one copy of the weights and one of the gradients.
    """

    def ratio(a, b):
        return rows[a]["samples_per_s"] / rows[b]["samples_per_s"] if a in rows and b in rows else None

    checks = []
    issue_model = (args.num_layers, args.d_model, args.num_heads, args.seq_len) == (8, 256, 4, 128)

    def add(name, value, met, spec):
        applies = spec is None or (issue_model and (args.nproc, args.num_microbatches, args.microbatch_size) == spec)
        where = (
            "any configuration" if spec is None else f"{spec[0]} processes, m={spec[1]}, b={spec[2]}, the default GPT"
        )
        checks.append({"target": name, "value": value, "met": met, "set_for": where, "applies": applies})

    r = ratio("ours-2bw", "torch-1f1b")
    if r is not None:
        add("ours-2bw >= 1.35x torch-1f1b samples/s", f"{r:.2f}x", r >= 1.35, (2, 2, 16))
    if "ours-2bw" in rows and rows["ours-2bw"]["efficiency"] is not None:
        eff = rows["ours-2bw"]["efficiency"]
        for bound, spec in [(0.92, (2, 2, 16)), (0.95, (2, 8, 4))]:
            add(f"ours-2bw pipeline efficiency >= {bound}", f"{eff:.2f}", eff >= bound, spec)
    for theirs in [s for s in rows if s.startswith("torch-") and "ours-2bw" in rows]:
        r = ratio("ours-2bw", theirs)
        for spec in [(2, 2, 16), (2, 8, 4)]:
            add(f"ours-2bw ahead of {theirs} (> 1.00x)", f"{r:.2f}x", r > 1.0, spec)
    for corrected in [s for s in rows if s.startswith("ours-2bw@") and parse_system(s)[2] != "none"]:
        _, optimizer, _ = parse_system(corrected)
        plain = next((s for s in rows if parse_system(s) == ("ours-2bw", optimizer, "none")), None)
        if plain is not None:
            r = ratio(corrected, plain)
            add(f"{corrected} >= 0.98x {plain} samples/s", f"{r:.3f}x", r >= 0.98, None)
    for ours, theirs in [("ours-flush", "torch-1f1b"), ("ours-gpipe", "torch-gpipe")]:
        r = ratio(ours, theirs)
        if r is not None:
            add(f"{ours} within 5% of {theirs} samples/s (>= 0.95x)", f"{r:.2f}x", r >= 0.95, (2, 8, 4))
    if "peak_tensor_bytes_per_stage" in rows.get("ours-2bw", {}) and "peak_tensor_bytes_per_stage" in rows.get(
        "ours-flush", {}
    ):
        two, flush = rows["ours-2bw"], rows["ours-flush"]
        for stage, (a, b, w) in enumerate(
            zip(two["peak_tensor_bytes_per_stage"], flush["peak_tensor_bytes_per_stage"], two["stage_weight_bytes"])
        ):
            if args.num_microbatches > args.nproc - stage:
                bound, what = w, "one weight copy"
            else:  # flush's peak is its first backward of a batch, before any gradient exists; 2bw's has them all
                bound, what = 2 * w, f"one weight copy + gradients, as m <= {args.nproc - stage} microbatches in flight"
            add(
                f"stage {stage}: ours-2bw peak tensors <= ours-flush + {what} ({bound / 2**20:.2f} MiB)",
                f"2bw - flush = {(a - b) / 2**20:.2f} MiB",
                a - b <= bound,
                None,
            )
    return checks


def _argv_model(args) -> list:
    """The worker's arguments that shape a run (model, batch, steps, device, precision)."""
    return [
        f"--{k}={v}"
        for k, v in [
            ("num-microbatches", args.num_microbatches),
            ("microbatch-size", args.microbatch_size),
            ("num-layers", args.num_layers),
            ("d-model", args.d_model),
            ("num-heads", args.num_heads),
            ("seq-len", args.seq_len),
            ("steps", args.steps),
            ("warmup", args.warmup),
            ("batch-p2p", args.batch_p2p),
            ("device", args.device),
            ("precision", args.precision),
        ]
    ]


def run_check(parser, args) -> None:
    """``--check``: each recorded shape's ours-2bw and single, alternating, ``--repeats`` times; the medians'
    efficiency against docs/benchmarks.md's figure (bench_check). Exits 1 when one regressed."""
    import bench_check

    shapes = bench_check.recorded(bench_check.DOC.read_text())
    today = {}
    for shape in shapes:
        shape_args = parser.parse_args([*shape.argv, f"--repeats={args.repeats}", f"--device={args.device}"])
        print(
            f"{shape.name}: python scripts/bench.py {' '.join(shape.argv)} --systems ours-2bw,single "
            f"--repeats {args.repeats} --memory-steps 0",
            flush=True,
        )
        runs = {"ours-2bw": [], "single": []}
        for _ in range(args.repeats):
            for system, out in runs.items():
                out.append(launch(system, shape_args, _argv_model(shape_args))["samples_per_s"])
        ours, single = statistics.median(runs["ours-2bw"]), statistics.median(runs["single"])
        today[shape.name] = ours / (shape_args.nproc * single)
        print(f"  ours-2bw {ours:.1f} samples/s, single {single:.1f}: efficiency {today[shape.name]:.2f}", flush=True)
    lines = bench_check.verdicts(shapes, today, tolerance=args.check_tolerance)
    print("\nthroughput guard (docs/benchmarks.md):\n" + "\n".join(lines))
    if any(line.lstrip().startswith("REGRESSED") for line in lines):
        raise SystemExit(1)


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
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
    parser.add_argument(
        "--memory-steps",
        type=int,
        default=4,
        help="steps of the untimed run that measures peak tensor memory; 0 skips it",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: one GPU per process (NCCL) when CUDA is available",
    )
    parser.add_argument("--batch-p2p", choices=["auto", "on", "off"], default="auto", help="our dist.batch_p2p")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16", "auto"],
        default="fp32",
        help="train.precision of every system (torch and single: forward under autocast, transfers in its dtype; fp16 "
        "without loss scaling)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a target set for this configuration is missed"
    )
    parser.add_argument("--json", default="bench.json")
    parser.add_argument(
        "--check",
        action="store_true",
        help="the throughput guard: ours-2bw's efficiency at the shapes recorded in docs/benchmarks.md (a small and a "
        "large microbatch), today against the record; exit 1 naming each shape that regressed",
    )
    parser.add_argument(
        "--check-tolerance", type=float, default=0.05, help="--check: how far below the record is a regression"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--memory-pass", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)
    if args.check:
        return run_check(parser, args)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 2 to time a step")
    argv_model = _argv_model(args)
    systems = args.systems.split(",")
    for spec in systems:
        try:
            parse_system(spec)
        except ValueError as e:
            parser.error(f"--systems: {e} (a system is SYSTEM[@OPTIMIZER[+CORRECTION]])")
    if args.memory_steps < 0:
        parser.error(f"--memory-steps ({args.memory_steps}) must be >= 0 (0 skips the peak tensor memory run)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu (or auto)")
    where = "1 GPU (NCCL)" if _uses_cuda(args) else "1 thread (gloo)"
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(
        f"config: {args.nproc} processes x {where}, GPT {args.num_layers} blocks d_model {args.d_model} "
        f"heads {args.num_heads} seq {args.seq_len} vocab 256, m={args.num_microbatches} b={args.microbatch_size}, "
        f"AdamW unless a system names its optimizer (@muon, +correction), lr 1e-3, precision {args.precision}, "
        f"{args.steps} steps "
        f"({args.warmup} warm-up left out), {args.repeats} repeats, systems alternate; torch {torch.__version__}"
    )
    results = {s: [] for s in systems}
    refused = {}  # torch schedules that refuse this shape: system -> why
    for repeat in range(args.repeats):
        for system in [s for s in systems if s not in refused]:
            try:
                results[system].append(launch(system, args, argv_model))
            except SystemFailed as e:
                if parse_system(system)[0] not in STRONGEST:
                    raise SystemExit(str(e)) from e
                refused[system] = e.reason
                del results[system]
                print(f"  repeat {repeat} {system:>21}: n/a ({e.reason})", flush=True)
                continue
            print(f"  repeat {repeat} {system:>21}: {results[system][-1]['samples_per_s']:.1f} samples/s", flush=True)
    memory = {}
    if args.memory_steps:
        for system in results:
            memory[system] = launch(system, args, argv_model, memory_pass=True)
        print(f"  peak tensor memory: one untimed run of {args.memory_steps} steps per system", flush=True)
    single = statistics.median(r["samples_per_s"] for r in results["single"]) if "single" in results else None
    rows = {}
    print(
        f"\n{'system':>21} {'samples/s':>10} {'efficiency':>10} {'idle':>6} {'peak RSS per stage (MiB)':>26} "
        f"{'peak tensors per stage (MiB)':>30}"
    )
    for system, runs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in runs)
        d = 1 if parse_system(system)[0] == "single" else args.nproc
        eff = sps / (d * single) if single else None
        peaks = [statistics.median(r["peak_rss"][s] for r in runs) for s in range(len(runs[0]["peak_rss"]))]
        idle = statistics.median(r["idle_fraction"] for r in runs)
        rows[system] = {
            "system": system,
            "samples_per_s": sps,
            "efficiency": eff,
            "idle_fraction": idle,
            "peak_rss_per_stage": peaks,
            "runs": runs,
        }
        tensors_text = ""
        if system in memory:
            rows[system].update(
                peak_tensor_bytes_per_stage=memory[system]["peak_tensor_bytes"],
                stage_weight_bytes=memory[system]["stage_weight_bytes"],
            )
            tensors_text = " ".join(f"{p / 2**20:.1f}" for p in memory[system]["peak_tensor_bytes"])
        peaks_text = " ".join(f"{p / 2**20:.0f}" for p in peaks)
        print(
            f"{system:>21} {sps:>10.1f} {eff if eff is not None else float('nan'):>10.2f} {idle:>6.2f} "
            f"{peaks_text:>26} {tensors_text:>30}"
        )
    print_breakdowns(rows)
    for system, why in refused.items():
        print(f"{system:>21} {'n/a':>10}  ({why})")
    pairs = [("ours-2bw", "torch-1f1b"), ("ours-flush", "torch-1f1b"), ("ours-zb1p", "ours-flush")]
    pairs += [("ours-zb1p", f"torch-{name}") for name in ("interleavedzb", "zbv")] + [("ours-gpipe", "torch-gpipe")]
    pairs += [("ours-zbv", "torch-zbv"), ("ours-zbv", "ours-zb1p")]
    for ours, theirs in pairs:
        if ours in rows and theirs in rows:
            print(f"{ours} / {theirs}: {rows[ours]['samples_per_s'] / rows[theirs]['samples_per_s']:.2f}x")
    strongest = max((s for s in rows if s.startswith("torch-")), key=lambda s: rows[s]["samples_per_s"], default=None)
    if "ours-2bw" in rows and strongest is not None:
        lead = rows["ours-2bw"]["samples_per_s"] / rows[strongest]["samples_per_s"]
        print(f"ours-2bw / the strongest torch schedule here ({strongest}): {lead:.2f}x")
    checks = check_targets(rows, args)
    if checks:
        print("\ntargets:")
    for c in checks:
        verdict = (
            ("met" if c["met"] else "MISSED") if c["applies"] else ("would be met" if c["met"] else "would be missed")
        )
        note = "" if c["applies"] else f"   (set for {c['set_for']}; not this configuration)"
        print(f"  {verdict:>15}  {c['target']}: {c['value']}{note}")
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "rows": list(rows.values()), "targets": checks}, indent=2) + "\n"
    )
    print(f"\nwrote {args.json}")
    if args.strict and any(c["applies"] and not c["met"] for c in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
