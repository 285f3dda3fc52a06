"""Pure glue between a run's Config and the planner: build the request, plan, apply a plan.

Used by the CLI (``python -m partitioner plan``) and by the runtime's ``partition=auto`` /
``partition=file`` (which shares the plan's text among ranks itself; nothing here talks to
other processes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import List, Optional, Tuple

import torch

from partitioner import time_to_loss
from partitioner.planner import HostFigures, Plan, Request, _order, _streams, plan
from partitioner.profile import (
    analytic_gpt,
    profile_gpt,
    profile_layer_list,
    runtime_baseline_bytes,
    with_document_mask,
    with_ties,
)
from partitioner.tensor import TensorShape
from partitioner.topology import GIB, num_devices
from partitioner.vplan import plan_v
from pipedream2bw.config import (
    SCHEDULES,
    Config,
    GPTConfig,
    OptimConfig,
    PipelineConfig,
    SwapConfig,
    TopologyConfig,
    TrainConfig,
    model_num_layers,
    v_schedule_refusal,
)
from pipedream2bw.config.optimizers import correction_in_effect, is_muon
from pipedream2bw.errors import ConfigError
from pipedream2bw.memory import precision as precisions
from pipedream2bw.memory.step_memory import StepModel
from pipedream2bw.models.gpt import layer_kind, lm_loss
from pipedream2bw.pipeline.schedule import SPLIT_SCHEDULES, V_SCHEDULES
from pipedream2bw.pipeline.ties import find_ties

log = logging.getLogger(__name__)

PARTITION_MODES = ("manual", "auto", "file")
COST_SOURCES = ("auto", "profile", "analytic")


def local_device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def runtime_topology(topo: TopologyConfig, *, world_size: int, local_world_size: int) -> TopologyConfig:
    """The topology a launched run has: ``world_size`` ranks, ``local_world_size`` per node.

    On 'cpu' the ranks are processes of one host sharing its memory and cores; on 'cuda' a
    device's memory is at most what this machine's GPU has.

    Raises:
        ConfigError: the topology describes another kind of device than this machine's.
    """
    if topo.device != local_device_kind():
        raise ConfigError(
            f"partition=auto plans for the machine it runs on, but topology.device ({topo.device!r}) is not this "
            f"machine's ({local_device_kind()!r}); pick a matching topology (e.g. topology=dgx on GPUs, topology=cpu "
            "here)"
        )
    if topo.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        topo = dataclasses.replace(topo, memory_per_device_gib=min(topo.memory_per_device_gib, total))
    if topo.device == "cpu":
        return dataclasses.replace(
            topo, nodes=1, devices_per_node=world_size, memory_per_device_gib=topo.host_memory_gib / world_size
        )
    per_node = max(1, local_world_size)
    return dataclasses.replace(topo, nodes=math.ceil(world_size / per_node), devices_per_node=per_node)


def planned_precision(cfg: Config, topo: TopologyConfig) -> str:
    """``train.precision`` resolved for the planned machine: ``auto`` is bf16 on 'cuda' topologies
    (this machine's GPU, if it plans for itself and has one; else assumed: every GPU of the shipped
    topologies supports bf16), fp32 on 'cpu'."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    if topo.device == "cuda" and topo.device == local_device_kind():
        return precisions.resolve("auto", "cuda")
    return "bf16" if topo.device == "cuda" else "fp32"


def uses_profile(cfg: Config) -> bool:
    """Whether layer costs are measured here ('profile') or computed ('analytic')."""
    costs = cfg.partition.costs
    if costs not in COST_SOURCES:
        raise ConfigError(f"partition.costs ({costs!r}) is unknown; use one of {list(COST_SOURCES)}")
    if costs == "auto":
        return cfg.topology.device == local_device_kind()
    if costs == "profile" and cfg.topology.device != local_device_kind():
        raise ConfigError(
            f"partition.costs=profile measures this machine's {local_device_kind()}, but topology.device is "
            f"{cfg.topology.device!r}; use partition.costs=analytic or a topology of this machine"
        )
    return costs == "profile"


