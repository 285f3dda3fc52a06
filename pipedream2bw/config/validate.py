"""The checks of a config's values before any process group starts, each naming the value, why and the fix
(``run/preflight.py`` adds those that need the model or the data files). torch is imported inside the checks of the
optimizer, the precision and the backend, which run after those of the shape and the ranges: the launcher finds
those mistakes without it (a third of a second, where importing torch takes one to several)."""

from __future__ import annotations

import logging
import math
import signal
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from pipedream2bw.config.corrections import DELAY_CORRECTIONS, FEEDBACK, PREDICTING, is_muon, prediction_refusal
from pipedream2bw.config.newest import PREDICT_HORIZON, newest_refusal
from pipedream2bw.config.ranges import check_ranges
from pipedream2bw.config.schema import (
    BACKENDS,
    LR_SCHEDULERS,
    ON_NONFINITE,
    PRECISIONS,
    SCHEDULES,
    UNCATCHABLE,
    WANDB_MODES,
    WEIGHT_DTYPES,
    Config,
    GPTConfig,
    HFModelConfig,
    SwapConfig,
    TrainConfig,
    even_balance,
    gpt_balance,
    model_num_layers,
    swap_stages,
)
from pipedream2bw.config.tensor_checks import tensor_parallel_refusal, validate_sequence_parallel
from pipedream2bw.errors import ConfigError

log = logging.getLogger(__name__)


def _validate_swap(swap: SwapConfig, num_stages: int) -> None:
    if swap.stages is not None:
        stages = list(swap.stages)
        bad = [s for s in stages if not 0 <= s < num_stages]
        if bad:
            raise ConfigError(
                f"swap.stages ({stages}) lists {bad}, not a stage of this {num_stages}-stage pipeline; "
                f"use indices 0..{num_stages - 1}"
            )
        if len(set(stages)) != len(stages):
            raise ConfigError(f"swap.stages ({stages}) lists a stage twice; list each stage once")
        if swap.enabled and sorted(stages) != list(range(num_stages)):
            raise ConfigError(
                f"swap.enabled (true) swaps every stage but swap.stages ({stages}) lists only some; "
                f"set swap.enabled=false to swap only those, or swap.stages=null to swap all"
            )
    if swap.optimizer not in ("device", "host"):
        raise ConfigError(f"swap.optimizer ({swap.optimizer!r}) is unknown; use 'device' or 'host'")
    if swap.host_step not in HOST_STEPS:
        raise ConfigError(f"swap.host_step ({swap.host_step!r}) is unknown; use one of {list(HOST_STEPS)}")
    if swap.min_bytes < 0:
        raise ConfigError(f"swap.min_bytes ({swap.min_bytes}) must be >= 0 (0 swaps every saved storage)")
    if swap.resident < 0:
        raise ConfigError(
            f"swap.resident ({swap.resident}) must be >= 0: the number of waiting microbatches kept on the device"
        )


def _validate_weight_stream(cfg: Config) -> None:
    """swap.weights=true: what weight streaming (pipedream2bw/memory/stream.py) composes with; the rest is refused.

    Composes: data parallelism (the host gradients all-reduced per layer), clipping, on_nonfinite=skip and fp16's loss
    scaler (the step agreement over the host gradients: their norm, finite or not; the step unscales them), validation
    passes (forward only, streamed), train.weight_dtype=compute (versions in the compute dtype on the host, float32
    masters and gradient sums). Refused: below."""
    s = cfg.swap
    if s.weight_prefetch < 0:
        raise ConfigError(f"swap.weight_prefetch ({s.weight_prefetch}) must be >= 0: layers copied ahead of use")
    if not s.weights:
        return
    why = None
    if not swap_stages(s, cfg.pipeline.num_stages):
        why = "no stage swaps; set swap.enabled=true or swap.stages=[...] to name the stages that stream"
    elif s.optimizer != "host":
        why = "a streamed stage's optimizer steps where its weights live, on the host; set swap.optimizer=host"
    if why is not None:
        raise ConfigError(f"swap.weights (true) with {why}")
    if cfg.optim.sharded and cfg.pipeline.data_parallel > 1:
        log.warning(
            "optim.sharded (true) is ignored on streamed stages (swap.weights): their masters and optimizer state are "
            "whole, in host memory; the other stages shard theirs"
        )


HOST_STEPS = ("auto", "background", "sync")  # swap.host_step


