"""Prints a schedule's per-stage action lists as a step-by-stage grid, with its bubble fraction, then
the same ticks with each stage's sends and receives lowered around its actions.

python scripts/show_schedule.py --schedule 2bw --num-stages 4 --num-microbatches 4 --num-batches 2
python scripts/show_schedule.py --batch-sends    # the lowering under NCCL: sends held for the next receive
python scripts/show_schedule.py --plan plan.yaml # a plan's schedule (its d, m), first its mesh: d x w x t and the ranks
python scripts/show_schedule.py --schedule zb1p  # zero bubble (ZB-H1): each backward as B (input grad.) and W
python scripts/show_schedule.py --schedule zbv   # zero bubble V: chunks r and 2d-1-r on rank r, actions "3F0"
"""

from __future__ import annotations

import argparse
import sys

from pipedream2bw.pipeline.schedule import (
    SPLIT_SCHEDULES,
    STEP,
    V_SCHEDULES,
    pipeline_actions,
    rank_actions,
    render,
    render_lowered,
    simulate,
)
from pipedream2bw.pipeline.versions import max_versions_alive


def refusal(schedule: str, d: int, m: int, num_batches: int, batch_sends: bool = False) -> str:
    """Why the runtime would not run these values (one line with the fix), or ``''``."""
    for flag, value in (("--num-stages", d), ("--num-microbatches", m), ("--num-batches", num_batches)):
        if value < 1:
            return f"{flag} ({value}) must be at least 1"
    if schedule == "2bw" and m < d:  # as pipeline.num_microbatches >= pipeline.num_stages (config/validate.py)
        return (
            f"--num-microbatches ({m}) must be >= --num-stages ({d}) for 2bw (two weight versions suffice only then; "
            f"training refuses it too); raise --num-microbatches to {d} or more, or use --schedule flush"
        )
    if schedule == "zbv" and batch_sends:
        return "--batch-sends: zbv is lowered for gloo only (training refuses dist.batch_p2p and NCCL with it)"
    return ""


def mesh_view(path: str) -> tuple:
    """A plan file's mesh as text (stages x replicas x tensor ranks; which ranks run each stage's replicas, a tensor
    group being t consecutive ranks on one node) and its (schedule, d, m)."""
    from partitioner.plans import load_plan

    plan = load_plan(path)
    t = plan.tensor_parallel
    lines = [
        f"plan {path}: mesh {plan.mesh} (stages x replicas x tensor ranks), {plan.num_ranks} ranks; {plan.schedule}, "
        f"m {plan.num_microbatches}, b {plan.microbatch_size}; ranks of each stage's replicas"
        + (f" (tensor groups of {t})" if t > 1 else "")
        + ":"
    ]
    for s, row in enumerate(plan.rank_map):
        groups = [f"{g * t}-{g * t + t - 1}" if t > 1 else str(g) for g in row]
        layers = f"{plan.boundaries[s]}-{plan.boundaries[s] + plan.balance[s] - 1}"
        lines.append(f"  stage {s:>3} (layers {layers}): " + " ".join(groups))
    return "\n".join(lines), plan.schedule, plan.num_stages, plan.num_microbatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["2bw", "flush", "zb1p", "zbv", "gpipe"], default="2bw")
    parser.add_argument("--num-stages", type=int, default=4)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--num-batches", type=int, default=2)
    parser.add_argument(
        "--forward-lead", type=int, default=0, help="pipeline.forward_lead: forwards ahead of 1F1B's d - s (2bw, flush)"
    )
    parser.add_argument(
        "--batch-sends",
        action="store_true",
        help="lower as under NCCL (dist.batch_p2p): sends held for the next receive; default gloo's prefetching",
    )
    parser.add_argument(
        "--plan", help="a plan file (python -m partitioner plan): its mesh, then its schedule (overrides the above)"
    )
    args = parser.parse_args()
    if args.plan:
        text, args.schedule, args.num_stages, args.num_microbatches = mesh_view(args.plan)
        print(text + "\n")
    d, m = args.num_stages, args.num_microbatches
    problem = refusal(args.schedule, d, m, args.num_batches, args.batch_sends)
    if problem:
        print(f"show_schedule.py: {problem}", file=sys.stderr)
        sys.exit(2)
    actions = pipeline_actions(
        args.schedule, num_stages=d, num_microbatches=m, num_batches=args.num_batches, forward_lead=args.forward_lead
    )
    grid = simulate(actions)
    print(render(grid))
    busy = sum(a is not None and a.kind != STEP for row in grid for a in row)
    kinds = "F, B (input gradient) and W (weight gradient)" if args.schedule in SPLIT_SCHEDULES else "F and B"
    if args.schedule in V_SCHEDULES:
        kinds += " of a chunk (half a stage)"
    print(
        f"\n{len(grid)} ticks ({kinds} one tick each, S one tick); idle fraction "
        f"{1 - busy / (len(grid) * d):.2f}; weight versions per stage: "
        f"{[max_versions_alive(a, schedule=args.schedule, num_microbatches=m) for a in actions]}"
    )
    lowered = [
        rank_actions(
            args.schedule,
            stage_index=s,
            num_stages=d,
            num_microbatches=m,
            first_batch=0,
            num_batches=args.num_batches,
            batch_sends=args.batch_sends,
            forward_lead=args.forward_lead,
        )
        for s in range(d)
    ]
    mode = "batched sends, as under NCCL" if args.batch_sends else "gloo: each receive posted one ahead"
    print(
        f"\nWhat each rank runs ({mode}), communication lowered around its actions:\n"
        "  RECV_X k  post the receive of microbatch k's activation (X=F, from s-1) or gradient (X=B, from s+1)\n"
        "  WAIT_X k  wait for it         FREE_X i  free our X sends up to i (that wait proved them received)\n"
        "  SEND_X k  send what X k made  HOLD_X k  the same, started with this rank's next RECV (batched sends)\n"
        + (
            f'  zbv: rank r runs chunks r and 2d-1-r ("3F0": chunk 3\'s F0); chunks {d - 1} and {d}, both on rank '
            f"{d - 1}, hand their tensors over in memory (RECV, FREE: nothing; SEND, WAIT: the hand-off)\n"
            if args.schedule in V_SCHEDULES
            else ""
        )
    )
    print(render_lowered(lowered))


if __name__ == "__main__":
    main()
