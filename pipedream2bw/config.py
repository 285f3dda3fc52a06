"""Typed configuration (dataclasses registered with Hydra's ConfigStore) and its validation."""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

class ConfigError(ValueError):
    """A config value that cannot work; the message names the value, why, and the fix."""


SCHEDULES = ("2bw", "flush", "gpipe")
WANDB_MODES = ("offline", "online", "disabled")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class PipelineConfig:
    schedule: str = "2bw"
    """'2bw' (1F1B, no flushes, two weight versions), 'flush' (PipeDream-Flush) or 'gpipe'."""
    num_stages: int = 4
    """Pipeline depth d; WORLD_SIZE must be num_stages * data_parallel."""
    num_microbatches: int = 8
    """Microbatches per batch m; 2bw needs m >= num_stages."""
    microbatch_size: int = 8
    """Sequences per microbatch b; a batch is data_parallel * m * b sequences."""
    balance: Optional[List[int]] = None
    """Layers per stage, first stage first; null splits the layers evenly."""
    data_parallel: int = 1
    """Replicas w of every stage; WORLD_SIZE = num_stages * data_parallel."""
    rank_map: Optional[List[List[int]]] = None
    """rank_map[stage][replica] = rank; null keeps a stage's replicas on one node when they fit."""
    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size in MiB; a bucket is reduced as soon as backward produced it."""
    recompute: bool = False
    """Activation recomputation: keep only each layer's input for backward and re-run its forward there."""
    trace: bool = False
    """Record when every F, B, send, recv, all-reduce and optimizer step ran on every rank for
    trace_steps steps; writes trace.json (Chrome/Perfetto), timeline.png and the bubble fraction."""
    trace_steps: int = 3
    """How many consecutive steps (batches) pipeline.trace records."""
    trace_first_step: Optional[int] = None
    """First traced step (0-based); null: train.warmup_steps, i.e. the first measured steps."""


@dataclass
class GPTConfig:
    name: str = "gpt"
    """Model family; 'gpt' is a decoder-only transformer as a list of layers."""
    num_layers: int = 5
    """Transformer blocks; the layer list adds embedding, final norm and LM head (+3)."""
    d_model: int = 128
    """Hidden size."""
    num_heads: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 128
    """Tokens per sequence (bytes, for the byte-level corpus)."""
    vocab_size: int = 256
    """Vocabulary size; >= 256 for byte-level text, > the largest id of a token file."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """A torch.optim optimizer by name, case-insensitive: sgd, adam, adamw, rmsprop, ... (not lbfgs)."""
    lr: float = 3e-3
    """Learning rate."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the optimizer, e.g. {momentum: 0.9} for sgd."""


@dataclass
class DataConfig:
    path: Optional[str] = None
    """A token file (.bin: token ids as written by scripts/prepare_tokens.py, memory-mapped), or a text
    file (.txt or .txt.gz, byte-level, read whole); null uses the shipped text."""
    token_dtype: str = "uint16"
    """Dtype of a .bin file's ids: 'uint16' (vocabularies up to 65536) or 'uint32'."""
    val_fraction: float = 0.0
    """Share of data.path held out for validation: its last tokens, never trained on; 0: none."""
    val_path: Optional[str] = None
    """A file of held-out data (of data.path's kind) for validation, instead of val_fraction."""


@dataclass
class TrainConfig:
    num_steps: int = 150
    """Batches (optimizer steps per stage) to train for."""
    log_every: int = 10
    """Log loss and throughput on rank 0 every this many steps."""
    warmup_steps: int = 3
    """Steps left out of the throughput figures."""
    global_batch_size: Optional[int] = None
    """Sequences per batch over all replicas; null means data_parallel * num_microbatches * microbatch_size, else it must equal that."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (and after the last); 0 writes none."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep in <run dir>/checkpoints; older ones are deleted once a newer one is complete."""
    eval_every: int = 0
    """Validation loss on held-out data (data.val_fraction or data.val_path) every this many steps and
    after the last, with the newest weights (forward only); 0: never."""
    eval_batches: int = 4
    """Validation batches per evaluation, each data_parallel * num_microbatches * microbatch_size
    windows; the same held-out windows at every evaluation."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in the run directory, if any (how a job
    restarted by torchrun --max-restarts picks up); 'never'; or a path: a checkpoint, its
    checkpoints/ directory, or a run directory, at any num_stages and data_parallel."""


@dataclass
class DistConfig:
    backend: str = "auto"
    """'auto' (nccl when CUDA is available, else gloo), 'gloo' or 'nccl'."""
    timeout_s: float = 300.0
    """Longest wait for any p2p transfer or gradient all-reduce before the run fails."""
    batch_p2p: Optional[bool] = None
    """Start each send together with the next receive; null: on for NCCL (needed there), off for gloo."""


