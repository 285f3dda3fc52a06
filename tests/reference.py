"""Single-process oracles: the 2BW update rule and plain minibatch training, on the whole model."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from pipedream2bw import precision as precisions
from pipedream2bw.config import Config, build_optimizer
from pipedream2bw.data import MicrobatchFeed, load_bytes
from pipedream2bw.loss_scale import LossScaler
from pipedream2bw.models import build_gpt_layers, lm_loss


class StageBoundaries(nn.Sequential):
    """The whole model in one process, with the activation rounded to ``dtype`` and back after the
    layers ``after`` (a pipeline's p2p transfers in the compute dtype); float32 rounds nothing."""

    def __init__(self, layers: Sequence[nn.Module], *, after: Sequence[int], dtype: torch.dtype):
        super().__init__(*layers)
        self.after, self.dtype = set(after), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self):
            x = layer(x)
            if i in self.after and x.dtype == torch.float32 and self.dtype != torch.float32:
                x = x.to(self.dtype).float()
        return x


def reference_train(cfg: Config, *, delayed: bool, balance: Sequence[int] = (), layers: Optional[Sequence[nn.Module]] = None,
                    info: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """Trains the unpartitioned model for ``cfg.train.num_steps`` batches.

    delayed=True applies the 2BW rule: g(t) is the mean gradient over batch t at W(t-1),
    W(-1) = W(0), and W(t+1) = W(t) - optimizer_step(g(t)). delayed=False is plain
    minibatch training: g(t) at W(t).

    Under ``cfg.train.precision`` bf16/fp16 it is a plain autocast loop (float32 weights, forward
    under autocast, loss in float32) whose activations are rounded to the compute dtype where a
    pipeline of ``balance`` sends them. fp16 scales the loss (``LossScaler``) and skips the step of
    a batch with a non-finite gradient: W(t+1) = W(t). ``layers`` replaces the GPT; ``info``
    receives ``loss_scales`` and ``skipped_steps``.

    Returns:
        (final state_dict, mean loss of each batch).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: Adam turns reduction-order noise in ~zero gradients into lr-sized steps
    try:
        return _train(cfg, delayed=delayed, balance=balance, layers=layers, info=info if info is not None else {})
    finally:
        torch.set_num_threads(threads)


def _train(cfg: Config, *, delayed: bool, balance, layers, info) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    torch.manual_seed(cfg.seed)
    m = cfg.pipeline.num_microbatches
    precision = precisions.resolve(cfg.train.precision, "cpu")
    after = [sum(balance[: s + 1]) - 1 for s in range(len(balance) - 1)]  # last layer of every stage but the last
    layers = build_gpt_layers(cfg.model, seed=cfg.seed) if layers is None else layers
    model = StageBoundaries(layers, after=after, dtype=precisions.compute_dtype(precision))  # W(t)
    t_cfg = cfg.train
    scaler = LossScaler(init_scale=t_cfg.loss_scale, growth_interval=t_cfg.loss_scale_growth_interval) if precision == "fp16" else None
    info.update(loss_scales=[], skipped_steps=[])
    stale = copy.deepcopy(model) if delayed else model  # W(t-1): the weights batch t runs with
    opt = build_optimizer(model.parameters(), cfg.optim)
    feed = MicrobatchFeed(
        load_bytes(cfg.data.path), seq_len=cfg.model.seq_len, microbatch_size=cfg.pipeline.microbatch_size,
        num_microbatches=m, seed=cfg.seed,
    )
    losses = []
    for t in range(cfg.train.num_steps):
        stale.zero_grad(set_to_none=True)
        batch_losses = []
        for j in range(m):
            x, y = feed.microbatch(t * m + j)
            with precisions.autocast(precision, "cpu"):
                logits = stale(x)
            loss = lm_loss(logits.float(), y)
            (loss * scaler.scale if scaler is not None else loss).backward()
            batch_losses.append(loss.detach())
        losses.append(float(torch.stack(batch_losses).mean()))
        scale = scaler.scale if scaler is not None else 1.0
        grads = [None if p.grad is None else p.grad / (m * scale) for p in stale.parameters()]
        if delayed:
            stale.load_state_dict(model.state_dict())  # batch t+1 runs with W(t)
        skip = scaler is not None and any(not torch.isfinite(g).all() for g in grads if g is not None)
        if scaler is not None:
            info["loss_scales"].append(scale)
            scaler.update(skip)
        if skip:
            info["skipped_steps"].append(t)
            continue  # W(t+1) = W(t), optimizer state untouched
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return model.state_dict(), losses
