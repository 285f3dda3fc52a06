"""Tensor parallelism's two figures on this machine against the planner's: a layer's all-reduce, and split compute.

1. The all-reduce that a split transformer block runs twice in its forward and twice in its backward: b*T*C float32
   activations, summed over t = 2 processes with gloo on loopback (median of --repeats after warm-up), beside
   ``partitioner.tensor.allreduce_s`` on topology=cpu's intra-node link (configs/topology/cpu.yaml).
2. The split compute's efficiency: one thread's forward + backward of the GPT's block at full width against half a
   block as one of t = 2 ranks runs it (half the heads, half the MLP width): T_full / (2 T_half), beside
   ``partitioner.tensor.TENSOR_EFFICIENCY``.

3. A block's collectives with and without sequence parallelism (``pipeline.sequence_parallel``), each run through
   the runtime's own functions (``pipeline.tensor``) between t = 2 gloo processes: unsplit along the sequence four
   all-reduces of b*T*C (two each way); split, in the forward two all-gathers of the slices and two reduce-scatters,
   in the backward the same four plus two all-gathers of the column-split inputs again and one all-reduce of the
   norms' and row biases' 6 C gradients - beside the planner's figures for both (``partitioner.tensor``).

python scripts/bench_tensor.py                       # the default GPT's shape (b 8, T 128, C 128) and C 512
python scripts/bench_tensor.py --d-model 128 512 --batch 8 --seq-len 128 --repeats 50
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partitioner.tensor import TENSOR_EFFICIENCY, allgather_s, allreduce_s
from partitioner.topology import intra_link
from pipedream2bw.config import TopologyConfig
from pipedream2bw.pipeline.tensor import gather_sequence, reduce_from, reduce_scatter_sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, port: int, sizes, repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for n in sizes:
            x = torch.ones(n // 4)
            for _ in range(5):
                dist.all_reduce(x)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - start)
            if rank == 0:
                out[n] = statistics.median(times)
    finally:
        dist.destroy_process_group()


def _median_s(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after five, each started together (a barrier)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sequence_worker(rank: int, port: int, shapes, repeats: int, out) -> None:
    """Each of ``shapes`` (B, T, C): the median seconds of each collective a block runs (the module docstring)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD
    try:
        for B, T, C in shapes:
            whole, piece, grads = torch.ones(B, T, C), torch.ones(B, T // 2, C), torch.ones(6 * C)
            ops = {
                "all-reduce": functools.partial(reduce_from, whole, group),
                "all-gather": functools.partial(gather_sequence, piece, group, rank=rank, size=2),
                "reduce-scatter": functools.partial(reduce_scatter_sequence, whole, group),
                "all-reduce 6C": functools.partial(dist.all_reduce, grads, group=group),
            }
            times = {name: _median_s(fn, repeats) for name, fn in ops.items()}
            if rank == 0:
                out[(B, T, C)] = times
    finally:
        dist.destroy_process_group()


def sequence_table(shapes, repeats: int, link) -> None:
    """Prints a block's collectives' seconds (forward + backward) at t = 2, unsplit and split along the sequence,
    measured and the planner's."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_sequence_worker, args=(_free_port(), list(shapes), repeats, out), nprocs=2, join=True)
        measured = dict(out)
    print("\na block's collectives, forward + backward, t = 2 gloo processes (ms; float32):")
    print(f"{'C':>6} {'op':>15} {'measured':>9} {'planner':>8}")
    for B, T, C in shapes:
        m, n = measured[(B, T, C)], B * T * C * 4
        model = {
            "all-reduce": allreduce_s(n, 2, link),
            "all-gather": allgather_s(n, 2, link),
            "reduce-scatter": allgather_s(n, 2, link),  # a ring reduce-scatter moves what an all-gather does
            "all-reduce 6C": allreduce_s(6 * C * 4, 2, link),
        }
        for op in m:
            print(f"{C:>6} {op:>15} {m[op] * 1e3:>9.3f} {model[op] * 1e3:>8.3f}")
        count = {"off": {"all-reduce": 4}, "on": {"all-gather": 6, "reduce-scatter": 4, "all-reduce 6C": 1}}
        for sp, ops in count.items():
            meas = sum(k * m[op] for op, k in ops.items())
            plan = sum(k * model[op] for op, k in ops.items())
            print(f"{C:>6} {'block, SP ' + sp:>15} {meas * 1e3:>9.3f} {plan * 1e3:>8.3f}   pred/meas {plan / meas:.2f}")


def measure_allreduce(sizes, repeats: int) -> dict:
    """Median seconds of a 2-process gloo all-reduce of each size (bytes) in ``sizes``."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_allreduce_worker, args=(_free_port(), list(sizes), repeats, out), nprocs=2, join=True)
        return dict(out)


class _Block(torch.nn.Module):
    """The GPT's pre-LN block (pipedream2bw.models.gpt.Block) with its heads and MLP width divided by ``t``: what one
    of t ranks computes (the norms whole, no all-reduce)."""

    def __init__(self, d_model: int, heads: int, t: int):
        super().__init__()
        self.h, C = heads // t, d_model
        self.ln1, self.ln2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
        self.qkv, self.proj = torch.nn.Linear(C, 3 * C // t), torch.nn.Linear(C // t, C)
        self.fc, self.fc_proj = torch.nn.Linear(C, 4 * C // t), torch.nn.Linear(4 * C // t, C)

    def forward(self, x):  # (B, T, C)
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, h, T, C/heads)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln2(x))))


