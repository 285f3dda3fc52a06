"""Pure: training precision (fp32, bf16, fp16 under autocast), its compute dtype and its bytes per parameter.

Under bf16 and fp16 every stage runs its forward under ``torch.autocast`` while the weight
versions stay float32: they are the master weights the optimizer steps (docs/design.md section 8,
first option). So, per parameter, a stage holds (``param_memory``)::

    versions x 4 B      weight versions (2 under 2bw, 1 under flush/gpipe), float32 = the masters
    + 4 B               gradient, accumulated in float32 over the batch's microbatches
    + k x 4 B           optimizer state, float32 (adam/adamw k = 2, sgd+momentum 1, sgd 0)
    + 4 B               held gradient, only where the step waits (``step_waits``: under 2bw with a step
                        agreement or ties, the closed batch's gradient waits for APPLY while the next
                        batch's accumulates)

the same under every precision (fp16's loss scaling always agrees, so under 2bw its step waits). What
is not per parameter stays out: the data-parallel reduction flattens a bucket at a time into the
tensor that becomes the gradient (``comm.BatchReduction``), the optimizers step a bucket at a time
(their temporaries are a bucket's), the all-gather of optim.sharded writes in place; measured
(``scripts/bench_memory.py``) a stage's peak is these bytes plus its activations, within 3%. What
reduced precision changes is elsewhere: activations
(autograd's saved tensors are mostly compute-dtype), p2p transfers (sent in the compute dtype,
half the bytes), and autocast's compute-dtype copy of each matmul weight, made once per
microbatch and saved for that microbatch's backward: up to 2 B per matmul parameter for every
microbatch in flight (``cast_per_microbatch``; counted with the activations, which is where
the runtime's saved-tensor measurement and the planner's profile see it).

The alternative (bf16 versions refreshed from float32 masters at each step, as the 2BW paper's
fp16 runs) would hold 2 x 2 + 4 B of weights instead of 2 x 4 and save the per-microbatch casts,
but runs every non-matmul op (layer norms, residual sums, softmax) in bf16 and needs a float32
gradient buffer beside bf16 parameters; autocast keeps those ops in float32, as the users'
plain training loops do, for 4 B more per parameter under 2bw.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

import torch

# the names of train.precision and train.weight_dtype, re-exported
from pipedream2bw.config import PRECISIONS, WEIGHT_DTYPES  # noqa: F401
from pipedream2bw.config.corrections import state_copies

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_BYTES = 4


def resolve(precision: str, device_type: str) -> str:
    """The precision a run uses: ``auto`` is bf16 on a CUDA device that supports it, else fp32.

    Args:
        precision: ``train.precision``.
        device_type: the run's device type, 'cuda' or 'cpu'.
    """
    if precision != "auto":
        return precision
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype forwards, activations and p2p transfers use under a resolved ``precision``."""
    return COMPUTE_DTYPES[precision]


def autocast(precision: str, device_type: str):
    """The context a stage's forward runs in: ``torch.autocast`` to the compute dtype, or off under fp32."""
    return torch.autocast(device_type, dtype=compute_dtype(precision), enabled=precision != "fp32")


def weight_dtype(precision: str, name: str) -> torch.dtype:
    """The dtype a stage stores its weight versions in under a resolved ``precision`` and
    ``train.weight_dtype`` ``name``: float32 ('fp32'), or the compute dtype ('compute'; float32 under fp32)."""
    return compute_dtype(precision) if name == "compute" else torch.float32


def needs_agreement(precision: str, *, clip_grad_norm: Optional[float], on_nonfinite: str) -> bool:
    """Whether batch t's step needs every stage's share (the step agreement, agreement.py): clipping,
    ``train.on_nonfinite=skip``, or fp16 (its loss scaler skips through it); ``StepRule.needs_agreement``."""
    return precision == "fp16" or clip_grad_norm is not None or on_nonfinite == "skip"