def tensor_request(cfg: Config, precision: str, *, search: Optional[bool] = None) -> dict:
    """The Request's tensor fields: the GPT's split (``tensor.TensorShape``; other models: none), the widths to try
    (``pipeline.tensor_parallel`` > 1 pins it; else every width, where ``search`` or, left None, where the runtime has
    the key: a runtime without it never gets a plan it cannot run) and ``pipeline.sequence_parallel``."""
    p = cfg.pipeline
    pinned = getattr(p, "tensor_parallel", 1)
    search = hasattr(p, "tensor_parallel") if search is None else search
    # what the runtime refuses at t > 1 (its run line would be refused): t = 1 only, unless t is pinned (the run
    # then refuses it in one line)
    search = search and not (pinned == 1 and _refused_at_t2(cfg))
    shape = None
    if isinstance(cfg.model, GPTConfig) and (search or pinned != 1):
        m = cfg.model
        shape = TensorShape(
            num_heads=m.num_heads,
            mlp_width=4 * m.d_model,
            d_model=m.d_model,
            seq_len=m.seq_len,
            vocab_size=m.vocab_size,
            act_bytes=precisions.compute_dtype(precision).itemsize,
            kinds=tuple(layer_kind(m, i) for i in range(model_num_layers(m))),
            muon=is_muon(cfg.optim),
            step=StepModel.of(cfg.optim, device_type=getattr(getattr(cfg, "topology", None), "device", "cpu")),
        )
    return dict(
        tensor=shape,
        tensor_widths=[pinned] if pinned != 1 else None,
        sequence_parallel=bool(getattr(p, "sequence_parallel", False)),
    )


def _refused_at_t2(cfg) -> bool:
    """Whether the runtime refuses ``cfg`` at pipeline.tensor_parallel > 1: synchronous warm-up steps
    (config/validate.py; the weight prediction runs at t > 1, issue 46)."""
    return getattr(cfg.pipeline, "sync_warmup_steps", 0) > 0


def make_request(
    cfg: Config,
    *,
    devices: Optional[int] = None,
    topology: Optional[TopologyConfig] = None,
    runtime_bytes=None,
    search_tensor: Optional[bool] = None,
) -> Request:
    """The planner's Request for ``cfg`` (``search_tensor``: ``tensor_request``'s ``search``)."""
    topo = topology or cfg.topology
    p = cfg.pipeline
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule ({p.schedule!r}) is unknown; use one of {list(SCHEDULES)}")
    if p.schedule in V_SCHEDULES and (refused := v_schedule_refusal(cfg)):
        raise ConfigError(refused)
    B = cfg.train.global_batch_size or p.data_parallel * p.num_microbatches * p.microbatch_size
    if runtime_bytes is None:
        runtime_bytes = (
            topo.runtime_overhead_gib * GIB if topo.runtime_overhead_gib is not None else runtime_baseline_bytes()
        )
    profile = uses_profile(cfg)
    # Muon orthogonalizes whole matrices: the run refuses optim.sharded at w > 1, so the search never shards it
    muon = is_muon(cfg.optim)
    req = Request(
        global_batch_size=B,
        topology=topo,
        devices=devices or num_devices(topo),
        memory_per_device_bytes=topo.memory_per_device_gib * GIB,
        runtime_bytes=runtime_bytes,
        schedule=p.schedule,
        forward_lead=p.forward_lead,
        objective=cfg.partition.objective,
        depths=cfg.partition.depths,
        microbatch_sizes=cfg.partition.microbatch_sizes,
        recompute=False if p.schedule in SPLIT_SCHEDULES else cfg.partition.recompute,  # as swap, below
        # zb1p keeps autograd's graph from B to W, which swapping, streaming and recomputation would move or run
        # twice (config/validate.py)
        swap=cfg.partition.swap and p.schedule not in SPLIT_SCHEDULES,
        swap_resident=cfg.partition.swap_resident,
        costs="profile" if profile else "analytic",
        model=dataclasses.asdict(cfg.model),
        tolerance=cfg.partition.tolerance,
        precision=planned_precision(cfg, topo),
        sharded=False if muon else cfg.partition.sharded,
        shardable=not muon,
        weight_dtype=cfg.train.weight_dtype or "fp32",
        bucket_bytes=p.bucket_mb * 2**20,
        step_agreement=precisions.needs_agreement(
            planned_precision(cfg, topo), clip_grad_norm=cfg.optim.clip_grad_norm, on_nonfinite=cfg.train.on_nonfinite
        ),
        tied=bool(getattr(cfg.model, "tie_embeddings", False)),
        early_apply=not (cfg.train.eval_every or p.check_ties),
        # the rest of what swap.weights refuses (fp16, ties, ...) the search checks itself (planner._streams)
        stream=cfg.partition.stream and p.schedule not in SPLIT_SCHEDULES,
        weight_prefetch=cfg.swap.weight_prefetch,
        # a CPU's cores (topology.cores), which its ranks' compute may leave none of free (cost._data_parallel_s)
        host=HostFigures(step=cfg.swap.host_step, cores=(topo.cores or 0) if topo.device == "cpu" else 0),
        **tensor_request(cfg, planned_precision(cfg, topo), search=search_tensor),
    )
    req = _newest_request(cfg, _documents_request(cfg, req))
    return dataclasses.replace(req, host=host_figures(cfg)) if _streams(req, 1) else req


