"""Pure: which rank runs which (stage, replica, tensor rank) of a d x w x t pipeline, as data.

d stages, each replicated w times; replica r of every stage forms one pipeline (a p2p
chain), and the w replicas of stage s average their gradients (one all-reduce group).
With tensor parallelism (t > 1) each (stage, replica) is a group of t consecutive ranks
(t innermost in the mesh replica x stage x tensor), which split the stage's layers; tensor rank
k of a stage talks to tensor rank k of its neighbours and of its replicas, so the ranks of
one tensor rank form a d x w pipeline of their own (``slice``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from pipedream2bw.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """``ranks[s][r]`` is the rank that runs stage ``s`` of replica ``r``."""

    ranks: Tuple[Tuple[int, ...], ...]
    tensor: int = 1
    """t: ranks per (stage, replica); ``ranks`` names the first of each group (its tensor rank 0)."""

    def position(self, rank: int) -> Tuple[int, int]:
        """(stage, replica) of ``rank`` (of its tensor group's first rank)."""
        first = rank - rank % self.tensor
        for s, row in enumerate(self.ranks):
            if first in row:
                return s, row.index(first)
        raise KeyError(f"rank {rank} is not in the layout {self.ranks}")

    def slice(self, tensor_rank: int) -> Tuple[Tuple[int, ...], ...]:
        """The d x w ranks (``[stage][replica]``) of tensor rank ``tensor_rank``: a pipeline of its own."""
        return tuple(tuple(r + tensor_rank for r in row) for row in self.ranks)

    def tensor_groups(self) -> List[Tuple[int, ...]]:
        """Every (stage, replica)'s t ranks, stage-major: the groups that split a stage's layers."""
        return [tuple(range(r, r + self.tensor)) for row in self.ranks for r in row]


def default_layout(num_stages: int, data_parallel: int, *, ranks_per_node: int) -> Layout:
    """Places a stage's replicas on one node when they fit there, else a replica's stages.

    All-reduce moves a stage's whole gradient once per batch, p2p only activations once per
    microbatch, so the replicas of a stage get the fastest links first: when ``w`` divides the
    ranks of a node, ranks ``s*w .. s*w+w-1`` hold stage ``s`` (stage-major). Otherwise
    consecutive stages of a replica sit on consecutive ranks (replica-major), which keeps
    each pipeline's p2p chain on as few nodes as possible.
    """
    d, w = num_stages, data_parallel
    if w <= ranks_per_node and ranks_per_node % w == 0:
        return Layout(tuple(tuple(s * w + r for r in range(w)) for s in range(d)))
    return Layout(tuple(tuple(r * d + s for r in range(w)) for s in range(d)))


def make_layout(
    num_stages: int,
    data_parallel: int,
    *,
    ranks_per_node: int,
    rank_map: Optional[Sequence[Sequence[int]]] = None,
    tensor_parallel: int = 1,
) -> Layout:
    """The explicit ``rank_map`` (``[stage][replica] -> rank``) if given, else the default; with
    ``tensor_parallel`` t > 1 the map (or the default) places groups of t consecutive ranks: ``rank_map[s][r] = g``
    puts stage s of replica r on ranks g*t .. g*t+t-1 (a plan's ``rank_map`` counts groups so).

    Raises:
        ConfigError: a map that is not d rows of w entries using each of 0..d*w-1 once.
    """
    t = tensor_parallel
    if rank_map is None:
        groups = default_layout(num_stages, data_parallel, ranks_per_node=max(ranks_per_node // t, 1))
        return Layout(tuple(tuple(g * t for g in row) for row in groups.ranks), t)
    rows = [list(row) for row in rank_map]
    flat = sorted(r for row in rows for r in row)
    if (
        len(rows) != num_stages
        or any(len(row) != data_parallel for row in rows)
        or flat != list(range(num_stages * data_parallel))
    ):
        what = "ranks" if t == 1 else f"groups of {t} tensor ranks"
        raise ConfigError(
            f"pipeline.rank_map ({rows}) must have {num_stages} rows (stages) of {data_parallel} {what} (replicas) "
            f"using each of 0..{num_stages * data_parallel - 1} once; or set it to null for the default placement"
        )
    return Layout(tuple(tuple(g * t for g in row) for row in rows), t)