def step_waits(
    schedule: str,
    *,
    agreement: bool,
    tied_across_stages: bool,
    sharded: bool = False,
    early_apply: bool = True,
    stage_index: Optional[int] = None,
) -> bool:
    """Whether stage ``stage_index`` (None: the stage that holds the most) holds a closed batch's gradient
    while the next batch's accumulates: under 2bw, APPLY(t) waits past batch t+1's first backward
    (docs/design.md section 7) when a step needs the other stages (a step ``agreement``: clipping, skip,
    fp16's loss scaling; weights tied across stages). Sharded (``StageWorker``), APPLY(t) runs 1 + 2s
    compute steps after CLOSE(t) with those, else 1: before batch t+1's first backward, on stage 0 or
    without them; with validation or the tie check (``early_apply`` false) it waits as unsharded.
    """
    if schedule != "2bw":
        return False
    if sharded and early_apply:
        return (agreement or tied_across_stages) and (stage_index is None or stage_index > 0)
    return agreement or tied_across_stages or sharded


def versions_held(schedule: str) -> int:
    """Weight versions a stage holds: two under 2bw, one under flush and gpipe."""
    return 2 if schedule == "2bw" else 1


def optimizer_state_factor(name: str, kwargs: Optional[Dict] = None) -> float:
    """Optimizer state per parameter byte: adam/adamw 2 (two moments), sgd with momentum 1, muon 1 (for the
    matrices it steps), plain sgd 0, rmsprop 1 (+1 with momentum), adagrad 1; unknown optimizers 2 (conservative).
    ``name``: a torch.optim name or an optimizer's import path (``optim._target_``, e.g. torch.optim.SGD)."""
    kwargs = dict(kwargs or {})
    name = name.rsplit(".", 1)[-1].lower()
    if name in ("adam", "adamw", "nadam", "radam", "adamax"):
        return 2.0 + (1.0 if kwargs.get("amsgrad") else 0.0)
    if name == "sgd":
        return 1.0 if kwargs.get("momentum", 0) else 0.0
    if name == "rmsprop":
        return 1.0 + (1.0 if kwargs.get("momentum", 0) else 0.0) + (1.0 if kwargs.get("centered") else 0.0)
    if name in ("adagrad", "adadelta"):
        return 1.0 if name == "adagrad" else 2.0
    if name == "muon":  # its momentum, for the matrices it steps (optim.muon_others' state for the rest)
        return 1.0
    if name == "adamw_rotated":  # Adam's two moments; each matrix's covariances and bases (8 (rows^2 + cols^2) B a
        return 2.0  # matrix: config/rotation.py) are not per parameter and not counted (partition.mode=auto refuses it)
    return 2.0


@dataclass(frozen=True)
class ParamMemory:
    """Bytes per parameter that a stage holds, by what holds them (see the module docstring)."""

    weight_copy: int  # one weight version
    versions: int  # versions held
    master: float  # a separate float32 master copy (0: the versions are the masters), / w when sharded
    gradient: int
    optimizer: float
    cast_per_microbatch: int  # compute-dtype weight copy per matmul parameter and microbatch in flight (activations)
    # the closed batch's gradient while the next accumulates, where the step waits (``step_waits``): 4 B, its
    # 4/w shard when sharded (the replica's summed shard); 0 where APPLY comes before the next backward
    held_gradient: float = 0.0

    @property
    def total(self) -> float:
        """Versions + master + gradient + held gradient + optimizer state (activations excluded)."""
        return self.versions * self.weight_copy + self.master + self.gradient + self.held_gradient + self.optimizer

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "total": self.total}


