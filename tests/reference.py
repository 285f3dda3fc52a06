"""Single-process oracles: the 2BW update rule, plain minibatch training and validation, on the whole model."""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
from torch import nn

from pipedream2bw.config import Config, build_optimizer
from pipedream2bw.data import VALIDATION, MicrobatchFeed, load_splits
from pipedream2bw.models import build_gpt_layers, lm_loss


def reference_train(cfg: Config, *, delayed: bool) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """Trains the unpartitioned model for ``cfg.train.num_steps`` batches.

    delayed=True applies the 2BW rule: g(t) is the mean gradient over batch t at W(t-1),
    W(-1) = W(0), and W(t+1) = W(t) - optimizer_step(g(t)). delayed=False is plain
    minibatch training: g(t) at W(t).

    Returns:
        (final state_dict, mean loss of each batch).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: Adam turns reduction-order noise in ~zero gradients into lr-sized steps
    try:
        return _train(cfg, delayed=delayed)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: Config, *, delayed: bool) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    torch.manual_seed(cfg.seed)
    m = cfg.pipeline.num_microbatches
    model = nn.Sequential(*build_gpt_layers(cfg.model, seed=cfg.seed))  # W(t)
    stale = copy.deepcopy(model) if delayed else model  # W(t-1): the weights batch t runs with
    opt = build_optimizer(model.parameters(), cfg.optim)
    feed = MicrobatchFeed(
        load_splits(cfg.data)[0], seq_len=cfg.model.seq_len, microbatch_size=cfg.pipeline.microbatch_size,
        num_microbatches=m, seed=cfg.seed,
    )
    losses = []
    for t in range(cfg.train.num_steps):
        stale.zero_grad(set_to_none=True)
        batch_losses = []
        for j in range(m):
            x, y = feed.microbatch(t * m + j)
            loss = lm_loss(stale(x), y)
            loss.backward()
            batch_losses.append(loss.detach())
        losses.append(float(torch.stack(batch_losses).mean()))
        grads = [None if p.grad is None else p.grad / m for p in stale.parameters()]
        if delayed:
            stale.load_state_dict(model.state_dict())  # batch t+1 runs with W(t)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return model.state_dict(), losses


def reference_eval(cfg: Config, weights: Dict[str, torch.Tensor]) -> float:
    """The validation loss of ``weights`` in one process: the mean microbatch loss over the
    ``train.eval_batches`` global batches of held-out windows that the pipeline evaluates."""
    p = cfg.pipeline
    model = nn.Sequential(*build_gpt_layers(cfg.model, seed=cfg.seed))
    model.load_state_dict(weights)
    model.eval()
    # One replica of w*m microbatches draws the same windows, in the same order, as w replicas of m.
    feed = MicrobatchFeed(
        load_splits(cfg.data)[1], seq_len=cfg.model.seq_len, microbatch_size=p.microbatch_size,
        num_microbatches=p.data_parallel * p.num_microbatches, seed=cfg.seed, stream=VALIDATION,
    )
    with torch.no_grad():
        losses = [lm_loss(model(x), y) for x, y in map(feed.microbatch, range(cfg.train.eval_batches * p.data_parallel * p.num_microbatches))]
    return float(torch.stack(losses).mean())
