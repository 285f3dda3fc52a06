"""Pipeline timelines: per-rank spans of F, B, step, send, recv and all-reduce; Chrome trace, Gantt chart, bubble.

Pure (no torch.distributed): a stage records spans with ``Recorder``; rank 0 turns the
gathered spans into a Chrome trace (one process row per rank, opens in Perfetto), a PNG
Gantt chart and the measured bubble fraction.

Clock: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process of a
host, so the ranks of one node line up exactly. Ranks on different nodes have unrelated
monotonic clocks: their rows are then each right in themselves but offset from each other
(bubble fractions, which are per rank, stay right).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

# forward, backward (under zb1p its input-gradient part), weight gradient (zb1p), optimizer step: the rank's own work
COMPUTE_KINDS = ("F", "B", "W", "S")
COMM_KINDS = ("send", "recv", "allreduce", "loss")  # posting a send; waiting on a receive, an all-reduce, a loss
HOST_KINDS = ("data", "hooks")  # the feed's microbatch (inside F); on_close/on_step (logging, checkpoints, validation)
# Work on a thread of the rank's own beside its training thread: the host optimizer step of swap.host_step=background,
# which overlaps the next batch; not the rank's compute (the bubble) and not in ``breakdown``'s training-thread time.
BACKGROUND_KINDS = ("hoststep",)
# Where a rank's traced wall time goes (``breakdown``): each second in exactly one.
BREAKDOWN = ("compute", "recv", "send", "step", "allreduce", "loss", "data", "hooks", "dispatch")
COLORS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "W": "#8fd19e",
    "S": "#c44e52",
    "send": "#8c8c8c",
    "recv": "#dd8452",
    "allreduce": "#8172b3",
    "loss": "#937860",
    "data": "#da8bc3",
    "hooks": "#ccb974",
    "hoststep": "#64b5cd",
}


class Span(NamedTuple):
    kind: str  # one of COMPUTE_KINDS, COMM_KINDS, HOST_KINDS or BACKGROUND_KINDS
    index: int  # microbatch k for F, B and their transfers; batch t for S, allreduce and loss
    start: float  # perf_counter seconds
    end: float


class Recorder:
    """Spans of one rank for the traced batches ``first_step .. first_step + num_steps - 1``.

    Recording is on from the end of step ``first_step - 1`` (from the start if it is 0) to the
    end of step ``first_step + num_steps - 1``: on every rank, that window holds the actions
    that run between those steps (in 1F1B steady state, m forwards, m backwards and one step
    per batch). Callers check ``on`` before timing anything, so a recorder that is off (or
    no recorder) costs one attribute read per action.
    """

    def __init__(self, *, first_step: int, num_steps: int, run_start: int = 0):
        self.first_step, self.num_steps = first_step, num_steps
        self.on = first_step == run_start  # run_start: the first step this run trains (resumed runs start later)
        self.spans: List[Span] = []
        self.window: Optional[List[float]] = [time.perf_counter()] if self.on else None  # [start, end]

    def add(self, kind: str, index: int, start: float, end: float) -> None:
        self.spans.append(Span(kind, index, start, end))

    def step_done(self, t: int, now: float) -> None:
        """Called at the end of optimizer step ``t``: switches recording on or off."""
        if t == self.first_step - 1:
            self.on, self.window = True, [now]
        elif t == self.first_step + self.num_steps - 1 and self.on:
            self.on = False
            self.window.append(now)


def bubble_fraction(spans: Sequence[Span], window: Sequence[float]) -> float:
    """Share of ``window`` in which the rank did no work of its own: the pipeline bubble.

    Work is the union of F, B and S spans, less the all-reduce waits (made inside S)."""
    start, end = window
    busy = sum(
        min(s.end, end) - max(s.start, start)
        for s in spans
        if s.kind in COMPUTE_KINDS and s.end > start and s.start < end
    )
    busy -= sum(s.end - s.start for s in spans if s.kind == "allreduce" and start <= s.start < end)
    return max(0.0, 1.0 - busy / (end - start))


def breakdown(spans: Sequence[Span], window: Sequence[float]) -> Dict[str, float]:
    """Seconds of ``window`` by what the rank did (``BREAKDOWN``), summing to its length.

    compute: F and B less the sends and the feed inside them (receives posted after a compute are
    counted in it); recv: waiting on a receive before a compute; send: posting sends; step: S less
    its all-reduce and agreement waits (allreduce); loss: rank 0 collecting batch losses; data: the
    feed; hooks: logging, checkpoints and validation between steps; dispatch: the rest, the host's
    cost of running the action list (Python between actions)."""
    start, end = window
    inside = [s for s in spans if start <= s.start < end]

    def total(*kinds: str) -> float:
        return sum(s.end - s.start for s in inside if s.kind in kinds)

    out = {
        "recv": total("recv"),
        "send": total("send"),
        "allreduce": total("allreduce"),
        "loss": total("loss"),
        "data": total("data"),
        "hooks": total("hooks"),
    }
    out["compute"] = total("F", "B", "W") - out["send"] - out["data"]
    out["step"] = total("S") - out["allreduce"]
    out["dispatch"] = max(0.0, (end - start) - sum(out.values()))
    return {k: out[k] for k in BREAKDOWN}


def bubble_summary(traces: Sequence[dict]) -> Dict[str, object]:
    """The measured bubble of each rank and overall (idle time over all ranks' traced time)."""
    per_rank = [bubble_fraction(tr["spans"], tr["window"]) for tr in traces]
    lengths = [tr["window"][1] - tr["window"][0] for tr in traces]
    return {
        "bubble_fraction": sum(f * n for f, n in zip(per_rank, lengths)) / sum(lengths),
        "bubble_fraction_per_rank": per_rank,
    }


def chrome_trace(traces: Sequence[dict], *, title: str = "") -> dict:
    """Chrome trace event JSON: one process per rank (named by stage), a compute, a comm and a host thread, and a
    host optimizer thread (the background host step's spans: they overlap the compute thread's).

    Each element of ``traces``: {"rank", "stage", "replica", "spans", "window"}. Times are
    microseconds from the earliest traced span of any rank."""
    t0 = min(tr["window"][0] for tr in traces)
    events: List[dict] = []
    for tr in traces:
        pid = tr["rank"]
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "args": {"name": f"rank {pid}: stage {tr['stage']}, replica {tr['replica']}"},
            }
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for tid, name in ((0, "compute"), (1, "comm"), (2, "host"), (3, "host optimizer")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        for s in tr["spans"]:
            events.append(
                {
                    "ph": "X",
                    "name": f"{s.kind}{s.index}",
                    "cat": s.kind,
                    "pid": pid,
                    "tid": _thread_of(s.kind),
                    "ts": (s.start - t0) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {"index": s.index},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def _thread_of(kind: str) -> int:
    """The Chrome trace thread (``chrome_trace``'s tid) of a span kind."""
    if kind in COMPUTE_KINDS:
        return 0
    return 2 if kind in HOST_KINDS else 3 if kind in BACKGROUND_KINDS else 1


def plot_timeline(traces: Sequence[dict], path: Path, *, title: str = "") -> None:
    """A Gantt chart of the traced steps: one row per rank (compute in the middle, comm below, a background host
    step above) as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from pipedream2bw.io.fileio import atomic_open

    t0 = min(tr["window"][0] for tr in traces)
    t1 = max(tr["window"][1] for tr in traces)
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.7 * len(traces)))
    for row, tr in enumerate(traces):
        y = len(traces) - 1 - row  # rank 0 on top
        for s in tr["spans"]:
            compute = s.kind in COMPUTE_KINDS
            x, width = (s.start - t0) * 1e3, max((s.end - s.start) * 1e3, 1e-3)
            ybar, height = (
                (y + 0.3, 0.5) if compute else (y + 0.84, 0.12) if s.kind in BACKGROUND_KINDS else (y + 0.05, 0.2)
            )
            ax.broken_barh(
                [(x, width)],
                (ybar, height),
                facecolors=COLORS[s.kind],
                edgecolor="white" if compute else "none",
                linewidth=0.3,
            )
            if compute and s.kind != "S" and width > (t1 - t0) * 1e3 / 80:
                ax.text(
                    x + width / 2, ybar + height / 2, str(s.index), ha="center", va="center", fontsize=6, color="white"
                )
    ax.set_yticks([len(traces) - 1 - r + 0.5 for r in range(len(traces))])
    ax.set_yticklabels([f"rank {tr['rank']} (stage {tr['stage']})" for tr in traces])
    ax.set_xlabel("ms")
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_title(title)
    ax.legend(
        handles=[Patch(color=COLORS[k], label=k) for k in COLORS],
        ncol=len(COLORS),
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.3 / len(traces)),
        frameon=False,
    )
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)
