"""Pure: a layer's costs on one of the t ranks that split it (Megatron's tensor parallelism, docs/design.md section 14).

A stage of t ranks splits each transformer block by heads (q, k, v column-wise, the attention's output projection
row-wise) and its MLP by the hidden width (the first matrix column-wise, the second row-wise); the embedding and the
LM head split by the vocabulary where t divides it (a vocab-parallel embedding; a column-parallel head with the
vocab-parallel cross entropy; the head only with the run's own loss: ``TensorShape.vocab_head``), else they stay
whole on every rank; the final norm stays whole. ``split_layers``
turns the whole model's ``LayerCost`` list into one rank's, so the cost model, the dynamic program and the simulator
run unchanged on it: a (stage, replica) of t ranks is one "device" of the d x w mesh with these costs.

Memory per rank (the GPT's pre-LN block, C = d_model, T tokens, b a microbatch, a = activation bytes)::

    parameters   the split matrices and the column-parallel biases / t (12 C^2 + 7 C of the block's 12 C^2 + 13 C);
                 the row-parallel biases and the norms whole (6 C): weight versions, gradients, optimizer state and
                 the step follow the parameters
    saved        16 b T C a per block (``profile.analytic_gpt``): q, k, v, the attention's output, the MLP's two
                 4C-wide activations (12 of the 16) / t; the two norms' inputs and the two inputs of the
                 column-parallel matrices (4 of the 16) whole on every rank; with sequence parallelism all 16 / t
                 (Korthikanti et al. 2022: the norms' and replicated inputs split along the sequence; the final
                 norm's stays whole: the runtime gathers the sequence before it); any autocast weight copies
                 counted in the saved bytes split with their matrices
    in / out     b T C a whole on every rank (each sends its copy to the next stage); / t with sequence parallelism

The step's transients (``partitioner.step``, ``pipedream2bw.memory.step_memory``): a delay correction's copy and a
multi-tensor temporary follow the rank's parameters; Muon's largest temporaries are a whole matrix's, gathered on
every tensor rank (the pieces, their concatenation and the whole) and iterated whole: they do not divide by t.

Step per batch: the optimizer's step over the rank's parameters (/ t with the split), but with Muon
(``TensorShape.muon``) a block's step stays whole: each rank all-gathers every hidden matrix's update (four
``allgather_s`` of its float32 bytes) and runs the Newton-Schulz iterations on the whole matrix.

Time per microbatch: the split layers' compute / (t * ``TENSOR_EFFICIENCY``) (a block's norms, a small part of it,
counted in); per block two all-reduces of b T C a bytes in the forward (after the attention's and the MLP's
row-parallel matrix) and two in the backward (the gradients of the two column-parallel inputs). With sequence
parallelism each becomes a reduce-scatter and an all-gather, which move the same bytes; the backward also gathers
each column-split matrix's input again (two all-gathers: only its slice was saved) and sums the norms' and row-split
biases' gradients (one all-reduce of 6 C float32 a block); the embedding's output slices' gradients are all-gathered
in the backward, the final norm's input in the forward (the norm runs whole: the head and the loss see the whole
sequence). The embedding: one all-reduce of its output in the forward; the head: one of its input's gradient in the
backward, and the vocab-parallel loss's three of b T float32 in the forward. A ring all-reduce of n bytes over t
ranks on the intra-node link: ``2 (t-1)/t n / bandwidth + 2 (t-1) latency`` (``allreduce_s``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

from partitioner.cost import LayerCost
from partitioner.step import gpt_step_fields
from partitioner.topology import Link
from pipedream2bw.errors import ConfigError
from pipedream2bw.memory.step_memory import StepModel

# A split matrix product runs below t times the whole one's speed (narrower matrices, more launches per FLOP): the
# fraction of the ideal 1/t that the cost model charges. Stated, not fitted: scripts/bench_tensor.py measures it on
# this machine's CPU for the default GPT's block (docs/planner.md).
TENSOR_EFFICIENCY = 0.9
BLOCK_WHOLE_SAVED = 4  # of the block's 16 saved b*T*C activations, those whole on every rank without sequence parallel


@dataclass(frozen=True)
class TensorShape:
    """What splitting a model needs to know of it: the GPT's dimensions and its layer list's kinds."""

    num_heads: int
    mlp_width: int  # the MLP's hidden width (4 * d_model in the GPT)
    d_model: int
    seq_len: int
    vocab_size: int
    act_bytes: int  # bytes of one activation element (the compute dtype)
    kinds: Sequence[str]  # per layer: 'embedding', 'block', 'norm' or 'head' (models.gpt.layer_kind)
    muon: bool = False  # optim.name=muon: the step orthogonalizes each whole matrix (an all-gather per matrix)
    # the LM head splits by the vocabulary with the run's own loss (lm_loss, which the vocab-parallel loss replaces);
    # a caller's loss_fn reads whole logits, so the runtime keeps the head whole on every rank (run/tensor.py)
    vocab_head: bool = True
    step: Optional[StepModel] = None  # the step's transients (``partitioner.step``); None: the whole layer's kept


def allreduce_s(nbytes: float, t: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``t`` ranks on ``link`` (s); 0 at t = 1."""
    if t == 1 or nbytes <= 0:
        return 0.0
    return 2 * (t - 1) / t * nbytes / link.bandwidth + 2 * (t - 1) * link.latency


