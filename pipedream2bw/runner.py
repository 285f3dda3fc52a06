"""One rank's training run: validate, start the groups, build the stage, run its schedule, save results."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm

from pipedream2bw import checkpoint, comm, evaluate, preempt, schedule, ties, timeline
from pipedream2bw import precision as precisions
from pipedream2bw.agreement import StepRule
from pipedream2bw.config import (
    Config,
    DataConfig,
    DistConfig,
    GPTConfig,
    OptimConfig,
    PipelineConfig,
    SwapConfig,
    TrainConfig,
    WandbConfig,
    build_optimizer,
    default_plan_choices,
    model_num_layers,
    optimizer_name,
    swap_stages,
    validate,
    validate_steps,
)
from pipedream2bw.data import data_resident_bytes, make_feeds
from pipedream2bw.errors import ConfigError
from pipedream2bw.fileio import atomic_symlink, atomic_write
from pipedream2bw.fileio import atomic_torch_save as save_state_dict
from pipedream2bw.host_optim import HostOptimizerVersions
from pipedream2bw.layout import Layout, make_layout
from pipedream2bw.loss_scale import LossScaler, ScaledStepRule
from pipedream2bw.lr_schedule import lr_at
from pipedream2bw.memprobe import process_peak_bytes
from pipedream2bw.models import lm_loss
from pipedream2bw.models.factory import ModelSource, model_source, read_vocab_size
from pipedream2bw.optimizers import extra_optim_settings, tag_muon_params
from pipedream2bw.results import summarize, write_summary
from pipedream2bw.runtime import RankPlan
from pipedream2bw.schedule import Action
from pipedream2bw.sharding import ShardedVersions
from pipedream2bw.stage import Peers, StageStats, StageWorker
from pipedream2bw.swap import SwapManager, make_backend
from pipedream2bw.tracking import LOSS_PLOT, MetricsLog, Tracker, plot_losses, progress_bar
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

    def forward(self, x: Any) -> Any:
        for layer in self:
            # A tuple or dict input goes in as its tensors: checkpoint saves tensor arguments (where
            # saved-tensor hooks, i.e. swapping, see them) and keeps anything else as a Python object.
            leaves, spec = pytree.tree_flatten(x)
            x = torch.utils.checkpoint.checkpoint(_call_unflattened, layer, spec, *leaves, use_reentrant=False)
        return x


def _call_unflattened(layer: nn.Module, spec: Any, *leaves: torch.Tensor) -> Any:
    return layer(pytree.tree_unflatten(list(leaves), spec))


def stage_module(
    indices: Sequence[int],
    layers: Optional[Sequence[nn.Module]],
    source: Optional[ModelSource],
    *,
    recompute: bool = False,
    tied: Sequence[ties.Tie] = (),
) -> nn.Sequential:
    """The layers ``indices`` of the whole list as one stage, keyed by global layer index.

    Keys are the layers' positions in the whole list, so parameter names match those of
    ``nn.Sequential(*all_layers)``: a stage's state_dict is a slice of the full model's. Layers
    come from ``layers``, else from ``source``; the names of each of ``tied`` that this stage holds
    refer to one parameter; ``recompute`` (``pipeline.recompute``) re-runs each layer in backward.
    """
    own = [layers[i] for i in indices] if layers is not None else source.build(indices)
    cls = RecomputeSequential if recompute else nn.Sequential
    module = cls(OrderedDict((str(i), layer) for i, layer in zip(indices, own)))
    ties.retie(module, tied)
    return module


def build_stage_module(
    cfg: Config,
    balance: Sequence[int],
    stage_index: int,
    layers: Optional[Sequence[nn.Module]],
    *,
    tied: Sequence[ties.Tie] = (),
    source: Optional[ModelSource] = None,
) -> nn.Sequential:
    """Stage ``stage_index``'s module (``stage_module``) of the model ``cfg.model`` describes (or of
    ``layers``, or ``source``) split by ``balance``: for tools and tests that hold a config."""
    start = sum(balance[:stage_index])
    indices = range(start, start + balance[stage_index])
    if layers is None:
        source = source or model_source(cfg.model, seed=cfg.seed)
    return stage_module(indices, layers, source, recompute=cfg.pipeline.recompute, tied=tied)


@dataclasses.dataclass(frozen=True)
class _Model:
    """The model a run trains: the caller's layer list, else the source that builds it from config;
    its loss and its parameters shared across layers."""

    layers: Optional[Sequence[nn.Module]]
    source: Optional[ModelSource]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    tied: Sequence[ties.Tie]

    @property
    def num_layers(self) -> int:
        return len(self.layers) if self.layers is not None else self.source.num_layers

    def whole(self) -> Sequence[nn.Module]:
        """The whole layer list: the caller's, else built on the meta device (no memory used)."""
        return self.layers if self.layers is not None else self.source.meta()

    def param_shapes(self) -> Dict[str, List[int]]:
        """Names and shapes of the whole model's state, as a checkpoint stores them."""
        return {k: list(v.shape) for k, v in nn.Sequential(*self.whole()).state_dict().items()}

    def vocab_size(self) -> Optional[int]:
        """The vocabulary its layers take (``read_vocab_size``; the head counts under next-token loss)."""
        return read_vocab_size(self.whole(), lm_head=self.loss_fn is lm_loss)

    def settings(self, model_cfg: Any) -> Dict[str, Any]:
        """What a checkpoint records of the model beyond its shapes, for a resume to compare: each layer's
        module types (a structural fingerprint) and, for a model from config, the settings that define it
        (``model.*`` but its name and initialisation: another ``model.num_heads`` has the same shapes)."""
        layers = self.layers if self.layers is not None else self.source.meta()
        record: Dict[str, Any] = {
            "fingerprint": [
                type(layer).__name__
                + "("
                + ", ".join(f"{n}: {type(m).__name__}" for n, m in layer.named_modules() if n)
                + ")"
                for layer in layers
            ]
        }
        if self.layers is None and dataclasses.is_dataclass(model_cfg):
            # not what only starts or exports it: a name, the initialisation, the weights it was started from
            ignored = ("name", "init_std", "pretrained", "export_dtype")
            defining = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in ignored}
            record.update({f"model.{k}": v for k, v in defining.items()})
        return json.loads(json.dumps(record, default=str))  # as the manifest holds it


