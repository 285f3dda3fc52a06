"""Pure: which rank runs which (stage, replica) of a d x w pipeline, as data.

d stages, each replicated w times; replica r of every stage forms one pipeline (a p2p
chain), and the w replicas of stage s average their gradients (one all-reduce group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from pipedream2bw.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """``ranks[s][r]`` is the rank that runs stage ``s`` of replica ``r``."""

    ranks: Tuple[Tuple[int, ...], ...]

    def position(self, rank: int) -> Tuple[int, int]:
        """(stage, replica) of ``rank``."""
        for s, row in enumerate(self.ranks):
            if rank in row:
                return s, row.index(rank)
        raise KeyError(f"rank {rank} is not in the layout {self.ranks}")


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
    num_stages: int, data_parallel: int, *, ranks_per_node: int, rank_map: Optional[Sequence[Sequence[int]]] = None
) -> Layout:
    """The explicit ``rank_map`` (``[stage][replica] -> rank``) if given, else the default.

    Raises:
        ConfigError: a map that is not d rows of w ranks using each of 0..d*w-1 once.
    """
    if rank_map is None:
        return default_layout(num_stages, data_parallel, ranks_per_node=ranks_per_node)
    rows = [list(row) for row in rank_map]
    flat = sorted(r for row in rows for r in row)
    if (
        len(rows) != num_stages
        or any(len(row) != data_parallel for row in rows)
        or flat != list(range(num_stages * data_parallel))
    ):
        raise ConfigError(
            f"pipeline.rank_map ({rows}) must have {num_stages} rows (stages) of {data_parallel} ranks (replicas) "
            f"using each rank 0..{num_stages * data_parallel - 1} once; or set it to null for the default placement"
        )
    return Layout(tuple(tuple(row) for row in rows))
