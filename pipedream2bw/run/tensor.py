"""Tensor parallelism in a rank's run (pipeline.tensor_parallel = t > 1): its tensor group and split stage,
whole tensors for checkpoints and final weights (gathered on save, cut on load: any t resumes any other), and
which parameters its share of the global gradient norm leaves out (whole ones, counted on tensor rank 0), and the loss
on the head's logits where they are split by the vocabulary (``VocabLoss``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from pipedream2bw.config.optimizers import TENSOR_SPLIT
from pipedream2bw.models.gpt_tensor import VocabLoss, split_blocks, split_vocab
from pipedream2bw.models.hf_tensor import HF_VOCAB, holds_decoder_layers, split_decoder_layers
from pipedream2bw.pipeline import comm
from pipedream2bw.pipeline.tensor import Split, WholeFromPieces, sharded_state, whole_state
from pipedream2bw.run.runtime import RankPlan

STATE_KEYS = ("weights", "previous", "optimizer")
"""What of a stage's state (``WeightVersions.state``, a checkpoint's layers) holds pieces of split parameters."""


@dataclass
class TensorPart:
    """This rank's place in its tensor group and what of its stage is split."""

    group: Any
    rank: int
    """Tensor rank, 0..size-1."""
    size: int
    """t."""
    device: torch.device
    splits: Dict[str, Split]
    """Split parameters by name (the stage's ``named_parameters()``) -> (dim, chunks)."""
    pieces: Dict[str, torch.Size]
    """Each split parameter's shape on this rank."""
    wholes: Dict[str, torch.Size]
    """Each split parameter's whole shape."""
    vocab_loss: Optional[VocabLoss] = None
    """The loss on this rank's logits where its stage's head is split by the vocabulary, else None."""

    def loss(self, loss_fn: Callable) -> Callable:
        """The loss this rank computes on its stage's output: ``vocab_loss`` where the head is split, else
        ``loss_fn``."""
        return loss_fn if self.vocab_loss is None else self.vocab_loss

    def whole(self, state: Mapping[str, Any]) -> Dict[str, Any]:
        """A stage state with whole tensors (a collective over the tensor group: each of its ranks calls it)."""
        return {
            **state,
            **{
                k: whole_state(state[k], self.splits, self.pieces, self.group, self.device)
                for k in STATE_KEYS
                if state.get(k) is not None
            },
        }

    def cut(self, state: Mapping[str, Any]) -> Dict[str, Any]:
        """A stage state of whole tensors (a checkpoint's) cut to this rank's pieces."""
        return {
            **state,
            **{
                k: sharded_state(state[k], self.splits, self.wholes, rank=self.rank, size=self.size)
                for k in STATE_KEYS
                if state.get(k) is not None
            },
        }

    def norm_excluded(self, module: nn.Module) -> List[int]:
        """Indices of ``module``'s parameters this rank leaves out of its share of the gradient norm: the whole
        ones (every tensor rank holds the same), except on tensor rank 0; a split one each rank counts its piece of."""
        if self.rank == 0:
            return []
        return [i for i, (n, _) in enumerate(module.named_parameters()) if n not in self.splits]


def split_stage(rt: RankPlan, ctx: comm.DistContext, module: nn.Module, *, lm_head: bool) -> Optional[TensorPart]:
    """Splits ``module`` (this rank's stage, whole) across its tensor group; None when t = 1 (nothing to split).
    The GPT's embedding and head split by the vocabulary where t divides it, the head only with ``lm_head`` (the run's
    loss is ``lm_loss``, which ``VocabLoss`` replaces; a user's loss needs whole logits). Every rank makes every
    tensor group, in the same order."""
    if rt.tensor_parallel == 1:
        return None
    group = comm.new_groups(ctx, rt.layout.tensor_groups())[rt.stage * rt.data_parallel + rt.replica]
    # every name of a tied parameter (a stage's state_dict, which checkpoints save, holds each)
    wholes = {n: p.shape for n, p in module.named_parameters(remove_duplicate=False)}
    splits: Dict[str, Split] = {}
    head_vocab = None
    for kinds in (None, HF_VOCAB):  # the GPT's embedding and head, model=hf's Llama family's
        vocab, head_size = split_vocab(
            module, group=group, rank=rt.tensor_rank, size=rt.tensor_parallel, head=lm_head, kinds=kinds
        )
        splits.update(vocab)
        head_vocab = head_vocab or head_size
    # after the vocabulary's split: sequence parallelism hooks the stage's embedding (its split one) and final norm
    sp = rt.sequence_parallel  # the blocks on 1/t of the sequence, sliced after the embedding, gathered before the norm
    # the built-in GPT's blocks or model=hf's Llama family's decoder layers
    split = split_decoder_layers if holds_decoder_layers(module) else split_blocks
    splits.update(split(module, group=group, rank=rt.tensor_rank, size=rt.tensor_parallel, sequence_parallel=sp))
    pieces = {n: p.shape for n, p in module.named_parameters(remove_duplicate=False) if n in splits}
    for n, p in module.named_parameters():  # Muon steps a piece through its whole matrix (config.optimizers)
        if n in splits:
            part = WholeFromPieces(splits[n], group, rank=rt.tensor_rank, size=rt.tensor_parallel, device=rt.device)
            setattr(p, TENSOR_SPLIT, part)
    return TensorPart(
        group=group,
        rank=rt.tensor_rank,
        size=rt.tensor_parallel,
        device=rt.device,
        splits=splits,
        pieces=pieces,
        wholes={n: wholes[n] for n in splits},
        vocab_loss=None
        if head_vocab is None
        else VocabLoss(group, vocab_size=head_vocab, rank=rt.tensor_rank, size=rt.tensor_parallel),
    )