def allgather_s(nbytes: float, t: int, link: Link) -> float:
    """A ring all-gather of a tensor of ``nbytes`` (whole) over ``t`` ranks on ``link`` (s); 0 at t = 1."""
    if t == 1 or nbytes <= 0:
        return 0.0
    return (t - 1) / t * nbytes / link.bandwidth + (t - 1) * link.latency


def widths(shape: TensorShape, *, devices: int, devices_per_node: int) -> List[int]:
    """The tensor widths a search may take: t dividing the heads, the MLP width, the device count and a node's
    devices (a tensor group never leaves a node)."""
    return [t for t in range(1, devices_per_node + 1) if not _why_not(shape, t, devices, devices_per_node)]


def check_width(shape, t: int, *, devices: int, devices_per_node: int) -> None:
    """Raises ConfigError naming ``pipeline.tensor_parallel`` when ``t`` cannot split ``shape`` on this machine
    (``shape`` None: a model the split does not know)."""
    if t == 1:
        return
    if shape is None:
        raise ConfigError(
            f"pipeline.tensor_parallel ({t}): the planner splits only the built-in GPT's layers (model=gpt); "
            "set pipeline.tensor_parallel=1 for this model"
        )
    why = _why_not(shape, t, devices, devices_per_node)
    if why:
        ok = widths(shape, devices=devices, devices_per_node=devices_per_node)
        raise ConfigError(f"pipeline.tensor_parallel ({t}) {why}; set it to one of {ok}")


def _why_not(shape: TensorShape, t: int, devices: int, devices_per_node: int) -> str:
    if t < 1:
        return "must be at least 1"
    if shape.num_heads % t:
        return f"must divide the attention heads ({shape.num_heads})"
    if shape.mlp_width % t:
        return f"must divide the MLP width ({shape.mlp_width})"
    if devices % t:
        return f"must divide the device count ({devices})"
    if t > devices_per_node or devices_per_node % t:
        return (
            f"must divide a node's devices (topology.devices_per_node={devices_per_node}): a tensor group stays "
            "on one node"
        )
    return ""


def split_layers(
    layers: Sequence[LayerCost],
    shape: TensorShape,
    t: int,
    *,
    b: int,
    link: Link,
    sequence_parallel: bool = False,
    efficiency: float = TENSOR_EFFICIENCY,
) -> List[LayerCost]:
    """One rank's costs of each layer of ``layers`` (the whole model's, microbatch size ``b``) split ``t`` ways,
    the collectives over ``link`` (the module docstring's model). ``layers`` itself at t = 1."""
    if t == 1:
        return list(layers)
    if len(layers) != len(shape.kinds):
        raise ValueError(f"{len(layers)} layer costs for a model of {len(shape.kinds)} layers")
    btc = b * shape.seq_len * shape.d_model * shape.act_bytes
    by_kind = {"block": _block, "embedding": _embedding, "head": _head, "norm": _norm}
    sp = sequence_parallel
    out = [
        by_kind[kind](c, shape, t, btc=btc, link=link, sp=sp, eff=efficiency, b=b)
        for c, kind in zip(layers, shape.kinds)
    ]
    if shape.step is None:
        return out
    dims = dict(d_model=shape.d_model, vocab_size=shape.vocab_size, seq_len=shape.seq_len, t=t)
    return [dataclasses.replace(c, **gpt_step_fields(shape.step, k, **dims)) for c, k in zip(out, shape.kinds)]


def _params(c: LayerCost, split: float, t: int) -> dict:
    """A layer's parameter-bound costs with the fraction ``split`` of its parameters divided by ``t``."""
    keep = 1 - split + split / t
    return dict(
        param_bytes=int(math.ceil(c.param_bytes * keep)),
        optimizer_bytes=int(math.ceil(c.optimizer_bytes * keep)),
        step_s=c.step_s * keep,
    )


