"""The typed config: the dataclasses Hydra composes (one per section, each field documented), how a
composed config becomes one, and the values derived from it (balances, swap stages, the tiny run)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pipedream2bw.config.corrections import AUTO, auto_gives, default_beta, is_muon, resolve_auto
from pipedream2bw.config.newest import PREDICT_HORIZON, resolve_weight_versions
from pipedream2bw.errors import ConfigError

log = logging.getLogger(__name__)


SCHEDULES = ("2bw", "flush", "zb1p", "zbv", "gpipe")


WANDB_MODES = ("offline", "online", "disabled")


BACKENDS = ("auto", "gloo", "nccl")


LR_SCHEDULERS = ("constant", "cosine", "linear")


ON_NONFINITE = ("stop", "skip")


PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # train.precision (memory/precision.py gives them their dtypes)


WEIGHT_DTYPES = ("fp32", "compute")  # train.weight_dtype


UNCATCHABLE = ("SIGKILL", "SIGSTOP")  # what train.preempt_signals cannot name


@dataclass
class PipelineConfig:
    schedule: str = "2bw"
    """'2bw' (1F1B, no flushes, two weight versions), 'flush' (PipeDream-Flush), 'zb1p' (zero bubble ZB-H1: flush's
    update, each backward split into its input-gradient part and its weight-gradient part, which fills the bubble),
    'zbv' (zero bubble ZB-V: as zb1p, with 2d chunks, rank r running chunks r and 2d-1-r; pipeline.balance lists 2d),
    'gpipe', or 'auto' under partition=auto: the planner's choice of the schedule that reaches a loss first (its step
    time x the steps the schedule takes under the optimizer, measured: docs/planner.md)."""
    num_stages: int = 4
    """Pipeline depth d; WORLD_SIZE must be num_stages * data_parallel * tensor_parallel."""
    num_microbatches: int = 8
    """Microbatches per batch m; 2bw needs m >= num_stages."""
    microbatch_size: int = 8
    """Sequences per microbatch b; a batch is data_parallel * m * b sequences."""
    balance: Optional[List[int]] = None
    """Layers per stage, first stage first; null splits the layers evenly."""
    data_parallel: int = 1
    """Replicas w of every stage; WORLD_SIZE = num_stages * data_parallel * tensor_parallel."""
    rank_map: Optional[List[List[int]]] = None
    """rank_map[stage][replica] = rank; null keeps a stage's replicas on one node when they fit. At
    pipeline.tensor_parallel t > 1 it counts groups of t consecutive ranks: entry g is ranks g*t .. g*t+t-1 (as a
    plan file's rank_map does)."""
    bucket_mb: float = 25.0
    """Gradient all-reduce bucket size in MiB; a bucket is reduced as soon as backward produced it."""
    recompute: bool = False
    """Activation recomputation: keep only each layer's input for backward and re-run its forward there."""
    tensor_parallel: int = 1
    """Tensor width t: each stage's layers split across t ranks (attention by heads, the MLP by its hidden width,
    Megatron's column- then row-wise split; docs/concepts.md). WORLD_SIZE = num_stages * data_parallel * t, t
    innermost (a stage's t ranks are consecutive, on one node); the built-in GPT (fp32, bf16) and model=hf's Llama
    family (fp32); where t divides the vocabulary the embedding and LM head split by it."""
    sequence_parallel: bool = False
    """At tensor_parallel t > 1 (moot at 1), the built-in GPT and model=hf's Llama family: Megatron's sequence
    parallelism. Between the split matrices each tensor rank holds 1/t of the sequence (norms, dropout, residual adds
    and the activations sent between stages); an all-gather before the column-split and a reduce-scatter after the
    row-split matrices (docs/concepts.md)."""
    trace: bool = False
    """Record when every F, B, send, recv, all-reduce and optimizer step ran on every rank for
    trace_steps steps; writes trace.json (Chrome/Perfetto), timeline.png and the bubble fraction."""
    trace_steps: int = 3
    """How many consecutive steps (batches) pipeline.trace records."""
    trace_first_step: Optional[int] = None
    """First traced step (0-based); null: train.warmup_steps, i.e. the first measured steps."""
    sync_warmup_steps: int = 0
    """Under schedule=2bw: the first N steps run as PipeDream-Flush (batch t reads W(t): no delay), then 2bw
    (batch N reads W(N), batch t > N reads W(t-1)); 0: 2bw from the first step. The delay correction is off on
    the synchronous steps (docs/convergence.md)."""
    weight_versions: str = "auto"
    """Under schedule=2bw, the version a microbatch's forward (and its backward) runs on: 'batch' (every microbatch of
    batch t on W(t-1), docs/design.md section 2); 'newest' (the newest version its stage holds at that forward: on
    stage s of d, microbatch j of batch t >= 1 on W(t) if j >= d - s - 1 + the stage's forward lead, else W(t-1); the
    same two buffers, schedule and steps; docs/concepts.md). newest refuses what it is not proven with
    (config/newest.py names each key); with optim.delay_correction=predict the forwards that miss W(t) run on its
    prediction W(t-1) + h d(t-2) (h: optim.predict_horizon; one more weight copy on a stage whose forwards before its
    previous step are more than half of num_microbatches), which Muon's optim.delay_correction=auto resolves to.
    'auto' (the default): newest for Muon wherever newest runs, batch elsewhere (config/newest.py's
    ``resolve_weight_versions``; chosen by measurement, docs/convergence.md); on a resume, the checkpoint's rule
    (``follow_checkpoint``). Under schedule=auto it is the 2bw candidate's rule, priced at its plan's depth, and moot
    (run as batch) where the plan picks another."""
    auto_weight_versions: bool = False
    """Set when the config is made, not by hand: true where pipeline.weight_versions is what 'auto' resolved to. Such
    a rule is resolved again whenever the config is made again (a plan's recomputation or swapping: batch), as
    optim.auto_correction is."""
    forward_lead: int = 0
    """Under 2bw and flush: the stages before the last run this many forwards ahead of 1F1B's d - s in flight (at
    most m - (d - s)), so a backward's gradient has a forward's time to arrive from the next stage instead of none;
    each costs one more microbatch of activations on those stages. 0 (plain 1F1B) is the default: on a 2-core CPU
    with gloo, 1 was 1.03x faster at microbatches of 4 sequences of 128 and 0.92-0.93x at microbatches of 1 and 2
    of 32 (docs/benchmarks.md); not measured where transfers have real latency (across nodes, on GPUs)."""
    check_ties: bool = False
    """Debug: after every step, compare a digest of each tied parameter's copies across the stages holding
    them (two small all-reduces per step); the run fails on the first step where they differ. Refused where no tie
    spans stages (none, or each one parameter on one rank: zbv's GPT tie, d = 1): nothing to compare."""


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
    dropout: float = 0.0
    """Dropout probability on the embedding's output and on each block's attention and MLP outputs before
    their residual adds (masks per layer and microbatch: the same at every layout); 0: none."""


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


@dataclass
class OptimConfig:
    name: str = "muon"
    """A torch.optim optimizer by name, case-insensitive: muon (the default: Muon for the hidden matrices,
    optim.muon_others for the rest), sgd, adam, adamw, rmsprop, ... (not lbfgs); or adamw_rotated (AdamW with the
    hidden matrices' moments in the eigenbases of their gradient covariances, SOAP-like; AdamW for the rest;
    optim.rotation_every, optim.rotation_beta; docs/convergence.md)."""
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
    ``optim=custom optim._target_=torch.optim.SGD +optim.momentum=0.9`` writes it Hydra's way (``_partial_: true``)."""
    no_decay_norms_and_biases: bool = False
    """Two parameter groups: weight decay (``kwargs.weight_decay``) on weights of 2 or more dimensions,
    none on 1-D parameters (norm scales, biases), as GPT training usually does."""
    sharded: Optional[bool] = None
    """ZeRO-1 over the data-parallel replicas (docs/sharding.md): the w replicas of a stage each keep
    1/w of the float32 master weights and optimizer state; gradients reduce-scatter in buckets, each replica
    steps its shard, the new weights are all-gathered (under 2bw while the next batch runs). Needs an
    elementwise optimizer (sgd, adam, adamw, ...); with data_parallel 1 it changes nothing. null: false, or
    under partition=auto|file the plan's choice (a value set here must agree with the plan's)."""
    # --- Muon and the 2bw delay corrections (pipedream2bw/optimizers.py; docs/convergence.md) ---
    muon_kwargs: Dict[str, Any] = field(default_factory=dict)
    """optim.name=muon: keyword arguments for torch.optim.Muon (its defaults: momentum 0.95, nesterov, weight_decay
    0.1), with adjust_lr_fn 'match_rms_adamw' unless set here, so that optim.lr serves Muon and the other
    optimizer alike (the schedule sets the same lr on both); optim.kwargs go to the other optimizer. Also
    ns_dtype: the Newton-Schulz iteration's dtype, 'auto' (bfloat16 on a GPU as torch's, float32 on a CPU, where
    bfloat16 is emulated at 10-20x the cost), 'bfloat16' or 'float32'."""
    muon_others: str = "adamw"
    """optim.name=muon: the torch.optim optimizer (by name) for what Muon does not take: parameters that are not
    2-D and those optim.muon_exclude matches."""
    muon_exclude: List[str] = field(default_factory=lambda: ["*Embedding*", "*Head*", "*head*"])
    """optim.name=muon (and adamw_rotated, whose rotation takes the same matrices): fnmatch patterns (case-sensitive)
    over each parameter's name within its stage and the class
    names of the modules on its path; a 2-D parameter matching any goes to optim.muon_others, not Muon. The model's
    first and last layers (its input lookups, its output projection) never go to Muon, whatever their classes;
    the patterns keep more out: by default embeddings (nn.Embedding) and heads (LMHead, lm_head) anywhere. A tied
    weight must match on every stage that holds it (the default patterns do)."""
    delay_correction: str = "auto"
    """Under pipeline.schedule=2bw, a correction of the one-step gradient delay, run in the deferred step on each
    stage (no extra communication): 'none'; 'error_feedback' (Zmushko et al. 2026: W(t+1) = W(t) + u(t) +
    beta * (u(t) - u(t-1)), u the optimizer's update; 4 bytes per parameter); 'lookahead' (Ajanthan et al.
    2025: Nesterov look-ahead with momentum 0.99, i.e. NAdamW for adamw and Muon's momentum 0.99 for muon; no
    extra state); 'predict' (weight prediction, PipeOptim: batch t reads W(t-1) + d, d the last applied update, a
    prediction of the W(t) its gradient is applied to, in place of W(t-1); 4 bytes per parameter; under
    pipeline.weight_versions=newest, only the forwards that miss W(t) read W(t-1) + h d (optim.predict_horizon), and a
    stage whose forwards before its previous step are more than half of num_microbatches holds one more weight copy);
    'predict_error_feedback' (both: the prediction around error feedback, d the corrected update; 8 bytes per
    parameter; measured best with optim.error_feedback_beta 0.5, its default under it); 'auto' (the
    default): for muon predict_error_feedback (the setting under which 2bw came closest to a flushing pipeline's
    loss, on every seed at both GPT shapes measured), or error_feedback where the run refuses the prediction
    (swap.optimizer=host, optim.sharded at data_parallel > 1, train.weight_dtype=compute under bf16/fp16: logged,
    naming the key), and under pipeline.weight_versions=newest predict; none for every other optimizer (with
    AdamW error feedback helped unreliably: docs/convergence.md); decided from the whole config when it is made
    (summary.json's delay_correction shows it); on a resume, the checkpoint's correction. flush and gpipe have no
    delay: the correction is off there (logged). docs/design.md states the exact rules."""
    error_feedback_beta: Optional[float] = None
    """optim.delay_correction=error_feedback|predict_error_feedback: the weight beta of the previous step's estimated
    error. null: 1.5 under error_feedback (with Muon at 2 GPT shapes it left 2bw closer to a flushing pipeline than the
    paper's 1.0 on every seed), 0.5 under predict_error_feedback (the prediction already removes most of the delay:
    1.5 over-corrects there), chosen by measurement (docs/convergence.md) when the config is made, by the correction
    'auto' resolves to."""
    predict_horizon: float = PREDICT_HORIZON
    """pipeline.weight_versions=newest with optim.delay_correction=predict: how far ahead the early forwards'
    prediction reaches, in steps: P(t) = W(t-1) + h d(t-2), d the last step's change; 1 predicts the W(t) they miss,
    more looks past it; 1.5 by default (measured: config/newest.py's ``PREDICT_HORIZON``, docs/convergence.md). The
    batch rule's prediction (predict, predict_error_feedback) always predicts one step, and a value other than the
    default is refused there."""
    auto_correction: bool = False
    """Set when the config is made, not by hand: true where optim.delay_correction (and a null error_feedback_beta)
    is what 'auto' resolved to, for every optimizer (none for all but Muon). Such a correction is resolved again
    whenever the config is made again, e.g. with a plan's pipeline.data_parallel > 1 under optim.sharded and
    partition=auto: the prediction falls back to error feedback there (logged) where a named one would be refused;
    on a resume the checkpoint's correction takes its place. Cleared beside a correction 'auto' never gives the
    optimizer (one named)."""
    rotation_every: int = 10
    """optim.name=adamw_rotated: refresh each hidden matrix's eigenbases (of the EMAs of G G^T and G^T G) every this
    many steps, the first at this step (AdamW's plain basis before it)."""
    rotation_beta: float = 0.95
    """optim.name=adamw_rotated: the EMA weight of the gradient covariances G G^T and G^T G whose eigenvectors are the
    basis Adam's moments live in."""

    def __post_init__(self) -> None:
        # 'auto' for any optimizer but Muon is 'none', here: OptimConfig(name="adamw") and optim.name=adamw on the
        # command line (Hydra makes the dataclass the same way) get no correction (issue 43: optim.name=adamw kept
        # the default's error feedback, 4 bytes a parameter the user had not asked for), marked as auto's choice (a
        # resume follows the checkpoint's correction in its place: config/newest.py). Muon's depends on the whole
        # config (config/corrections.py): Config resolves it, and the beta with it
        if self.delay_correction == AUTO and not is_muon(self):
            self.delay_correction, self.auto_correction = "none", True
        elif self.auto_correction and not auto_gives(self):  # named through dataclasses.replace, which keeps the mark
            self.auto_correction = False
        if self.error_feedback_beta is None and self.delay_correction != AUTO:  # the resolved config shows it
            self.error_feedback_beta = default_beta(self.delay_correction)


@dataclass
class DataConfig:
    path: Optional[str] = None
    """A token file (.bin: token ids as written by scripts/prepare_tokens.py, memory-mapped), or a text
    file (.txt or .txt.gz, byte-level, read whole); null uses the shipped text."""
    token_dtype: str = "auto"
    """Dtype of a .bin file's ids: 'uint16' (vocabularies up to 65536) or 'uint32'; 'auto': what the file's
    <file>.json says (scripts/prepare_tokens.py writes it), else uint16."""
    val_fraction: float = 0.0
    """Share of data.path held out for validation: its last tokens, never trained on; 0: none."""
    val_path: Optional[str] = None
    """A file of held-out data (of data.path's kind) for validation, instead of val_fraction."""
    packing: str = "windows"
    """'windows' (fixed windows of model.seq_len + 1 tokens drawn from one flat stream) or 'documents' (data.path a
    JSONL of {"text"} or {"prompt", "response"} documents, or a token file with its .docs.npy index from
    scripts/prepare_tokens.py --documents; null: the shipped example; whole documents packed into rows of
    model.seq_len, attention and positions restricted to each document, prompts masked from the loss)."""


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
    preempt_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])
    """Signals that preempt the run (SLURM and Kubernetes send SIGTERM before they kill a job; SIGINT is
    Ctrl-C): every rank stops within two steps at one agreed step, writes a checkpoint of it, summary.json
    says "preempted", and the process exits with 128 + the signal's number (143, 130) so that the scheduler
    requeues it; a second Ctrl-C exits at once; [] leaves the signals' default action (die at once, unsaved)."""
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
    """Processes each sweep job launches; null: pipeline.num_stages * data_parallel * tensor_parallel."""
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
    stream: bool = True
    """Let the planner stream weights from host memory (swap.weights, docs/memory.md) on stages that would not fit
    otherwise: on GPUs, with data_parallel=1 and what swap.weights accepts; such a stage swaps its activations too,
    and the plan sets swap.optimizer=host."""
    cache_dir: Optional[str] = None
    """Profile cache directory; null: ~/.cache/pipedream2bw."""
    repeats: int = 5
    """Timed repeats per layer when profiling (median), after warm-up."""
    analytic_dtype_bytes: Optional[int] = None
    """Removed: the planner's bytes follow train.precision (set that instead); must stay null."""


