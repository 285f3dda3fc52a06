"""What a run logs: the record prefix, logging for a programmatic run, the settings and sizes at its start."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from torch import nn

from pipedream2bw.config import (
    Config,
    optimizer_name,
)
from pipedream2bw.config.optimizers import correction_in_effect, is_muon, muon_edge_layers, muon_param_roles
from pipedream2bw.run.model import RunModel
from pipedream2bw.run.runtime import RankPlan

log = logging.getLogger(__name__)


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""Hydra's default job-logging format, which the CLI's train.log and console use."""


_log_prefix = ""


def set_log_prefix(prefix: str) -> None:
    """Prefixes every later log record of this process with ``prefix`` (e.g. ``[stage s/rank r]``)."""
    global _log_prefix
    if not _log_prefix:
        base = logging.getLogRecordFactory()

        def factory(*args, **kwargs):
            record = base(*args, **kwargs)
            if isinstance(record.msg, str):
                record.msg = _log_prefix + record.msg
            return record

        logging.setLogRecordFactory(factory)
    _log_prefix = prefix + " "


RUN_WIDE = ("pipedream2bw.config", "pipedream2bw.data")
"""Loggers whose warnings read the same on every rank (the config's, the data's): rank 0 alone logs them."""


def quiet_ranks(rank: int) -> None:
    """One warning per run, not per rank: on ranks other than 0 the run-wide loggers log errors only."""
    if rank != 0:
        for name in RUN_WIDE:
            logging.getLogger(name).setLevel(logging.ERROR)


def configure_logging(run_dir: Path) -> None:
    """Logs as the CLI does when the caller configured no logging (a programmatic ``run()``):
    INFO and up to stderr and to ``<run_dir>/train.log``, in Hydra's format. Leaves logging
    alone if the root logger has a handler already (Hydra's, or the caller's own)."""
    root = logging.getLogger()
    if root.handlers:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter(LOG_FORMAT)
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(run_dir / "train.log")):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


def log_start(rt: RankPlan, num_dp_buckets: int, tie_groups) -> None:
    """Logs what this rank runs, and the ties it holds."""
    log.info(
        "%s schedule, %s x %s, replica %d, balance %s, layers %s, %s, on %s (%s), precision %s",
        rt.schedule,
        _plural(rt.num_stages, "stage"),
        _plural(rt.data_parallel, "replica"),
        rt.replica,
        list(rt.balance),
        rt.layer_indices,
        _plural(num_dp_buckets, "all-reduce bucket"),
        rt.device,
        rt.backend,
        rt.precision,
    )
    for _, _, held in tie_groups:
        for tie, _ in held:
            log.info(
                "tied across stages %s: %s; gradients summed over its holders",
                rt.tie_holders(tie),
                ", ".join(tie.names),
            )


