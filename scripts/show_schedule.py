"""Prints a schedule's per-stage action lists as a step-by-stage grid, with its bubble fraction.

python scripts/show_schedule.py --schedule 2bw --num-stages 4 --num-microbatches 4 --num-batches 2
"""

from __future__ import annotations

import argparse

from pipedream2bw.schedule import STEP, pipeline_actions, render, simulate
from pipedream2bw.versions import max_versions_alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["2bw", "flush", "gpipe"], default="2bw")
    parser.add_argument("--num-stages", type=int, default=4)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--num-batches", type=int, default=2)
    args = parser.parse_args()
    actions = pipeline_actions(
        args.schedule, num_stages=args.num_stages, num_microbatches=args.num_microbatches, num_batches=args.num_batches
    )
    grid = simulate(actions)
    print(render(grid))
    busy = sum(a is not None and a.kind != STEP for row in grid for a in row)
    print(
        f"\n{len(grid)} ticks (F and B one tick each, S one tick); idle fraction "
        f"{1 - busy / (len(grid) * args.num_stages):.2f}; weight versions per stage: "
        f"{[max_versions_alive(a, schedule=args.schedule, num_microbatches=args.num_microbatches) for a in actions]}"
    )


if __name__ == "__main__":
    main()
