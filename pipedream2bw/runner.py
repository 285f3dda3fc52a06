"""One rank's training run: validate, start the groups, build the stage, run its schedule, save results."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import nn

from pipedream2bw import comm
from pipedream2bw.config import Config, build_optimizer, swap_stages, validate
from pipedream2bw.data import MicrobatchFeed, load_bytes
from pipedream2bw.models import build_gpt_layers, lm_loss
from pipedream2bw.results import save_state_dict, summarize, write_summary
from pipedream2bw.schedule import check_stage, stage_actions
from pipedream2bw.layout import Layout, make_layout
from pipedream2bw.host_optim import HostOptimizerVersions
from pipedream2bw.stage import Peers, StageWorker
from pipedream2bw.swap import SwapManager, make_backend
from pipedream2bw.tracking import Tracker
from pipedream2bw.versions import WeightVersions, bucketize

log = logging.getLogger(__name__)


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


def build_stage_module(cfg: Config, balance: Sequence[int], stage_index: int, layers: Optional[Sequence[nn.Module]]) -> nn.Sequential:
    """This stage's contiguous slice of the layer list, keyed by global layer index.

    Keys are the layers' positions in the whole list, so parameter names match those of
    ``nn.Sequential(*all_layers)``: a stage's state_dict is a slice of the full model's.
    """
    start = sum(balance[:stage_index])
    indices = range(start, start + balance[stage_index])
    own = [layers[i] for i in indices] if layers is not None else build_gpt_layers(cfg.model, seed=cfg.seed, indices=indices)
    return nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(indices, own)))


def run(
    cfg: Config,
    run_dir: Path,
    *,
    layers: Optional[Sequence[nn.Module]] = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    store: Optional[Any] = None,
) -> Optional[Dict[str, Any]]:
    """Trains this rank's stage; on rank 0, writes and returns the summary.

    Args:
        cfg: the run's config (validated here, before any process group starts).
        run_dir: directory shared by all ranks for summary.json and final_model.pt.
        layers: the whole model as a list of layers (any ``nn.Sequential``'s children);
            by default the GPT that ``cfg.model`` describes, of which each rank builds only
            its own slice.
        loss_fn: (last stage output, targets) -> scalar loss of a microbatch.
        store: rendezvous store already connected (the entry point's); made here if None.

    Raises:
        ConfigError: bad config, before any process group starts.
        comm.PeerFailure: another rank failed first.
    """
    rank, world_size, local_rank = comm.env_rank()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    set_log_prefix(f"[rank {rank}]")
    balance = validate(cfg, world_size=world_size, num_layers=None if layers is None else len(layers), local_world_size=local_world_size)
    layout = make_layout(cfg.pipeline.num_stages, cfg.pipeline.data_parallel, ranks_per_node=local_world_size, rank_map=cfg.pipeline.rank_map)
    set_log_prefix(f"[stage {layout.position(rank)[0]}/rank {rank}]")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if store is None:
        store = comm.make_store(rank=rank, world_size=world_size, timeout_s=cfg.dist.timeout_s)
    ctx = comm.init(store=store, rank=rank, world_size=world_size, local_rank=local_rank, backend=cfg.dist.backend, timeout_s=cfg.dist.timeout_s)
    try:
        summary = _train(cfg, run_dir, ctx, layout, balance, layers, loss_fn)
    except BaseException as e:
        first = ctx.monitor.report(layout.position(rank)[0], e)
        failed_here = first.startswith(f"rank {rank} ")
        if failed_here:
            log.error("%s", first, exc_info=True)
        else:
            log.error("stopping because %s (here: %s: %s)", first, type(e).__name__, e)
        ctx.monitor.leave()
        ctx.monitor.stop()  # this rank is out: its caller decides what happens next
        if failed_here:
            raise
        raise comm.PeerFailure(first) from e
    comm.shutdown(ctx)
    return summary


def _train(cfg: Config, run_dir: Path, ctx: comm.DistContext, layout: Layout, balance, layers, loss_fn) -> Optional[Dict[str, Any]]:
    p = cfg.pipeline
    d, w, m, b = p.num_stages, p.data_parallel, p.num_microbatches, p.microbatch_size
    global_batch = w * m * b
    s, replica = layout.position(ctx.rank)
    torch.manual_seed(cfg.seed)
    module = build_stage_module(cfg, balance, s, layers).to(ctx.device)
    buckets = bucketize(list(module.parameters()), bucket_bytes=p.bucket_mb * 2**20)
    versions = (HostOptimizerVersions if cfg.swap.optimizer == "host" else WeightVersions)(
        module, schedule=p.schedule, optimizer_factory=lambda params: build_optimizer(params, cfg.optim), buckets=buckets,
    )
    reducer = None
    if w > 1:  # every rank makes every stage's group, in the same order
        group = comm.new_groups(ctx, layout.ranks)[s]
        reducer = comm.GradReducer(ctx, group=group, replicas=[list(r.parameters()) for r in versions.replicas], buckets=buckets)
    peers = Peers(
        prev=layout.ranks[s - 1][replica] if s > 0 else None,
        next=layout.ranks[s + 1][replica] if s < d - 1 else None,
        loss_sources=tuple(layout.ranks[d - 1]) if ctx.rank == 0 else (),
    )
    feed = MicrobatchFeed(
        load_bytes(cfg.data.path), seq_len=cfg.model.seq_len, microbatch_size=b, num_microbatches=m, seed=cfg.seed,
        num_replicas=w, replica=replica,
    )
    in_flight_limit = m if p.schedule == "gpipe" else d - s
    swap = _swap_manager(cfg, s, min(in_flight_limit, m), versions, ctx.device)
    worker = StageWorker(
        stage_index=s, num_stages=d, num_microbatches=m, peers=peers, versions=versions, feed=feed,
        p2p=comm.P2P(ctx, batch_sends=cfg.dist.batch_p2p if cfg.dist.batch_p2p is not None else ctx.backend == "nccl"),
        loss_fn=loss_fn, device=ctx.device, reducer=reducer, grad_scale=1.0 / (m * w), swap=swap,
    )
    actions = stage_actions(p.schedule, stage_index=s, num_stages=d, num_microbatches=m, num_batches=cfg.train.num_steps)
    check_stage(actions, num_microbatches=m, in_flight_limit=in_flight_limit)
    log.info(
        "%s schedule, %d stages x %d replicas, replica %d, balance %s, layers %s, %d all-reduce buckets, on %s (%s)",
        p.schedule, d, w, replica, balance, list(module._modules), len(buckets), ctx.device, ctx.backend,
    )
    tracker = Tracker(cfg, run_dir) if ctx.rank == 0 else None
    on_step = _progress(cfg, worker, tracker, samples_per_step=global_batch) if ctx.rank == 0 else (lambda t: None)
    stats = worker.run(actions, on_step=on_step)
    stats.replica = replica
    if reducer is not None:
        stats.allreduce_calls, stats.allreduce_exposed_s = reducer.num_collectives, reducer.exposed_s

    all_stats = comm.gather_to_rank0(ctx, stats)
    # Replicas hold equal weights: replica 0 of each stage contributes its slice of the model.
    shard = {k: v.detach().cpu() for k, v in versions.newest().state_dict().items()} if replica == 0 else {}
    shards = comm.gather_to_rank0(ctx, shard)
    if ctx.rank != 0:
        return None
    meta = {
        "schedule": p.schedule, "num_stages": d, "data_parallel": w, "num_microbatches": m, "microbatch_size": b,
        "global_batch_size": global_batch, "balance": balance, "rank_map": [list(r) for r in layout.ranks],
        "num_steps": cfg.train.num_steps, "seq_len": cfg.model.seq_len, "backend": ctx.backend, "device": ctx.device.type,
        "memory_kind": "cuda_max_allocated" if ctx.device.type == "cuda" else "process_peak_rss",
    }
    summary = summarize(all_stats, meta=meta, warmup_steps=cfg.train.warmup_steps, samples_per_step=global_batch, seq_len=cfg.model.seq_len)
    write_summary(summary, run_dir)
    save_state_dict({k: v for shard in shards for k, v in shard.items()}, run_dir / "final_model.pt")
    tracker.finish(summary)
    log.info(
        "done: loss %.4f -> %.4f, %.1f samples/s, %.0f tokens/s; results in %s",
        summary["losses"][0], summary["final_loss"], summary["samples_per_s"], summary["tokens_per_s"], run_dir,
    )
    return summary


def _swap_manager(cfg: Config, s: int, in_flight: int, versions: WeightVersions, device: torch.device) -> Optional[SwapManager]:
    """Stage ``s``'s activation swapper, if ``cfg.swap`` selects it and it can help."""
    if s not in swap_stages(cfg.swap, cfg.pipeline.num_stages):
        return None
    if in_flight <= cfg.swap.resident + 1:
        log.warning(
            "swap: stage %d has at most %d microbatch(es) in flight and swap.resident=%d keeps %d of them besides the "
            "one computing: nothing to swap, so it does not", s, in_flight, cfg.swap.resident, cfg.swap.resident)
        return None
    held = [t for r in versions.replicas for t in (*r.parameters(), *r.buffers())]  # never swapped
    log.info("swap: activations of waiting microbatches >= %d bytes to host, %d kept on the device", cfg.swap.min_bytes, cfg.swap.resident)
    return SwapManager(make_backend(device), min_bytes=cfg.swap.min_bytes, resident=cfg.swap.resident, exclude=held)


def _progress(cfg: Config, worker: StageWorker, tracker: "Tracker", *, samples_per_step: int) -> Callable[[int], None]:
    """Rank 0's per-step callback: log loss and throughput every ``train.log_every`` steps."""
    window = {"start": time.perf_counter(), "steps": 0}

    def on_step(t: int) -> None:
        window["steps"] += 1
        loss = worker.stats.losses[-1]
        tracker.log({"loss": loss}, step=t)
        if (t + 1) % cfg.train.log_every and t + 1 != cfg.train.num_steps:
            return
        now = time.perf_counter()
        rate = window["steps"] * samples_per_step / (now - window["start"])
        window.update(start=now, steps=0)
        tracker.log({"samples_per_s": rate, "tokens_per_s": rate * cfg.model.seq_len}, step=t)
        log.info("step %d/%d loss %.4f %.1f samples/s %.0f tokens/s", t + 1, cfg.train.num_steps, loss, rate, rate * cfg.model.seq_len)

    return on_step

