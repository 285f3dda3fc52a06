"""Per-layer costs of the GPT: measured (forward/backward time, saved bytes) or analytic (FLOPs).

Measured: each distinct layer shape is run alone on this machine's device with one thread on
CPU (as the ranks run) or CUDA with synchronization, timed as the median of ``repeats`` after
warm-up, and what the backward split into B then W (zb1p, zbv) takes more, and its B alone (``split_backward``; a
layer whose input needs a gradient); what autograd saves is counted with ``saved_tensors_hooks`` (parameters excluded);
the optimizer's state and step time come from a real step of the configured optimizer. The
transformer blocks share one shape, so one block's profile stands for all of them. The last
layer is profiled with the loss attached, as the last stage runs it. Results are cached on disk,
keyed by the model, optimizer, b, device, dtype and torch version.

Any layer list (a model from config or the Python API's ``layers``): ``profile_layer_list`` runs
the layers in order on a real microbatch of token ids, each timed alone on the previous one's
output (a tuple or dict of tensors too); layers of the same structure on inputs of the same
shape are measured once. A parameter shared by layers (a tied embedding; ``with_ties``) is named in each holder's
``LayerCost.ties``: the cost model counts it once on a stage (or zbv rank) holding several holders, once on each
stage holding one, as the runtime keeps it (one parameter there, a copy a stage). Not cached (the model is code, not a
config). The GPT's ``model.tie_embeddings``: the embedding's token weight and the head's (``gpt_ties``).

Analytic: FLOP counts (a block: 24*b*T*C^2 + 4*b*T^2*C forward, twice that backward) at the
topology's ``peak_tflops``, memory-bound layers at ``memory_bw_gbps``, and the saved bytes a
pre-LN block keeps (16 activations of b*T*C elements with fused attention, as measured), for models too big
to run here (the 175B example).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from partitioner.cost import LayerCost
from partitioner.step import gpt_step_fields
from pipedream2bw.config import (
    GPTConfig,
    OptimConfig,
    TopologyConfig,
    build_optimizer,
    model_num_layers,
    optimizer_name,
)
from pipedream2bw.config.corrections import concrete
from pipedream2bw.config.optimizers import MUON_ROLE, extra_optim_settings, is_muon, tag_muon_params
from pipedream2bw.io.fileio import atomic_write_text
from pipedream2bw.memory import precision as precisions
from pipedream2bw.memory.memprobe import saved_bytes
from pipedream2bw.memory.step_memory import StepModel, layer_step_bytes
from pipedream2bw.models import build_gpt_layers, lm_loss
from pipedream2bw.models.gpt import layer_kind
from pipedream2bw.pipeline.split_backward import GraphPlans, backward_input, backward_weight

# 2: the step's transient bytes (LayerCost.step_*); 3: the split backward's (split_s); 4: its B's (input_s); 5: the
# split timed by the runtime's own code
CACHE_VERSION = 5


SPLIT_ANALYTIC = 0.07
"""Analytic costs' split backward (B then W, zb1p and zbv) over the whole backward, less 1: measured 1.072 at GPT 8 x
256, seq 128, b=16 (``scripts/bench_split.py``, docs/benchmarks.md), the largest shape measured; the models analytic
costs are for are larger still, where the split's fixed costs weigh less (1.125 at b=4, 1.28-1.56 at GPT 4 x 64)."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("PD2BW_CACHE_DIR", Path.home() / ".cache" / "pipedream2bw"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_passes(
    forward: Callable[[], Any],
    backward: Callable[[Any], None],
    leaves: Sequence[torch.Tensor],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    split: Optional[Callable[[Any], Callable[[], None]]] = None,
) -> Tuple[float, float, float, Optional[float]]:
    """Median seconds of ``forward()`` and of ``backward(its output)`` over ``repeats`` runs after
    ``warmup``, the gradients of ``leaves`` cleared before each; and with ``split`` (B of another forward's output,
    returning its W, in the same round) the median of each round's B + W less its ``backward``, at least 0, and of
    its B alone (else 0 and None)."""
    fwd, bwd, extra, first = [], [], [], []

    def timed(fn: Callable[[], Any]) -> Tuple[Any, float]:
        for t in leaves:
            t.grad = None
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        return result, time.perf_counter() - t0

    for r in range(warmup + repeats):
        out, f = timed(forward)
        _, b = timed(functools.partial(backward, out))
        if split is not None:
            weight, s_b = timed(functools.partial(split, forward()))
            _, s_w = timed(weight)
        if r >= warmup:
            fwd.append(f)
            bwd.append(b)
            if split is not None:
                extra.append(s_b + s_w - b)
                first.append(s_b)
    if not extra:
        return statistics.median(fwd), statistics.median(bwd), 0.0, None
    return statistics.median(fwd), statistics.median(bwd), max(0.0, statistics.median(extra)), statistics.median(first)


