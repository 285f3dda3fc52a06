"""Start and resume, before any process group: the plan (partition=auto|file) and the checkpoint rank 0
chooses and shares through the rendezvous store; the outputs/latest link."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from pipedream2bw.config import (
    Config,
    GPTConfig,
    default_plan_choices,
    model_num_layers,
    swap_stages,
    validate_steps,
)
from pipedream2bw.config.newest import read_layout_record
from pipedream2bw.config.ranges import check_ranges
from pipedream2bw.errors import ConfigError
from pipedream2bw.io import checkpoint, manifests, rundir
from pipedream2bw.io.fileio import atomic_symlink
from pipedream2bw.memory import precision as precisions
from pipedream2bw.memory.memprobe import available_host_bytes
from pipedream2bw.memory.precision import optimizer_state_factor
from pipedream2bw.memory.stream import host_bytes_model
from pipedream2bw.pipeline import comm, ties
from pipedream2bw.pipeline.layout import Layout, make_layout
from pipedream2bw.run import logs, preflight
from pipedream2bw.run.model import RunModel, training_settings

log = logging.getLogger(__name__)


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


def choose_checkpoint(
    cfg: Config,
    run_dir: Path,
    store: Any,
    rank: int,
    world_size: int,
    model: RunModel,
    *,
    lock: Optional[rundir.RunLock] = None,
) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The checkpoint to resume from, per ``train.resume``: rank 0 chooses (verifying checksums,
    setting corrupt ones aside, refusing another model's or other settings') and every rank gets its
    choice, before any process group starts. Rank 0 first takes the run directory's ``lock``, refuses
    links inside it, and removes what an interrupted prune left.

    Raises:
        ConfigError: on every rank, when the checkpoint asked for is missing, of another
            model or settings, already at ``train.num_steps``, or when checkpoints are there
            but none can be loaded (``checkpoint.NoLoadableCheckpoint``); when a live run holds the
            run directory (``rundir.RunDirInUse``) or a link is planted in it.
    """
    t = cfg.train
    answer, key = None, "resume"
    if rank == 0:
        try:
            if lock is not None:
                lock.acquire(run_dir)
            rundir.check_no_links(run_dir)
            checkpoint.clean_leftovers(run_dir / checkpoint.DIRNAME)
            path = None if t.resume == "never" else _select_checkpoint(cfg, run_dir, model)
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


def _select_checkpoint(cfg: Config, run_dir: Path, model: RunModel) -> Optional[Path]:
    """Rank 0's choice for ``choose_checkpoint`` (``train.resume`` auto or a path), checked against this run."""
    t = cfg.train
    if t.resume == "auto":
        checkpoint.clear_partials(run_dir / checkpoint.DIRNAME)
    else:
        rundir.check_resume_source(Path(t.resume), own=run_dir)
    # resolved: a link (outputs/latest) may be re-pointed at this run before the other ranks read it
    path, manifest = checkpoint.select(run_dir if t.resume == "auto" else Path(t.resume).resolve())
    if path is None and t.resume != "auto":
        raise ConfigError(
            f"train.resume ({t.resume}) holds no complete checkpoint with intact files; "
            f"point it at another checkpoint or use train.resume=never"
        )
    if path is not None:
        recorded = manifest.get("training_settings")
        if isinstance(recorded, dict):  # 2026-11-27's newest with its layout: the rule, where it resumes as trained
            manifest = {**manifest, "training_settings": read_layout_record(recorded, cfg.pipeline)}
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
                f"nothing left to train; to train further, raise train.num_steps "
                f"(e.g. train.num_steps={2 * manifest['step']}), or start afresh with train.resume=never"
            )
    return path


def _auto_plan(cfg: Config, topo: Any, *, world_size: int, model: RunModel) -> Any:
    """partition=auto's plan: t = 1 unless pipeline.tensor_parallel pins it, as at t > 1 the runtime refuses much
    a plan may choose (swapping, sharding, fp16, Muon, layer lists: validate); a plan file may have any t."""
    from partitioner.auto import plan_config

    kw = dict(devices=world_size, topology=topo, layers=model.layers, loss_fn=model.loss_fn, search_tensor=False)
    return plan_config(cfg, **kw)[0]


