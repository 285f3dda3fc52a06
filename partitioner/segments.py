"""Pure: a model's per-layer costs (``LayerCost``) and their prefix sums (``Segments``): any contiguous segment's totals
in two lookups, each parameter shared by layers (a tied embedding) counted once where a stage holds several of its
holders (``Segments.total``). The cost model (``partitioner.cost``) evaluates a stage's formulas over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipedream2bw.memory.stream import device_bytes_model


@dataclass(frozen=True)
class LayerCost:
    """One layer at one microbatch size: seconds per microbatch, bytes."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    saved_bytes: int  # what autograd saves for backward, parameters excluded
    input_bytes: int
    output_bytes: int
    optimizer_bytes: int = 0  # optimizer state for this layer's parameters
    step_s: float = 0.0  # optimizer step over this layer's parameters, once per batch
    # the step's transients (``pipedream2bw.memory.step_memory``): the most one of its tensors' step holds at once
    # (Muon's whole matrix and its iterations), its multi-tensor optimizer's temporary over its parameters, and the
    # delay correction's float32 copy of them (under 2bw only)
    step_peak_bytes: int = 0
    step_group_bytes: int = 0
    step_copy_bytes: int = 0
    # what the backward split into B and W (zb1p, zbv) takes more than the whole backward, per microbatch: profiled
    # (``profile.split_backward``), else a ratio (``profile.SPLIT_ANALYTIC``); 0: not charged
    split_s: float = 0.0
    # B alone, the input's gradient with the graph kept, per microbatch (W takes the rest, backward_s + split_s -
    # input_s): profiled where the layer's input needs a gradient (0 where it needs none: B does nothing there), or
    # None: half the backward (analytic costs)
    input_s: Optional[float] = None
    # parameters this layer shares with other layers (a tied embedding): (the tie's name, its share of this layer's
    # parameter bytes); where one stage holds several of the layers naming a tie, it holds one parameter
    ties: Tuple[Tuple[str, float], ...] = ()


