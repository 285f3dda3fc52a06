"""One rank's training run: validate, start the groups, build the stage, run its schedule, save results."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from pipedream2bw import checkpoint, comm, evaluate, schedule, ties, timeline
from pipedream2bw import precision as precisions
from pipedream2bw.agreement import StepRule
from pipedream2bw.config import Config, ConfigError, GPTConfig, build_optimizer, optimizer_name, swap_stages, validate
from pipedream2bw.data import data_resident_bytes, make_feeds
from pipedream2bw.fileio import atomic_torch_save as save_state_dict
from pipedream2bw.fileio import atomic_write
from pipedream2bw.host_optim import HostOptimizerVersions
from pipedream2bw.layout import Layout, make_layout
from pipedream2bw.loss_scale import LossScaler, ScaledStepRule
from pipedream2bw.lr_schedule import lr_at
from pipedream2bw.models.factory import ModelSource, model_source
from pipedream2bw.results import summarize, write_summary
from pipedream2bw.schedule import BACKWARD, FORWARD, check_stage, shift_batches, stage_actions
from pipedream2bw.stage import Peers, StageStats, StageWorker
from pipedream2bw.swap import SwapManager, make_backend
from pipedream2bw.tracking import Tracker, progress_bar
from pipedream2bw.versions import WeightVersions, bucketize

log = logging.getLogger(__name__)

TRAIN_RANGE = "pipedream2bw.train"
"""torch.profiler range around each rank's training loop (not set-up, checkpoint waits or result gathering)."""


_log_prefix = ""


def set_log_prefix(prefix: str) -> None:
    """Prefixes every later log record of this process with ``prefix`` (e.g. ``[stage s/rank r]``)."""
    global _log_prefix
    if not _log_prefix:
        base = logging.getLogRecordFactory()

        def factory(*args, **kwargs):
            record = base(*args, **kwargs)
            if isinstance(record.msg, str):
                record.msg = _log_prefix + record.msg
            return record

        logging.setLogRecordFactory(factory)
    _log_prefix = prefix + " "