def training_settings(cfg: Config) -> Dict[str, Any]:
    """What a checkpoint records of the training that a resume must continue unchanged (not the layout:
    a resume at another num_stages or data_parallel is the same training)."""
    o = cfg.optim
    on_cuda = cfg.dist.backend == "nccl" or (cfg.dist.backend == "auto" and torch.cuda.is_available())
    precision = precisions.resolve(cfg.train.precision, "cuda" if on_cuda else "cpu")
    record = {
        "train.precision": precision,
        # what the forwards read: float32 versions, or versions rounded to the compute dtype (under fp32 the same).
        # The checkpoint holds float32 masters either way, but the arithmetic that follows differs, as a
        # train.precision change's does: refused, unless train.resume_strict=false
        "train.weight_dtype": "compute"
        if precisions.weight_dtype(precision, cfg.train.weight_dtype) != torch.float32
        else "fp32",
        # flush and gpipe both train W(t+1) = W(t) - step(grad f(W(t))); 2bw uses W(t-1)
        "pipeline.schedule": "2bw" if cfg.pipeline.schedule == "2bw" else "flush or gpipe",
        "optim": optimizer_name(o),
        "optim.kwargs": dict(o.kwargs),
        "optim.no_decay_norms_and_biases": o.no_decay_norms_and_biases,
        "optim.lr": o.lr,
        "optim.scheduler": o.scheduler,
        "optim.warmup_steps": o.warmup_steps,
        "optim.min_lr": o.min_lr,
    }
    record.update(extra_optim_settings(o))  # Muon's and the delay correction's, where set
    return json.loads(json.dumps(record, default=str))


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
    with preempt.Watch(cfg.train.preempt_signals) as watch:
        return _run(cfg, run_dir, layers=layers, loss_fn=loss_fn, store=store, watch=watch, on_start=on_start)


