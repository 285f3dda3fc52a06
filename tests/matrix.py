"""The feature matrix (docs/design.md section 9): covering arrays over what a run combines, run in shared ranks."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import re
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import covertable
import torch
from dist_helper import spawn
from torch import nn

from pipedream2bw.config import (
    Config,
    DataConfig,
    DistConfig,
    GPTConfig,
    LayerListConfig,
    OptimConfig,
    PipelineConfig,
    SwapConfig,
    TrainConfig,
    WandbConfig,
    even_balance,
    gpt_balance,
)
from pipedream2bw.models.factory import model_source
from pipedream2bw.pipeline import comm
from pipedream2bw.pipeline.layout import make_layout
from pipedream2bw.run.runner import run

# Every feature and its values, in the order the generator sees them (the constraints below read a
# prefix of a row: schedule, d and w come first). The first value of each is the plain run.
FACTORS: "OrderedDict[str, Tuple[Any, ...]]" = OrderedDict(
    schedule=("2bw", "flush", "gpipe"),
    d=(1, 2, 4),  # pipeline.num_stages
    w=(1, 2),  # pipeline.data_parallel
    resume=(False, True),  # half the steps at (d, w) with a checkpoint, the rest resumed at RESUME_AT[(d, w)]
    swap=(False, True),  # activation swapping on every stage (swap.enabled, min_bytes 0, resident 0)
    precision=("fp32", "bf16", "fp16"),  # train.precision; fp16 always runs with its loss scaler
    tied=(False, True),  # a weight tied across the first and last stage (embedding and LM head)
    clip=(False, True),  # optim.clip_grad_norm, below every step's norm
    skip=(False, True),  # train.on_nonfinite=skip, with an inf put into one replica's gradient at batch SKIP_BATCH
    recompute=(False, True),  # pipeline.recompute
    host_optim=(False, True),  # swap.optimizer=host
    validation=(False, True),  # train.eval_every=EVAL_EVERY on held-out data
    # masked_layers: every boundary a (hidden, integer mask) tuple, with dropout (masks per layer and
    # microbatch, the same at every layout: pipedream2bw/pipeline/stateful.py); else the GPT
    structured=(False, True),
    sharded=(False, True),  # optim.sharded: masters and optimizer state sharded over the w replicas (w=1: inert)
    weight_dtype=("fp32", "compute"),  # train.weight_dtype: compute stores the versions in bf16/fp16 (fp32: inert)
    muon=(
        False,
        True,
    ),  # optim.name=muon: Muon for the hidden matrices, optim.muon_others=sgd (the cells' SGD) for the rest
    correction=(
        "none",
        "error_feedback",
    ),  # optim.delay_correction (off under flush, gpipe); lookahead: its own factor, below
    # swap.weights on every stage (swap.enabled): weights, gradients and optimizer state in host memory, each layer
    # streamed to the "device" for its forward and backward; activations swap only where ``swap`` is set too
    stream=(False, True),
    # optim.delay_correction=lookahead (2bw, the Muon cells): Muon with Nesterov momentum 0.99 for the hidden matrices,
    # NAdamW (beta1 0.99) for the rest (optim.muon_others=adamw): LOOKAHEAD; refused with the plain cells' SGD
    lookahead=(False, True),
    # pipeline.schedule=zb1p in place of a flush cell's flush: the same update (the flush reference), each backward
    # split into B (input gradient) and W (weight gradient, later: pipeline/split_backward.py)
    zero_bubble=(False, True),
    # data.packing=documents (issue 45): the shipped example documents packed into rows of SEQ_LEN, each attending
    # only within its documents (positions across every boundary beside the activations), the loss the mean over the
    # batch's unmasked tokens
    documents=(False, True),
    # pipeline.forward_lead (issue 47): the stages before the last run one forward ahead of 1F1B's bound (2bw, flush)
    forward_lead=(0, 1),
    # pipeline.tensor_parallel (issue 44): each stage's GPT blocks, embedding and head split over 2 tensor ranks
    # (d x w x 2 ranks). PAIRWISE_ONLY: both arrays cover its pairs, not its triples
    t=(1, 2),
)
# Features that only matrix.EXTRA's cells vary (no factor of the arrays: a cell each, issue 46), Cell fields whose
# constraints and refusals below are checked all the same: pipeline.sync_warmup_steps=SYNC_WARMUP (2bw: the first
# steps as PipeDream-Flush, then 2bw), optim.delay_correction=predict (2bw: batch t reads W(t-1) + d(t-2)) and
# pipeline.schedule=zbv in place of a flush cell's flush (``v``: 2d chunks, rank r running r and 2d-1-r) and
# pipeline.weight_versions=newest (``newest``; every other cell names batch, the rule tests/reference.py's
# reference_run states).
EXTRA_ONLY = ("sync_warmup", "predict", "v", "newest")
PREDICT_CORRECTION = {"none": "predict", "error_feedback": "predict_error_feedback"}
"""A predict cell's optim.delay_correction, from its correction: the prediction alone, or around error feedback."""

NUM_STEPS = 6  # the 2BW delay shows from step 1; step SKIP_BATCH is skipped; a resume at RESUME_STEP
RESUME_STEP = 3
SYNC_WARMUP = 2  # a sync_warmup cell's flushing steps: its resume (RESUME_STEP) and skip (SKIP_BATCH) come after
SKIP_BATCH = 3  # the first batch a resumed run trains: the skip meets the state the resume restored
EVAL_EVERY = 2  # validation after steps 2, 4 and 6
GLOBAL_BATCH = 8  # sequences per batch: w * m * b with b = 1, so m = 8 / w >= d at every layout
CLIP = 0.5  # below every step's gradient norm of these models (0.7 .. 15): clipping acts on every step,
# and steps stay large enough for the 2BW delay to show above bf16's tolerance
WIDTH, SEQ_LEN = 16, 8
DROPOUT = 0.2  # structured cells' mixing layers
POISONED_LAYER = 1  # the first block (GPT) or mixing layer (structured): on stage 0 whenever d > 1

# A resumed cell continues at another (d, w) with the same number of ranks (the same spawned group).
RESUME_AT = {(1, 2): (2, 1), (2, 1): (1, 2), (2, 2): (4, 1), (4, 1): (2, 2)}

