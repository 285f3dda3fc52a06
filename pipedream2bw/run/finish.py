"""Finish: close the run's writers, write the final weights, gather every rank's stats on rank 0 and write
summary.json, the trace and final_model.pt."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint

from pipedream2bw.config import (
    Config,
    DistConfig,
    OptimConfig,
    TrainConfig,
    optimizer_name,
)
from pipedream2bw.config.newest import prediction_weight_copies
from pipedream2bw.config.optimizers import correction_in_effect
from pipedream2bw.data import data_resident_bytes
from pipedream2bw.io import checkpoint, timeline
from pipedream2bw.io.fileio import atomic_torch_save as save_state_dict
from pipedream2bw.io.fileio import atomic_write
from pipedream2bw.memory import precision as precisions
from pipedream2bw.memory.loss_scale import ScaledStepRule
from pipedream2bw.memory.sharding import ShardedVersions
from pipedream2bw.memory.stream import StreamedVersions
from pipedream2bw.pipeline import comm, schedule, ties
from pipedream2bw.pipeline.agreement import StepRule
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run import build, evaluate, logs, preempt, step_hooks
from pipedream2bw.run.model import RunModel
from pipedream2bw.run.results import summarize, write_summary
from pipedream2bw.run.runtime import RankPlan
from pipedream2bw.run.stage import StageStats
from pipedream2bw.run.tensor import TensorPart

log = logging.getLogger(__name__)


def close(
    rt: RankPlan,
    stats: StageStats,
    evaluator: Optional[evaluate.Evaluator],
    feed: Any,
    val_feed: Any,
    bar: Any,
    saver: checkpoint.Checkpointer,
    groups: build.Groups,
) -> Dict[str, Any]:
    """Ends the run's evaluator, bar and checkpoint writes; completes ``stats``.

    Returns:
        This rank's tie record: its tie all-reduces, their exposed time and the steps it checked ties.
    """
    if evaluator is not None:
        evaluator.close()
        stats.eval_s = evaluator.time_s
    stats.data_resident_bytes = data_resident_bytes(feed, val_feed)
    if bar is not None:
        bar.close()
    saver.wait()
    stats.replica, stats.checkpoint_s = rt.replica, saver.write_s
    if groups.reducer is not None:
        stats.allreduce_calls, stats.allreduce_exposed_s = groups.reducer.num_collectives, groups.reducer.exposed_s
    exchange, checker = groups.exchange, groups.checker
    return {
        "tie_allreduce_calls": exchange.num_collectives if exchange else 0,
        "tie_exposed_s": exchange.exposed_s if exchange else 0.0,
        "tie_checked_steps": checker.steps_checked if checker else 0,
    }


def finish(
    cfg: Config,
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    model: RunModel,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    predictions: Dict[str, Any],
    parts: build.Components,
    hooks: step_hooks.StepHooks,
    stats: StageStats,
    preempted: Optional[preempt.Preempted],
) -> Optional[Dict[str, Any]]:
    """After the last step: the validation losses still in flight, the writers closed, the final weights
    (not of a preempted run: its checkpoint holds them), then summary.json. Returns the summary on rank 0."""
    hooks.report_validation()
    tie_record = close(rt, stats, parts.evaluator, parts.feed, parts.val_feed, hooks.bar, hooks.saver, parts.groups)
    if preempted is not None and rt.rank == 0:
        log.warning(
            "preempted by %s%s: every rank stopped after step %d of %d; checkpoint %s; exiting with %d to be requeued",
            logs.signal_name(preempted.signum),
            f" (ranks got {preempt.describe(preempted.received)})" if len(preempted.received) > 1 else "",
            preempted.step,
            rt.num_steps,
            checkpoint.step_dir(run_dir / checkpoint.DIRNAME, preempted.step),
            preempted.exit_code,
        )
    final = None
    if preempted is None:  # the checkpoint holds a preempted run's weights
        final = final_weights(rt, parts.versions, cfg.train, split=parts.split)
        write_final(rt, ctx, run_dir, state=final, model=model, train=cfg.train, dist=cfg.dist)
    return gather_and_write(
        rt,
        ctx,
        run_dir,
        stats=stats,
        tie_record=tie_record,
        final=final,
        parts=parts,
        model=model,
        resume=resume,
        predictions=predictions,
        hooks=hooks,
        cfg=cfg,
        preempted=preempted,
    )


def gather_and_write(
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    *,
    stats: StageStats,
    tie_record: Dict[str, Any],
    final: Optional[Dict[str, torch.Tensor]],
    parts: build.Components,
    model: RunModel,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    predictions: Dict[str, Any],
    hooks: step_hooks.StepHooks,
    cfg: Config,
    preempted: Optional[preempt.Preempted] = None,
) -> Optional[Dict[str, Any]]:
    """Gathers every rank's stats, model slice and tie record on rank 0, which writes summary.json,
    final_model.pt (and the trace), closes the wandb run and returns the summary; None elsewhere. A
    preempted run writes no final_model.pt (its checkpoint holds the weights) and no trace."""
    train, pipeline = cfg.train, cfg.pipeline
    tied = model.tied
    all_stats = comm.gather_to_rank0(ctx, stats)
    gathered = train.save_final == "gathered" and preempted is None  # a preempted run's weights are in its checkpoint
    # Replicas hold equal weights: replica 0 of each stage contributes its slice of the model.
    kept = final is not None and gathered  # tensor_parallel: replica 0's tensor rank 0 holds the whole tensors
    shard = ties.drop_aliases({k: v.detach().cpu() for k, v in final.items()}, tied) if kept else {}
    shards = comm.gather_to_rank0(ctx, shard) if gathered else None
    tie_records = comm.gather_to_rank0(ctx, tie_record)
    if rt.rank != 0:
        return None
    meta = {
        **_layout_meta(rt, resume),
        **predictions,
        **_precision_meta(rt, cfg, parts, tied),
        **_ties_meta(rt, tied, tie_records),
        **_outcome_meta(run_dir, parts.evaluator, preempted),
    }
    # Throughput counts the steps this run took; a resumed (or preempted) run may have fewer than the warm-up.
    warmup = min(train.warmup_steps, len(stats.step_end_times) - 1)
    summary = summarize(all_stats, meta=meta, warmup_steps=warmup, samples_per_step=rt.global_batch, seq_len=rt.seq_len)
    trace = parts.worker.trace
    if trace is not None and preempted is None:
        title = (
            f"{rt.schedule}, d={rt.num_stages}, w={rt.data_parallel}, m={rt.num_microbatches}, b={rt.microbatch_size}"
        )
        steps = range(trace.first_step, trace.first_step + pipeline.trace_steps)
        summary["trace"] = save_trace(all_stats, run_dir, steps=steps, title=title)
    write_summary(summary, run_dir)
    if (
        shards is not None and preempted is None
    ):  # as the tied model's own state_dict: every name of a tie on one tensor
        whole = ties.add_aliases({k: v for shard in shards for k, v in shard.items()}, tied)
        save_state_dict(whole, run_dir / "final_model.pt")
    hooks.tracker.finish(summary)
    hooks.record.plot()
    hooks.record.metrics.close()
    log.info(
        "done: loss %.4f -> %.4f, %.1f samples/s, %.0f tokens/s; results in %s",
        summary["losses"][0],
        summary["final_loss"],
        summary["samples_per_s"],
        summary["tokens_per_s"],
        run_dir,
    )
    return summary


def _layout_meta(rt: RankPlan, resume: Optional[Tuple[Path, Dict[str, Any]]]) -> Dict[str, Any]:
    """summary.json's record of what ran where: the schedule, the layout, the batch, the device."""
    return {
        "schedule": rt.schedule,
        "weight_versions": rt.weight_versions,  # 2bw: batch t's version for all of it, or each forward's newest
        "num_stages": rt.num_stages,
        "data_parallel": rt.data_parallel,
        "tensor_parallel": rt.tensor_parallel,
        "num_microbatches": rt.num_microbatches,
        "microbatch_size": rt.microbatch_size,
        "global_batch_size": rt.global_batch,
        "balance": list(rt.balance),
        "rank_map": [list(r) for r in rt.layout.ranks],
        "num_steps": rt.num_steps,
        "seq_len": rt.seq_len,
        "backend": rt.backend,
        "device": rt.device.type,
        "memory_kind": "cuda_max_allocated" if rt.device.type == "cuda" else "process_peak_rss",
        "resumed_from": None if resume is None else str(resume[0]),
        "first_step": rt.first_step,
        "recompute": rt.recompute,
    }