def format_duration(seconds: float) -> str:
    """``3725.0`` -> ``'1h02m'``, ``83.0`` -> ``'1m23s'``, ``7.2`` -> ``'7s'``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def log_run(rt: RankPlan, cfg: Config, model: RunModel, feed: Any, val_feed: Any) -> None:
    """Rank 0: the settings that matter, the parameters per stage and the data's size, at the start of the log."""
    o = cfg.optim
    sched = o.scheduler + (f", {o.warmup_steps} warm-up steps" if o.warmup_steps else "")
    correction = correction_in_effect(o, rt.schedule)
    log.info(
        "run: %s schedule, %s x %s (d=%d, w=%d), m=%d microbatches of b=%d sequences of %d tokens "
        "(global batch %d sequences, %d tokens), %s steps",
        rt.schedule,
        _plural(rt.num_stages, "stage"),
        _plural(rt.data_parallel, "replica"),
        rt.num_stages,
        rt.data_parallel,
        rt.num_microbatches,
        rt.microbatch_size,
        rt.seq_len,
        rt.global_batch,
        rt.global_batch * rt.seq_len,
        rt.num_steps if not rt.first_step else f"{rt.first_step}..{rt.num_steps}",
    )
    log.info(  # a line of its own: the header was one line of 310 characters (issue 43)
        "training: precision %s, optimizer %s lr %.4g (%s)%s%s",
        rt.precision,
        optimizer_name(o),
        o.lr,
        sched,
        f", clip {o.clip_grad_norm}" if o.clip_grad_norm is not None else "",
        f", delay correction {correction}" if rt.schedule == "2bw" else "",  # none said too: 'auto' chose it
    )
    if rt.sync_warmup_steps:
        log.info("pipeline.sync_warmup_steps: steps 0..%d run as flush (no delay), then 2bw", rt.sync_warmup_steps - 1)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.whole()]
    bounds = [sum(rt.balance[:s]) for s in range(len(rt.balance) + 1)]  # zbv: 2d chunks
    per_stage = [sum(per_layer[a:b]) for a, b in zip(bounds, bounds[1:])]
    whole = sum(p.numel() for p in nn.Sequential(*model.whole()).parameters())  # a tied weight counts once
    log.info(
        "parameters: %s in all; per %s: %s",
        f"{whole:,}",
        "stage" if len(rt.balance) == rt.num_stages else "chunk (zbv: rank r runs chunks r and 2d-1-r)",
        ", ".join(f"{s}: {n:,} (layers {a}-{b - 1})" for s, (n, a, b) in enumerate(zip(per_stage, bounds, bounds[1:]))),
    )
    if rt.precision == "bf16" and rt.device.type == "cpu" and not native_bf16_cpu():
        log.warning(
            "train.precision=bf16 on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16): torch emulates it, "
            "often 10-100x slower than fp32 (bench_precision.py measured 0.76 against 71 samples/s); use fp32 here"
        )
    if is_muon(o):
        log.info("optimizer per stage (parameters each steps): %s", _muon_split(model, o, bounds))
    if feed is None:  # rank 0 is not a first or last stage (a custom rank_map): its data is not opened here
        return
    if hasattr(feed, "docs"):  # data.packing=documents
        return _log_documents(rt, cfg, feed, val_feed)
    num_train = len(feed.data)
    epochs = rt.num_steps * rt.global_batch * rt.seq_len / num_train
    val = f", {len(val_feed.data):,} held out for validation" if val_feed is not None else ", no validation data"
    log.info(
        "data: %s, %s tokens to train on%s; %d steps read %s tokens (%.2f epochs)",
        cfg.data.path or "the shipped corpus (bytes)",
        f"{num_train:,}",
        val,
        rt.num_steps,
        f"{rt.num_steps * rt.global_batch * rt.seq_len:,}",
        epochs,
    )


def _log_documents(rt: RankPlan, cfg: Config, feed: Any, val_feed: Any) -> None:
    """``log_run``'s data line for packed documents: documents, not tokens, are what is split and read."""
    index = feed.docs.index
    val = f", {len(val_feed.docs):,} held out for validation" if val_feed is not None else ", no validation data"
    log.info(
        "data: %s, %s documents (%s tokens) to train on%s, packed into rows of %d; %d steps read %s rows",
        cfg.data.path or "the shipped example documents (bytes)",
        f"{len(index):,}",
        f"{int((index[:, 1] - index[:, 0]).sum()):,}",
        val,
        rt.seq_len,
        rt.num_steps,
        f"{rt.num_steps * rt.global_batch:,}",
    )


def native_bf16_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 natively (an x86 avx512_bf16 or amx_bf16 flag); True where it cannot tell
    (no /proc/cpuinfo, or not x86): no warning on a guess."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return True
    flags = set(text.split())
    return "avx2" not in flags or bool(flags & {"avx512_bf16", "amx_bf16"})


def _muon_split(model: RunModel, optim, bounds) -> str:
    """Per stage, how many parameters Muon steps and how many ``optim.muon_others`` does, as the stages tag them."""
    whole = nn.Sequential(*model.whole())
    roles = muon_param_roles(whole, optim.muon_exclude, edge_layers=muon_edge_layers(len(whole)))
    parts = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        params = [p for i in range(a, b) for p in whole[i].parameters()]
        muon = sum(p.numel() for p in params if roles[id(p)])
        others = sum(p.numel() for p in params) - muon
        parts.append(f"{s}: muon {muon:,}, {optim.muon_others} {others:,}")
    return "; ".join(parts)


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name
