"""Pure: per-stage action lists (F/B/W/S) for 2bw, flush, zb1p, zbv and gpipe schedules, checked, lowered, simulated.

Indices used throughout (torchgpipe style):
    d: number of stages, s: stage index, m: microbatches per batch,
    t: batch index, k = t*m + j: global index of microbatch j of batch t.
An action is ``(stage_index, kind, index)`` printed as ``"1F3"``: kind F (forward of
microbatch k), B (backward of microbatch k) or S (optimizer step closing batch t). Under zb1p (zero bubble,
ZB-H1: Qi et al., ICLR 2024) a backward is split in two: B k computes only the gradient of the stage's input
(what stage s-1 waits for), W k the gradients of the weights (nobody waits: it fills the bubbles).

Under zbv (ZB-V, Qi et al. section 6; torch.distributed.pipelining's ScheduleZBVZeroBubble) the model is cut into
2d chunks (virtual stages v = 0..2d-1) and rank r runs two of them, r and 2d-1-r (a V: the first and the last chunk,
and so the loss, on rank 0). Its actions name the virtual stage (``"3F0"``: chunk 3's forward of microbatch 0); a
rank's list holds both chunks' actions and one S per batch (named by the rank's first chunk, r). Between chunks
d-1 and d, both on rank d-1, a transfer is a hand-off in the rank's memory.

``lower`` adds a stage's communication to its list as actions of their own (as
torch.distributed.pipelining's RECV_F/SEND_F/RECV_B/SEND_B), each ``OP_X`` with X the compute
kind whose tensors travel (F: activations, sent to s+1; B: input gradients, sent to s-1):

    RECV_X k   post the receive of microbatch k's tensors (its buffers; the transfer runs behind)
    WAIT_X k   wait for them (posted earlier): F k or B k uses them next
    FREE_X i   the wait just done proves the neighbour received our X sends up to microbatch i: free them
    SEND_X k   send what F k or B k produced
    HOLD_X k   the same send, held back and started in one batch with this stage's next RECV (NCCL)

printed like the compute kinds: ``"1RECV_F3"``, ``"0FREE_F2"``.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

FORWARD, BACKWARD, WEIGHT, STEP = "F", "B", "W", "S"
COMPUTE_KINDS = (FORWARD, BACKWARD, WEIGHT, STEP)
SPLIT_SCHEDULES = ("zb1p", "zbv")  # schedules whose backward is split into B (input gradient) and W (weight gradient)
V_SCHEDULES = ("zbv",)  # schedules whose ranks run two chunks each, r and 2d-1-r (``chunks``)
RECV, WAIT, FREE, SEND, HOLD = "RECV", "WAIT", "FREE", "SEND", "HOLD"
COMM_OPS = (RECV, WAIT, FREE, SEND, HOLD)
COMM_KINDS = tuple(f"{op}_{x}" for op in COMM_OPS for x in (FORWARD, BACKWARD))
_ACTION_RE = re.compile(r"^(\d+)([A-Z]+(?:_[FB])?)(\d+)$")


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
        if not match or match[2] not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"{text!r} is not an action like '1F3', '0B2', '1W2', '2S0' or '1RECV_F3'")
        return Action(int(match[1]), match[2], int(match[3]))


def comm_op(kind: str) -> Optional[Tuple[str, str]]:
    """``(op, X)`` of a lowered communication kind (``"RECV_F"`` -> ``("RECV", "F")``); None for F, B, W, S."""
    return tuple(kind.split("_")) if kind in COMM_KINDS else None


def lead(stage_index: int, num_stages: int, num_microbatches: int, forward_lead: int) -> int:
    """The forwards stage s runs ahead of 1F1B's d - s (``pipeline.forward_lead``): none on the last stage
    (its backward follows its forward at once), and no more than leave the stage at most m in flight."""
    s, d, m = stage_index, num_stages, num_microbatches
    return 0 if s == d - 1 else max(0, min(forward_lead, m - (d - s)))


def in_flight(schedule: str, stage_index: int, num_stages: int, num_microbatches: int, *, forward_lead: int = 0) -> int:
    """Most microbatches stage s holds forwarded but not yet backwarded (under zb1p and zbv: not yet through
    their W, whose tensors autograd keeps until then): min(d - s, m) under the 1F1B schedules (2bw and
    flush), plus ``lead`` on the stages before the last with pipeline.forward_lead; m under gpipe, min(d, m)
    on every stage under zb1p (ZB-H1: the first stage's 1F1B peak, so the peak over the stages is 1F1B's),
    min(2d - v, m) on chunk v under zbv (a rank's two chunks, r and 2d-1-r, hold at most 2d + 1 chunk-microbatches,
    a chunk being half a stage). The one rule behind the runtime's check, its activation swapping and the planner's
    memory model.
    """
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "zb1p":
        return min(num_stages, num_microbatches)
    if schedule == "zbv":  # ``stage_index``: a chunk v of 2d; a rank holds 2d - r + r + 1 = 2d + 1 chunk-microbatches
        return min(2 * num_stages - stage_index, num_microbatches)
    ahead = lead(stage_index, num_stages, num_microbatches, forward_lead)
    return min(num_stages - stage_index, num_microbatches) + ahead


def chunks(schedule: str, stage_index: int, num_stages: int) -> Tuple[int, ...]:
    """The (virtual) stages that rank ``stage_index`` of ``num_stages`` runs: itself, or under zbv r and 2d-1-r."""
    if schedule in V_SCHEDULES:
        return (stage_index, 2 * num_stages - 1 - stage_index)
    return (stage_index,)


def chunk_rank(v: int, num_stages: int) -> int:
    """Under a V schedule, the rank of ``num_stages`` that runs chunk ``v`` of 2d (``chunks``' inverse)."""
    return v if v < num_stages else 2 * num_stages - 1 - v


def whole_backwards(
    actions: Sequence[Action], *, schedule: str, rank: int, num_stages: int
) -> FrozenSet[Tuple[int, int]]:
    """The (virtual stage, k) whose B k runs the whole backward and W k nothing, on rank ``rank``'s list ``actions``
    (compute only or lowered): those of a chunk whose input gradient stays on the rank (under zbv chunk d, whose B
    hands chunk d-1 its gradient in memory) and whose W k is the rank's next compute action after B k. Running W's
    work at B then delays nothing another rank or chunk waits for, and saves the split's cost (a second autograd
    pass over the weights' branches, the graph kept between: about 10% of a backward, issue 46)."""
    if schedule not in V_SCHEDULES:
        return frozenset()
    compute = [a for a in actions if a.kind in (FORWARD, BACKWARD, WEIGHT)]
    return frozenset(
        (a.stage_index, a.index)
        for a, b in zip(compute, compute[1:])
        if a.kind == BACKWARD
        and b == a._replace(kind=WEIGHT)
        and 0 < a.stage_index
        and chunk_rank(a.stage_index - 1, num_stages) == rank == chunk_rank(a.stage_index, num_stages)
    )


def num_chunks(schedule: str, num_stages: int) -> int:
    """Virtual stages of a pipeline of ``num_stages`` ranks: 2d under zbv, else d."""
    return 2 * num_stages if schedule in V_SCHEDULES else num_stages


@functools.lru_cache(maxsize=32)
def _zero_bubble_v(num_stages: int, num_microbatches: int) -> Tuple[Tuple[Action, ...], ...]:
    """ZB-V's order of one batch's F, B and W on every rank (chunks r and 2d-1-r, microbatches 0..m-1): torch's
    ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (torch 2.13), its idle slots dropped. Warm-up:
    2(d - r) - 1 forwards of chunk r, then r pairs (F of chunk 2d-1-r, F of chunk r), then d - r triples F, B, W
    of chunk 2d-1-r; steady: F, B, W of chunk r then of chunk 2d-1-r; cool-down: the B's left (with chunk r's W's
    between them), then the W's left. Computed for max(2d - 1, m) microbatches, those past m dropped."""
    d, m = num_stages, num_microbatches
    n = max(2 * d - 1, m)
    lists = []
    for r in range(d):
        c0, c1 = r, 2 * d - 1 - r
        ops: List[Action] = []
        cnt = {(c, x): 0 for c in (c0, c1) for x in (FORWARD, BACKWARD, WEIGHT)}

        def add(c: int, x: str, ops: List[Action] = ops, cnt: dict = cnt) -> None:
            ops.append(Action(c, x, cnt[(c, x)]))
            cnt[(c, x)] += 1

        for _ in range(2 * (d - r) - 1):
            add(c0, FORWARD)
        for _ in range(r):
            add(c1, FORWARD)
            add(c0, FORWARD)
        for _ in range(d - r):
            add(c1, FORWARD), add(c1, BACKWARD), add(c1, WEIGHT)
        while cnt[(c1, FORWARD)] < cnt[(c0, FORWARD)] or cnt[(c0, FORWARD)] < n:
            if cnt[(c0, FORWARD)] < n:
                add(c0, FORWARD)
            add(c0, BACKWARD), add(c0, WEIGHT), add(c1, FORWARD), add(c1, BACKWARD), add(c1, WEIGHT)
        for _ in range(r):
            add(c0, BACKWARD), add(c1, BACKWARD)
        for _ in range(d - r):
            add(c0, BACKWARD), add(c0, WEIGHT)
        for c in (c1, c0):
            while cnt[(c, WEIGHT)] < cnt[(c, BACKWARD)]:
                add(c, WEIGHT)
        lists.append(tuple(a for a in ops if a.index < m))
    return tuple(lists)


@functools.lru_cache(maxsize=32)
def _zero_bubble_h1(num_stages: int, num_microbatches: int) -> Tuple[Tuple[Action, ...], ...]:
    """ZB-H1's order of one batch's F, B and W on every stage (microbatches 0..m-1), found by running
    the stages greedily in unit time (F, B and W one tick each): a stage does its next F if the input
    arrived, at most d - s are forwarded and not backwarded (1F1B's bound) and at most ``in_flight``
    forwarded and not through W; else the next B if its gradient arrived (B is what stage s-1 waits
    for); else its oldest pending W; else it idles. W's wait wherever 1F1B would idle for a gradient
    and fill those ticks. A batch then takes 3m + d - 1 ticks, ZB-H1's (d-1)(F + B - W) bubble, against
    1F1B's 3m + 3(d-1) (``tests/test_schedule.py`` checks it over a grid; the priority of F over B
    is what reaches it: B first leaves the last W's of the first stage idling, 3m + 2(d-1) at d=4, m=8).
    """
    d, m = num_stages, num_microbatches
    nf, nb, nw = [0] * d, [0] * d, [0] * d
    done: Dict[Tuple[int, str, int], int] = {}  # (stage, kind, k) -> the tick it finished
    lists: List[List[Action]] = [[] for _ in range(d)]
    tick = 0
    while any(n < m for n in nw):
        chosen = []
        for s in range(d):
            dep_b = done.get((s + 1, BACKWARD, nb[s]), tick + 1) if s < d - 1 else 0
            dep_f = done.get((s - 1, FORWARD, nf[s]), tick + 1) if s > 0 else 0
            if nf[s] < m and dep_f <= tick and nf[s] - nb[s] < d - s and nf[s] - nw[s] < in_flight("zb1p", s, d, m):
                chosen.append(Action(s, FORWARD, nf[s]))
            elif nb[s] < nf[s] and dep_b <= tick:
                chosen.append(Action(s, BACKWARD, nb[s]))
            elif nw[s] < nb[s]:
                chosen.append(Action(s, WEIGHT, nw[s]))
            else:
                chosen.append(None)
        for a in chosen:
            if a is not None:
                count = {FORWARD: nf, BACKWARD: nb, WEIGHT: nw}[a.kind]
                count[a.stage_index] += 1
                done[(a.stage_index, a.kind, a.index)] = tick + 1
                lists[a.stage_index].append(a)
        tick += 1
    return tuple(tuple(stage) for stage in lists)


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
    """Puts S t right after the backward of the last microbatch of batch t (its W, where backwards are split)."""
    last = WEIGHT if any(a.kind == WEIGHT for a in actions) else BACKWARD
    out = []
    for a in actions:
        out.append(a)
        if a.kind == last and (a.index + 1) % num_microbatches == 0:
            out.append(Action(stage_index, STEP, a.index // num_microbatches))
    return out


def stage_actions(
    schedule: str,
    *,
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
    num_batches: int,
    forward_lead: int = 0,
) -> List[Action]:
    """The ordered actions of one stage for ``num_batches`` batches.

    2bw runs 1F1B over all batches as one stream (no flush: batch t+1's warm-up forwards
    overlap batch t's last backwards); flush runs 1F1B per batch; zb1p ZB-H1 per batch
    (``_zero_bubble_h1``: backwards split into B and W); gpipe all forwards then all backwards per
    batch. Every schedule steps once per batch, right after its last backward (zb1p: its last W).
    ``forward_lead`` (2bw and flush): the stages before the last keep ``lead`` more microbatches forwarded
    (d - s + lead): each backward's gradient then has a forward's time to arrive, instead of none. Under 2bw
    the forwards run before S t are still batch t+1's (d - s + lead <= m), which reads W(t), not S t's W(t+1).

    Raises:
        ValueError: unknown schedule.
    """
    s, d, m = stage_index, num_stages, num_microbatches
    ahead = lead(s, d, m, forward_lead) if schedule in ("2bw", "flush") else 0
    if schedule == "2bw":
        actions = _one_f_one_b(s, 0, num_batches * m, d - s + ahead)
    elif schedule == "flush":
        actions = [a for t in range(num_batches) for a in _one_f_one_b(s, t * m, m, d - s + ahead)]
    elif schedule == "zb1p":
        one = _zero_bubble_h1(d, m)[s]
        actions = [a._replace(index=t * m + a.index) for t in range(num_batches) for a in one]
    elif schedule == "zbv":  # a batch's work ends with W's of both chunks: S t closes it
        one = _zero_bubble_v(d, m)[s]
        batches = [[b._replace(index=t * m + b.index) for b in one] + [Action(s, STEP, t)] for t in range(num_batches)]
        return [a for batch in batches for a in batch]
    elif schedule == "gpipe":
        actions = [
            Action(s, kind, t * m + j) for t in range(num_batches) for kind in (FORWARD, BACKWARD) for j in range(m)
        ]
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use one of 2bw, flush, zb1p, zbv, gpipe")
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


def _receives(a: Action, num_stages: int) -> bool:
    """Whether compute action ``a`` needs a tensor from a neighbour: F on s > 0, B on s < d-1."""
    return (a.kind == FORWARD and a.stage_index > 0) or (a.kind == BACKWARD and a.stage_index < num_stages - 1)


def lower(
    actions: Sequence[Action],
    *,
    num_stages: int,
    prev_actions: Sequence[Action] = (),
    next_actions: Sequence[Action] = (),
    batch_sends: bool,
) -> List[Action]:
    """Adds one stage's communication to its compute list (the kinds in the module docstring).

    Around each F or B (forwards and backwards each run in microbatch order, ``check_stage``):
    a receive is posted (RECV) unless posted before, waited on (WAIT) and its receipt used
    (FREE); what the compute produced is sent (SEND or HOLD). The choices the runtime used to
    make as it went are data here:

    - prefetch (``batch_sends`` False, gloo, where each transfer progresses on its own): each
      WAIT k is preceded by the RECV of k+1 of the same kind, so the next transfer overlaps compute;
    - batched sends (``batch_sends`` True, NCCL, where the transfers between two ranks run in
      order): receives are posted only when needed, and a send whose next compute action receives
      is a HOLD, started in one batch with that receive (Megatron's send_forward_recv_backward);
    - receipts: WAIT of microbatch j from a neighbour proves it received our sends up to the last
      one it consumed before sending j (``receipts`` of ``prev_actions``/``next_actions``, the
      neighbours' compute lists); a FREE follows the wait when that frees something new.

    Returns:
        the lowered list: every compute action of ``actions``, in order, with its communication.
    """
    if not actions:
        return []
    d = num_stages
    end = max((a.index for a in actions if a.kind == FORWARD), default=-1) + 1  # a resumed run starts past 0
    proofs = {
        FORWARD: receipts(prev_actions, consumes=BACKWARD, signals=FORWARD),  # prev's F j frees our B sends
        BACKWARD: receipts(next_actions, consumes=FORWARD, signals=BACKWARD),  # next's B j frees our F sends
    }
    freed = {BACKWARD: -1, FORWARD: -1}  # by kind of our sends: the highest microbatch freed so far
    posted = set()
    out: List[Action] = []
    for pos, a in enumerate(actions):
        s, k, x = a.stage_index, a.index, a.kind
        if _receives(a, d):
            if (x, k) in posted:
                posted.remove((x, k))
            else:
                out.append(Action(s, f"{RECV}_{x}", k))
            if not batch_sends and k + 1 < end:
                out.append(Action(s, f"{RECV}_{x}", k + 1))
                posted.add((x, k + 1))
            out.append(Action(s, f"{WAIT}_{x}", k))
            ours = BACKWARD if x == FORWARD else FORWARD
            proof = proofs[x].get(k, -1)
            if proof > freed[ours]:
                out.append(Action(s, f"{FREE}_{ours}", proof))
                freed[ours] = proof
        out.append(a)
        if (x == FORWARD and s < d - 1) or (x == BACKWARD and s > 0):
            hold = batch_sends and pos + 1 < len(actions) and _receives(actions[pos + 1], d)
            out.append(Action(s, f"{HOLD if hold else SEND}_{x}", k))
    return out


class Step(NamedTuple):
    """One compute action of a lowered list and the communication lowered around it:
    ``actions[start:stop]``, ``compute`` at ``actions[at]``."""

    start: int
    at: int
    stop: int
    compute: Action


def steps(actions: Sequence[Action]) -> List[Step]:
    """Splits a lowered list into steps: the receives before a compute action, it, and its sends."""
    out: List[Step] = []
    start, at = 0, None
    for pos, a in enumerate(actions):
        op = comm_op(a.kind)
        if at is not None and (op is None or op[0] not in (SEND, HOLD)):
            out.append(Step(start, at, pos, actions[at]))
            start, at = pos, None
        if op is None:
            assert at is None, f"{a} at {pos}: two compute actions in one step"
            at = pos
    if at is not None:
        out.append(Step(start, at, len(actions), actions[at]))
    assert (out[-1].stop if out else 0) == len(actions), "a lowered list must end with a compute action or its sends"
    return out


def rank_actions(
    schedule: str,
    *,
    stage_index: int,
    num_stages: int,
    num_microbatches: int,
    first_batch: int,
    num_batches: int,
    batch_sends: bool,
    forward_lead: int = 0,
) -> List[Action]:
    """What one rank runs: its stage's actions for batches ``first_batch .. first_batch + num_batches - 1``,
    checked (``check_stage`` with the ``in_flight`` bound), shifted to those batches and lowered
    with the neighbours' lists (``lower``).

    Raises:
        ScheduleError: the stage's compute list breaks a rule.
    """
    s, d, m = stage_index, num_stages, num_microbatches
    if schedule in V_SCHEDULES:
        return _rank_actions_v(schedule, s, d, m, first_batch=first_batch, num_batches=num_batches)

    def compute(stage: int) -> List[Action]:
        acts = stage_actions(
            schedule,
            stage_index=stage,
            num_stages=d,
            num_microbatches=m,
            num_batches=num_batches,
            forward_lead=forward_lead,
        )
        if stage == s:
            limit = in_flight(schedule, s, d, m, forward_lead=forward_lead)
            check_stage(acts, num_microbatches=m, in_flight_limit=limit)
        return shift_batches(acts, first_batch=first_batch, num_microbatches=m)

    return lower(
        compute(s),
        num_stages=d,
        prev_actions=compute(s - 1) if s > 0 else (),
        next_actions=compute(s + 1) if s < d - 1 else (),
        batch_sends=batch_sends,
    )


def check_chunks(actions: Sequence[Action], *, schedule: str, num_stages: int, num_microbatches: int) -> None:
    """``check_stage`` on each chunk of a rank's list (its actions of one virtual stage and the S's), with the
    chunk's ``in_flight`` bound; for a schedule of one chunk a rank, on the list.

    Raises:
        ScheduleError: the first action that breaks a rule.
    """
    d, m = num_stages, num_microbatches
    for v in sorted({a.stage_index for a in actions if a.kind != STEP}):
        own = [a for a in actions if a.stage_index == v or a.kind == STEP]
        check_stage(own, num_microbatches=m, in_flight_limit=in_flight(schedule, v, d, m))


def _rank_actions_v(schedule: str, r: int, d: int, m: int, *, first_batch: int, num_batches: int) -> List[Action]:
    """``rank_actions`` of a V schedule: each chunk's actions lowered (``lower``, a pipeline of 2d chunks, sends
    not batched) with the neighbouring chunks' lists, then put back in the rank's order, step by step."""
    lists = pipeline_actions(schedule, num_stages=d, num_microbatches=m, num_batches=num_batches)
    check_chunks(lists[r], schedule=schedule, num_stages=d, num_microbatches=m)
    lists = [shift_batches(x, first_batch=first_batch, num_microbatches=m) for x in lists]
    by_chunk: Dict[int, List[Action]] = collections.defaultdict(list)
    for rank_list in lists:
        for a in rank_list:
            if a.kind != STEP:
                by_chunk[a.stage_index].append(a)
    stepped: Dict[Action, List[Action]] = {}
    for v in chunks(schedule, r, d):
        lowered = lower(
            by_chunk[v],
            num_stages=2 * d,
            prev_actions=by_chunk.get(v - 1, ()),
            next_actions=by_chunk.get(v + 1, ()),
            batch_sends=False,
        )
        stepped.update({st.compute: lowered[st.start : st.stop] for st in steps(lowered)})
    return [b for a in lists[r] for b in stepped.get(a, [a])]


def pipeline_actions(
    schedule: str, *, num_stages: int, num_microbatches: int, num_batches: int, forward_lead: int = 0
) -> List[List[Action]]:
    """Action lists of all stages, stage 0 first."""
    return [
        stage_actions(
            schedule,
            stage_index=s,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            num_batches=num_batches,
            forward_lead=forward_lead,
        )
        for s in range(num_stages)
    ]


def max_in_flight(actions: Sequence[Action]) -> int:
    """Most microbatches forwarded but not yet backwarded at any point of one stage's list (where
    backwards are split, not yet through their W: autograd holds their tensors until then)."""
    release = WEIGHT if any(a.kind == WEIGHT for a in actions) else BACKWARD
    live, peak = 0, 0
    for a in actions:
        live += 1 if a.kind == FORWARD else -1 if a.kind == release else 0
        peak = max(peak, live)
    return peak


def check_stage(actions: Sequence[Action], *, num_microbatches: int, in_flight_limit: int) -> None:
    """Checks one stage: each microbatch forwarded once then backwarded once, in microbatch
    order (a list with W actions: each B k followed by W k, W's in microbatch order too, or none at
    all); at most ``in_flight_limit`` in flight (``max_in_flight``'s count); one step per batch,
    after its last backward (its last W).

    Raises:
        ScheduleError: the first action that breaks a rule.
    """
    split = any(a.kind == WEIGHT for a in actions)
    done: Dict[str, List[int]] = {FORWARD: [], BACKWARD: [], WEIGHT: [], STEP: []}
    last = done[WEIGHT] if split else done[BACKWARD]  # the work a step closes, and that frees a microbatch
    before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}
    for pos, a in enumerate(actions):
        where = f"action {pos} ({a}) of stage {a.stage_index}"
        if a.kind == FORWARD and a.index != len(done[FORWARD]):
            raise ScheduleError(f"{where}: forwards must run in microbatch order, expected F{len(done[FORWARD])}")
        if a.kind in before and (a.index != len(done[a.kind]) or a.index >= len(done[before[a.kind]])):
            what = "backward before its forward" if a.kind == BACKWARD else "weight gradient before its backward"
            raise ScheduleError(f"{where}: {what} or out of microbatch order")
        if a.kind == STEP and (a.index != len(done[STEP]) or len(last) != (a.index + 1) * num_microbatches):
            raise ScheduleError(f"{where}: a step must follow the last backward of its batch")
        done[a.kind].append(a.index)
        if len(done[FORWARD]) - len(last) > in_flight_limit:
            raise ScheduleError(
                f"{where}: {len(done[FORWARD]) - len(last)} microbatches in flight, limit {in_flight_limit}"
            )
    complete = len(done[BACKWARD]) == len(done[FORWARD]) and len(last) == len(done[FORWARD])
    if not complete or len(done[STEP]) * num_microbatches != len(last):
        raise ScheduleError(f"stage {actions[0].stage_index if actions else '?'}: the list ends with work left undone")


def _dependency(a: Action, num_stages: int) -> Optional[Tuple[int, str, int]]:
    """The action on another stage that ``a`` waits for: F k on stage s waits for F k on s-1 (its
    input), B k on s < d-1 for B k on s+1 (its output's gradient); the last stage's backward needs
    only its own forward, S nothing."""
    s = a.stage_index
    if a.kind == FORWARD and s > 0:
        return (s - 1, FORWARD, a.index)
    if a.kind == BACKWARD and s < num_stages - 1:
        return (s + 1, BACKWARD, a.index)
    return None


def timings(
    actions_per_stage: Sequence[Sequence[Action]], duration: Callable[[Action], float], *, latency: float = 0.0
) -> List[List[Tuple[float, float]]]:
    """Runs the stages' compute lists event by event: each action starts once its stage is free
    and the action it depends on (``_dependency``; its transfer included in that one's
    ``duration``) has finished, ``latency`` before (a transfer's delay on the wire, which keeps
    the receiver waiting but not the sender: pipeline.forward_lead hides it).

    Returns:
        ``[stage][position] -> (start, end)``.

    Raises:
        ScheduleError: a deadlock (no stage can move, work remains), with the grid of what ran.
    """
    d = len(actions_per_stage)
    # the virtual stages (zbv: 2d chunks on d ranks, each list one rank's); else one per list
    num_virtual = max((a.stage_index for stage in actions_per_stage for a in stage), default=-1) + 1
    pos, clock = [0] * d, [0.0] * d
    done: Dict[tuple, float] = {}  # (stage, kind, index) -> when it finished
    times: List[List[Tuple[float, float]]] = [[] for _ in range(d)]
    remaining = sum(len(a) for a in actions_per_stage)
    while remaining:
        progressed = False
        for s in range(d):
            while pos[s] < len(actions_per_stage[s]):
                a = actions_per_stage[s][pos[s]]
                dep = _dependency(a, num_virtual)
                ready = done.get(dep) if dep is not None else 0.0
                if ready is None:
                    break
                start = max(clock[s], ready + (latency if dep is not None else 0.0))
                clock[s] = start + duration(a)
                done[(a.stage_index, a.kind, a.index)] = clock[s]
                times[s].append((start, clock[s]))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [str(actions_per_stage[s][pos[s]]) for s in range(d) if pos[s] < len(actions_per_stage[s])]
            ran = [list(stage[: len(t)]) for stage, t in zip(actions_per_stage, times)]
            raise ScheduleError(f"deadlock at time {max(clock)}: blocked {blocked}\n{render(_grid(ran, times))}")
    return times


def _grid(actions_per_stage: Sequence[Sequence[Action]], times: Sequence[Sequence[Tuple[float, float]]]):
    """grid[tick][stage] from unit-time ``timings``."""
    ticks = max((int(end) for t in times for _, end in t), default=0)
    grid: List[List[Optional[Action]]] = [[None] * len(actions_per_stage) for _ in range(ticks)]
    for s, (stage, t) in enumerate(zip(actions_per_stage, times)):
        for a, (start, _) in zip(stage, t):
            grid[int(start)][s] = a
    return grid


def simulate(actions_per_stage: Sequence[Sequence[Action]]) -> List[List[Optional[Action]]]:
    """Runs the stages' lists in unit-time clock ticks (``timings`` with every F, B, W and S one tick
    long); lowered lists run their compute, communication taking no time of its own.

    Returns:
        grid[tick][stage]: the action run then, or None for an idle stage.

    Raises:
        ScheduleError: a deadlock (no stage can move, work remains), with the grid so far.
    """
    compute = [[a for a in stage if a.kind in COMPUTE_KINDS] for stage in actions_per_stage]
    return _grid(compute, timings(compute, lambda a: 1.0))


def render(grid: Sequence[Sequence[Optional[Action]]]) -> str:
    """Step-by-rank text grid: one row per stage, one column per tick, '.' for idle."""
    if not grid:
        return "(empty)"
    d = len(grid[0])
    # a rank that runs several chunks (zbv) shows each action with its chunk: "3F0"
    named = any(a is not None and a.kind != STEP and a.stage_index != s for row in grid for s, a in enumerate(row))
    text = str if named else (lambda a: f"{a.kind}{a.index}")
    width = max(len(text(a)) for row in grid for a in row if a is not None)
    lines = []
    for s in range(d):
        cells = [(text(a) if a is not None else ".").rjust(width) for a in (row[s] for row in grid)]
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)


def _cell(actions: Sequence[Action], mark: Optional[int] = None, offset: int = 0, named: bool = False) -> str:
    """Actions without their stage (``named``: with it, as a rank of two chunks needs), ``>X<`` around the one at
    position ``mark`` (positions from ``offset``)."""
    text = [str(a) if named else f"{a.kind}{a.index}" for a in actions]
    return " ".join(f">{x}<" if offset + i == mark else x for i, x in enumerate(text))


def _named(actions: Sequence[Action]) -> bool:
    """Whether a rank's list holds several chunks' actions (zbv), so that a cell must name each one's chunk."""
    return len({a.stage_index for a in actions if a.kind != STEP}) > 1


def render_lowered(lowered_per_stage: Sequence[Sequence[Action]]) -> str:
    """Tick-by-stage table of lowered lists: one row per tick of ``simulate``, each stage's cell the
    step (its compute action with the communication lowered around it) that runs then."""
    compute = [[a for a in stage if a.kind in COMPUTE_KINDS] for stage in lowered_per_stage]
    grid = simulate(compute)
    cells = [[] for _ in grid]
    for s, stage in enumerate(lowered_per_stage):
        tick_of = {row[s]: t for t, row in enumerate(grid) if row[s] is not None}
        column = ["."] * len(grid)
        for step in steps(stage):
            column[tick_of[step.compute]] = _cell(stage[step.start : step.stop], named=_named(stage))
        for t, c in enumerate(column):
            cells[t].append(c)
    widths = [max([len(f"stage {s}")] + [len(row[s]) for row in cells]) for s in range(len(lowered_per_stage))]
    header = "tick  " + "  ".join(f"stage {s}".ljust(w) for s, w in enumerate(widths))
    rows = [f"{t:4d}  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) for t, row in enumerate(cells)]
    return "\n".join([header.rstrip()] + [r.rstrip() for r in rows])


def render_steps(actions: Sequence[Action], *, mark: Optional[int] = None, context: Optional[int] = None) -> str:
    """One rank's lowered list, one step per line (``steps``), the action at position ``mark``
    shown ``>like this<``; with ``context``, only that many steps either side of the marked one."""
    all_steps = steps(actions)
    lines = []
    for n, st in enumerate(all_steps):
        lines.append(f"step {n:5d}: {_cell(actions[st.start : st.stop], mark, st.start, _named(actions))}")
    if mark is not None and context is not None:
        at = next((n for n, st in enumerate(all_steps) if st.start <= mark < st.stop), len(all_steps) - 1)
        lo, hi = max(0, at - context), min(len(lines), at + context + 1)
        before, after = lo, len(lines) - hi
        lines = (
            ([f"... {before} step{'s' * (before > 1)} before"] if before else [])
            + lines[lo:hi]
            + ([f"... {after} step{'s' * (after > 1)} after"] if after else [])
        )
    return "\n".join(lines)
