"""Stage boundaries over P2P's steady-state path (issue 47): after the first crossing agreed on a structure, a
tensor or a plain list/tuple of tensors crosses without pytree and posts on the process group itself."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_helper import spawn

from pipedream2bw.pipeline.boundary import Channel
from pipedream2bw.pipeline.comm import P2P, PipelineShapeError

STEPS = 4


def _data():
    """The tensors both ranks expect, from one seed: activations (2, 3, 4), integer ids (2, 3), one tensor (5,)."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(2, 3, 4, generator=g), torch.randint(0, 9, (2, 3), generator=g), torch.randn(5, generator=g))
        for _ in range(STEPS)
    ]


def _crossings() -> None:
    """Ranks 0 and 2 over a group [0, 2] (rank 2 is the group's rank 1: P2P's cached translation is exercised);
    rank 1 only takes part in making the group."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group([0, 2])
    if rank == 1:
        return dist.barrier()
    ctx = SimpleNamespace(rank=rank, device=torch.device("cpu"), timeout=timedelta(seconds=30))
    p2p, held = P2P(ctx, group=group), P2P(ctx, group=group, batch_sends=True)
    act, grad = (Channel(p2p, tag=t, what=w, device=ctx.device) for t, w in ((0, "an output"), (1, "a gradient")))
    leaf = Channel(held, tag=0, what="a tensor", device=ctx.device)
    data = _data()
    if rank == 0:
        for k, (x, ids, one) in enumerate(data):
            act.send((x, ids), peer=2, token=k)  # a tuple of a float and an integer tensor
            got = grad.recv(2)
            assert type(got) is list and len(got) == 1 and torch.equal(got[0], 2 * x), got
            p2p.release(2, k)
            leaf.send(one, peer=2, defer=True, token=k)  # held back, then started with the next receive
            assert torch.equal(leaf.recv(2), one + k)
        # What the first crossing did not agree on is refused before anything is sent (the peer would never
        # receive it): a list where a tuple crossed, a third element, the first element's shape changed.
        x, ids, _ = data[0]
        for bad in ([x, ids], (x, ids, ids), (x[:1], ids)):
            with pytest.raises(PipelineShapeError):
                act.send(bad, peer=2, token=STEPS)
    else:
        for k, (x, ids, _) in enumerate(data):
            got = act.recv(0)
            assert type(got) is tuple and len(got) == 2, got
            assert torch.equal(got[0], x) and torch.equal(got[1], ids) and got[1].dtype == torch.int64, got
            grad.send([2 * got[0]], peer=0, token=k)  # a list of one, as a backward's input gradients
            leaf.send(leaf.recv(0) + k, peer=0, token=k)
    p2p.flush()
    held.flush()
    dist.barrier()


@pytest.mark.slow
def test_steady_state_crossings_arrive_whole_and_refuse_another_structure(tmp_path):
    results = spawn(_crossings, world_size=3, log_dir=tmp_path, timeout_s=120)
    assert all(r.exitcode == 0 for r in results), "\n".join(f"rank {r.rank} ({r.exitcode}):\n{r.log}" for r in results)
