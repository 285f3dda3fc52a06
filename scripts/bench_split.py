"""What splitting a backward costs (issue 46): one chunk of the GPT split into 2d, in one process and one thread,
its backward as zb1p and zbv run it (B: ``split_backward.backward_input``, then W: ``backward_weight``, each timed)
against the whole backward (``torch.autograd.backward``), the whole backward with the graph kept (``retain_graph``,
as B keeps it) and the input's gradient alone (``torch.autograd.grad(out, x, retain_graph=True)``: what B cannot
beat), interleaved (the order reversed every other round), thread-CPU ms per microbatch (medians; the first 3
rounds left out).

    python scripts/bench_split.py [--microbatch-size 4] [--chunk 1 | --last] [--num-stages 2] [--rounds 30]
        [--num-layers 8] [--baseline REF] [--matmuls]

The GPT is bench.py's (by default 8 blocks x 256, 4 heads, seq 128, vocab 256); chunk ``--chunk`` of its split into
2 x ``--num-stages`` (``gpt_balance``), a middle one by default (its input needs a gradient; no loss), or with
``--last`` the last one (blocks, final norm and head) with the cross-entropy loss (``lm_loss``). ``--baseline REF``
also times ``pipeline/split_backward.py`` as it is at git revision REF, interleaved with today's: a before/after in one
process. ``--matmuls`` instead prints each matmul's time in B, W and the whole backward (torch.profiler).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipedream2bw.config import Config, GPTConfig, PipelineConfig, TrainConfig, WandbConfig, gpt_balance
from pipedream2bw.models.gpt import lm_loss
from pipedream2bw.pipeline import split_backward
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


def _at_revision(ref: str):
    """``pipeline/split_backward.py`` as it is at git revision ``ref``, imported as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    for where in ("pipeline", "run"):  # run/ before it moved (the planner's profile runs it too)
        shown = subprocess.run(
            ["git", "show", f"{ref}:pipedream2bw/{where}/split_backward.py"], cwd=root, capture_output=True
        )
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"--baseline {ref}: no pipedream2bw/pipeline/ or run/split_backward.py there")
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / "split_backward_at_ref.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("split_backward_at_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _profile_matmuls(forward, params, plans: dict, rounds: int) -> None:
    """``--matmuls``: each ``aten::mm``'s self CPU time under torch.profiler, by where it ran (B, W, the whole backward)
    and its input shapes (median us, calls a round): W's weight-gradient matmuls against the same ones in the whole."""
    from torch.profiler import profile, record_function

    def round_() -> None:
        x, out, grad = forward()
        with record_function("B"):
            _, work = split_backward.backward_input([out], [grad], [x], params, **plans)
        with record_function("W"):
            split_backward.backward_weight(work)
        x, out, grad = forward()
        with record_function("whole"):
            torch.autograd.backward([out], None if grad is None else [grad])

    for _ in range(3):
        round_()
    with profile(record_shapes=True) as prof:
        for _ in range(rounds):
            round_()
    found = collections.defaultdict(list)
    for event in prof.events():
        where = event.cpu_parent
        while where is not None and where.name not in ("B", "W", "whole"):
            where = where.cpu_parent
        if event.name == "aten::mm" and where is not None:
            found[(where.name, str(event.input_shapes))].append(event.self_cpu_time_total)
    print(f"aten::mm self CPU us (median of {rounds} rounds) by where it ran and its input shapes, x calls a round")
    for (where, shapes), us in sorted(found.items()):
        print(f"  {where:>5} {shapes}: {statistics.median(us):.1f} x {len(us) // rounds}")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1, help="which of the 2d chunks (0 < chunk < 2d - 1)")
    parser.add_argument("--last", action="store_true", help="the last chunk, with the loss (instead of --chunk)")
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--num-layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--baseline", default=None, help="a git revision: its split_backward.py timed beside today's")
    parser.add_argument("--matmuls", action="store_true", help="instead: each matmul's time in B, W and the whole")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _config(args)
    balance = gpt_balance(cfg.model, 2 * args.num_stages)
    chunk = len(balance) - 1 if args.last else args.chunk
    if not args.last and not 0 < chunk < len(balance) - 1:
        raise SystemExit(f"--chunk ({chunk}) must be a middle chunk: 1 .. {len(balance) - 2} (or --last)")
    module = build_stage_module(cfg, balance, chunk, None)
    params = list(module.parameters())
    splits = {"split": split_backward}
    if args.baseline:
        splits[f"split at {args.baseline}"] = _at_revision(args.baseline)

    def forward():
        x = torch.randn(args.microbatch_size, cfg.model.seq_len, cfg.model.d_model, requires_grad=True)
        out = module(x)
        if args.last:
            targets = torch.randint(0, cfg.model.vocab_size, (args.microbatch_size, cfg.model.seq_len))
            return x, lm_loss(out, targets), None
        return x, out, torch.randn_like(out)

    # B's analyses kept across microbatches, as a stage keeps them (a revision before GraphPlans: none)
    plans = {how: {"plans": m.GraphPlans()} if hasattr(m, "GraphPlans") else {} for how, m in splits.items()}
    if args.matmuls:
        return _profile_matmuls(forward, params, plans["split"], args.rounds)

    def one(how: str) -> tuple:
        x, out, grad = forward()
        grads = [grad] if grad is not None else None
        start = time.thread_time()
        if how in splits:
            _, work = splits[how].backward_input([out], [grad], [x], params, **plans[how])
            mid = time.thread_time()
            splits[how].backward_weight(work)
            end = time.thread_time()
            return (mid - start) * 1e3, (end - mid) * 1e3, (end - start) * 1e3
        if how == "input gradient only":
            torch.autograd.grad([out], [x], grads, retain_graph=True)
        else:
            torch.autograd.backward([out], grads, retain_graph=how == "whole, graph kept")
        return ((time.thread_time() - start) * 1e3,)

    hows = [*splits, "whole", "whole, graph kept", "input gradient only"]
    times = {how: [] for how in hows}
    for r in range(args.rounds):
        for how in hows if r % 2 == 0 else hows[::-1]:  # each follows another every other round: no fixed neighbour
            t = one(how)
            if r >= 3:
                times[how].append(t)
    what = "last, with the loss" if args.last else "middle"
    print(f"chunk {chunk} ({what}) of {balance} (layers a chunk), b={args.microbatch_size}: thread-CPU ms a microbatch")
    whole = statistics.median(t[0] for t in times["whole"])
    for how in hows:
        if how in splits:
            b, w, total = (statistics.median(t[i] for t in times[how]) for i in range(3))
            print(f"  {how:>22}: {total:.2f} (B {b:.2f}, W {w:.2f}); / whole: {total / whole:.3f}")
        else:
            print(f"  {how:>22}: {statistics.median(t[0] for t in times[how]):.2f}")


if __name__ == "__main__":
    main()