def _documents_request(cfg: Config, req: Request) -> Request:
    """``req`` under data.packing=documents: only what the runtime runs with packed documents (config/validate.py's
    ``_validate_documents``): no weight streaming (nor its host optimizer), no tensor split (t = 1)."""
    if cfg.data.packing != "documents":
        return req
    return dataclasses.replace(req, stream=False, tensor=None, tensor_widths=None)


def _newest_request(cfg: Config, req: Request) -> Request:
    """``req`` for 2bw under pipeline.weight_versions=newest: only the layouts newest runs (config/newest.py's
    ``newest_refusal``): no recomputation, swapping, streaming, sharding or tensor split, at any depth and replicas;
    under the prediction, the third weight copy of the stages whose early forwards are more than half of m (the
    planner's ``newest_predict``). Without it the planner would pick what the run then refuses. Newest that 'auto'
    chose keeps every layout: a plan newest does not run runs the batch rule (``plan_rule``), its memory counted
    with the prediction's copies all the same."""
    if req.schedule != "2bw" or cfg.pipeline.weight_versions != "newest":
        return req
    predict = dataclasses.replace(req, newest_predict=cfg.optim.delay_correction == "predict")
    if cfg.pipeline.auto_weight_versions:
        return predict
    none = dict(recompute=False, swap=False, stream=False, sharded=False, tensor=None, tensor_widths=None)
    return dataclasses.replace(predict, **none)


def plan_rule(cfg: Config, p: Plan) -> str:
    """pipeline.weight_versions of a run of plan ``p`` under ``cfg``: 'auto''s newest becomes batch where the plan
    recomputes, swaps, streams, shards or splits tensors (what newest refuses, config/newest.py), as the Config made
    with the plan's keys resolves it; batch where the plan's schedule is not 2bw."""
    rule = cfg.pipeline.weight_versions
    if p.schedule != "2bw":
        return "batch"
    unproven = p.recompute or p.swap_stages or p.stream_stages or p.sharded or p.tensor_parallel > 1
    return "batch" if rule == "newest" and cfg.pipeline.auto_weight_versions and unproven else rule


def plan_optim(cfg: Config, p: Plan) -> OptimConfig:
    """``cfg.optim`` as a run of plan ``p`` resolves it: where ``plan_rule`` turns 'auto''s newest into batch, Muon's
    'auto' correction is the batch rule's (newest's prediction is its own)."""
    rule = plan_rule(cfg, p)
    if rule == cfg.pipeline.weight_versions or p.schedule != "2bw":
        return cfg.optim
    pipeline = dataclasses.replace(cfg.pipeline, weight_versions=rule, auto_weight_versions=False)
    return dataclasses.replace(cfg, pipeline=pipeline).optim