@dataclass
class WandbConfig:
    mode: str = "offline"
    """'offline' (files in the run directory, no network), 'online' or 'disabled'."""
    project: str = "pipedream2bw"
    """wandb project name."""
    name: Optional[str] = None
    """Run name; null lets wandb choose."""
    group: Optional[str] = None
    """wandb group of the run; a sweep sets it to the sweep's name so that its jobs show together."""


@dataclass
class SweepConfig:
    nproc: Optional[int] = None
    """Processes each sweep job launches; null: pipeline.num_stages * pipeline.data_parallel."""
    timeout_s: float = 3600.0
    """Longest a sweep job may run; it is then stopped and recorded as failed, and the sweep goes on."""
    name: Optional[str] = None
    """The sweep's name, also the wandb group of its jobs; null: the sweep directory."""
    objective: Optional[str] = "samples_per_s"
    """The job's figure a sweep returns (what hydra/sweeper=optuna optimizes): samples_per_s,
    tokens_per_s, final_loss, final_val_loss, step_time_s or max_peak_memory_mib; null: none."""


@dataclass
class TopologyConfig:
    """A machine description for the planner (``partitioner/``); the runtime itself ignores it."""

    name: str = "cpu"
    """Preset name, for tables and plan files."""
    device: str = "cpu"
    """'cpu' (ranks are processes sharing the host) or 'cuda' (one GPU per rank)."""
    nodes: int = 1
    """Nodes in the machine."""
    devices_per_node: int = 2
    """Devices (ranks) per node."""
    memory_per_device_gib: float = 12.0
    """Memory one device may use (GiB); on 'cpu', the host memory split among the ranks."""
    cores: Optional[int] = 2
    """CPU cores shared by all ranks ('cpu' only): more busy ranks than cores share them; null on GPUs."""
    intra_node_bw_gbps: float = 1.5
    """Bandwidth of a link within a node (GB/s): NVLink on a GPU node, loopback TCP on this machine."""
    intra_node_latency_us: float = 150.0
    """Latency of one message within a node (microseconds)."""
    inter_node_bw_gbps: float = 1.5
    """Bandwidth between nodes per device (GB/s), e.g. InfiniBand."""
    inter_node_latency_us: float = 150.0
    """Latency of one message between nodes (microseconds)."""
    host_memory_gib: float = 24.0
    """Host memory per node (GiB): where swapped activations go."""
    host_device_bw_gbps: float = 10.0
    """Host-device copy bandwidth (GB/s, PCIe on GPUs) for swapping."""
    peak_tflops: float = 0.05
    """Achievable dense compute per device (TFLOP/s) for analytic (unprofiled) layer costs."""
    memory_bw_gbps: float = 10.0
    """Device memory bandwidth (GB/s) for analytic costs of memory-bound layers and optimizer steps."""
    runtime_overhead_gib: Optional[float] = None
    """Memory the runtime takes before any model (CUDA context, NCCL, the torch process on CPU), GiB;
    null: measured (on CPU, this process's peak RSS before the model is built)."""


@dataclass
class PartitionConfig:
    mode: str = "manual"
    """'manual' (pipeline.* as given), 'auto' (rank 0 profiles and plans at startup) or 'file' (run partition.path)."""
    path: Optional[str] = None
    """Plan file to run ('file'), or where 'auto' and the CLI write theirs (null: plan.yaml in the run dir / cwd)."""
    objective: str = "throughput"
    """'throughput' (fastest plan that fits) or 'memory' (lowest peak memory per device)."""
    costs: str = "auto"
    """Layer costs: 'profile' (measure here), 'analytic' (FLOP-based), 'auto' (profile if topology.device is this machine's)."""
    microbatch_sizes: Optional[List[int]] = None
    """Candidate microbatch sizes b; null: every divisor of the per-replica batch up to 64."""
    depths: Optional[List[int]] = None
    """Candidate pipeline depths d; null: every divisor of the device count up to the layer count."""
    recompute: Optional[bool] = None
    """Force recomputation on or off; null lets the planner choose."""
    swap: bool = True
    """Let the planner swap activations to host memory on stages that would not fit otherwise."""
    swap_resident: int = 1
    """Microbatches whose activations stay on device on a swapping stage (swap.resident)."""
    cache_dir: Optional[str] = None
    """Profile cache directory; null: ~/.cache/pipedream2bw."""
    repeats: int = 5
    """Timed repeats per layer when profiling (median), after warm-up."""
    analytic_dtype_bytes: int = 4
    """Bytes per weight and activation for analytic costs: 4 (fp32, as this runtime trains), 2 (fp16/bf16 mixed precision)."""