# Tolerances against the single-process reference, per precision. fp32: float32 round-off (torch's
# defaults). bf16/fp16: the reference rounds where the pipeline sends (reference.StageBoundaries), so
# one layout is bit for bit; replicas (w = 2) and other splits sum gradients in another order, which
# moves a few roundings of activations to the compute dtype by one unit (2**-8 bf16, 2**-11 fp16).
TOLERANCE: Dict[str, Dict[str, float]] = {
    "fp32": {},
    "bf16": dict(rtol=1e-2, atol=1e-3),
    "fp16": dict(rtol=1e-3, atol=1e-4),
}


def tolerance(cell: "Cell") -> Dict[str, float]:
    """The cell's tolerance: its precision's, except that Muon under fp16 takes bf16's. Newton-Schulz maps a
    one-unit difference in a momentum's weak directions to an update difference of the order of the learning rate:
    measured 3.0e-4 (1.lin.weight, 2bw-d2w1-fp16-tied-clip-tuple-muon-ef, tied gradients summed across the stages
    in another order than the reference's) on a CPU with avx512_bf16, where the earlier machines measured under
    1e-4; the features it checks still move the weights by more (check_features_matter)."""
    if cell.muon and cell.precision == "fp16":
        return TOLERANCE["bf16"]
    return TOLERANCE[cell.precision]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the matrix: a value for every factor."""

    schedule: str
    d: int
    w: int
    resume: bool
    swap: bool
    precision: str
    tied: bool
    clip: bool
    skip: bool
    recompute: bool
    host_optim: bool
    validation: bool
    structured: bool
    sharded: bool
    weight_dtype: str
    muon: bool = False
    correction: str = "none"
    stream: bool = False
    lookahead: bool = False
    t: int = 1  # pipeline.tensor_parallel
    sync_warmup: bool = False
    predict: bool = False
    zero_bubble: bool = False
    documents: bool = False
    forward_lead: int = 0
    v: bool = False  # EXTRA_ONLY: pipeline.schedule=zbv in place of a flush cell's flush
    newest: bool = False  # EXTRA_ONLY: pipeline.weight_versions=newest (reference_newest's rule)

    @property
    def run_schedule(self) -> str:
        """pipeline.schedule of the cell's runs: zb1p for a zero-bubble flush cell, zbv for a V one."""
        return "zb1p" if self.zero_bubble else "zbv" if self.v else self.schedule

    @property
    def id(self) -> str:
        """Readable test id, e.g. ``2bw-d2w2-bf16-tied-clip-resume-d4w1``."""
        parts = [self.run_schedule, f"d{self.d}w{self.w}", self.precision]
        flags = ("tied", "clip", "skip", "recompute", "swap", "host_optim", "validation", "structured", "sharded")
        short = {"recompute": "recomp", "host_optim": "hostopt", "validation": "val", "structured": "tuple"}
        parts += [short.get(f, f) for f in flags if getattr(self, f)]
        if self.weight_dtype == "compute":
            parts.append("wcompute")
        if self.muon:
            parts.append("muon")
        if self.correction != "none":
            parts.append({"error_feedback": "ef"}.get(self.correction, self.correction))
        if self.lookahead:
            parts.append("lookahead")
        if self.predict:
            parts.append("predict")
        if self.newest:
            parts.append("newest")
        if self.sync_warmup:
            parts.append("sync")
        if self.stream:
            parts.append("stream")
        if self.documents:
            parts.append("docs")
        if self.forward_lead:
            parts.append(f"lead{self.forward_lead}")
        if self.resume:
            d, w = RESUME_AT[(self.d, self.w)]
            parts.append(f"resume-d{d}w{w}")
        if self.t > 1:
            parts.append(f"t{self.t}")
        return "-".join(parts)

    @property
    def world_size(self) -> int:
        return self.d * self.w * self.t

    def layouts(self) -> List[Tuple[int, int]]:
        """(d, w) of each run: one, or the first half's and the resumed half's."""
        return [(self.d, self.w)] + ([RESUME_AT[(self.d, self.w)]] if self.resume else [])


# The generator's constraints: (factors read, predicate on a row holding them, why). A row failing one is
# no run at all, so the covering arrays leave its combinations out.
CONSTRAINTS: List[Tuple[Tuple[str, ...], Callable[[Dict[str, Any]], bool], str]] = [
    (("d", "w"), lambda r: r["d"] * r["w"] <= 8, "at most 8 ranks"),
    (("d", "w", "t"), lambda r: r["d"] * r["w"] * r["t"] <= 8, "at most 8 ranks"),
    (
        ("skip", "t"),
        lambda r: not (r["skip"] and r["t"] > 1),
        "a skip cell's inf comes from a layer list of the test's own (poisoned_layers), which t > 1 refuses",
    ),
    (
        ("resume", "d", "w"),
        lambda r: not r["resume"] or (r["d"], r["w"]) in RESUME_AT,
        "resume needs another layout with as many ranks (RESUME_AT): none for 1x1 and 4x2",
    ),
    (
        ("swap", "d", "schedule"),
        lambda r: not r["swap"] or r["d"] >= 2 or r["schedule"] == "gpipe",
        "swapping needs a stage with more microbatches in flight than the one computing (resident 0): "
        "d >= 2 under 1F1B, any d under gpipe",
    ),
    (
        ("structured", "weight_dtype"),
        lambda r: not (r["structured"] and r["weight_dtype"] == "compute"),
        "weight_dtype=compute needs layers that take activations in the compute dtype: masked_layers computes "
        "in float32 on purpose, which a bf16 LayerNorm refuses (torch's mixed-dtype error, not detectable before)",
    ),
    (
        ("schedule", "correction"),
        lambda r: r["correction"] == "none" or r["schedule"] == "2bw",
        "a delay correction is off under flush and gpipe (no delay; test_corrections.py shows it inert): a cell "
        "there would cover its pairs with nothing",
    ),
    (
        ("schedule", "lookahead"),
        lambda r: not r["lookahead"] or r["schedule"] == "2bw",
        "the look-ahead is off under flush and gpipe (no delay), as the correction factor is",
    ),
    (
        ("schedule", "zero_bubble"),
        lambda r: not r["zero_bubble"] or r["schedule"] == "flush",
        "zb1p is flush's update with the backward split: a zero-bubble cell stands in for a flush cell",
    ),
    (
        ("schedule", "zero_bubble", "v"),
        lambda r: not r["v"] or (r["schedule"] == "flush" and not r["zero_bubble"]),
        "zbv is flush's update on a V of 2d chunks: a V cell stands in for a flush cell (not a zb1p one)",
    ),
    (
        ("correction", "lookahead"),
        lambda r: not (r["lookahead"] and r["correction"] != "none"),
        "one optim.delay_correction per run: the correction factor's or the look-ahead",
    ),
    # the forward lead acts under 1F1B (2bw, flush) on a stage before the last: moot under gpipe and zb1p (logged) and
    # at d = 1. Three rules of two factors each, not one of four: a rule is read once a row holds all its factors, and
    # the coverage check's search (``completes``) would otherwise fill every factor before zero_bubble to find out
    (("schedule", "forward_lead"), lambda r: not r["forward_lead"] or r["schedule"] != "gpipe", "lead: not gpipe"),
    (("d", "forward_lead"), lambda r: not r["forward_lead"] or r["d"] >= 2, "lead: d >= 2"),
    (("zero_bubble", "forward_lead"), lambda r: not (r["forward_lead"] and r["zero_bubble"]), "lead: not zb1p"),
    (
        ("schedule", "sync_warmup"),
        lambda r: not r["sync_warmup"] or r["schedule"] == "2bw",
        "the synchronous warm-up is moot under flush and gpipe (every step is synchronous; logged)",
    ),
    (
        ("schedule", "correction", "lookahead", "predict"),
        lambda r: (
            not r["predict"] or (r["schedule"] == "2bw" and r["correction"] != "lookahead" and not r["lookahead"])
        ),
        "the prediction is a delay correction: off under flush and gpipe; with error feedback it is "
        "optim.delay_correction=predict_error_feedback, and the look-ahead is another correction",
    ),
    # 2bw's m >= d holds by construction (m = 8 / w); fp16 always runs with its loss scaler.
]

