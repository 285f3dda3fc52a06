"""Peak memory each rank adds while loading its layers of a pretrained directory (model.pretrained), at depth d.

    python scripts/measure_hf_load.py                   # a random Llama of 32M parameters (128 MB float32), d=4
    python scripts/measure_hf_load.py --stages 2 --dtype bfloat16
    python scripts/measure_hf_load.py --reader safe_open   # the same through safetensors.safe_open, to compare

Saves a random Llama with save_pretrained (sharded, as the hub's models are), then runs one fresh
process per stage that builds only its own layers from it (what a rank does at start-up,
``model_source(...).build(indices)``) and reports the peak resident set that building added
(Linux: VmHWM reset through /proc/self/clear_refs before, read after) against the bytes of its
own parameters and of the whole model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _safe_open_read(self, names, *, dtype=None):
    """The alternative measured against: each tensor through safetensors.safe_open, copied out of the mapping."""
    import torch
    from safetensors import safe_open

    out = {}
    for file in sorted({self.tensors[n][0] for n in names}):
        with safe_open(str(self.path / file), framework="pt") as f:
            for name in (n for n in names if self.tensors[n][0] == file):
                mapped = f.get_tensor(name)
                out[name] = torch.empty(mapped.shape, dtype=dtype or torch.float32).copy_(mapped)
                del mapped
    return out


def rank_main(directory: str, indices: list, reader: str) -> None:
    import torch

    from pipedream2bw.config import HFModelConfig
    from pipedream2bw.models import hf_io
    from pipedream2bw.models.factory import model_source

    if reader == "safe_open":
        hf_io.PretrainedDir.read = _safe_open_read

    source = model_source(HFModelConfig(pretrained=directory, seq_len=128), seed=0)  # header check, meta list
    torch.empty(1)  # torch's allocator set up before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status("VmRSS")
    layers = source.build(indices)
    peak, after = _status("VmHWM"), _status("VmRSS")
    own = sum(t.numel() * t.element_size() for layer in layers for t in layer.state_dict().values())
    print(json.dumps({"indices": indices, "own_bytes": own, "peak_added": peak - before, "kept": after - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--reader",
        default="pipedream2bw",
        choices=["pipedream2bw", "safe_open"],
        help="how tensors are read: the library's byte-range reads, or safetensors.safe_open (for comparison)",
    )
    parser.add_argument("--rank-of", nargs=2, help=argparse.SUPPRESS)  # internal: DIR JSON-INDICES
    args = parser.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of[0], json.loads(args.rank_of[1]), args.reader)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipedream2bw.config import even_balance

    config = LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=8192, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
        model.save_pretrained(tmp, max_shard_size="40MB")
        whole = sum(t.numel() * 4 for t in model.state_dict().values())  # as float32 masters
        files = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        del model
        balance = even_balance(config.num_hidden_layers + 3, args.stages)
        print(
            f"Llama {sum(balance)} layers, {whole / 4e6:.1f}M parameters: {whole / 2**20:.1f} MiB as float32 masters, "
            f"{files / 2**20:.1f} MiB of {args.dtype} in {len(list(Path(tmp).glob('*.safetensors')))} files; "
            f"d={args.stages}, balance {balance}"
        )
        print(f"{'stage':>5} {'layers':>10} {'own MiB':>9} {'peak added MiB':>15} {'kept MiB':>9} {'peak/own':>9}")
        start = 0
        for s, count in enumerate(balance):
            indices = list(range(start, start + count))
            start += count
            out = subprocess.run(
                [sys.executable, __file__, "--reader", args.reader, "--rank-of", tmp, json.dumps(indices)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(
                f"{s:>5} {f'{indices[0]}-{indices[-1]}':>10} {r['own_bytes'] / 2**20:>9.1f} "
                f"{r['peak_added'] / 2**20:>15.1f} {r['kept'] / 2**20:>9.1f} {r['peak_added'] / r['own_bytes']:>9.2f}"
            )
        print(f"whole model as float32: {whole / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
