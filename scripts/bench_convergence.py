"""Convergence under the one-step delay: flush (the synchronous reference) against 2bw, same model and batches.

    nice -n 10 python scripts/bench_convergence.py [--steps 300] [--lrs 3e-3,1e-3] [--seeds 0,1,2]
        [--optimizers adamw,muon] [--corrections none,error_feedback,lookahead] [--data-path FILE] [--out DIR]

A correction may end in ``+syncN`` (e.g. ``error_feedback+sync30``): that correction after N synchronous steps
(pipeline.sync_warmup_steps=N); ``+betaX``: optim.error_feedback_beta=X; ``+momX``: the optimizer's momentum X
(Muon's ``momentum`` for its matrices, AdamW's beta1). --flush-corrections names flush's runs the same way
(``none``, ``none+mom0.9``); the first is the reference every 2bw run is compared with. ``+newest`` (2bw only, with
``none`` or ``predict``): pipeline.weight_versions=newest, each forward on its stage's newest version
(a depth-dependent rule: run it with --num-stages); ``+horizonX`` (with ``predict+newest``): optim.predict_horizon=X.
With --target-loss, each run also prints its steps to that loss and to its seed's reference flush's final loss, as a
ratio to flush's steps.
--scheduler, --warmup and --min-lr set the learning-rate schedule (optim.scheduler, optim.warmup_steps, optim.min_lr),
the same for every run of the grid: e.g. ``--scheduler cosine --warmup 30 --min-lr 3e-4``. Run names do not say the
schedule (nor the shape), so give each its own --out.

Every run trains the same GPT (4 blocks, d_model 64, 4 heads, seq 64; 32 sequences a step as 4 microbatches of 8) for
--steps steps as one stage, through the project's ``run()`` on one rank (the delay is one step at any depth:
docs/design.md section 2), each in its own process with --threads threads. --num-stages D > 1 runs each 2bw run (and
flush's, unless --flush-num-stages says otherwise) as D stages under torchrun with D ranks, its name ending in -dD
(flush's runs at one stage are the reference: a flushing pipeline at any depth is minibatch training). The batches
depend on the seed only, so flush and 2bw see the same ones. Validation loss on held-out data (the last 10% of the
text) every --eval-every steps. flush runs each optimizer with no correction (it has no delay to correct); 2bw runs
each optimizer with each correction. Runs already in --out (their summary.json) are reused, so a grid can be grown seed
by seed.

Prints the command, the configuration, each run's final validation loss, then per optimizer and learning rate:
flush's final validation loss, 2bw's for each correction, the gap (2bw - flush, paired by seed: mean and
min..max over seeds), the steps 2bw took to reach flush's final validation loss (mean over seeds; '>N' if it
never did), samples/s (median) and the extra optimizer-state bytes per parameter that the correction costs
(measured: the run's optimizer state over the same optimizer's without the correction). Draws the validation
curves to <out>/curves.png and writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(args, *, schedule: str, optimizer: str, correction: str, lr: float, seed: int, num_stages: int = 1):
    """The run's Config: the model and batches of every run, with this schedule, optimizer and correction."""
    from pipedream2bw.config import (
        Config,
        DataConfig,
        GPTConfig,
        OptimConfig,
        PipelineConfig,
        TrainConfig,
        WandbConfig,
    )

    # e.g. error_feedback+sync30: pipeline.sync_warmup_steps=30; error_feedback+beta0.5: optim.error_feedback_beta;
    # error_feedback+mom0.9: Muon's momentum (muon) or beta1 (adamw); none+mom0.9 in --flush-corrections: flush's
    correction, *options = correction.split("+")
    sync = next((o[4:] for o in options if o.startswith("sync")), "")
    beta = next((float(o[4:]) for o in options if o.startswith("beta")), None)
    mom = next((float(o[3:]) for o in options if o.startswith("mom")), None)
    horizon = next((float(o[7:]) for o in options if o.startswith("horizon")), None)
    newest = "newest" in options  # pipeline.weight_versions=newest (2bw)
    unknown = [o for o in options if not o.startswith(("sync", "beta", "mom", "horizon")) and o != "newest"]
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} of correction {correction!r}: use +syncN, +betaX, +momX, +horizonX or +newest"
        )
    return Config(
        pipeline=PipelineConfig(
            schedule=schedule,
            num_stages=num_stages,
            num_microbatches=args.num_microbatches,
            microbatch_size=args.microbatch_size,
            sync_warmup_steps=int(sync or 0),
            weight_versions="newest" if newest else "batch",
        ),
        model=GPTConfig(
            num_layers=args.num_layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len
        ),
        optim=OptimConfig(
            name=optimizer,
            lr=lr,
            delay_correction=correction,
            scheduler=args.scheduler,
            warmup_steps=args.warmup,
            min_lr=args.min_lr,
            **({} if beta is None else {"error_feedback_beta": beta}),
            **({} if mom is None else _momentum(optimizer, mom)),
            **({} if horizon is None else {"predict_horizon": horizon}),
        ),
        data=DataConfig(path=args.data_path, val_fraction=args.val_fraction),
        train=TrainConfig(
            num_steps=args.steps,
            log_every=max(1, args.steps // 5),
            warmup_steps=min(10, args.steps - 1),
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
        ),
        wandb=WandbConfig(mode="disabled"),
        seed=seed,
    )


def _momentum(optimizer: str, mom: float) -> Dict[str, Any]:
    """OptimConfig fields that set the momentum of ``optimizer`` to ``mom``: Muon's ``momentum`` (its hidden
    matrices; the others' AdamW keeps its betas) or AdamW's and Adam's beta1 (beta2 stays torch's 0.999)."""
    if optimizer == "muon":
        return {"muon_kwargs": {"momentum": mom}}
    if optimizer in ("adamw", "adam", "adamw_rotated"):
        return {"kwargs": {"betas": (mom, 0.999)}}
    raise ValueError(f"+mom{mom:g} is not defined for optimizer {optimizer!r}: use muon, adam, adamw or adamw_rotated")


def _one(args, spec: Dict[str, Any], run_dir: Path) -> None:
    """In a child process: one run on one rank (or on this rank of torchrun's, --num-stages > 1)."""
    if spec.get("num_stages", 1) == 1:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    import torch

    torch.set_num_threads(args.threads)
    from pipedream2bw.run.runner import run

    run(run_config(args, **spec), run_dir)


def _name(spec: Dict[str, Any]) -> str:
    depth = spec.get("num_stages", 1)  # one stage: no suffix (the names of runs before --num-stages)
    name = f"{spec['schedule']}-{spec['optimizer']}-{spec['correction']}-lr{spec['lr']:g}-s{spec['seed']}"
    return name + (f"-d{depth}" if depth > 1 else "")


def grid(args) -> List[Dict[str, Any]]:
    specs = []
    for seed in args.seeds:
        for lr in args.lrs:
            for optimizer in args.optimizers:
                common = dict(optimizer=optimizer, lr=lr, seed=seed)
                for flush in args.flush_corrections:  # "none" (the reference: the first), or e.g. none+mom0.9
                    depth = args.flush_num_stages or args.num_stages
                    specs.append(dict(schedule="flush", correction=flush, **common, **_depth(depth)))
                for correction in args.corrections:
                    specs.append(dict(schedule="2bw", correction=correction, **common, **_depth(args.num_stages)))
    return specs


def _depth(num_stages: int) -> Dict[str, int]:
    """A run spec's depth: none at one stage (so its name and results are those of the runs before --num-stages)."""
    return {} if num_stages == 1 else {"num_stages": num_stages}


def _summary(out: Path, spec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    path = out / _name(spec) / "summary.json"
    if not path.exists():
        return None
    s = json.loads(path.read_text())
    return s if s.get("status") == "completed" else None


def _num_params(args) -> int:
    from pipedream2bw.config import GPTConfig
    from pipedream2bw.models.gpt import build_gpt_layers

    cfg = GPTConfig(num_layers=args.num_layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=args.seq_len)
    return sum(p.numel() for layer in build_gpt_layers(cfg, seed=0) for p in layer.parameters())


def steps_to(curve: List[Dict[str, float]], target: float) -> Optional[int]:
    """The first evaluated step whose validation loss is at most ``target``; None if none is."""
    return next((c["step"] for c in curve if c["loss"] <= target), None)


def report(args, out: Path) -> Dict[str, Any]:
    rows = []
    for spec in grid(args):
        s = _summary(out, spec)
        if s is None:
            continue
        rank = s["ranks"][0]
        rows.append(
            dict(
                spec,
                final_val_loss=s["final_val_loss"],
                val_losses=s["val_losses"],
                samples_per_s=s["samples_per_s"],
                step_time_s=s["step_time_s"],
                optimizer_state_bytes_per_param=rank["optimizer_state_bytes"] / _num_params(args),
            )
        )
    print_runs(args, rows)
    reference = args.flush_corrections[0]

    def pick(**kw):
        return [r for r in rows if all(r[k] == v for k, v in kw.items())]

    table = []
    print(
        "\n| optimizer | lr | flush | 2bw correction | 2bw | gap (mean, min..max over seeds) | steps to flush's loss "
        f"| steps to flush-{args.optimizers[0]}'s loss | samples/s | extra B/param | seeds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for optimizer in args.optimizers:
        for lr in args.lrs:
            flush = {r["seed"]: r for r in pick(schedule="flush", optimizer=optimizer, lr=lr, correction=reference)}
            base = pick(schedule="2bw", optimizer=optimizer, lr=lr, correction="none")
            base_state = statistics.median([r["optimizer_state_bytes_per_param"] for r in base]) if base else None
            for correction in args.corrections:
                runs = [r for r in pick(schedule="2bw", optimizer=optimizer, lr=lr, correction=correction)]
                paired = [(flush[r["seed"]], r) for r in runs if r["seed"] in flush]
                if not paired:
                    continue
                gaps = [b["final_val_loss"] - f["final_val_loss"] for f, b in paired]
                reach = [steps_to(b["val_losses"], f["final_val_loss"]) for f, b in paired]
                default_flush = {
                    r["seed"]: r
                    for r in pick(schedule="flush", optimizer=args.optimizers[0], lr=lr, correction=reference)
                }
                reach0 = [
                    steps_to(b["val_losses"], default_flush[b["seed"]]["final_val_loss"])
                    for _, b in paired
                    if b["seed"] in default_flush
                ]
                steps = _steps(reach, args.steps)
                extra = (
                    statistics.median([b["optimizer_state_bytes_per_param"] for _, b in paired]) - base_state
                    if base_state is not None
                    else float("nan")
                )
                entry = dict(
                    optimizer=optimizer,
                    lr=lr,
                    correction=correction,
                    seeds=[b["seed"] for _, b in paired],
                    flush=statistics.mean(f["final_val_loss"] for f, _ in paired),
                    twobw=statistics.mean(b["final_val_loss"] for _, b in paired),
                    gap=statistics.mean(gaps),
                    gap_min=min(gaps),
                    gap_max=max(gaps),
                    steps_to_flush_loss=reach,
                    steps_to_default_flush_loss=reach0,
                    samples_per_s=statistics.median(b["samples_per_s"] for _, b in paired),
                    flush_samples_per_s=statistics.median(f["samples_per_s"] for f, _ in paired),
                    extra_bytes_per_param=extra,
                )
                table.append(entry)
                print(
                    f"| {optimizer} | {lr:g} | {entry['flush']:.3f} | {correction} | {entry['twobw']:.3f} | "
                    f"{entry['gap']:+.3f} ({entry['gap_min']:+.3f}..{entry['gap_max']:+.3f}) | {steps} | "
                    f"{_steps(reach0, args.steps)} | {entry['samples_per_s']:.0f} | {extra:.1f} | {len(paired)} |"
                )
    result = dict(command=" ".join(map(shlex.quote, sys.argv)), config=_config(args), runs=rows, table=table)
    if args.time_to_loss and rows:
        result["time_to_loss"] = time_to_loss(args, rows, out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    if rows and not args.no_plot:
        plot(args, rows, out / "curves.png")
    return result


def print_runs(args, rows: List[Dict[str, Any]]) -> None:
    """Each run's final validation loss and samples/s; with --target-loss, the steps it took to that loss and to
    its seed's reference flush run's final loss (same optimizer and lr), and their ratio to that flush run's."""
    print("\nruns (final validation loss, samples/s[, steps to --target-loss, to flush's final loss (x flush's)]):")
    for r in rows:
        line = f"  {_name(r):42s} {r['final_val_loss']:.4f}  {r['samples_per_s']:.1f}"
        if args.target_loss is not None:
            key = ("flush", r["optimizer"], args.flush_corrections[0], r["lr"], r["seed"])
            flush = next(
                (f for f in rows if (f["schedule"], f["optimizer"], f["correction"], f["lr"], f["seed"]) == key), None
            )
            for target in (args.target_loss, None if flush is None else flush["final_val_loss"]):
                if target is None:
                    continue
                mine = steps_to(r["val_losses"], target)
                ref = None if flush is None else steps_to(flush["val_losses"], target)
                ratio = f" ({mine / ref:.2f}x)" if mine and ref else ""
                line += f"  to {target:.3f}: {mine if mine else f'>{args.steps}'}{ratio}"
        print(line)


def time_to_loss(args, rows: List[Dict[str, Any]], out: Path) -> Dict[str, Any]:
    """Wall time to the default flushing run's final validation loss (or --target-loss), at --nproc ranks:
    steps (from the runs above, mean over seeds; the delay, hence the losses, is the same at any depth) x step
    time, every step time measured in one scripts/bench.py run that alternates the systems. Ours: each 2bw
    setting that reached the loss in every seed; theirs: torch.distributed.pipelining's strongest schedules (two
    stages per rank) with each optimizer whose flush run reached it (a synchronous schedule's losses are
    flush's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench.py, beside this script
    from bench import STRONGEST

    lr = args.lrs[0]
    default = [r for r in rows if (r["schedule"], r["optimizer"], r["lr"]) == ("flush", args.optimizers[0], lr)]
    target = args.target_loss if args.target_loss is not None else statistics.mean(r["final_val_loss"] for r in default)
    systems: Dict[str, float] = {}  # bench system -> steps to the target
    for key in sorted({(r["schedule"], r["optimizer"], r["correction"]) for r in rows if r["lr"] == lr}):
        runs = [r for r in rows if (r["schedule"], r["optimizer"], r["correction"], r["lr"]) == (*key, lr)]
        reach = [steps_to(r["val_losses"], target) for r in runs]
        if None in reach:
            continue
        schedule, optimizer, correction = key
        if schedule == "2bw":
            systems[f"ours-2bw@{optimizer}+{correction}"] = statistics.mean(reach)
        else:
            systems.update({f"{theirs}@{optimizer}": statistics.mean(reach) for theirs in STRONGEST})
    where = "--target-loss" if args.target_loss is not None else f"flush-{args.optimizers[0]}'s final, lr {lr:g}"
    print(f"\ntime to validation loss {target:.3f} ({where}) at {args.nproc} ranks:")
    if not any(s.startswith("ours-") for s in systems) or not any(s.startswith("torch-") for s in systems):
        print("  not measured: no 2bw setting or no flush run reached it in every seed")
        return dict(target=target, systems={})
    json_path = out / "time_to_loss_bench.json"
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("bench.py")),
        f"--nproc={args.nproc}",
        f"--num-microbatches={args.num_microbatches}",
        f"--microbatch-size={args.microbatch_size}",
        f"--num-layers={args.num_layers}",
        f"--d-model={args.d_model}",
        f"--num-heads={args.num_heads}",
        f"--seq-len={args.seq_len}",
        f"--repeats={args.bench_repeats}",
        "--memory-steps=0",
        "--device=cpu",
        f"--systems={','.join(systems)}",
        f"--json={json_path}",
    ]
    print("  step times:", " ".join(map(shlex.quote, cmd)), flush=True)
    subprocess.run(cmd, check=True)
    measured = {r["system"]: r for r in json.loads(json_path.read_text())["rows"]}
    table = {}
    print(f"\n| system | steps to {target:.3f} | step time (s, median) | time to {target:.3f} (s) |")
    print("|---|---|---|---|")
    for system, steps in sorted(systems.items(), key=lambda kv: kv[0]):
        if system not in measured:  # a torch schedule that refused the shape
            continue
        step_time = args.num_microbatches * args.microbatch_size / measured[system]["samples_per_s"]
        table[system] = dict(steps=steps, step_time_s=step_time, time_s=steps * step_time)
        print(f"| {system} | {steps:.0f} | {step_time:.4f} | {steps * step_time:.1f} |")
    ours = min((s for s in table if s.startswith("ours-")), key=lambda s: table[s]["time_s"])
    theirs = min((s for s in table if s.startswith("torch-")), key=lambda s: table[s]["time_s"])
    ratio = table[ours]["time_s"] / table[theirs]["time_s"]
    print(f"\nours ({ours}) / torch's fastest ({theirs}): {ratio:.2f}x the time to {target:.3f}")
    return dict(target=target, systems=table, ours=ours, theirs=theirs, ratio=ratio)


def _steps(reach: List[Optional[int]], num_steps: int) -> str:
    """Mean steps to a loss over the seeds that reached it ('>N' if none did; '(k/n)' if only k of n did)."""
    reached = [x for x in reach if x is not None]
    if not reached:
        return f">{num_steps}"
    return f"{statistics.mean(reached):.0f}" + ("" if len(reached) == len(reach) else f" ({len(reached)}/{len(reach)})")


def plot(args, rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(args.optimizers), len(args.lrs), figsize=(4.2 * len(args.lrs), 3.2 * len(args.optimizers)), squeeze=False
    )
    colors = {"flush": "black", "none": "tab:red", "error_feedback": "tab:blue", "lookahead": "tab:green"}
    for i, optimizer in enumerate(args.optimizers):
        for j, lr in enumerate(args.lrs):
            ax = axes[i][j]
            for r in rows:
                if r["optimizer"] != optimizer or r["lr"] != lr:
                    continue
                key = "flush" if r["schedule"] == "flush" else r["correction"]
                label = key if r["seed"] == min(args.seeds) else None
                steps = [c["step"] for c in r["val_losses"]]
                losses = [c["loss"] for c in r["val_losses"]]
                ax.plot(steps, losses, color=colors.get(key), lw=1, alpha=0.8, label=label)
            ax.set_title(f"{optimizer} lr {lr:g}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel("validation loss", fontsize=8)
            ax.set_ylim(top=3.4)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    print(f"\ncurves: {path}")


def _config(args) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("one", "report_only")}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What ``run_config`` reads besides the grid and --eval-every: the learning-rate schedule, the GPT, the batch
    and the data every run shares (scripts/screen_newest.py takes them too)."""
    from pipedream2bw.config.schema import LR_SCHEDULERS

    p.add_argument("--warmup", type=int, default=0, help="optim.warmup_steps (linear learning-rate warm-up)")
    p.add_argument(
        "--scheduler",
        default="constant",
        choices=LR_SCHEDULERS,
        help="optim.scheduler, the same for flush and 2bw (run names do not say it: give each its own --out)",
    )
    p.add_argument("--min-lr", type=float, default=0.0, help="optim.min_lr, what cosine and linear decay to")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--data-path", default=None, help="data.path (default: the shipped text)")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--eval-batches", type=int, default=4)


def main(argv=None) -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    words = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", type=floats, default=[3e-3, 1e-3])
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--optimizers", type=words, default=["adamw", "muon"])
    p.add_argument("--corrections", type=words, default=["none", "error_feedback", "lookahead"])
    p.add_argument(
        "--flush-corrections",
        type=words,
        default=["none"],
        help="flush's runs: 'none' and, e.g., none+mom0.9 (another momentum); the first is the reference",
    )
    add_run_arguments(p)
    p.add_argument("--num-stages", type=int, default=1, help="pipeline depth D: D > 1 runs each under torchrun")
    p.add_argument(
        "--flush-num-stages", type=int, default=None, help="flush's runs' depth (default: --num-stages; 1 reuses them)"
    )
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--out", default="outputs/convergence")
    p.add_argument("--report-only", action="store_true", help="only report the runs already in --out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--time-to-loss",
        action="store_true",
        help="then time each setting that reached the default flush run's final loss (first --lrs) with "
        "scripts/bench.py at --nproc ranks, ours against torch's strongest schedules",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks of the --time-to-loss step times")
    p.add_argument("--target-loss", type=float, default=None, help="--time-to-loss to this validation loss instead")
    p.add_argument("--bench-repeats", type=int, default=3, help="scripts/bench.py --repeats for --time-to-loss")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.one:
        spec = json.loads(args.one)
        _one(args, spec, out / _name(spec))
        return
    print("command:", " ".join(map(shlex.quote, [sys.executable, *sys.argv])))
    print("config:", json.dumps(_config(args)))
    todo = [s for s in grid(args) if _summary(out, s) is None]
    if args.report_only and len(todo) == len(grid(args)):  # it raised FileNotFoundError writing results.json (issue 43)
        print(f"no runs in {out} to report: run without --report-only first (or name their --out)", file=sys.stderr)
        sys.exit(2)
    if not args.report_only:
        from pipedream2bw.pipeline.comm import torchrun_command  # --num-stages > 1: each run on D ranks

        print(f"{len(grid(args)) - len(todo)} runs found in {out}, {len(todo)} to run", flush=True)
        running: List[subprocess.Popen] = []
        base = [a for a in (argv if argv is not None else sys.argv[1:])]
        for spec in todo:
            while len(running) >= args.jobs:
                running[0].wait()
                running = [r for r in running if r.poll() is None]
            log = out / f"{_name(spec)}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            launch = torchrun_command(spec["num_stages"]) if "num_stages" in spec else [sys.executable]
            cmd = [*launch, __file__, *base, "--one", json.dumps(spec)]
            running.append(subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT))
            print(f"started {_name(spec)}", flush=True)
        for r in running:
            r.wait()
    report(args, out)


if __name__ == "__main__":
    main()
