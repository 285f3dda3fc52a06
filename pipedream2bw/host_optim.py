"""Optimizer state and update on the host (swap.optimizer=host), as KARMA and ZeRO-Offload do."""

from __future__ import annotations

from typing import Callable, List

import torch
from torch import nn

from pipedream2bw.versions import WeightVersions


class HostOptimizerVersions(WeightVersions):
    """``WeightVersions`` whose optimizers step host copies of the weights.

    The master parameters (what the optimizers own, with their state: Adam's two moments)
    live in host memory and always hold the newest version W(t). Closing batch t, each
    bucket's gradient (scaled on the device) is copied to the host, the optimizer steps there,
    and the result is copied into the device replica that will hold W(t+1). The device keeps
    the weight versions and the gradient being accumulated, but no optimizer state. The update
    rule is unchanged (docs/design.md section 2); on a GPU the host's float32 arithmetic may round
    differently from the GPU's.
    """

    def _make_masters(self, module: nn.Module) -> List[nn.Parameter]:
        """Host copies of the weights (pinned when the module is on a GPU); optimizer state is made lazily, so none is on the device."""
        pin = next(module.parameters()).device.type == "cuda"
        return [
            nn.Parameter(
                p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone(),
                requires_grad=p.requires_grad,
            )
            for p in module.parameters()
        ]

    @torch.no_grad()
    def step(
        self, batch_index: int, *, grad_scale: float, before_bucket: Callable[[int], None] = lambda i: None
    ) -> None:
        """Closes batch t: W(t+1) = W(t) - optimizer_step(grad_scale * gradients), stepped on the host."""
        t = batch_index
        src = list(self.module_for_batch(t).parameters())
        dst_index = self._destination(t)
        dst = list(self.replicas[dst_index].parameters())  # fully overwritten with W(t+1) below
        for bucket_index, (bucket, optimizer) in enumerate(zip(self.buckets, self.optimizers)):
            before_bucket(bucket_index)
            for i in bucket:
                g = src[i].grad
                self.master[i].grad = None if g is None else g.mul_(grad_scale).to("cpu")
                src[i].grad = None
            optimizer.step()
            for i in bucket:
                self.master[i].grad = None
                dst[i].copy_(self.master[i], non_blocking=True)
        self.holds[dst_index] = t + 1

    @torch.no_grad()
    def load_state(self, **state) -> None:
        """``WeightVersions.load_state``, then the host masters take the newest version (they always hold it)."""
        super().load_state(**state)
        for master, p in zip(self.master, self.replicas[0].parameters()):  # replica 0 holds the newest after a load
            master.copy_(p)