def block_seconds(d_model: int, heads: int, t: int, *, batch: int, seq_len: int, repeats: int) -> float:
    """Median seconds of one thread's forward + backward of ``_Block(d_model, heads, t)``."""
    torch.set_num_threads(1)
    block = _Block(d_model, heads, t)
    x = torch.randn(batch, seq_len, d_model, requires_grad=True)
    times = []
    for r in range(repeats + 3):
        start = time.perf_counter()
        block(x).sum().backward()
        if r >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[128, 512], help="hidden sizes C to try")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (divisible by 2)")
    parser.add_argument("--batch", type=int, default=8, help="microbatch size b")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens T")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    link = intra_link(TopologyConfig())  # topology=cpu's defaults: 1.5 GB/s, 150 us
    sizes = [args.batch * args.seq_len * c * 4 for c in args.d_model]
    measured = measure_allreduce(sizes, args.repeats)
    print(f"all-reduce of one block's activation (b {args.batch} x T {args.seq_len} x C float32), 2 gloo processes:")
    print(f"{'C':>6} {'KiB':>8} {'measured ms':>12} {'planner ms':>11} {'pred/meas':>9}")
    for c, n in zip(args.d_model, sizes):
        pred = allreduce_s(n, 2, link)
        print(f"{c:>6} {n / 1024:>8.0f} {measured[n] * 1e3:>12.3f} {pred * 1e3:>11.3f} {pred / measured[n]:>9.2f}")
    print(f"\nsplit compute, one thread, forward + backward of a block (planner's efficiency {TENSOR_EFFICIENCY}):")
    print(f"{'C':>6} {'whole ms':>9} {'half ms':>8} {'efficiency':>10}")
    for c in args.d_model:
        shape = dict(batch=args.batch, seq_len=args.seq_len, repeats=args.repeats)
        whole = block_seconds(c, args.heads, 1, **shape)
        half = block_seconds(c, args.heads, 2, **shape)
        print(f"{c:>6} {whole * 1e3:>9.2f} {half * 1e3:>8.2f} {whole / (2 * half):>10.2f}")
    sequence_table([(args.batch, args.seq_len, c) for c in args.d_model], args.repeats, link)


if __name__ == "__main__":
    main()