def _validate_host_step(cfg: Config) -> None:
    """swap.host_step=background: where the host step can leave the training thread (memory/host_optim.py)."""
    s, p = cfg.swap, cfg.pipeline
    if s.host_step != "background":
        return
    why = None
    if s.optimizer != "host":
        why = f"swap.optimizer ({s.optimizer!r}): only a host optimizer steps on a thread; set swap.optimizer=host"
    elif p.schedule != "2bw":
        why = (
            f"pipeline.schedule ({p.schedule!r}): batch t+1's first forward reads W(t+1) at once, so there is no "
            "batch to overlap the step with; use schedule=2bw or swap.host_step=sync"
        )
    elif cfg.optim.sharded and p.data_parallel > 1:
        why = "optim.sharded: sharded masters step synchronously; use swap.host_step=auto or sync"
    elif (
        cfg.train.weight_dtype == "compute"
        and cfg.train.precision != "fp32"
        and not (s.weights and len(swap_stages(s, p.num_stages)) == p.num_stages)
    ):
        why = (
            "train.weight_dtype (compute): compute-dtype weights step synchronously unless streamed; use "
            "swap.host_step=auto or sync, or stream every stage (swap.weights=true, swap.enabled=true)"
        )
    if why is not None:
        raise ConfigError(f"swap.host_step (background) with {why}")


def _validate_forward_lead(cfg: Config) -> None:
    """pipeline.forward_lead: forwards ahead of 1F1B's bound, under the two 1F1B schedules only (schedule=auto may
    choose either or zb1p, so elsewhere it is moot, as sync_warmup_steps is off 2bw)."""
    p = cfg.pipeline
    if p.forward_lead > 0 and p.schedule in ("gpipe", "zb1p", "zbv"):
        log.info(
            "pipeline.forward_lead (%d) is moot under pipeline.schedule=%s: %s",
            p.forward_lead,
            p.schedule,
            "all m forwards run first" if p.schedule == "gpipe" else "its zero-bubble order is its own",
        )


def _validate_check_ties(cfg: Config) -> None:
    """pipeline.check_ties compares a tie's copies on the stages holding them; the GPT's tie (model.tie_embeddings:
    the embedding and the head) is one parameter where one rank holds both (zbv's rank 0, chunks 0 and 2d-1; the one
    stage at d = 1), with no copies to compare: refused there, and without a tie (a layer list's ties: run/start.py)."""
    p = cfg.pipeline
    if not p.check_ties or not isinstance(cfg.model, GPTConfig):
        return
    where = (
        "the GPT has no tied weights (model.tie_embeddings=false)"
        if not cfg.model.tie_embeddings
        else "the GPT's tied embedding is one parameter on rank 0 under pipeline.schedule=zbv (chunks 0 and 2d-1)"
        if p.schedule == "zbv"
        else "the GPT's tied embedding is one parameter on the one stage (pipeline.num_stages=1)"
        if p.num_stages == 1
        else None
    )
    if where:
        raise ConfigError(
            f"pipeline.check_ties (true) compares a tie's copies across the stages holding them, but {where}: "
            "there is nothing to compare; set pipeline.check_ties=false"
        )


def _validate_sync_warmup(cfg: Config) -> None:
    """pipeline.sync_warmup_steps: flush's steps, then 2bw's, on the plain weight versions (pipeline/versions.py)."""
    p, n = cfg.pipeline, cfg.pipeline.sync_warmup_steps
    if n == 0:
        return
    if p.schedule != "2bw":
        log.info(
            "pipeline.sync_warmup_steps (%d) is moot under pipeline.schedule=%s: every step is synchronous",
            n,
            p.schedule,
        )
        return
    why = None
    if cfg.swap.optimizer == "host":
        why = "swap.optimizer (host): the host step's versions keep 2bw's rule throughout; set swap.optimizer=device"
    elif cfg.optim.sharded and p.data_parallel > 1:
        why = "optim.sharded (true) at pipeline.data_parallel > 1: sharded versions keep 2bw's rule; set it false"
    elif cfg.train.weight_dtype == "compute" and cfg.train.precision != "fp32":
        why = "train.weight_dtype (compute): compute-dtype versions keep 2bw's rule; set train.weight_dtype=fp32"
    elif cfg.train.precision == "fp16":
        why = "train.precision (fp16): the loss scaler's lag is 2bw's or flush's for a whole run; use bf16 or fp32"
    elif cfg.optim.delay_correction == "lookahead":
        why = (
            "optim.delay_correction (lookahead): it changes the optimizer for the whole run; use error_feedback or none"
        )
    elif p.tensor_parallel > 1:
        why = f"pipeline.tensor_parallel ({p.tensor_parallel}): not proven with split stages; set it to 1"
    if why is not None:
        raise ConfigError(f"pipeline.sync_warmup_steps ({n}) with {why}, or set pipeline.sync_warmup_steps=0")