def host_figures(cfg: Config) -> HostFigures:
    """This host's optimizer step and copy speed (``partitioner.host``: measured once, cached in partition.cache_dir)
    for a plan whose stages may step on the host; the host of the planned machine is taken to be this one."""
    from partitioner.host import host_profile

    host = host_profile(cache_dir=cfg.partition.cache_dir)
    return HostFigures(
        step_bw=host.step_bytes_per_s,
        copy_bw=host.copy_bytes_per_s,
        reduce_bw=host.reduce_bytes_per_s,
        step=cfg.swap.host_step,
        text=host.describe(),
        cores=host.cores,
        omp_threads=int(os.environ.get("OMP_NUM_THREADS") or 0),
    )


def plan_config(cfg: Config, *, runners_up: int = 4, layers=None, loss_fn=None, **request_kwargs) -> List[Plan]:
    """Plans ``cfg.model`` (or the layer list ``layers``, with ``loss_fn``) for ``cfg.topology`` (or the
    given devices/topology): best plan first. The GPT has analytic costs too; any other layer
    list is profiled here. A plan whose stages step on the host is costed with ``host_optimizer``'s optimizer.

    Raises:
        ConfigError: nothing fits (the message names the memory or devices that would), or analytic
            costs asked for a model that is not the GPT.
    """
    if cfg.pipeline.schedule == time_to_loss.AUTO:
        return _plan_schedules(cfg, runners_up=runners_up, layers=layers, loss_fn=loss_fn, **request_kwargs)
    req = make_request(cfg, **request_kwargs)
    if layers is not None:  # a layer list the planner does not know how to split: t = 1 (a pinned t is refused)
        req = dataclasses.replace(req, tensor=None)
    elif req.tensor is not None and loss_fn not in (None, lm_loss):  # the caller's loss: the head stays whole
        req = dataclasses.replace(req, tensor=dataclasses.replace(req.tensor, vocab_head=False))
    # error feedback's state exists only under 2bw: a flush or gpipe plan does not pay its 4 B a parameter
    optim = dataclasses.replace(cfg.optim, delay_correction=correction_in_effect(cfg.optim, cfg.pipeline.schedule))
    costs = _cost_fns(cfg, req, layers=layers, loss_fn=loss_fn)
    if req.schedule in V_SCHEDULES:  # 2d chunks, two a rank (partitioner/vplan.py)
        return plan_v(costs(optim), req, runners_up=runners_up)
    if host_optimizer(optim) == optim or not _streams(req, 1):
        return plan(costs(optim), req, runners_up=runners_up)
    # Muon: resident plans step it on the devices, streaming ones (every stage on the host) step its muon_others
    resident, error = [], None
    try:
        resident = plan(costs(optim), dataclasses.replace(req, stream=False), runners_up=runners_up)
    except ConfigError as e:
        error = e
    try:
        streamed = [p for p in plan(costs(host_optimizer(optim)), req, runners_up=runners_up) if p.steps_on_host]
    except ConfigError as e:
        streamed, error = [], e if not resident else error
    if not resident and not streamed:
        raise error
    found = resident + streamed
    return [found[i] for i in _order(found, req.objective, req.tolerance)][: runners_up + 1]


