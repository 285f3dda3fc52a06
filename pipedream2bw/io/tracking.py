"""Rank 0's record of a run: metrics.jsonl, loss.png, the progress bar, and wandb (offline by default).

``MetricsLog`` appends one JSON line per step (and one per validation pass) to the run directory's
``metrics.jsonl``; ``plot_losses`` draws ``loss.png``. One wandb run per training job: the loss and
throughput as the run goes, then, from summary.json (which holds every rank's gathered
``StageStats``), per-stage peak memory, time waiting on neighbours and on the gradient all-reduce,
the measured bubble, the timeline picture, and the planner's predictions and plan when the
summary has them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from pipedream2bw.config import WandbConfig
from pipedream2bw.io.fileio import atomic_open, atomic_write_text

log = logging.getLogger(__name__)

SCALARS = ("final_loss", "final_val_loss", "samples_per_s", "tokens_per_s", "step_time_s", "predicted_samples_per_s")


def stage_rows(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per stage: measured peak memory (largest replica), predicted peak memory when
    the planner gave one, and the mean over the stage's replicas of the time spent waiting on
    neighbours (p2p) and on the gradient all-reduce."""
    predicted = summary.get("predicted_peak_memory_bytes")
    rows = []
    for stage, peak in enumerate(summary["peak_memory_bytes"]):
        ranks = [r for r in summary["ranks"] if r["stage"] == stage]
        rows.append(
            {
                "stage": stage,
                "peak_memory_bytes": peak,
                "predicted_peak_memory_bytes": predicted[stage] if predicted else None,
                "p2p_wait_s": sum(r.get("p2p_wait_s", 0.0) for r in ranks) / len(ranks),
                "allreduce_exposed_s": sum(r["allreduce_exposed_s"] for r in ranks) / len(ranks),
            }
        )
    return rows


