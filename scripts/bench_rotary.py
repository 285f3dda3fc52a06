"""Where model=hf computes rotary cos/sin: in each decoder layer, or once and carried across stages (measured).

    python scripts/bench_rotary.py                       # Llama layer: hidden 1024, 16 heads (8 KV), T 512, b 2
    python scripts/bench_rotary.py --hidden 2048 --seq-len 1024 --microbatch 1

Times one decoder layer's forward + backward (median of --repeats, one thread) as model=hf runs it
(``models.hf.DecoderLayer``: cos/sin from the positions in every layer) and with cos/sin computed
once beforehand and passed in (what carrying them from the embedding would cost per layer: nothing),
and the rotary computation alone. Carrying would add 2 x (T, head_dim) values to every stage
boundary's transfer; the script prints that against the hidden states' (b, T, hidden).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from pipedream2bw.config.docs import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaConfig

    from pipedream2bw.config import HFModelConfig
    from pipedream2bw.models.hf import build_hf_layers, resolve_config

    config = dict(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=1,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=256,
        max_position_embeddings=args.seq_len,
    )
    LlamaConfig(**config)  # fails early on a bad shape
    hf = resolve_config(HFModelConfig(model_type="llama", config=config, seq_len=args.seq_len))
    block = build_hf_layers(hf, seed=0, indices=[1])[0]  # models.hf.DecoderLayer
    x = torch.randn(args.microbatch, args.seq_len, args.hidden, requires_grad=True)
    positions = torch.arange(args.seq_len)[None]
    cos_sin = block.rotary(x, positions)

    def in_layer():
        block(x).sum().backward()

    def carried():
        block.layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin).sum().backward()

    t_in, t_carried = _median_s(in_layer, args.repeats), _median_s(carried, args.repeats)
    t_rotary = _median_s(lambda: block.rotary(x, positions), args.repeats * 10)
    head_dim = args.hidden // args.heads
    extra = 2 * args.seq_len * head_dim / (args.microbatch * args.seq_len * args.hidden)
    print(
        f"Llama layer hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), T={args.seq_len}, "
        f"b={args.microbatch}, 1 thread, median of {args.repeats}"
    )
    print(f"  forward+backward, cos/sin computed in the layer:  {t_in * 1e3:8.2f} ms")
    print(f"  forward+backward, cos/sin computed before:        {t_carried * 1e3:8.2f} ms")
    print(f"  rotary cos/sin alone:                             {t_rotary * 1e3:8.3f} ms ({t_rotary / t_carried:.2%})")
    print(f"  carrying cos/sin would add {extra:.2%} to every boundary's transfer of the hidden states")


if __name__ == "__main__":
    main()
