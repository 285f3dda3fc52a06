"""Single-process oracles: the 2BW update rule and plain minibatch training, on the whole model."""

from __future__ import annotations

import copy
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw.config import Config, build_optimizer
from pipedream2bw.data import MicrobatchFeed, load_bytes
from pipedream2bw.lr_schedule import lr_at
from pipedream2bw.models.factory import model_source


class Reference(NamedTuple):
    weights: Dict[str, torch.Tensor]  # final state_dict
    losses: List[float]  # mean loss of each batch
    lrs: List[float]  # learning rate of each step
    grad_norms: List[float]  # global norm of g(t) before clipping, as clip_grad_norm_ returns it
    skipped_steps: List[int]  # steps with a non-finite loss or gradient, not taken


def reference_train(cfg: Config, *, delayed: bool) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """``reference_run``'s final weights and losses."""
    ref = reference_run(cfg, delayed=delayed)
    return ref.weights, ref.losses


def reference_run(cfg: Config, *, delayed: bool, layers: Optional[Sequence[nn.Module]] = None) -> Reference:
    """Trains the unpartitioned model (``layers``, by default the GPT of ``cfg.model``) for
    ``cfg.train.num_steps`` batches.

    delayed=True applies the 2BW rule: g(t) is the mean gradient over batch t at W(t-1),
    W(-1) = W(0), and W(t+1) = W(t) - optimizer_step(g(t)). delayed=False is plain
    minibatch training: g(t) at W(t). Step t uses ``lr_at(t)``; with ``optim.clip_grad_norm``,
    g(t) is clipped by ``torch.nn.utils.clip_grad_norm_`` over the whole model; a batch whose loss
    or gradient is not finite is skipped (W(t+1) = W(t)), as train.on_nonfinite=skip does.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: Adam turns reduction-order noise in ~zero gradients into lr-sized steps
    try:
        return _train(cfg, delayed=delayed, layers=layers)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: Config, *, delayed: bool, layers: Optional[Sequence[nn.Module]]) -> Reference:
    torch.manual_seed(cfg.seed)
    m = cfg.pipeline.num_microbatches
    source = model_source(cfg.model, seed=cfg.seed)  # the GPT, or a factory's layers (tied ones stay tied)
    model = nn.Sequential(*(layers if layers is not None else source.build()))  # W(t)
    lm_loss = source.loss_fn
    stale = copy.deepcopy(model) if delayed else model  # W(t-1): the weights batch t runs with
    opt = build_optimizer(model.parameters(), cfg.optim)
    feed = MicrobatchFeed(
        load_bytes(cfg.data.path), seq_len=cfg.model.seq_len, microbatch_size=cfg.pipeline.microbatch_size,
        num_microbatches=m, seed=cfg.seed,
    )
    out = Reference(None, [], [], [], [])
    for t in range(cfg.train.num_steps):
        stale.zero_grad(set_to_none=True)
        batch_losses = []
        for j in range(m):
            x, y = feed.microbatch(t * m + j)
            loss = lm_loss(stale(x), y)
            loss.backward()
            batch_losses.append(loss.detach())
        out.losses.append(float(torch.stack(batch_losses).mean()))
        out.lrs.append(lr_at(t, cfg.optim, num_steps=cfg.train.num_steps))
        grads = [None if p.grad is None else p.grad / m for p in stale.parameters()]
        if delayed:
            stale.load_state_dict(model.state_dict())  # batch t+1 runs with W(t)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))  # the norm only: nothing clipped
        out.grad_norms.append(norm)
        if not math.isfinite(out.losses[-1]) or not math.isfinite(norm):
            out.skipped_steps.append(t)
            continue
        if cfg.optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
        for group in opt.param_groups:
            group["lr"] = out.lrs[-1]
        opt.step()
    return out._replace(weights=model.state_dict())
