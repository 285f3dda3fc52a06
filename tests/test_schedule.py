"""Pure schedule tests: invariants over a grid of (d, m), no deadlock, one literal table."""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import pytest

from pipedream2bw.pipeline.schedule import (
    BACKWARD,
    COMPUTE_KINDS,
    FORWARD,
    FREE,
    HOLD,
    RECV,
    SEND,
    WAIT,
    WEIGHT,
    Action,
    ScheduleError,
    check_chunks,
    check_stage,
    chunks,
    comm_op,
    in_flight,
    max_in_flight,
    pipeline_actions,
    rank_actions,
    receipts,
    render,
    render_steps,
    shift_batches,
    simulate,
    stage_actions,
    steps,
    timings,
    whole_backwards,
)
from pipedream2bw.pipeline.versions import max_versions_alive

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


def test_zb1p_invariants_over_grid():
    # ZB-H1: a microbatch's tensors stay until its W, at most min(d, m) of them on any stage (the first stage's
    # 1F1B peak); forwarded-not-backwarded stays within 1F1B's d - s; one weight version; no deadlock.
    for d, m in GRID:
        actions = pipeline_actions("zb1p", num_stages=d, num_microbatches=m, num_batches=NUM_BATCHES)
        for s, stage in enumerate(actions):
            check_stage(stage, num_microbatches=m, in_flight_limit=in_flight("zb1p", s, d, m))
            assert max_in_flight(stage) <= min(d, m)
            assert max_in_flight([a for a in stage if a.kind != WEIGHT]) <= min(d - s, m), (d, m, s)
            assert max_versions_alive(stage, schedule="zb1p", num_microbatches=m) == 1
        simulate(actions)


def test_zb1p_literal_table():
    # d=2, m=3: stage 1 holds W1 back so that B2 reaches stage 0 at once; one idle tick, flush's three.
    actions = pipeline_actions("zb1p", num_stages=2, num_microbatches=3, num_batches=1)
    assert [" ".join(map(str, stage)) for stage in actions] == [
        "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2 0S0",
        "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2 1S0",
    ]
    assert render(simulate(actions)).splitlines() == [
        "stage 0: F0 F1  . B0 W0 F2 B1 W1 B2 W2 S0",
        "stage 1:  . F0 B0 F1 B1 W0 F2 B2 W1 W2 S0",
    ]


@pytest.mark.parametrize("d,m", [(2, 4), (3, 7), (4, 4), (4, 8), (5, 10), (8, 16)])
def test_zb1p_idles_less_than_flush(d, m):
    # Same work in the same time units: F 1, a whole backward 2 (flush's B; zb1p's B 1 + W 1), S 0.
    def batch_time(schedule):
        lists = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=1)
        cost = {FORWARD: 1.0, BACKWARD: 2.0 if schedule == "flush" else 1.0, WEIGHT: 1.0, "S": 0.0}
        return max(end for stage in timings(lists, lambda a: cost[a.kind]) for _, end in stage)

    flush, zb = batch_time("flush"), batch_time("zb1p")
    assert flush == 3 * m + 3 * (d - 1)  # 1F1B's bubble: (d - 1) (F + B + W)
    assert zb == 3 * m + (d - 1)  # ZB-H1's: (d - 1) (F + B - W)
    assert zb < flush


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5])
def test_zbv_is_torchs_order(d):
    # ZB-V as torch.distributed.pipelining runs it (its "I" is our B), for every m: fewer than 2d - 1 too.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for m in range(1, 11):
        plan = types.SimpleNamespace(pp_group_size=d, num_stages=2 * d, _n_microbatches=m)
        ours = pipeline_actions("zbv", num_stages=d, num_microbatches=m, num_batches=1)
        for r in range(d):
            theirs = schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(plan, r)
            assert [str(a).replace("B", "I") for a in ours[r][:-1]] == [str(a) for a in theirs if a is not None]
            assert ours[r][-1] == Action(r, "S", 0)