class RecomputeSequential(nn.Sequential):
    """``nn.Sequential`` that keeps only each layer's input for backward and re-runs the layer there
    (``pipeline.recompute``); parameter names are those of ``nn.Sequential``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x


def build_stage_module(
    cfg: Config,
    balance: Sequence[int],
    stage_index: int,
    layers: Optional[Sequence[nn.Module]],
    *,
    tied: Sequence[ties.Tie] = (),
    source: Optional[ModelSource] = None,
) -> nn.Sequential:
    """This stage's contiguous slice of the layer list, keyed by global layer index.

    Keys are the layers' positions in the whole list, so parameter names match those of
    ``nn.Sequential(*all_layers)``: a stage's state_dict is a slice of the full model's. Layers
    come from ``layers``, else from ``source`` (default: ``cfg.model``'s); the names of each of
    ``tied`` that this stage holds refer to one parameter.
    """
    start = sum(balance[:stage_index])
    indices = range(start, start + balance[stage_index])
    if layers is not None:
        own = [layers[i] for i in indices]
    else:
        own = (source or model_source(cfg.model, seed=cfg.seed)).build(indices)
    cls = RecomputeSequential if cfg.pipeline.recompute else nn.Sequential
    module = cls(OrderedDict((str(i), layer) for i, layer in zip(indices, own)))
    ties.retie(module, tied)
    return module


def run(
    cfg: Config,
    run_dir: Path,
    *,
    layers: Optional[Sequence[nn.Module]] = None,
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
    store: Optional[Any] = None,
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

    Raises:
        ConfigError: bad config, a model factory that does not import or returns no layer list, or
            parameters shared in a way the runtime cannot honour: before any process group starts.
        comm.PeerFailure: another rank failed first.
    """
    source = None if layers is not None else model_source(cfg.model, seed=cfg.seed)
    if loss_fn is None:
        loss_fn = source.loss_fn if source is not None else model_source(cfg.model, seed=cfg.seed).loss_fn
    tied = ties.find_ties(layers if layers is not None else source.meta())  # every rank, before any group
    rank, world_size, local_rank = comm.env_rank()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    set_log_prefix(f"[rank {rank}]")
    plan, agreed = None, None  # agreed: keys for what rank 0 decides before any group starts (plan, checkpoint)
    if cfg.partition.mode != "manual":
        if store is None:
            store = comm.make_store(rank=rank, world_size=world_size, timeout_s=cfg.dist.timeout_s)
        agreed = comm.run_scope(store)
        cfg, plan = _resolve_partition(
            cfg,
            agreed,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            run_dir=Path(run_dir),
            layers=layers,
            loss_fn=loss_fn,
        )
    gpt = layers is None and isinstance(cfg.model, GPTConfig)  # the GPT's own default split
    num_layers = None if gpt else len(layers) if layers is not None else source.num_layers
    balance = validate(cfg, world_size=world_size, num_layers=num_layers, local_world_size=local_world_size)
    layout = make_layout(
        cfg.pipeline.num_stages,
        cfg.pipeline.data_parallel,
        ranks_per_node=local_world_size,
        rank_map=cfg.pipeline.rank_map,
    )
    set_log_prefix(f"[stage {layout.position(rank)[0]}/rank {rank}]")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if store is None:  # made after validate: a bad config fails every rank at once, with no rendezvous
        store = comm.make_store(rank=rank, world_size=world_size, timeout_s=cfg.dist.timeout_s)
    resume = _choose_checkpoint(cfg, run_dir, agreed or comm.run_scope(store), rank, world_size, layers, source, tied)
    ctx = comm.init(
        store=store,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        backend=cfg.dist.backend,
        timeout_s=cfg.dist.timeout_s,
    )
    try:
        predictions = (
            {}
            if plan is None
            else {
                "predicted_samples_per_s": plan.predicted_samples_per_s,
                "predicted_peak_memory_bytes": list(plan.predicted_peak_memory_bytes),
                "plan": dataclasses.asdict(plan),  # logged to wandb as a table
            }
        )
        summary = _train(
            cfg, run_dir, ctx, layout, balance, layers, loss_fn, resume, predictions, source=source, tied=tied
        )
    except BaseException as e:
        first = ctx.monitor.report(layout.position(rank)[0], e)
        failed_here = first.startswith(f"rank {rank} ")
        if failed_here:
            log.error("%s", first, exc_info=True)
        else:
            log.error("stopping because %s (here: %s: %s)", first, type(e).__name__, e)
        ctx.monitor.leave()
        ctx.monitor.stop()  # this rank is out: its caller decides what happens next
        if failed_here:
            raise
        raise comm.PeerFailure(first) from e
    comm.shutdown(ctx)
    return summary


def _param_shapes(
    cfg: Config, layers: Optional[Sequence[nn.Module]], source: Optional[ModelSource] = None
) -> Dict[str, List[int]]:
    """Names and shapes of the whole model's state, as a checkpoint stores them (no memory used
    for a model from config: it is built on the meta device)."""
    if layers is None:
        layers = (source or model_source(cfg.model, seed=cfg.seed)).meta()
    return {k: list(v.shape) for k, v in nn.Sequential(*layers).state_dict().items()}


def _choose_checkpoint(
    cfg: Config,
    run_dir: Path,
    store: Any,
    rank: int,
    world_size: int,
    layers,
    source=None,
    tied: Sequence[ties.Tie] = (),
) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The checkpoint to resume from, per ``train.resume``: rank 0 chooses (verifying checksums,
    setting corrupt ones aside, refusing another model's) and every rank gets its choice,
    before any process group starts.

    Raises:
        ConfigError: on every rank, when the checkpoint asked for is missing, of another
            model, or already at ``train.num_steps``.
    """
    t = cfg.train
    if t.resume == "never":
        return None
    answer, key = None, "resume"
    if rank == 0:
        try:
            if t.resume == "auto":
                checkpoint.clear_partials(run_dir / checkpoint.DIRNAME)
            path, manifest = checkpoint.select(run_dir if t.resume == "auto" else Path(t.resume))
            if path is None and t.resume != "auto":
                raise ConfigError(
                    f"train.resume ({t.resume}) holds no complete checkpoint with intact files; "
                    f"point it at another checkpoint or use train.resume=never"
                )
            if path is not None:
                checkpoint.check_model(manifest, _param_shapes(cfg, layers, source), path)
                checkpoint.check_ties(manifest, [list(t.names) for t in tied], path)
                if manifest["step"] >= t.num_steps:
                    raise ConfigError(
                        f"checkpoint {path} is at step {manifest['step']}, and train.num_steps is {t.num_steps}: "
                        f"nothing left to train; raise train.num_steps"
                    )
            answer = json.dumps({"path": None if path is None else str(path)})
        except Exception as e:  # the other ranks wait for an answer: give them this one
            comm.share_from_rank0(
                store, key, json.dumps({"error": str(e), "config": isinstance(e, ConfigError)}), world_size=world_size
            )
            raise
    answer = json.loads(comm.share_from_rank0(store, key, answer, world_size=world_size))
    if "error" in answer:
        raise (ConfigError if answer["config"] else RuntimeError)(answer["error"])
    if answer["path"] is None:
        return None
    path = Path(answer["path"])
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    log.info("resuming from %s (step %d of %d)", path, manifest["step"], t.num_steps)
    return path, manifest


def _resolve_partition(
    cfg: Config,
    store: Any,
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    run_dir: Path,
    layers: Optional[Sequence[nn.Module]] = None,
    loss_fn: Optional[Callable] = None,
):
    """``partition=auto|file``: rank 0 plans (or reads the plan file) and shares the plan's text
    through the rendezvous store, before any process group starts; every rank applies it.

    Returns:
        (cfg with the plan's pipeline settings, the plan).

    Raises:
        ConfigError: on every rank, when rank 0 could not plan (e.g. nothing fits).
    """
    from partitioner.auto import PARTITION_MODES, apply_plan, plan_config, runtime_topology
    from partitioner.planner import load_plan, plan_from_text, plan_to_text, save_plan

    mode = cfg.partition.mode
    if mode not in PARTITION_MODES:
        raise ConfigError(f"partition.mode ({mode!r}) is unknown; use one of {list(PARTITION_MODES)}")
    key, text = "plan", None
    if rank == 0:
        try:
            if mode == "file":
                if not cfg.partition.path:
                    raise ConfigError("partition=file needs partition.path=<plan file>")
                text = plan_to_text(load_plan(cfg.partition.path))
            else:
                topo = runtime_topology(cfg.topology, world_size=world_size, local_world_size=local_world_size)
                best = plan_config(cfg, devices=world_size, topology=topo, layers=layers, loss_fn=loss_fn)[0]
                run_dir.mkdir(parents=True, exist_ok=True)
                save_plan(best, cfg.partition.path or run_dir / "plan.yaml")
                text = plan_to_text(best)
        except ConfigError as e:
            text = "ERROR " + str(e)
        except Exception as e:  # the other ranks wait for the plan: tell them, then fail here
            comm.share_from_rank0(
                store, key, f"ERROR rank 0 could not plan: {type(e).__name__}: {e}", world_size=world_size
            )
            raise
    text = comm.share_from_rank0(store, key, text if rank == 0 else None, world_size=world_size)
    if text.startswith("ERROR "):
        raise ConfigError(text[len("ERROR ") :])
    plan = plan_from_text(text)
    log.info(
        "partition=%s: %d stages x %d replicas, b=%d, m=%d, balance %s, recompute %s; predicted %.1f samples/s",
        mode,
        plan.num_stages,
        plan.data_parallel,
        plan.microbatch_size,
        plan.num_microbatches,
        plan.balance,
        plan.recompute,
        plan.predicted_samples_per_s,
    )
    return apply_plan(cfg, plan, world_size=world_size, num_layers=None if layers is None else len(layers)), plan


def _tie_groups(ctx: comm.DistContext, layout: Layout, tied: Sequence[ties.Tie], balance, module: nn.Module):
    """One process group per distinct set of ranks holding tied copies (made on every rank, in the
    same order); returns [(group, source rank, [(tie, parameter index in ``module``)])] for the
    groups this rank is in. The source, the first holder stage's replica 0, owns the canonical copy."""
    sets: Dict[Tuple[int, ...], List[ties.Tie]] = {}
    for tie in tied:
        stages = ties.holders(tie, balance)
        if len(stages) > 1:
            sets.setdefault(tuple(sorted(r for st in stages for r in layout.ranks[st])), []).append(tie)
    groups = comm.new_groups(ctx, list(sets)) if sets else []
    index = {id(q): i for i, q in enumerate(module.parameters())}
    mine = []
    for group, (ranks, group_ties) in zip(groups, sets.items()):
        if ctx.rank in ranks:
            src = layout.ranks[ties.holders(group_ties[0], balance)[0]][0]
            held = []
            for tie in group_ties:
                name = next(n for n in tie.names if n.split(".", 1)[0] in module._modules)
                held.append((tie, index[id(module.get_parameter(name))]))
            mine.append((group, src, held))
    return mine


def _train(
    cfg: Config,
    run_dir: Path,
    ctx: comm.DistContext,
    layout: Layout,
    balance,
    layers,
    loss_fn,
    resume,
    predictions,
    *,
    source: Optional[ModelSource] = None,
    tied: Sequence[ties.Tie] = (),
) -> Optional[Dict[str, Any]]:
    p = cfg.pipeline
    d, w, m, b = p.num_stages, p.data_parallel, p.num_microbatches, p.microbatch_size
    global_batch = w * m * b
    s, replica = layout.position(ctx.rank)
    torch.manual_seed(cfg.seed)
    module = build_stage_module(cfg, balance, s, layers, tied=tied, source=source).to(ctx.device)
    tie_groups = _tie_groups(ctx, layout, tied, balance, module)
    with torch.no_grad():  # every copy starts as the canonical one (a rank building its layers alone made its own)
        for group, src, held in tie_groups:
            for _, i in held:
                comm.broadcast(list(module.parameters())[i].data, src=src, group=group)
    # Tied parameters are summed across their holders (TieExchange), one bucket each, after the
    # data-parallel buckets that the GradReducer averages across this stage's replicas.
    params = list(module.parameters())
    tied_index = [i for _, _, held in tie_groups for _, i in held]
    rest = [i for i in range(len(params)) if i not in set(tied_index)]
    buckets = [
        [rest[j] for j in bucket] for bucket in bucketize([params[i] for i in rest], bucket_bytes=p.bucket_mb * 2**20)
    ]
    buckets = [bucket for bucket in buckets if bucket] + [[i] for i in tied_index]
    num_dp_buckets = len(buckets) - len(tied_index)
    versions = (HostOptimizerVersions if cfg.swap.optimizer == "host" else WeightVersions)(
        module,
        schedule=p.schedule,
        optimizer_factory=lambda params: build_optimizer(params, cfg.optim),
        buckets=buckets,
    )
    indices = [int(i) for i in module._modules]  # global layer indices
    first_batch = 0
    precision = precisions.resolve(cfg.train.precision, ctx.device.type)
    rule = StepRule(clip_grad_norm=cfg.optim.clip_grad_norm, on_nonfinite=cfg.train.on_nonfinite)
    if precision == "fp16":  # the loss scaler owns skipping; its scale changes reach batches one (2bw: two) later
        scaler = LossScaler(
            init_scale=cfg.train.loss_scale,
            growth_interval=cfg.train.loss_scale_growth_interval,
            min_scale=cfg.train.loss_scale_min,
        )
        rule = ScaledStepRule(
            scaler,
            lag=2 if p.schedule == "2bw" else 1,
            clip_grad_norm=cfg.optim.clip_grad_norm,
            on_nonfinite=cfg.train.on_nonfinite,
        )
    layout_record = {
        "num_stages": d,
        "data_parallel": w,
        "balance": list(balance),
        "rank_map": [list(r) for r in layout.ranks],
    }
    if resume is not None:
        path, manifest = resume
        first_batch = manifest["step"]
        state = checkpoint.load_layers(path, indices, ties=[list(t.names) for t in tied])
        if p.schedule == "2bw" and state["previous"] is None:
            log.warning(
                "%s holds one weight version (a %s run): batch %d runs with W(%d), not W(%d)",
                path,
                manifest["schedule"],
                first_batch,
                first_batch,
                first_batch - 1,
            )
        if manifest["global_batch_size"] != global_batch:
            log.warning(
                "%s was trained with global batch %d, this run uses %d: training continues, but not as the same run",
                path,
                manifest["global_batch_size"],
                global_batch,
            )
        if manifest["optimizer"] != optimizer_name(cfg.optim):
            log.warning(
                "%s holds %s state; this run's optimizer is %s: it starts afresh",
                path,
                manifest["optimizer"],
                optimizer_name(cfg.optim),
            )
            state["optimizer"] = {}
        versions.load_state(step=first_batch, **{k: state[k] for k in ("weights", "previous", "optimizer")})
        if isinstance(rule, ScaledStepRule) and manifest.get("loss_scaler") is not None:
            rule.load_state_dict(manifest["loss_scaler"])
        elif isinstance(rule, ScaledStepRule):
            log.warning(
                "%s holds no loss scaler state (a %s run): the loss scale starts afresh at %g",
                path,
                manifest.get("precision", "fp32"),
                rule.scaler.scale,
            )
        rng = checkpoint.load_rng(path, ctx.rank) if manifest["layout"] == layout_record else None
        if rng is not None:
            checkpoint.set_rng_state(rng)
    reducer = None
    if w > 1:  # every rank makes every stage's group, in the same order
        group = comm.new_groups(ctx, layout.ranks)[s]
        if num_dp_buckets:
            reducer = comm.GradReducer(
                ctx,
                group=group,
                replicas=[list(r.parameters()) for r in versions.replicas],
                buckets=buckets[:num_dp_buckets],
            )
    exchange = None
    if (
        tie_groups
    ):  # a copy whose canonical one (replica 0 of the first holder stage) is on another stage: norm counted there
        elsewhere = [i for _, src, held in tie_groups if layout.position(src)[0] != s for _, i in held]
        exchange = ties.TieExchange(
            comm, ctx, versions, [(g, [i for _, i in held]) for g, _, held in tie_groups], norm_excluded=elsewhere
        )
    checker = None
    if p.check_ties and tie_groups:
        checker = ties.TieChecker(
            comm,
            ctx,
            versions,
            [(g, [i for _, i in held], [t.canonical for t, _ in held]) for g, _, held in tie_groups],
        )
    # The step agreement's own group of all ranks, made (or not: the config decides) on every rank in the same order.
    agreement = (
        comm.AsyncSum(ctx, group=comm.new_groups(ctx, [range(ctx.world_size)])[0]) if rule.needs_agreement else None
    )
    peers = Peers(
        prev=layout.ranks[s - 1][replica] if s > 0 else None,
        next=layout.ranks[s + 1][replica] if s < d - 1 else None,
        loss_sources=tuple(layout.ranks[d - 1]) if ctx.rank == 0 else (),
    )
    feed = val_feed = None
    if s in (0, d - 1):  # only the first (inputs) and last (targets) stages open the data
        feed, val_feed = make_feeds(
            cfg.data,
            seq_len=cfg.model.seq_len,
            microbatch_size=b,
            num_microbatches=m,
            seed=cfg.seed,
            num_replicas=w,
            replica=replica,
        )
    evaluator = None
    if cfg.train.eval_every:  # its own group (made on every rank): validation transfers never queue behind training's
        evaluator = evaluate.Evaluator(
            prev=peers.prev,
            next=peers.next,
            loss_sources=peers.loss_sources,
            feed=val_feed,
            p2p=comm.P2P(ctx, group=comm.new_groups(ctx, [range(ctx.world_size)])[0]),
            num_microbatches=cfg.train.eval_batches * m,
            loss_fn=loss_fn,
            device=ctx.device,
            precision=precision,
        )
    in_flight_limit = m if p.schedule == "gpipe" else d - s

    def actions_of(stage: int) -> list:
        """A stage's actions for this run's batches, first_batch .. num_steps - 1 (this stage's checked)."""
        acts = stage_actions(
            p.schedule,
            stage_index=stage,
            num_stages=d,
            num_microbatches=m,
            num_batches=cfg.train.num_steps - first_batch,
        )
        if stage == s:
            check_stage(acts, num_microbatches=m, in_flight_limit=in_flight_limit)
        return shift_batches(acts, first_batch=first_batch, num_microbatches=m)

    actions = actions_of(s)
    receipts = (
        schedule.receipts(actions_of(s - 1), consumes=BACKWARD, signals=FORWARD) if s > 0 else {},
        schedule.receipts(actions_of(s + 1), consumes=FORWARD, signals=BACKWARD) if s < d - 1 else {},
    )
    swap = _swap_manager(cfg, s, min(in_flight_limit, m), versions, ctx.device)
    worker = StageWorker(
        stage_index=s,
        num_stages=d,
        num_microbatches=m,
        peers=peers,
        versions=versions,
        feed=feed,
        p2p=comm.P2P(ctx, batch_sends=cfg.dist.batch_p2p if cfg.dist.batch_p2p is not None else ctx.backend == "nccl"),
        loss_fn=loss_fn,
        device=ctx.device,
        reducer=reducer,
        grad_scale=1.0 / (m * w),
        swap=swap,
        receipts=receipts,
        replica=replica,
        step_rule=rule,
        agreement=agreement,
        lr_at=lambda t: lr_at(t, cfg.optim, num_steps=cfg.train.num_steps),
        exchanges=[exchange] if exchange is not None else [],
        precision=precision,
    )
    if p.trace:  # traced steps are counted from 0, whatever step a resumed run starts at
        first = max(first_batch, cfg.train.warmup_steps if p.trace_first_step is None else p.trace_first_step)
        if first + p.trace_steps <= cfg.train.num_steps:
            worker.trace = timeline.Recorder(first_step=first, num_steps=p.trace_steps, run_start=first_batch)
        else:
            log.warning(
                "pipeline.trace: steps %d..%d were trained before this resumed run; nothing traced",
                first,
                first + p.trace_steps - 1,
            )
    log.info(
        "%s schedule, %d stages x %d replicas, replica %d, balance %s, layers %s, %d all-reduce buckets, on %s (%s), precision %s",
        p.schedule,
        d,
        w,
        replica,
        balance,
        indices,
        num_dp_buckets,
        ctx.device,
        ctx.backend,
        precision,
    )
    for _, _, held in tie_groups:
        for tie, _ in held:
            log.info(
                "tied across stages %s: %s; gradients summed over its holders",
                ties.holders(tie, balance),
                ", ".join(tie.names),
            )
    if resume is not None and ctx.rank == 0:
        worker.stats.losses = list(resume[1]["losses"])
        worker.stats.lrs = list(
            resume[1].get("lrs", [None] * first_batch)
        )  # checkpoints before lrs were recorded: unknown
        worker.stats.grad_norms = list(resume[1].get("grad_norms", [None] * first_batch))
        worker.stats.skipped_steps = list(resume[1].get("skipped_steps", []))
    if resume is not None and evaluator is not None:  # keep the passes already run; a pass still owed runs first
        evaluator.losses = [(n, v) for n, v in resume[1].get("val_losses", []) if n <= first_batch]
        if first_batch % cfg.train.eval_every == 0 and first_batch not in {
            n for n, _ in resume[1].get("val_losses", [])
        }:
            evaluator.run(versions.newest(), step=first_batch)
    tracker = (
        Tracker(cfg, run_dir, run_id=resume[1].get("wandb_run_id") if resume is not None else None)
        if ctx.rank == 0
        else None
    )
    bar = progress_bar(cfg.train.num_steps, initial=first_batch) if ctx.rank == 0 else None
    postfix: Dict[str, str] = {}
    progress = (
        _progress(cfg, worker, tracker, bar, samples_per_step=global_batch, postfix=postfix)
        if ctx.rank == 0
        else (lambda t: None)
    )

    def report_validation() -> None:
        """Rank 0: logs the validation losses that have arrived (console, wandb, progress bar)."""
        for n, loss in evaluator.collect() if evaluator is not None else ():
            tracker.log({"val/loss": loss, "val/perplexity": evaluate.perplexity(loss)}, step=n)
            postfix["val_loss"] = f"{loss:.4f}"

    saver = checkpoint.Checkpointer(
        run_dir / checkpoint.DIRNAME,
        every=cfg.train.checkpoint_every,
        num_steps=cfg.train.num_steps,
        keep=cfg.train.keep_checkpoints,
        rank=ctx.rank,
        world_size=ctx.world_size,
        layers=indices if replica == 0 else [],
        post=ctx.board.post,
        read=lambda keys, timeout_s: ctx.board.read(keys, timeout_s=timeout_s),
        timeout_s=cfg.dist.timeout_s,
        manifest={
            "schedule": p.schedule,
            "optimizer": optimizer_name(cfg.optim),
            "num_layers": sum(balance),
            "layout": layout_record,
            "global_batch_size": global_batch,
            "seed": cfg.seed,
            "param_shapes": _param_shapes(cfg, layers, source) if ctx.rank == 0 else {},
            "ties": [list(t.names) for t in tied],
            "wandb_run_id": tracker.run_id if tracker is not None else None,
            "precision": precision,
        },
    )

    rngs = {}  # step -> RNG states where its batch ended: a deferred APPLY runs after later batches' forwards

    def on_close(t: int) -> None:
        if saver.due(t + 1):
            rngs[t + 1] = checkpoint.rng_state()

    def state() -> Dict[str, Any]:  # one tensor per tie: the canonical name's, written by its first holder
        st = versions.state()
        return {
            **st,
            **{
                k: ties.drop_aliases(st[k], tied) if st[k] is not None else None
                for k in ("weights", "previous", "optimizer")
            },
        }

    def on_step(t: int) -> None:
        if checker is not None:
            checker(t)
        report_validation()  # passes of earlier steps: their losses were sent before batch t's, received in step t
        progress(t)
        st = worker.stats
        history = (
            {"lrs": st.lrs, "grad_norms": st.grad_norms, "skipped_steps": st.skipped_steps} if ctx.rank == 0 else None
        )
        if history is not None and isinstance(rule, ScaledStepRule):
            history["loss_scaler"] = rule.state_dict()
        if (
            evaluator is not None and ctx.rank == 0
        ):  # written in the background: it may list later passes, which a resume drops
            saver.manifest["val_losses"] = list(evaluator.losses)
        saver.after_step(t + 1, state, st.losses if ctx.rank == 0 else None, history=history, rng=rngs.pop(t + 1, None))
        if evaluator is not None and evaluate.due(t + 1, every=cfg.train.eval_every, num_steps=cfg.train.num_steps):
            evaluator.run(versions.newest(), step=t + 1)

    with (
        logging_redirect_tqdm() if bar is not None and not bar.disable else contextlib.nullcontext(),
        torch.profiler.record_function(TRAIN_RANGE),
    ):
        stats = worker.run(actions, on_step=on_step, on_close=on_close)
    report_validation()
    if evaluator is not None:
        evaluator.close()
        stats.eval_s = evaluator.time_s
    stats.data_resident_bytes = data_resident_bytes(feed, val_feed)
    if bar is not None:
        bar.close()
    saver.wait()
    stats.replica, stats.checkpoint_s = replica, saver.write_s
    if reducer is not None:
        stats.allreduce_calls, stats.allreduce_exposed_s = reducer.num_collectives, reducer.exposed_s
    tie_record = {
        "tie_allreduce_calls": exchange.num_collectives if exchange else 0,
        "tie_exposed_s": exchange.exposed_s if exchange else 0.0,
        "tie_checked_steps": checker.steps_checked if checker else 0,
    }

    all_stats = comm.gather_to_rank0(ctx, stats)
    # Replicas hold equal weights: replica 0 of each stage contributes its slice of the model.
    shard = (
        ties.drop_aliases({k: v.detach().cpu() for k, v in versions.newest().state_dict().items()}, tied)
        if replica == 0
        else {}
    )
    shards = comm.gather_to_rank0(ctx, shard)
    tie_records = comm.gather_to_rank0(ctx, tie_record)
    if ctx.rank != 0:
        return None
    meta = {
        "schedule": p.schedule,
        "num_stages": d,
        "data_parallel": w,
        "num_microbatches": m,
        "microbatch_size": b,
        "global_batch_size": global_batch,
        "balance": balance,
        "rank_map": [list(r) for r in layout.ranks],
        "num_steps": cfg.train.num_steps,
        "seq_len": cfg.model.seq_len,
        "backend": ctx.backend,
        "device": ctx.device.type,
        "memory_kind": "cuda_max_allocated" if ctx.device.type == "cuda" else "process_peak_rss",
        "resumed_from": None if resume is None else str(resume[0]),
        "first_step": first_batch,
        "recompute": p.recompute,
        **predictions,
        **_precision_record(cfg, precision, rule, worker.stats),
        "ties": [
            {
                **t,
                "checked_steps": min(
                    (
                        r["tie_checked_steps"]
                        for r, (st, _) in zip(tie_records, _positions(layout, ctx.world_size))
                        if st in t["stages"]
                    ),
                    default=0,
                ),
            }
            for t in ties.describe(tied, balance)
        ],
        "tie_allreduce_calls": [r["tie_allreduce_calls"] for r in tie_records],
        "val_losses": [] if evaluator is None else [{"step": n, "loss": v} for n, v in evaluator.losses],
        "final_val_loss": evaluator.losses[-1][1] if evaluator is not None and evaluator.losses else None,
    }
    # Throughput counts the steps this run took; a resumed run may have fewer than the warm-up.
    warmup = min(cfg.train.warmup_steps, cfg.train.num_steps - first_batch - 1)
    summary = summarize(
        all_stats, meta=meta, warmup_steps=warmup, samples_per_step=global_batch, seq_len=cfg.model.seq_len
    )
    if worker.trace is not None:
        title = f"{p.schedule}, d={d}, w={w}, m={m}, b={b}"
        summary["trace"] = _save_trace(
            all_stats,
            run_dir,
            steps=range(worker.trace.first_step, worker.trace.first_step + p.trace_steps),
            title=title,
        )
    write_summary(summary, run_dir)
    # As the tied model's own state_dict: every name of a tie on one tensor.
    save_state_dict(
        ties.add_aliases({k: v for shard in shards for k, v in shard.items()}, tied), run_dir / "final_model.pt"
    )
    tracker.finish(summary)
    log.info(
        "done: loss %.4f -> %.4f, %.1f samples/s, %.0f tokens/s; results in %s",
        summary["losses"][0],
        summary["final_loss"],
        summary["samples_per_s"],
        summary["tokens_per_s"],
        run_dir,
    )
    return summary


def _positions(layout: Layout, world_size: int) -> List[Tuple[int, int]]:
    """(stage, replica) of every rank, in rank order."""
    return [layout.position(r) for r in range(world_size)]


def _precision_record(cfg: Config, precision: str, rule: StepRule, stats: StageStats) -> Dict[str, Any]:
    """summary.json's precision fields: the precision, its bytes per parameter, and under fp16 the loss scale."""
    record = {
        "precision": precision,
        "compute_dtype": str(precisions.compute_dtype(precision)).replace("torch.", ""),
        "bytes_per_parameter": precisions.param_memory(
            precision,
            schedule=cfg.pipeline.schedule,
            optimizer=optimizer_name(cfg.optim),
            optimizer_kwargs=cfg.optim.kwargs,
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


def _save_trace(all_stats: Sequence[StageStats], run_dir: Path, *, steps: range, title: str) -> Dict[str, Any]:
    """Writes trace.json (Chrome trace events, for Perfetto) and timeline.png; returns the measured bubble."""
    traces = [{"rank": st.rank, "stage": st.stage_index, "replica": st.replica, **st.trace} for st in all_stats]
    atomic_write(run_dir / "trace.json", json.dumps(timeline.chrome_trace(traces, title=title)).encode())
    timeline.plot_timeline(traces, run_dir / "timeline.png", title=title)
    return {**timeline.bubble_summary(traces), "steps": list(steps), "files": ["trace.json", "timeline.png"]}


def _swap_manager(
    cfg: Config, s: int, in_flight: int, versions: WeightVersions, device: torch.device
) -> Optional[SwapManager]:
    """Stage ``s``'s activation swapper, if ``cfg.swap`` selects it and it can help."""
    if s not in swap_stages(cfg.swap, cfg.pipeline.num_stages):
        return None
    if in_flight <= cfg.swap.resident + 1:
        log.warning(
            "swap: stage %d has at most %d microbatch(es) in flight and swap.resident=%d keeps %d of them besides the "
            "one computing: nothing to swap, so it does not",
            s,
            in_flight,
            cfg.swap.resident,
            cfg.swap.resident,
        )
        return None
    held = [t for r in versions.replicas for t in (*r.parameters(), *r.buffers())]  # never swapped
    log.info(
        "swap: activations of waiting microbatches >= %d bytes to host, %d kept on the device",
        cfg.swap.min_bytes,
        cfg.swap.resident,
    )
    return SwapManager(make_backend(device), min_bytes=cfg.swap.min_bytes, resident=cfg.swap.resident, exclude=held)


def _progress(
    cfg: Config,
    worker: StageWorker,
    tracker: "Tracker",
    bar: Any,
    *,
    samples_per_step: int,
    postfix: Optional[Dict[str, str]] = None,
) -> Callable[[int], None]:
    """Rank 0's per-step callback: advance the progress bar; log loss and throughput every ``train.log_every`` steps.
    ``postfix``: more to show on the bar (the latest validation loss), updated by the caller."""
    window = {"start": time.perf_counter(), "steps": 0}

    def on_step(t: int) -> None:
        window["steps"] += 1
        loss, lr, grad_norm = worker.stats.losses[-1], worker.stats.lrs[-1], worker.stats.grad_norms[-1]
        tracker.log({"loss": loss, "lr": lr, **({"grad_norm": grad_norm} if grad_norm is not None else {})}, step=t)
        if not bar.disable:
            steps_per_s = bar.format_dict["rate"] or 0.0  # tqdm's smoothed steps/s
            bar.set_postfix(
                loss=f"{loss:.4f}",
                samples_per_s=f"{steps_per_s * samples_per_step:.1f}",
                **(postfix or {}),
                refresh=False,
            )
            bar.update(1)
        if (t + 1) % cfg.train.log_every and t + 1 != cfg.train.num_steps:
            return
        now = time.perf_counter()
        rate = window["steps"] * samples_per_step / (now - window["start"])
        window.update(start=now, steps=0)
        tracker.log({"samples_per_s": rate, "tokens_per_s": rate * cfg.model.seq_len}, step=t)
        norm = f" grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        log.info(
            "step %d/%d loss %.4f lr %.4g%s %.1f samples/s %.0f tokens/s",
            t + 1,
            cfg.train.num_steps,
            loss,
            lr,
            norm,
            rate,
            rate * cfg.model.seq_len,
        )

    return on_step