def _precision_meta(rt: RankPlan, cfg: Config, parts: build.Components, tied: Sequence[ties.Tie]) -> Dict[str, Any]:
    """``precision_record`` of this run, with whether its steps wait (``precision.step_waits``)."""
    train, optim, rule = cfg.train, cfg.optim, parts.rule
    waits = precisions.step_waits(
        rt.schedule,
        agreement=rule.needs_agreement,
        tied_across_stages=any(len(rt.tie_holders(tie)) > 1 for tie in tied),
        sharded=optim.sharded and rt.data_parallel > 1,
        early_apply=not (train.eval_every or cfg.pipeline.check_ties),
    )
    return precision_record(rt, optim, rule, parts.worker.stats, weight_dtype_name=train.weight_dtype, waits=waits)


def _ties_meta(rt: RankPlan, tied: Sequence[ties.Tie], tie_records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """summary.json's ties: each with the steps every holder checked it, and each rank's tie all-reduces."""
    checked = [
        {
            **t,
            "checked_steps": min(
                (r["tie_checked_steps"] for r, (st, _) in zip(tie_records, rt.positions()) if st in t["stages"]),
                default=0,
            ),
        }
        for t in ties.describe(tied, list(rt.balance), v_schedule=rt.schedule in schedule.V_SCHEDULES)
    ]
    return {"ties": checked, "tie_allreduce_calls": [r["tie_allreduce_calls"] for r in tie_records]}


def _outcome_meta(
    run_dir: Path, evaluator: Optional[evaluate.Evaluator], preempted: Optional[preempt.Preempted]
) -> Dict[str, Any]:
    """summary.json's validation losses and how the run ended (completed, or preempted: where to resume)."""
    return {
        "val_losses": [] if evaluator is None else [{"step": n, "loss": v} for n, v in evaluator.losses],
        "final_val_loss": evaluator.losses[-1][1] if evaluator is not None and evaluator.losses else None,
        "status": "completed" if preempted is None else "preempted",
        "preempted": None
        if preempted is None
        else {
            "signal": logs.signal_name(preempted.signum),
            "step": preempted.step,
            "checkpoint": str(checkpoint.step_dir(run_dir / checkpoint.DIRNAME, preempted.step)),
            "exit_code": preempted.exit_code,
        },
    }


def final_weights(
    rt: RankPlan, versions: WeightVersions, train: TrainConfig, *, split: Optional[TensorPart] = None
) -> Optional[Dict[str, torch.Tensor]]:
    """This stage's final weights on its replica 0 (None on the others, and when the run writes none): the
    newest version, or, where the versions are stored in the compute dtype (train.weight_dtype=compute),
    the float32 masters, all-gathered over the replicas when sharded (every replica takes part). With a tensor
    ``split``, whole tensors gathered over replica 0's tensor group, kept by its tensor rank 0."""
    if train.save_final == "none" and train.export_hf is None:
        return None
    if isinstance(versions, (ShardedVersions, StreamedVersions)) and versions.weight_dtype != torch.float32:
        state = versions.final_state(keep=rt.replica == 0)
    elif rt.replica != 0:
        return None
    else:
        state = versions.weights().state_dict()
    if split is None or rt.replica != 0:
        return state
    whole = split.whole({"weights": state})["weights"]
    return whole if rt.tensor_rank == 0 else None


def write_final(
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    *,
    state: Optional[Dict[str, torch.Tensor]],
    model: RunModel,
    train: TrainConfig,
    dist: DistConfig,
) -> None:
    """The final weights as shards, each stage's replica 0 writing its own at once (pipedream2bw.models.hf_io):
    ``train.save_final=sharded`` (final_model/, layer-list names) and ``train.export_hf`` (a Hugging Face model);
    ``state``: this stage's final weights on its replica 0 (``final_weights``), None on the others."""
    from pipedream2bw.models import hf_io

    writers = [rt.layout.ranks[s][0] for s in range(rt.num_stages)]
    aliases = [n for t in model.tied for n in t.names[1:]]
    common = dict(
        shard=rt.stage,
        num_shards=rt.num_stages,
        rank=rt.rank,
        writers=writers,
        post=ctx.board.post,
        read=lambda keys, timeout_s: ctx.board.read(keys, timeout_s=timeout_s),
        timeout_s=dist.timeout_s,
    )
    if train.save_final == "sharded":
        mine = None if state is None else {k: v.detach().cpu() for k, v in ties.drop_aliases(state, model.tied).items()}
        hf_io.write_sharded(run_dir / "final_model", mine, key="final/sharded", **common)
    if train.export_hf is not None:
        hf = model.source.hf if model.source is not None else None
        assert hf is not None, "run() refuses train.export_hf without model=hf"
        mine = None if state is None else hf_io.to_hf_shard(hf, state, aliases)
        hf_io.write_sharded(
            Path(train.export_hf),
            mine,
            key="final/export_hf",
            config=hf.export_config,
            source_dir=hf.source_dir,
            **common,
        )


def precision_record(
    rt: RankPlan,
    optim: OptimConfig,
    rule: StepRule,
    stats: StageStats,
    *,
    weight_dtype_name: str = "fp32",
    waits: bool = False,
) -> Dict[str, Any]:
    """summary.json's precision fields: the precision, its bytes per parameter (``waits``: the step waits,
    ``precision.step_waits``), and under fp16 the loss scale."""
    correction = correction_in_effect(optim, rt.schedule)
    record = {
        "precision": rt.precision,
        "compute_dtype": str(precisions.compute_dtype(rt.precision)).replace("torch.", ""),
        "delay_correction": correction,  # optim.delay_correction as it ran: auto resolved, none off 2bw
        "bytes_per_parameter": precisions.param_memory(
            rt.precision,
            schedule=rt.schedule,
            optimizer=optimizer_name(optim),
            optimizer_kwargs=optim.kwargs,
            weight_dtype_name=weight_dtype_name,
            sharded=optim.sharded,
            data_parallel=rt.data_parallel,
            waits=waits,
            delay_correction=correction,
            versions=_weight_copies(rt, correction),
        ).as_dict(),
    }
    if isinstance(rule, ScaledStepRule):  # every rank's scaler takes the same values; these are rank 0's
        record["loss_scale"] = {
            "final": rule.scaler.scale,
            "per_step": stats.loss_scales,
            "skipped_steps": stats.skipped_steps,
            "state": rule.state_dict(),
        }
    return record


def _weight_copies(rt: RankPlan, correction: str) -> Optional[int]:
    """The weight copies this rank's stage holds where they are not its schedule's versions: under
    pipeline.weight_versions=newest with its prediction, W and one or two predictions (``PredictedNewestVersions``)."""
    if rt.weight_versions != "newest" or correction != "predict":
        return None
    return prediction_weight_copies(rt.num_stages, rt.num_microbatches, rt.forward_lead, stage_index=rt.stage)


def save_trace(all_stats: Sequence[StageStats], run_dir: Path, *, steps: range, title: str) -> Dict[str, Any]:
    """Writes trace.json (Chrome trace events, for Perfetto) and timeline.png; returns the measured bubble."""
    traces = [{"rank": st.rank, "stage": st.stage_index, "replica": st.replica, **st.trace} for st in all_stats]
    atomic_write(run_dir / "trace.json", json.dumps(timeline.chrome_trace(traces, title=title)).encode())
    timeline.plot_timeline(traces, run_dir / "timeline.png", title=title)
    per_step = [  # seconds per traced step, by what each rank did (timeline.BREAKDOWN)
        {k: v / len(steps) for k, v in timeline.breakdown(tr["spans"], tr["window"]).items()} for tr in traces
    ]
    return {
        **timeline.bubble_summary(traces),
        "breakdown_per_rank": per_step,
        "steps": list(steps),
        "files": ["trace.json", "timeline.png"],
    }