# What a streamed cell (swap.weights) keeps to, so that an example breaking one of it is refused for that alone.
STREAMS: Dict[str, Any] = dict(
    schedule="2bw", d=2, w=1, resume=False, precision="fp32", tied=False, clip=False, skip=False, host_optim=True,
    validation=False, weight_dtype="fp32", stream=True,
)  # fmt: skip

# Combinations the code refuses at config time: (factors read, predicate, the ConfigError's pattern, why,
# the values of an example). Listed in docs/concepts.md ("Supported combinations"). They are no cells of the
# arrays (a refused run covers nothing); test_matrix validates each example and checks the refusal.
REFUSED: List[Tuple[Tuple[str, ...], Callable[[Dict[str, Any]], bool], str, str, Dict[str, Any]]] = [
    (
        ("precision", "tied", "weight_dtype"),
        lambda r: r["weight_dtype"] == "compute" and r["precision"] == "bf16" and r["tied"],
        r"train.weight_dtype \(compute\) with (model.tie_embeddings|tied weights)",
        "the tie's float32 gradient sum across stages is not written yet",
        dict(schedule="2bw", d=2, w=1, precision="bf16", tied=True, weight_dtype="compute", structured=False),
    ),
    (
        ("precision", "weight_dtype"),
        lambda r: r["weight_dtype"] == "compute" and r["precision"] == "fp16",
        r"train.weight_dtype \(compute\) with train.precision \(fp16\)",
        "fp16 autocast runs layer norms in float32, which meet fp16 norm weights",
        dict(schedule="2bw", d=2, w=1, precision="fp16", tied=False, weight_dtype="compute"),
    ),
    (
        ("d", "w", "resume", "sharded", "muon"),
        lambda r: r["muon"] and r["sharded"] and (r["w"] > 1 or r["resume"] and RESUME_AT[(r["d"], r["w"])][1] > 1),
        r"optim.name \(muon\) with optim.sharded \(true\)",
        "Muon orthogonalizes whole matrices; sharding steps flat pieces",
        dict(schedule="2bw", d=1, w=2, sharded=True, muon=True),
    ),
    (
        ("muon", "lookahead"),
        lambda r: r["lookahead"] and not r["muon"],
        r"optim.delay_correction \(lookahead\) with optim.name \(sgd\)",
        "the look-ahead is Nesterov momentum in place of AdamW's and Muon's: defined for adamw and muon (with "
        "muon_others=adamw), not for the plain cells' SGD",
        dict(schedule="2bw", d=2, w=1, muon=False, lookahead=True, correction="none"),
    ),
    (
        ("precision", "weight_dtype", "muon"),
        lambda r: r["muon"] and r["weight_dtype"] == "compute" and r["precision"] == "bf16",
        r"train.weight_dtype \(compute\) steps pieces of every parameter",
        "versions in the compute dtype keep flat float32 masters, which need an elementwise optimizer",
        dict(schedule="2bw", d=2, w=1, precision="bf16", tied=False, weight_dtype="compute", muon=True),
    ),
    # swap.weights (config/validate.py _validate_weight_stream; ties: run/start.py check_weight_stream, which the
    # built model's ties need). Each example streams and breaks one of them (STREAMS: what a streamed cell keeps).
    (
        ("stream", "host_optim"),
        lambda r: r["stream"] and not r["host_optim"],
        r"swap.weights \(true\) with a streamed stage's optimizer steps where its weights live",
        "a streamed stage's optimizer steps where its weights live, on the host",
        dict(STREAMS, host_optim=False),
    ),
    (
        ("tied", "stream"),
        lambda r: r["stream"] and r["tied"],
        r"swap.weights \(true\) with tied weights .* on a streamed stage",
        "a tied weight would travel once per layer that uses it (refused when the run starts, from the model's ties)",
        dict(STREAMS, tied=True, structured=False),
    ),
    (
        ("swap", "stream", "zero_bubble"),
        lambda r: r["zero_bubble"] and (r["swap"] or r["stream"]),
        r"pipeline.schedule \(zb1p\) with swapping",
        "swapping moves a microbatch's saved tensors around its backward, which zb1p splits in two",
        dict(schedule="flush", d=2, w=1, swap=True, zero_bubble=True),
    ),
    (
        ("recompute", "zero_bubble"),
        lambda r: r["zero_bubble"] and r["recompute"],
        r"pipeline.schedule \(zb1p\) with recomputation",
        "the checkpoint's recomputation runs once per backward pass: B's and again W's",
        dict(schedule="flush", d=2, w=1, recompute=True, zero_bubble=True),
    ),
]