def _validate_step_rules(cfg: Config) -> None:
    """The learning-rate schedule, gradient clipping and non-finite handling (optim.*, train.on_nonfinite)."""
    o, n = cfg.optim, cfg.train.num_steps
    if o.scheduler not in LR_SCHEDULERS:
        raise ConfigError(f"optim.scheduler ({o.scheduler!r}) is unknown; use one of {list(LR_SCHEDULERS)}")
    if not 0 <= o.warmup_steps <= n:
        raise ConfigError(
            f"optim.warmup_steps ({o.warmup_steps}) must be in [0, train.num_steps ({n})]: the learning-rate warm-up "
            f"runs within the training steps; lower it"
        )
    if not (math.isfinite(o.min_lr) and 0 <= o.min_lr <= o.lr):
        raise ConfigError(
            f"optim.min_lr ({o.min_lr}) must be in [0, optim.lr ({o.lr})]: the decay goes from optim.lr down to it"
        )
    if o.scheduler == "constant" and o.min_lr != 0:
        log.warning(
            "optim.min_lr (%g) is ignored by optim.scheduler=constant; use cosine or linear to decay to it", o.min_lr
        )
    if o.clip_grad_norm is not None and not (math.isfinite(o.clip_grad_norm) and o.clip_grad_norm > 0):
        raise ConfigError(
            f"optim.clip_grad_norm ({o.clip_grad_norm}) must be a positive number, or null for no clipping"
        )
    if cfg.train.on_nonfinite not in ON_NONFINITE:
        raise ConfigError(
            f"train.on_nonfinite ({cfg.train.on_nonfinite!r}) is unknown; use one of {list(ON_NONFINITE)}"
        )


def _validate_sharding(cfg: Config) -> None:
    """optim.sharded and train.weight_dtype: an elementwise optimizer; what does not compose yet is refused here."""
    t = cfg.train
    if t.weight_dtype is not None and t.weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"train.weight_dtype ({t.weight_dtype!r}) is unknown; use one of {list(WEIGHT_DTYPES)}")
    if t.weight_dtype == "compute" and t.precision != "fp32":
        _need_elementwise(cfg, "train.weight_dtype (compute)")
        if t.precision == "fp16":
            raise ConfigError(
                "train.weight_dtype (compute) with train.precision (fp16): fp16 autocast runs layer norms in float32, "
                "which then meet fp16 norm weights (torch refuses the mixed dtypes); use train.precision=bf16 or "
                "train.weight_dtype=fp32"
            )
        if getattr(cfg.model, "tie_embeddings", False):
            raise ConfigError(
                "train.weight_dtype (compute) with model.tie_embeddings (true): the tie's float32 gradient sum "
                "across stages is not written yet; set train.weight_dtype=fp32 or model.tie_embeddings=false"
            )
    o = cfg.optim
    if not o.sharded or cfg.pipeline.data_parallel == 1:
        return
    _need_elementwise(cfg, "optim.sharded (true)")


def _need_elementwise(cfg: Config, what: str) -> None:
    from pipedream2bw.config.optim import ELEMENTWISE_OPTIMIZERS

    o = cfg.optim
    if o.target or o.name.lower() not in ELEMENTWISE_OPTIMIZERS:
        raise ConfigError(
            f"{what} steps pieces of every parameter (flat float32 masters), which needs an elementwise "
            f"optimizer; {o.target or o.name} may not be one: use one of {list(ELEMENTWISE_OPTIMIZERS)}"
        )


def _validate_precision(cfg: Config) -> None:
    import torch

    t = cfg.train
    if cfg.partition.analytic_dtype_bytes is not None:
        raise ConfigError(
            f"partition.analytic_dtype_bytes ({cfg.partition.analytic_dtype_bytes}) was replaced by train.precision, "
            "which the planner's costs now follow (weights, activations, transfers); drop it and set "
            "train.precision=bf16, fp16 or fp32"
        )
    if t.precision not in PRECISIONS:
        raise ConfigError(f"train.precision ({t.precision!r}) is unknown; use one of {list(PRECISIONS)}")
    on_cuda = cfg.dist.backend == "nccl" or (cfg.dist.backend == "auto" and torch.cuda.is_available())
    if t.precision == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.precision (bf16) is not supported by this GPU ({torch.cuda.get_device_name()}); "
            f"use train.precision=fp16 (with loss scaling) or fp32"
        )
    if (
        not (t.loss_scale > 0 and math.isfinite(t.loss_scale))
        or t.loss_scale_growth_interval < 1
        or not t.loss_scale_min > 0
    ):
        raise ConfigError(
            f"train.loss_scale ({t.loss_scale}) and train.loss_scale_min ({t.loss_scale_min}) must be positive numbers "
            f"and train.loss_scale_growth_interval ({t.loss_scale_growth_interval}) >= 1"
        )


def signal_numbers(names: Sequence[str]) -> Dict[str, int]:
    """The signals ``train.preempt_signals`` names, by name.

    Raises:
        ConfigError: a name that is no signal here, or one that cannot be caught (bad input: exit 2, also where
            ``run()`` installs the handlers before any other check).
    """
    out = {}
    for name in names:
        sig = getattr(signal.Signals, str(name).upper(), None) if str(name).upper().startswith("SIG") else None
        if sig is None or sig.name in UNCATCHABLE:
            catchable = sorted(
                s.name for s in signal.Signals if s.name not in UNCATCHABLE and not s.name.startswith("SIG_")
            )
            raise ConfigError(f"{name!r} is not a signal that can be caught here; use names such as {catchable[:12]}")
        out[sig.name] = int(sig)
    return out