class Segments:
    """Prefix sums over a layer list, so that any segment's totals are two lookups (arrays or ints)."""

    def __init__(self, layers: Sequence[LayerCost]):
        self.layers = list(layers)
        self.n = n = len(layers)

        def prefix(values):
            return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])

        def range_max(values):  # [i, j]: the max of values[i..j-1] (0 where j <= i)
            v, out = np.asarray(values, dtype=np.float64), np.zeros((n + 1, n + 1))
            for i in range(n):
                out[i, i + 1 :] = np.maximum.accumulate(v[i:])
            return out

        self.F = prefix([c.forward_s for c in layers])
        self.B = prefix([c.backward_s for c in layers])
        self.X = prefix([c.split_s for c in layers])
        self.I = prefix([c.backward_s / 2 if c.input_s is None else c.input_s for c in layers])
        self.S = prefix([c.step_s for c in layers])
        self.W = prefix([c.param_bytes for c in layers])
        self.O = prefix([c.optimizer_bytes for c in layers])
        self.A = prefix([c.saved_bytes for c in layers])
        self.SG = prefix([c.step_group_bytes for c in layers])
        self.SC = prefix([c.step_copy_bytes for c in layers])
        self.IN = np.asarray([c.input_bytes for c in layers] + [0], dtype=np.float64)
        self.OUT = np.asarray([0] + [c.output_bytes for c in layers], dtype=np.float64)  # OUT[j]: output of layer j-1
        # RMAX[i, j]: max over layers i..j-1 of (saved + output): the gradients alive in one layer's backward.
        self.RMAX = range_max([c.saved_bytes + c.output_bytes for c in layers])
        # SMAX[i, j]: the largest one tensor's step temporaries over layers i..j-1
        self.SMAX = range_max([c.step_peak_bytes for c in layers])
        self.shared = _shared(self.layers)
        self._stream: Dict[int, tuple] = {}

    def total(self, key: str, i, j, held: Sequence[Tuple[int, int]] = ()):
        """Layers i..j-1's sum of ``key`` (``TIE_KEYS``: W, O, S, SG, SC), each shared parameter (``LayerCost.ties``)
        counted once however many of its holders the segment holds, and not at all where one of ``held`` (layer
        ranges the same rank holds besides this one: zbv's other chunk) holds it; ``i``/``j`` may be arrays."""
        prefix = getattr(self, key)
        out = prefix[j] - prefix[i]
        for holders, sizes in self.shared:
            count = sum(np.asarray((i <= h) & (h < j), dtype=np.float64) for h in holders)
            there = any(a <= h < b for a, b in held for h in holders)
            out = out - (count if there else np.maximum(count - 1, 0.0)) * sizes[key]
        return out

    def stream_device(self, window: int, weight_copy_bytes: int = 4):
        """(DEV, MAXW): ``DEV[i, j]``: a streamed stage of layers i..j-1's device bytes for weights and gradients
        (``stream.device_bytes_model``, the runtime's own model, over the layers' bytes in the versions' dtype:
        ``weight_copy_bytes`` a parameter); ``MAXW[i, j]``: its largest layer (the gradients, in that dtype too)."""
        key = (window, weight_copy_bytes)
        if key not in self._stream:
            sizes = [c.param_bytes * weight_copy_bytes // 4 for c in self.layers]
            dev, maxw = np.zeros((self.n + 1, self.n + 1)), np.zeros((self.n + 1, self.n + 1))
            for i in range(self.n):
                for j in range(i + 1, self.n + 1):
                    dev[i, j] = device_bytes_model(sizes[i:j], window=window)
                    maxw[i, j] = max(sizes[i:j])
            self._stream[key] = (dev, maxw)
        return self._stream[key]

    def reduce_exposed(self, one_way: float, latency: float, *, recompute: bool):
        """(PA, EXP): a streamed stage's host all-reduce (``_stream_reduce_s``), one bucket per layer of ``one_way``
        seconds a byte plus ``latency``: ``PA`` its prefix sums; ``EXP[i, j]``: what of layers i..j-1's all-reduce
        outlasts the batch's last backward. Bucket q starts once that backward has left layer q - 1 (the stream reports
        a layer's added gradients when it hands over the next layer's: a layer late), bucket i at its end; the buckets
        one after another on the group: ``max_(i<=q<j) (sum_(i..q) a - sum_(i..max(i, q-1)-1) B)``."""
        key = ("reduce", one_way, latency, recompute)
        if key not in self._stream:
            nbytes = np.asarray([c.param_bytes for c in self.layers], dtype=np.float64)
            a = np.where(nbytes > 0, nbytes * one_way + latency, 0.0)
            b = np.asarray([c.backward_s + (c.forward_s if recompute else 0.0) for c in self.layers])
            pa, pb = np.concatenate([[0.0], np.cumsum(a)]), np.concatenate([[0.0], np.cumsum(b)])
            exp = np.zeros((self.n + 1, self.n + 1))
            for i in range(self.n):
                # bucket q's end if the chain never waited, from the backward's start: PA[q+1] - PB[max(i, q-1)]
                v = pa[i + 1 : self.n + 1] - pb[np.maximum(i, np.arange(i, self.n) - 1)]
                exp[i, i + 1 :] = np.maximum.accumulate(v) - pa[i] + pb[i]
            self._stream[key] = (pa, exp)
        return self._stream[key]

    def stream_stalls(
        self, host_device_bw: float, *, recompute: bool, grads_out: bool = True, weight_copy_bytes: int = 4
    ):
        """Prefix sums of the streamed stall's per-layer terms (module docstring): (t, PF, PB, BB) with ``t[k]``
        layer k's copy time (its bytes in the versions' dtype, ``weight_copy_bytes`` a parameter, as its gradients),
        ``PF[k] = sum_(q<k) max(0, t[q+1] - F_q)``, ``PB[k] = sum_(0<q<k) max(0, t[q-1] - BB_q)`` and ``BB_q`` = the
        backward's own time per layer (B, + F with recomputation, + the gradients out unless ``grads_out`` is false:
        on a CPU they are the host's sums, charged apart)."""
        nbytes = np.asarray([c.param_bytes for c in self.layers], dtype=np.float64) * (weight_copy_bytes / 4)
        t = nbytes / host_device_bw
        f = np.asarray([c.forward_s for c in self.layers], dtype=np.float64)
        bb = np.asarray([c.backward_s for c in self.layers], dtype=np.float64) + (t if grads_out else 0.0)
        bb = bb + (f if recompute else 0.0)
        pf = np.concatenate([[0.0], np.cumsum(np.maximum(0.0, t[1:] - f[:-1])), [0.0]])
        pb = np.concatenate([[0.0, 0.0], np.cumsum(np.maximum(0.0, t[:-1] - bb[1:]))])
        return np.concatenate([t, [0.0]]), pf, pb, np.concatenate([[0.0], np.cumsum(t)])


# Segments' prefix sums that a shared parameter adds to: its LayerCost field
TIE_KEYS = dict(W="param_bytes", O="optimizer_bytes", S="step_s", SG="step_group_bytes", SC="step_copy_bytes")


def _shared(layers: Sequence[LayerCost]) -> List[Tuple[Tuple[int, ...], Dict[str, float]]]:
    """Each tie of ``layers`` (``LayerCost.ties``) named by two or more: (its holders' indices, one copy's figure per
    ``TIE_KEYS`` key: its share of a holder's, the least over its holders, as a holder counts it at the least)."""
    by_name: Dict[str, List[Tuple[int, float]]] = {}
    for k, c in enumerate(layers):
        for name, share in c.ties:
            by_name.setdefault(name, []).append((k, share))
    return [
        (
            tuple(k for k, _ in found),
            {key: min(share * getattr(layers[k], f) for k, share in found) for key, f in TIE_KEYS.items()},
        )
        for found in by_name.values()
        if len(found) > 1
    ]
