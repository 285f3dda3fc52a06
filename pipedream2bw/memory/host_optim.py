"""Optimizer state and update on the host (swap.optimizer=host), as KARMA and ZeRO-Offload do."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from pipedream2bw.pipeline.versions import WeightVersions


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
        """Host copies of the weights (pinned when the module is on a GPU); optimizer state is made lazily, so none
        is on the device."""
        pin = next(module.parameters()).device.type == "cuda"
        return [
            nn.Parameter(
                p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone(),
                requires_grad=p.requires_grad,
            )
            for p in module.parameters()
        ]

    def _prepare_destination(self, dst_index: int, t: int) -> None:
        """Nothing: the masters hold W(t), and every parameter of the destination is overwritten from them."""

    def _attach_master(self, i: int, dst: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
        """The host master of parameter ``i`` takes a host copy of its (scaled) gradient."""
        self.master[i].grad = None if grad is None else grad.to("cpu")

    def _detach_master(self, i: int, dst: nn.Parameter) -> None:
        """After its bucket's host step: the new weights W(t+1) go to the device replica ``dst``."""
        self.master[i].grad = None
        dst.copy_(self.master[i], non_blocking=True)

    @torch.no_grad()
    def load_state(self, **state) -> None:
        """``WeightVersions.load_state``, then the host masters take the newest version (they always hold it)."""
        super().load_state(**state)
        for master, p in zip(self.master, self.replicas[0].parameters()):  # replica 0 holds the newest after a load
            master.copy_(p)
