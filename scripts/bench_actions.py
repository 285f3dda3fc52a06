"""What one action of ours-2bw costs, per rank (issue 47): wall and thread-CPU time per call of a send's, a receive's
posting and waiting, a forward and a backward, with the process group's own send and receive inside them.

    python scripts/bench_actions.py [--num-microbatches 16] [--microbatch-size 2] [--num-layers 4] [--d-model 128]

Runs scripts/bench.py's ours-2bw worker (2 ranks, gloo) with the methods below wrapped by clock reads while the
training loop's profiler range is open, and prints medians over the calls of the last three quarters of the run
(the first quarter is warm-up). Thread-CPU time is this thread's own work, which other jobs on the machine move
less than the wall clock; the difference between a method and the calls inside it is its own Python. A tree
before issue 47 posts with ``dist.isend``/``dist.irecv`` (listed) where a later one calls ``group.send``/``recv``;
run it there beside this directory's bench_calls.py, whose worker scaffolding it shares.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_calls import in_training_range, run_ranks  # scripts/: copy both files into an older tree


def _timed(record: dict, on: list, label: str, fn):
    """``fn`` with each call's (wall ns, thread-CPU ns) appended to ``record[label]`` while ``on[0]``."""

    def timed(*args, **kwargs):
        if not on[0]:
            return fn(*args, **kwargs)
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            record[label].append((time.perf_counter_ns() - wall, time.thread_time_ns() - cpu))

    return timed


def _profiled_worker(out: str) -> None:
    """In a rank: bench.py's worker with the action methods timed inside the training loop's range."""
    import torch.distributed as dist

    from pipedream2bw.pipeline import boundary, comm
    from pipedream2bw.run import stage

    record, on = collections.defaultdict(list), [False]
    for owner, names in (
        (dist, ("isend", "irecv")),
        (comm.P2P, ("send", "post_recv", "wait_recv", "release")),
        (boundary.Channel, ("send", "post_recv", "wait_recv")),
        (stage.StageWorker, ("forward", "backward", "_communicate")),
    ):
        for name in names:
            label = f"{'dist' if owner is dist else owner.__name__}.{name}"
            setattr(owner, name, _timed(record, on, label, getattr(owner, name)))
    if hasattr(comm.P2P, "_post"):  # the process group's own send and receive (issue 47), apart
        post = comm.P2P._post
        sends, recvs = (_timed(record, on, f"group.{k}", post) for k in ("send", "recv"))
        comm.P2P._post = lambda self, kind, *a: (sends if kind == "send" else recvs)(self, kind, *a)
    in_training_range(lambda: on.__setitem__(0, True), lambda: on.__setitem__(0, False))
    medians = {}
    for label, calls in record.items():
        calls = calls[len(calls) // 4 :]
        if calls:
            medians[label] = [len(calls), *(statistics.median(c[i] for c in calls) / 1e3 for i in (0, 1))]
    Path(out, f"actions{os.environ['RANK']}.json").write_text(json.dumps(medians))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for flag, default, what in (
        ("num-microbatches", 16, "microbatches a batch"),
        ("microbatch-size", 2, "sequences a microbatch"),
        ("num-layers", 4, "transformer blocks"),
        ("d-model", 128, "model width"),
        ("num-heads", 4, "attention heads"),
        ("seq-len", 32, "tokens a sequence"),
        ("steps", 30, "optimizer steps"),
        ("warmup", 5, "steps bench.py leaves out of its figures"),
    ):
        parser.add_argument(f"--{flag}", type=int, default=default, help=what)
    parser.add_argument("--profiled", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.profiled:
        return _profiled_worker(args.profiled)
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "profiled"]
    with tempfile.TemporaryDirectory() as out:
        run_ranks(__file__, out, ["--worker", "ours-2bw", "--out", out, "--device=cpu", "--memory-steps=0", *shape])
        ranks = [json.loads(Path(out, f"actions{r}.json").read_text()) for r in (0, 1)]
    print(f"{'us per call, medians':34}" + "".join(f"{f'rank {r} wall':>14}{'cpu':>8}" for r in (0, 1)))
    for label in sorted(set(ranks[0]) | set(ranks[1])):
        row = "".join(
            f"{ranks[r][label][1]:>14.1f}{ranks[r][label][2]:>8.1f}" if label in ranks[r] else f"{'-':>14}{'-':>8}"
            for r in (0, 1)
        )
        print(f"{label:34}{row}")


if __name__ == "__main__":
    main()