def _io(c: LayerCost, t: int, sp: bool, *, inputs: bool = True) -> dict:
    """Input and output bytes per rank: / t with sequence parallelism (the embedding's input, token ids, whole)."""
    div = t if sp else 1
    return dict(
        input_bytes=int(math.ceil(c.input_bytes / (div if inputs else 1))),
        output_bytes=int(math.ceil(c.output_bytes / div)),
    )


def _block(c: LayerCost, shape: TensorShape, t: int, *, btc, link, sp, eff, b) -> LayerCost:
    C, H = shape.d_model, shape.mlp_width
    split = (4 * C * C + 2 * C * H + 3 * C + H) / (4 * C * C + 2 * C * H + 9 * C + H)  # 12C^2+7C of 12C^2+13C
    whole = 0 if sp else min(c.saved_bytes, BLOCK_WHOLE_SAVED * btc)
    ar = 2 * allreduce_s(btc, t, link)
    # sequence parallelism's backward gathers each column-split matrix's input again (only its slice was saved) and
    # sums the norms' and row biases' gradients (6 C, float32) over the tensor group: one small all-reduce a block
    again = 2 * allgather_s(btc, t, link) + allreduce_s(6 * C * 4, t, link) if sp else 0.0
    params = _params(c, split, t)
    if shape.muon:  # each rank gathers every hidden matrix's float32 update and orthogonalizes it whole: the step's
        # time does not divide by t (its Newton-Schulz iterations dominate it), and four all-gathers add to it
        gathers = sum(allgather_s(4 * n, t, link) for n in (3 * C * C, C * C, C * H, H * C))  # qkv, proj, fc, fc_proj
        params["step_s"] = c.step_s + gathers
    return dataclasses.replace(
        c,
        forward_s=c.forward_s / (t * eff) + ar,
        backward_s=c.backward_s / (t * eff) + ar + again,
        split_s=c.split_s / (t * eff),
        input_s=None if c.input_s is None else c.input_s / (t * eff) + ar + again,  # the input's all-reduce is B's
        saved_bytes=int(math.ceil(whole + (c.saved_bytes - whole) / t)),
        **params,
        **_io(c, t, sp),
    )


def _embedding(c: LayerCost, shape: TensorShape, t: int, *, btc, link, sp, eff, b) -> LayerCost:
    # sequence parallelism slices its output (each rank keeps its part of the sequence): the slices' gradients are
    # gathered whole in the backward
    bwd = c.backward_s + (allgather_s(btc, t, link) if sp else 0.0)
    if shape.vocab_size % t:  # whole on every rank: nothing to reduce
        return dataclasses.replace(c, backward_s=bwd, **_io(c, t, sp, inputs=False))
    V, T = shape.vocab_size, shape.seq_len
    fwd = c.forward_s + allreduce_s(btc, t, link)  # the gather is memory-bound: its time stays
    params = _params(c, V / (V + T), t)
    return dataclasses.replace(c, forward_s=fwd, backward_s=bwd, **params, **_io(c, t, sp, inputs=False))


def _head(c: LayerCost, shape: TensorShape, t: int, *, btc, link, sp, eff, b) -> LayerCost:
    if shape.vocab_size % t or not shape.vocab_head:
        return c
    whole = 0 if sp else min(c.saved_bytes, btc)  # its input, whole without sequence parallelism
    loss = 3 * allreduce_s(b * shape.seq_len * 4, t, link)  # the vocab-parallel loss: max, sum of exp, target
    return dataclasses.replace(
        c,
        forward_s=c.forward_s / (t * eff) + loss,
        backward_s=c.backward_s / (t * eff) + allreduce_s(btc, t, link),
        split_s=c.split_s / (t * eff),
        input_s=None if c.input_s is None else c.input_s / (t * eff) + allreduce_s(btc, t, link),
        saved_bytes=int(math.ceil(whole + (c.saved_bytes - whole) / t)),
        **_params(c, 1.0, t),
        **_io(c, t, sp),
    )


def _norm(c: LayerCost, shape: TensorShape, t: int, *, btc, link, sp, eff, b) -> LayerCost:
    if not sp:
        return c
    # the runtime gathers the sequence before the final norm (the head and the loss see it whole, as at t = 1): its
    # input arrives as a slice and is all-gathered; it runs, saves and sends whole
    return dataclasses.replace(
        c,
        forward_s=c.forward_s + allgather_s(btc, t, link),
        input_bytes=int(math.ceil(c.input_bytes / t)),
    )