# pipeline.sync_warmup_steps and optim.delay_correction=predict keep to the plain weight versions (config/validate.py)
REFUSED += [
    (
        ("sync_warmup", "precision"),
        lambda r: r["sync_warmup"] and r["precision"] == "fp16",
        r"pipeline.sync_warmup_steps \(2\) with train.precision \(fp16\)",
        "the loss scaler's lag is 2bw's or flush's for a whole run",
        dict(schedule="2bw", d=2, w=1, precision="fp16", sync_warmup=True, stream=False, weight_dtype="fp32"),
    ),
    (
        ("sync_warmup", "host_optim"),
        lambda r: r["sync_warmup"] and r["host_optim"],
        r"pipeline.sync_warmup_steps \(2\) with swap.optimizer \(host\)",
        "the host step's versions keep 2bw's rule",
        dict(schedule="2bw", d=2, w=1, precision="fp32", sync_warmup=True, host_optim=True, stream=False),
    ),
    (
        ("d", "w", "resume", "sharded", "sync_warmup", "predict"),
        lambda r: (
            (r["sync_warmup"] or r["predict"])
            and r["sharded"]
            and (r["w"] > 1 or r["resume"] and RESUME_AT[(r["d"], r["w"])][1] > 1)
        ),
        r"(pipeline.sync_warmup_steps \(2\)|optim.delay_correction \(predict\)) with optim.sharded",
        "sharded versions keep 2bw's rule and hold no prediction",
        dict(schedule="2bw", d=1, w=2, resume=False, sharded=True, sync_warmup=True, muon=False, host_optim=False),
    ),
    (
        ("precision", "weight_dtype", "sync_warmup", "predict"),
        lambda r: (r["sync_warmup"] or r["predict"]) and r["weight_dtype"] == "compute" and r["precision"] == "bf16",
        r"(pipeline.sync_warmup_steps \(2\)|optim.delay_correction \(predict\)) with train.weight_dtype",
        "compute-dtype versions are rounded copies of float32 masters",
        dict(schedule="2bw", d=2, w=1, precision="bf16", tied=False, weight_dtype="compute", predict=True),
    ),
    (
        ("sync_warmup", "lookahead"),
        lambda r: r["sync_warmup"] and r["lookahead"],
        r"pipeline.sync_warmup_steps \(2\) with optim.delay_correction \(lookahead\)",
        "the look-ahead changes the optimizer for the whole run",
        dict(schedule="2bw", d=2, w=1, precision="fp32", muon=True, lookahead=True, sync_warmup=True),
    ),
    (
        ("predict", "host_optim"),
        lambda r: r["predict"] and r["host_optim"],
        r"optim.delay_correction \(predict\) with swap.optimizer \(host\)",
        "the host's masters are not the versions batches read",
        dict(schedule="2bw", d=2, w=1, precision="fp32", predict=True, host_optim=True, stream=False),
    ),
]

# data.packing=documents (config/validate.py _validate_documents): what packed documents are not proven with
DOCUMENTS = "data.packing=documents is proven with"
REFUSED += [
    (
        ("precision", "documents"),
        lambda r: r["documents"] and r["precision"] == "fp16",
        DOCUMENTS + r".* without train.precision=fp16",
        "fp16's loss scaling with the weighted loss is not proven",
        dict(schedule="2bw", d=2, w=1, precision="fp16", documents=True, weight_dtype="fp32"),
    ),
    (
        ("host_optim", "stream", "documents"),
        lambda r: r["documents"] and (r["host_optim"] or r["stream"]),
        DOCUMENTS + r".* without swap.weights/swap.optimizer",
        "the host optimizer and weight streaming are not proven with packed documents",
        dict(schedule="2bw", d=2, w=1, host_optim=True, stream=False, documents=True, sync_warmup=False),
    ),
    (
        ("structured", "documents"),
        lambda r: r["documents"] and r["structured"],
        DOCUMENTS + r".* without a layer list \(model=custom\)",
        "a layer list would have to take the positions",
        dict(schedule="2bw", d=2, w=1, structured=True, documents=True, weight_dtype="fp32"),
    ),
]

# pipeline.tensor_parallel > 1 (config/tensor_checks.py; the warm-up: config/validate.py): what a
# tensor split is not proven with
TENSOR = r"pipeline.tensor_parallel \(2\) "
REFUSED += [
    (
        ("structured", "t"),
        lambda r: r["t"] > 1 and r["structured"],
        TENSOR + r"splits the built-in GPT \(model=gpt\) and model=hf's Llama family only",
        "no plan says which of a layer list's matrices to split",
        dict(schedule="2bw", d=2, w=1, t=2, structured=True, tied=False, weight_dtype="fp32"),
    ),
    (
        ("host_optim", "stream", "t"),
        lambda r: r["t"] > 1 and (r["host_optim"] or r["stream"]),
        TENSOR + r"with swap.weights / swap.optimizer=host",
        "streaming tensor shards and stepping them on the host are not built",
        dict(schedule="2bw", d=2, w=1, t=2, host_optim=True, stream=False),
    ),
    (
        ("precision", "t"),
        lambda r: r["t"] > 1 and r["precision"] == "fp16",
        TENSOR + r"with train.precision \(fp16\)",
        "the loss scaler's skip is not proven on split blocks",
        dict(schedule="2bw", d=2, w=1, t=2, precision="fp16", weight_dtype="fp32"),
    ),
    (
        ("documents", "t"),
        lambda r: r["t"] > 1 and r["documents"],
        TENSOR + r"with data.packing \(documents\)",
        "packed documents are not proven at t > 1",
        dict(schedule="2bw", d=2, w=1, t=2, documents=True),
    ),
    (
        ("zero_bubble", "t"),
        lambda r: r["t"] > 1 and r["zero_bubble"],
        TENSOR + r"with pipeline.schedule \(zb1p\)",
        "zb1p's split backward is not proven on split blocks",
        dict(schedule="flush", d=2, w=1, t=2, zero_bubble=True),
    ),
    (
        ("t", "sync_warmup"),
        lambda r: r["t"] > 1 and r["sync_warmup"],
        r"pipeline.sync_warmup_steps \(2\) with pipeline.tensor_parallel \(2\)",
        "the warm-up is not proven with split stages (the prediction is: issue 46)",
        dict(schedule="2bw", d=2, w=1, t=2, sync_warmup=True),
    ),
]