def test_zbv_invariants_over_grid():
    # Rank r runs chunks r and 2d-1-r; each chunk's actions pass check_stage with in_flight's min(2d - v, m);
    # a rank holds at most 2d chunk-microbatches (1F1B's d stage-microbatches); one version; no deadlock.
    for d, m in GRID:
        actions = pipeline_actions("zbv", num_stages=d, num_microbatches=m, num_batches=NUM_BATCHES)
        for r, rank in enumerate(actions):
            assert {a.stage_index for a in rank if a.kind != "S"} == set(chunks("zbv", r, d)) == {r, 2 * d - 1 - r}
            check_chunks(rank, schedule="zbv", num_stages=d, num_microbatches=m)
            for v in chunks("zbv", r, d):
                assert max_in_flight([a for a in rank if a.stage_index == v]) == in_flight("zbv", v, d, m)
            assert max_in_flight([a for a in rank if a.kind != "S"]) <= 2 * d
            assert max_versions_alive(rank, schedule="zbv", num_microbatches=m) == 1
        simulate(actions)


def test_zbv_whole_backwards_only_where_the_gradient_stays_on_the_rank_and_w_follows():
    # issue 46: B k of chunk d (on rank d-1, its input gradient handed to chunk d-1 in memory) runs the whole
    # backward when W k is the rank's next compute action; no other chunk's (its gradient is another rank's wait).
    one = rank_actions(
        "zbv", stage_index=1, num_stages=2, num_microbatches=8, first_batch=0, num_batches=1, batch_sends=False
    )
    assert whole_backwards(one, schedule="zbv", rank=1, num_stages=2) == {(2, k) for k in range(7)}  # 2B7 1B7 .. 2W7
    for d, m in GRID:
        for r, rank in enumerate(pipeline_actions("zbv", num_stages=d, num_microbatches=m, num_batches=2)):
            whole = whole_backwards(rank, schedule="zbv", rank=r, num_stages=d)
            assert {v for v, _ in whole} <= ({d} if r == d - 1 else set())
            compute = [a for a in rank if a.kind != "S"]
            assert len(whole) == sum(
                b == a._replace(kind="W") and a.stage_index == d for a, b in zip(compute, compute[1:])
            )
        zb1p = pipeline_actions("zb1p", num_stages=d, num_microbatches=m, num_batches=1)
        assert not any(whole_backwards(x, schedule="zb1p", rank=s, num_stages=d) for s, x in enumerate(zb1p))


def test_zbv_literal_table():
    # d=2, m=4: chunks 0 and 3 on rank 0 (the first layers and the loss), 1 and 2 on rank 1.
    actions = pipeline_actions("zbv", num_stages=2, num_microbatches=4, num_batches=1)
    assert render(simulate(actions)).splitlines() == [
        "stage 0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3 "
        "0S0   .",
        "stage 1:   . 1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3 "
        "1S0",
    ]


@pytest.mark.parametrize("d,m", [(2, 4), (2, 8), (3, 5), (4, 8), (4, 16)])
def test_zbv_idles_less_than_zb1p(d, m):
    # Same work: a chunk is half a stage (its F, B and W half a tick each, zb1p's one tick); S takes no time.
    def batch_time(schedule, unit):
        lists = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=1)
        return max(end for stage in timings(lists, lambda a: 0.0 if a.kind == "S" else unit) for _, end in stage)

    zbv, zb1p = batch_time("zbv", 0.5), batch_time("zb1p", 1.0)
    assert zb1p == 3 * m + (d - 1)
    assert 3 * m < zbv < zb1p