def _run(
    cfg: Config,
    run_dir: Path,
    *,
    layers: Optional[Sequence[nn.Module]],
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]],
    store: Optional[Any],
    watch: preempt.Watch,
    on_start: Optional[Callable[[], None]],
) -> Optional[Dict[str, Any]]:
    """``run``, with ``watch`` noting preemption signals."""
    source = None if layers is not None else model_source(cfg.model, seed=cfg.seed)
    if loss_fn is None:
        loss_fn = source.loss_fn if source is not None else model_source(cfg.model, seed=cfg.seed).loss_fn
    tied = ties.find_ties(layers if layers is not None else source.meta())  # every rank, before any group
    model = _Model(layers, source, loss_fn, tied)
    rank, world_size, local_rank = comm.env_rank()
    configure_logging(Path(run_dir))
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
            model=model,
        )
    cfg = default_plan_choices(cfg)  # what no plan chose and the run left null
    gpt = layers is None and isinstance(cfg.model, GPTConfig)  # the GPT's own default split
    num_layers = None if gpt else model.num_layers
    balance = validate(
        cfg,
        world_size=world_size,
        num_layers=num_layers,
        local_world_size=local_world_size,
        layers_vocab_size=None if gpt else model.vocab_size(),
    )
    if cfg.train.export_hf is not None and model.source is None:
        raise ConfigError("train.export_hf needs model=hf built from config, not a layer list passed to run()")
    precision = precisions.resolve(cfg.train.precision, "cuda" if torch.cuda.is_available() else "cpu")
    if model.tied and cfg.train.weight_dtype == "compute" and precision != "fp32":  # ties of any model, found here
        raise ConfigError(
            f"train.weight_dtype (compute) with tied weights ({[list(t.names) for t in model.tied]}): the tie's "
            "float32 gradient sum across stages is not written yet; set train.weight_dtype=fp32 or untie them"
        )
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
    resume = _choose_checkpoint(cfg, run_dir, agreed or comm.run_scope(store), rank, world_size, model)
    if rank == 0:  # after the checkpoint is chosen: train.resume=outputs/latest means the run before this one
        link_latest(run_dir)
    if on_start is not None:
        on_start()
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
        rt = RankPlan.from_config(cfg, layout=layout, balance=balance, ctx=ctx, resume=resume)
        summary, preempted = _train(cfg, rt, ctx, run_dir, model, resume, predictions, watch=watch)
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
    if preempted is not None:
        raise preempted
    return summary


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""Hydra's default job-logging format, which the CLI's train.log and console use."""


def configure_logging(run_dir: Path) -> None:
    """Logs as the CLI does when the caller configured no logging (a programmatic ``run()``):
    INFO and up to stderr and to ``<run_dir>/train.log``, in Hydra's format. Leaves logging
    alone if the root logger has a handler already (Hydra's, or the caller's own)."""
    root = logging.getLogger()
    if root.handlers:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter(LOG_FORMAT)
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(run_dir / "train.log")):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def link_latest(run_dir: Path, *, cwd: Optional[Path] = None) -> Optional[Path]:
    """Points ``<results folder>/latest`` at ``run_dir``: ``outputs/latest`` -> ``2026-11-23/10-48-49``.

    The results folder is the first folder of ``run_dir``'s path below the working directory
    (``outputs`` for ``outputs/<date>/<time>``, also for a multirun's and a sweep's jobs under
    ``outputs/multirun/`` and ``outputs/sweeps/``). The link is relative, so the folder can move,
    and replaced atomically (``fileio.atomic_symlink``). Nothing is linked for a run directory that
    is not at least two folders below the working directory.

    Returns:
        The link, or None.
    """
    try:
        rel = Path(run_dir).resolve().relative_to((cwd or Path.cwd()).resolve())
    except ValueError:  # not below the working directory
        return None
    if len(rel.parts) < 2:
        return None
    link = (cwd or Path.cwd()) / rel.parts[0] / "latest"
    atomic_symlink(Path(*rel.parts[1:]), link)
    return link


def _choose_checkpoint(
    cfg: Config, run_dir: Path, store: Any, rank: int, world_size: int, model: _Model
) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The checkpoint to resume from, per ``train.resume``: rank 0 chooses (verifying checksums,
    setting corrupt ones aside, refusing another model's or other settings') and every rank gets its
    choice, before any process group starts. Rank 0 first removes what an interrupted prune left.

    Raises:
        ConfigError: on every rank, when the checkpoint asked for is missing, of another
            model or settings, already at ``train.num_steps``, or when checkpoints are there
            but none can be loaded (``checkpoint.NoLoadableCheckpoint``).
    """
    t = cfg.train
    if rank == 0:
        checkpoint.clean_leftovers(run_dir / checkpoint.DIRNAME)
    if t.resume == "never":
        return None
    answer, key = None, "resume"
    if rank == 0:
        try:
            if t.resume == "auto":
                checkpoint.clear_partials(run_dir / checkpoint.DIRNAME)
            # resolved: a link (outputs/latest) may be re-pointed at this run before the other ranks read it
            path, manifest = checkpoint.select(run_dir if t.resume == "auto" else Path(t.resume).resolve())
            if path is None and t.resume != "auto":
                raise ConfigError(
                    f"train.resume ({t.resume}) holds no complete checkpoint with intact files; "
                    f"point it at another checkpoint or use train.resume=never"
                )
            if path is not None:
                checkpoint.check_model(manifest, model.param_shapes(), path)
                checkpoint.check_ties(manifest, [list(t.names) for t in model.tied], path)
                checkpoint.check_settings(
                    manifest,
                    model=model.settings(cfg.model),
                    training=training_settings(cfg),
                    where=path,
                    strict=t.resume_strict,
                )
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
    model: _Model,
):
    """``partition=auto|file``: rank 0 plans (or reads the plan file) and shares the plan's text
    through the rendezvous store, before any process group starts; every rank applies it.

    Returns:
        (cfg with the plan's pipeline settings, its optim.sharded and train.weight_dtype, the plan).

    Raises:
        ConfigError: on every rank, when rank 0 could not plan (e.g. nothing fits), or the run sets an
            optim.sharded or train.weight_dtype that the plan contradicts.
    """
    from partitioner.auto import PARTITION_MODES, apply_choices, apply_plan, plan_config, runtime_topology
    from partitioner.planner import load_plan, plan_from_text, plan_to_text, save_plan

    mode = cfg.partition.mode
    validate_steps(cfg.train)  # before profiling and planning, which take a while
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
                best = plan_config(cfg, devices=world_size, topology=topo, layers=model.layers, loss_fn=model.loss_fn)[
                    0
                ]
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
        "partition=%s: %d stages x %d replicas, b=%d, m=%d, balance %s, recompute %s, sharded %s, weight_dtype %s; "
        "predicted %.1f samples/s",
        mode,
        plan.num_stages,
        plan.data_parallel,
        plan.microbatch_size,
        plan.num_microbatches,
        plan.balance,
        plan.recompute,
        plan.sharded,
        plan.weight_dtype,
        plan.predicted_samples_per_s,
    )
    precision = precisions.resolve(cfg.train.precision, "cuda" if torch.cuda.is_available() else "cpu")
    optim, train = apply_choices(cfg.optim, cfg.train, plan, precision=precision)
    gpt = model.layers is None and isinstance(cfg.model, GPTConfig)
    num_layers = model_num_layers(cfg.model) if gpt else model.num_layers
    pipeline, swap = apply_plan(cfg.pipeline, cfg.swap, plan, world_size=world_size, num_layers=num_layers)
    return dataclasses.replace(cfg, pipeline=pipeline, swap=swap, optim=optim, train=train), plan


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
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    model: _Model,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    predictions: Dict[str, Any],
    *,
    watch: preempt.Watch,
) -> Tuple[Optional[Dict[str, Any]], Optional[preempt.Preempted]]:
    """This rank's run as named steps; each takes ``rt`` and only the config sections it uses.

    Every rank makes every process group, in the same order: the ties' (build), the stages'
    data-parallel ones and the step agreement's (groups), the evaluator's (data), the preemption
    flag's (``train.preempt_signals``).

    Returns:
        (the summary on rank 0, else None; ``preempt.Preempted`` if a signal stopped the run, else None).
    """
    module, tie_groups = _build_stage(rt, ctx, model)
    versions, buckets, num_dp_buckets = _build_versions(
        rt,
        module,
        tie_groups,
        bucket_mb=cfg.pipeline.bucket_mb,
        swap=cfg.swap,
        optim=cfg.optim,
        weight_dtype_name=cfg.train.weight_dtype,
    )
    rule = _step_rule(rt, cfg.train, cfg.optim)
    if resume is not None:
        _restore(rt, resume, versions, rule, optim=cfg.optim, tied=model.tied)
    groups = _comm_groups(rt, ctx, versions, buckets[:num_dp_buckets], tie_groups, rule, cfg.pipeline.check_ties)
    peers = _peers(rt)
    feed, val_feed, evaluator = _data(rt, ctx, peers, cfg.data, cfg.train, model.loss_fn)
    stop_rule = None
    if watch.signals:  # a CPU scalar per step on a gloo group of its own: no device sync, no queueing behind training
        channel = None
        if ctx.world_size > 1:
            channel = comm.AsyncSum(ctx, group=comm.new_groups(ctx, [range(ctx.world_size)], backend="gloo")[0])
        stop_rule = preempt.Agreement(watch, channel, last_step=rt.num_steps - 1)
    actions = _actions(rt, batch_sends=_batch_sends(cfg.dist, rt))
    in_flight = schedule.in_flight(rt.schedule, rt.stage, rt.num_stages, rt.num_microbatches)
    swap = _swap_manager(cfg.swap, rt, in_flight, versions)
    worker = _worker(
        rt,
        ctx,
        peers,
        versions,
        feed,
        model.loss_fn,
        groups,
        rule,
        swap,
        cfg.optim,
        cfg.dist,
        model.tied,
        # on_step passes through the stages (validation, the tie check): a sharded APPLY keeps apply_due's point
        early_apply=not (cfg.train.eval_every or cfg.pipeline.check_ties),
    )
    _trace(rt, worker, cfg.pipeline, warmup_steps=cfg.train.warmup_steps)
    _log_start(rt, num_dp_buckets, tie_groups)
    if rt.rank == 0:
        _log_run(rt, cfg, model, feed, val_feed)
    if resume is not None:
        _resume_history(rt, resume, worker, evaluator, versions, eval_every=cfg.train.eval_every)
    config = dataclasses.asdict(cfg) if rt.rank == 0 else None  # wandb logs the resolved config, defaults filled in
    tracker, bar, progress, postfix, record = _tracking(
        rt, run_dir, resume, worker, cfg.wandb, cfg.train, config=config
    )
    saver = _checkpointer(rt, ctx, run_dir, cfg, model, tracker, resume, shards=isinstance(versions, ShardedVersions))
    hooks = _StepHooks(
        rt,
        worker=worker,
        versions=versions,
        evaluator=evaluator,
        checker=groups.checker,
        rule=rule,
        saver=saver,
        tracker=tracker,
        record=record,
        progress=progress,
        postfix=postfix,
        tied=model.tied,
        eval_every=cfg.train.eval_every,
        preemption=stop_rule,
    )
    preempted = None
    with (
        logging_redirect_tqdm() if bar is not None and not bar.disable else contextlib.nullcontext(),
        torch.profiler.record_function(TRAIN_RANGE),
    ):
        try:
            stats = worker.run(actions, on_step=hooks.on_step, on_close=hooks.on_close)
        except preempt.Preempted as e:  # every rank, after the same step: the rest of its actions is dropped
            preempted, stats = e, worker.stats
            worker._measure_memory()
    hooks.report_validation()
    tie_record = _close(rt, stats, evaluator, feed, val_feed, bar, saver, groups)
    if preempted is not None and rt.rank == 0:
        log.warning(
            "preempted by %s: every rank stopped after step %d of %d; checkpoint %s; exiting with %d to be requeued",
            signal_name(preempted.signum),
            preempted.step,
            rt.num_steps,
            checkpoint.step_dir(run_dir / checkpoint.DIRNAME, preempted.step),
            preempted.exit_code,
        )
    final = None
    if preempted is None:  # the checkpoint holds a preempted run's weights
        final = _final_weights(rt, versions, cfg.train)
        _write_final(rt, ctx, run_dir, state=final, model=model, train=cfg.train, dist=cfg.dist)
    summary = _gather_and_write(
        rt,
        ctx,
        run_dir,
        stats=stats,
        tie_record=tie_record,
        worker=worker,
        final=final,
        evaluator=evaluator,
        rule=rule,
        model=model,
        resume=resume,
        predictions=predictions,
        tracker=tracker,
        record=record,
        pipeline=cfg.pipeline,
        train=cfg.train,
        optim=cfg.optim,
        preempted=preempted,
    )
    return summary, preempted


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _build_stage(
    rt: RankPlan, ctx: comm.DistContext, model: _Model
) -> Tuple[nn.Module, List[Tuple[Any, int, List[Tuple[ties.Tie, int]]]]]:
    """This rank's stage module on its device and the groups of its tied parameters (``_tie_groups``),
    every tied copy set to its canonical one."""
    torch.manual_seed(rt.seed)
    module = stage_module(rt.layer_indices, model.layers, model.source, recompute=rt.recompute, tied=model.tied)
    module = module.to(rt.device)
    tie_groups = _tie_groups(ctx, rt.layout, model.tied, rt.balance, module)
    with torch.no_grad():  # every copy starts as the canonical one (a rank building its layers alone made its own)
        for group, src, held in tie_groups:
            for _, i in held:
                comm.broadcast(list(module.parameters())[i].data, src=src, group=group)
    return module, tie_groups


