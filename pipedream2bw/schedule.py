"""Pure: per-stage action lists (F/B/S) for the 2bw, flush and gpipe schedules, checked and simulated.

Indices used throughout (torchgpipe style):
    d: number of stages, s: stage index, m: microbatches per batch,
    t: batch index, k = t*m + j: global index of microbatch j of batch t.
An action is ``(stage_index, kind, index)`` printed as ``"1F3"``: kind F (forward of
microbatch k), B (backward of microbatch k) or S (optimizer step closing batch t).
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Sequence

FORWARD, BACKWARD, STEP = "F", "B", "S"
_ACTION_RE = re.compile(r"^(\d+)([FBS])(\d+)$")


class ScheduleError(Exception):
    """An action list that breaks a schedule invariant or deadlocks; the message shows the grid."""


class Action(NamedTuple):
    stage_index: int
    kind: str
    index: int  # microbatch k for F and B, batch t for S

    def __str__(self) -> str:
        return f"{self.stage_index}{self.kind}{self.index}"

    @staticmethod
    def parse(text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(f"{text!r} is not an action like '1F3', '0B2' or '2S0'")
        return Action(int(match[1]), match[2], int(match[3]))


def _one_f_one_b(stage_index: int, first: int, count: int, in_flight: int) -> List[Action]:
    """1F1B over microbatches first..first+count-1 with at most ``in_flight`` forwarded, not backwarded."""
    warmup = min(in_flight - 1, count)
    actions = [Action(stage_index, FORWARD, first + i) for i in range(warmup)]
    for i in range(count):
        if warmup + i < count:
            actions.append(Action(stage_index, FORWARD, first + warmup + i))
        actions.append(Action(stage_index, BACKWARD, first + i))
    return actions


def _insert_steps(actions: List[Action], stage_index: int, num_microbatches: int) -> List[Action]:
    """Puts S t right after the backward of the last microbatch of batch t."""
    out = []
    for a in actions:
        out.append(a)
        if a.kind == BACKWARD and (a.index + 1) % num_microbatches == 0:
            out.append(Action(stage_index, STEP, a.index // num_microbatches))
    return out


def stage_actions(
    schedule: str, *, stage_index: int, num_stages: int, num_microbatches: int, num_batches: int
) -> List[Action]:
    """The ordered actions of one stage for ``num_batches`` batches.

    2bw runs 1F1B over all batches as one stream (no flush: batch t+1's warm-up forwards
    overlap batch t's last backwards); flush runs 1F1B per batch; gpipe all forwards then all
    backwards per batch. Every schedule steps once per batch, right after its last backward.

    Raises:
        ValueError: unknown schedule.
    """
    s, d, m = stage_index, num_stages, num_microbatches
    if schedule == "2bw":
        actions = _one_f_one_b(s, 0, num_batches * m, d - s)
    elif schedule == "flush":
        actions = [a for t in range(num_batches) for a in _one_f_one_b(s, t * m, m, d - s)]
    elif schedule == "gpipe":
        actions = [
            Action(s, kind, t * m + j) for t in range(num_batches) for kind in (FORWARD, BACKWARD) for j in range(m)
        ]
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use one of 2bw, flush, gpipe")
    return _insert_steps(actions, s, m)


def shift_batches(actions: Sequence[Action], *, first_batch: int, num_microbatches: int) -> List[Action]:
    """The same actions for batches ``first_batch``, ``first_batch + 1``, ... instead of 0, 1, ...
    (a run resumed after ``first_batch`` steps starts its pipeline afresh at that batch)."""
    return [
        a._replace(index=a.index + (first_batch if a.kind == STEP else first_batch * num_microbatches)) for a in actions
    ]


def receipts(peer_actions: Sequence[Action], *, consumes: str, signals: str) -> Dict[int, int]:
    """What a neighbour's transfers prove about our sends to it.

    For each ``signals`` action j of ``peer_actions`` (a forward whose output the neighbour
    sends us, or a backward whose input gradient it sends us): the largest index i of its
    ``consumes`` actions (those that needed what we sent: its forwards for our activations,
    its backwards for our gradients) done before j. Once we hold what j sent, our sends up
    to microbatch i have been received; -1 when none.
    """
    proofs, done = {}, -1
    for a in peer_actions:
        if a.kind == consumes:
            done = max(done, a.index)
        elif a.kind == signals:
            proofs[a.index] = done
    return proofs


def pipeline_actions(schedule: str, *, num_stages: int, num_microbatches: int, num_batches: int) -> List[List[Action]]:
    """Action lists of all stages, stage 0 first."""
    return [
        stage_actions(
            schedule, stage_index=s, num_stages=num_stages, num_microbatches=num_microbatches, num_batches=num_batches
        )
        for s in range(num_stages)
    ]


def max_in_flight(actions: Sequence[Action]) -> int:
    """Most microbatches forwarded but not yet backwarded at any point of one stage's list."""
    live, peak = 0, 0
    for a in actions:
        live += {FORWARD: 1, BACKWARD: -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


def check_stage(actions: Sequence[Action], *, num_microbatches: int, in_flight_limit: int) -> None:
    """Checks one stage: each microbatch forwarded once then backwarded once, in microbatch
    order; at most ``in_flight_limit`` in flight; one step per batch, after its last backward.

    Raises:
        ScheduleError: the first action that breaks a rule.
    """
    forwarded, backwarded, stepped = [], [], []
    for pos, a in enumerate(actions):
        where = f"action {pos} ({a}) of stage {a.stage_index}"
        if a.kind == FORWARD:
            if a.index != len(forwarded):
                raise ScheduleError(f"{where}: forwards must run in microbatch order, expected F{len(forwarded)}")
            forwarded.append(a.index)
        elif a.kind == BACKWARD:
            if a.index != len(backwarded) or a.index >= len(forwarded):
                raise ScheduleError(f"{where}: backward before its forward or out of microbatch order")
            backwarded.append(a.index)
        elif a.kind == STEP:
            if a.index != len(stepped) or len(backwarded) != (a.index + 1) * num_microbatches:
                raise ScheduleError(f"{where}: a step must follow the last backward of its batch")
            stepped.append(a.index)
        if len(forwarded) - len(backwarded) > in_flight_limit:
            raise ScheduleError(
                f"{where}: {len(forwarded) - len(backwarded)} microbatches in flight, limit {in_flight_limit}"
            )
    if len(backwarded) != len(forwarded) or len(stepped) * num_microbatches != len(backwarded):
        raise ScheduleError(f"stage {actions[0].stage_index if actions else '?'}: the list ends with work left undone")


def simulate(actions_per_stage: Sequence[Sequence[Action]]) -> List[List[Optional[Action]]]:
    """Runs the stages' lists in unit-time clock ticks, honouring the p2p dependencies.

    F k on stage s waits for F k on s-1; B k on stage s < d-1 waits for B k on s+1 (the last
    stage's backward needs only its own forward). Each tick, every stage whose next action is
    ready runs it.

    Returns:
        grid[tick][stage]: the action run then, or None for an idle stage.

    Raises:
        ScheduleError: a deadlock (no stage can move, work remains), with the grid so far.
    """
    d = len(actions_per_stage)
    pos = [0] * d
    done: Dict[tuple, int] = {}  # (stage, kind, index) -> tick it finished
    grid: List[List[Optional[Action]]] = []
    while any(pos[s] < len(actions_per_stage[s]) for s in range(d)):
        tick, row = len(grid), [None] * d
        for s in range(d):
            if pos[s] == len(actions_per_stage[s]):
                continue
            a = actions_per_stage[s][pos[s]]
            dep = {FORWARD: (s - 1, FORWARD), BACKWARD: (s + 1, BACKWARD)}.get(a.kind)
            if dep and 0 <= dep[0] < d and done.get((dep[0], dep[1], a.index), tick) >= tick:
                continue
            row[s] = a
        if not any(row):
            blocked = [str(actions_per_stage[s][pos[s]]) for s in range(d) if pos[s] < len(actions_per_stage[s])]
            raise ScheduleError(f"deadlock at tick {tick}: blocked {blocked}\n{render(grid)}")
        for s, a in enumerate(row):
            if a is not None:
                done[tuple(a)] = tick
                pos[s] += 1
        grid.append(row)
    return grid


def render(grid: Sequence[Sequence[Optional[Action]]]) -> str:
    """Step-by-rank text grid: one row per stage, one column per tick, '.' for idle."""
    if not grid:
        return "(empty)"
    d = len(grid[0])
    width = max(len(str(a)) - 1 for row in grid for a in row if a is not None)
    lines = []
    for s in range(d):
        cells = [(f"{a.kind}{a.index}" if a is not None else ".").rjust(width) for a in (row[s] for row in grid)]
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)
