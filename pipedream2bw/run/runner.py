"""One rank's training run, as its phases: start (before any process group), build, the steps, finish."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from pipedream2bw.config import (
    Config,
)
from pipedream2bw.io import rundir
from pipedream2bw.pipeline import comm
from pipedream2bw.pipeline.agreement import NonFiniteError
from pipedream2bw.run import build, finish, logs, preempt, start, step_hooks
from pipedream2bw.run.model import RunModel
from pipedream2bw.run.runtime import RankPlan
from pipedream2bw.run.stage import StageStats

log = logging.getLogger(__name__)


TRAIN_RANGE = "pipedream2bw.train"
"""torch.profiler range around each rank's training loop (not set-up, checkpoint waits or result gathering)."""


def run(
    cfg: Config,
    run_dir: Path,
    *,
    layers: Optional[Sequence[nn.Module]] = None,
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
    store: Optional[Any] = None,
    on_start: Optional[Callable[[], None]] = None,
) -> Optional[Dict[str, Any]]:
    """Trains this rank's stage; on rank 0, writes and returns the summary.

    Args:
        cfg: the run's config (validated here, before any process group starts).
        run_dir: directory shared by all ranks for summary.json and final_model.pt.
        layers: the whole model as a list of layers (any ``nn.Sequential``'s children);
            by default the layers ``cfg.model`` describes (the GPT, or a factory's), of which
            each rank builds only its own slice where the factory allows.
        loss_fn: (last stage output, targets) -> scalar loss of a microbatch; by default
            ``cfg.model``'s (next-token cross-entropy unless ``model.loss`` names one).
        store: rendezvous store already connected (the entry point's); made here if None.
        on_start: called once the config and the checkpoint to resume from are accepted, before any
            process group starts (the entry point writes Hydra's record of the run then).

    Raises:
        ConfigError: bad config, a model factory that does not import or returns no layer list, or
            parameters shared in a way the runtime cannot honour: before any process group starts.
        comm.PeerFailure: another rank failed first.
        preempt.Preempted: a signal of ``train.preempt_signals`` stopped every rank at one step, after a
            checkpoint of it and summary.json (``"preempted"``) were written.
    """
    logs.quiet_ranks(comm.env_rank()[0])
    # rank 0 locks the run directory before it looks at its checkpoints, until the run ends (rundir.RunLock)
    with preempt.Watch(cfg.train.preempt_signals) as watch, rundir.RunLock() as lock:
        return _run(
            cfg, run_dir, layers=layers, loss_fn=loss_fn, store=store, watch=watch, on_start=on_start, lock=lock
        )


def _run(
    cfg: Config,
    run_dir: Path,
    *,
    layers: Optional[Sequence[nn.Module]],
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]],
    store: Optional[Any],
    watch: preempt.Watch,
    on_start: Optional[Callable[[], None]],
    lock: Optional[rundir.RunLock] = None,
) -> Optional[Dict[str, Any]]:
    """``run``, with ``watch`` noting preemption signals: start (every check, the plan and the checkpoint,
    before any process group), then the groups, then this rank's training."""
    s = start.start(cfg, Path(run_dir), layers=layers, loss_fn=loss_fn, store=store, on_start=on_start, lock=lock)
    ctx = comm.init(
        store=s.store,
        rank=s.rank,
        world_size=s.world_size,
        local_rank=s.local_rank,
        backend=s.cfg.dist.backend,
        timeout_s=s.cfg.dist.timeout_s,
    )
    try:
        rt = RankPlan.from_config(s.cfg, layout=s.layout, balance=s.balance, ctx=ctx, resume=s.resume)
        summary, preempted = _train(s.cfg, rt, ctx, s.run_dir, s.model, s.resume, s.predictions, watch=watch)
    except BaseException as e:
        peer_failure = _leave(ctx, s.layout.position(s.rank)[0], s.rank, e)
        comm.abandon()  # another run() in this process can start afresh
        if peer_failure is None:
            raise
        raise peer_failure from e
    comm.shutdown(ctx)
    if preempted is not None:
        raise preempted
    return summary


def _train(
    cfg: Config,
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    model: RunModel,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    predictions: Dict[str, Any],
    *,
    watch: preempt.Watch,
) -> Tuple[Optional[Dict[str, Any]], Optional[preempt.Preempted]]:
    """This rank's run as phases: build its components, attach the step hooks, run its actions, finish.

    Returns:
        (the summary on rank 0, else None; ``preempt.Preempted`` if a signal stopped the run, else None).
    """
    parts = build.components(cfg, rt, ctx, model, resume, watch=watch)
    logs.log_start(rt, parts.num_dp_buckets, parts.tie_groups)
    if rt.rank == 0:
        logs.log_run(rt, cfg, model, parts.feed, parts.val_feed)
    if resume is not None:
        step_hooks.resume_history(rt, resume, parts, eval_every=cfg.train.eval_every)
    hooks = step_hooks.attach(cfg, rt, ctx, run_dir, model, resume, parts)
    stats, preempted = _steps(parts, hooks)
    summary = finish.finish(cfg, rt, ctx, run_dir, model, resume, predictions, parts, hooks, stats, preempted)
    return summary, preempted


def _steps(parts: build.Components, hooks: step_hooks.StepHooks) -> Tuple[StageStats, Optional[preempt.Preempted]]:
    """Runs this rank's actions, the hooks after each step; a preemption stops every rank after the same step."""
    worker = parts.worker
    with torch.profiler.record_function(TRAIN_RANGE):  # the bar keeps log lines off its line (progress_bar)
        try:
            return worker.run(parts.actions, on_step=hooks.on_step, on_close=hooks.on_close), None
        except preempt.Preempted as e:  # every rank, after the same step: the rest of its actions is dropped
            worker._measure_memory()
            return worker.stats, e


def _leave(ctx: comm.DistContext, stage: int, rank: int, e: BaseException) -> Optional[comm.PeerFailure]:
    """After ``e`` on this rank: reports it (the first failure of the run wins), leaves the monitor.

    Returns:
        None when this rank failed first (its caller re-raises ``e``), else the peer's failure to raise.
    """
    first = ctx.monitor.report(stage, e)
    failed_here = first.startswith(f"rank {rank} ")
    if failed_here:  # a non-finite loss is the run's verdict, said in one line; anything else with its traceback
        log.error("%s", first, exc_info=not isinstance(e, NonFiniteError))
    else:
        log.error("stopping because %s (here: %s: %s)", first, type(e).__name__, e)
    ctx.monitor.leave()
    ctx.monitor.stop()  # this rank is out: its caller decides what happens next
    return None if failed_here else comm.PeerFailure(first)