def _build_versions(
    rt: RankPlan,
    module: nn.Module,
    tie_groups,
    *,
    bucket_mb: float,
    swap: SwapConfig,
    optim: OptimConfig,
    weight_dtype_name: str = "fp32",
) -> Tuple[WeightVersions, List[List[int]], int]:
    """The stage's weight versions and optimizer, with its gradient buckets.

    Returns:
        (versions, buckets as parameter indices, how many of them are data-parallel ones).
    """
    # Tied parameters are summed across their holders (TieExchange), one bucket each, after the
    # data-parallel buckets that the GradReducer averages across this stage's replicas.
    params = list(module.parameters())
    tied_index = [i for _, _, held in tie_groups for _, i in held]
    rest = [i for i in range(len(params)) if i not in set(tied_index)]
    buckets = [
        [rest[j] for j in bucket] for bucket in bucketize([params[i] for i in rest], bucket_bytes=bucket_mb * 2**20)
    ]
    buckets = [bucket for bucket in buckets if bucket] + [[i] for i in tied_index]
    num_dp_buckets = len(buckets) - len(tied_index)
    if rt.schedule != "2bw" and optim.delay_correction != "none":  # flush, gpipe: no delay, nothing to correct
        optim = dataclasses.replace(optim, delay_correction="none")
    if not optim.target and optim.name.lower() == "muon":  # which parameters Muon takes: see OptimConfig.muon_exclude
        tag_muon_params(module, optim.muon_exclude)
    factory = lambda params: build_optimizer(params, optim)  # noqa: E731
    sharded = optim.sharded and rt.data_parallel > 1
    weight_dtype = precisions.weight_dtype(rt.precision, weight_dtype_name)
    if sharded or weight_dtype != torch.float32:  # the replicas' group ranks are sorted global ranks
        versions = ShardedVersions(
            module,
            schedule=rt.schedule,
            optimizer_factory=factory,
            buckets=buckets,
            num_sharded=num_dp_buckets if sharded else 0,
            shard_index=sorted(rt.layout.ranks[rt.stage]).index(rt.rank),
            num_shards=rt.data_parallel if sharded else 1,
            host=swap.optimizer == "host",
            weight_dtype=weight_dtype,
        )
    else:
        versions = (HostOptimizerVersions if swap.optimizer == "host" else WeightVersions)(
            module, schedule=rt.schedule, optimizer_factory=factory, buckets=buckets
        )
    return versions, buckets, num_dp_buckets


def _step_rule(rt: RankPlan, train: TrainConfig, optim: OptimConfig) -> StepRule:
    """What a step does with its gradient: clip, and skip or stop on non-finite values (fp16: the loss scaler's)."""
    if rt.precision != "fp16":
        return StepRule(clip_grad_norm=optim.clip_grad_norm, on_nonfinite=train.on_nonfinite)
    # The loss scaler owns skipping; its scale changes reach batches one (2bw: two) later.
    scaler = LossScaler(
        init_scale=train.loss_scale,
        growth_interval=train.loss_scale_growth_interval,
        min_scale=train.loss_scale_min,
    )
    return ScaledStepRule(
        scaler,
        lag=2 if rt.schedule == "2bw" else 1,
        clip_grad_norm=optim.clip_grad_norm,
        on_nonfinite=train.on_nonfinite,
    )