def _plan_schedules(cfg: Config, *, runners_up: int, **kwargs) -> List[Plan]:
    """schedule=auto: each of ``time_to_loss.CANDIDATES`` planned, the plans ranked by their time to a loss (batch
    time x steps factor) under the throughput objective (by peak memory, then that time, under memory); each plan
    records every candidate's best time (``schedule_choice``)."""
    found, choice, factors, error = [], {}, {}, None
    for schedule in time_to_loss.CANDIDATES:
        one = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule=schedule))
        try:
            plans = plan_config(one, runners_up=runners_up, **kwargs)
        except ConfigError as e:
            error = error or e
            continue
        plans = [dataclasses.replace(p, predicted_steps_factor=_steps_factor(cfg, p)) for p in plans]
        fastest = min(plans, key=lambda p: p.predicted_batch_time_s * p.predicted_steps_factor)
        choice[schedule] = fastest.predicted_batch_time_s * fastest.predicted_steps_factor
        factors[schedule] = fastest.predicted_steps_factor
        found += plans
    if not found:
        raise error

    def key(p: Plan) -> tuple:
        t = p.predicted_batch_time_s * p.predicted_steps_factor
        return (max(p.predicted_peak_memory_bytes), t) if cfg.partition.objective == "memory" else (t,)

    best = sorted(found, key=key)[: runners_up + 1]
    return [dataclasses.replace(p, schedule_choice=dict(choice), schedule_factors=dict(factors)) for p in best]


def _steps_factor(cfg: Config, p: Plan) -> float:
    """Plan ``p``'s steps factor under ``cfg`` (``time_to_loss.steps_factor``; under pipeline.weight_versions=newest,
    2bw's rule at the plan's depth); infinite where its schedule is not known to reach the loss."""
    rule, optim = plan_rule(cfg, p), plan_optim(cfg, p)
    factor = time_to_loss.steps_factor(p.schedule, optim, weight_versions=rule, num_stages=p.num_stages)
    return math.inf if factor is None else factor


def _cost_fns(cfg: Config, req: Request, *, layers, loss_fn):
    """``costs(optim)``: the per-layer cost function (microbatch size -> costs) of the model under ``optim``."""
    documents = cfg.data.packing == "documents"  # rows padded to seq_len, plus the document mask's costs
    if layers is not None or not isinstance(cfg.model, GPTConfig):
        if documents:
            raise ConfigError(
                "partition=auto with data.packing=documents plans the built-in GPT only (a layer list is profiled on "
                "windows, without the document mask); use model=gpt, or partition=manual with pipeline.*"
            )
        if req.costs != "profile":
            raise ConfigError(
                f"partition.costs ({cfg.partition.costs}) with topology.device {cfg.topology.device!r}: analytic costs "
                "know only "
                f"the GPT; profile this model here (partition.costs=profile, with a topology of this machine's device)"
            )
        from pipedream2bw.models.factory import model_source

        source = model_source(cfg.model, seed=cfg.seed) if layers is None else None
        get = (lambda i: layers[i]) if layers is not None else (lambda i: source.build([i])[0])
        if source is not None and not source.by_index:
            whole = source.build()
            get = lambda i: whole[i]  # noqa: E731
        num = len(layers) if layers is not None else source.num_layers
        loss = loss_fn or (source.loss_fn if source is not None else None)
        tied = find_ties(layers if layers is not None else source.meta())  # as the runtime finds them (run/model.py)
        return lambda optim: (
            lambda b: with_ties(
                profile_layer_list(get, num, loss, optim, b, seq_len=cfg.model.seq_len, repeats=cfg.partition.repeats),
                tied,
            )
        )
    if req.costs == "profile":
        return lambda optim: (
            lambda b: profile_gpt(
                cfg.model,
                optim,
                b,
                repeats=cfg.partition.repeats,
                cache_dir=cfg.partition.cache_dir,
                seed=cfg.seed,
                precision=req.precision,
                documents=documents,
                weight_dtype=req.weight_dtype,
            )
        )

    def analytic(optim: OptimConfig, b: int):
        layers = analytic_gpt(cfg.model, optim, b, req.topology, precision=req.precision, weight_dtype=req.weight_dtype)
        return with_document_mask(layers, cfg.model, b, req.topology, precision=req.precision) if documents else layers

    return lambda optim: lambda b: analytic(optim, b)


