"""The step hooks: what runs after each optimizer step (tie check, validation, progress, metrics.jsonl,
loss.png, checkpoint, the preemption stop) and rank 0's tracking that they feed."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint

from pipedream2bw.config import (
    Config,
    TrainConfig,
    WandbConfig,
    optimizer_name,
)
from pipedream2bw.io import checkpoint
from pipedream2bw.io.tracking import LOSS_PLOT, MetricsLog, Tracker, plot_losses, progress_bar
from pipedream2bw.memory.loss_scale import ScaledStepRule
from pipedream2bw.memory.memprobe import process_peak_bytes
from pipedream2bw.memory.sharding import ShardedVersions
from pipedream2bw.pipeline import comm, ties
from pipedream2bw.pipeline.agreement import StepRule
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run import build, evaluate, logs, preempt
from pipedream2bw.run.model import RunModel, training_settings
from pipedream2bw.run.runtime import RankPlan
from pipedream2bw.run.stage import StageWorker
from pipedream2bw.run.tensor import TensorPart

log = logging.getLogger(__name__)


def resume_history(
    rt: RankPlan,
    resume: Tuple[Path, Dict[str, Any]],
    parts: build.Components,
    *,
    eval_every: int,
) -> None:
    """A resumed run keeps the checkpoint's history (rank 0's losses, learning rates, ..., the validation
    passes already run); a validation pass still owed at the first step runs first."""
    manifest, first_batch = resume[1], rt.first_step
    worker, evaluator, versions = parts.worker, parts.evaluator, parts.versions
    if rt.rank == 0:
        worker.stats.losses = list(manifest["losses"])
        worker.stats.lrs = list(manifest.get("lrs", [None] * first_batch))  # checkpoints before lrs were recorded
        worker.stats.grad_norms = list(manifest.get("grad_norms", [None] * first_batch))
        worker.stats.skipped_steps = list(manifest.get("skipped_steps", []))
    if evaluator is not None:
        evaluator.losses = [(n, v) for n, v in manifest.get("val_losses", []) if n <= first_batch]
        if first_batch % eval_every == 0 and first_batch not in {n for n, _ in manifest.get("val_losses", [])}:
            evaluator.run(versions.weights(), step=first_batch)


def tracking(
    rt: RankPlan,
    run_dir: Path,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    worker: StageWorker,
    wandb: WandbConfig,
    train: TrainConfig,
    *,
    config: Optional[Dict[str, Any]],
) -> Tuple[Optional[Tracker], Any, Callable[[int], None], Dict[str, str], Optional["RunRecord"]]:
    """Rank 0's wandb run (continuing the checkpoint's), progress bar, per-step progress callback and
    run-directory record (metrics.jsonl, loss.png).

    Returns:
        (tracker, bar, progress callback, the bar's extra postfix, record), None and a no-op on other ranks.
    """
    postfix: Dict[str, str] = {}
    if rt.rank != 0:
        return None, None, (lambda t: None), postfix, None
    tracker = Tracker(
        wandb, run_dir, config=config, run_id=resume[1].get("wandb_run_id") if resume is not None else None
    )
    bar = progress_bar(rt.num_steps, initial=rt.first_step)
    record = RunRecord(rt, run_dir, worker, earlier=_checkpoint_run_dir(resume))
    progress = progress_callback(
        train,
        worker,
        tracker,
        bar,
        samples_per_step=rt.global_batch,
        seq_len=rt.seq_len,
        postfix=postfix,
        metrics=record.metrics,
        device=rt.device,
        first_step=rt.first_step,
    )
    return tracker, bar, progress, postfix, record


def _checkpoint_run_dir(resume: Optional[Tuple[Path, Dict[str, Any]]]) -> Optional[Path]:
    """The run directory holding the checkpoint resumed from (``<run dir>/checkpoints/step_<n>``), or None."""
    if resume is None or resume[0].parent.name != checkpoint.DIRNAME:
        return None
    return resume[0].parent.parent


class RunRecord:
    """Rank 0's files in the run directory that show the run as it goes: metrics.jsonl (every step and
    validation pass) and loss.png (redrawn at each validation pass, checkpoint and the end)."""

    def __init__(self, rt: RankPlan, run_dir: Path, worker: StageWorker, *, earlier: Optional[Path] = None):
        self.metrics = MetricsLog(run_dir, first_step=rt.first_step, earlier=earlier)
        if self.metrics.copied_from is not None:
            log.info("metrics.jsonl: steps 1..%d copied from %s", rt.first_step, self.metrics.copied_from)
        self.plot_path = run_dir / LOSS_PLOT
        self.worker = worker
        self.val_losses: List[Tuple[int, float]] = []
        w = f", w={rt.data_parallel}" if rt.data_parallel > 1 else ""
        self.title = (
            f"{run_dir.parent.name}/{run_dir.name}: {rt.schedule}, d={rt.num_stages}{w}, m={rt.num_microbatches}, "
            f"b={rt.microbatch_size}, {rt.precision}"
        )

    def validation(self, step: int, loss: float) -> None:
        self.metrics.write({"step": step, "val_loss": loss, "val_perplexity": evaluate.perplexity(loss)})
        self.val_losses.append((step, loss))

    def plot(self) -> None:
        """Redraws loss.png from every loss so far (a resumed run's include the checkpoint's)."""
        try:
            plot_losses(self.worker.stats.losses, self.val_losses, self.plot_path, title=self.title)
        except Exception as e:  # a picture must never stop training
            log.warning("could not draw %s: %s: %s", self.plot_path, type(e).__name__, e)


def checkpointer(
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    cfg: Config,
    model: RunModel,
    tracker: Optional[Tracker],
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    *,
    shards: bool = False,
) -> checkpoint.Checkpointer:
    """The checkpoint writer (``train.checkpoint_every``); replica 0 of each stage writes its layers, and with
    ``shards`` (sharding.ShardedVersions, or a streamed stage's float32 masters) every replica its pieces of the
    masters and optimizer state. Its
    manifests carry the run's lineage (the resumed checkpoint's, else a new one), which pruning keeps to."""
    train, optim, dist = cfg.train, cfg.optim, cfg.dist
    lineage = (resume[1].get("lineage") if resume is not None else None) or checkpoint.new_lineage()
    return checkpoint.Checkpointer(
        run_dir / checkpoint.DIRNAME,
        every=train.checkpoint_every,
        num_steps=rt.num_steps,
        keep=train.keep_checkpoints,
        rank=rt.rank,
        world_size=rt.world_size,
        layers=rt.layer_indices if rt.replica == 0 and rt.tensor_rank == 0 else [],  # tensor rank 0: whole tensors
        shard_layers=rt.layer_indices if shards else [],
        post=ctx.board.post,
        read=lambda keys, timeout_s: ctx.board.read(keys, timeout_s=timeout_s),
        timeout_s=dist.timeout_s,
        manifest={
            "schedule": rt.schedule,
            "optimizer": optimizer_name(optim),
            "num_layers": sum(rt.balance),
            "layout": rt.layout_record,
            "global_batch_size": rt.global_batch,
            "seed": rt.seed,
            "param_shapes": model.param_shapes() if rt.rank == 0 else {},
            "lineage": lineage,
            "model_settings": model.settings(cfg.model) if rt.rank == 0 else {},
            "training_settings": training_settings(cfg),
            "ties": [list(t.names) for t in model.tied],
            "wandb_run_id": tracker.run_id if tracker is not None else None,
            "precision": rt.precision,
            "hf": model.source.hf.manifest() if model.source is not None and model.source.hf is not None else None,
        },
    )


class StepHooks:
    """The worker's callbacks: ``on_close(t)`` when batch t's last backward ran, ``on_step(t)`` after its
    optimizer step (tie check, validation reports and passes, progress, checkpoint)."""

    def __init__(
        self,
        rt: RankPlan,
        *,
        worker: StageWorker,
        versions: WeightVersions,
        evaluator: Optional[evaluate.Evaluator],
        checker: Optional[ties.TieChecker],
        rule: StepRule,
        saver: checkpoint.Checkpointer,
        tracker: Optional[Tracker],
        record: Optional[RunRecord],
        progress: Callable[[int], None],
        postfix: Dict[str, str],
        tied: Sequence[ties.Tie],
        eval_every: int,
        preemption: Optional[preempt.Agreement] = None,
        bar: Any = None,
        split: Optional[TensorPart] = None,
    ):
        self.preemption, self.bar, self.split = preemption, bar, split
        self.rt, self.worker, self.versions, self.evaluator = rt, worker, versions, evaluator
        self.checker, self.rule, self.saver, self.tracker, self.record = checker, rule, saver, tracker, record
        self.progress, self.postfix, self.tied, self.eval_every = progress, postfix, tied, eval_every
        # float32 masters of their own (optim.sharded, train.weight_dtype=compute): at t > 1 a checkpoint stores them
        # as the weights (the versions are their rounding) and the optimizer state whole, no shard files
        self._masters = isinstance(versions, ShardedVersions)
        # step -> RNG states where its batch ended: a deferred APPLY runs after later batches' forwards
        self.rngs: Dict[int, Any] = {}

    def report_validation(self) -> bool:
        """Rank 0: logs the validation losses that have arrived (console, wandb, progress bar, metrics.jsonl).

        Returns:
            Whether any arrived.
        """
        arrived = self.evaluator.collect() if self.evaluator is not None else []
        for n, loss in arrived:
            self.tracker.log({"val/loss": loss, "val/perplexity": evaluate.perplexity(loss)}, step=n)
            self.record.validation(n, loss)
            self.postfix["val_loss"] = f"{loss:.4f}"
        return bool(arrived)

    def on_close(self, t: int) -> None:
        if self.saver.due(t + 1) or self.preemption is not None:  # a preemption may checkpoint any step
            self.rngs[t + 1] = checkpoint.rng_state()

    def _state(self) -> Dict[str, Any]:  # one tensor per tie: the canonical name's, written by its first holder
        # pipeline.tensor_parallel with float32 masters of their own: the pieces' masters and optimizer state first
        # gathered over the replicas (no shard files), then every tensor rank of replica 0 gathers whole tensors
        st = self.versions.whole_state() if self.split is not None and self._masters else self.versions.state()
        if self.split is not None:
            st = self.split.whole(st)
        # buffers training changes, as the resumed run's first forward must find them (pipeline/stateful.py)
        for k in ("weights", "previous"):
            if st.get(k) is not None:
                st[k].update(self.worker.buffers_at_start(st["step"]))
        return {
            **st,
            **{
                k: ties.drop_aliases(st[k], self.tied) if st[k] is not None else None
                for k in ("weights", "previous", "optimizer", "shards")
                if k in st
            },
        }

    def on_step(self, t: int) -> None:
        rank0, evaluator = self.rt.rank == 0, self.evaluator
        if self.checker is not None:
            self.checker(t)
        # passes of earlier steps: their losses were sent before batch t's, received in step t
        validated = self.report_validation()
        self.progress(t)
        if rank0 and (validated or self.saver.due(t + 1)) and t + 1 < self.rt.num_steps:  # the end: plotted last
            self.record.plot()
        st = self.worker.stats
        history = {"lrs": st.lrs, "grad_norms": st.grad_norms, "skipped_steps": st.skipped_steps} if rank0 else None
        if history is not None and isinstance(self.rule, ScaledStepRule):
            history["loss_scaler"] = self.rule.state_dict()
        if evaluator is not None and rank0:  # written in the background: it may list later passes, which a resume drops
            self.saver.manifest["val_losses"] = list(evaluator.losses)
        # Every rank reads the same flags after the same step: all stop here, or none.
        stop = self.preemption is not None and self.preemption.after_step(t)
        if stop and history is not None:
            history["preempted"] = logs.signal_name(self.preemption.signum)
        rt = self.rt
        if self.split is not None and (stop or self.saver.due(t + 1)):
            if rt.replica == 0 and rt.tensor_rank > 0:
                self._state()  # its pieces to the gather of the whole tensors, which its tensor rank 0 writes
            elif rt.replica > 0 and self._masters:  # its shards to replica 0's gathers over the replicas
                self.versions.whole_state(keep=False)
        self.saver.after_step(
            t + 1,
            self._state,
            st.losses if rank0 else None,
            history=history,
            rng=self.rngs.pop(t + 1, None),
            force=stop,
        )
        if stop:  # the validation pass due here, if any, is owed: the resumed run starts with it
            raise preempt.Preempted(t + 1, self.preemption.signum, self.preemption.received)
        if evaluator is not None and evaluate.due(t + 1, every=self.eval_every, num_steps=self.rt.num_steps):
            evaluator.run(self.versions.weights(), step=t + 1)


PROGRESS_EVERY_S = 10.0
"""Off a terminal (no progress bar), a step line at least this often, whatever ``train.log_every``."""


def progress_callback(
    train: TrainConfig,
    worker: StageWorker,
    tracker: "Tracker",
    bar: Any,
    *,
    samples_per_step: int,
    seq_len: int,
    postfix: Optional[Dict[str, str]] = None,
    metrics: Optional[MetricsLog] = None,
    device: Optional[torch.device] = None,
    first_step: int = 0,
) -> Callable[[int], None]:
    """Rank 0's per-step callback: advance the progress bar, append the step to ``metrics`` (metrics.jsonl);
    log loss, throughput and the time left every ``train.log_every`` steps, at the first and the last step, and
    off a terminal at least every ``PROGRESS_EVERY_S``.
    ``postfix``: more to show on the bar (the latest validation loss), updated by the caller."""
    start = time.perf_counter()
    window = {"start": start, "steps": 0, "last": start, "logged": start}
    device = device or torch.device("cpu")

    def on_step(t: int) -> None:
        now = time.perf_counter()
        window["steps"] += 1
        step_s, window["last"] = now - window["last"], now
        loss, lr, grad_norm = worker.stats.losses[-1], worker.stats.lrs[-1], worker.stats.grad_norms[-1]
        tracker.log({"loss": loss, "lr": lr, **({"grad_norm": grad_norm} if grad_norm is not None else {})}, step=t)
        # The time left at this run's mean step time so far (its first steps' warm-up included).
        eta_s = (train.num_steps - t - 1) * (now - start) / (t + 1 - first_step)
        if metrics is not None:
            metrics.write(
                {
                    "step": t + 1,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "samples_per_s": samples_per_step / step_s,
                    "tokens_per_s": samples_per_step * seq_len / step_s,
                    "step_time_s": step_s,
                    "memory_bytes": process_peak_bytes(device),
                    "eta_s": eta_s,
                    "time": time.time(),
                }
            )
        if not bar.disable:
            steps_per_s = bar.format_dict["rate"] or 0.0  # tqdm's smoothed steps/s
            bar.set_postfix(
                loss=f"{loss:.4f}",
                samples_per_s=f"{steps_per_s * samples_per_step:.1f}",
                **(postfix or {}),
                refresh=False,
            )
            bar.update(1)
        # every train.log_every steps, the last, the first (the run shows it trains at once), and one at least every
        # PROGRESS_EVERY_S off a terminal (issue 43: the default run said nothing between its 10-step lines)
        due = (t + 1) % train.log_every == 0 or t + 1 == train.num_steps or t == first_step
        if not due and (not bar.disable or now - window["logged"] < PROGRESS_EVERY_S):
            return
        rate = window["steps"] * samples_per_step / (now - window["start"])
        window.update(start=now, steps=0, logged=now)
        tracker.log({"samples_per_s": rate, "tokens_per_s": rate * seq_len}, step=t)
        norm = f" grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        left = f", {logs.format_duration(eta_s)} left" if t + 1 < train.num_steps else ""
        log.info(
            "step %d/%d loss %.4f lr %.4g%s %.1f samples/s %.0f tokens/s%s",
            t + 1,
            train.num_steps,
            loss,
            lr,
            norm,
            rate,
            rate * seq_len,
            left,
        )

    return on_step


def attach(
    cfg: Config,
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    model: RunModel,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    parts: build.Components,
) -> StepHooks:
    """The step hooks of this rank's worker, with rank 0's tracking (wandb, the bar, metrics.jsonl, loss.png)
    and the checkpoint writer they feed."""
    config = dataclasses.asdict(cfg) if rt.rank == 0 else None  # wandb logs the resolved config, defaults filled in
    tracker, bar, progress, postfix, record = tracking(
        rt, run_dir, resume, parts.worker, cfg.wandb, cfg.train, config=config
    )
    shards = isinstance(parts.versions, ShardedVersions) or getattr(parts.versions, "float32_masters", False)
    shards = shards and parts.split is None  # at t > 1 whole tensors: replica 0 writes the gathered optimizer state
    saver = checkpointer(rt, ctx, run_dir, cfg, model, tracker, resume, shards=shards)
    return StepHooks(
        rt,
        worker=parts.worker,
        versions=parts.versions,
        evaluator=parts.evaluator,
        checker=parts.groups.checker,
        rule=parts.rule,
        saver=saver,
        tracker=tracker,
        record=record,
        progress=progress,
        postfix=postfix,
        tied=model.tied,
        eval_every=cfg.train.eval_every,
        preemption=parts.preemption,
        bar=bar,
        split=parts.split,
    )