def _restore(
    rt: RankPlan,
    resume: Tuple[Path, Dict[str, Any]],
    versions: WeightVersions,
    rule: StepRule,
    *,
    optim: OptimConfig,
    tied: Sequence[ties.Tie],
) -> None:
    """Loads this stage's weights, optimizer, loss scaler and (under the same layout) RNG states from the checkpoint."""
    path, manifest = resume
    first_batch = rt.first_step
    state = checkpoint.load_layers(path, rt.layer_indices, ties=[list(t.names) for t in tied])
    if rt.schedule == "2bw" and state["previous"] is None:
        log.warning(
            "%s holds one weight version (a %s run): batch %d runs with W(%d), not W(%d)",
            path,
            manifest["schedule"],
            first_batch,
            first_batch,
            first_batch - 1,
        )
    if manifest["global_batch_size"] != rt.global_batch:
        log.warning(
            "%s was trained with global batch %d, this run uses %d: training continues, but not as the same run",
            path,
            manifest["global_batch_size"],
            rt.global_batch,
        )
    if manifest["optimizer"] != optimizer_name(optim):
        log.warning(
            "%s holds %s state; this run's optimizer is %s: it starts afresh",
            path,
            manifest["optimizer"],
            optimizer_name(optim),
        )
        state["optimizer"] = {}
    masters = state["masters"]  # float32 masters of a sharded or weight_dtype=compute run: the truer weights
    if isinstance(versions, ShardedVersions):
        versions.load_state(
            step=first_batch, masters=masters, **{k: state[k] for k in ("weights", "previous", "optimizer")}
        )
    else:
        weights = {**state["weights"], **masters}
        versions.load_state(step=first_batch, weights=weights, previous=state["previous"], optimizer=state["optimizer"])
    if isinstance(rule, ScaledStepRule) and manifest.get("loss_scaler") is not None:
        rule.load_state_dict(manifest["loss_scaler"])
    elif isinstance(rule, ScaledStepRule):
        log.warning(
            "%s holds no loss scaler state (a %s run): the loss scale starts afresh at %g",
            path,
            manifest.get("precision", "fp32"),
            rule.scaler.scale,
        )
    rng = checkpoint.load_rng(path, rt.rank) if manifest["layout"] == rt.layout_record else None
    if rng is not None:
        checkpoint.set_rng_state(rng)


class _Groups(NamedTuple):
    """What this rank talks to its peers through besides p2p (None: not needed by this run)."""

    reducer: Optional[comm.GradReducer]  # averages the data-parallel buckets over the stage's replicas
    exchange: Optional[ties.TieExchange]  # sums tied gradients over their holders
    checker: Optional[ties.TieChecker]  # pipeline.check_ties: checks tied copies stay equal
    agreement: Optional[comm.AsyncSum]  # the step rule's sums over all ranks


def _comm_groups(
    rt: RankPlan,
    ctx: comm.DistContext,
    versions: WeightVersions,
    dp_buckets: List[List[int]],
    tie_groups,
    rule: StepRule,
    check_ties: bool,
) -> _Groups:
    """The gradient all-reduce, tie exchange and checker, and step agreement of this rank."""
    reducer = None
    if rt.data_parallel > 1:  # every rank makes every stage's group, in the same order
        group = comm.new_groups(ctx, rt.layout.ranks)[rt.stage]
        if dp_buckets:
            reducer = comm.GradReducer(
                ctx,
                group=group,
                replicas=[list(r.parameters()) for r in versions.replicas],
                buckets=dp_buckets,
                sharded=isinstance(versions, ShardedVersions) and versions.num_sharded > 0,
            )
        if isinstance(versions, ShardedVersions) and versions.num_sharded > 0:
            versions.connect(lambda shard, full: comm.all_gather_async(ctx, shard, full, group=group))
    exchange = None
    if tie_groups:  # a copy whose canonical one (replica 0 of the first holder stage) is on another stage: norm there
        elsewhere = [i for _, src, held in tie_groups if rt.layout.position(src)[0] != rt.stage for _, i in held]
        exchange = ties.TieExchange(
            comm, ctx, versions, [(g, [i for _, i in held]) for g, _, held in tie_groups], norm_excluded=elsewhere
        )
    checker = None
    if check_ties and tie_groups:
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
    return _Groups(reducer, exchange, checker, agreement)


def _peers(rt: RankPlan) -> Peers:
    """This rank's neighbours in its replica's pipeline; rank 0 also hears every replica's loss from the last stage."""
    return Peers(
        prev=rt.prev_rank,
        next=rt.next_rank,
        loss_sources=tuple(rt.layout.ranks[rt.num_stages - 1]) if rt.rank == 0 else (),
    )


def _data(
    rt: RankPlan, ctx: comm.DistContext, peers: Peers, data: DataConfig, train: TrainConfig, loss_fn: Callable
) -> Tuple[Any, Any, Optional[evaluate.Evaluator]]:
    """The training and validation feeds (first and last stages only) and the evaluator (``train.eval_every``).

    Returns:
        (training feed, validation feed, evaluator), None where this rank has none.
    """
    feed = val_feed = None
    if rt.stage in (0, rt.num_stages - 1):  # only the first (inputs) and last (targets) stages open the data
        feed, val_feed = make_feeds(
            data,
            seq_len=rt.seq_len,
            microbatch_size=rt.microbatch_size,
            num_microbatches=rt.num_microbatches,
            seed=rt.seed,
            num_replicas=rt.data_parallel,
            replica=rt.replica,
        )
    evaluator = None
    if train.eval_every:  # its own group (made on every rank): validation transfers never queue behind training's
        evaluator = evaluate.Evaluator(
            prev=peers.prev,
            next=peers.next,
            loss_sources=peers.loss_sources,
            feed=val_feed,
            p2p=comm.P2P(ctx, group=comm.new_groups(ctx, [range(ctx.world_size)])[0]),
            num_microbatches=train.eval_batches * rt.num_microbatches,
            loss_fn=loss_fn,
            device=rt.device,
            precision=rt.precision,
            # weights stored in the compute dtype (train.weight_dtype=compute): the stage runs in it, as in training
            upcast=precisions.weight_dtype(rt.precision, train.weight_dtype) == torch.float32,
        )
    return feed, val_feed, evaluator


def _batch_sends(dist: DistConfig, rt: RankPlan) -> bool:
    """Whether sends are held for the next receive (``dist.batch_p2p``; null: under NCCL)."""
    return dist.batch_p2p if dist.batch_p2p is not None else rt.backend == "nccl"


