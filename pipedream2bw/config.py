"""Typed configuration (dataclasses registered with Hydra's ConfigStore) and its validation."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from pipedream2bw.errors import ConfigError  # re-exported: users' code imports it from here

log = logging.getLogger(__name__)

SCHEDULES = ("2bw", "flush", "gpipe")
WANDB_MODES = ("offline", "online", "disabled")
BACKENDS = ("auto", "gloo", "nccl")
LR_SCHEDULERS = ("constant", "cosine", "linear")
ON_NONFINITE = ("stop", "skip")


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
    check_ties: bool = False
    """Debug: after every step, compare a digest of each tied parameter's copies across the stages holding
    them (two small all-reduces per step); the run fails on the first step where they differ."""


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
    tie_embeddings: bool = False
    """Share the LM head's weight with the token embedding (as GPT-2 does); across stages, every
    stage holding it keeps a copy and their gradients are summed before the step."""


@dataclass
class LayerListConfig:
    """A user's model: a factory that returns its layer list (``model=custom model._target_=...``)."""

    target: str = "???"
    """Import path of the factory, ``pkg.module.function`` (Hydra's ``_target_``). It returns a list of
    ``nn.Module``s (each layer takes the previous one's output); it is called with ``kwargs``, plus
    ``seq_len``, ``seed`` and ``indices`` when it takes them. A factory taking ``indices`` builds
    only those layers (each rank its own); otherwise it builds the whole list under
    ``torch.manual_seed(seed)``, and each rank keeps its slice."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory (the model entry's other keys, e.g. ``+model.width=512``)."""
    seq_len: int = 128
    """Tokens per sequence the data feed gives the first layer (byte-level, token ids 0..255)."""
    loss: Optional[str] = None
    """Import path of the loss, (last layer's output, targets (B, T) int64) -> scalar; a class is
    instantiated with ``loss_kwargs``, a function bound to them; null: next-token cross-entropy."""
    loss_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the loss (its entry's other keys when ``loss`` is given as ``{_target_: ...}``)."""
    name: str = "custom"
    """Label for logs and plan files."""
    vocab_size: Optional[int] = None
    """Token ids the model takes (every id in the data must be below it). null: read from the layers (the
    rows of the first layer's first nn.Embedding; with the default loss, also the last layer's last
    nn.Linear's outputs: the smaller); required for token files when neither is there."""


@dataclass
class HFModelConfig:
    """A transformers causal LM as a layer list (``model=hf``): [embedding, decoder layers..., final norm, head].

    Llama, Mistral and Qwen2 (decoder layers that take rotary ``position_embeddings``) and GPT-2;
    from a hand-written config (``model_type`` and ``config``), a local ``config.json``
    (``config_path``) or a ``save_pretrained`` directory (``pretrained``). Nothing is downloaded.
    """

    name: str = "hf"
    """Label for logs and plan files."""
    model_type: Optional[str] = None
    """transformers' model_type of a hand-written config: 'llama', 'mistral', 'qwen2' or 'gpt2'; null with
    config_path or pretrained, whose config.json names it."""
    config: Dict[str, Any] = field(default_factory=dict)
    """Keys of a hand-written transformers config (hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings, ...; GPT-2: n_embd, n_layer, ...);
    transformers' defaults fill in the rest. Must be empty with config_path or pretrained."""
    config_path: Optional[str] = None
    """A local config.json: the model it describes, randomly initialised (seeded per layer)."""
    pretrained: Optional[str] = None
    """A local save_pretrained directory (config.json plus model.safetensors, or shards listed by
    model.safetensors.index.json): its weights, each rank reading only its own layers' tensors into
    float32 master weights. A hub name is refused: download it first and pass the directory."""
    seq_len: int = 128
    """Tokens per sequence the data feed gives the first layer; at most the model's max_position_embeddings."""
    dropout: Optional[float] = 0.0
    """Every dropout probability of the config (attention_dropout; GPT-2's resid/embd/attn_pdrop) set to this;
    null keeps the config's own. 0 makes the pipeline's numbers equal to a single-process run's."""
    export_dtype: Optional[str] = None
    """Dtype of exported weights (train.export_hf, export-hf): 'float32', 'bfloat16' or 'float16'; null: the
    pretrained files' dtype (float32 for a model not loaded from one)."""

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (its config's ``vocab_size``): token files are checked against it."""
        from pipedream2bw.models.hf import resolve_config  # models/ imports this module

        return resolve_config(self).config.vocab_size


@dataclass
class OptimConfig:
    name: str = "adamw"
    """A torch.optim optimizer by name, case-insensitive: sgd, adam, adamw, rmsprop, ... (not lbfgs)."""
    lr: float = 3e-3
    """Learning rate: the peak of optim.scheduler's schedule (all of it for 'constant')."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the optimizer, e.g. {momentum: 0.9} for sgd."""
    scheduler: str = "constant"
    """Learning rate of step t: 'constant' (lr), 'cosine' or 'linear' (decay from lr to min_lr over the
    steps after the warm-up, reaching min_lr at the last of train.num_steps); all after warmup_steps of warm-up."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up: step t < warmup_steps uses lr * (t + 1) / warmup_steps (not train.warmup_steps,
    which only leaves steps out of the throughput figures)."""
    min_lr: float = 0.0
    """Learning rate that 'cosine' and 'linear' decay to; ignored by 'constant'."""
    clip_grad_norm: Optional[float] = None
    """Clip the gradient to this global 2-norm over all stages and replicas (torch.nn.utils.clip_grad_norm_ on
    the whole model); null: no clipping. The norm is logged every step."""
    target: Optional[str] = None
    """An optimizer class by import path (e.g. torch.optim.SGD or my_pkg.Lion), used instead of ``name``;
    ``optim=custom optim._target_=... +optim.momentum=0.9`` writes it Hydra's way (``_partial_: true``)."""
    no_decay_norms_and_biases: bool = False
    """Two parameter groups: weight decay (``kwargs.weight_decay``) on weights of 2 or more dimensions,
    none on 1-D parameters (norm scales, biases), as GPT training usually does."""
    sharded: Optional[bool] = None
    """ZeRO-1 over the data-parallel replicas (docs/design.md section 10): the w replicas of a stage each keep
    1/w of the float32 master weights and optimizer state; gradients reduce-scatter in buckets, each replica
    steps its shard, the new weights are all-gathered (under 2bw while the next batch runs). Needs an
    elementwise optimizer (sgd, adam, adamw, ...); with data_parallel 1 it changes nothing. null: false, or
    under partition=auto|file the plan's choice (a value set here must agree with the plan's)."""
    # --- Muon and the 2bw delay corrections (pipedream2bw/optimizers.py; docs/convergence.md) ---
    muon_kwargs: Dict[str, Any] = field(default_factory=dict)
    """optim.name=muon: keyword arguments for torch.optim.Muon (its defaults: momentum 0.95, nesterov, weight_decay
    0.1), with adjust_lr_fn 'match_rms_adamw' unless set here, so that optim.lr serves Muon and the other
    optimizer alike (the schedule sets the same lr on both); optim.kwargs go to the other optimizer."""
    muon_others: str = "adamw"
    """optim.name=muon: the torch.optim optimizer (by name) for what Muon does not take: parameters that are not
    2-D and those optim.muon_exclude matches."""
    muon_exclude: List[str] = field(default_factory=lambda: ["*Embedding*", "*Head*", "*head*"])
    """optim.name=muon: fnmatch patterns (case-sensitive) over each parameter's name within its stage and the class
    names of the modules on its path; a 2-D parameter matching any goes to optim.muon_others, not Muon. The
    default keeps embeddings (nn.Embedding) and the LM head (LMHead, lm_head) out of Muon. A tied weight must
    match on every stage that holds it (the default patterns do)."""
    delay_correction: str = "none"
    """Under pipeline.schedule=2bw, a correction of the one-step gradient delay, run in the deferred step on each
    stage (no extra communication): 'none'; 'error_feedback' (Zmushko et al. 2026: W(t+1) = W(t) + u(t) +
    beta * (u(t) - u(t-1)), u the optimizer's update; 4 bytes per parameter); 'lookahead' (Ajanthan et al.
    2025: Nesterov look-ahead with momentum 0.99, i.e. NAdamW for adamw and Muon's momentum 0.99 for muon; no
    extra state). flush and gpipe have no delay: the correction is off there (logged). docs/design.md states the
    exact rules."""
    error_feedback_beta: float = 1.0
    """optim.delay_correction=error_feedback: the weight beta of the previous step's estimated error."""


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
    """Sequences per batch over all replicas; null means data_parallel * num_microbatches * microbatch_size,
    else it must equal that."""
    on_nonfinite: str = "stop"
    """A non-finite loss or gradient in a batch: 'stop' (every rank exits non-zero; the message names the step,
    the stage and which was non-finite; the last complete checkpoint is kept) or 'skip' (no stage or replica
    steps for that batch; the run goes on and summary.json lists the skipped steps)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (and after the last); 0 writes none."""
    keep_checkpoints: int = 2
    """Complete checkpoints of this run's lineage to keep in <run dir>/checkpoints; older ones are deleted once a
    newer one is complete (another run's checkpoints in the same directory never are)."""
    eval_every: int = 0
    """Validation loss on held-out data (data.val_fraction or data.val_path) every this many steps and
    after the last, with the newest weights (forward only); 0: never."""
    eval_batches: int = 4
    """Validation batches per evaluation, each data_parallel * num_microbatches * microbatch_size
    windows; the same held-out windows at every evaluation."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint in the run directory, if any (how a job
    restarted by torchrun --max-restarts picks up); 'never'; or a path: a checkpoint, its
    checkpoints/ directory, or a run directory, at any num_stages and data_parallel. With 'auto', checkpoints
    that are there but none loadable stop the run (exit 2) rather than start it again from step 0."""
    resume_strict: bool = True
    """Refuse a checkpoint written with other model settings (e.g. model.num_heads) or training settings
    (train.precision, train.weight_dtype, the optimizer and its kwargs, the learning-rate schedule, 2bw vs
    flush/gpipe), naming them; false resumes anyway and logs the differences (another optimizer starts with
    fresh state)."""
    preempt_signals: List[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals that preempt the run (SLURM and Kubernetes send SIGTERM before they kill a job): every rank
    stops within two steps at one agreed step, writes a checkpoint of it, summary.json says
    "preempted", and the process exits with 128 + the signal's number (143) so that the scheduler
    requeues it; [] leaves the signals' default action (die at once, unsaved)."""
    precision: str = "auto"
    """'fp32', 'bf16' or 'fp16': each stage's forward and loss under torch.autocast to that dtype,
    float32 master weights, p2p transfers in that dtype; fp16 adds dynamic loss scaling. 'auto':
    bf16 on a CUDA device that supports it, else fp32."""
    weight_dtype: Optional[str] = None
    """What the weight versions are stored in: 'fp32' (the versions are the float32 masters the optimizer
    steps) or 'compute' (bf16 under train.precision=bf16: two versions of 2 B per parameter under 2bw,
    refreshed at each step from float32 masters that the optimizer keeps, sharded or not; gradients are
    summed over the microbatches in float32; refused under fp16 and with tied weights). Under fp32 both
    are the same. null: 'fp32', or under partition=auto|file the plan's (a value set here must agree with it).
    Checkpoints and the final weights (final_model.pt, final_model/, train.export_hf) hold the float32 masters;
    resuming with another value is refused unless train.resume_strict=false."""
    loss_scale: float = 65536.0
    """fp16 only: the first loss scale; halved on every step with a non-finite gradient (which is skipped)."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: the loss scale doubles after this many clean steps in a row."""
    loss_scale_min: float = 1.0
    """fp16 only: the floor; a scale below it means training diverges (logged as an error)."""
    save_final: str = "gathered"
    """The final weights at the end of a run: 'gathered' (final_model.pt, one state_dict written by rank 0, which
    holds the whole model for it), 'sharded' (final_model/: each stage writes its own layers as safetensors, with an
    index; no rank holds the whole model) or 'none'."""
    export_hf: Optional[str] = None
    """model=hf only: at the end of the run, write the final weights to this directory as a Hugging Face model
    (config.json, one safetensors shard per stage written by that stage, model.safetensors.index.json), which
    AutoModelForCausalLM.from_pretrained loads; written whole or not at all. null: no export."""


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
    """Plan file to run ('file'), or where 'auto' and python -m partitioner plan write theirs (null: 'auto' writes
    plan.yaml in the run directory, the CLI outputs/plans/<date>/<time>/plan.yaml; its --out comes first)."""
    sharded: Optional[bool] = False
    """Plan with optim.sharded (true), without (false), or let the search try both (null). The plan records its
    choice, which a run of it sets as optim.sharded (an optim.sharded set by the run must agree)."""
    objective: str = "throughput"
    """'throughput' (fastest plan that fits) or 'memory' (lowest peak memory per device)."""
    tolerance: float = 0.01
    """Plans within this fraction of the best objective count as tied; among them the other objective
    decides (throughput: least peak memory; memory: most samples/s)."""
    costs: str = "auto"
    """Layer costs: 'profile' (measure here), 'analytic' (FLOP-based), 'auto' (profile if topology.device is this
    machine's)."""
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
    analytic_dtype_bytes: Optional[int] = None
    """Removed: the planner's bytes follow train.precision (set that instead); must stay null."""


@dataclass
class SwapConfig:
    """Swapping of stashed activations to host memory (docs/design.md section 5; pipedream2bw/swap.py)."""

    enabled: bool = False
    """Swap on every stage; false swaps only the stages listed in ``stages``."""
    stages: Optional[List[int]] = None
    """Stage indices to swap on, e.g. [0, 1] (stage 0 holds the most microbatches in flight); null: none, unless
    enabled."""
    min_bytes: int = 65536
    """Only saved storages of at least this many bytes move; smaller ones stay (the copy would cost more than it
    frees)."""
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
    model: Any = field(default_factory=GPTConfig)
    """``GPTConfig`` (model=gpt), ``HFModelConfig`` (model=hf) or ``LayerListConfig`` (a factory named by
    ``_target_``)."""
    optim: Any = field(default_factory=OptimConfig)
    """``OptimConfig``; optim=custom's ``{_target_: cls, _partial_: true, ...}`` becomes one in ``from_hydra``."""
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
    # model and optim come untyped from their config groups: gpt.yaml and default.yaml type them
    # (base_gpt, base_optim); custom entries ({_target_: ...}) take any keys, typed by ``from_hydra``.
    cs.store(name="base_config", node=Config(model={}, optim={}))
    cs.store(group="model", name="base_gpt", node=GPTConfig)
    cs.store(group="model", name="base_hf", node=HFModelConfig)
    cs.store(group="optim", name="base_optim", node=OptimConfig)
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


def optimizer_name(cfg: OptimConfig) -> str:
    """What a checkpoint records of the optimizer: ``optim.target`` if set, else ``optim.name`` lower-cased."""
    return cfg.target if cfg.target else cfg.name.lower()


def _optimizer_of(cfg: OptimConfig) -> type:
    if not cfg.target:
        return optimizer_class(cfg.name)
    from pipedream2bw.models.factory import locate  # models/ imports config: import here

    cls = locate(cfg.target, what="optim._target_")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            f"optim._target_ ({cfg.target}) is {cls!r}, not a torch.optim.Optimizer subclass; name an optimizer class"
        )
    return cls


def param_groups(params, cfg: OptimConfig) -> list:
    """``params`` as the optimizer takes them: one list, or with ``no_decay_norms_and_biases`` two groups
    (1-D parameters without weight decay). Decided by shape, never by name, so that every stage
    holding a copy of a tied weight puts it in the same group."""
    params = list(params)
    if not cfg.no_decay_norms_and_biases:
        return params
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Builds the optimizer that ``cfg`` names (``target`` or ``name``) over ``params``.

    Raises:
        ConfigError: unknown optimizer, or keyword arguments it does not take.
    """
    if _uses_optimizers_module(cfg):
        from pipedream2bw.optimizers import build_optimizer as build_extended

        return build_extended(param_groups(params, cfg), cfg)
    cls = _optimizer_of(cfg)
    try:
        return cls(param_groups(params, cfg), lr=cfg.lr, **dict(cfg.kwargs))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"optim.kwargs ({dict(cfg.kwargs)}) are not valid for {cls.__name__}: {e}; "
            f"fix or remove them (e.g. optim.kwargs={{}})"
        ) from e


def _uses_optimizers_module(cfg: OptimConfig) -> bool:
    return (not cfg.target and cfg.name.lower() == "muon") or cfg.delay_correction != "none"


DELAY_CORRECTIONS = ("none", "error_feedback", "lookahead")


def _validate_optim_extras(cfg: Config) -> None:
    """optim.name=muon and optim.delay_correction: what composes, and what is refused and why."""
    o = cfg.optim
    if o.delay_correction not in DELAY_CORRECTIONS:
        raise ConfigError(
            f"optim.delay_correction ({o.delay_correction!r}) is unknown; use one of {list(DELAY_CORRECTIONS)}"
        )
    muon = not o.target and o.name.lower() == "muon"
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
    if o.delay_correction == "none":
        return
    if cfg.pipeline.schedule != "2bw":
        log.info(
            "optim.delay_correction (%s) is off under pipeline.schedule=%s: every gradient is taken at the weights it "
            "updates, so there is no delay to correct",
            o.delay_correction,
            cfg.pipeline.schedule,
        )
    if o.delay_correction == "error_feedback" and not (
        math.isfinite(o.error_feedback_beta) and o.error_feedback_beta >= 0
    ):
        raise ConfigError(f"optim.error_feedback_beta ({o.error_feedback_beta}) must be a finite number >= 0")
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


TINY_ENV = "PIPEDREAM2BW_TINY"
"""Set to 1, the training entry point shrinks every run (``tiny``): the docs' test runs their commands so."""


def tiny(cfg: Config) -> Config:
    """``cfg`` at a size that runs in seconds on a CPU, for smoke-testing documented commands
    (``PIPEDREAM2BW_TINY=1``): step counts and step intervals divided by 50 (at least 2 steps, an interval
    at least 1), one validation batch, the GPT at d_model 32, 2 heads, seq_len at most 32, microbatches of
    at most 2 (unless train.global_batch_size fixes the batch), wandb off. Layer counts, the layout and
    everything else stay, so what the command checks (its keys, the layout, resuming) still holds.
    """
    t = cfg.train
    num_steps = max(2, t.num_steps // 50)

    def interval(n: int) -> int:
        return max(1, n // 50) if n else 0

    train = dataclasses.replace(
        t,
        num_steps=num_steps,
        warmup_steps=min(t.warmup_steps, num_steps - 1),
        log_every=interval(t.log_every),
        checkpoint_every=interval(t.checkpoint_every),
        eval_every=interval(t.eval_every),
        eval_batches=min(t.eval_batches, 1),
    )
    model = cfg.model
    if isinstance(model, GPTConfig):
        model = dataclasses.replace(model, d_model=32, num_heads=2, seq_len=min(model.seq_len, 32))
    pipeline = cfg.pipeline
    if t.global_batch_size is None:
        pipeline = dataclasses.replace(pipeline, microbatch_size=min(pipeline.microbatch_size, 2))
    pipeline = dataclasses.replace(
        pipeline, trace_steps=min(pipeline.trace_steps, num_steps - train.warmup_steps), trace_first_step=None
    )
    optim = cfg.optim
    if isinstance(optim, OptimConfig):
        optim = dataclasses.replace(optim, warmup_steps=min(optim.warmup_steps, num_steps))
    return dataclasses.replace(
        cfg,
        train=train,
        model=model,
        pipeline=pipeline,
        optim=optim,
        wandb=dataclasses.replace(cfg.wandb, mode="disabled"),
    )


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


# torch.optim optimizers whose update of an element reads only that element (and scalars): they may step shards
ELEMENTWISE_OPTIMIZERS = ("sgd", "adam", "adamw", "nadam", "radam", "adamax", "rmsprop", "adagrad", "adadelta", "rprop")


def _validate_sharding(cfg: Config) -> None:
    """optim.sharded and train.weight_dtype: an elementwise optimizer; what does not compose yet is refused here."""
    from pipedream2bw.precision import WEIGHT_DTYPES

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
    o = cfg.optim
    if o.target or o.name.lower() not in ELEMENTWISE_OPTIMIZERS:
        raise ConfigError(
            f"{what} steps pieces of every parameter (flat float32 masters), which needs an elementwise "
            f"optimizer; {o.target or o.name} may not be one: use one of {list(ELEMENTWISE_OPTIMIZERS)}"
        )


def _validate_precision(cfg: Config) -> None:
    from pipedream2bw.precision import PRECISIONS

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
    from pipedream2bw.preempt import signal_numbers

    try:
        signal_numbers(t.preempt_signals)
    except ValueError as e:
        raise ConfigError(f"train.preempt_signals ({list(t.preempt_signals)}): {e}; or [] for none") from None


def default_plan_choices(cfg: Config) -> Config:
    """``cfg`` with what a plan may choose and the run left null (optim.sharded, train.weight_dtype) at its
    default: false, 'fp32'. ``partition=auto|file`` sets them from the plan first."""
    optim = cfg.optim if cfg.optim.sharded is not None else dataclasses.replace(cfg.optim, sharded=False)
    train = cfg.train if cfg.train.weight_dtype is not None else dataclasses.replace(cfg.train, weight_dtype="fp32")
    return dataclasses.replace(cfg, optim=optim, train=train)


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


def _model_vocab(mdl: Any, from_layers: Optional[int]) -> Optional[int]:
    """The vocabulary the data must fit: the GPT's ``vocab_size``; a layer list's ``model.vocab_size``, which
    may not exceed what its layers take, else what they take (None: unknown)."""
    if isinstance(mdl, GPTConfig):
        return mdl.vocab_size
    given = getattr(mdl, "vocab_size", None)
    if given is not None and given < 1:
        raise ConfigError(f"model.vocab_size ({given}) must be >= 1, or null to read it from the model's layers")
    if given is not None and from_layers is not None and given > from_layers:
        raise ConfigError(
            f"model.vocab_size ({given}) is more than the model's layers take ({from_layers}: its embedding rows or "
            f"head outputs); ids from {from_layers} on would fail inside the model; set model.vocab_size<={from_layers}"
        )
    return given if given is not None else from_layers


def validate(
    cfg: Config,
    *,
    world_size: int,
    num_layers: Optional[int] = None,
    local_world_size: int = 1,
    layers_vocab_size: Optional[int] = None,
) -> List[int]:
    """Checks a config before any process group starts.

    Args:
        cfg: the run's config.
        world_size: number of ranks that will run it.
        local_world_size: ranks on this node (one GPU each under NCCL).
        num_layers: length of a user's layer list; None for the GPT that ``cfg.model`` describes.
        layers_vocab_size: a layer list's vocabulary as read from its layers (``read_vocab_size``).

    Returns:
        The balance (layers per stage) the run will use: ``pipeline.balance``, else
        ``gpt_balance`` for the GPT and ``even_balance`` for other layer lists.

    Raises:
        ConfigError: naming the value, why it is wrong and how to fix it.
    """
    p, mdl = cfg.pipeline, cfg.model
    gpt = num_layers is None
    if gpt and not isinstance(mdl, GPTConfig):
        raise ConfigError(
            f"model ({mdl!r}) is not a GPTConfig; pass its layer count (the runner does) or use model=gpt"
        )
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
    if isinstance(mdl, GPTConfig) and mdl.d_model % mdl.num_heads:
        raise ConfigError(f"model.num_heads ({mdl.num_heads}) must divide model.d_model ({mdl.d_model})")
    if mdl.seq_len < 1:
        raise ConfigError(f"model.seq_len ({mdl.seq_len}) must be >= 1")
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        raise ConfigError(f"optim.lr ({cfg.optim.lr}) must be a positive number")
    if _optimizer_of(cfg.optim) is torch.optim.LBFGS:
        raise ConfigError(
            "optim (lbfgs) re-evaluates the loss through a closure, which a pipeline cannot; use sgd, adam, adamw, ..."
        )
    _validate_optim_extras(cfg)  # before the trial build: it names what Muon and the corrections refuse
    build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim)
    _validate_step_rules(cfg)
    _validate_sharding(cfg)
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
    from pipedream2bw.data import check_data  # data.py imports this module

    vocab = _model_vocab(mdl, layers_vocab_size)
    read = isinstance(mdl, LayerListConfig) and mdl.vocab_size is None and vocab is not None
    vocab_from = "the vocabulary of the model's layers (embedding rows, head outputs)" if read else "model.vocab_size"
    check_data(cfg.data, vocab_size=vocab, seq_len=mdl.seq_len, need_val=t.eval_every > 0, vocab_from=vocab_from)
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
    _validate_swap(cfg.swap, d)
    return balance


def from_hydra(dcfg: Any) -> Config:
    """The typed Config of a composed Hydra config: ``OmegaConf.to_object``, then the untyped
    ``_target_`` entries of ``model`` and ``optim`` as ``LayerListConfig`` and ``OptimConfig``.

    Raises:
        ConfigError: an entry that is neither the schema's nor a ``_target_`` one, or an optimizer
            entry without ``_partial_: true``.
    """
    from omegaconf import OmegaConf

    if not isinstance(dcfg, Config):
        check_known_keys(dcfg)
    cfg = OmegaConf.to_object(dcfg) if not isinstance(dcfg, Config) else dcfg
    model, optim = cfg.model, cfg.optim
    if isinstance(model, dict):
        model = layer_list_config(model)
    if isinstance(optim, dict):
        optim = target_optim_config(optim)
    return dataclasses.replace(cfg, model=model, optim=optim)


def check_known_keys(dcfg: Any) -> None:
    """Refuses keys that no schema has (``+train.num_step=5`` is added by Hydra, then dropped by
    ``OmegaConf.to_object``: the run would silently ignore it), naming the closest valid key. Entries
    without a schema (a ``_target_`` model or optimizer, ``kwargs``) take any keys.

    Raises:
        ConfigError: naming every unknown key and, where one is close, the key meant.
    """
    import difflib

    from omegaconf import DictConfig, OmegaConf

    unknown = []

    def walk(node: Any, prefix: str) -> None:
        schema = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(schema):
            return  # a free-form entry
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node.keys():
            name = f"{prefix}{key}"
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
                hint = (
                    f"did you mean {prefix}{close[0]}?" if close else f"{prefix or 'top level'} has {', '.join(fields)}"
                )
                unknown.append(f"{name} ({hint})")
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                walk(child, f"{name}.")

    walk(dcfg, "")
    if unknown:
        raise ConfigError(
            f"unknown config key{'s' if len(unknown) > 1 else ''}: {'; '.join(unknown)}; a key added with + must "
            f"still be one the schema knows (python -m pipedream2bw.train --cfg job lists them)"
        )


def layer_list_config(entry: Dict[str, Any]) -> LayerListConfig:
    """A ``{_target_: factory, seq_len: ..., loss: ..., <factory kwargs>}`` model entry, typed."""
    entry = dict(entry)
    if not entry.get("_target_") or entry["_target_"] == "???":
        raise ConfigError(
            f"the model entry ({entry}) names no layer-list factory; set model._target_=pkg.module.function "
            f"(model=custom), or use model=gpt"
        )
    target = entry.pop("_target_")
    entry.pop("_partial_", None)
    loss, loss_kwargs = entry.pop("loss", None), {}
    if isinstance(loss, dict):
        loss_kwargs = {k: v for k, v in loss.items() if k not in ("_target_", "_partial_")}
        loss = loss.get("_target_")
    known = {f.name for f in dataclasses.fields(LayerListConfig)} - {"target", "kwargs", "loss", "loss_kwargs"}
    fields = {k: entry.pop(k) for k in list(entry) if k in known}
    return LayerListConfig(target=target, kwargs=entry, loss=loss, loss_kwargs=loss_kwargs, **fields)


def target_optim_config(entry: Dict[str, Any]) -> OptimConfig:
    """A ``{_target_: cls, _partial_: true, lr: ..., <kwargs>}`` optimizer entry, typed."""
    entry = dict(entry)
    if not entry.get("_target_") or entry["_target_"] == "???":
        raise ConfigError(
            f"the optim entry ({entry}) names no optimizer; set optim._target_=torch.optim.SGD (optim=custom) or use "
            "optim.name"
        )
    if entry.pop("_partial_", None) is not True:
        raise ConfigError(
            f"optim._target_ ({entry['_target_']}) needs _partial_: true: the runtime passes each stage's parameters "
            f"when it builds the optimizer; add optim._partial_=true"
        )
    target = entry.pop("_target_")
    lr = entry.pop("lr", OptimConfig.lr)
    no_decay = bool(entry.pop("no_decay_norms_and_biases", False))
    return OptimConfig(
        name=target.rsplit(".", 1)[-1].lower(), lr=lr, kwargs=entry, target=target, no_decay_norms_and_biases=no_decay
    )