def _run_lowered(lowered, d):
    """Runs the ranks' lowered zbv lists as messages: WAIT_X k of chunk v blocks until the chunk that sends it (v-1
    for F, v+1 for B) has run SEND_X k; FREE_X i of chunk v asserts the receiving chunk has waited for our X sends up
    to i. Returns the (chunk, X, k) sends made."""
    sent, waited, pos = set(), set(), [0] * len(lowered)
    while any(p < len(x) for p, x in zip(pos, lowered)):
        moved = False
        for r, actions in enumerate(lowered):
            while pos[r] < len(actions):
                a, op = actions[pos[r]], comm_op(actions[pos[r]].kind)
                if op is not None and op[0] == WAIT:
                    src = a.stage_index - 1 if op[1] == FORWARD else a.stage_index + 1
                    if (src, op[1], a.index) not in sent:
                        break
                    waited.add((src, op[1], a.index))
                elif op is not None and op[0] == FREE:
                    mine = [k for (v, x, k) in sent if v == a.stage_index and x == op[1] and k <= a.index]
                    assert all((a.stage_index, op[1], k) in waited for k in mine), (r, a)
                elif op is not None and op[0] in (SEND, HOLD):
                    sent.add((a.stage_index, op[1], a.index))
                pos[r] += 1
                moved = True
        assert moved, f"deadlock at {[x[p] if p < len(x) else None for p, x in zip(pos, lowered)]}"
    return sent


@pytest.mark.parametrize("d,m", [(1, 2), (2, 2), (2, 4), (2, 8), (3, 6), (4, 8)])
def test_zbv_lowering_sends_each_tensor_once_and_frees_only_what_arrived(d, m):
    # Each chunk's communication lowered with its neighbouring chunks' lists (chunks d-1 and d on one rank: the
    # worker hands those over in memory), then put back in the rank's order: every wait is matched, nothing freed
    # early (a FREE is a blocking wait on gloo), no deadlock, over batches and for a run resumed at batch 5.
    for first_batch in (0, 5):
        lowered = [
            rank_actions(
                "zbv",
                stage_index=r,
                num_stages=d,
                num_microbatches=m,
                first_batch=first_batch,
                num_batches=2,
                batch_sends=False,
            )
            for r in range(d)
        ]
        for r, actions in enumerate(lowered):
            compute = [a for a in actions if a.kind in COMPUTE_KINDS]
            assert compute == shift_batches(
                pipeline_actions("zbv", num_stages=d, num_microbatches=m, num_batches=2)[r],
                first_batch=first_batch,
                num_microbatches=m,
            )
        sent = _run_lowered(lowered, d)
        ks = range(first_batch * m, (first_batch + 2) * m)
        assert sent == {(v, FORWARD, k) for v in range(2 * d - 1) for k in ks} | {
            (v, BACKWARD, k) for v in range(1, 2 * d) for k in ks
        }


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


def _calls_before_lowering(compute, *, num_stages, prev_actions, next_actions, batch_sends):
    """The P2P calls StageWorker made, in order, before the lowering (stage.py up to b88f0c3: run's
    next_k and defer_send, _recv's prefetch and pending receives, the receipts runner.py computed)."""
    s, d = compute[0].stage_index, num_stages
    first, last = s == 0, s == d - 1
    end = max(a.index for a in compute if a.kind == FORWARD) + 1
    receives = [(a.kind == FORWARD and not first) or (a.kind == BACKWARD and not last) for a in compute]
    proofs = {
        FORWARD: receipts(prev_actions, consumes=BACKWARD, signals=FORWARD) if s > 0 else {},
        BACKWARD: receipts(next_actions, consumes=FORWARD, signals=BACKWARD) if s < d - 1 else {},
    }
    pending, calls = set(), []

    def recv(kind, k, next_k):
        if (kind, k) in pending:
            pending.remove((kind, k))
        else:
            calls.append(("post", kind, k))
        if next_k is not None and not batch_sends:  # _prefetch = not p2p.batch_sends
            calls.append(("post", kind, next_k))
            pending.add((kind, next_k))
        calls.append(("wait", kind, k))
        calls.append(("release", "prev" if kind == FORWARD else "next", proofs[kind].get(k, -1)))

    for pos, a in enumerate(compute):
        next_k = a.index + 1 if a.index + 1 < end else None
        defer = pos + 1 < len(compute) and receives[pos + 1]
        if a.kind == FORWARD:
            if not first:
                recv(FORWARD, a.index, next_k)
            if not last:
                calls.append(("send", "next", a.index, defer and batch_sends))  # P2P defers only when batching
        elif a.kind == BACKWARD:
            if not last:
                recv(BACKWARD, a.index, next_k)
            if not first:
                calls.append(("send", "prev", a.index, defer and batch_sends))
    return calls


