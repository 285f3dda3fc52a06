"""What splitting a backward costs (issue 46): one chunk of the GPT split into 2d, in one process and one thread,
its backward as zb1p and zbv run it (B: ``split_backward.backward_input``, then W: ``backward_weight``) against the
whole backward (``torch.autograd.backward``) and the whole backward with the graph kept (``retain_graph``, as B keeps
it), interleaved, thread-CPU ms per microbatch (medians; the first 3 rounds left out).

    python scripts/bench_split.py [--microbatch-size 4] [--chunk 1] [--num-stages 2] [--rounds 30] [--num-layers 8]

The GPT is bench.py's (by default 8 blocks x 256, 4 heads, seq 128, vocab 256); chunk ``--chunk`` of its split into
2 x ``--num-stages`` (``gpt_balance``), a middle one by default (its input needs a gradient; no loss).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipedream2bw.config import Config, GPTConfig, PipelineConfig, TrainConfig, WandbConfig, gpt_balance
from pipedream2bw.run import split_backward
from pipedream2bw.run.model import build_stage_module


def _config(args) -> Config:
    return Config(
        pipeline=PipelineConfig(schedule="zbv", num_stages=args.num_stages, microbatch_size=args.microbatch_size),
        model=GPTConfig(
            num_layers=args.num_layers,
            d_model=args.d_model,
            num_heads=args.num_heads,
            seq_len=args.seq_len,
            vocab_size=256,
        ),
        train=TrainConfig(num_steps=1),
        wandb=WandbConfig(mode="disabled"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1, help="which of the 2d chunks (0 < chunk < 2d - 1)")
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--num-layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _config(args)
    balance = gpt_balance(cfg.model, 2 * args.num_stages)
    if not 0 < args.chunk < len(balance) - 1:
        raise SystemExit(f"--chunk ({args.chunk}) must be a middle chunk: 1 .. {len(balance) - 2}")
    module = build_stage_module(cfg, balance, args.chunk, None)
    params = list(module.parameters())

    def one(how: str) -> float:
        x = torch.randn(args.microbatch_size, cfg.model.seq_len, cfg.model.d_model, requires_grad=True)
        out = module(x)
        grad = torch.randn_like(out)
        start = time.thread_time()
        if how == "split":
            _, work = split_backward.backward_input([out], [grad], [x], params)
            split_backward.backward_weight(work)
        else:
            torch.autograd.backward([out], [grad], retain_graph=how == "whole, graph kept")
        return (time.thread_time() - start) * 1e3

    times = {how: [] for how in ("split", "whole", "whole, graph kept")}
    for r in range(args.rounds):
        for how, kept in times.items():
            t = one(how)
            if r >= 3:
                kept.append(t)
    print(f"chunk {args.chunk} of {balance} (layers a chunk), b={args.microbatch_size}: thread-CPU ms a microbatch")
    for how, kept in times.items():
        print(f"  {how:>18}: {statistics.median(kept):.1f}")
    split, whole = statistics.median(times["split"]), statistics.median(times["whole"])
    print(f"  split / whole: {split / whole:.3f}")


if __name__ == "__main__":
    main()