def host_optimizer(optim: OptimConfig) -> OptimConfig:
    """The optimizer of a plan whose stages step on the host (one that streams: swap.optimizer=host on every stage):
    ``optim``, but for optim.name=muon its optim.muon_others over every parameter. The host never runs Muon's
    Newton-Schulz iterations (a matrix iteration over every hidden matrix, several TFLOP a step at 13B on a CPU): the
    runtime sends each momentum matrix to the device for them (memory/host_optim.py's Muon with host state), a round
    trip over the link a step that this cost model does not count, so such a plan is costed, and run
    (``run_overrides``), with the elementwise optimizer. The one place that decides it. A step on the host refuses the
    weight prediction (``corrections.prediction_refusal``): where Muon has the prediction with error feedback ('auto''s
    choice where it composes; named, such a plan could not run), the plan runs with the run line's optim.name, whose
    'auto' is no correction, and is costed so."""
    if not is_muon(optim):
        return optim
    correction = "none" if optim.auto_correction else optim.delay_correction  # the run line's optim.name: its auto
    return dataclasses.replace(optim, name=optim.muon_others, delay_correction=correction)


def run_overrides(optim: OptimConfig, p: Plan) -> List[str]:
    """Overrides that a run of plan ``p`` needs beyond the ones it was planned with: ``optim.name`` where the plan
    steps on the host and ``host_optimizer`` changes it."""
    host = host_optimizer(optim)
    return [f"optim.name={host.name}"] if p.steps_on_host and host.name != optim.name else []


def apply_plan(
    pipeline: PipelineConfig, swap: SwapConfig, p: Plan, *, world_size: int, num_layers: int
) -> Tuple[PipelineConfig, SwapConfig]:
    """The ``pipeline`` and ``swap`` config sections with the plan's pipeline settings and its ``swap.stages``
    (under schedule=auto, pipeline.weight_versions=batch where the plan's schedule is not 2bw: newest is moot there);
    a plan that streams weights also sets ``swap.weights``, ``swap.weight_prefetch`` and ``swap.optimizer=host``
    (what streaming needs); one that keeps its optimizer state on the host without streaming, ``swap.optimizer=host``.

    Args:
        pipeline: the run's ``pipeline`` section.
        swap: the run's ``swap`` section.
        p: the plan.
        world_size: ranks launched.
        num_layers: length of the model's layer list.

    Raises:
        ConfigError: the plan needs another number of ranks, or another model; the run sets swap.weights and
            the plan streams nothing; the plan streams stages that do not swap (the runtime streams exactly those).
    """
    if p.num_ranks != world_size:
        raise ConfigError(
            f"the plan runs {p.num_stages} stages x {p.data_parallel} replicas x {p.tensor_parallel} tensor ranks = "
            f"{p.num_ranks} ranks but {world_size} were launched; launch {p.num_ranks} ranks or plan again "
            f"for {world_size}"
        )
    tensor = {}
    if hasattr(pipeline, "tensor_parallel"):
        tensor = dict(tensor_parallel=p.tensor_parallel)
    elif p.tensor_parallel > 1:
        raise ConfigError(
            f"the plan splits each stage over {p.tensor_parallel} tensor ranks but this runtime has no "
            "pipeline.tensor_parallel: run a plan whose tensor_parallel is 1 (partition=auto plans one for it)"
        )
    if hasattr(pipeline, "sequence_parallel"):
        tensor["sequence_parallel"] = p.sequence_parallel
    if sum(p.balance) != num_layers:
        raise ConfigError(
            f"the plan's balance {p.balance} covers {sum(p.balance)} layers but the model has {num_layers}; "
            f"plan again for this model"
        )
    rule = getattr(pipeline, "weight_versions", "batch")  # a runtime without the key runs the batch rule
    chosen = getattr(pipeline, "auto_weight_versions", False)  # 'auto''s: resolved again with the plan's keys
    if pipeline.schedule == time_to_loss.AUTO and p.schedule != "2bw" and rule != "batch" and not chosen:
        log.info(
            "pipeline.weight_versions (%s) is moot under pipeline.schedule=%s (schedule=auto's choice): its forwards "
            "run on the newest version (the rule is 2bw's); running it as batch",
            rule,
            p.schedule,
        )
        pipeline = dataclasses.replace(pipeline, weight_versions="batch")
    pipeline = dataclasses.replace(
        pipeline,
        schedule=p.schedule,
        num_stages=p.num_stages,
        data_parallel=p.data_parallel,
        microbatch_size=p.microbatch_size,
        num_microbatches=p.num_microbatches,
        balance=list(p.balance),
        rank_map=[list(r) for r in p.rank_map],
        recompute=p.recompute,
        **tensor,
    )
    if p.stream_stages and sorted(p.stream_stages) != sorted(p.swap_stages):
        raise ConfigError(
            f"the plan streams stages {p.stream_stages} but swaps {p.swap_stages}: swap.weights streams exactly the "
            "stages that swap; list the same stages in both, or plan again"
        )
    if swap.weights and not p.stream_stages:
        raise ConfigError(
            "swap.weights (true) with a plan that streams no stage: under partition=auto|file the plan decides which "
            "stages stream (partition.stream lets the planner choose it); drop swap.weights"
        )
    stream = dict(weights=True, weight_prefetch=p.weight_prefetch, optimizer="host") if p.stream_stages else {}
    if p.host_optimizer and not p.stream_stages:  # the state on the host, the weights on the devices
        stream = dict(optimizer="host")
    return pipeline, dataclasses.replace(
        swap, enabled=False, stages=list(p.swap_stages), resident=p.swap_resident, **stream
    )