def _calls_of_lowered(lowered):
    """The P2P calls StageWorker._communicate makes for a lowered list."""
    calls = []
    for a in lowered:
        op = comm_op(a.kind)
        if op is None:
            continue
        peer = "next" if op[1] == FORWARD else "prev"  # where X's sends go
        if op[0] == RECV:
            calls.append(("post", op[1], a.index))
        elif op[0] == WAIT:
            calls.append(("wait", op[1], a.index))
        elif op[0] == FREE:
            calls.append(("release", peer, a.index))
        else:
            calls.append(("send", peer, a.index, op[0] == HOLD))
    return calls


def _without_empty_releases(calls):
    """``calls`` less the releases that free nothing, checked on a model of P2P's held sends: a send
    to a peer is held (with its microbatch as token) until a release with a bound >= its token."""
    held, bound, out = {"prev": [], "next": []}, {"prev": -1, "next": -1}, []
    for c in calls:
        if c[0] == "send":
            held[c[1]].append(c[2])
        elif c[0] == "release":
            freed = [t for t in held[c[1]] if t <= c[2]]
            held[c[1]] = [t for t in held[c[1]] if t > c[2]]
            if c[2] <= bound[c[1]]:
                assert not freed, c  # a release at or below an earlier one's bound finds nothing left
                continue
            bound[c[1]] = c[2]
        out.append(c)
    return out


@pytest.mark.parametrize("schedule", ["2bw", "flush", "zb1p", "gpipe"])
def test_lowering_makes_the_p2p_calls_the_runtime_made(schedule):
    # The refactor's contract: on every rank, gloo (prefetch) and NCCL (batched sends), fresh and
    # resumed, the lowered list makes the P2P calls of the run-time rule it replaced, in the same
    # order, less releases that free nothing (the rule called release(peer, -1) and repeats).
    for d in (2, 3, 4):
        for m in (d, 2 * d):
            for first_batch in (0, 5):
                compute = [
                    shift_batches(stage, first_batch=first_batch, num_microbatches=m)
                    for stage in pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=3)
                ]
                for batch_sends in (False, True):
                    for s in range(d):
                        lowered = rank_actions(
                            schedule,
                            stage_index=s,
                            num_stages=d,
                            num_microbatches=m,
                            first_batch=first_batch,
                            num_batches=3,
                            batch_sends=batch_sends,
                        )
                        case = (d, m, first_batch, batch_sends, s)
                        assert [a for a in lowered if a.kind in COMPUTE_KINDS] == compute[s], case
                        assert [lowered[st.at] for st in steps(lowered)] == compute[s], case
                        before = _calls_before_lowering(
                            compute[s],
                            num_stages=d,
                            prev_actions=compute[s - 1] if s > 0 else [],
                            next_actions=compute[s + 1] if s < d - 1 else [],
                            batch_sends=batch_sends,
                        )
                        assert _calls_of_lowered(lowered) == _without_empty_releases(before), case


