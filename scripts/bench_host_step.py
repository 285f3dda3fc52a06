"""The host optimizer step (swap.optimizer=host, swap.weights): parameters per second against torch's default and the
bandwidth bound, and how the kernel rounds.

    python scripts/bench_host_step.py                        # 16 M parameters, 1 and 2 threads
    python scripts/bench_host_step.py --params 64e6 --threads 1,2,4 --grad-dtype bf16 --json out.json

For each thread count (``torch.set_num_threads``), ``--rounds`` rounds alternate three timings over the same
tensors (``--params`` float32 parameters in ``--tensors`` tensors, as a stage's layers), each the median of
``--repeats`` steps after one that makes the state:

- default: ``torch.optim.AdamW(params, lr)`` as torch builds it on the CPU (its per-tensor loop);
- ours: what the host step runs (``memory.host_optim.host_kernel``: fused AdamW), over float32 or, with
  ``--grad-dtype bf16``, bf16 gradients cast to float32 first as ``HostOptimizerVersions`` does (the cast is timed);
- the bound: bytes the step must read and write (weight and both moments read and written, the gradient read:
  ``adam_step_bytes``) over the host's bandwidth (``host_optim.copy_bandwidth``: a large copy, or an in-place add,
  between buffers already touched, bytes read plus written per second), the best median over the thread counts
  measured ("copy GB/s" is each thread count's own).

Each figure is the median over rounds; the acceptance (issue 42) is ours >= 3x default and >= 0.5x the bound.

Rounding (``--rounding-params``, one thread and two): ``--rounding-steps`` AdamW steps (weight decay 0.1) from the
same weights and gradients in float64, with torch's loop and with ours in float32: the largest and mean absolute
difference of each to the float64 weights, how many elements ours rounds otherwise than the loop, and whether ours
gives the same bits run to run and at 1 and 2 threads (reproducible).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
from torch import nn

from pipedream2bw.config.schema import OptimConfig
from pipedream2bw.memory.host_optim import adam_step_bytes, copy_bandwidth, host_kernel

LR = 1e-3


def _params(num_params: int, num_tensors: int, grad_dtype: torch.dtype):
    """The float32 parameters and their gradients (in ``grad_dtype``: torch lets no bf16 gradient sit on a float32
    parameter, so the host step casts it first)."""
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(num_params // num_tensors, generator=g)) for _ in range(num_tensors)]
    grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(grad_dtype) for p in params]
    return params, grads


def _timed_steps(step, repeats: int) -> float:
    """The median seconds of ``repeats`` calls of ``step`` after one (which makes the optimizer state)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _ours(params: List[nn.Parameter], grads: List[torch.Tensor]):
    """The host step over ``params``: a bf16 gradient is cast to the master's dtype first (timed with the step), as
    ``HostOptimizerVersions._attach_master`` does."""
    masters = [nn.Parameter(p.detach()) for p in params]  # the same storage
    opt = torch.optim.AdamW(masters, lr=LR, **host_kernel(OptimConfig(name="adamw")).kwargs)

    def step() -> None:
        for m, g in zip(masters, grads):
            m.grad = g.to(m.dtype)  # float32: the same tensor (no copy)
        opt.step()

    return step


def measure(args: argparse.Namespace, threads: int) -> Dict[str, Any]:
    torch.set_num_threads(threads)
    grad_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.grad_dtype]
    params, grads = _params(int(args.params), args.tensors, grad_dtype)
    n = sum(p.numel() for p in params)
    default_opt = torch.optim.AdamW(
        [nn.Parameter(p.detach()) for p in params], lr=LR
    )  # its own masters on the same storage, with float32 gradients (torch's default step takes no other)
    for m, g in zip(default_opt.param_groups[0]["params"], grads):
        m.grad = g.float()
    ours = _ours(params, grads)
    rows: Dict[str, List[float]] = {"default": [], "ours": [], "copy_bytes_per_s": []}
    for _ in range(args.rounds):
        rows["default"].append(n / _timed_steps(default_opt.step, args.repeats))
        rows["ours"].append(n / _timed_steps(ours, args.repeats))
        rows["copy_bytes_per_s"].append(copy_bandwidth(repeats=args.repeats))
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "threads": threads,
        "default_params_per_s": med["default"],
        "ours_params_per_s": med["ours"],
        "copy_bytes_per_s": med["copy_bytes_per_s"],
        "bytes_per_param": adam_step_bytes(grad_dtype),
        "ours_over_default": med["ours"] / med["default"],
        "rounds": rows,
    }