def validate_steps(t: TrainConfig) -> None:
    """The training-length settings, which ``partition=auto`` checks before it profiles and plans.

    Raises:
        ConfigError: naming the value and the fix.
    """
    if t.num_steps < 1 or t.log_every < 1:
        raise ConfigError(f"train.num_steps ({t.num_steps}) and train.log_every ({t.log_every}) must be >= 1")
    if not 0 <= t.warmup_steps < t.num_steps:
        raise ConfigError(
            f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.num_steps ({t.num_steps})) "
            f"so that throughput is measured on at least one step; lower it"
        )
    try:
        signal_numbers(t.preempt_signals)
    except ValueError as e:
        raise ConfigError(f"train.preempt_signals ({list(t.preempt_signals)}): {e}; or [] for none") from None


SAVE_FINAL = ("gathered", "sharded", "none")


def _validate_final(cfg: Config) -> None:
    """What a run writes at its end: ``train.save_final`` and ``train.export_hf``."""
    t = cfg.train
    if t.save_final not in SAVE_FINAL:
        raise ConfigError(f"train.save_final ({t.save_final!r}) is unknown; use one of {list(SAVE_FINAL)}")
    if t.export_hf is not None:
        if not isinstance(cfg.model, HFModelConfig):
            raise ConfigError(
                f"train.export_hf ({t.export_hf}) writes a Hugging Face model, which needs model=hf; use model=hf "
                "(model.pretrained=DIR, model.config_path=... or a hand-written model.config) or drop train.export_hf"
            )
        parent = Path(t.export_hf).resolve().parent
        if not parent.is_dir():
            raise ConfigError(
                f"train.export_hf ({t.export_hf}): its parent directory {parent} does not exist; create it first"
            )


def require_file(path: Optional[str], key: str) -> None:
    """A data file a key names (data.path, data.val_path) is there: checked before torch is imported, so that the
    launcher finds a mistyped path in a second (the data's own checks, which need torch, come later).

    Raises:
        ConfigError: naming the key and the path.
    """
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"{key} ({path}) is not a file; point {key} at a text file or a .bin token file")


def validate(
    cfg: Config,
    *,
    world_size: int,
    num_layers: Optional[int] = None,
    local_world_size: int = 1,
) -> List[int]:
    """Checks a config before any process group starts: all that needs no model and no data file
    (``pipedream2bw.run.preflight.check`` adds those, and calls this first).

    Args:
        cfg: the run's config.
        world_size: number of ranks that will run it.
        local_world_size: ranks on this node (one GPU each under NCCL).
        num_layers: length of a user's layer list; None for the GPT that ``cfg.model`` describes.

    Returns:
        The balance (layers per stage) the run will use: ``pipeline.balance``, else
        ``gpt_balance`` for the GPT and ``even_balance`` for other layer lists.

    Raises:
        ConfigError: naming the value, why it is wrong and how to fix it.
    """
    check_ranges(cfg)  # each number in its own range first: the checks below relate keys, and blamed the wrong one
    p, mdl = cfg.pipeline, cfg.model
    gpt = num_layers is None
    if gpt and not isinstance(mdl, GPTConfig):
        raise ConfigError(
            f"model ({mdl!r}) is not a GPTConfig; pass its layer count (the runner does) or use model=gpt"
        )
    num_layers = model_num_layers(mdl) if gpt else num_layers
    _validate_shape(cfg, world_size)
    balance = _validate_balance(cfg, num_layers, gpt=gpt)
    require_file(cfg.data.path, "data.path")
    require_file(cfg.data.val_path, "data.val_path")
    _validate_model_and_optim(cfg)
    _validate_train(cfg)
    _validate_run(cfg, local_world_size)
    _validate_swap(cfg.swap, p.num_stages)
    _validate_weight_stream(cfg)
    _validate_host_step(cfg)
    _validate_documents(cfg)
    _validate_tensor_parallel(cfg, gpt=gpt, local_world_size=local_world_size)
    _validate_sync_warmup(cfg)
    _validate_check_ties(cfg)
    why = newest_refusal(cfg)  # pipeline.weight_versions=newest: what it is not proven with
    if why:
        raise ConfigError(why)
    _validate_forward_lead(cfg)
    _validate_split_backward(cfg)
    _validate_v_schedule(cfg)
    return balance


def _validate_v_schedule(cfg: Config) -> None:
    """pipeline.schedule=zbv: what it is not proven with is refused in one line naming the key."""
    refused = v_schedule_refusal(cfg)
    if refused:
        raise ConfigError(refused)


