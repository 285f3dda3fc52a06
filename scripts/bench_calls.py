"""Python function calls a step of ours-2bw, per rank: what an action costs in Python, which load does not change.

    python scripts/bench_calls.py [--system ours-2bw@muon+predict:newest] [--num-microbatches 8] [--microbatch-size 1]

Runs scripts/bench.py's ours-2bw worker (``--system``: another system of ours, e.g.
ours-2bw@muon+predict:newest) twice (``--short`` and ``--long`` steps) with cProfile over the training loop (the
``pipedream2bw.train`` range) of each rank, and prints (long - short) / (long - short steps): the calls a step, the
same on every run of a tree. A commit that adds Python work to each forward, backward, send or receive shows exactly,
where wall time on a shared machine varies by 2x (issue 47's bisect: copy this file into an old tree and run it
there, with that tree on PYTHONPATH). ``--top N`` also lists the N functions with the most calls a step; ``--times
N`` the N with the most cumulative milliseconds a step (wall time under cProfile: where the time goes, not a timing)
and their calls a step.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def in_training_range(enter, leave) -> None:
    """In a rank: bench.py's worker (this process's arguments after ``--``), ``enter()`` called as the training loop's
    profiler range (``runner.TRAIN_RANGE``) opens and ``leave()`` as it closes. bench_actions.py runs its timers so."""
    import torch

    sys.path.insert(0, str(HERE))
    import bench

    try:
        from pipedream2bw.run import runner
    except ImportError:  # a tree from before the package's layers (issue 47's bisect reaches 7662ab8)
        from pipedream2bw import runner

    record_function = torch.profiler.record_function

    class Range:
        def __init__(self, name: str, *args, **kwargs):
            self.name, self.inner = name, record_function(name, *args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            if self.name == runner.TRAIN_RANGE:
                enter()
            return self

        def __exit__(self, *exc):
            if self.name == runner.TRAIN_RANGE:
                leave()
            return self.inner.__exit__(*exc)

    torch.profiler.record_function = Range
    sys.argv = [str(HERE / "bench.py"), *sys.argv[sys.argv.index("--") + 1 :]]
    bench.main()


def run_ranks(script: str, out: str, worker: list) -> None:
    """``script --profiled out -- worker`` on 2 ranks by torchrun (bench.py's worker arguments); exits with the ranks'
    output if it fails."""
    try:
        from pipedream2bw.pipeline.comm import torchrun_command
    except ImportError:  # a tree from before the package's layers
        from pipedream2bw.comm import torchrun_command

    proc = subprocess.run(
        [*torchrun_command(2), script, "--profiled", out, "--", *worker], capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-3000:])


def _profiled_worker(out: str) -> None:
    """In a rank: bench.py's worker, with cProfile on while the training loop's profiler range is open."""
    prof = cProfile.Profile()
    in_training_range(prof.enable, prof.disable)
    stats = pstats.Stats(prof)
    names = {key: f"{Path(key[0]).name}:{key[1]}:{key[2]}" for key in stats.stats}
    calls = {names[key]: s[1] for key, s in stats.stats.items()}
    cumulative = {names[key]: s[3] for key, s in stats.stats.items()}  # seconds in it and what it calls
    Path(out, f"calls{os.environ['RANK']}.json").write_text(
        json.dumps({"total": stats.total_calls, "calls": calls, "cumulative": cumulative})
    )


def _run(args, steps: int, out: str) -> list:
    worker = ["--worker", args.system, "--out", out, f"--steps={steps}", "--warmup=2", "--device=cpu"]
    shape = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("num_microbatches", "microbatch_size")]
    shape += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("num_layers", "d_model", "num_heads", "seq_len")]
    run_ranks(__file__, out, [*worker, *shape])
    return [json.loads(Path(out, f"calls{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", default="ours-2bw", help="bench.py's system, e.g. ours-2bw@muon+predict:newest")
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--short", type=int, default=6, help="steps of the first run")
    parser.add_argument("--long", type=int, default=14, help="steps of the second run")
    parser.add_argument("--top", type=int, default=0, help="also list the N functions with the most calls a step")
    parser.add_argument(
        "--times",
        type=int,
        default=0,
        help="also list the N functions with the most cumulative ms a step (wall time: noisy)",
    )
    parser.add_argument("--profiled", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.profiled:
        return _profiled_worker(args.profiled)
    if args.long <= args.short or args.short < 4:
        parser.error(f"--long ({args.long}) must exceed --short ({args.short}), which must be >= 4 (2 warm-up)")
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        short, long = _run(args, args.short, a), _run(args, args.long, b)
    n = args.long - args.short
    for rank, (x, y) in enumerate(zip(short, long)):
        print(f"rank {rank}: {(y['total'] - x['total']) / n:.0f} Python calls a step")
        per_step = {k: (v - x["calls"].get(k, 0)) / n for k, v in y["calls"].items()}
        for name, count in sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {count:8.1f}  {name}")
        ms = {k: 1e3 * (v - x["cumulative"].get(k, 0.0)) / n for k, v in y["cumulative"].items()}
        for name, value in sorted(ms.items(), key=lambda kv: -kv[1])[: args.times]:
            print(f"  {value:8.2f} ms  {per_step.get(name, 0):6.1f} calls  {name}")


if __name__ == "__main__":
    main()