def apply_choices(
    optim: OptimConfig, train: TrainConfig, p: Plan, *, precision: str
) -> Tuple[OptimConfig, TrainConfig]:
    """The ``optim`` and ``train`` sections with the plan's ``sharded`` and ``weight_dtype`` (what its memory was
    counted for): a value the run leaves null takes the plan's; one the run sets must agree with the plan's
    where that changes the run (sharded: over the plan's w > 1 replicas; the weight dtype: under ``precision``,
    the run's resolved one, where 'compute' under fp32 is float32 too).

    Raises:
        ConfigError: a value set by the run that the plan contradicts (naming both, and the fix), a plan's
            weight_dtype that is unknown, or optim.name=muon with a plan that steps on the host (``host_optimizer``).
    """
    if p.weight_dtype not in precisions.WEIGHT_DTYPES:
        raise ConfigError(
            f"the plan's weight_dtype ({p.weight_dtype!r}) is unknown; use one of {list(precisions.WEIGHT_DTYPES)} "
            f"in the plan file, or plan again"
        )
    conflicts = []
    if optim.sharded is not None and optim.sharded != p.sharded and p.data_parallel > 1:
        run, planned = str(optim.sharded).lower(), str(p.sharded).lower()
        conflicts.append(
            f"optim.sharded ({run}) contradicts the plan's sharded ({planned}, over {p.data_parallel} replicas): drop "
            f"optim.sharded or set optim.sharded={planned} to run the plan, or plan again with partition.sharded={run}"
        )
    dtype = precisions.weight_dtype
    if train.weight_dtype is not None and dtype(precision, train.weight_dtype) != dtype(precision, p.weight_dtype):
        conflicts.append(
            f"train.weight_dtype ({train.weight_dtype}) contradicts the plan's weight_dtype ({p.weight_dtype}, under "
            f"{precision}): drop train.weight_dtype or set train.weight_dtype={p.weight_dtype} to run the plan, or "
            f"plan again with train.weight_dtype={train.weight_dtype}"
        )
    host = host_optimizer(optim)
    if p.steps_on_host and host.name != optim.name:
        conflicts.append(
            f"optim.name ({optim.name}) with a plan whose stages step their optimizers on the host "
            f"(swap.optimizer=host), costed with optim.name={host.name} (Muon there would send every momentum matrix "
            f"to the device and back each step, which the plan does not count): set optim.name={host.name}, or plan "
            "again with partition.stream=false"
        )
    if conflicts:
        raise ConfigError("; ".join(conflicts))
    optim = optim if optim.sharded is not None else dataclasses.replace(optim, sharded=p.sharded)
    train = train if train.weight_dtype is not None else dataclasses.replace(train, weight_dtype=p.weight_dtype)
    return optim, train