# Rows every array holds (the generator fills their other factors): the combinations that once trained
# silently wrong, which a pairwise array need not contain (they are 3- and 4-way interactions).
PRESETS: List[Dict[str, Any]] = [
    # issue 21: 2bw + a weight tied across stages + w >= 2, without clipping or skip (a deferred step with
    # no agreement of its own): the step used one replica's un-averaged gradient
    dict(schedule="2bw", d=2, w=2, tied=True, clip=False, skip=False, precision="fp32", resume=False),
    # 2bw + a tie + validation at d >= 3, no agreement: only the tie's holders deferred APPLY(t), and a middle
    # stage's validation pass waited for the last stage, which first needed that stage's next activation
    dict(schedule="2bw", d=4, w=1, tied=True, validation=True, clip=False, skip=False, precision="fp32"),
]


# Cells run beside the arrays (test_matrix.test_extra_cells), as the arrays' cells are: ones that failed outside them.
EXTRA: List[Cell] = [
    # issue 32: fp16 + Muon + w = 2: the reference summed the 8 microbatch gradients in one run of float32 additions,
    # the replicas 4 + 4; W(1) differed by ~1e-7, fp16's forward at W(1) rounded a few activations the other way
    # and Muon's normalized step made that 4.1e-4 by step 6 (fp16's atol is 1e-4). The reference now sums as the
    # replicas do (reference_run's ``replicas``) and the run matches it to 7e-9.
    Cell(
        schedule="2bw", d=1, w=2, resume=True, swap=False, precision="fp16", tied=True, clip=False, skip=False,
        recompute=False, host_optim=False, validation=False, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, correction="error_feedback",
    ),
    # the look-ahead (FULL_ONLY) in the default tier: NAdamW and Muon across a resume from d2w1 to d1w2, fp16, a tie,
    # clipping and a skip
    Cell(
        schedule="2bw", d=2, w=1, resume=True, swap=False, precision="fp16", tied=True, clip=True, skip=True,
        recompute=False, host_optim=False, validation=False, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, lookahead=True,
    ),
    # pipeline.tensor_parallel=2 (issue 44; t is a factor of the arrays, pairwise): 2bw across a resume from d2w1 to
    # d1w2 with a weight tied across the first and last stage (the arrays' t = 2 cells tie across stages under gpipe
    # only), clipping, validation, Muon (whole matrices gathered over the tensor group; its momenta and error feedback's
    # state saved whole) and, since issue 46, Muon's default there: the prediction around error feedback ('auto'; P and
    # d saved whole too)
    Cell(
        schedule="2bw", d=2, w=1, resume=True, swap=False, precision="fp32", tied=True, clip=True, skip=False,
        recompute=False, host_optim=False, validation=True, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, correction="error_feedback", t=2, predict=True,
    ),
    # gpipe at d1w2, t = 2, with a tie, clipping, recomputation and the optimizer state sharded over the replicas
    # (ZeRO-1 of each tensor rank's pieces) in fp32
    Cell(
        schedule="gpipe", d=1, w=2, resume=False, swap=False, precision="fp32", tied=True, clip=True, skip=False,
        recompute=True, host_optim=False, validation=False, structured=False, sharded=True, weight_dtype="fp32", t=2,
    ),
    # issue 42: bf16 streamed versions (train.weight_dtype=compute with swap.weights) with float32 host masters, across
    # a resume from d2w1 to d1w2 (the streamed checkpoint's masters into two streamed replicas), clipping (the norm of
    # the float32 host sums) and validation through the bf16 copies; the arrays' pairs of it are fp32 or unstreamed
    Cell(
        schedule="2bw", d=2, w=1, resume=True, swap=False, precision="bf16", tied=False, clip=True, skip=False,
        recompute=False, host_optim=True, validation=True, structured=False, sharded=False, weight_dtype="compute",
        stream=True,
    ),
    # issue 46, EXTRA_ONLY: the synchronous warm-up with Muon and error feedback across a resume
    # from d2w2 to d4w1 after the switch, a tie, clipping, a skip and validation; the weight prediction with
    # dropout's tuple boundaries, recomputation, swapping and bf16 across a resume from d4w1 to d2w2
    Cell(
        schedule="2bw", d=2, w=2, resume=True, swap=False, precision="fp32", tied=True, clip=True, skip=True,
        recompute=False, host_optim=False, validation=True, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, correction="error_feedback", sync_warmup=True,
    ),
    Cell(
        schedule="2bw", d=4, w=1, resume=True, swap=True, precision="bf16", tied=False, clip=True, skip=True,
        recompute=True, host_optim=False, validation=True, structured=True, sharded=False, weight_dtype="fp32",
        predict=True,
    ),
    # issue 46, EXTRA_ONLY: zbv (2d chunks, rank r running r and 2d-1-r) with bf16 (every chunk boundary rounded, the
    # hand-off on rank d-1 too), the embedding and head tied on rank 0 (chunks 0 and 3), clipping and validation
    # through the V, across a resume from d2w1 to d1w2 (both chunks on one rank, whose reducer leaves the tie to its
    # last W's hook)
    Cell(
        schedule="flush", d=2, w=1, resume=True, swap=False, precision="bf16", tied=True, clip=True, skip=False,
        recompute=False, host_optim=False, validation=True, structured=False, sharded=False, weight_dtype="fp32",
        v=True,
    ),
    # the prediction around error feedback (optim.delay_correction=predict_error_feedback) with Muon across a resume
    Cell(
        schedule="2bw", d=2, w=1, resume=True, swap=False, precision="fp32", tied=False, clip=False, skip=False,
        recompute=False, host_optim=False, validation=True, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, correction="error_feedback", predict=True,
    ),
    # pipeline.weight_versions=newest with its prediction and Muon across a resume at another layout (the new layout's
    # rule from the checkpoint's batch on), from two stages to one and from one (whose checkpoint holds P(n) though
    # its stage ran no forward on it) to two, the second in bf16
    Cell(
        schedule="2bw", d=2, w=1, resume=True, swap=False, precision="fp32", tied=False, clip=False, skip=False,
        recompute=False, host_optim=False, validation=False, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, predict=True, newest=True,
    ),
    Cell(
        schedule="2bw", d=1, w=2, resume=True, swap=False, precision="bf16", tied=False, clip=False, skip=False,
        recompute=False, host_optim=False, validation=False, structured=False, sharded=False, weight_dtype="fp32",
        muon=True, predict=True, newest=True,
    ),
]  # fmt: skip