def v_schedule_refusal(cfg: Config) -> Optional[str]:
    """Why ``cfg`` cannot run pipeline.schedule=zbv (two chunks a rank, run/chunks.py), in one line naming the key and
    the fix, or None. zbv is proven against the flush reference on gloo, at w >= 1, under partition=manual|auto|file
    (a plan's balance lists its 2d chunks), with AdamW and SGD, clipping, fp32, bf16 and fp16 (the compute dtype across
    every chunk boundary, the hand-off on rank d-1 too; fp16's loss scale and agreed skip), validation passes
    (run/evaluate.py's legs, a chunk each), the GPT's tied embeddings (chunks 0 and 2d-1, both on rank 0: one parameter
    there; a layer list's tie across ranks is refused in run/start.py), optim.sharded, swap.optimizer=host,
    train.weight_dtype=compute and packed documents. What it is not proven with is refused here; the planner asks too
    (schedule=auto skips zbv where this says no)."""
    if cfg.pipeline.schedule != "zbv":
        return None
    import torch

    why = "pipeline.schedule=zbv (two chunks a rank) is proven on gloo without"
    nccl = cfg.dist.backend == "nccl" or (cfg.dist.backend == "auto" and torch.cuda.is_available())
    refused = [
        (nccl or bool(cfg.dist.batch_p2p), "NCCL or dist.batch_p2p (sends held)", "dist.backend=gloo and no batch_p2p"),
        (bool(swap_stages(cfg.swap, cfg.pipeline.num_stages)), "swap.enabled/swap.stages", "neither"),
        (cfg.swap.weights, "swap.weights (weight streaming)", "it false"),
        (bool(cfg.pipeline.recompute), "pipeline.recompute", "it false"),
        (cfg.pipeline.tensor_parallel > 1, "pipeline.tensor_parallel > 1", "it 1"),
    ]
    for bad, what, fix in refused:
        if bad:
            return f"{why} {what}; set {fix}, or use pipeline.schedule=zb1p"
    return None


def _validate_tensor_parallel(cfg: Config, *, gpt: bool, local_world_size: int) -> None:
    """pipeline.tensor_parallel: t divides the GPT's heads and MLP width (model=hf's: run/preflight.py), fits a
    node (the topology's and the launch's: a tensor group's consecutive ranks stay on one node when t divides the
    ranks per node), and composes (or one line)."""
    t = cfg.pipeline.tensor_parallel
    if t == 1:
        if cfg.pipeline.sequence_parallel:
            log.info("pipeline.sequence_parallel (true) is moot at pipeline.tensor_parallel=1: no tensor group splits")
        return
    why = tensor_parallel_refusal(cfg, gpt=gpt)
    if why is not None:
        raise ConfigError(f"pipeline.tensor_parallel ({t}) {why}")
    mdl = cfg.model
    if isinstance(mdl, GPTConfig) and (mdl.num_heads % t or (4 * mdl.d_model) % t):
        raise ConfigError(
            f"pipeline.tensor_parallel ({t}) must divide model.num_heads ({mdl.num_heads}) and the MLP width "
            f"4 x model.d_model ({4 * mdl.d_model}): ranks split attention by heads, the MLP by width; pick a divisor"
        )
    if t > cfg.topology.devices_per_node:
        raise ConfigError(
            f"pipeline.tensor_parallel ({t}) is more than topology.devices_per_node ({cfg.topology.devices_per_node}): "
            "a tensor group all-reduces every layer and must stay on one node; lower pipeline.tensor_parallel"
        )
    if local_world_size % t:
        raise ConfigError(
            f"pipeline.tensor_parallel ({t}) must divide the ranks per node ({local_world_size}, LOCAL_WORLD_SIZE): a "
            "tensor group's t consecutive ranks must stay on one node; launch a multiple of t ranks per node"
        )
    validate_sequence_parallel(cfg)


PACKINGS = ("windows", "documents")