@dataclass
class SwapConfig:
    """Swapping of stashed activations to host memory (docs/design.md section 5; pipedream2bw/memory/swap.py)."""

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
    host_step: str = "auto"
    """swap.optimizer=host: where the host optimizer step runs. 'background': on a thread of its own, while the next
    batch computes (2bw only: W(t+1) is first read by batch t+2's forward; bit for bit the synchronous step);
    'sync': on the training thread; 'auto': background where it can be (2bw, and a stage whose masters are not
    sharded or compute-dtype; a streamed stage's too, swap.weights), else sync."""
    weights: bool = False
    """Stream weights (docs/memory.md): on the stages that swap, the weight versions, gradient accumulators and
    optimizer state live in host memory and each layer's weights come to the device only for its forward and its
    backward (pipedream2bw/memory/stream.py); needs swap.optimizer=host. A stage then needs device memory for
    swap.weight_prefetch + 1 layers' weights, not all of them."""
    weight_prefetch: int = 1
    """Streamed stages: layers whose weights are copied ahead of the one computing (0: each layer's copy starts
    when it is needed, no overlap)."""


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
    """Seeds weight initialisation (per layer), the batch order and each layer's random stream per microbatch
    (dropout masks: the same at every layout, schedule and resume; docs/concepts.md)."""

    def __post_init__(self) -> None:
        # optim.delay_correction=auto resolved from the whole config (config/corrections.py), however the Config is
        # made (Hydra's OmegaConf.to_object, Config(...) in Python, dataclasses.replace), and again when it is made
        # again: a plan's pipeline.data_parallel > 1 under optim.sharded refuses the prediction 'auto' chose. First
        # pipeline.weight_versions=auto (config/newest.py), which Muon's correction depends on
        if isinstance(self.optim, OptimConfig) and isinstance(self.pipeline, PipelineConfig):
            self.pipeline = resolve_weight_versions(self)
        if isinstance(self.optim, OptimConfig) and (self.optim.delay_correction == AUTO or self.optim.auto_correction):
            self.optim = resolve_auto(self)


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


def default_plan_choices(cfg: Config) -> Config:
    """``cfg`` with what a plan may choose and the run left null (optim.sharded, train.weight_dtype) at its
    default: false, 'fp32'. ``partition=auto|file`` sets them from the plan first."""
    optim = cfg.optim if cfg.optim.sharded is not None else dataclasses.replace(cfg.optim, sharded=False)
    train = cfg.train if cfg.train.weight_dtype is not None else dataclasses.replace(cfg.train, weight_dtype="fp32")
    return dataclasses.replace(cfg, optim=optim, train=train)


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