def _actions(rt: RankPlan, *, batch_sends: bool) -> List[Action]:
    """This rank's actions for this run's batches, checked and with its communication lowered."""
    return schedule.rank_actions(
        rt.schedule,
        stage_index=rt.stage,
        num_stages=rt.num_stages,
        num_microbatches=rt.num_microbatches,
        first_batch=rt.first_step,
        num_batches=rt.num_steps - rt.first_step,
        batch_sends=batch_sends,
    )


def _worker(
    rt: RankPlan,
    ctx: comm.DistContext,
    peers: Peers,
    versions: WeightVersions,
    feed: Any,
    loss_fn: Callable,
    groups: _Groups,
    rule: StepRule,
    swap: Optional[SwapManager],
    optim: OptimConfig,
    dist: DistConfig,
    tied: Sequence[ties.Tie],
    *,
    early_apply: bool = True,
) -> StageWorker:
    """The stage worker that runs this rank's actions (``early_apply``: StageWorker's)."""
    m, w = rt.num_microbatches, rt.data_parallel
    exchanged = any(len(ties.holders(tie, rt.balance)) > 1 for tie in tied)  # on some stages, maybe not this one
    return StageWorker(
        stage_index=rt.stage,
        num_stages=rt.num_stages,
        num_microbatches=m,
        peers=peers,
        versions=versions,
        feed=feed,
        p2p=comm.P2P(ctx, batch_sends=_batch_sends(dist, rt)),
        loss_fn=loss_fn,
        device=rt.device,
        reducer=groups.reducer,
        grad_scale=1.0 / (m * w),
        swap=swap,
        replica=rt.replica,
        step_rule=rule,
        agreement=groups.agreement,
        lr_at=lambda t: lr_at(t, optim, num_steps=rt.num_steps),
        exchanges=[groups.exchange] if groups.exchange is not None else [],
        precision=rt.precision,
        steps_wait_on_others=exchanged,
        early_apply=early_apply,
    )


def _trace(rt: RankPlan, worker: StageWorker, pipeline: PipelineConfig, *, warmup_steps: int) -> None:
    """``pipeline.trace``: sets the worker's timeline recorder over the traced steps."""
    p = pipeline
    if not p.trace:
        return
    first_batch = rt.first_step  # traced steps are counted from 0, whatever step a resumed run starts at
    first = max(first_batch, warmup_steps if p.trace_first_step is None else p.trace_first_step)
    if first + p.trace_steps <= rt.num_steps:
        worker.trace = timeline.Recorder(first_step=first, num_steps=p.trace_steps, run_start=first_batch)
    else:
        log.warning(
            "pipeline.trace: steps %d..%d were trained before this resumed run; nothing traced",
            first,
            first + p.trace_steps - 1,
        )


def _log_start(rt: RankPlan, num_dp_buckets: int, tie_groups) -> None:
    """Logs what this rank runs, and the ties it holds."""
    log.info(
        "%s schedule, %s x %s, replica %d, balance %s, layers %s, %s, on %s (%s), precision %s",
        rt.schedule,
        _plural(rt.num_stages, "stage"),
        _plural(rt.data_parallel, "replica"),
        rt.replica,
        list(rt.balance),
        rt.layer_indices,
        _plural(num_dp_buckets, "all-reduce bucket"),
        rt.device,
        rt.backend,
        rt.precision,
    )
    for _, _, held in tie_groups:
        for tie, _ in held:
            log.info(
                "tied across stages %s: %s; gradients summed over its holders",
                ties.holders(tie, rt.balance),
                ", ".join(tie.names),
            )


def format_duration(seconds: float) -> str:
    """``3725.0`` -> ``'1h02m'``, ``83.0`` -> ``'1m23s'``, ``7.2`` -> ``'7s'``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _log_run(rt: RankPlan, cfg: Config, model: _Model, feed: Any, val_feed: Any) -> None:
    """Rank 0: the settings that matter, the parameters per stage and the data's size, at the start of the log."""
    o = cfg.optim
    sched = o.scheduler + (f", {o.warmup_steps} warm-up steps" if o.warmup_steps else "")
    log.info(
        "run: %s schedule, %s x %s (d=%d, w=%d), m=%d microbatches of b=%d sequences of %d tokens "
        "(global batch %d sequences, %d tokens), %s steps, precision %s, optimizer %s lr %.4g (%s)%s",
        rt.schedule,
        _plural(rt.num_stages, "stage"),
        _plural(rt.data_parallel, "replica"),
        rt.num_stages,
        rt.data_parallel,
        rt.num_microbatches,
        rt.microbatch_size,
        rt.seq_len,
        rt.global_batch,
        rt.global_batch * rt.seq_len,
        rt.num_steps if not rt.first_step else f"{rt.first_step}..{rt.num_steps}",
        rt.precision,
        optimizer_name(o),
        o.lr,
        sched,
        f", clip {o.clip_grad_norm}" if o.clip_grad_norm is not None else "",
    )
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.whole()]
    bounds = [sum(rt.balance[:s]) for s in range(rt.num_stages + 1)]
    per_stage = [sum(per_layer[a:b]) for a, b in zip(bounds, bounds[1:])]
    whole = sum(p.numel() for p in nn.Sequential(*model.whole()).parameters())  # a tied weight counts once
    log.info(
        "parameters: %s in all; per stage: %s",
        f"{whole:,}",
        ", ".join(f"{s}: {n:,} (layers {a}-{b - 1})" for s, (n, a, b) in enumerate(zip(per_stage, bounds, bounds[1:]))),
    )
    if feed is None:  # rank 0 is not a first or last stage (a custom rank_map): its data is not opened here
        return
    num_train = len(feed.data)
    epochs = rt.num_steps * rt.global_batch * rt.seq_len / num_train
    val = f", {len(val_feed.data):,} held out for validation" if val_feed is not None else ", no validation data"
    log.info(
        "data: %s, %s tokens to train on%s; %d steps read %s tokens (%.2f epochs)",
        cfg.data.path or "the shipped corpus (bytes)",
        f"{num_train:,}",
        val,
        rt.num_steps,
        f"{rt.num_steps * rt.global_batch * rt.seq_len:,}",
        epochs,
    )