# Every rule a row must keep, as (its factors, whether a row keeps it): the constraints, and not being refused.
RULES: List[Tuple[Tuple[str, ...], Callable[[Dict[str, Any]], bool]]] = [(keys, ok) for keys, ok, _ in CONSTRAINTS] + [
    (keys, lambda r, f=f: not f(r)) for keys, f, *_ in REFUSED
]


# The rules that read each factor (``_extends``)
_RULES_OF: Dict[str, List[Tuple[Tuple[str, ...], Callable[[Dict[str, Any]], bool]]]] = {
    name: [(keys, ok) for keys, ok in RULES if name in keys] for name in FACTORS
}


def feasible(values: Dict[str, Any]) -> bool:
    """False when a (partial) row breaks a constraint or is refused whose factors it all holds."""
    return all(ok(values) for keys, ok in RULES if all(k in values for k in keys))


def refusal(cell: Cell) -> Optional[str]:
    """The pattern of the ConfigError that config validation must raise for ``cell``; None: it runs."""
    row = dataclasses.asdict(cell)
    return next((pattern for _, applies, pattern, *_ in REFUSED if applies(row)), None)


# Factors added after the arrays were first drawn, in order: each is laid over the arrays of the factors before it,
# whose cells stay as they were (the new factor at its plain value); the generator then adds the cells the new
# factor's combinations need. Adding a factor thus adds its own cells only, instead of redrawing every cell.
LAYERED = ("stream", "lookahead", "zero_bubble", "documents", "forward_lead", "t")
# Layered factors that only the 3-wise array (matrix_full) varies; the pairwise one holds them at their plain value, and
# EXTRA holds a cell of each. lookahead: its 4 pairwise cells cost the default tier ~40 s on this 2-core machine.
FULL_ONLY = ("lookahead",)
# Layered factors that both arrays cover pairwise only (issue 44: "the t factor's cells are pairwise, the rest
# 3-wise"): the 3-wise array lays them over its cells at strength 2, so they add a pairwise array's cells to it, not a
# 3-wise one's. t: a t = 2 cell runs twice the ranks on 2 cores. Kept last in LAYERED (a later layer would cover its
# triples)
PAIRWISE_ONLY = ("t",)
# Rows a layer starts from besides the arrays' (the generator fills their other factors). t: the pair (d = 4, t = 2)
# needs 8 ranks; held to one cell, without a resume (RESUME_AT would run d2w2 at t = 2: 8 ranks again), t's other pairs
# fit 4 ranks or fewer (left to the generator, its first pick of them ran three 8-rank runs: d2w2 resumed at d4w1, d4w1)
LAYER_PRESETS: Dict[str, List[Dict[str, Any]]] = {"t": [dict(t=2, d=4, w=1, resume=False)]}


def covering_array(strength: int) -> List[Cell]:
    """The ``strength``-wise covering array (covertable) of FACTORS under the constraints and
    refusals, PRESETS first: every feasible combination of values of any ``strength`` factors is in
    at least one cell. Deterministic: covertable's hash sorter with a fixed salt orders the candidates.
    Built in layers (``LAYERED``); below strength 3 without the FULL_ONLY factors (at their plain value); the
    PAIRWISE_ONLY factors laid over at strength 2 whatever ``strength``."""
    names = [n for n in FACTORS if n not in LAYERED]
    rows = _make(names, strength, PRESETS)
    for name in LAYERED:
        if strength < 3 and name in FULL_ONLY:
            continue
        names.append(name)
        layer_strength = min(strength, 2) if name in PAIRWISE_ONLY else strength
        presets = [{**row, name: FACTORS[name][0]} for row in rows] + LAYER_PRESETS.get(name, [])
        rows = _make(names, layer_strength, presets)
    return [Cell(**{name: row.get(name, FACTORS[name][0]) for name in FACTORS}) for row in rows]


