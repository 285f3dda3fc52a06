"""The range of every numeric config field, checked before anything is built from the config.

A negative dimension, a zero count, a NaN or infinite timeout or a fraction of 1 reached the runtime and died
there (building a tensor of negative size, converting NaN to an integer), after the process groups
started, with a traceback (issue 34). ``check_ranges`` refuses each with a ``ConfigError`` naming the
key, the value, the range and the fix. Only the config is needed: no torch, no model, no data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterator, Optional, Tuple

from pipedream2bw.errors import ConfigError

BIG = 2**31 - 1
"""Upper bound of sizes and counts: beyond it no tensor dimension or step count is meant."""

# key -> (low, low_open, high, high_open): numbers must be finite and within; None: no bound on that side
_Range = Tuple[Optional[float], bool, Optional[float], bool]
POSITIVE: _Range = (0, True, None, False)  # > 0
AT_LEAST_1: _Range = (1, False, BIG, False)
AT_LEAST_0: _Range = (0, False, BIG, False)
NON_NEGATIVE: _Range = (0, False, None, False)  # >= 0, floats
FRACTION: _Range = (0, False, 1, True)  # [0, 1)

RANGES: Dict[str, _Range] = {
    "pipeline.num_stages": AT_LEAST_1,
    "pipeline.num_microbatches": AT_LEAST_1,
    "pipeline.microbatch_size": AT_LEAST_1,
    "pipeline.data_parallel": AT_LEAST_1,
    "pipeline.tensor_parallel": AT_LEAST_1,
    "pipeline.bucket_mb": POSITIVE,
    "pipeline.trace_steps": AT_LEAST_1,
    "pipeline.trace_first_step": AT_LEAST_0,
    "pipeline.sync_warmup_steps": AT_LEAST_0,
    "pipeline.forward_lead": AT_LEAST_0,
    "model.num_layers": AT_LEAST_1,
    "model.d_model": AT_LEAST_1,
    "model.num_heads": AT_LEAST_1,
    "model.seq_len": AT_LEAST_1,
    "model.vocab_size": AT_LEAST_1,
    "model.init_std": NON_NEGATIVE,
    "model.dropout": FRACTION,
    "optim.lr": NON_NEGATIVE,
    "optim.warmup_steps": AT_LEAST_0,
    "optim.min_lr": NON_NEGATIVE,
    "optim.clip_grad_norm": POSITIVE,
    "optim.error_feedback_beta": NON_NEGATIVE,
    "optim.predict_horizon": POSITIVE,
    "optim.rotation_every": AT_LEAST_1,
    "optim.rotation_beta": FRACTION,
    "data.val_fraction": FRACTION,
    "train.num_steps": AT_LEAST_1,
    "train.log_every": AT_LEAST_1,
    "train.warmup_steps": AT_LEAST_0,
    "train.global_batch_size": AT_LEAST_1,
    "train.checkpoint_every": AT_LEAST_0,
    "train.keep_checkpoints": AT_LEAST_1,
    "train.eval_every": AT_LEAST_0,
    "train.eval_batches": AT_LEAST_1,
    "train.loss_scale": POSITIVE,
    "train.loss_scale_growth_interval": AT_LEAST_1,
    "train.loss_scale_min": POSITIVE,
    "dist.timeout_s": POSITIVE,
    "sweep.timeout_s": POSITIVE,
    "sweep.nproc": AT_LEAST_1,
    "topology.nodes": AT_LEAST_1,
    "topology.devices_per_node": AT_LEAST_1,
    "topology.cores": AT_LEAST_1,
    "topology.runtime_overhead_gib": NON_NEGATIVE,
    "partition.tolerance": NON_NEGATIVE,
    "partition.swap_resident": AT_LEAST_0,
    "partition.repeats": AT_LEAST_1,
    "swap.min_bytes": AT_LEAST_0,
    "swap.resident": AT_LEAST_0,
    "swap.weight_prefetch": AT_LEAST_0,
    "seed": (0, False, 2**63 - 1, False),
}
"""Every numeric field's range by key; a float field of ``topology`` not named here must be > 0."""


def numeric_fields(cfg: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(key, value) of every int or float field of the dataclass ``cfg`` and its sections (bools excluded)."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from numeric_fields(value, f"{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value


def _range_of(key: str) -> _Range:
    if key in RANGES:
        return RANGES[key]
    if key.startswith("topology."):
        return POSITIVE
    return (None, False, None, False)


def _describe(r: _Range) -> str:
    low, low_open, high, high_open = r
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    return " and ".join(parts) or "finite"


def check_ranges(cfg: Any) -> None:
    """Refuses a numeric config field that is not finite or out of its range (``RANGES``).

    Raises:
        ConfigError: naming the key, its value, its range and the fix.
    """
    for key, value in numeric_fields(cfg):
        if value is None:
            continue
        r = _range_of(key)
        low, low_open, high, high_open = r
        bad = isinstance(value, float) and not math.isfinite(value)
        bad = bad or (low is not None and (value <= low if low_open else value < low))
        bad = bad or (high is not None and (value >= high if high_open else value > high))
        if bad:
            raise ConfigError(f"{key} ({value}) must be {_describe(r)}; set {key}=<a number in that range>")