def param_memory(
    precision: str,
    *,
    schedule: str,
    optimizer: str,
    optimizer_kwargs: Optional[Dict] = None,
    weight_dtype_name: str = "fp32",
    sharded: bool = False,
    data_parallel: int = 1,
    waits: bool = False,
    delay_correction: str = "none",
    versions: Optional[int] = None,
) -> ParamMemory:
    """Bytes per parameter under a resolved ``precision`` (one of fp32, bf16, fp16), ``train.weight_dtype``
    and ``optim.sharded`` over ``data_parallel`` replicas, ``waits`` if the step waits (``step_waits``):
    the one source of these figures for summary.json, the README's table and the planner's memory model.

    Versions in the compute dtype, or sharding, need float32 masters of their own (sharding.py): 4 B, or
    4/w B sharded; sharding divides the optimizer state by w. Autocast's per-microbatch weight casts
    are made only from float32 versions. ``optim.delay_correction=error_feedback`` keeps one more float32 copy
    (the previous update) in the optimizer state, sharded with it; ``predict`` one too (the last applied update, d);
    ``predict_error_feedback`` both. ``versions``: the weight copies held where not ``versions_held(schedule)``
    (pipeline.weight_versions=newest with its prediction: config/newest.py's ``prediction_replicas``).
    """
    w = data_parallel if sharded else 1
    extra_state = state_copies(delay_correction)
    stored = weight_dtype(precision, weight_dtype_name)
    weight_copy = torch.finfo(stored).bits // 8
    reduced = torch.finfo(compute_dtype(precision)).bits // 8 if precision != "fp32" and weight_copy == 4 else 0
    return ParamMemory(
        weight_copy=weight_copy,
        versions=versions_held(schedule) if versions is None else versions,
        master=FP32_BYTES / w if (w > 1 or weight_copy != FP32_BYTES) else 0,
        gradient=FP32_BYTES,
        optimizer=FP32_BYTES * (optimizer_state_factor(optimizer, optimizer_kwargs) + extra_state) / w,
        cast_per_microbatch=reduced,
        held_gradient=FP32_BYTES / w if waits else 0.0,
    )


def markdown_table_sharded(*, optimizer: str = "adamw", precision: str = "bf16") -> str:
    """The README's table of bytes per parameter by weight_dtype, optim.sharded and w, from ``param_memory``;
    the last column is what a waiting step (2bw with clipping, skip or ties: ``step_waits``) adds."""
    rows = [
        "| schedule | weight_dtype | sharded | w | versions | master | gradient | optimizer | total "
        "| + held gradient if the step waits |"
    ]
    rows.append("|---|---|---|---|---|---|---|---|---|---|")
    for schedule in ("2bw", "flush"):
        for name in WEIGHT_DTYPES:
            for sharded, w in ((False, 1), (True, 2), (True, 4), (True, 8)):
                common = dict(schedule=schedule, optimizer=optimizer, weight_dtype_name=name, sharded=sharded)
                pm = param_memory(precision, **common, data_parallel=w)
                held = param_memory(precision, **common, data_parallel=w, waits=True).held_gradient
                rows.append(
                    f"| {schedule} | {name} | {'yes' if sharded else 'no'} | {w} | {pm.versions} x {pm.weight_copy} B "
                    f"| {pm.master:g} B | {pm.gradient} B | {pm.optimizer:g} B | {pm.total:g} B "
                    f"| {f'{held:g} B' if step_waits(schedule, agreement=True, tied_across_stages=False) else '-'} |"
                )
    return "\n".join(rows)


def markdown_table(*, optimizer: str = "adamw") -> str:
    """The README's bytes-per-parameter table for ``optimizer``, from ``param_memory``: without clipping,
    skip or ties (fp16's loss scaling makes a 2bw step wait: its total holds the held gradient)."""
    rows = [
        "| precision | schedule | weight versions | master | gradients | held gradient | optimizer | total "
        "| per microbatch in flight |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for precision in ("fp32", "bf16", "fp16"):
        for schedule in ("2bw", "flush"):
            agreement = needs_agreement(precision, clip_grad_norm=None, on_nonfinite="stop")
            waits = step_waits(schedule, agreement=agreement, tied_across_stages=False)
            pm = param_memory(precision, schedule=schedule, optimizer=optimizer, waits=waits)
            if waits:
                held = f"{pm.held_gradient:g} B"
            elif step_waits(schedule, agreement=True, tied_across_stages=False):
                held = "0 B (4 B with clipping, skip or ties)"
            else:
                held = "0 B"
            cast = f"{pm.cast_per_microbatch} B per matmul parameter" if pm.cast_per_microbatch else "-"
            rows.append(
                f"| {precision} | {schedule if schedule == '2bw' else 'flush, gpipe'} | {pm.versions} x "
                f"{pm.weight_copy} B | "
                f"{pm.master} B | {pm.gradient} B | {held} | {pm.optimizer:g} B | {pm.total:g} B | {cast} |"
            )
    return "\n".join(rows)
