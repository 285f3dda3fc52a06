"""The optimizer step's time of optim.name=adamw_rotated against adamw, over a GPT's parameters (issue 46).

    nice -n 19 python scripts/bench_rotation_step.py [--num-layers 4] [--d-model 64] [--steps 60] [--threads 1]
        [--rotation-every 10,1]

Builds the GPT's layers, tags its hidden matrices as a stage does (optim.muon_exclude's defaults), gives every
parameter a random gradient and times --steps optimizer steps of each optimizer (the first 10 left out): the median
step (a step without a refresh, for the rotation) and the mean (refreshes included: two eigendecompositions per
matrix every rotation_every steps). Prints one line per optimizer.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(prog="bench_rotation_step.py", description=__doc__.split("\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rotation-every", default="10,1", help="optim.rotation_every values, comma-separated")
    args = p.parse_args()

    import torch

    from pipedream2bw.config import GPTConfig, OptimConfig, build_optimizer
    from pipedream2bw.config.optimizers import muon_edge_layers, tag_muon_params
    from pipedream2bw.models.gpt import build_gpt_layers

    torch.set_num_threads(args.threads)
    cfg = GPTConfig(num_layers=args.num_layers, d_model=args.d_model, num_heads=args.num_heads, seq_len=64)
    model = torch.nn.Sequential(*build_gpt_layers(cfg, seed=0))
    tag_muon_params(model, OptimConfig().muon_exclude, edge_layers=muon_edge_layers(len(model)))
    torch.manual_seed(0)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-2
    settings = [("adamw", 10)] + [("adamw_rotated", int(k)) for k in args.rotation_every.split(",")]
    for name, every in settings:
        opt = build_optimizer(model.parameters(), OptimConfig(name=name, lr=1e-4, rotation_every=every))
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        kept = times[10:]
        label = name if name == "adamw" else f"{name} rotation_every={every}"
        print(f"{label}: median step {statistics.median(kept) * 1e3:.2f} ms, mean {statistics.mean(kept) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