def split_backward(
    outputs: Sequence[torch.Tensor], grads, inputs: Sequence[torch.Tensor], params, *, plans: Optional[GraphPlans]
) -> Callable[[], None]:
    """A backward as zb1p and zbv run it (issue 46), by the runtime's own code (``pipeline/split_backward.py``): B now,
    the ``inputs``' gradients with the graph kept; W returned, the ``params``' from what B caught; ``grads`` None for
    a loss. ``plans``: the layer's graph analyses kept across rounds, as a stage keeps them across microbatches."""
    _, work = backward_input(list(outputs), grads, list(inputs), list(params), plans=plans)
    return functools.partial(backward_weight, work)


def _time_optimizer(
    params: Sequence[torch.nn.Parameter], optim: OptimConfig, *, device: torch.device, warmup: int, repeats: int
) -> Tuple[float, int]:
    """(median seconds of one step, optimizer state bytes after a real step) of ``optim`` on ``params``."""
    if not params:
        return 0.0, 0
    opt = build_optimizer(params, optim)
    steps = []
    for r in range(warmup + repeats):
        for p in params:
            p.grad = torch.zeros_like(p)
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        if r >= warmup:
            steps.append(time.perf_counter() - t0)
    state_bytes = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
    return statistics.median(steps), state_bytes


def profile_layer(
    layer: torch.nn.Module,
    cfg: GPTConfig,
    optim: OptimConfig,
    kind: str,
    b: int,
    *,
    device: torch.device,
    repeats: int = 5,
    warmup: int = 2,
    precision: str = "fp32",
    documents: bool = False,
    weight_dtype: str = "fp32",
) -> LayerCost:
    """Measures one layer at microbatch size ``b`` (see the module docstring), its forward under
    ``precision``'s autocast with float32 weights, as a stage runs it; inputs and outputs in the
    compute dtype, as they cross stages. ``documents`` (data.packing=documents): the layer takes and passes on the
    packed rows' positions (``document_positions``), the blocks attend through the document mask, and the loss
    weighs its targets, as the runtime's packed rows do. ``weight_dtype`` (train.weight_dtype): 'compute' under
    bf16/fp16 stores the weights in the compute dtype, as such a stage's versions are: autocast has no cast of them to
    make or save, and the input stays in that dtype (run/stage.py); the optimizer's step and state are still timed
    on float32 copies (the runtime steps float32 masters) and ``param_bytes`` counts float32 bytes, as always."""
    layer = layer.to(device)
    stored = precisions.weight_dtype(precision, weight_dtype)
    tag_muon_params(layer, optim.muon_exclude)  # optim.name=muon: which parameters Muon steps, as a stage tags them
    masters = None
    if stored != torch.float32:  # float32 masters (with the tags) for the step's timing; then the layer in its dtype
        masters = [torch.nn.Parameter(p.detach().clone()) for p in layer.parameters()]
        for m, p in zip(masters, layer.parameters()):
            m.__dict__.update(p.__dict__)
        layer = layer.to(stored)  # floating parameters and buffers only (the same Parameters, tags kept)
    params = list(layer.parameters())
    T, C = cfg.seq_len, cfg.d_model
    wire = precisions.compute_dtype(precision)
    gen = torch.Generator().manual_seed(0)
    if kind == "embedding":
        x = torch.randint(0, cfg.vocab_size, (b, T), generator=gen).to(device)
    else:
        x = torch.randn(b, T, C, generator=gen).to(device, wire).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (b, T), generator=gen).to(device)
    positions = document_positions(b, T).to(device) if documents else None
    pos_bytes = 0 if positions is None else positions.numel() * positions.element_size()  # cross beside x
    if documents:
        targets = (targets, torch.full((b, T), 1.0 / (b * T), device=device))  # (ids, weights), as packed rows

    # as StageWorker.forward: float32 in, autocast, loss in float32, sent in the wire dtype
    def forward() -> torch.Tensor:
        with precisions.autocast(precision, device.type):
            inp = x.float() if x.is_floating_point() and stored == torch.float32 else x
            out = layer(inp if positions is None else (inp, positions))
        if kind == "head":
            return lm_loss(out.float(), targets)
        return (out if positions is None else out[0]).to(wire)

    out = forward()
    out_bytes = 0 if kind == "head" else out.numel() * out.element_size() + pos_bytes
    grad = None if kind == "head" else torch.randn(out.shape, generator=gen).to(device, out.dtype)
    return _measure(
        kind,
        forward,
        lambda out: out.backward(grad),
        params,
        [x] if x.requires_grad else [],
        optim,
        input_bytes=x.numel() * x.element_size() + pos_bytes,
        output_bytes=out_bytes,
        device=device,
        warmup=warmup,
        repeats=repeats,
        masters=masters,
        split=functools.partial(_split_of_output, grad=grad, x=x, params=params, plans=GraphPlans())
        if x.requires_grad
        else None,
    )