def resolve_partition(
    cfg: Config,
    store: Any,
    *,
    rank: int,
    world_size: int,
    local_world_size: int,
    run_dir: Path,
    model: RunModel,
):
    """``partition=auto|file``: rank 0 plans (or reads the plan file) and shares the plan's text
    through the rendezvous store, before any process group starts; every rank applies it.

    Returns:
        (cfg with the plan's pipeline settings, its optim.sharded and train.weight_dtype, the plan).

    Raises:
        ConfigError: on every rank, when rank 0 could not plan (e.g. nothing fits), or the run sets an
            optim.sharded or train.weight_dtype that the plan contradicts.
    """
    from partitioner.auto import PARTITION_MODES, apply_choices, apply_plan, runtime_topology
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
                best = _auto_plan(cfg, topo, world_size=world_size, model=model)
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
        "partition=%s: %d stages x %d replicas x %d tensor ranks, b=%d, m=%d, balance %s, recompute %s, sharded %s, "
        "weight_dtype %s; predicted %.1f samples/s",
        mode,
        plan.num_stages,
        plan.data_parallel,
        plan.tensor_parallel,
        plan.microbatch_size,
        plan.num_microbatches,
        plan.balance,
        plan.recompute,
        plan.sharded,
        plan.weight_dtype,
        plan.predicted_samples_per_s,
    )
    if plan.schedule_choice:
        log.info("%s", _schedule_choice(cfg, plan))
    precision = precisions.resolve(cfg.train.precision, "cuda" if torch.cuda.is_available() else "cpu")
    optim, train = apply_choices(cfg.optim, cfg.train, plan, precision=precision)
    gpt = model.layers is None and isinstance(cfg.model, GPTConfig)
    num_layers = model_num_layers(cfg.model) if gpt else model.num_layers
    pipeline, swap = apply_plan(cfg.pipeline, cfg.swap, plan, world_size=world_size, num_layers=num_layers)
    return dataclasses.replace(cfg, pipeline=pipeline, swap=swap, optim=optim, train=train), plan


@dataclasses.dataclass(frozen=True)
class Started:
    """What a rank knows once its run is accepted, before any process group: the config as planned, the
    model, where this rank runs, the checkpoint to resume from and the plan's predictions."""

    cfg: Config
    model: RunModel
    run_dir: Path
    rank: int
    world_size: int
    local_rank: int
    layout: Layout
    balance: List[int]
    store: Any
    resume: Optional[Tuple[Path, Dict[str, Any]]]
    predictions: Dict[str, Any]