@dataclass
class SwapConfig:
    """Swapping of stashed activations to host memory (DESIGN.md section 5; pipedream2bw/swap.py)."""

    enabled: bool = False
    """Swap on every stage; false swaps only the stages listed in ``stages``."""
    stages: Optional[List[int]] = None
    """Stage indices to swap on, e.g. [0, 1] (stage 0 holds the most microbatches in flight); null: none, unless enabled."""
    min_bytes: int = 65536
    """Only saved storages of at least this many bytes move; smaller ones stay (the copy would cost more than it frees)."""
    resident: int = 1
    """Microbatches waiting for their backward whose activations stay on the device, besides the one being computed:
    1 brings microbatch k+1 back while k's backward runs; 0 fetches each at the start of its own backward (no overlap).
    A stage with at most resident + 1 microbatches in flight has nothing to gain and does not swap."""
    optimizer: str = "device"
    """'device', or 'host': every stage keeps its optimizer state and runs its update in host memory
    (KARMA, ZeRO-Offload); gradients go to the host at the step, new weights come back."""


@dataclass
class Config:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """Only for ``python -m pipedream2bw.sweep``; training ignores it."""
    swap: SwapConfig = field(default_factory=SwapConfig)
    seed: int = 0
    """Seeds weight initialisation (per layer) and the batch order."""


def register_configs() -> None:
    """Registers the schemas with Hydra's ConfigStore (``base_config``, ``model/base_gpt``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_gpt", node=GPTConfig)
    cs.store(group="topology", name="base_topology", node=TopologyConfig)
    cs.store(group="partition", name="base_partition", node=PartitionConfig)


def optimizer_class(name: str) -> type:
    """The torch.optim class called ``name`` (case-insensitive).

    Raises:
        ConfigError: no such optimizer in torch.optim.
    """
    classes = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }
    try:
        return classes[name.lower()]
    except KeyError:
        raise ConfigError(
            f"optim.name ({name!r}) is not a torch.optim optimizer; use one of {sorted(classes)}"
        ) from None


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Builds the optimizer named by ``cfg`` over ``params``.

    Raises:
        ConfigError: unknown optimizer, or keyword arguments it does not take.
    """
    cls = optimizer_class(cfg.name)
    try:
        return cls(params, lr=cfg.lr, **dict(cfg.kwargs))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"optim.kwargs ({dict(cfg.kwargs)}) are not valid for {cls.__name__}: {e}; "
            f"fix or remove them (e.g. optim.kwargs={{}})"
        ) from e


def even_balance(num_layers: int, num_stages: int) -> List[int]:
    """Splits ``num_layers`` into ``num_stages`` contiguous counts that differ by at most one.

    The extra layers go to the middle stages first: the first stage holds the most in-flight
    activations and the last the LM head, so they are the first to run out of memory.
    """
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    middle_first = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
    for s in middle_first[:extra]:
        counts[s] += 1
    return counts


def model_num_layers(model: GPTConfig) -> int:
    """Length of the model's layer list (the unit that stage boundaries count)."""
    return model.num_layers + 3  # embedding, blocks..., final norm, LM head


def gpt_balance(model: GPTConfig, num_stages: int) -> List[int]:
    """The GPT's default split: transformer blocks spread evenly (``even_balance``), the cheap
    embedding added to the first stage and the final norm and LM head to the last.

    Counting layers instead would leave a stage holding only the norm and head nearly idle.
    With fewer blocks than stages, falls back to ``even_balance`` over all layers.
    """
    if model.num_layers < num_stages:
        return even_balance(model_num_layers(model), num_stages)
    counts = even_balance(model.num_layers, num_stages)
    counts[0] += 1
    counts[-1] += 2
    return counts


def swap_stages(swap: SwapConfig, num_stages: int) -> List[int]:
    """The stages that swap: all when ``swap.enabled``, else ``swap.stages`` (validated)."""
    return list(range(num_stages)) if swap.enabled else sorted(swap.stages or [])


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
    if swap.min_bytes < 0:
        raise ConfigError(f"swap.min_bytes ({swap.min_bytes}) must be >= 0 (0 swaps every saved storage)")
    if swap.resident < 0:
        raise ConfigError(
            f"swap.resident ({swap.resident}) must be >= 0: the number of waiting microbatches kept on the device"
        )


