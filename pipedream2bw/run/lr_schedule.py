"""Pure: the learning rate of step t (optim.scheduler, optim.warmup_steps, optim.min_lr)."""

from __future__ import annotations

import math

from pipedream2bw.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, *, num_steps: int) -> float:
    """The learning rate of step ``step`` (0-based) of a run of ``num_steps`` steps.

    W: optim.warmup_steps, T: num_steps. Steps t < W warm up linearly, ``lr * (t + 1) / W``
    (never 0: the first step already learns). After the warm-up, with p = (t - W) / (T - W - 1)
    going from 0 at t = W to 1 at the last step: 'constant' keeps ``lr``, 'linear' goes
    ``lr -> min_lr`` along p, 'cosine' along ``(1 + cos(pi p)) / 2``. A function of the step and
    the config only: every stage and replica gets the same value, and a resumed run continues
    the schedule exactly.
    """
    lr, warmup = optim.lr, optim.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if optim.scheduler == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, num_steps - warmup - 1))
    if optim.scheduler == "linear":
        return lr + (optim.min_lr - lr) * progress
    if optim.scheduler == "cosine":
        return optim.min_lr + 0.5 * (lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown optim.scheduler {optim.scheduler!r}")