def add_bounds(rows: List[Dict[str, Any]]) -> None:
    """Each row's bound: the host's bandwidth (the best median over the thread counts measured: one core may not
    draw all the memory system gives, and the bound is the memory's) over the bytes a parameter's step moves."""
    host = max(r["copy_bytes_per_s"] for r in rows)
    for r in rows:
        r["host_bytes_per_s"] = host
        r["bound_params_per_s"] = host / r["bytes_per_param"]
        r["ours_over_bound"] = r["ours_params_per_s"] / r["bound_params_per_s"]


def _adamw_run(num_params: int, steps: int, *, dtype: torch.dtype, kwargs: Dict[str, Any], threads: int):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(num_params, generator=g, dtype=torch.float64)
    grads = [torch.randn(num_params, generator=g, dtype=torch.float64) * 10.0**-k for k in range(steps)]
    p = nn.Parameter(w.to(dtype))
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, **kwargs)
    for grad in grads:
        p.grad = grad.to(dtype)
        opt.step()
    return p.detach().clone()


def rounding(args: argparse.Namespace) -> Dict[str, Any]:
    """The loop's and ours' distance to a float64 step, and whether ours is reproducible (module docstring)."""
    n, steps = int(args.rounding_params), args.rounding_steps
    fused = host_kernel(OptimConfig(name="adamw")).kwargs
    ref = _adamw_run(n, steps, dtype=torch.float64, kwargs={}, threads=1)
    loop = _adamw_run(n, steps, dtype=torch.float32, kwargs={}, threads=1)
    ours = [_adamw_run(n, steps, dtype=torch.float32, kwargs=fused, threads=t) for t in (1, 1, 2)]
    dist = lambda w: (w.double() - ref).abs()  # noqa: E731
    return {
        "params": n,
        "steps": steps,
        "loop_max_abs_err": dist(loop).max().item(),
        "loop_mean_abs_err": dist(loop).mean().item(),
        "ours_max_abs_err": dist(ours[0]).max().item(),
        "ours_mean_abs_err": dist(ours[0]).mean().item(),
        "elements_ours_rounds_otherwise": int((ours[0] != loop).sum()),
        "ours_same_bits_run_to_run": torch.equal(ours[0], ours[1]),
        "ours_same_bits_1_and_2_threads": torch.equal(ours[0], ours[2]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=16e6, help="float32 parameters stepped")
    ap.add_argument("--tensors", type=int, default=16, help="tensors they are split into")
    ap.add_argument("--threads", default="1,2", help="torch.set_num_threads values, comma-separated")
    ap.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--repeats", type=int, default=5, help="steps timed per round (after one untimed)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of default, ours, copy")
    ap.add_argument("--rounding-params", type=float, default=1e6)
    ap.add_argument("--rounding-steps", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("config:", json.dumps({k: v for k, v in vars(args).items() if k != "json"}), "torch", torch.__version__)
    rows = [measure(args, int(t)) for t in args.threads.split(",")]
    add_bounds(rows)
    head = ("threads", "default", "ours", "bound", "copy GB/s", "x default", "of bound")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (7, 12, 12, 12, 10, 9, 8))))
    for r in rows:
        print(
            f"{r['threads']:>7} {r['default_params_per_s'] / 1e6:>10.1f} M {r['ours_params_per_s'] / 1e6:>10.1f} M "
            f"{r['bound_params_per_s'] / 1e6:>10.1f} M {r['copy_bytes_per_s'] / 1e9:>10.2f} "
            f"{r['ours_over_default']:>9.2f} {r['ours_over_bound']:>8.2f}"
        )
    ok = all(r["ours_over_default"] >= 3 and r["ours_over_bound"] >= 0.5 for r in rows)
    print("acceptance (>= 3x default and >= 0.5x bound at every thread count):", "met" if ok else "NOT met")
    rnd = rounding(args)
    print("rounding against a float64 step:", json.dumps(rnd))
    if args.json:
        with open(args.json, "w") as f:
            out = {"command": shlex.join(sys.argv), "config": vars(args), "rows": rows, "rounding": rnd}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