def test_lowered_literal_lists():
    # d=2, m=2, two batches. gloo: each wait is preceded by the next receive's post; NCCL: a send
    # followed by a receiving action is held for that receive's post (HOLD); FREE where a wait
    # proves that the neighbour got our sends up to that microbatch.
    def lowered(batch_sends):
        return [
            " ".join(
                map(
                    str,
                    rank_actions(
                        "2bw",
                        stage_index=s,
                        num_stages=2,
                        num_microbatches=2,
                        first_batch=0,
                        num_batches=2,
                        batch_sends=batch_sends,
                    ),
                )
            )
            for s in range(2)
        ]

    assert lowered(False) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0WAIT_B0 0FREE_F0 0B0 0F2 0SEND_F2 0RECV_B2 0WAIT_B1 0FREE_F1 "
        "0B1 0S0 0F3 0SEND_F3 0RECV_B3 0WAIT_B2 0FREE_F2 0B2 0WAIT_B3 0FREE_F3 0B3 0S1",
        "1RECV_F0 1RECV_F1 1WAIT_F0 1F0 1B0 1SEND_B0 1RECV_F2 1WAIT_F1 1F1 1B1 1SEND_B1 1S0 1RECV_F3 1WAIT_F2 "
        "1FREE_B0 1F2 1B2 1SEND_B2 1WAIT_F3 1FREE_B1 1F3 1B3 1SEND_B3 1S1",
    ]
    assert lowered(True) == [
        "0F0 0SEND_F0 0F1 0HOLD_F1 0RECV_B0 0WAIT_B0 0FREE_F0 0B0 0F2 0HOLD_F2 0RECV_B1 0WAIT_B1 0FREE_F1 0B1 0S0 "
        "0F3 0HOLD_F3 0RECV_B2 0WAIT_B2 0FREE_F2 0B2 0RECV_B3 0WAIT_B3 0FREE_F3 0B3 0S1",
        "1RECV_F0 1WAIT_F0 1F0 1B0 1HOLD_B0 1RECV_F1 1WAIT_F1 1F1 1B1 1SEND_B1 1S0 1RECV_F2 1WAIT_F2 1FREE_B0 1F2 "
        "1B2 1HOLD_B2 1RECV_F3 1WAIT_F3 1FREE_B1 1F3 1B3 1SEND_B3 1S1",
    ]
    for text in lowered(False) + lowered(True):
        assert " ".join(str(Action.parse(a)) for a in text.split()) == text


def test_rendered_steps_mark_the_failing_action():
    # What a failing rank logs: its steps around the failing action, which is marked >so<.
    actions = rank_actions(
        "2bw", stage_index=1, num_stages=2, num_microbatches=2, first_batch=0, num_batches=50, batch_sends=False
    )
    text = render_steps(actions, mark=actions.index(Action(1, FORWARD, 40)), context=2)
    assert text.splitlines() == [
        "... 98 steps before",
        "step    98: B39 SEND_B39",
        "step    99: S19",
        "step   100: RECV_F41 WAIT_F40 FREE_B38 >F40<",
        "step   101: B40 SEND_B40",
        "step   102: RECV_F42 WAIT_F41 FREE_B39 F41",
        "... 147 steps after",
    ]