def plan_rows(plan: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A plan as table rows: its ``stages`` list when it has one (one row per stage, plan-wide
    scalars repeated), else one row of its scalar fields."""
    scalars = {k: v for k, v in plan.items() if isinstance(v, (int, float, str, bool)) or v is None}
    stages = plan.get("stages")
    if isinstance(stages, list) and stages and all(isinstance(s, dict) for s in stages):
        return [
            {**scalars, **{k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in s.items()}}
            for s in stages
        ]
    return [{**scalars, **{k: str(v) for k, v in plan.items() if k not in scalars}}]


METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


class MetricsLog:
    """``<run_dir>/metrics.jsonl``: one JSON object per line, appended and flushed as the run goes.

    A training line per step: ``step`` (steps done: batch t is step t + 1, as in the log and the
    checkpoints' ``step_<n>``), ``loss``, ``lr``, ``grad_norm`` (null when no agreement computed it),
    ``samples_per_s`` and ``tokens_per_s`` (of this step alone), ``step_time_s``, ``memory_bytes``
    (rank 0's peak so far: CUDA max allocated, or the process's peak resident set on the CPU),
    ``eta_s`` and ``time`` (Unix seconds). A validation line per pass: ``step``, ``val_loss``,
    ``val_perplexity``. A resumed run keeps the lines up to its first step and appends after them
    (the lines an interrupted attempt wrote past its checkpoint are dropped, as their steps run again);
    resumed into a new run directory, it starts with the lines up to its first step of ``earlier``'s
    metrics.jsonl (the run directory that holds the checkpoint), so that it holds the whole history as
    summary.json and loss.png do. Either way a step's validation line appears once.
    """

    def __init__(self, run_dir: Path, *, first_step: int = 0, earlier: Optional[Path] = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.copied_from: Optional[Path] = None  # earlier's metrics.jsonl, when its lines were copied
        self._kept_vals: set = set()  # the first step's validation line, when kept: not written again
        source = self.path
        if first_step and not self.path.is_file() and earlier is not None and (Path(earlier) / METRICS_FILE).is_file():
            source = self.copied_from = Path(earlier) / METRICS_FILE
        if source.is_file():
            kept = [line for line in source.read_text().splitlines() if _step_of(line) <= first_step]
            # a checkpoint is written before its step's validation pass, which the resumed run then repeats
            self._kept_vals = {first_step} & {_step_of(line) for line in kept if '"val_loss"' in line}
            atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
        self._file = open(self.path, "a", encoding="utf-8")  # open for the whole run; close() ends it

    def write(self, record: Dict[str, Any]) -> None:
        """Appends ``record`` as one line and flushes it (a crash loses at most the line being written). A
        validation pass at the resumed run's first step whose line is kept (the same pass, on the same
        weights, that the earlier run wrote) is not written again."""
        if "val_loss" in record and record["step"] in self._kept_vals:
            self._kept_vals.discard(record["step"])
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line cut short by a crash: dropped
        return float("inf")


def read_metrics(run_dir: Path) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """A run directory's metrics.jsonl as (training lines, validation lines)."""
    records = [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines() if line]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


PLOT_POINTS = 2000
"""At most this many training-loss points in loss.png: a long run's batches are averaged in equal runs."""


def downsample(losses: Sequence[float], max_points: int = PLOT_POINTS) -> Tuple[List[float], List[float]]:
    """(steps, losses) to draw: every batch's loss (batch t at step t + 1) when there are at most
    ``max_points``, else the mean of each of ``max_points`` runs of consecutive batches, at its middle step.
    A picture's cost stays bounded whatever the run's length (issue 34: all 6,000 points of a long run,
    redrawn at every checkpoint, grew rank 0's memory by hundreds of MiB)."""
    n = len(losses)
    if n <= max_points:
        return [float(t) for t in range(1, n + 1)], [float(x) for x in losses]
    steps, means = [], []
    for i in range(max_points):
        lo, hi = i * n // max_points, (i + 1) * n // max_points
        steps.append((lo + 1 + hi) / 2)
        means.append(sum(losses[lo:hi]) / (hi - lo))
    return steps, means


def _release_freed_memory() -> None:
    """Hands what the drawing freed back to the system (glibc keeps freed heap pages for reuse otherwise)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def plot_losses(
    losses: Sequence[float], val_losses: Sequence[Tuple[int, float]], path: Path, *, title: str = ""
) -> None:
    """Draws training loss (batch t at step t + 1) and validation loss (after n steps) against the step
    into the PNG file ``path``, written atomically (``loss.png`` is never seen half-drawn).

    Memory stays bounded: at most ``PLOT_POINTS`` training points (``downsample``) and as many validation
    points, a figure of its own (no pyplot state) collected at once, and the freed memory returned to the system.

    Args:
        losses: the mean loss of every batch so far, from the first.
        val_losses: (step, loss) of every validation pass so far.
        path: the PNG file to write.
        title: the figure's title (the run's settings).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)  # no display: render to a file
    ax = fig.subplots()
    steps, values = downsample(losses)
    ax.plot(steps, values, label="training (batch mean)", color="tab:blue", linewidth=1)
    if val_losses:
        val_losses = list(val_losses)
        if len(val_losses) > PLOT_POINTS:
            val_losses = [val_losses[i * len(val_losses) // PLOT_POINTS] for i in range(PLOT_POINTS)] + val_losses[-1:]
        steps, values = zip(*val_losses)
        ax.plot(steps, values, "o-", label="validation", color="tab:orange", linewidth=1.5, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_open(Path(path)) as f:
        fig.savefig(f, dpi=100, format="png")
    del fig, ax
    gc.collect()  # a figure is a web of reference cycles, with its canvas's pixel buffer: free it now, not at
    _release_freed_memory()  # some later collection (figures piled up between redraws; issue 34)


def progress_bar(num_steps: int, *, initial: int = 0, file: Optional[TextIO] = None) -> Any:
    """Rank 0's tqdm bar over the training steps (steps/s, elapsed<remaining time; loss and samples/s as postfix).

    Disabled unless ``file`` (stderr by default) is a terminal, so that logs and CI output
    keep only the regular log lines. While a bar is drawn (until its ``close()``), console log lines and
    Python warnings go through ``tqdm.write``: each clears the bar, takes its own line, and the bar is
    redrawn below it (they otherwise land on the bar's line)."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    class Bar(tqdm):
        redirect: Optional[contextlib.ExitStack] = None

        def close(self) -> None:
            try:
                super().close()
            finally:
                if self.redirect is not None:  # the console handlers and showwarning as they were
                    self.redirect, redirect = None, self.redirect
                    redirect.close()

    file = sys.stderr if file is None else file
    bar = Bar(
        total=num_steps,
        initial=initial,
        desc="train",
        unit="step",
        file=file,
        disable=not file.isatty(),
        dynamic_ncols=True,
        leave=True,
    )
    if not bar.disable:
        bar.redirect = contextlib.ExitStack()
        bar.redirect.enter_context(logging_redirect_tqdm())
        bar.redirect.enter_context(_warnings_through(tqdm, file))
    return bar


@contextlib.contextmanager
def _warnings_through(tqdm: Any, file: TextIO) -> Iterator[None]:
    """Python warnings printed with ``tqdm.write`` to ``file`` (so on their own line, not a bar's)."""
    import warnings

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file_=None, line=None):  # noqa: ARG001 (showwarning's signature)
        tqdm.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=file)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


class Tracker:
    """A wandb run in ``run_dir`` (``wandb.mode``: offline, online or disabled).

    ``config``: the run's whole config as a plain dict (``dataclasses.asdict``), logged as the wandb
    run's config. ``run_id``: the id of the run a resumed job continues (a checkpoint keeps it).
    Online, the job resumes that wandb run and logs on from its first step; offline, where wandb
    cannot resume, it starts a new offline run under the same id.
    """

    def __init__(
        self,
        wandb_cfg: WandbConfig,
        run_dir: Path,
        *,
        config: Optional[Dict[str, Any]] = None,
        run_id: Optional[str] = None,
    ):
        self.run = None
        self.run_dir = Path(run_dir)
        if wandb_cfg.mode == "disabled":
            return
        import wandb  # imported here: it is slow to import and only rank 0 needs it

        self.run = wandb.init(
            project=wandb_cfg.project,
            name=wandb_cfg.name,
            group=wandb_cfg.group,
            mode=wandb_cfg.mode,
            dir=str(run_dir),
            config=config,  # the resolved config, every default filled in
            settings=wandb.Settings(silent=True, console="off"),
            id=run_id,
            resume="allow" if run_id is not None and wandb_cfg.mode == "online" else None,
        )
        log.info(
            "wandb run %s (%s%s) in %s", self.run.id, wandb_cfg.mode, ", continued" if run_id else "", self.run.dir
        )

    @property
    def run_id(self) -> Optional[str]:
        return None if self.run is None else self.run.id

    def log(self, metrics: Dict[str, Any], *, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, summary: Optional[Dict[str, Any]] = None, *, plan: Optional[Dict[str, Any]] = None) -> None:
        """Puts the run's figures in the wandb summary, logs the tables and picture, closes the run.

        Args:
            summary: the summary.json payload (None when the run failed).
            plan: the planner's plan as a dict; by default the summary's ``plan``, if any.
        """
        if self.run is None:
            return
        if summary:
            self._summarize(summary, plan if plan is not None else summary.get("plan"))
            for r in summary.get("ranks", []):
                for key in ("peak_device_bytes", "swapped_out_bytes", "stall_s") if r.get("swap") else ():
                    self.run.summary[f"stage{r['stage']}/replica{r['replica']}/swap_{key}"] = r["swap"][key]
        self.run.finish()

    def _summarize(self, summary: Dict[str, Any], plan: Optional[Dict[str, Any]]) -> None:
        import wandb

        rows = stage_rows(summary)
        media: Dict[str, Any] = {"stages": _table(rows)}
        trace = summary.get("trace")
        png = self.run_dir / "timeline.png"
        if trace and png.is_file():
            media["timeline"] = wandb.Image(str(png), caption=f"steps {trace['steps']}")
        if plan:
            media["plan"] = _table(plan_rows(plan))
        # Logged first: a row reaches the summary when the next one is logged, and the last
        # training step's row (the throughput of its log window) must not overwrite the figures below.
        self.run.log(media, step=summary["num_steps"])
        out = self.run.summary
        for key in SCALARS:
            if summary.get(key) is not None:
                out[key] = summary[key]
        for row in rows:
            for key in ("peak_memory_bytes", "predicted_peak_memory_bytes", "p2p_wait_s", "allreduce_exposed_s"):
                if row[key] is not None:
                    out[f"stage{row['stage']}/{key}"] = row[key]
        out["skipped_steps"] = len(summary.get("skipped_steps") or [])
        out["comm_wait_s"] = sum(r.get("p2p_wait_s", 0.0) + r["allreduce_exposed_s"] for r in summary["ranks"])
        if trace:
            out["bubble_fraction"] = trace["bubble_fraction"]
            for rank, fraction in enumerate(trace["bubble_fraction_per_rank"]):
                out[f"rank{rank}/bubble_fraction"] = fraction


def _table(rows: List[Dict[str, Any]]) -> Any:
    import wandb

    columns = list(dict.fromkeys(k for row in rows for k in row))
    return wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