def validate(cfg: Config, *, world_size: int, num_layers: Optional[int] = None, local_world_size: int = 1) -> List[int]:
    """Checks a config before any process group starts.

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
    p, mdl = cfg.pipeline, cfg.model
    gpt = num_layers is None
    num_layers = model_num_layers(mdl) if gpt else num_layers
    d, m = p.num_stages, p.num_microbatches
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule ({p.schedule!r}) is unknown; use one of {list(SCHEDULES)}")
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
    if world_size != d * w:
        raise ConfigError(
            f"world size ({world_size}) must equal pipeline.num_stages ({d}) x pipeline.data_parallel ({w}) = {d * w}; "
            f"launch with torchrun --nproc-per-node {d * w} or set pipeline.data_parallel={world_size // d}"
        )
    per_batch = w * p.microbatch_size
    B = cfg.train.global_batch_size
    if B is not None and (B % per_batch or B // per_batch != m):
        fix = f"set pipeline.num_microbatches={B // per_batch}" if B % per_batch == 0 and B > 0 else (
            f"use a multiple of data_parallel x microbatch_size = {per_batch}")
        raise ConfigError(
            f"train.global_batch_size ({B}) must equal pipeline.data_parallel ({w}) x pipeline.num_microbatches ({m}) "
            f"x pipeline.microbatch_size ({p.microbatch_size}) = {w * m * p.microbatch_size}; {fix}"
        )
    if p.bucket_mb <= 0:
        raise ConfigError(f"pipeline.bucket_mb ({p.bucket_mb}) must be > 0")
    if d > num_layers:
        raise ConfigError(
            f"pipeline.num_stages ({d}) is more than the model's {num_layers} layers; "
            f"lower pipeline.num_stages or add layers (model.num_layers)"
        )
    default = gpt_balance(mdl, d) if gpt else even_balance(num_layers, d)
    balance = list(p.balance) if p.balance is not None else default
    if len(balance) != d or any(n < 1 for n in balance) or sum(balance) != num_layers:
        raise ConfigError(
            f"pipeline.balance ({balance}) must list {d} positive layer counts (one per stage) "
            f"summing to the model's {num_layers} layers; e.g. pipeline.balance={default}"
        )
    if p.schedule == "2bw" and m < d:
        raise ConfigError(
            f"pipeline.num_microbatches ({m}) must be >= pipeline.num_stages ({d}) for 2bw "
            f"(two weight versions suffice only then); raise pipeline.num_microbatches to {d} or more"
        )
    if mdl.d_model % mdl.num_heads:
        raise ConfigError(f"model.num_heads ({mdl.num_heads}) must divide model.d_model ({mdl.d_model})")
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr ({cfg.optim.lr}) must be a positive number")
    if optimizer_class(cfg.optim.name) is torch.optim.LBFGS:
        raise ConfigError("optim.name (lbfgs) re-evaluates the loss through a closure, which a pipeline cannot; use sgd, adam, adamw, ...")
    build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim)
    t = cfg.train
    if t.num_steps < 1 or t.log_every < 1:
        raise ConfigError(f"train.num_steps ({t.num_steps}) and train.log_every ({t.log_every}) must be >= 1")
    if not 0 <= t.warmup_steps < t.num_steps:
        raise ConfigError(
            f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.num_steps ({t.num_steps})) "
            f"so that throughput is measured on at least one step; lower it"
        )
    if t.checkpoint_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError(
            f"train.checkpoint_every ({t.checkpoint_every}) must be >= 0 (0: no checkpoints) and "
            f"train.keep_checkpoints ({t.keep_checkpoints}) >= 1"
        )
    if t.eval_every < 0 or t.eval_batches < 1:
        raise ConfigError(
            f"train.eval_every ({t.eval_every}) must be >= 0 (0: no validation) and train.eval_batches ({t.eval_batches}) >= 1"
        )
    from pipedream2bw.data import check_data  # data.py imports this module

    check_data(cfg.data, vocab_size=mdl.vocab_size, seq_len=mdl.seq_len, need_val=t.eval_every > 0)
    if t.resume not in ("auto", "never") and not Path(t.resume).exists():
        raise ConfigError(
            f"train.resume ({t.resume}) is neither 'auto', 'never' nor an existing path; "
            f"point it at a checkpoint, a checkpoints/ directory or a run directory"
        )
    if p.trace:
        first = t.warmup_steps if p.trace_first_step is None else p.trace_first_step
        if p.trace_steps < 1 or first < 0 or first + p.trace_steps > t.num_steps:
            raise ConfigError(
                f"pipeline.trace_first_step ({first}) and pipeline.trace_steps ({p.trace_steps}) must trace at least one of "
                f"the train.num_steps ({t.num_steps}) steps and no more; lower them or raise train.num_steps"
            )
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
    _validate_swap(cfg.swap, d)
    return balance