def _make(names: Sequence[str], strength: int, presets: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """covertable's array over the factors ``names``, under the rules that read only those."""
    constraints = [
        {"operator": "fn", "requires": list(keys), "evaluate": ok} for keys, ok in RULES if set(keys) <= set(names)
    ]
    return covertable.make(
        {name: list(FACTORS[name]) for name in names},
        strength=strength,
        constraints=constraints,
        presets=list(presets),
        salt="pd2bw",
    )


def completes(values: Dict[str, Any]) -> bool:
    """Whether some full row of the product holding ``values`` passes ``feasible``: a search that fills the other
    factors in order and leaves a partial row as soon as a rule whose factors it holds fails."""
    return feasible(values) and _extends(values)


def _extends(values: Dict[str, Any]) -> bool:
    """``completes`` for a feasible ``values``: each value of the next factor checked against the rules that read
    it alone (the others held before: a quarter of the default tier's coverage test was this search's rule checks)."""
    name = next((n for n in FACTORS if n not in values), None)
    if name is None:
        return True
    for value in FACTORS[name]:
        row = {**values, name: value}
        if all(ok(row) for keys, ok in _RULES_OF[name] if all(k in row for k in keys)) and _extends(row):
            return True
    return False


def combined(strength: int) -> List[Tuple[int, ...]]:
    """The positions (in FACTORS) of the factor combinations an array of ``strength`` covers: every ``strength`` of
    them, except that a PAIRWISE_ONLY factor's are its pairs."""
    names = list(FACTORS)
    pairwise = {names.index(n) for n in PAIRWISE_ONLY}
    wide = [c for c in itertools.combinations(range(len(names)), strength) if strength <= 2 or not pairwise & set(c)]
    pairs = [c for c in itertools.combinations(range(len(names)), 2) if pairwise & set(c)] if strength > 2 else []
    return wide + pairs


def uncovered(cells: Sequence[Cell], strength: int) -> List[Dict[str, Any]]:
    """Feasible value combinations of the factors ``combined(strength)`` names that no cell holds (feasible: some full
    row of the product with those values passes ``feasible``: ``completes``). Below strength 3 the FULL_ONLY factors
    are held at their plain value."""
    names = list(FACTORS)
    held = {n: FACTORS[n][0] for n in FULL_ONLY} if strength < 3 else {}
    combos = combined(strength)
    covered = set()
    for cell in cells:
        row = [getattr(cell, n) for n in names]
        covered.update(tuple((i, row[i]) for i in positions) for positions in combos)
    missing = []
    for positions in combos:
        for values in itertools.product(*(FACTORS[names[i]] for i in positions)):
            combo = tuple(zip(positions, values))
            values = {names[i]: v for i, v in combo}
            if any(values.get(n, v) != v for n, v in held.items()):
                continue
            if combo not in covered and completes({**values, **held}):
                missing.append(combo)
    return [{names[i]: v for i, v in combo} for combo in sorted(missing, key=repr)]


# ---- configs -----------------------------------------------------------------------------------


def cell_config(cell: Cell, *, layout: Optional[Tuple[int, int]] = None, resume: str = "never") -> Config:
    """The run of ``cell`` at ``layout`` (d, w), by default the cell's own; (1, 1) is the reference's."""
    d, w = layout or (cell.d, cell.w)
    if cell.structured:
        model: Any = LayerListConfig(
            target="custom_models.masked_layers",
            kwargs={"width": WIDTH, "tie": cell.tied, "dropout": DROPOUT},
            seq_len=SEQ_LEN,
        )
    else:
        model = GPTConfig(num_layers=2, d_model=WIDTH, num_heads=2, seq_len=SEQ_LEN, tie_embeddings=cell.tied)
    c = 2 * d if cell.v else d  # zbv: 2d chunks
    balance = gpt_balance(model, c) if isinstance(model, GPTConfig) else even_balance(5, c)
    return Config(
        pipeline=PipelineConfig(
            schedule=cell.run_schedule,
            num_stages=d,
            data_parallel=w,
            tensor_parallel=1 if layout == (1, 1) else cell.t,  # (1, 1): the reference's
            num_microbatches=GLOBAL_BATCH // w,
            microbatch_size=1,
            balance=balance,
            recompute=cell.recompute,
            sync_warmup_steps=SYNC_WARMUP if cell.sync_warmup else 0,
            forward_lead=cell.forward_lead,
            weight_versions="newest" if cell.newest else "batch",
        ),
        model=model,
        # SGD with momentum: Adam blows reduction-order round-off on ~zero gradients up to lr-sized steps (LOOKAHEAD's
        # cells take AdamW's NAdamW for the parameters Muon does not step)
        optim=OptimConfig(
            **{
                **dict(
                    name="sgd",
                    lr=0.2,
                    kwargs={"momentum": 0.9},
                    scheduler="cosine",
                    warmup_steps=2,
                    min_lr=0.02,
                    clip_grad_norm=CLIP if cell.clip else None,
                    sharded=cell.sharded,
                    delay_correction=cell.correction,
                ),
                # muon: Muon (its own lr scaling, 'original') for the hidden matrices, the same SGD for the rest
                **(dict(name="muon", muon_others="sgd", muon_kwargs={"adjust_lr_fn": "original"}) if cell.muon else {}),
                **(LOOKAHEAD if cell.lookahead else {}),
                **(dict(delay_correction=PREDICT_CORRECTION[cell.correction]) if cell.predict else {}),
                # Muon's prediction around error feedback is the default's (issue 46): such a cell leaves it to 'auto',
                # which Config resolves to it where nothing refuses the prediction (config/corrections.py)
                **(dict(delay_correction="auto") if cell.muon and cell.predict and cell.correction != "none" else {}),
            }
        ),
        data=DataConfig(val_fraction=0.1 if cell.validation else 0.0, **(_short_documents() if cell.documents else {})),
        train=TrainConfig(
            num_steps=NUM_STEPS,
            log_every=100,
            warmup_steps=1,
            on_nonfinite="skip" if cell.skip else "stop",
            precision=cell.precision,
            weight_dtype=cell.weight_dtype,
            loss_scale=1024.0,  # the scale grows every 2 clean steps: it changes within the run
            loss_scale_growth_interval=2,
            checkpoint_every=RESUME_STEP if cell.resume and layout is None else 0,
            eval_every=EVAL_EVERY if cell.validation else 0,
            eval_batches=1,
            resume=resume,
        ),
        dist=DistConfig(timeout_s=60.0),
        wandb=WandbConfig(mode="disabled"),
        # stream without swap: every stage streams its weights (swap.enabled) and keeps all its microbatches'
        # activations (resident GLOBAL_BATCH: no swap manager)
        swap=SwapConfig(
            enabled=cell.swap or cell.stream,
            min_bytes=0,
            resident=GLOBAL_BATCH if cell.stream and not cell.swap else 0,
            optimizer="host" if cell.host_optim else "device",
            weights=cell.stream,
        ),
        seed=3,
    )


def _short_documents() -> Dict[str, Any]:
    """A documents cell's data section: 64 byte-level documents of 1 to 12 bytes (one in three a prompt/response
    pair), so that a row of SEQ_LEN slots holds several and the mask shows (the shipped example's documents are
    longer than a row: each piece would attend to itself alone). Written once, the same bytes every time."""
    path = Path(tempfile.gettempdir()) / "pd2bw-matrix-documents-v1.jsonl"
    if not path.exists():
        rng = random.Random(45)
        lines = []
        for i in range(64):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(1, 12)))
            cut = rng.randint(0, len(text))
            lines.append({"prompt": text[:cut], "response": text[cut:]} if i % 3 == 0 else {"text": text})
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        os.replace(tmp, path)
    return dict(path=str(path), packing="documents")


LOOKAHEAD_EPS = 1e-3  # NAdamW's eps in look-ahead cells (torch's 1e-8): see LOOKAHEAD
# A look-ahead cell's optimizer: Muon and NAdamW (optim.muon_others=adamw; the look-ahead sets beta1 and Muon's momentum
# to 0.99), lr 0.02 with Muon's 'match_rms_adamw' scaling (AdamW-sized steps for both). Adam divides by the root of its
# second moment, so a gradient that is zero but for round-off (a key's bias: softmax ignores it) steps by ~lr whatever
# its sign: the reason the plain cells use SGD. Measured (issue 32): 2bw-d2w1-fp16-tied-clip-skip-muon-lookahead-
# resume-d1w2 with eps 1e-8 ends 1.5e-3 from the reference at 2.qkv.bias (fp16's atol 1e-4); eps LOOKAHEAD_EPS, above
# that round-off and below the other gradients, keeps such steps round-off-sized (the biases then within 1e-4).
LOOKAHEAD: Dict[str, Any] = dict(
    muon_others="adamw",
    lr=0.02,
    min_lr=0.002,
    kwargs={"eps": LOOKAHEAD_EPS},
    muon_kwargs={"adjust_lr_fn": "match_rms_adamw"},
    delay_correction="lookahead",
)


