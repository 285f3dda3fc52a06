"""What this rank runs (stage, replica, layout, schedule, precision, steps), decided once from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from pipedream2bw.config import Config
from pipedream2bw.memory import precision as precisions
from pipedream2bw.pipeline import schedule as schedules
from pipedream2bw.pipeline import ties
from pipedream2bw.pipeline.layout import Layout


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a run, built once by ``from_config`` after ``config.validate``; the
    runtime's components take this (and the config sections they need), never the whole ``Config``.

    d: ``num_stages``, w: ``data_parallel``, t: ``tensor_parallel``, m: ``num_microbatches``, b: ``microbatch_size``.
    """

    rank: int
    world_size: int
    stage: int
    """This rank's stage index, 0..d-1."""
    replica: int
    """This rank's replica of its stage, 0..w-1 (replica r of every stage forms one pipeline)."""
    layout: Layout
    """Which rank runs which (stage, replica)."""
    balance: Tuple[int, ...]
    """Layers per stage (zbv: per chunk, 2d of them, rank r running chunks r and 2d-1-r)."""
    schedule: str
    """'2bw', 'flush' or 'gpipe'."""
    num_microbatches: int
    microbatch_size: int
    seq_len: int
    """Tokens per sample."""
    precision: str
    """The resolved precision: 'fp32', 'bf16' or 'fp16' (never 'auto')."""
    device: torch.device
    backend: str
    """'gloo' or 'nccl'."""
    seed: int
    recompute: bool
    """Whether stages keep only each layer's input and re-run it in backward."""
    first_step: int
    """The first batch this run trains: 0, or the step of the checkpoint it resumes from."""
    num_steps: int
    """The batch the run ends before (``train.num_steps``)."""
    sync_warmup_steps: int = 0
    """Under 2bw: the steps that run as PipeDream-Flush first (``pipeline.sync_warmup_steps``)."""
    weight_versions: str = "batch"
    """Under 2bw: the version a forward runs on, its batch's or the stage's newest (``pipeline.weight_versions``)."""
    forward_lead: int = 0
    """Forwards ahead of 1F1B's bound on the stages before the last (``pipeline.forward_lead``)."""
    sequence_parallel: bool = False
    """At t > 1: the blocks' activations split along the sequence over the tensor group
    (``pipeline.sequence_parallel``)."""

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        layout: Layout,
        balance: Sequence[int],
        ctx: Any,
        resume: Optional[Tuple[Any, Dict[str, Any]]] = None,
    ) -> "RankPlan":
        """This rank's plan.

        Args:
            cfg: the validated config (after ``partition=auto|file`` applied its plan).
            layout: the run's rank placement (``layout.make_layout``).
            balance: layers per stage, as ``config.validate`` returned it.
            ctx: anything with this process's ``rank``, ``world_size``, ``device`` and ``backend``
                (a ``comm.DistContext``).
            resume: (checkpoint path, manifest) the run resumes from, or None.
        """
        stage, replica = layout.position(ctx.rank)
        p = cfg.pipeline
        return cls(
            rank=ctx.rank,
            world_size=ctx.world_size,
            stage=stage,
            replica=replica,
            layout=layout,
            balance=tuple(balance),
            schedule=p.schedule,
            num_microbatches=p.num_microbatches,
            microbatch_size=p.microbatch_size,
            seq_len=cfg.model.seq_len,
            precision=precisions.resolve(cfg.train.precision, ctx.device.type),
            device=ctx.device,
            backend=ctx.backend,
            seed=cfg.seed,
            recompute=p.recompute,
            first_step=0 if resume is None else resume[1]["step"],
            num_steps=cfg.train.num_steps,
            sync_warmup_steps=p.sync_warmup_steps if p.schedule == "2bw" else 0,
            forward_lead=p.forward_lead,
            weight_versions=p.weight_versions if p.schedule == "2bw" else "batch",
            sequence_parallel=p.sequence_parallel and layout.tensor > 1,
        )

    @property
    def num_stages(self) -> int:
        return len(self.layout.ranks)

    @property
    def data_parallel(self) -> int:
        return len(self.layout.ranks[0])

    @property
    def tensor_parallel(self) -> int:
        """t: ranks that split each of this stage's layers (pipeline.tensor_parallel)."""
        return self.layout.tensor

    @property
    def tensor_rank(self) -> int:
        """This rank's place in its tensor group, 0..t-1 (its (stage, replica)'s ranks are consecutive)."""
        return self.rank % self.layout.tensor

    @property
    def pipeline_ranks(self) -> Tuple[Tuple[int, ...], ...]:
        """``[stage][replica]`` -> the rank of this rank's tensor rank there: its d x w pipeline (``layout.ranks``
        when t = 1)."""
        return self.layout.slice(self.tensor_rank)

    @property
    def global_batch(self) -> int:
        """Samples per step: w * m * b."""
        return self.data_parallel * self.num_microbatches * self.microbatch_size

    @property
    def layer_indices(self) -> List[int]:
        """Global indices of this stage's layers in the whole layer list (zbv: its two chunks', in that order)."""
        out: List[int] = []
        for v in schedules.chunks(self.schedule, self.stage, self.num_stages):
            start = sum(self.balance[:v])
            out += range(start, start + self.balance[v])
        return out

    def tie_holders(self, tie: Any) -> List[int]:
        """The stages holding a copy of ``tie`` (a ``ties.Tie``): under zbv the ranks whose chunks use it."""
        return ties.holders(tie, self.balance, v_schedule=self.schedule in schedules.V_SCHEDULES)

    @property
    def prev_rank(self) -> Optional[int]:
        """The rank that sends this one its inputs (the previous stage of this replica), or None on the first stage."""
        return self.pipeline_ranks[self.stage - 1][self.replica] if self.stage > 0 else None

    @property
    def next_rank(self) -> Optional[int]:
        """The rank this one sends its outputs to, or None on the last stage."""
        return self.pipeline_ranks[self.stage + 1][self.replica] if self.stage < self.num_stages - 1 else None

    @property
    def layout_record(self) -> Dict[str, Any]:
        """The layout as a checkpoint manifest records it (RNG states are restored only under the same one)."""
        record = {
            "num_stages": self.num_stages,
            "data_parallel": self.data_parallel,
            "balance": list(self.balance),
            "rank_map": [list(r) for r in self.layout.ranks],
        }
        return record if self.tensor_parallel == 1 else {**record, "tensor_parallel": self.tensor_parallel}

    def positions(self) -> List[Tuple[int, int]]:
        """(stage, replica) of every rank, in rank order."""
        return [self.layout.position(r) for r in range(self.world_size)]
