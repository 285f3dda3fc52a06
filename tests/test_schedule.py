"""Pure schedule tests: invariants over a grid of (d, m), no deadlock, one literal table."""

from __future__ import annotations

import pytest

from pipedream2bw.schedule import (
    BACKWARD,
    FORWARD,
    Action,
    ScheduleError,
    check_stage,
    max_in_flight,
    pipeline_actions,
    render,
    simulate,
    stage_actions,
)
from pipedream2bw.versions import max_versions_alive

GRID = [(d, m) for d in range(1, 6) for m in range(1, 11)]
NUM_BATCHES = 3


def _grid(schedule):
    return [(d, m) for d, m in GRID if schedule != "2bw" or m >= d]


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_invariants_over_grid(schedule):
    for d, m in _grid(schedule):
        actions = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=NUM_BATCHES)
        for s, stage in enumerate(actions):
            limit = m if schedule == "gpipe" else d - s
            check_stage(stage, num_microbatches=m, in_flight_limit=limit)
            assert max_in_flight(stage) == min(limit, m if schedule != "2bw" else NUM_BATCHES * m)
            versions = max_versions_alive(stage, schedule=schedule, num_microbatches=m)
            assert versions == (2 if schedule == "2bw" else 1), (d, m, s)
        simulate(actions)  # raises on deadlock


def test_2bw_literal_table():
    # d=2, m=2, two batches: stage 0 starts batch 1 (F2) before it finishes batch 0 (B1): no flush.
    actions = pipeline_actions("2bw", num_stages=2, num_microbatches=2, num_batches=2)
    assert [" ".join(map(str, stage)) for stage in actions] == [
        "0F0 0F1 0B0 0F2 0B1 0S0 0F3 0B2 0B3 0S1",
        "1F0 1B0 1F1 1B1 1S0 1F2 1B2 1F3 1B3 1S1",
    ]
    assert render(simulate(actions)).splitlines() == [
        "stage 0: F0 F1  . B0 F2 B1 S0 F3 B2  . B3 S1",
        "stage 1:  . F0 B0 F1 B1 S0 F2 B2 F3 B3 S1  .",
    ]


def test_flush_and_gpipe_drain_between_batches():
    for schedule in ("flush", "gpipe"):
        for stage in pipeline_actions(schedule, num_stages=3, num_microbatches=4, num_batches=2):
            step0 = [str(a)[1:] for a in stage].index("S0")
            assert all(a.index < 4 for a in stage[:step0] if a.kind in (FORWARD, BACKWARD))


def test_2bw_has_no_flush_bubble():
    d, m, batches = 4, 4, 6
    ticks = {
        s: len(simulate(pipeline_actions(s, num_stages=d, num_microbatches=m, num_batches=batches)))
        for s in ("2bw", "flush")
    }
    # flush pays the (d - 1)-deep fill and drain once per batch; 2bw once per run.
    assert ticks["flush"] - ticks["2bw"] >= (batches - 1) * (d - 1)


def test_action_text_round_trip():
    for a in stage_actions("2bw", stage_index=2, num_stages=3, num_microbatches=3, num_batches=2):
        assert Action.parse(str(a)) == a
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("F3")


def test_broken_lists_are_caught():
    with pytest.raises(ScheduleError, match="backward before its forward"):
        check_stage([Action(0, "B", 0), Action(0, "F", 0)], num_microbatches=1, in_flight_limit=1)
    with pytest.raises(ScheduleError, match="in flight"):
        check_stage([Action(0, "F", 0), Action(0, "F", 1)], num_microbatches=2, in_flight_limit=1)
    # Stage 1 wants microbatch 1's gradient before stage 0 can have sent its activation.
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(
            [
                [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
                [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)],
            ]
        )


def test_2bw_with_m_below_d_runs_ahead_of_its_weights():
    # Why 2bw requires m >= d: with m = 1 < d = 3, stage 0 would start batch 2, which runs
    # with W(1), before the step that produces W(1).
    stage0 = stage_actions("2bw", stage_index=0, num_stages=3, num_microbatches=1, num_batches=4)
    with pytest.raises(ScheduleError, match="needs W"):
        max_versions_alive(stage0, schedule="2bw", num_microbatches=1)
