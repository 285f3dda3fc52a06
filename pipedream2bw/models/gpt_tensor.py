"""The GPT's blocks split across a tensor group (pipeline.tensor_parallel): attention by heads, the MLP by width.

Megatron's split: ``qkv`` and ``fc`` column-wise (tensor rank k holds heads k*H/t .. (k+1)*H/t - 1 of q, k and v,
and rows k*4C/t .. of ``fc``), ``proj`` and ``fc_proj`` row-wise (the matching input columns); their biases are
added once, after the sum. Norms, embedding and head stay whole on every rank, and so do the activations between
blocks: each rank's dropout draws the same mask as an unsplit run (one random stream per layer and microbatch).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipedream2bw.models.gpt import Block
from pipedream2bw.pipeline.tensor import SharedGroup, Split, copy_to, reduce_from, shard


class SplitBlock(Block):
    """A ``Block`` holding tensor rank ``rank``'s pieces (of ``size``) of its matrices; parameter names unchanged."""

    SPLITS: Dict[str, Split] = {
        "qkv.weight": (0, 3),
        "qkv.bias": (0, 3),
        "proj.weight": (1, 1),
        "fc.weight": (0, 1),
        "fc.bias": (0, 1),
        "fc_proj.weight": (1, 1),
    }
    """Each split parameter's (dim, chunks) (pipeline.tensor.Split): the rest is whole on every rank."""

    def __init__(self, block: Block, *, group: Any, rank: int, size: int):
        nn.Module.__init__(self)
        self.num_heads, self.head_dim, self.dropout = block.num_heads // size, block.head_dim, block.dropout
        self.ln1, self.qkv, self.proj, self.ln2, self.fc, self.fc_proj = (
            block.ln1,
            block.qkv,
            block.proj,
            block.ln2,
            block.fc,
            block.fc_proj,
        )
        self.tensor_group = SharedGroup(group)
        with torch.no_grad():
            for name, split in self.SPLITS.items():
                p = self.get_parameter(name)
                p.data = shard(p.data, split, rank=rank, size=size)

    def attention(self, h: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        group = self.tensor_group.group
        y = self.heads(copy_to(h, group), positions)  # (B, T, C/t): this rank's heads
        out = reduce_from(F.linear(y, self.proj.weight), group)  # (B, T, C), in autocast's dtype
        return out + self.proj.bias.to(out.dtype)  # the bias as autocast casts it for an unsplit F.linear

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        group = self.tensor_group.group
        y = F.gelu(self.fc(copy_to(h, group)))  # (B, T, 4C/t)
        out = reduce_from(F.linear(y, self.fc_proj.weight), group)
        return out + self.fc_proj.bias.to(out.dtype)


def split_blocks(module: nn.Module, *, group: Any, rank: int, size: int) -> Dict[str, Split]:
    """Replaces each GPT ``Block`` among ``module``'s children by its ``SplitBlock`` for tensor rank ``rank``.

    Returns:
        The split parameters of ``module`` by name (``module.named_parameters()``'s), with their splits.
    """
    splits: Dict[str, Split] = {}
    for name, child in list(module._modules.items()):
        if type(child) is Block:
            module._modules[name] = SplitBlock(child, group=group, rank=rank, size=size)
            splits.update({f"{name}.{k}": v for k, v in SplitBlock.SPLITS.items()})
    return splits