def start(
    cfg: Config,
    run_dir: Path,
    *,
    layers: Optional[Sequence[nn.Module]],
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]],
    store: Optional[Any],
    on_start: Optional[Callable[[], None]],
    lock: Optional[rundir.RunLock] = None,
) -> Started:
    """Everything before the process groups, on every rank: the model, the plan (``partition=auto|file``),
    every check of the config against the model and the data, the layout, the checkpoint to resume from.

    Raises:
        ConfigError: on every rank, before any process group starts.
    """
    check_ranges(cfg)  # before anything is built from it: a model of d_model -32 dies building it
    model = RunModel.of(cfg, layers, loss_fn)
    rank, world_size, local_rank = comm.env_rank()
    logs.configure_logging(run_dir)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    logs.set_log_prefix(f"[rank {rank}]")
    cfg = manifests.resumed_settings(cfg, run_dir)  # before the plan: it plans, and the run runs, the checkpoint's rule
    plan, agreed = None, None  # agreed: keys for what rank 0 decides before any group starts (plan, checkpoint)
    if cfg.partition.mode != "manual":
        if store is None:
            store = comm.make_store(rank=rank, world_size=world_size, timeout_s=cfg.dist.timeout_s)
        agreed = comm.run_scope(store)
        cfg, plan = resolve_partition(
            cfg,
            agreed,
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            run_dir=run_dir,
            model=model,
        )
    cfg = default_plan_choices(cfg)  # what no plan chose and the run left null
    balance = _check(cfg, model, world_size=world_size, local_world_size=local_world_size)
    cfg = _newest_or_batch(cfg, model.tied, balance)
    layout = make_layout(
        cfg.pipeline.num_stages,
        cfg.pipeline.data_parallel,
        ranks_per_node=local_world_size,
        rank_map=cfg.pipeline.rank_map,
        tensor_parallel=cfg.pipeline.tensor_parallel,
    )
    logs.set_log_prefix(f"[stage {layout.position(rank)[0]}/rank {rank}]")
    check_stream_host_memory(cfg, model, balance, layout, rank=rank, local_world_size=local_world_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    if store is None:  # made after validate: a bad config fails every rank at once, with no rendezvous
        store = comm.make_store(rank=rank, world_size=world_size, timeout_s=cfg.dist.timeout_s)
    resume = choose_checkpoint(cfg, run_dir, agreed or comm.run_scope(store), rank, world_size, model, lock=lock)
    if rank == 0:  # after the checkpoint is chosen: train.resume=outputs/latest means the run before this one
        link_latest(run_dir)
    if on_start is not None:
        on_start()
    return Started(
        cfg, model, run_dir, rank, world_size, local_rank, layout, balance, store, resume, _predictions(plan)
    )


def _schedule_choice(cfg: Config, plan: Any) -> str:
    """schedule=auto's line: each candidate's time to a loss, 2bw's under the rule and correction the plan runs."""
    from partitioner import time_to_loss
    from partitioner.auto import plan_optim, plan_rule

    rule = plan_rule(cfg, plan) if plan.schedule == "2bw" else cfg.pipeline.weight_versions
    why = dict(factors=plan.schedule_factors, weight_versions=rule)
    return time_to_loss.describe(plan.schedule_choice, plan_optim(cfg, plan), plan.schedule, **why)


def _check(cfg: Config, model: RunModel, *, world_size: int, local_world_size: int) -> List[int]:
    """``preflight.check`` with the model's layer count and vocabulary, then what only the built model shows.

    Returns:
        The balance (layers per stage).
    """
    gpt = model.layers is None and isinstance(cfg.model, GPTConfig)  # the GPT's own default split
    balance = preflight.check(
        cfg,
        world_size=world_size,
        num_layers=None if gpt else model.num_layers,
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
    if cfg.swap.weights:
        check_weight_stream(cfg, model.tied, balance, precision)
    # zbv: a tie within one rank's two chunks (the GPT's, chunks 0 and 2d-1 on rank 0) is one parameter there; a tie
    # across ranks (a layer list's) would sum over an exchange group, not proven under zbv
    zbv = cfg.pipeline.schedule == "zbv"
    across = [list(t.names) for t in model.tied if zbv and len(ties.holders(t, balance, v_schedule=True)) > 1]
    if across:
        raise ConfigError(
            f"pipeline.schedule=zbv with weights tied across ranks ({across}): only a tie within one rank's two chunks "
            "(rank r runs chunks r and 2d-1-r) is proven; untie them, move the tied layers into such chunks with "
            "pipeline.balance, or use pipeline.schedule=zb1p"
        )
    check_tie_check(cfg, model.tied, balance)
    check_newest_ties(cfg, model.tied, balance)
    return balance


def _across_stages(tied: Sequence[ties.Tie], balance: Sequence[int]) -> List[List[str]]:
    """The ties whose layers sit on more than one stage of ``balance``."""
    return [list(t.names) for t in tied if len(ties.holders(t, balance)) > 1]


def check_newest_ties(cfg: Config, tied: Sequence[ties.Tie], balance: Sequence[int]) -> None:
    """pipeline.weight_versions=newest, named, with a layer list's tie across stages (the GPT's model.tie_embeddings
    is refused with the config, config/newest.py): its gradient sum would defer the step, which newest is not proven
    with. 'auto''s newest falls back to batch instead (``_newest_or_batch``).

    Raises:
        ConfigError: in one line, naming the ties.
    """
    p = cfg.pipeline
    if p.weight_versions != "newest" or p.schedule != "2bw" or p.auto_weight_versions:
        return
    across = _across_stages(tied, balance)
    if across:
        raise ConfigError(
            f"pipeline.weight_versions=newest with weights tied across stages ({across}): the step would wait for "
            "their gradient sum, so the newest version is not the one proven; untie them, or set "
            "pipeline.weight_versions=batch"
        )


def _newest_or_batch(cfg: Config, tied: Sequence[ties.Tie], balance: Sequence[int]) -> Config:
    """``cfg``, but where pipeline.weight_versions=auto chose newest and a layer list ties weights across stages
    (which only the built model shows), the batch rule, logged (and Muon's 'auto' correction with it)."""
    p = cfg.pipeline
    if not (p.auto_weight_versions and p.weight_versions == "newest" and p.schedule == "2bw"):
        return cfg
    across = _across_stages(tied, balance)
    if not across:
        return cfg
    log.info("pipeline.weight_versions=auto resolves to batch, not newest: weights tied across stages (%s)", across)
    batch = dataclasses.replace(p, weight_versions="batch", auto_weight_versions=False)
    return dataclasses.replace(cfg, pipeline=batch)


def check_tie_check(cfg: Config, tied: Sequence[ties.Tie], balance: Sequence[int]) -> None:
    """pipeline.check_ties with a layer list (the GPT's: config/validate.py): refused where no tie spans stages (none,
    or each one parameter on the rank holding its layers: zbv's two chunks of a rank, the one stage at d = 1).

    Raises:
        ConfigError: in one line, naming the ties.
    """
    zbv = cfg.pipeline.schedule == "zbv"
    if not cfg.pipeline.check_ties or any(len(ties.holders(t, balance, v_schedule=zbv)) > 1 for t in tied):
        return
    where = (
        f"every tied weight ({[list(t.names) for t in tied]}) is one parameter on the rank holding its layers"
        if tied
        else "the model has no tied weights"
    )
    raise ConfigError(
        f"pipeline.check_ties (true) compares a tie's copies across the stages holding them, but {where}: "
        "there is nothing to compare; set pipeline.check_ties=false"
    )


def check_weight_stream(cfg: Config, tied: Sequence[ties.Tie], balance: Sequence[int], precision: str) -> None:
    """swap.weights: what the config alone could not tell (ties, the resolved precision), before any group.

    Raises:
        ConfigError: a streamed stage holds a tied weight.
    """
    streamed = set(swap_stages(cfg.swap, cfg.pipeline.num_stages))
    held = [list(t.names) for t in tied if streamed & set(ties.holders(t, balance))]
    if held:
        raise ConfigError(
            f"swap.weights (true) with tied weights {held} on a streamed stage: a tied weight would travel once per "
            "layer that uses it and its gradients be summed in another order; untie them or stream other stages"
        )


def check_stream_host_memory(
    cfg: Config,
    model: RunModel,
    balance: Sequence[int],
    layout: Layout,
    *,
    rank: int,
    local_world_size: int,
    available: Optional[int] = None,
) -> None:
    """swap.weights: the host buffers (pinned on CUDA) that the streamed stages of this rank's host ask for, against
    the memory the host has available, before any process group starts (a pinned allocation that fails later
    does so in the middle of set-up, or the host swaps). Ranks ``local_world_size`` at a time share a host.

    Args:
        available: the host's available bytes; None: ``memprobe.available_host_bytes`` (no check if unknown).

    Raises:
        ConfigError: naming the bytes asked for, the bytes available and the settings to change.
    """
    if not cfg.swap.weights:
        return
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    streamed = set(swap_stages(cfg.swap, cfg.pipeline.num_stages))
    node = rank // local_world_size
    here = [r for r in range(node * local_world_size, (node + 1) * local_world_size) if r < sum(map(len, layout.ranks))]
    stages = [layout.position(r)[0] for r in here if layout.position(r)[0] in streamed]
    if not stages:
        return
    whole, starts = model.whole(), [sum(balance[:s]) for s in range(len(balance))]
    factor = optimizer_state_factor(cfg.optim.target or cfg.optim.name, cfg.optim.kwargs)
    versions = precisions.versions_held(cfg.pipeline.schedule)
    # train.weight_dtype=compute: 2-byte versions (bf16, or whatever train.precision=auto resolves to)
    compute = cfg.train.weight_dtype == "compute" and cfg.train.precision != "fp32"
    weight_dtype = torch.bfloat16 if compute else torch.float32
    need = sum(
        host_bytes_model(
            whole[starts[s] : starts[s] + balance[s]],
            versions=versions,
            optimizer_factor=factor,
            weight_dtype=weight_dtype,
        )
        for s in stages
    )
    if need > available:
        raise ConfigError(
            f"swap.weights (true): the streamed stages on this host (stages {sorted(set(stages))}, {len(stages)} "
            f"ranks) need {need} bytes ({need / 2**30:.2f} GiB) of host memory (pinned on CUDA) for their {versions} "
            f"weight version(s), gradient accumulators and optimizer state, but the host has {available} bytes "
            f"({available / 2**30:.2f} GiB) available (MemAvailable); stream fewer stages (swap.stages), run fewer "
            "ranks per host, or a smaller model"
        )


def _predictions(plan: Any) -> Dict[str, Any]:
    """What summary.json records of the plan a ``partition=auto|file`` run follows (nothing without one)."""
    if plan is None:
        return {}
    return {
        "predicted_samples_per_s": plan.predicted_samples_per_s,
        "predicted_peak_memory_bytes": list(plan.predicted_peak_memory_bytes),
        "plan": dataclasses.asdict(plan),  # logged to wandb as a table
    }