def _validate_documents(cfg: Config) -> None:
    """data.packing=documents: what it is proven with (docs/data.md); each other feature refused in one line."""
    packing = cfg.data.packing
    if packing not in PACKINGS:
        raise ConfigError(f"data.packing ({packing!r}) is unknown; use one of {list(PACKINGS)}")
    if packing == "windows":
        return
    why = (
        "data.packing=documents is proven with the built-in GPT and model=hf's Llama family in fp32 and bf16 (2bw, "
        "flush, gpipe, zb1p, zbv, recompute, optim.sharded, activation swapping, the GPT's partition=auto), without"
    )
    refused = [
        (not isinstance(cfg.model, (GPTConfig, HFModelConfig)), "a layer list (model=custom)", "model=gpt or hf"),
        (
            cfg.train.precision == "fp16",  # its loss scaling with the weighted loss is not proven
            "train.precision=fp16",
            "train.precision=bf16 or fp32",
        ),
        (
            cfg.partition.mode == "auto" and not isinstance(cfg.model, GPTConfig),
            "partition=auto for model=hf (the planner profiles its layers on windows, without the mask)",
            "partition=manual with pipeline.*",
        ),
        (cfg.swap.weights or cfg.swap.optimizer != "device", "swap.weights/swap.optimizer", "their defaults"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"{why} {what}; set {fix}, or data.packing=windows")


def _validate_split_backward(cfg: Config) -> None:
    """pipeline.schedule=zb1p splits each backward into B (input gradient) and W (weight gradient), autograd's graph
    kept between them (pipeline/split_backward.py); what holds or moves a stage's saved tensors by backward is
    refused."""
    if cfg.pipeline.schedule != "zb1p":
        return
    why = None
    if swap_stages(cfg.swap, cfg.pipeline.num_stages):
        why = "swapping (swap.enabled or swap.stages): it moves a microbatch's saved tensors around one backward, "
        why += "which zb1p splits in two; use pipeline.schedule=flush with swapping, or drop swap.enabled/swap.stages"
    elif cfg.pipeline.recompute or cfg.partition.recompute:
        why = "recomputation (pipeline.recompute or partition.recompute): B would recompute each layer and W again "
        why += "(the checkpoint's recomputation runs once per pass); use pipeline.schedule=flush with recompute, or "
        why += "set pipeline.recompute=false"
    if why is not None:
        raise ConfigError(f"pipeline.schedule (zb1p) with {why}")


def _validate_shape(cfg: Config, world_size: int) -> None:
    """The pipeline's shape: schedule, stages, microbatches, replicas, against the ranks launched."""
    p = cfg.pipeline
    d, m = p.num_stages, p.num_microbatches
    if p.schedule == "auto":  # a plan replaces it before these checks (partition=auto|file)
        raise ConfigError(
            f"pipeline.schedule (auto) is the planner's choice, and partition.mode is {cfg.partition.mode!r}: use "
            f"partition=auto, or name one of {list(SCHEDULES)}"
        )
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule ({p.schedule!r}) is unknown; use one of {list(SCHEDULES)} or auto")
    if d < 1:
        raise ConfigError(f"pipeline.num_stages ({d}) must be >= 1")
    if m < 1 or p.microbatch_size < 1:
        raise ConfigError(
            f"pipeline.num_microbatches ({m}) and pipeline.microbatch_size ({p.microbatch_size}) must be >= 1"
        )
    w = p.data_parallel
    if w < 1:
        raise ConfigError(f"pipeline.data_parallel ({w}) must be >= 1")
    if world_size % d:
        raise ConfigError(
            f"world size ({world_size}) is not divisible by pipeline.num_stages ({d}); "
            f"launch a multiple of {d} ranks or change pipeline.num_stages"
        )
    t = p.tensor_parallel
    if t < 1:
        raise ConfigError(f"pipeline.tensor_parallel ({t}) must be >= 1")
    if t > 1 and world_size == d * w * t:
        return
    if t > 1:
        raise ConfigError(
            f"world size ({world_size}) must equal pipeline.num_stages ({d}) x pipeline.data_parallel ({w}) x "
            f"pipeline.tensor_parallel ({t}) = {d * w * t}; launch with torchrun --nproc-per-node {d * w * t}"
        )
    if world_size != d * w:
        raise ConfigError(
            f"world size ({world_size}) must equal pipeline.num_stages ({d}) x pipeline.data_parallel ({w}) = {d * w}; "
            f"launch with torchrun --nproc-per-node {d * w} or set pipeline.data_parallel={world_size // d}"
        )


def _validate_balance(cfg: Config, num_layers: int, *, gpt: bool) -> List[int]:
    """The global batch, the buckets and the split of the model's ``num_layers`` layers into stages.

    Returns:
        The balance: ``pipeline.balance``, else the GPT's or an even split.
    """
    p, mdl = cfg.pipeline, cfg.model
    d, m, w = p.num_stages, p.num_microbatches, p.data_parallel
    per_batch = w * p.microbatch_size
    B = cfg.train.global_batch_size
    if B is not None and (B % per_batch or B // per_batch != m):
        fix = (
            f"set pipeline.num_microbatches={B // per_batch}"
            if B % per_batch == 0 and B > 0
            else (f"use a multiple of data_parallel x microbatch_size = {per_batch}")
        )
        raise ConfigError(
            f"train.global_batch_size ({B}) must equal pipeline.data_parallel ({w}) x pipeline.num_microbatches ({m}) "
            f"x pipeline.microbatch_size ({p.microbatch_size}) = {w * m * p.microbatch_size}; {fix}"
        )
    if p.bucket_mb <= 0:
        raise ConfigError(f"pipeline.bucket_mb ({p.bucket_mb}) must be > 0")
    c = 2 * d if p.schedule == "zbv" else d  # zbv: 2d chunks, two a rank
    if c > num_layers:
        raise ConfigError(
            f"pipeline.num_stages ({d}) is more than the model's {num_layers} layers"
            + (" can split into (zbv: 2 chunks a stage)" if c > d else "")
            + "; lower pipeline.num_stages or add layers (model.num_layers)"
        )
    default = gpt_balance(mdl, c) if gpt else even_balance(num_layers, c)
    balance = list(p.balance) if p.balance is not None else default
    if len(balance) != c or any(n < 1 for n in balance) or sum(balance) != num_layers:
        raise ConfigError(
            f"pipeline.balance ({balance}) must list {c} positive layer counts (one per "
            + ("chunk: zbv runs 2 a stage" if c > d else "stage")
            + f") summing to the model's {num_layers} layers; e.g. pipeline.balance={default}"
        )
    if p.schedule == "2bw" and m < d:
        raise ConfigError(
            f"pipeline.num_microbatches ({m}) must be >= pipeline.num_stages ({d}) for 2bw "
            f"(two weight versions suffice only then); raise pipeline.num_microbatches to {d} or more"
        )
    return balance


def _validate_model_and_optim(cfg: Config) -> None:
    """The GPT's heads, the sequence length, the optimizer (built once, on a scalar), its step rules and sharding."""
    import torch

    from pipedream2bw.config.optim import build_optimizer, optimizer_of

    mdl = cfg.model
    if isinstance(mdl, GPTConfig) and mdl.d_model % mdl.num_heads:
        raise ConfigError(f"model.num_heads ({mdl.num_heads}) must divide model.d_model ({mdl.d_model})")
    if mdl.seq_len < 1:
        raise ConfigError(f"model.seq_len ({mdl.seq_len}) must be >= 1")
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr ({cfg.optim.lr}) must be a positive number")
    if optimizer_of(cfg.optim) is torch.optim.LBFGS:
        raise ConfigError(
            "optim (lbfgs) re-evaluates the loss through a closure, which a pipeline cannot; use sgd, adam, adamw, ..."
        )
    _validate_optim_extras(cfg)  # before the trial build: it names what Muon and the corrections refuse
    _validate_rotation(cfg)
    build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim)
    _validate_step_rules(cfg)
    _validate_sharding(cfg)


def _validate_optim_extras(cfg: Config) -> None:
    """optim.name=muon and optim.delay_correction: what composes, and what is refused and why."""
    import torch

    from pipedream2bw.config.optim import optimizer_class

    o = cfg.optim
    if o.delay_correction not in DELAY_CORRECTIONS:
        raise ConfigError(
            f"optim.delay_correction ({o.delay_correction!r}) is unknown; use one of {['auto', *DELAY_CORRECTIONS]}"
        )
    muon = is_muon(o)
    if muon:
        others = optimizer_class(o.muon_others)  # raises for an unknown name
        if others is torch.optim.Muon:
            raise ConfigError(
                "optim.muon_others (muon): Muon takes only 2-D parameters; name the optimizer for the rest, "
                "e.g. optim.muon_others=adamw"
            )
        if o.sharded and cfg.pipeline.data_parallel > 1:
            raise ConfigError(
                "optim.name (muon) with optim.sharded (true) at pipeline.data_parallel > 1: Muon orthogonalizes "
                "whole matrices, and sharding gives each replica a flat piece of every parameter; set "
                "optim.sharded=false (or use an elementwise optimizer such as adamw)"
            )
        if cfg.partition.sharded and cfg.partition.mode == "auto":
            raise ConfigError(
                "partition.sharded (true) with optim.name (muon): the plan's replicas would shard the optimizer, and "
                "Muon orthogonalizes whole matrices; drop partition.sharded (the search then never shards Muon) or "
                "use an elementwise optimizer such as optim.name=adamw"
            )
    _validate_horizon(cfg)
    if o.delay_correction == "none":
        return
    if cfg.pipeline.schedule != "2bw":
        log.info(
            "optim.delay_correction (%s) is off under pipeline.schedule=%s: every gradient is taken at the weights it "
            "updates, so there is no delay to correct",
            o.delay_correction,
            cfg.pipeline.schedule,
        )
    if o.delay_correction in FEEDBACK and not (math.isfinite(o.error_feedback_beta) and o.error_feedback_beta >= 0):
        raise ConfigError(f"optim.error_feedback_beta ({o.error_feedback_beta}) must be a finite number >= 0")
    _validate_prediction(cfg)
    if o.delay_correction == "lookahead":
        name = "custom" if o.target else o.name.lower()
        if name not in ("adamw", "muon") or (muon and o.muon_others.lower() != "adamw"):
            raise ConfigError(
                f"optim.delay_correction (lookahead) with optim.name ({o.target or o.name})"
                + (f" and optim.muon_others ({o.muon_others})" if muon else "")
                + ": the look-ahead is Nesterov momentum 0.99 in place of AdamW's heavy ball (NAdamW) and Muon's "
                "momentum; it is defined for adamw and muon (with muon_others=adamw); use one of them, or "
                "optim.delay_correction=error_feedback, which wraps any optimizer"
            )
        if "betas" in o.kwargs and o.kwargs["betas"][0] != 0.99 or "momentum" in o.muon_kwargs:
            raise ConfigError(
                "optim.delay_correction (lookahead) sets beta1 (optim.kwargs.betas[0]) and Muon's momentum to "
                "0.99; remove them from optim.kwargs / optim.muon_kwargs (betas[1] may stay: give betas=[0.99, b2])"
            )


def _validate_rotation(cfg: Config) -> None:
    """optim.name=adamw_rotated: whole matrices stepped on the stage's device, the planner not asked."""
    from pipedream2bw.config.optimizers import is_rotated

    if not is_rotated(cfg.optim):
        return
    why = None
    if cfg.swap.optimizer == "host" or cfg.swap.weights:
        why = "swap.optimizer (host) / swap.weights: the rotation's host step is not built; set swap.optimizer=device"
    elif cfg.pipeline.tensor_parallel > 1:
        why = (
            f"pipeline.tensor_parallel ({cfg.pipeline.tensor_parallel}): a split matrix's covariances need the whole "
            "matrix, which is not gathered for it; set pipeline.tensor_parallel=1"
        )
    elif cfg.partition.mode == "auto":
        why = (
            "partition.mode (auto): the planner's memory model does not count the rotation's covariances and bases "
            "(2 (rows^2 + cols^2) floats a matrix); use partition.mode=manual"
        )
    if why is not None:
        raise ConfigError(f"optim.name (adamw_rotated) with {why}, or use optim.name=adamw")


def _validate_horizon(cfg: Config) -> None:
    """optim.predict_horizon: newest's prediction's alone (the batch rule's predicts one step)."""
    o, p = cfg.optim, cfg.pipeline
    if o.predict_horizon == PREDICT_HORIZON or (p.weight_versions == "newest" and o.delay_correction == "predict"):
        return
    raise ConfigError(
        f"optim.predict_horizon ({o.predict_horizon}) sets how far newest's prediction reaches, and this run has "
        f"pipeline.weight_versions={p.weight_versions} with optim.delay_correction={o.delay_correction}"
        + (f" under pipeline.schedule={p.schedule}" if p.schedule != "2bw" else "")
        + f": remove it (its default is {PREDICT_HORIZON}), or set pipeline.weight_versions=newest and "
        "optim.delay_correction=predict (or auto, with optim.name=muon)"
    )


def _validate_prediction(cfg: Config) -> None:
    """optim.delay_correction=predict|predict_error_feedback: the prediction lives in the plain weight versions
    (pipeline/versions.py); what refuses it is ``corrections.prediction_refusal`` ('auto' falls back by it). Under
    pipeline.weight_versions=newest, predict is newest's own (its early forwards', ``PredictedNewestVersions``), which
    config/newest.py refuses where it does not run."""
    if cfg.optim.delay_correction not in PREDICTING or cfg.pipeline.weight_versions == "newest":
        return
    why = prediction_refusal(cfg)
    if why is not None:
        raise ConfigError(
            f"optim.delay_correction ({cfg.optim.delay_correction}) with {why}, "
            "or use optim.delay_correction=error_feedback"
        )


def _validate_train(cfg: Config) -> None:
    """The training loop's settings: steps, checkpoints, validation, what to resume, what to trace."""
    p = cfg.pipeline
    t = cfg.train
    validate_steps(t)
    if t.checkpoint_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError(
            f"train.checkpoint_every ({t.checkpoint_every}) must be >= 0 (0: no checkpoints) and "
            f"train.keep_checkpoints ({t.keep_checkpoints}) >= 1"
        )
    if t.eval_every < 0 or t.eval_batches < 1:
        raise ConfigError(
            f"train.eval_every ({t.eval_every}) must be >= 0 (0: no validation) and train.eval_batches "
            f"({t.eval_batches}) >= 1"
        )
    if t.resume not in ("auto", "never") and not Path(t.resume).exists():
        raise ConfigError(
            f"train.resume ({t.resume}) is neither 'auto', 'never' nor an existing path; "
            f"point it at a checkpoint, a checkpoints/ directory or a run directory"
        )
    if p.trace:
        first = t.warmup_steps if p.trace_first_step is None else p.trace_first_step
        if p.trace_steps < 1 or first < 0 or first + p.trace_steps > t.num_steps:
            raise ConfigError(
                f"pipeline.trace_first_step ({first}) and pipeline.trace_steps ({p.trace_steps}) must trace at least "
                f"one of the train.num_steps ({t.num_steps}) steps and no more; lower them or raise train.num_steps"
            )


def _validate_run(cfg: Config, local_world_size: int) -> None:
    """Precision, what the run writes at its end, tracking and the process groups' backend."""
    import torch

    _validate_precision(cfg)
    _validate_final(cfg)
    if cfg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode ({cfg.wandb.mode!r}) is unknown; use one of {list(WANDB_MODES)}")
    if cfg.dist.backend not in BACKENDS:
        raise ConfigError(f"dist.backend ({cfg.dist.backend!r}) is unknown; use one of {list(BACKENDS)}")
    if cfg.dist.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend (nccl) needs CUDA, which is not available here; use dist.backend=gloo")
    uses_nccl = cfg.dist.backend == "nccl" or (cfg.dist.backend == "auto" and torch.cuda.is_available())
    if uses_nccl and local_world_size > torch.cuda.device_count():
        raise ConfigError(
            f"{local_world_size} ranks on this node but {torch.cuda.device_count()} GPUs: NCCL needs one GPU per rank "
            f"(LOCAL_RANK); launch at most {torch.cuda.device_count()} ranks per node or use dist.backend=gloo"
        )
    if cfg.dist.timeout_s <= 0:
        raise ConfigError(f"dist.timeout_s ({cfg.dist.timeout_s}) must be > 0")