def _split_of_output(out, *, grad, x, params, plans: GraphPlans) -> Callable[[], None]:
    """``split_backward`` of a GPT layer's output ``out`` (a loss where ``grad`` is None) to its input ``x``."""
    return split_backward([out], None if grad is None else [grad], [x], params, plans=plans)


def document_positions(b: int, T: int) -> torch.Tensor:
    """Positions of packed rows for profiling (data.packing=documents): documents of T/4 tokens, restarting at 0 ->
    (b, T) int64. The mask's cost does not depend on where the documents end: the blocks build a (b, 1, T, T) mask
    and attention reads all of it whatever it holds."""
    return (torch.arange(T) % max(1, T // 4)).expand(b, T).contiguous()


def _measure(
    name: str,
    forward: Callable[[], Any],
    backward: Callable[[Any], None],
    params: List[torch.Tensor],
    inputs: List[torch.Tensor],
    optim: OptimConfig,
    *,
    input_bytes: int,
    output_bytes: int,
    device: torch.device,
    warmup: int,
    repeats: int,
    masters: Optional[List[torch.Tensor]] = None,
    split: Optional[Callable[[Any], None]] = None,
) -> LayerCost:
    """One layer's cost from its ``forward`` and ``backward`` passes: their times (gradients of ``params`` and of
    the floating-point ``inputs`` cleared between repeats), what ``split`` (the backward as B then W) takes more than
    ``backward`` where given (a layer whose input needs a gradient), the bytes autograd saves, the optimizer step's
    time and state (on ``masters``, float32 copies of compute-dtype ``params``, where given, as are
    ``param_bytes``)."""
    forward_s, backward_s, split_s, input_s = _time_passes(
        forward, backward, params + inputs, device=device, warmup=warmup, repeats=repeats, split=split
    )
    saved = saved_bytes(forward, params)
    stepped = params if masters is None else masters
    step_s, opt_bytes = _time_optimizer(stepped, optim, device=device, warmup=warmup, repeats=repeats)
    return LayerCost(
        name=name,
        forward_s=forward_s,
        backward_s=backward_s,
        split_s=split_s,
        input_s=0.0 if split is None else input_s,  # no input needing a gradient: B does nothing
        param_bytes=sum(p.numel() * p.element_size() for p in stepped),  # float32: the masters' where given
        saved_bytes=saved,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        optimizer_bytes=opt_bytes,
        step_s=step_s,
        **_step_bytes(params, optim, device),
    )


def _step_bytes(params: Sequence[torch.Tensor], optim: OptimConfig, device: torch.device) -> Dict[str, int]:
    """``LayerCost``'s step fields of a layer's (tagged) ``params`` under ``optim`` (``step_memory``)."""
    model = StepModel.of(optim, device_type=device.type)
    shapes = [(p.shape[0] if p.dim() else 1, p.numel() // max(p.shape[0] if p.dim() else 1, 1)) for p in params]
    muon = [p.dim() == 2 and getattr(p, MUON_ROLE, False) for p in params]
    return layer_step_bytes(model, [(rows, cols, mu, 1) for (rows, cols), mu in zip(shapes, muon)])


def _cache_key(
    cfg: GPTConfig,
    optim: OptimConfig,
    b: int,
    device: torch.device,
    dtype: torch.dtype,
    threads: int,
    documents: bool = False,
    weight_dtype: torch.dtype = torch.float32,
) -> str:
    extra = {"documents": True} if documents else {}  # windows' keys stay as they were (their caches hold)
    if weight_dtype != torch.float32:  # compute-dtype weights: no autocast casts of them (float32's keys as they were)
        extra["weight_dtype"] = str(weight_dtype)
    desc = json.dumps(
        {
            **extra,
            "v": CACHE_VERSION,
            "model": dataclasses.asdict(cfg),
            "optim": {"name": optim.name.lower(), "kwargs": dict(optim.kwargs), **extra_optim_settings(optim)},
            "b": b,
            "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "dtype": str(dtype),
            "torch": torch.__version__,
            "threads": threads,
        },
        sort_keys=True,
    )
    return hashlib.sha256(desc.encode()).hexdigest()[:20]


def profile_gpt(
    cfg: GPTConfig,
    optim: OptimConfig,
    b: int,
    *,
    device: Optional[torch.device] = None,
    repeats: int = 5,
    cache_dir: Optional[Path] = None,
    use_cache: bool = True,
    seed: int = 0,
    precision: str = "fp32",
    documents: bool = False,
    weight_dtype: str = "fp32",
) -> List[LayerCost]:
    """Measured costs of every layer of the GPT at microbatch size ``b`` under a resolved
    ``precision`` (fp32, bf16, fp16), on packed rows with their document mask where ``documents``
    (data.packing=documents), with weights stored in ``weight_dtype`` (train.weight_dtype: ``profile_layer``), from
    the cache if there."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = 1 if device.type == "cpu" else torch.get_num_threads()
    stored = precisions.weight_dtype(precision, weight_dtype)
    key = _cache_key(cfg, optim, b, device, precisions.compute_dtype(precision), threads, documents, stored)
    path = Path(cache_dir or default_cache_dir()) / f"profile-{key}.json"
    if use_cache and path.is_file():
        try:
            kinds = json.loads(path.read_text())
            return _expand(cfg, {k: LayerCost(**v) for k, v in kinds.items()})
        except (ValueError, TypeError):
            pass  # a corrupt or old entry: measure again
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kinds: Dict[str, LayerCost] = {}
        for i in range(model_num_layers(cfg)):
            kind = layer_kind(cfg, i)
            if kind not in kinds:
                layer = build_gpt_layers(cfg, seed=seed, indices=[i])[0]
                kinds[kind] = profile_layer(
                    layer,
                    cfg,
                    optim,
                    kind,
                    b,
                    device=device,
                    repeats=repeats,
                    precision=precision,
                    documents=documents,
                    weight_dtype=weight_dtype,
                )
    finally:
        torch.set_num_threads(saved_threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({k: dataclasses.asdict(v) for k, v in kinds.items()}, indent=1))
    return _expand(cfg, kinds)


def _expand(cfg: GPTConfig, kinds: Dict[str, LayerCost]) -> List[LayerCost]:
    return gpt_ties(
        cfg,
        [
            dataclasses.replace(kinds[layer_kind(cfg, i)], name=f"{i}:{layer_kind(cfg, i)}", ties=())
            for i in range(model_num_layers(cfg))
        ],
    )


def with_ties(costs: List[LayerCost], tied: Sequence[Any]) -> List[LayerCost]:
    """A layer list's ``costs`` with its ties named (``LayerCost.ties``; ``tied``: ``pipeline.ties.find_ties``' of the
    list): each holder's share of its parameter bytes is the tie's float32 bytes (at most all of them)."""
    shares: Dict[int, List[Tuple[str, float]]] = {}
    for tie in tied:
        nbytes = 4 * int(torch.Size(tie.shape).numel())
        for layer in tie.layers:
            share = min(1.0, nbytes / costs[layer].param_bytes) if costs[layer].param_bytes else 0.0
            shares.setdefault(layer, []).append((tie.canonical, share))
    return [dataclasses.replace(c, ties=tuple(shares.get(i, ()))) for i, c in enumerate(costs)]


TIE = "tok"  # the GPT's tie: the token embedding's (V, C) weight, the LM head's too with model.tie_embeddings


def gpt_ties(cfg: GPTConfig, layers: List[LayerCost]) -> List[LayerCost]:
    """The GPT's ``layers`` with its tie named where ``cfg.tie_embeddings``: the embedding (V of its V + T rows of
    d_model) and the head (all of its weight: no bias) hold one (V, C) parameter (``cost.Segments.total``)."""
    if not cfg.tie_embeddings:
        return layers
    V, T = cfg.vocab_size, cfg.seq_len
    share = {"embedding": V / (V + T), "head": 1.0}
    return [
        dataclasses.replace(c, ties=((TIE, share[layer_kind(cfg, i)]),)) if layer_kind(cfg, i) in share else c
        for i, c in enumerate(layers)
    ]


def analytic_gpt(
    cfg: GPTConfig,
    optim: OptimConfig,
    b: int,
    topo: TopologyConfig,
    *,
    precision: str = "fp32",
    weight_dtype: str = "fp32",
) -> List[LayerCost]:
    """FLOP- and byte-count costs of every layer at microbatch size ``b`` on ``topo``'s devices.

    Under a resolved ``precision`` (fp32, bf16, fp16) as the runtime trains: activations in the
    compute dtype, plus autocast's compute-dtype copy of the matmul weights per microbatch where the weight versions
    are float32 (``weight_dtype``, train.weight_dtype: compute-dtype weights are not cast); weights in float32 bytes;
    weights, gradient and optimizer state per parameter from ``precision.param_memory`` (under Muon, its state
    for the blocks' matrices and optim.muon_others' for the rest).
    """
    T, C, V = cfg.seq_len, cfg.d_model, cfg.vocab_size
    flops, bw = topo.peak_tflops * 1e12, topo.memory_bw_gbps * 1e9
    muon = is_muon(optim)
    pm, pm_matrices = (
        precisions.param_memory(
            precision,
            schedule="flush",
            optimizer=name,
            optimizer_kwargs=optim.kwargs,
            delay_correction=concrete(optim),
        )
        for name in ((optim.muon_others, "muon") if muon else (optimizer_name(optim),) * 2)
    )
    dtype_bytes = precisions.compute_dtype(precision).itemsize
    btc = b * T * C * dtype_bytes
    cast = precisions.param_memory(precision, schedule="flush", optimizer="adam", weight_dtype_name=weight_dtype)

    def step_s(nbytes: float) -> float:  # read the gradient, read and write weights and state
        return 3 * nbytes / bw

    def make(name, fwd_flops, fwd_bytes, params, saved, inp, out, matmul_params=0) -> LayerCost:
        # optim.name=muon steps a block's matrices (the default optim.muon_exclude leaves the embedding and head
        # to optim.muon_others, with the norms and biases)
        pbytes = params * pm.weight_copy
        state = (params - matmul_params) * (pm.optimizer + pm.master)
        state += matmul_params * ((pm_matrices if "block" in name else pm).optimizer + pm.master)
        saved += matmul_params * cast.cast_per_microbatch
        fwd = max(fwd_flops / flops, fwd_bytes / bw)
        return LayerCost(
            name=name,
            forward_s=fwd,
            backward_s=2 * fwd,
            param_bytes=int(pbytes),
            saved_bytes=int(saved),
            input_bytes=int(inp),
            output_bytes=int(out),
            optimizer_bytes=int(state),
            step_s=step_s(pbytes + state),
        )

    block_params = 12 * C * C + 13 * C
    layers = []
    for i in range(model_num_layers(cfg)):
        kind = layer_kind(cfg, i)
        if kind == "embedding":
            layers.append(make(f"{i}:embedding", 0, 2 * btc, (V + T) * C, b * T * 8, b * T * 8, btc))
        elif kind == "block":
            f = 24 * b * T * C * C + 4 * b * T * T * C
            layers.append(
                make(
                    f"{i}:block",
                    f,
                    2 * block_params * dtype_bytes + 20 * btc,
                    block_params,
                    16 * btc,
                    btc,
                    btc,
                    12 * C * C,
                )
            )
        elif kind == "norm":
            layers.append(make(f"{i}:norm", 0, 3 * btc, 2 * C, btc, btc, btc))
        else:
            logits = b * T * V * dtype_bytes
            loss = b * T * V * 4  # the loss upcasts the logits: float32 log-probabilities saved for backward
            layers.append(
                make(
                    f"{i}:head",
                    2 * b * T * C * V,
                    V * C * dtype_bytes + 3 * logits,
                    V * C,
                    btc + logits + loss,
                    btc,
                    0,
                    V * C,
                )
            )
    return gpt_ties(cfg, _with_split(_with_step(layers, cfg, optim, topo.device)))


def _with_split(layers: List[LayerCost]) -> List[LayerCost]:
    """Analytic ``layers`` with their split backward's cost, ``SPLIT_ANALYTIC`` of their backward (none for the
    embedding: its input, token ids, needs no gradient)."""
    return [
        dataclasses.replace(c, split_s=0.0 if "embedding" in c.name else SPLIT_ANALYTIC * c.backward_s) for c in layers
    ]


def _with_step(layers: List[LayerCost], cfg: GPTConfig, optim: OptimConfig, device_type: str) -> List[LayerCost]:
    """The GPT's ``layers`` with their step's transient bytes (``partitioner.step``) under ``optim`` on a
    ``device_type`` device."""
    model = StepModel.of(optim, device_type=device_type)
    dims = dict(d_model=cfg.d_model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    return [dataclasses.replace(c, **gpt_step_fields(model, layer_kind(cfg, i), **dims)) for i, c in enumerate(layers)]


def with_document_mask(
    layers: Sequence[LayerCost], cfg: GPTConfig, b: int, topo: TopologyConfig, *, precision: str = "fp32"
) -> List[LayerCost]:
    """``analytic_gpt``'s ``layers`` on packed documents (data.packing=documents). Every row is padded to
    model.seq_len (a fixed bucket), so a microbatch costs the windows' figures plus the mask's:

    - memory: each block's attention saves the (b, 1, T, T) mask for its backward in the compute dtype (SDPA
      converts the boolean mask to an additive one: measured with saved_tensors_hooks, 4 bytes an element under
      fp32, tests/test_plan_documents.py); the (b, T) int64 positions cross every boundary beside the activations;
    - time: the mask's bytes at the device's memory bandwidth: built (two (b, T, T) boolean passes and the
      conversion), read by each head's attention once forward and twice backward.
    """
    T, H = cfg.seq_len, cfg.num_heads
    bw, dt = topo.memory_bw_gbps * 1e9, precisions.compute_dtype(precision).itemsize
    mask = b * T * T * dt  # (b, 1, T, T) in the compute dtype: what attention saves
    pos = b * T * 8  # (b, T) int64
    build_s, read_s = (b * T * T * 4 + mask) / bw, H * mask / bw
    out = []
    for layer in layers:
        kind = layer.name.split(":", 1)[1]
        extra = dict(input_bytes=layer.input_bytes + pos)  # the embedding's: ids and positions
        if kind != "head":  # the head drops the positions
            extra["output_bytes"] = layer.output_bytes + pos
        if kind == "block":
            extra.update(
                saved_bytes=layer.saved_bytes + mask,
                forward_s=layer.forward_s + build_s + read_s,
                backward_s=layer.backward_s + 2 * read_s,
            )
        out.append(dataclasses.replace(layer, **extra))
    return out


def warm_up_runtime() -> None:
    """One forward, backward and optimizer step of a tiny GPT (kilobytes of tensors).

    The first ones page in the kernels' code and start the autograd engine and the CPU
    libraries' pools: on this machine about 90 MiB of resident memory that any model pays
    once, whatever its size. The runtime baseline is measured after it.
    """
    cfg = GPTConfig(num_layers=1, d_model=8, num_heads=2, seq_len=8)
    model = torch.nn.Sequential(*build_gpt_layers(cfg, seed=0))
    opt = build_optimizer(model.parameters(), OptimConfig(name="adamw"))
    x = torch.randint(0, 256, (1, cfg.seq_len))
    lm_loss(model(x), x).backward()
    opt.step()


def runtime_baseline_bytes(*, warm: bool = True) -> int:
    """Peak resident memory of this process so far (after ``warm_up_runtime``): on CPU, what the
    torch runtime holds before any real model. Call it before profiling, which allocates more."""
    if warm:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            warm_up_runtime()
        finally:
            torch.set_num_threads(threads)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _signature(layer: torch.nn.Module, x, last: bool) -> str:
    shapes = [(tuple(t.shape), str(t.dtype)) for t in torch.utils._pytree.tree_leaves(x)]
    return repr((type(layer).__qualname__, repr(layer), [tuple(p.shape) for p in layer.parameters()], shapes, last))


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(tree) if torch.is_tensor(t))


def profile_any_layer(
    layer: torch.nn.Module,
    x,
    targets: torch.Tensor,
    loss_fn: Optional[Callable],
    optim: OptimConfig,
    *,
    name: str,
    device: torch.device,
    repeats: int = 5,
    warmup: int = 2,
) -> LayerCost:
    """Measures one layer of any list on its input ``x`` (a tensor or a tuple/dict of them); with
    ``loss_fn`` (the last layer) the loss is part of its forward, as the last stage runs it."""
    import torch.utils._pytree as pytree

    tag_muon_params(layer, optim.muon_exclude)
    params = list(layer.parameters())
    gen = torch.Generator().manual_seed(0)
    float_inputs = [t for t in pytree.tree_leaves(x) if t.is_floating_point()]
    for t in float_inputs:
        t.requires_grad_()

    def forward():
        out = layer(x)
        return loss_fn(out, targets) if loss_fn is not None else out

    out = forward()
    outs = [t for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]
    grads = (
        None if loss_fn is not None else [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(device) for t in outs]
    )

    def needing(out) -> List[torch.Tensor]:
        return [t for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]

    def backward(out) -> None:
        if loss_fn is not None:
            out.backward()
        elif outs:
            torch.autograd.backward(needing(out), grads)

    plans = GraphPlans()

    def split(out) -> Callable[[], None]:
        if loss_fn is not None or outs:
            return split_backward(needing(out), grads, float_inputs, params, plans=plans)
        return lambda: None

    return _measure(
        name,
        forward,
        backward,
        params,
        float_inputs,
        optim,
        input_bytes=_nbytes(x),
        output_bytes=0 if loss_fn is not None else _nbytes(out),
        device=device,
        warmup=warmup,
        repeats=repeats,
        split=split if float_inputs else None,
    )


def profile_layer_list(
    layers: Callable[[int], torch.nn.Module],
    num_layers: int,
    loss_fn: Callable,
    optim: OptimConfig,
    b: int,
    *,
    seq_len: int,
    vocab_size: int = 256,
    device: Optional[torch.device] = None,
    repeats: int = 5,
) -> List[LayerCost]:
    """Measured costs of every layer of a list at microbatch size ``b``.

    Args:
        layers: ``layers(i)`` gives layer ``i``, a copy the profile may train (it steps an optimizer).
        loss_fn: (last layer's output, targets) -> loss.
        seq_len, vocab_size: the microbatch of token ids the first layer gets.
    """
    import copy as _copy

    import torch.utils._pytree as pytree

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = 1 if device.type == "cpu" else torch.get_num_threads()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (b, seq_len), generator=gen).to(device)
    targets = torch.randint(0, vocab_size, (b, seq_len), generator=gen).to(device)
    costs: List[LayerCost] = []
    seen: Dict[str, LayerCost] = {}
    try:
        for i in range(num_layers):
            layer = _copy.deepcopy(layers(i)).to(device)
            last = i == num_layers - 1
            key = _signature(layer, x, last)
            if key not in seen:
                inputs = pytree.tree_map(lambda t: t.detach().clone() if torch.is_tensor(t) else t, x)
                seen[key] = profile_any_layer(
                    layer,
                    inputs,
                    targets,
                    loss_fn if last else None,
                    optim,
                    name=type(layer).__name__,
                    device=device,
                    repeats=repeats,
                )
            costs.append(dataclasses.replace(seen[key], name=f"{i}:{seen[key].name}"))
            if not last:
                with torch.no_grad():
                    x = pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, layer(x))
    finally:
        torch.set_num_threads(saved_threads)
    return costs
