"""Screen newest's prediction horizon in one process: the rule, not the runtime (tests/reference.py's
``reference_newest``, whose losses the pipeline's equal to float32 round-off: tests/test_newest.py, the matrix).

    nice -n 10 python scripts/screen_newest.py --horizons 1,1.5,2 --seeds 0,1,2 [--num-stages 2]
        [--num-layers 4 --d-model 64 --seq-len 64 --num-microbatches 4 --microbatch-size 8] [--balance 3,4]

Each run trains the GPT of scripts/bench_convergence.py's runs (its ``run_config``: the same batches, learning rate,
validation windows) for --steps steps, one thread, under pipeline.weight_versions=newest with optim.delay_correction=
predict at each horizon h (optim.predict_horizon), and flush (plain minibatch training: the rule at one stage) as the
reference, validating every --eval-every steps. Prints the command, the configuration, flush's own first step at its
validation loss at --target-step (at most --target-step: a curve may dip there before), then per horizon each seed's
steps to that loss and the gap to it at --target-step, the mean ratio to flush's and the mean gap. A screen: it says
which horizon to run the pipeline at (scripts/bench_convergence.py's ``predict+newest+horizonX``), in a quarter of
the cores; the pipeline's runs are the measurement.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]


def _curve(cfg, balance: List[int], every: int) -> Dict[int, float]:
    """Validation loss every ``every`` steps of the newest rule over ``balance`` (one stage: plain training)."""
    from reference import reference_eval, reference_newest

    curve: Dict[int, float] = {}

    def on_step(t: int, model) -> None:
        if (t + 1) % every == 0:
            curve[t + 1] = reference_eval(cfg, model.state_dict())

    reference_newest(cfg, balance=balance, on_step=on_step)
    return curve


def main(argv=None) -> None:
    from bench_convergence import add_run_arguments, run_config, steps_to

    from pipedream2bw.config import gpt_balance

    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--horizons", type=floats, default=[1.0, 1.5, 2.0])
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--target-step", type=int, default=300, help="flush's loss at this step is the target")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--balance", type=ints, default=None, help="layers a stage (default: gpt_balance's)")
    add_run_arguments(p)  # the schedule, GPT, batch and data of bench_convergence's runs, with its defaults
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--out", default=None, help="write the curves here (JSON)")
    args = p.parse_args(argv)
    if args.target_step % args.eval_every or args.target_step > args.steps:
        raise SystemExit("--target-step must be a multiple of --eval-every and at most --steps")
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("config:", json.dumps(vars(args)))
    common = dict(optimizer="muon", lr=args.lr)
    curves: Dict[str, Dict[int, Dict[int, float]]] = {"flush": {}}
    for seed in args.seeds:
        flush = run_config(args, schedule="flush", correction="none", seed=seed, **common)
        curves["flush"][seed] = _curve(flush, [sum(args.balance or gpt_balance(flush.model, 1))], args.eval_every)
        for h in args.horizons:
            cfg = run_config(
                args, schedule="2bw", correction=f"predict+newest+horizon{h}", seed=seed, num_stages=args.num_stages,
                **common,
            )  # fmt: skip
            balance = args.balance or gpt_balance(cfg.model, args.num_stages)
            curves.setdefault(f"h={h:g}", {})[seed] = _curve(cfg, balance, args.eval_every)
            print(f"  seed {seed} h={h:g}: {curves[f'h={h:g}'][seed][args.target_step]:.4f} at {args.target_step}")
    n = args.target_step
    reach = lambda curve, target: steps_to([{"step": s, "loss": v} for s, v in sorted(curve.items())], target)  # noqa: E731
    targets = {seed: curve[n] for seed, curve in curves["flush"].items()}
    firsts = {seed: reach(curves["flush"][seed], target) for seed, target in targets.items()}  # at most n
    print(f"\nsteps to flush's validation loss at step {n}, gap to it there, ratio to flush's own first step at it")
    print(f"  flush   {' / '.join(str(firsts[seed]) for seed in args.seeds)}  (seeds {args.seeds})")
    for name, runs in curves.items():
        if name == "flush":
            continue
        steps = [reach(curve, targets[seed]) for seed, curve in runs.items()]
        gaps = [curve[n] - targets[seed] for seed, curve in runs.items()]
        shown = " / ".join(str(s) if s is not None else f">{args.steps}" for s in steps)
        ratios = [s / firsts[seed] for s, seed in zip(steps, runs)] if None not in steps else None
        ratio = f"{sum(ratios) / len(ratios):.3f}x" if ratios else "-"
        print(f"  {name:7s} {shown}  mean {ratio}  gap {sum(gaps) / len(gaps):+.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(curves))


if __name__ == "__main__":
    main()