class _InfOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, poison):
        ctx.poison = poison
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * math.inf if ctx.poison() else grad), None


def poisoned_layers(cfg: Config, *, call: Optional[int]) -> List[nn.Module]:
    """The model of ``cfg`` whose layer POISONED_LAYER passes an infinite gradient back on its
    ``call``-th backward (1-based; None: never). Counted in backward (recomputation runs forwards
    twice, validation forwards none), shared by both weight versions (a forward hook, so parameter
    names stay the model's)."""
    layers = model_source(cfg.model, seed=cfg.seed).build()
    calls = [0]

    def poison() -> bool:
        calls[0] += 1
        return calls[0] == call

    def hook(module, inputs, output):
        if isinstance(output, tuple):  # the hidden state; the mask carries no gradient
            return (_InfOnBackward.apply(output[0], poison), *output[1:])
        return _InfOnBackward.apply(output, poison)

    layers[POISONED_LAYER].register_forward_hook(hook)
    return layers


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of a cell in the shared ranks: its config, directory and where an inf goes (skip)."""

    cell_id: str
    cfg: Config
    run_dir: str
    poison_rank: Optional[int]  # the rank whose POISONED_LAYER gets the inf
    poison_call: Optional[int]  # ... on this backward call of it


def jobs_of(cell: Cell, root: Path) -> List[Job]:
    """The runs of ``cell``: one, or the first half (checkpoint at RESUME_STEP) and the resumed run."""
    jobs = []
    for i, layout in enumerate(cell.layouts()):
        run_dir = root / cell.id / f"run{i}"
        cfg = cell_config(cell, layout=None if i == 0 else layout)
        if i == 1:
            cfg = cell_config(
                cell, layout=layout, resume=str(root / cell.id / "run0" / "checkpoints" / f"step_{RESUME_STEP:08d}")
            )
        rank = call = None
        if cell.skip:  # the last replica of the stage holding the poisoned layer, first microbatch of SKIP_BATCH
            d, w = layout
            stage = next(s for s in range(d) if sum(cfg.pipeline.balance[: s + 1]) > POISONED_LAYER)
            rank = make_layout(d, w, ranks_per_node=d * w * cell.t, tensor_parallel=cell.t).ranks[stage][w - 1]
            first_step = RESUME_STEP if i == 1 else 0
            call = (SKIP_BATCH - first_step) * cfg.pipeline.num_microbatches + 1
        jobs.append(Job(cell.id, cfg, str(run_dir), rank, call))
    return jobs


def run_jobs(jobs: Sequence[Job]) -> None:
    """On every rank: the jobs one after another, sharing the ranks and one rendezvous store (runner.run
    makes and tears down each job's process groups). The first failure ends this rank (and, through the
    failure monitor, the others): the caller re-spawns for the jobs after it."""
    rank, world_size, _ = comm.env_rank()
    store = comm.make_store(rank=rank, world_size=world_size, timeout_s=60)
    for job in jobs:
        print(f"=== job {job.cell_id} {Path(job.run_dir).name}", flush=True)
        layers = None
        if job.poison_call is not None:
            layers = poisoned_layers(job.cfg, call=job.poison_call if rank == job.poison_rank else None)
        run(job.cfg, Path(job.run_dir), layers=layers, store=store)


@dataclasses.dataclass
class CellRuns:
    """What a cell's runs left: per run, summary.json and final_model.pt; or the failure's logs."""

    summaries: List[Dict[str, Any]]
    weights: List[Dict[str, torch.Tensor]]
    error: Optional[str] = None


class MatrixRunner:
    """Runs cells in groups that share one spawn of ranks: all pending cells with the same number of
    ranks, in order, their jobs one after another (``run_jobs``). A job that fails ends its spawn; the
    cells after it are run by a new spawn, so one failing cell costs the others nothing but time."""

    def __init__(self, root: Path, cells: Sequence[Cell]):
        self.root, self.cells = Path(root), list(cells)
        self.results: Dict[str, CellRuns] = {}
        self.group_s: Dict[int, float] = {}  # world size -> wall time of its spawns

    def result(self, cell: Cell) -> CellRuns:
        if cell.id not in self.results:
            group = [c for c in self.cells if c.world_size == cell.world_size and c.id not in self.results]
            if cell not in group:
                group.append(cell)
            start = time.monotonic()
            self._run_group(group)
            self.group_s[cell.world_size] = self.group_s.get(cell.world_size, 0.0) + time.monotonic() - start
        return self.results[cell.id]

    def _run_group(self, cells: List[Cell]) -> None:
        while cells:
            jobs = [job for cell in cells for job in jobs_of(cell, self.root)]
            log_dir = self.root / "logs" / f"{cells[0].id}"
            results = spawn(
                run_jobs,
                world_size=cells[0].world_size,
                args=(jobs,),
                log_dir=log_dir,
                timeout_s=60 + 30 * len(jobs),
            )
            logs = {r.rank: r.log for r in results}
            rest = []
            for i, cell in enumerate(cells):
                runs = [j for j in jobs if j.cell_id == cell.id]
                done = [Path(j.run_dir, "summary.json").exists() for j in runs]
                if all(done):
                    self.results[cell.id] = CellRuns(
                        summaries=[json.loads(Path(j.run_dir, "summary.json").read_text()) for j in runs],
                        weights=[torch.load(Path(j.run_dir, "final_model.pt")) for j in runs],
                    )
                    continue
                self.results[cell.id] = CellRuns([], [], error=_failure(cell.id, logs, results))
                rest = cells[i + 1 :]
                break
            cells = rest


def _failure(cell_id: str, logs: Dict[int, str], results) -> str:
    """Each rank's exit code and its log from the failing cell's first job on."""
    out = []
    for r in results:
        text = r.log
        at = text.find(f"=== job {cell_id} ")
        out.append(f"--- rank {r.rank} exit {r.exitcode}\n{text[at if at >= 0 else 0 :][-6000:]}")
    return "\n".join(out)


def error_line(error: str) -> str:
    """The first line naming an exception in a failure's logs, for a short report."""
    for pattern in (r"failed: [^\n]+", r"\w+(Error|Exception): [^\n]+"):
        m = re.search(pattern, error)
        if m:
            return m.group(0)[:300]
    return error.strip().splitlines()[-1][:300] if error.strip() else "(no log)"
