"""Pure: the optimizer step's transient bytes, what a step allocates and frees again, per the code that steps.

A stage's step (``pipeline.versions``: one optimizer over the stage's parameters where w = 1, else one per gradient
bucket) holds, beside the weights, gradients and state that the planner already counts (``precision.param_memory``)::

    correction copy   optim.delay_correction=error_feedback or predict (config/optimizers.py: ``ErrorFeedback``,
                      ``WeightPrediction``), under 2bw only (``correction_in_effect``): a float32 clone of every
                      parameter the optimizer steps, alive through the inner optimizer's step: 4 B a parameter
    group temporary   torch's multi-tensor (foreach) Adam family, its default on CUDA: ``_foreach_sqrt`` of the
                      second moments over the whole group, 4 B a parameter it steps
    + the largest one tensor's temporaries (``tensor_bytes``), the inner optimizers stepping one tensor after another:
      Muon (``optimizers.Muon.step``) on a matrix of e = rows x cols elements, k = min(rows, cols), in the
      Newton-Schulz dtype (n B: 4 float32, 2 bfloat16, optim.muon_kwargs.ns_dtype 'auto': bfloat16 on CUDA)::
          the nesterov update (float32, 4e) + x and its next iterate (2 n e) + the Gram matrix and its
          polynomial (2 n k^2) + the previous matrix's x, alive until rebound (n e; taken as this matrix's)
      at t > 1 the update is gathered whole first (``pipeline.tensor.gather_whole``): the pieces, their
      concatenations and the whole (3 x 4e) beside the update's piece (4e / t), and the iterations run on the
      whole matrix on every tensor rank; the single-tensor Adam family (torch's default on a CPU): the
      denominator's two temporaries (2 x 4 B a parameter) + the previous tensor's denominator (taken as this one's);
      SGD (with or without momentum) none.

Measured (``tests/test_step_memory.py``: torch.profiler's memory events over one step, CPU, float32) these are exact
for a lone matrix or a pair of equal ones and at most one tensor's temporaries over otherwise. With optim.sharded the
correction copy is a shard's; a host optimizer (swap.optimizer=host) steps on the host: its device holds none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Tuple

from pipedream2bw.config.corrections import concrete, state_copies

FP32 = 4
ADAM_FAMILY = ("adam", "adamw", "nadam", "radam", "adamax")


@dataclass(frozen=True)
class StepModel:
    """What a step's temporaries depend on: the optimizer for elementwise parameters (Muon's others, or the one
    optimizer), whether Muon steps the matrices, the delay correction (as configured; ``StageContext`` applies it
    under 2bw only), and the device's paths (foreach and the Newton-Schulz dtype)."""

    elementwise: str = "adamw"  # lower-case torch.optim name, or an import path's class name
    muon: bool = False
    correction: str = "none"  # optim.delay_correction, resolved
    foreach: bool = False  # torch's multi-tensor path: its default on CUDA
    ns_bytes: int = FP32  # the Newton-Schulz iteration's element bytes

    @staticmethod
    def of(optim, *, device_type: str) -> "StepModel":
        """The model of ``optim`` (an ``OptimConfig``) on a ``device_type`` ('cpu' or 'cuda') device."""
        muon = not optim.target and optim.name.lower() == "muon"
        name = (optim.muon_others if muon else (optim.target or optim.name)).rsplit(".", 1)[-1].lower()
        correction = concrete(optim)
        if correction == "lookahead" and name == "adamw":
            name = "nadam"  # optimizers.build_optimizer: AdamW -> NAdamW
        ns = str(dict(optim.muon_kwargs).get("ns_dtype", "auto"))
        ns_bytes = 2 if ns == "bfloat16" or (ns == "auto" and device_type == "cuda") else FP32
        kwargs = dict(optim.kwargs)
        foreach = bool(kwargs["foreach"]) if kwargs.get("foreach") is not None else device_type == "cuda"
        return StepModel(name, muon, correction, foreach, ns_bytes)

    @property
    def correction_copies(self) -> int:
        """Float32 copies of the stepped parameters the delay correction clones (under 2bw)."""
        # predict_error_feedback: the prediction's clone (W(t)) lives through error feedback's (W(t) again)
        return state_copies(self.correction)

    @property
    def group_copies(self) -> int:
        """Float32 copies of the elementwise optimizer's parameters its multi-tensor step makes at once."""
        return 1 if self.foreach and self.elementwise in ADAM_FAMILY else 0

    def tensor_bytes(self, rows: int, cols: int = 1, *, muon: bool = False, t: int = 1) -> float:
        """The most bytes one tensor's step of ``rows`` x ``cols`` elements (the whole tensor's) holds at once on
        one of ``t`` tensor ranks: ``muon`` if Muon steps it (the whole matrix is gathered at t > 1), else the
        elementwise optimizer on this rank's piece (1 / t of it where it is split, ``t`` > 1)."""
        e = rows * cols
        if muon and self.muon:
            k = min(rows, cols)
            iterate = FP32 * e + self.ns_bytes * (2 * e + 2 * k * k)
            gather = FP32 * (3 * e + e / t) if t > 1 else 0.0
            return max(iterate, gather) + self.ns_bytes * e
        if self.elementwise == "sgd" or (self.foreach and self.elementwise in ADAM_FAMILY):
            return 0.0
        return 3 * FP32 * e / t  # the Adam family's, measured; other optimizers taken as it


def layer_step_bytes(model: StepModel, tensors: Iterable[Tuple[int, int, bool, int]]) -> Dict[str, int]:
    """A layer's step transients under ``model``: ``LayerCost``'s ``step_peak_bytes`` (its largest one tensor's),
    ``step_group_bytes`` (the multi-tensor temporary over its elementwise parameters) and ``step_copy_bytes`` (the
    delay correction's copy of all of them), from ``tensors``: per parameter (rows, cols, whether Muon steps it,
    the tensor ranks it is split over: 1 whole), rows x cols being the whole parameter's shape."""
    peak, stepped, elementwise = 0.0, 0.0, 0.0
    for rows, cols, muon, t in tensors:
        peak = max(peak, model.tensor_bytes(rows, cols, muon=muon, t=t))
        piece = FP32 * rows * cols / t
        stepped += piece
        elementwise += 0.0 if (muon and model.muon) else piece
    return dict(
        step_peak_bytes=int(math.ceil(peak)),
        step_group_bytes=int(math.ceil(model.group_copies * elementwise)),
        step_copy_bytes=int(math.ceil(model.correction_copies * stepped)),
    )
