"""model=hf: transformers' Llama family and GPT-2 as layer lists; pretrained directories in, exports out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_helper import run_ok
from hf_models import Frozen, read_dir, save_tiny

from pipedream2bw.config import (
    Config,
    HFModelConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
    WandbConfig,
)
from pipedream2bw.data import MicrobatchFeed, load_bytes

pytest.importorskip("transformers", reason="model=hf needs the optional extra: pip install -e '.[hf]'")
pytest.importorskip("safetensors", reason="model=hf needs the optional extra: pip install -e '.[hf]'")

SEQ = 16


def hf_config(pretrained: Path, d: int, **train) -> Config:
    """A run of the model in ``pretrained`` at depth ``d``; the optimizer never changes a weight (lr = 0)."""
    return Config(
        pipeline=PipelineConfig(schedule="2bw", num_stages=d, num_microbatches=max(d, 2), microbatch_size=2),
        model=HFModelConfig(pretrained=str(pretrained), seq_len=SEQ),
        optim=OptimConfig(name="frozen", target=f"{Frozen.__module__}.Frozen", lr=1.0),
        train=TrainConfig(num_steps=1, log_every=100, warmup_steps=0, **train),
        wandb=WandbConfig(mode="disabled"),
        seed=5,
    )


def first_batch(cfg: Config) -> torch.Tensor:
    """Batch 0's windows (w*m*b, T+1) as the pipeline's feed draws them from the shipped corpus."""
    p = cfg.pipeline
    feed = MicrobatchFeed(
        load_bytes(), seq_len=SEQ, microbatch_size=p.microbatch_size, num_microbatches=p.num_microbatches, seed=cfg.seed
    )
    return feed._batch_windows(0)


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("kind,tied", [("llama", True), ("llama", False), ("gpt2", True)])
def test_pretrained_round_trip_and_first_loss(tmp_path, kind, tied, d):
    """save_pretrained -> model.pretrained at depth d -> train.export_hf after a step at lr = 0: every
    tensor equal bit for bit, the export's logits the original's, and the run's first loss
    transformers' own loss of that batch (float32 round-off)."""
    from transformers import AutoModelForCausalLM

    original = save_tiny(tmp_path / "pretrained", kind, tied=tied)
    cfg = hf_config(tmp_path / "pretrained", d, export_hf=str(tmp_path / "export"), save_final="none")
    summary = run_ok(cfg, tmp_path / "run")

    before, _ = read_dir(tmp_path / "pretrained")
    after, files = read_dir(tmp_path / "export")
    assert files == {f"model-{s + 1:05d}-of-{d:05d}.safetensors" for s in range(d)}  # one shard per stage
    assert sorted(after) == sorted(before)  # the tied head's name absent from both
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(before)
    assert not list(tmp_path.glob(".export.partial")) and not (tmp_path / "run" / "final_model.pt").exists()

    windows = first_batch(cfg)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.equal(exported(input_ids=windows).logits, original(input_ids=windows).logits)
        expected = original(input_ids=windows, labels=windows).loss  # transformers shifts the labels itself
    torch.testing.assert_close(torch.tensor(summary["losses"][0]), expected.float())
