"""Build: this rank's components from the config sections each uses (the stage module and its tied copies,
weight versions and optimizer, step rule, process groups, data and evaluator, actions, swapper, worker)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from pipedream2bw.config import (
    Config,
    DataConfig,
    DistConfig,
    OptimConfig,
    PipelineConfig,
    SwapConfig,
    TrainConfig,
    build_optimizer,
    optimizer_name,
    swap_stages,
)
from pipedream2bw.config.newest import early_forwards
from pipedream2bw.config.optim import probe_kind, state_misfits
from pipedream2bw.config.optimizers import (
    correction_in_effect,
    is_muon,
    muon_edge_layers,
    orthogonalize_on,
    tag_muon_params,
    takes_matrices,
)
from pipedream2bw.data import make_feeds
from pipedream2bw.io import checkpoint, timeline
from pipedream2bw.memory import precision as precisions
from pipedream2bw.memory.host_optim import HostOptimizerVersions, host_kernel, host_threads, node_cores
from pipedream2bw.memory.loss_scale import LossScaler, ScaledStepRule
from pipedream2bw.memory.sharding import ShardedVersions
from pipedream2bw.memory.stream import StreamedVersions, WeightStream
from pipedream2bw.memory.swap import SwapManager, make_backend
from pipedream2bw.models import lm_loss
from pipedream2bw.pipeline import comm, schedule, ties
from pipedream2bw.pipeline.agreement import StepRule
from pipedream2bw.pipeline.schedule import Action
from pipedream2bw.pipeline.versions import NewestVersions, PredictedNewestVersions, WeightVersions, bucketize
from pipedream2bw.run import chunks, evaluate, preempt, tensor
from pipedream2bw.run.lr_schedule import lr_at
from pipedream2bw.run.model import RunModel, optim_settings, stage_module
from pipedream2bw.run.runtime import RankPlan
from pipedream2bw.run.stage import Peers, StageWorker

log = logging.getLogger(__name__)


def _tie_groups(ctx: comm.DistContext, rt: RankPlan, tied: Sequence[ties.Tie], module: nn.Module):
    """One process group per distinct set of ranks holding tied copies (made on every rank, in the
    same order); returns [(group, source rank, [(tie, parameter index in ``module``)])] for the
    groups this rank is in. The source, the first holder stage's replica 0, owns the canonical copy. A tie on one
    stage (zbv's GPT tie: chunks 0 and 2d-1, both on stage 0) is one parameter there (``ties.retie``): no group."""
    sets: Dict[Tuple[int, ...], List[ties.Tie]] = {}
    layout = rt.layout
    for k in range(layout.tensor):  # tensor rank k's copies are tied among themselves (pipeline.tensor_parallel)
        for tie in tied:
            stages = rt.tie_holders(tie)
            if len(stages) > 1:
                sets.setdefault(tuple(sorted(r for st in stages for r in layout.slice(k)[st])), []).append(tie)
    groups = comm.new_groups(ctx, list(sets)) if sets else []
    index = {id(q): i for i, q in enumerate(module.parameters())}
    mine = []
    for group, (ranks, group_ties) in zip(groups, sets.items()):
        if ctx.rank in ranks:
            src = layout.ranks[rt.tie_holders(group_ties[0])[0]][0] + ctx.rank % layout.tensor
            held = []
            for tie in group_ties:
                name = next(n for n in tie.names if n.split(".", 1)[0] in module._modules)
                held.append((tie, index[id(module.get_parameter(name))]))
            mine.append((group, src, held))
    return mine


def build_stage(
    rt: RankPlan, ctx: comm.DistContext, model: RunModel, *, streamed: bool = False
) -> Tuple[nn.Module, List[Tuple[Any, int, List[Tuple[ties.Tie, int]]]], Optional[tensor.TensorPart]]:
    """This rank's stage module on its device, the groups of its tied parameters (``_tie_groups``), every
    tied copy set to its canonical one, and its part of the stage's split (pipeline.tensor_parallel; else None)."""
    torch.manual_seed(rt.seed)
    module = stage_module(rt.layer_indices, model.layers, model.source, recompute=rt.recompute, tied=model.tied)
    split = tensor.split_stage(rt, ctx, module, lm_head=model.loss_fn is lm_loss)
    if streamed:  # swap.weights: the parameters stay in host memory (StreamedVersions moves them to its buffers)
        for m in module.modules():
            m._buffers.update({k: b.to(rt.device) for k, b in m._buffers.items() if b is not None})
    else:
        module = module.to(rt.device)
    tie_groups = _tie_groups(ctx, rt, model.tied, module)
    with torch.no_grad():  # every copy starts as the canonical one (a rank building its layers alone made its own)
        for group, src, held in tie_groups:
            for _, i in held:
                comm.broadcast(list(module.parameters())[i].data, src=src, group=group)
    return module, tie_groups, split


def _optimizer_factory(rt: RankPlan, module: nn.Module, optim: OptimConfig, swap: SwapConfig):
    """(the optimizer config as this stage runs it, params -> its optimizer): the delay correction where it runs,
    Muon's parameters tagged, the host's fastest kernel where the step runs there."""
    optim = dataclasses.replace(optim, delay_correction=correction_in_effect(optim, rt.schedule))
    if takes_matrices(optim):  # which parameters Muon (the rotation) takes: hidden matrices (optim.muon_exclude)
        tag_muon_params(module, optim.muon_exclude, edge_layers=muon_edge_layers(sum(rt.balance)))
    if swap.optimizer == "host":  # the step runs on the host (swap.weights too): the fastest CPU kernel
        optim = host_kernel(optim)
    # Muon with its state on the host (swap.optimizer=host, swap.weights): the Newton-Schulz iterations run on the
    # stage's device, never on the host's cores (a CPU run's device is the host)
    ns_device = rt.device if is_muon(optim) and swap.optimizer == "host" and rt.device.type != "cpu" else None
    # newest's prediction lives in its versions (PredictedNewestVersions), not in the optimizer
    stepped = dataclasses.replace(optim, delay_correction="none") if rt.weight_versions == "newest" else optim

    def factory(params):
        opt = build_optimizer(params, stepped)
        if ns_device is not None:
            orthogonalize_on(opt, ns_device)
        return opt

    return optim, factory


def build_versions(
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
    # With no replicas no reducer waits on buckets: one optimizer steps the untied parameters in one multi-tensor
    # pass (a bucket each, 36 AdamW steps a batch took 53 ms of an H200 where one took 34, over 6 batches of
    # bench_precision's GPT). The host optimizer and compute-dtype versions keep theirs: a bucket is one copy to the
    # host and back, or one flat float32 master.
    weight_dtype = precisions.weight_dtype(rt.precision, weight_dtype_name)
    one = rt.data_parallel == 1 and swap.optimizer != "host" and weight_dtype == torch.float32
    bucket_bytes = math.inf if one else bucket_mb * 2**20
    buckets = [[rest[j] for j in bucket] for bucket in bucketize([params[i] for i in rest], bucket_bytes=bucket_bytes)]
    buckets = [bucket for bucket in buckets if bucket] + [[i] for i in tied_index]
    num_dp_buckets = len(buckets) - len(tied_index)
    optim, factory = _optimizer_factory(rt, module, optim, swap)
    sharded = optim.sharded and rt.data_parallel > 1
    background = swap.host_step != "sync" and rt.schedule == "2bw"  # swap.host_step: off the training thread
    threads = _host_step_threads() if background else None
    if swap.weights and rt.stage in swap_stages(swap, rt.num_stages):  # swap.weights: versions in host buffers
        versions = StreamedVersions(
            module,
            pin=rt.device.type == "cuda",
            schedule=rt.schedule,
            optimizer_factory=factory,
            background=background,
            threads=threads,
            weight_dtype=weight_dtype,  # compute: versions in that dtype, float32 masters (ShardedVersions' checkpoint)
            shard_index=replica_index(rt),  # replica 0 writes the masters
        )  # one optimizer bucket per layer, each also a bucket of the replicas' all-reduce; no ties (validated)
        return versions, versions.buckets, len(versions.buckets)
    if sharded or weight_dtype != torch.float32:  # the replicas' group ranks are sorted global ranks
        versions = ShardedVersions(
            module,
            schedule=rt.schedule,
            optimizer_factory=factory,
            buckets=buckets,
            num_sharded=num_dp_buckets if sharded else 0,
            shard_index=replica_index(rt),
            num_shards=rt.data_parallel if sharded else 1,
            host=swap.optimizer == "host",
            weight_dtype=weight_dtype,
        )
    elif swap.optimizer == "host":
        versions = HostOptimizerVersions(
            module,
            schedule=rt.schedule,
            optimizer_factory=factory,
            buckets=buckets,
            background=background,
            threads=threads,
        )
    else:
        kind, newest = _newest(rt, optim)
        versions = kind(
            module,
            schedule=rt.schedule,
            optimizer_factory=factory,
            buckets=buckets,
            sync_warmup_steps=rt.sync_warmup_steps,
            **newest,
        )
    return versions, buckets, num_dp_buckets


def _newest(rt: RankPlan, optim: OptimConfig) -> Tuple[type, Dict[str, int]]:
    """The versions' class and its arguments beyond the plain ones: under pipeline.weight_versions=newest
    ``NewestVersions`` (``PredictedNewestVersions`` with optim.delay_correction=predict, and its horizon) and the
    forwards of a batch that run before the stage's previous step, d - s - 1 + its lead, with m (which with them sets
    the prediction's replicas); else ``WeightVersions`` and none."""
    if rt.weight_versions != "newest":
        return WeightVersions, {}
    early = early_forwards(rt.num_stages, rt.num_microbatches, rt.forward_lead, stage_index=rt.stage)
    plain = {"early_forwards": early, "num_microbatches": rt.num_microbatches}
    if optim.delay_correction == "predict":
        return PredictedNewestVersions, {**plain, "horizon": optim.predict_horizon}
    return NewestVersions, plain


def replica_index(rt: RankPlan) -> int:
    """This rank's place among its stage's replicas of its tensor rank (the group that shards and all-reduces its
    pieces), by sorted global rank as the group's ranks are."""
    return sorted(rt.layout.slice(rt.tensor_rank)[rt.stage]).index(rt.rank)


def _host_step_threads() -> int:
    """The background host step's intra-op threads: the node's cores that its ranks (LOCAL_WORLD_SIZE, torchrun's)
    leave free, each computing on this rank's torch threads (``host_optim.host_threads``)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return host_threads(cores=node_cores(), ranks=ranks, rank_threads=torch.get_num_threads())


def step_rule(rt: RankPlan, train: TrainConfig, optim: OptimConfig) -> StepRule:
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


def _optimizer_state_misfits(
    path: Path, manifest: Dict[str, Any], versions: WeightVersions, saved: Dict[str, dict], optim: OptimConfig
) -> bool:
    """Whether this run's optimizer cannot step from the checkpoint's state (``optim.state_misfits``: e.g. Adam's
    ``amsgrad`` turned on under ``train.resume_strict=false`` reads a ``max_exp_avg_sq`` the state lacks, which
    crashed the first step), warning why: then the state starts afresh."""
    kinds = {n: probe_kind(p) for n, p in versions.replicas[0].named_parameters()}
    misfits = state_misfits(optim, {(kinds[n], frozenset(st)) for n, st in saved.items() if n in kinds})
    if not misfits:
        return False
    recorded, ours = manifest.get("training_settings") or {}, optim_settings(optim)
    changed = [
        f"{k}: checkpoint {recorded[k]!r}, this run {ours[k]!r}"
        for k in ours
        if k in recorded and recorded[k] != ours[k]
    ]
    lacks = sorted({key for keys in misfits.values() for key in keys})
    log.warning(
        "%s: its optimizer state lacks %s, which this run's optimizer (%s) needs to step (%s): the optimizer state "
        "starts afresh",
        path,
        ", ".join(repr(k) for k in lacks),
        optimizer_name(optim),
        "; ".join(changed) or "its settings changed",
    )
    return True


def restore(
    rt: RankPlan,
    resume: Tuple[Path, Dict[str, Any]],
    versions: WeightVersions,
    rule: StepRule,
    *,
    optim: OptimConfig,
    tied: Sequence[ties.Tie],
    split: Optional[tensor.TensorPart] = None,
) -> None:
    """Loads this stage's weights, optimizer, loss scaler and (under the same layout) RNG states from the checkpoint
    (whole tensors, cut to this rank's pieces under ``split``)."""
    path, manifest = resume
    first_batch = rt.first_step
    state = checkpoint.load_layers(path, rt.layer_indices, ties=[list(t.names) for t in tied])
    if split is not None:
        state = split.cut(state)
    says = rt.rank == 0  # what the manifest shows is the same on every rank: said once
    if says and rt.schedule == "2bw" and state["previous"] is None:
        log.warning(
            "%s holds one weight version (a %s run): batch %d runs with W(%d), not W(%d)",
            path,
            manifest["schedule"],
            first_batch,
            first_batch,
            first_batch - 1,
        )
    if says and manifest["global_batch_size"] != rt.global_batch:
        log.warning(
            "%s was trained with global batch %d, this run uses %d: training continues, but not as the same run",
            path,
            manifest["global_batch_size"],
            rt.global_batch,
        )
    if manifest["optimizer"] != optimizer_name(optim):
        if says:
            log.warning(
                "%s holds %s state; this run's optimizer is %s: it starts afresh",
                path,
                manifest["optimizer"],
                optimizer_name(optim),
            )
        state["optimizer"] = {}
    elif state["optimizer"] and _optimizer_state_misfits(path, manifest, versions, state["optimizer"], optim):
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
    elif says and isinstance(rule, ScaledStepRule):
        log.warning(
            "%s holds no loss scaler state (a %s run): the loss scale starts afresh at %g",
            path,
            manifest.get("precision", "fp32"),
            rule.scaler.scale,
        )
    rng = checkpoint.load_rng(path, rt.rank) if manifest["layout"] == rt.layout_record else None
    if rng is not None:
        checkpoint.set_rng_state(rng)


class Groups(NamedTuple):
    """What this rank talks to its peers through besides p2p (None: not needed by this run)."""

    reducer: Optional[comm.GradReducer]  # averages the data-parallel buckets over the stage's replicas
    exchange: Optional[ties.TieExchange]  # sums tied gradients over their holders
    checker: Optional[ties.TieChecker]  # pipeline.check_ties: checks tied copies stay equal
    agreement: Optional[comm.AsyncSum]  # the step rule's sums over all ranks


def comm_groups(
    rt: RankPlan,
    ctx: comm.DistContext,
    versions: WeightVersions,
    dp_buckets: List[List[int]],
    tie_groups,
    rule: StepRule,
    check_ties: bool,
    *,
    host_grads: bool = False,
) -> Groups:
    """The gradient all-reduce, tie exchange and checker, and step agreement of this rank (``host_grads``: some
    stage streams its weights, swap.weights, and all-reduces host gradients: over gloo groups, made on every rank)."""
    reducer = None
    if rt.data_parallel > 1:  # every rank makes every stage's group (of each tensor rank's), in the same order
        stages = [row for k in range(rt.tensor_parallel) for row in rt.layout.slice(k)]
        mine = rt.tensor_rank * rt.num_stages + rt.stage
        group = comm.new_groups(ctx, stages)[mine]
        if host_grads and rt.backend != "gloo":  # swap.weights: host gradients, which NCCL cannot reduce
            host_group = comm.new_groups(ctx, stages, backend="gloo")[mine]
            group = host_group if isinstance(versions, StreamedVersions) else group
        if dp_buckets:
            reducer = comm.GradReducer(
                ctx,
                group=group,
                replicas=[list(r.parameters()) for r in versions.replicas],
                buckets=dp_buckets,
                sharded=isinstance(versions, ShardedVersions) and versions.num_sharded > 0,
                autograd_hooks=not isinstance(versions, StreamedVersions),  # WeightStream.on_grad reports them
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
    return Groups(reducer, exchange, checker, agreement)


def peers(rt: RankPlan) -> Peers:
    """This rank's neighbours in its replica's pipeline; rank 0 also hears every replica's loss from the last stage."""
    last = 0 if rt.schedule in schedule.V_SCHEDULES else rt.num_stages - 1  # the stage holding the last layer
    return Peers(
        prev=rt.prev_rank,
        next=rt.next_rank,
        loss_sources=tuple(rt.layout.ranks[last]) if rt.rank == 0 else (),
        sends_loss=rt.tensor_rank == 0,
    )


def data(
    rt: RankPlan, ctx: comm.DistContext, peers: Peers, data: DataConfig, train: TrainConfig, loss_fn: Callable
) -> Tuple[Any, Any, Optional[evaluate.Evaluator]]:
    """The training and validation feeds (first and last stages only) and the evaluator (``train.eval_every``).

    Returns:
        (training feed, validation feed, evaluator), None where this rank has none.
    """
    feed = val_feed = None
    last = 0 if rt.schedule in schedule.V_SCHEDULES else rt.num_stages - 1  # zbv: rank 0 holds the last chunk
    if rt.stage in (0, last):  # only the first (inputs) and last (targets) stages open the data
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
            legs=eval_legs(rt, peers),
            loss_sources=peers.loss_sources,
            feed=val_feed,
            p2p=comm.P2P(ctx, group=comm.new_groups(ctx, [range(ctx.world_size)])[0]),
            num_microbatches=train.eval_batches * rt.num_microbatches,
            loss_fn=loss_fn,
            device=rt.device,
            precision=rt.precision,
            # weights stored in the compute dtype (train.weight_dtype=compute): the stage runs in it, as in training
            upcast=precisions.weight_dtype(rt.precision, train.weight_dtype) == torch.float32,
            sends_loss=peers.sends_loss,
        )
    return feed, val_feed, evaluator


def eval_legs(rt: RankPlan, peers: Peers) -> List[evaluate.Leg]:
    """This rank's part of a validation pass: its stage from its neighbours, or under zbv its two chunks in their
    order (``chunk_specs``: chunk d-1 hands chunk d its output on rank d-1)."""
    specs = chunk_specs(rt)
    if not specs:
        return [evaluate.Leg(layers=None, prev=peers.prev, next=peers.next)]
    starts = [0, specs[0].num_layers]
    return [
        evaluate.Leg(layers=slice(start, start + spec.num_layers), prev=spec.prev, next=spec.next)
        for start, spec in zip(starts, specs)
    ]


def batch_sends(dist: DistConfig, rt: RankPlan) -> bool:
    """Whether sends are held for the next receive (``dist.batch_p2p``; null: under NCCL)."""
    return dist.batch_p2p if dist.batch_p2p is not None else rt.backend == "nccl"


def actions(rt: RankPlan, *, batch_sends: bool) -> List[Action]:
    """This rank's actions for this run's batches, checked and with its communication lowered: under 2bw with
    pipeline.sync_warmup_steps=N, flush's for the batches before N, then 2bw's from N on (a pipeline started
    afresh at batch N, as a run resumed there starts it)."""
    if rt.schedule != "2bw" or rt.first_step >= rt.sync_warmup_steps:
        return _rank_actions(rt, rt.schedule, rt.first_step, rt.num_steps, batch_sends=batch_sends)
    switch = min(rt.sync_warmup_steps, rt.num_steps)
    flush = _rank_actions(rt, "flush", rt.first_step, switch, batch_sends=batch_sends)
    return flush + (
        _rank_actions(rt, "2bw", switch, rt.num_steps, batch_sends=batch_sends) if switch < rt.num_steps else []
    )


def _rank_actions(rt: RankPlan, name: str, first: int, end: int, *, batch_sends: bool) -> List[Action]:
    """``schedule.rank_actions`` of schedule ``name`` for this rank's batches ``first .. end - 1``."""
    return schedule.rank_actions(
        name,
        stage_index=rt.stage,
        num_stages=rt.num_stages,
        num_microbatches=rt.num_microbatches,
        first_batch=first,
        num_batches=end - first,
        batch_sends=batch_sends,
        forward_lead=rt.forward_lead,
    )


def worker(
    rt: RankPlan,
    ctx: comm.DistContext,
    peers: Peers,
    versions: WeightVersions,
    feed: Any,
    loss_fn: Callable,
    groups: Groups,
    rule: StepRule,
    swap: Optional[SwapManager],
    optim: OptimConfig,
    dist: DistConfig,
    tied: Sequence[ties.Tie],
    *,
    early_apply: bool = True,
    stream: Optional[WeightStream] = None,
    norm_excluded: Sequence[int] = (),
) -> StageWorker:
    """The stage worker that runs this rank's actions (``early_apply``: StageWorker's)."""
    m, w = rt.num_microbatches, rt.data_parallel
    exchanged = any(len(rt.tie_holders(tie)) > 1 for tie in tied)  # on some stages, maybe not this one
    assert not (exchanged and rt.weight_versions == "newest"), "a tie across stages under newest (run/start.py)"
    return StageWorker(
        stage_index=rt.stage,
        num_stages=rt.num_stages,
        num_microbatches=m,
        peers=peers,
        versions=versions,
        feed=feed,
        p2p=comm.P2P(ctx, batch_sends=batch_sends(dist, rt)),
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
        seed=rt.seed,
        num_replicas=w,
        stream=stream,
        norm_excluded=norm_excluded,
        chunks=chunk_specs(rt),
    )


def chunk_specs(rt: RankPlan) -> List[chunks.ChunkSpec]:
    """This rank's chunks under zbv (run/chunks.py), their neighbours in its replica's pipeline; none otherwise."""
    if rt.schedule not in schedule.V_SCHEDULES:
        return []
    d = rt.num_stages
    ranks = [rt.pipeline_ranks[schedule.chunk_rank(v, d)][rt.replica] for v in range(2 * d)]
    rank_of = [chunks.LOCAL if r == rt.rank else r for r in ranks]
    return chunks.v_chunk_specs(stage=rt.stage, num_stages=d, balance=rt.balance, rank_of=rank_of)


def trace(rt: RankPlan, worker: StageWorker, pipeline: PipelineConfig, *, warmup_steps: int) -> None:
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


def weight_stream(swap: SwapConfig, rt: RankPlan, versions: WeightVersions) -> Optional[WeightStream]:
    """swap.weights: this stage's weight streamer, if it streams (its versions are then ``StreamedVersions``)."""
    if not isinstance(versions, StreamedVersions):
        return None
    log.info(
        "swap.weights: %d layers' weights (%.1f MiB in all versions) stream from host memory, %d ahead",
        len(versions.layers),
        versions.host_weight_bytes() / 2**20,
        swap.weight_prefetch,
    )
    return WeightStream(versions, make_backend(rt.device), window=swap.weight_prefetch, recompute=rt.recompute)


def swap_manager(swap: SwapConfig, rt: RankPlan, in_flight: int, versions: WeightVersions) -> Optional[SwapManager]:
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


@dataclasses.dataclass
class Components:
    """This rank's parts of the run, as ``components`` builds them (None: not needed by this run or rank)."""

    tie_groups: List[Tuple[Any, int, List[Tuple[ties.Tie, int]]]]
    versions: WeightVersions
    num_dp_buckets: int
    rule: StepRule
    groups: Groups
    feed: Any
    val_feed: Any
    evaluator: Optional[evaluate.Evaluator]
    preemption: Optional[preempt.Agreement]
    actions: List[Action]
    worker: StageWorker
    split: Optional[tensor.TensorPart] = None
    """This rank's part of its stage's tensor split (pipeline.tensor_parallel > 1), else None."""


def components(
    cfg: Config,
    rt: RankPlan,
    ctx: comm.DistContext,
    model: RunModel,
    resume: Optional[Tuple[Path, Dict[str, Any]]],
    *,
    watch: preempt.Watch,
) -> Components:
    """This rank's components, each from ``rt`` and only the config sections it uses, restored from ``resume``.

    Every rank makes every process group, in the same order: the ties' (build_stage), the stages'
    data-parallel ones and the step agreement's (comm_groups), the evaluator's (data), the preemption
    flag's (``train.preempt_signals``).
    """
    streamed = cfg.swap.weights and rt.stage in swap_stages(cfg.swap, rt.num_stages)
    module, tie_groups, split = build_stage(rt, ctx, model, streamed=streamed)
    versions, buckets, num_dp_buckets = build_versions(
        rt,
        module,
        tie_groups,
        bucket_mb=cfg.pipeline.bucket_mb,
        swap=cfg.swap,
        optim=cfg.optim,
        weight_dtype_name=cfg.train.weight_dtype,
    )
    rule = step_rule(rt, cfg.train, cfg.optim)
    if resume is not None:
        restore(rt, resume, versions, rule, optim=cfg.optim, tied=model.tied, split=split)
    dp_buckets, check_ties = buckets[:num_dp_buckets], cfg.pipeline.check_ties
    groups = comm_groups(rt, ctx, versions, dp_buckets, tie_groups, rule, check_ties, host_grads=cfg.swap.weights)
    neighbours = peers(rt)
    loss_fn = model.loss_fn if split is None else split.loss(model.loss_fn)  # split logits: the vocab-parallel loss
    feed, val_feed, evaluator = data(rt, ctx, neighbours, cfg.data, cfg.train, loss_fn)
    stop_rule = preemption(rt, ctx, watch)
    own_actions = actions(rt, batch_sends=batch_sends(cfg.dist, rt))
    in_flight = schedule.in_flight(
        rt.schedule, rt.stage, rt.num_stages, rt.num_microbatches, forward_lead=rt.forward_lead
    )
    swapper = swap_manager(cfg.swap, rt, in_flight, versions)
    stream = weight_stream(cfg.swap, rt, versions)
    if stream is not None and evaluator is not None:  # validation passes stream the newest version's weights too
        evaluator.forward = stream.evaluate
    stage_worker = worker(
        rt,
        ctx,
        neighbours,
        versions,
        feed,
        loss_fn,
        groups,
        rule,
        swapper,
        cfg.optim,
        cfg.dist,
        model.tied,
        # on_step passes through the stages (validation, the tie check): a sharded APPLY keeps apply_due's point
        early_apply=not (cfg.train.eval_every or cfg.pipeline.check_ties),
        stream=stream,
        norm_excluded=split.norm_excluded(module) if split is not None else (),
    )
    trace(rt, stage_worker, cfg.pipeline, warmup_steps=cfg.train.warmup_steps)
    return Components(
        tie_groups=tie_groups,
        versions=versions,
        num_dp_buckets=num_dp_buckets,
        rule=rule,
        groups=groups,
        feed=feed,
        val_feed=val_feed,
        evaluator=evaluator,
        preemption=stop_rule,
        actions=own_actions,
        worker=stage_worker,
        split=split,
    )


def preemption(rt: RankPlan, ctx: comm.DistContext, watch: preempt.Watch) -> Optional[preempt.Agreement]:
    """The agreement on a preemption stop (``train.preempt_signals``; None without signals)."""
    if not watch.signals:
        return None
    # a CPU scalar per step on a gloo group of its own: no device sync, no queueing behind training
    channel = None
    if ctx.world_size > 1:
        channel = comm.AsyncSum(ctx, group=comm.new_groups(ctx, [range(ctx.world_size)], backend="gloo")[0])
    return preempt.Agreement(watch, channel, last_step=rt.num_steps - 1)
