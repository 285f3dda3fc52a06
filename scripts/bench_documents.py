"""Throughput of packed documents (data.packing=documents) against fixed windows of the same token count.

    python scripts/bench_documents.py [--nproc 2] [--repeats 3] [--steps 20] [overrides ...]

Both run the real command (python -m pipedream2bw.train, launched as torchrun does) on the same GPT, layout and
batch shape (rows of model.seq_len tokens, b rows a microbatch, m microbatches a batch): windows draw rows from the
shipped text, documents pack the shipped example documents (pipedream2bw/data/python_docs_qa.jsonl) into rows,
padded to model.seq_len, with the block-diagonal attention mask built in every block. The two alternate within
each repeat so that machine drift hits them alike. Prints the medians of samples/s (rows a second) and tokens/s
(row slots a second; for documents also the document tokens, padding left out), then what the mask alone costs
in one process (the GPT's forward and backward on a microbatch of windows against one of packed rows, alternating),
and writes it all as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pipedream2bw.run.launch import LaunchError, launch_train, worker_threads

PACKINGS = ("windows", "documents")


def run_once(packing: str, *, nproc: int, m: int, b: int, steps: int, overrides, out_dir: Path) -> dict:
    run_dir = out_dir / f"{packing}-{time.monotonic_ns()}"
    try:
        launch_train(
            [
                f"data.packing={packing}",
                f"pipeline.num_stages={nproc}",
                f"pipeline.num_microbatches={m}",
                f"pipeline.microbatch_size={b}",
                f"train.num_steps={steps}",
                "wandb.mode=disabled",
                *overrides,
            ],
            nproc=nproc,
            run_dir=run_dir,
        )
    except LaunchError as e:
        raise SystemExit(f"{packing} failed: {e}; see {run_dir}/train.log and {run_dir}/launch/") from e
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "step_time_s": summary["step_time_s"]}


def real_fraction(seq_len: int, rows: int) -> float:
    """The share of the first ``rows`` packed rows' slots that hold document tokens (the rest is padding)."""
    from pipedream2bw.config import Config
    from pipedream2bw.data.documents import DocumentFeed, load_documents

    docs = load_documents(None, lambda path: None)  # the shipped example, as the runs read it (the default seed)
    feed = DocumentFeed(docs, seq_len=seq_len, microbatch_size=1, num_microbatches=1, seed=Config().seed)
    return feed.real_tokens(0, rows) / (rows * seq_len)


def mask_cost(seq_len: int, microbatch_size: int, repeats: int) -> dict:
    """One process, one thread: the default GPT's forward and backward on one microbatch of windows against one of
    packed rows (the mask built in every block, attention with it), alternating; medians of ``repeats`` in ms."""
    import torch

    from pipedream2bw.config import Config, GPTConfig
    from pipedream2bw.data.documents import DocumentFeed, load_documents
    from pipedream2bw.models.gpt import build_gpt_layers, lm_loss

    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=seq_len)
    model = torch.nn.Sequential(*build_gpt_layers(cfg, seed=0))
    feed = DocumentFeed(
        load_documents(None, lambda path: None), seq_len=seq_len, microbatch_size=microbatch_size,
        num_microbatches=1, seed=Config().seed,
    )  # fmt: skip
    (ids, positions), (targets, weights) = feed.microbatch(0)
    cases = {"windows": (ids, targets), "documents": ((ids, positions), (targets, weights))}
    times = {name: [] for name in cases}
    for _ in range(repeats + 2):  # the first two left out (warm-up)
        for name, (x, y) in cases.items():
            start = time.perf_counter()
            lm_loss(model(x), y).backward()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks: pipeline stages")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mask-repeats", type=int, default=30, help="in-process timings of the mask alone")
    parser.add_argument("--json", default="bench_documents.json")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.d_model=256")
    args = parser.parse_args()
    m, b, T = args.num_microbatches, args.microbatch_size, args.seq_len
    overrides = [f"model.seq_len={T}", *args.overrides]
    print("command:", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(
        f"config: {args.nproc} stages, m={m} b={b} seq_len={T}, {args.steps} steps (warm-up left out), "
        f"{args.repeats} repeats, overrides={args.overrides}; OMP_NUM_THREADS per rank: "
        f"{worker_threads(args.nproc) or 'all cores'}"
    )
    results = {p: [] for p in PACKINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for packing in PACKINGS:
                r = run_once(
                    packing, nproc=args.nproc, m=m, b=b, steps=args.steps, overrides=overrides, out_dir=Path(tmp)
                )
                results[packing].append(r)
                print(f"  repeat {repeat} {packing}: {r['samples_per_s']:.1f} samples/s", flush=True)
    real = real_fraction(T, args.steps * m * b)
    rows = {}
    print(f"\n{'packing':>10} {'samples/s':>10} {'tokens/s':>10} {'document tokens/s':>18} {'vs windows':>10}")
    base = statistics.median(r["samples_per_s"] for r in results["windows"])
    for packing, runs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in runs)
        share = real if packing == "documents" else 1.0
        rows[packing] = {"samples_per_s": sps, "tokens_per_s": sps * T, "real_tokens_per_s": sps * T * share}
        rows[packing]["runs"] = runs
        print(f"{packing:>10} {sps:>10.1f} {sps * T:>10.0f} {sps * T * share:>18.0f} {sps / base:>10.2f}")
    print(f"document tokens fill {100 * real:.1f}% of the packed rows' slots (the rest is padding)")
    cost = mask_cost(T, b, args.mask_repeats)
    print(
        f"the mask alone (one process, one thread, forward + backward of one microbatch, median of "
        f"{args.mask_repeats}): windows {cost['windows']:.1f} ms, documents {cost['documents']:.1f} ms "
        f"({cost['documents'] / cost['windows']:.3f}x)"
    )
    out = {"config": vars(args), "real_fraction": real, "results": rows, "mask_ms": cost}
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