def test_show_schedule_prints_sends_and_receives(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[1] / "scripts" / "show_schedule.py"
    args = ["--schedule", "2bw", "--num-stages", "2", "--num-microbatches", "2", "--num-batches", "2"]
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    table = out[out.index("tick  stage 0                             stage 1") :]
    assert table[1:5] == [
        "   0  F0 SEND_F0                          .",
        "   1  F1 SEND_F1                          RECV_F0 RECV_F1 WAIT_F0 F0",
        "   2  .                                   B0 SEND_B0",
        "   3  RECV_B0 RECV_B1 WAIT_B0 FREE_F0 B0  RECV_F2 WAIT_F1 F1",
    ]
    assert len(table) == 1 + 12  # the header and the compute grid's 12 ticks


def test_show_schedule_refuses_fewer_microbatches_than_stages_for_2bw(monkeypatch, capsys):
    # issue 35: m < d under 2bw printed an invalid grid, then a ScheduleError traceback; training refuses m < d.
    script = Path(__file__).resolve().parents[1] / "scripts" / "show_schedule.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--num-stages", "4", "--num-microbatches", "2"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.splitlines() == [
        "show_schedule.py: --num-microbatches (2) must be >= --num-stages (4) for 2bw (two weight versions suffice "
        "only then; training refuses it too); raise --num-microbatches to 4 or more, or use --schedule flush"
    ]


def test_show_schedule_zb1p_idles_less_than_flush(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[1] / "scripts" / "show_schedule.py"
    idle = {}
    for schedule in ("flush", "zb1p"):
        args = ["--schedule", schedule, "--num-stages", "4", "--num-microbatches", "8", "--num-batches", "1"]
        monkeypatch.setattr(sys, "argv", [str(script), *args])
        runpy.run_path(str(script), run_name="__main__")
        out = capsys.readouterr().out.splitlines()
        line = next(x for x in out if "idle fraction" in x)
        idle[schedule] = float(line.split("idle fraction ")[1].split(";")[0])
        assert ("W" in out[0]) == (schedule == "zb1p")  # stage 0's row shows its W's
    assert idle == {"flush": 0.30, "zb1p": 0.14}


def test_show_schedule_zbv_names_each_actions_chunk(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[1] / "scripts" / "show_schedule.py"
    args = ["--schedule", "zbv", "--num-stages", "2", "--num-microbatches", "4", "--num-batches", "1"]
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("stage 0: 0F0 0F1 0F2 3F0 3B0 3W0") and out[1].startswith("stage 1:   . 1F0 2F0 1F1")
    assert "weight versions per stage: [1, 1]" in out[3]
    assert any("chunks 1 and 2, both on rank 1, hand their tensors over in memory" in x for x in out)
    assert any(x.startswith("   0  0F0 0SEND_F0") for x in out)  # the lowered table names chunks too
    monkeypatch.setattr(sys, "argv", [str(script), *args, "--batch-sends"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(script), run_name="__main__")
    assert "zbv is lowered for gloo only" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
@pytest.mark.parametrize("lead", [1, 2])
def test_forward_lead_keeps_the_invariants_over_grid(schedule, lead):
    """pipeline.forward_lead: stages before the last hold d - s + lead in flight (at most m), the last stage's list
    is 1F1B's, 2bw still never reads a version not yet made (the forwards before S t are batch t+1's), and the
    lowered lists run without a deadlock."""
    for d, m in _grid(schedule):
        plain = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=NUM_BATCHES)
        ahead = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=NUM_BATCHES, forward_lead=lead)
        assert ahead[-1] == plain[-1]
        for s, stage in enumerate(ahead):
            limit = in_flight(schedule, s, d, m, forward_lead=lead)
            assert limit == (min(d - s + lead, m) if s < d - 1 and d - s < m else min(d - s, m)), (d, m, s)
            check_stage(stage, num_microbatches=m, in_flight_limit=limit)
            assert max_in_flight(stage) == limit, (d, m, s)
            versions = max_versions_alive(stage, schedule=schedule, num_microbatches=m)
            assert versions == (2 if schedule == "2bw" else 1), (d, m, s)
            lowered = rank_actions(
                schedule,
                stage_index=s,
                num_stages=d,
                num_microbatches=m,
                first_batch=0,
                num_batches=NUM_BATCHES,
                batch_sends=False,
                forward_lead=lead,
            )
            assert [a for a in lowered if comm_op(a.kind) is None] == stage
        simulate(ahead)  # raises on deadlock


def test_forward_lead_hides_a_transfer_latency():
    """At d = 2 a transfer's latency c lengthens every 1F1B cycle (stage 0's backward waits for the gradient of the
    forward it just sent, here by c a microbatch); one forward ahead gives the gradient that forward's time to
    arrive, and the batch takes what it takes without latency."""
    cost = {FORWARD: 1.0, BACKWARD: 2.0}

    def batch_time(lead, latency):
        lists = pipeline_actions("2bw", num_stages=2, num_microbatches=8, num_batches=6, forward_lead=lead)
        t = timings(lists, lambda a: cost.get(a.kind, 0.5), latency=latency)
        steps_end = [end for a, (_, end) in zip(lists[0], t[0]) if a.kind not in cost]
        return (steps_end[-1] - steps_end[1]) / (len(steps_end) - 2)

    assert batch_time(0, 0.3) == pytest.approx(batch_time(0, 0.0) + 8 * 0.3)
    assert batch_time(1, 0.3) == pytest.approx(batch_time(0, 0.0))