def _resume_history(
    rt: RankPlan,
    resume: Tuple[Path, Dict[str, Any]],
    worker: StageWorker,
    evaluator: Optional[evaluate.Evaluator],
    versions: WeightVersions,
    *,
    eval_every: int,
) -> None:
    """A resumed run keeps the checkpoint's history (rank 0's losses, learning rates, ..., the validation
    passes already run); a validation pass still owed at the first step runs first."""
    manifest, first_batch = resume[1], rt.first_step
    if rt.rank == 0:
        worker.stats.losses = list(manifest["losses"])
        worker.stats.lrs = list(manifest.get("lrs", [None] * first_batch))  # checkpoints before lrs were recorded
        worker.stats.grad_norms = list(manifest.get("grad_norms", [None] * first_batch))
        worker.stats.skipped_steps = list(manifest.get("skipped_steps", []))
    if evaluator is not None:
        evaluator.losses = [(n, v) for n, v in manifest.get("val_losses", []) if n <= first_batch]
        if first_batch % eval_every == 0 and first_batch not in {n for n, _ in manifest.get("val_losses", [])}:
            evaluator.run(versions.newest(), step=first_batch)


def _tracking(
    rt: RankPlan,
    run_dir: Path,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    worker: StageWorker,
    wandb: WandbConfig,
    train: TrainConfig,
    *,
    config: Optional[Dict[str, Any]],
) -> Tuple[Optional[Tracker], Any, Callable[[int], None], Dict[str, str], Optional["_RunRecord"]]:
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
    record = _RunRecord(rt, run_dir, worker)
    progress = _progress(
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


class _RunRecord:
    """Rank 0's files in the run directory that show the run as it goes: metrics.jsonl (every step and
    validation pass) and loss.png (redrawn at each validation pass, checkpoint and the end)."""

    def __init__(self, rt: RankPlan, run_dir: Path, worker: StageWorker):
        self.metrics = MetricsLog(run_dir, first_step=rt.first_step)
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


def _checkpointer(
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    cfg: Config,
    model: _Model,
    tracker: Optional[Tracker],
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    *,
    shards: bool = False,
) -> checkpoint.Checkpointer:
    """The checkpoint writer (``train.checkpoint_every``); replica 0 of each stage writes its layers, and with
    ``shards`` (sharding.ShardedVersions) every replica its pieces of the masters and optimizer state. Its
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
        layers=rt.layer_indices if rt.replica == 0 else [],
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


class _StepHooks:
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
        record: Optional[_RunRecord],
        progress: Callable[[int], None],
        postfix: Dict[str, str],
        tied: Sequence[ties.Tie],
        eval_every: int,
        preemption: Optional[preempt.Agreement] = None,
    ):
        self.preemption = preemption
        self.rt, self.worker, self.versions, self.evaluator = rt, worker, versions, evaluator
        self.checker, self.rule, self.saver, self.tracker, self.record = checker, rule, saver, tracker, record
        self.progress, self.postfix, self.tied, self.eval_every = progress, postfix, tied, eval_every
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
        st = self.versions.state()
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
            history["preempted"] = signal_name(self.preemption.signum)
        self.saver.after_step(
            t + 1,
            self._state,
            st.losses if rank0 else None,
            history=history,
            rng=self.rngs.pop(t + 1, None),
            force=stop,
        )
        if stop:  # the validation pass due here, if any, is owed: the resumed run starts with it
            raise preempt.Preempted(t + 1, self.preemption.signum)
        if evaluator is not None and evaluate.due(t + 1, every=self.eval_every, num_steps=self.rt.num_steps):
            evaluator.run(self.versions.newest(), step=t + 1)


def _close(
    rt: RankPlan,
    stats: StageStats,
    evaluator: Optional[evaluate.Evaluator],
    feed: Any,
    val_feed: Any,
    bar: Any,
    saver: checkpoint.Checkpointer,
    groups: _Groups,
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


def _gather_and_write(
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    *,
    stats: StageStats,
    tie_record: Dict[str, Any],
    worker: StageWorker,
    final: Optional[Dict[str, torch.Tensor]],
    evaluator: Optional[evaluate.Evaluator],
    rule: StepRule,
    model: _Model,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    predictions: Dict[str, Any],
    tracker: Optional[Tracker],
    record: Optional[_RunRecord],
    pipeline: PipelineConfig,
    train: TrainConfig,
    optim: OptimConfig,
    preempted: Optional[preempt.Preempted] = None,
) -> Optional[Dict[str, Any]]:
    """Gathers every rank's stats, model slice and tie record on rank 0, which writes summary.json,
    final_model.pt (and the trace), closes the wandb run and returns the summary; None elsewhere. A
    preempted run writes no final_model.pt (its checkpoint holds the weights) and no trace."""
    d, w, m, b = rt.num_stages, rt.data_parallel, rt.num_microbatches, rt.microbatch_size
    tied, balance = model.tied, list(rt.balance)
    all_stats = comm.gather_to_rank0(ctx, stats)
    gathered = train.save_final == "gathered" and preempted is None  # a preempted run's weights are in its checkpoint
    # Replicas hold equal weights: replica 0 of each stage contributes its slice of the model.
    shard = (
        ties.drop_aliases({k: v.detach().cpu() for k, v in final.items()}, tied) if rt.replica == 0 and gathered else {}
    )
    shards = comm.gather_to_rank0(ctx, shard) if gathered else None
    tie_records = comm.gather_to_rank0(ctx, tie_record)
    if rt.rank != 0:
        return None
    meta = {
        "schedule": rt.schedule,
        "num_stages": d,
        "data_parallel": w,
        "num_microbatches": m,
        "microbatch_size": b,
        "global_batch_size": rt.global_batch,
        "balance": balance,
        "rank_map": [list(r) for r in rt.layout.ranks],
        "num_steps": rt.num_steps,
        "seq_len": rt.seq_len,
        "backend": rt.backend,
        "device": rt.device.type,
        "memory_kind": "cuda_max_allocated" if rt.device.type == "cuda" else "process_peak_rss",
        "resumed_from": None if resume is None else str(resume[0]),
        "first_step": rt.first_step,
        "recompute": rt.recompute,
        **predictions,
        **_precision_record(
            rt,
            optim,
            rule,
            worker.stats,
            weight_dtype_name=train.weight_dtype,
            waits=precisions.step_waits(
                rt.schedule,
                agreement=rule.needs_agreement,
                tied_across_stages=any(len(ties.holders(tie, balance)) > 1 for tie in tied),
                sharded=optim.sharded and w > 1,
                early_apply=not (train.eval_every or pipeline.check_ties),
            ),
        ),
        "ties": [
            {
                **t,
                "checked_steps": min(
                    (r["tie_checked_steps"] for r, (st, _) in zip(tie_records, rt.positions()) if st in t["stages"]),
                    default=0,
                ),
            }
            for t in ties.describe(tied, balance)
        ],
        "tie_allreduce_calls": [r["tie_allreduce_calls"] for r in tie_records],
        "val_losses": [] if evaluator is None else [{"step": n, "loss": v} for n, v in evaluator.losses],
        "final_val_loss": evaluator.losses[-1][1] if evaluator is not None and evaluator.losses else None,
        "status": "completed" if preempted is None else "preempted",
        "preempted": None
        if preempted is None
        else {
            "signal": signal_name(preempted.signum),
            "step": preempted.step,
            "checkpoint": str(checkpoint.step_dir(run_dir / checkpoint.DIRNAME, preempted.step)),
            "exit_code": preempted.exit_code,
        },
    }
    # Throughput counts the steps this run took; a resumed (or preempted) run may have fewer than the warm-up.
    warmup = min(train.warmup_steps, len(stats.step_end_times) - 1)
    summary = summarize(all_stats, meta=meta, warmup_steps=warmup, samples_per_step=rt.global_batch, seq_len=rt.seq_len)
    if worker.trace is not None and preempted is None:
        title = f"{rt.schedule}, d={d}, w={w}, m={m}, b={b}"
        summary["trace"] = _save_trace(
            all_stats,
            run_dir,
            steps=range(worker.trace.first_step, worker.trace.first_step + pipeline.trace_steps),
            title=title,
        )
    write_summary(summary, run_dir)
    if (
        shards is not None and preempted is None
    ):  # as the tied model's own state_dict: every name of a tie on one tensor
        save_state_dict(
            ties.add_aliases({k: v for shard in shards for k, v in shard.items()}, tied), run_dir / "final_model.pt"
        )
    tracker.finish(summary)
    record.plot()
    record.metrics.close()
    log.info(
        "done: loss %.4f -> %.4f, %.1f samples/s, %.0f tokens/s; results in %s",
        summary["losses"][0],
        summary["final_loss"],
        summary["samples_per_s"],
        summary["tokens_per_s"],
        run_dir,
    )
    return summary


def _final_weights(rt: RankPlan, versions: WeightVersions, train: TrainConfig) -> Optional[Dict[str, torch.Tensor]]:
    """This stage's final weights on its replica 0 (None on the others, and when the run writes none): the
    newest version, or, where the versions are stored in the compute dtype (train.weight_dtype=compute),
    the float32 masters, all-gathered over the replicas when sharded (every replica takes part)."""
    if train.save_final == "none" and train.export_hf is None:
        return None
    if isinstance(versions, ShardedVersions) and versions.weight_dtype != torch.float32:
        return versions.final_state(keep=rt.replica == 0)
    return versions.newest().state_dict() if rt.replica == 0 else None


def _write_final(
    rt: RankPlan,
    ctx: comm.DistContext,
    run_dir: Path,
    *,
    state: Optional[Dict[str, torch.Tensor]],
    model: _Model,
    train: TrainConfig,
    dist: DistConfig,
) -> None:
    """The final weights as shards, each stage's replica 0 writing its own at once (pipedream2bw.hf_io):
    ``train.save_final=sharded`` (final_model/, layer-list names) and ``train.export_hf`` (a Hugging Face model);
    ``state``: this stage's final weights on its replica 0 (``_final_weights``), None on the others."""
    from pipedream2bw import hf_io

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


def _precision_record(
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
    record = {
        "precision": rt.precision,
        "compute_dtype": str(precisions.compute_dtype(rt.precision)).replace("torch.", ""),
        "bytes_per_parameter": precisions.param_memory(
            rt.precision,
            schedule=rt.schedule,
            optimizer=optimizer_name(optim),
            optimizer_kwargs=optim.kwargs,
            weight_dtype_name=weight_dtype_name,
            sharded=optim.sharded,
            data_parallel=rt.data_parallel,
            waits=waits,
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
    per_step = [  # seconds per traced step, by what each rank did (timeline.BREAKDOWN)
        {k: v / len(steps) for k, v in timeline.breakdown(tr["spans"], tr["window"]).items()} for tr in traces
    ]
    return {
        **timeline.bubble_summary(traces),
        "breakdown_per_rank": per_step,
        "steps": list(steps),
        "files": ["trace.json", "timeline.png"],
    }


def _swap_manager(swap: SwapConfig, rt: RankPlan, in_flight: int, versions: WeightVersions) -> Optional[SwapManager]:
    """This stage's activation swapper, if ``swap`` selects it and it can help."""
    s = rt.stage
    if s not in swap_stages(swap, rt.num_stages):
        return None
    if in_flight <= swap.resident + 1:
        log.warning(
            "swap: stage %d has at most %d microbatch(es) in flight and swap.resident=%d keeps %d of them besides the "
            "one computing: nothing to swap, so it does not",
            s,
            in_flight,
            swap.resident,
            swap.resident,
        )
        return None
    held = [t for r in versions.replicas for t in (*r.parameters(), *r.buffers())]  # never swapped
    log.info(
        "swap: activations of waiting microbatches >= %d bytes to host, %d kept on the device",
        swap.min_bytes,
        swap.resident,
    )
    return SwapManager(make_backend(rt.device), min_bytes=swap.min_bytes, resident=swap.resident, exclude=held)


def _progress(
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
    log loss, throughput and the time left every ``train.log_every`` steps.
    ``postfix``: more to show on the bar (the latest validation loss), updated by the caller."""
    start = time.perf_counter()
    window = {"start": start, "steps": 0, "last": start}
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
        if (t + 1) % train.log_every and t + 1 != train.num_steps:
            return
        rate = window["steps"] * samples_per_step / (now - window["start"])
        window.update(start=now, steps=0)
        tracker.log({"samples_per_s": rate, "tokens_per_s": rate * seq_len}, step=t)
        norm = f" grad norm {grad_norm:.4g}" if grad_norm is not None else ""
        left = f", {format_duration(eta_s)} left" if t + 1 < train.num_steps else ""
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
