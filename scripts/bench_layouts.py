"""Throughput of d x w layouts on the same global batch, and all-reduce time not hidden by backward.

    python scripts/bench_layouts.py [--layouts 2x2,4x1,1x4] [--repeats 3] [--steps 20] [overrides ...]

Each run is the real command (python -m pipedream2bw.train, launched as torchrun does: one thread per rank unless
OMP_NUM_THREADS is set); layouts alternate within each
repeat so that machine drift hits them alike. Prints the command, the configuration and a
table of medians, and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pipedream2bw.run.launch import LaunchError, launch_train, worker_threads


def run_layout(
    d: int, w: int, *, global_batch: int, microbatch_size: int, steps: int, schedule: str, overrides, out_dir: Path
) -> dict:
    m = global_batch // (w * microbatch_size)
    run_dir = out_dir / f"{d}x{w}-{time.monotonic_ns()}"
    try:  # the real training command, launched as torchrun does (pipedream2bw.run.launch)
        launch_train(
            [
                f"pipeline.schedule={schedule}",
                f"pipeline.num_stages={d}",
                f"pipeline.data_parallel={w}",
                f"pipeline.num_microbatches={m}",
                f"pipeline.microbatch_size={microbatch_size}",
                f"train.num_steps={steps}",
                "wandb.mode=disabled",
                *overrides,
            ],
            nproc=d * w,
            run_dir=run_dir,
        )
    except LaunchError as e:
        raise SystemExit(f"{d}x{w} failed: {e}; see {run_dir}/train.log and {run_dir}/launch/") from e
    summary = json.loads((run_dir / "summary.json").read_text())
    exposed = [r["allreduce_exposed_s"] / steps for r in summary["ranks"]]
    return {
        "samples_per_s": summary["samples_per_s"],
        "step_time_s": summary["step_time_s"],
        "exposed_allreduce_s_per_step": max(exposed),
        "num_microbatches": m,
    }


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--layouts", default="2x2,4x1,1x4", help="comma-separated DxW")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--json", default="bench_layouts.json")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.d_model=256")
    args = parser.parse_args()
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    threads = ", ".join(f"{d}x{w}: {worker_threads(d * w) or 'all cores'}" for d, w in layouts)
    print(
        f"config: schedule={args.schedule} global_batch={args.global_batch} microbatch_size={args.microbatch_size} "
        f"steps={args.steps} (first 3 left out) repeats={args.repeats} overrides={args.overrides}; "
        f"OMP_NUM_THREADS per rank: {threads}"
    )
    results = {layout: [] for layout in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for d, w in layouts:
                r = run_layout(
                    d,
                    w,
                    global_batch=args.global_batch,
                    microbatch_size=args.microbatch_size,
                    steps=args.steps,
                    schedule=args.schedule,
                    overrides=args.overrides,
                    out_dir=Path(tmp),
                )
                results[(d, w)].append(r)
                print(
                    f"  repeat {repeat} {d}x{w}: {r['samples_per_s']:.1f} samples/s, "
                    f"exposed all-reduce {1e3 * r['exposed_allreduce_s_per_step']:.1f} ms/step",
                    flush=True,
                )
    base = statistics.median(r["samples_per_s"] for r in results[layouts[0]])
    rows = []
    print(
        f"\n{'layout':>8} {'m':>3} {'samples/s':>10} {'vs ' + 'x'.join(map(str, layouts[0])):>8} {'step ms':>8} "
        f"{'exposed AR ms/step':>19} {'exposed %':>9}"
    )
    for (d, w), runs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in runs)
        step = statistics.median(r["step_time_s"] for r in runs)
        exposed = statistics.median(r["exposed_allreduce_s_per_step"] for r in runs)
        rows.append(
            {
                "num_stages": d,
                "data_parallel": w,
                "num_microbatches": runs[0]["num_microbatches"],
                "samples_per_s": sps,
                "ratio": sps / base,
                "step_time_s": step,
                "exposed_allreduce_s_per_step": exposed,
                "runs": runs,
            }
        )
        print(
            f"{f'{d}x{w}':>8} {runs[0]['num_microbatches']:>3} {sps:>10.1f} {sps / base:>8.2f} {1e3 * step:>8.1f} "
            f"{1e3 * exposed:>19.1f} {100 * exposed / step:>8.1f}%"
        )
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
