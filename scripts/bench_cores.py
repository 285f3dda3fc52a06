"""What this host gives two pipeline ranks, apart from our runtime (issue 47): whether two single-threaded
trainings at once each run as fast as one alone (the cores' sharing), and gloo's cost per transfer (posting an isend,
a round trip) at activation sizes.

    python scripts/bench_cores.py                    # both, 3 rounds each
    python scripts/bench_cores.py --rounds 5 --skip-gloo
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import List

SHAPES = [(1, 32, 128, 2, 300), (2, 32, 128, 2, 200), (4, 128, 256, 4, 12)]  # b, T, C, blocks, steps timed
SIZES_KIB = (16, 32, 256)


def step_ms(b: int, T: int, C: int, layers: int, iters: int) -> float:
    """One process, one thread: the GPT's forward and backward on a (b, T) microbatch, ms a step (5 warm-up)."""
    import torch
    from torch import nn

    from pipedream2bw.config import GPTConfig
    from pipedream2bw.models import build_gpt_layers

    torch.set_num_threads(1)
    cfg = GPTConfig(num_layers=layers, d_model=C, num_heads=4, seq_len=T)
    model = nn.Sequential(*build_gpt_layers(cfg, seed=0))
    x, y = torch.randint(0, cfg.vocab_size, (b, T)), torch.randint(0, cfg.vocab_size, (b, T))

    def step() -> None:
        out = model(x)
        nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()

    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters * 1e3


def _spawn(shape, n: int) -> List[float]:
    """``n`` processes of ``step_ms(*shape)`` at once; their ms a step."""
    cmd = [sys.executable, __file__, "--worker", *map(str, shape)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return [float(p.communicate()[0]) for p in procs]


def gloo_worker() -> None:
    """torchrun's rank: isend posting and ping-pong round trip medians (us) per size, printed by rank 0."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for kib in SIZES_KIB:
        x, post, rtt = torch.randn(kib * 256), [], []
        dist.barrier()
        for _ in range(300):
            start = time.perf_counter()
            if rank == 0:
                work = dist.isend(x, 1)
                posted = time.perf_counter()
                work.wait()
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                posted = time.perf_counter()
                dist.isend(x, 0).wait()
            post.append((posted - start) * 1e6)
            rtt.append((time.perf_counter() - start) * 1e6)
        if rank == 0:
            print(
                f"  gloo {kib} KiB: isend posting {statistics.median(post[50:]):.0f} us, "
                f"round trip {statistics.median(rtt[50:]):.0f} us"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-gloo", action="store_true")
    parser.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return print(f"{step_ms(*args.worker):.3f}")
    if args.gloo_worker:
        return gloo_worker()
    print(f"command: bench_cores.py {' '.join(sys.argv[1:])}")
    print(f"config: {os.cpu_count()} cores; GPT microbatches (b, T, d_model, blocks): {[s[:4] for s in SHAPES]}")
    for shape in SHAPES:
        for r in range(args.rounds):
            alone, both = _spawn(shape, 1), _spawn(shape, 2)
            print(f"  b={shape[0]} T={shape[1]} C={shape[2]} {shape[3]} blocks, round {r}: alone {alone[0]:.2f} ms "
                  f"a step, two at once {both[0]:.2f} / {both[1]:.2f} (ratio {max(both) / alone[0]:.2f})")  # fmt: skip
    if not args.skip_gloo:
        from pipedream2bw.pipeline.comm import torchrun_command

        for _ in range(args.rounds):
            subprocess.run([*torchrun_command(2), __file__, "--gloo-worker"], check=True)


if __name__ == "__main__":
    main()
