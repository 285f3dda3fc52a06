"""model=hf: transformers' Llama family and GPT-2 as layer lists; pretrained directories in, exports out."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest
import torch
from dist_helper import run_ok, spawn, train_cli
from hf_models import Frozen, read_dir, save_tiny

from pipedream2bw.config import (
    Config,
    ConfigError,
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


def hf_config(pretrained: Path, d: int, w: int = 1, **train) -> Config:
    """A run of the model in ``pretrained`` on d x w ranks; the optimizer never changes a weight (lr = 0)."""
    return Config(
        pipeline=PipelineConfig(
            schedule="2bw", num_stages=d, data_parallel=w, num_microbatches=max(d, 2), microbatch_size=2
        ),
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
        load_bytes(),
        seq_len=SEQ,
        microbatch_size=p.microbatch_size,
        num_microbatches=p.num_microbatches,
        seed=cfg.seed,
        num_replicas=p.data_parallel,
    )
    return feed._batch_windows(0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,tied,d,w",
    [(k, t, d, 1) for k, t in [("llama", True), ("llama", False), ("gpt2", True)] for d in (1, 2, 4)]
    + [("llama", True, 2, 2)],
)
def test_pretrained_round_trip_and_first_loss(tmp_path, kind, tied, d, w):
    """save_pretrained -> model.pretrained at depth d -> train.export_hf after a step at lr = 0: every
    tensor equal bit for bit, the export's logits the original's, and the run's first loss
    transformers' own loss of that batch (float32 round-off)."""
    from transformers import AutoModelForCausalLM

    original = save_tiny(tmp_path / "pretrained", kind, tied=tied)
    cfg = hf_config(tmp_path / "pretrained", d, w, export_hf=str(tmp_path / "export"), save_final="none")
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


# --- in one process: the layer list, the checks before any group starts ---------------------------


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_layer_list_computes_the_transformers_model(tmp_path, kind):
    """Loaded from a sharded directory and run layer after layer: transformers' logits; the layer list's
    tensors are the model's, name for name and shape for shape (ties once)."""
    from pipedream2bw.models import hf_io
    from pipedream2bw.models.factory import model_source
    from pipedream2bw.pipeline import ties

    original = save_tiny(tmp_path, kind, shard="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2  # sharded, with an index
    source = model_source(HFModelConfig(pretrained=str(tmp_path), seq_len=SEQ), seed=0)
    x = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(1))
    h = x
    with torch.no_grad():
        for layer in source.build():
            h = layer(h)
        torch.testing.assert_close(h, original(input_ids=x).logits)
    expected = hf_io.expected_tensors(source.hf, source.meta(), ties.find_ties(source.meta()))
    assert expected == {k: list(v.shape) for k, v in read_dir(tmp_path)[0].items()}


def test_random_init_from_a_config_file_matches_the_pretrained_names(tmp_path):
    """model.config_path builds the same layer list at random (seeded per layer: any subset of layers
    gets the same weights), and a hand-written config the same as its config.json."""
    from pipedream2bw.models.factory import model_source

    save_tiny(tmp_path, "llama", tied=False)
    by_path = model_source(HFModelConfig(config_path=str(tmp_path / "config.json"), seq_len=SEQ), seed=3)
    config = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "model_type"}
    by_hand = model_source(HFModelConfig(model_type="llama", config=config, seq_len=SEQ), seed=3)
    whole, part = by_path.build(), by_hand.build([2, 4])
    for i, layer in zip([2, 4], part):
        for (n1, p1), (n2, p2) in zip(whole[i].named_parameters(), layer.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2)
    assert by_path.hf.export_config == by_hand.hf.export_config


def test_bf16_weights_load_into_float32_masters_and_export_as_bf16(tmp_path):
    """dtypes are explicit: bf16 tensors become float32 parameters (exactly), and an export writes the
    files' dtype back, bit for bit."""
    from pipedream2bw.models import hf_io
    from pipedream2bw.models.factory import model_source

    save_tiny(tmp_path, "llama", dtype=torch.bfloat16)
    source = model_source(HFModelConfig(pretrained=str(tmp_path), seq_len=SEQ), seed=0)
    layers = source.build()
    assert {p.dtype for layer in layers for p in layer.parameters()} == {torch.float32}
    state = torch.nn.Sequential(*layers).state_dict()
    exported = hf_io.to_hf_shard(source.hf, state, aliases=[f"{source.num_layers - 1}.weight"])
    original, _ = read_dir(tmp_path)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert tensor.dtype == exported[name].dtype == torch.bfloat16 and torch.equal(tensor, exported[name]), name


def _tamper(directory: Path) -> None:
    """One tensor gone, one added, one of another shape (its header says so: nothing else is read)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.7.mlp.gate.weight"] = torch.zeros(2)
    tensors["model.norm.weight"] = torch.ones(33)
    save_file(tensors, directory / "model.safetensors")


BAD_PRETRAINED = {
    "tampered": (
        _tamper,
        r"missing: model.layers.1.mlp.up_proj.weight; unexpected: model.layers.7.mlp.gate.weight; shape differs: "
        r"model.norm.weight \[33\] \(model \[32\]\)",
    ),
    "no_safetensors": (
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        r"holds neither model.safetensors nor model.safetensors.index.json \(it has \['pytorch_model.bin'\]",
    ),
    "positions": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "max_position_embeddings": 8})
        ),
        r"model.seq_len \(16\) is more than the model's max_position_embeddings \(8\)",
    ),
    "sliding": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "mistral", "sliding_window": 8})
        ),
        r"model.seq_len \(16\) is more than the sliding attention window \(8\) of this mistral config",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_PRETRAINED))
def test_a_directory_that_does_not_fit_is_named_before_any_weights_load(tmp_path, bad):
    from pipedream2bw.models.factory import model_source

    save_tiny(tmp_path, "llama", shard="10MB")
    tamper, error = BAD_PRETRAINED[bad]
    tamper(tmp_path)
    with pytest.raises(ConfigError, match=error):
        model_source(HFModelConfig(pretrained=str(tmp_path), seq_len=SEQ), seed=0)


@pytest.mark.slow
def test_bad_sources_fail_every_rank_before_any_group_starts(tmp_path):
    """Through the command line, on each rank alone: a hub name (nothing is downloaded), a directory whose
    tensors do not fit, and train.export_hf without model=hf."""
    save_tiny(tmp_path / "bad", "llama", shard="10MB")
    _tamper(tmp_path / "bad")
    common = ["model.seq_len=16", "pipeline.num_stages=2", "pipeline.num_microbatches=2", "wandb.mode=disabled"]
    runs = [
        ["model=hf", "model.pretrained=meta-llama/Llama-3.2-1B", *common, f"hydra.run.dir={tmp_path / 'a'}"],
        ["model=hf", f"model.pretrained={tmp_path / 'bad'}", *common, f"hydra.run.dir={tmp_path / 'b'}"],
        ["model=gpt", f"train.export_hf={tmp_path / 'out'}", *common, f"hydra.run.dir={tmp_path / 'c'}"],
    ]
    results = spawn(train_cli, world_size=2, args=(runs,), log_dir=tmp_path / "logs", timeout_s=240)
    for r in results:
        assert r.exitcode == 0 and "process group was started" not in r.log and r.log.count("EXIT 2") == 3, r.log
        assert re.search(r"model.pretrained \(meta-llama/Llama-3.2-1B\) is not a local directory. It looks like a "
                         r"Hugging Face hub name: nothing is downloaded", r.log), r.log  # fmt: skip
        assert "missing: model.layers.1.mlp.up_proj.weight; unexpected: model.layers.7.mlp.gate.weight" in r.log
        assert "train.export_hf (" in r.log and "needs model=hf" in r.log


def test_config_sources_are_checked(tmp_path):
    from pipedream2bw.models.hf import resolve_config

    save_tiny(tmp_path, "llama")
    cases = [
        (HFModelConfig(), r"model=hf needs a model: model.pretrained=DIR"),
        (HFModelConfig(model_type="bert"), r"model.model_type \('bert'\) is not one of"),
        (HFModelConfig(pretrained=str(tmp_path), config_path=str(tmp_path)), r"are both set"),
        (HFModelConfig(pretrained=str(tmp_path), model_type="llama"), r"drop them"),
        (HFModelConfig(pretrained=str(tmp_path / "nowhere")), r"is not a local directory. Point it at a directory"),
        (HFModelConfig(model_type="llama", config={"hidden_sise": 3}, seq_len=SEQ), None),  # transformers keeps extras
    ]
    for model, error in cases:
        if error is None:
            resolve_config(model)
            continue
        with pytest.raises(ConfigError, match=error):
            resolve_config(model)


def test_token_ids_are_checked_against_the_models_vocabulary(tmp_path):
    """The vocabulary of model=hf is its config's (config.json here), as model.vocab_size is the GPT's."""
    import numpy as np

    from pipedream2bw.run.preflight import check, hf_vocab_size

    save_tiny(tmp_path, "llama")
    cfg = hf_config(tmp_path, 2)
    assert hf_vocab_size(cfg.model) == 300
    np.array([5] * 50 + [300] * 50, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    cfg.data.path = str(tmp_path / "tokens.bin")
    with pytest.raises(ConfigError, match=r"holds token id 300 \(first id >= 300 at position 50\)"):
        check(cfg, world_size=2, num_layers=6)


@pytest.mark.slow
def test_sharded_final_weights_and_export_from_a_checkpoint(tmp_path):
    """train.save_final=sharded: each stage's own safetensors shard of final_model/ (layer-list names, each
    tie once); export-hf from the run's checkpoint: the pretrained tensors again, bit for bit."""
    from safetensors.torch import load_file

    from pipedream2bw import checkpoint as checkpoint_cli

    save_tiny(tmp_path / "pretrained", "llama", tied=True)
    cfg = hf_config(tmp_path / "pretrained", 2, save_final="sharded", checkpoint_every=1)
    run_ok(cfg, tmp_path / "run")
    original, _ = read_dir(tmp_path / "pretrained")

    final = tmp_path / "run" / "final_model"
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["0.embed_tokens.weight"] == "model-00001-of-00002.safetensors" and "5.weight" not in index
    assert torch.equal(load_file(final / index["4.weight"])["4.weight"], original["model.norm.weight"])

    assert checkpoint_cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    exported, files = read_dir(tmp_path / "export")
    assert len(files) == 2 and sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert (tmp_path / "export" / "generation_config.json").is_file()  # the pretrained directory's, carried over
    # A checkpoint of another model is refused by name.
    gpt = tmp_path / "gpt_ckpt"
    (gpt / "step_00000001").mkdir(parents=True)
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "manifest.json").read_text())
    (gpt / "step_00000001" / "manifest.json").write_text(json.dumps({**manifest, "files": {}, "hf": None}))
    assert checkpoint_cli.main(["export-hf", str(gpt), "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_compute_weight_versions_export_their_float32_masters(tmp_path):
    """train.weight_dtype=compute (bf16 versions of float32 masters), one step of SGD: final_model/
    (save_final=sharded), train.export_hf and export-hf from the checkpoint all hold the float32 masters, bit
    for bit those consolidate reads, not their bf16 rounding. Regression (issue 23): they held the bf16 version."""
    from pipedream2bw import checkpoint as checkpoint_cli
    from pipedream2bw.io import checkpoint
    from pipedream2bw.models import hf_io
    from pipedream2bw.models.factory import model_source

    save_tiny(tmp_path / "pretrained", "llama", tied=False)  # float32: exported in float32
    cfg = hf_config(tmp_path / "pretrained", 1, save_final="sharded", checkpoint_every=1, export_hf=str(tmp_path / "x"))
    cfg.train.precision, cfg.train.weight_dtype, cfg.optim = "bf16", "compute", OptimConfig(name="sgd", lr=0.1)
    run_ok(cfg, tmp_path / "run")
    masters = torch.load(checkpoint.consolidate(tmp_path / "run"))  # layer-list names, float32
    assert any(not torch.equal(v, v.bfloat16().float()) for v in masters.values())
    final, _ = read_dir(tmp_path / "run" / "final_model")
    assert final.keys() == masters.keys() and all(torch.equal(final[k], v) for k, v in masters.items())
    expected = hf_io.to_hf_shard(model_source(cfg.model, seed=cfg.seed).hf, masters, [])
    assert checkpoint_cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "from_checkpoint")]) == 0
    for out in ("x", "from_checkpoint"):
        exported, _ = read_dir(tmp_path / out)
        assert exported.keys() == expected.keys(), out
        assert all(torch.equal(exported[k], v) for k, v in expected.items()), out


# --- the walk-through of docs/pretrained.md --------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "pretrained.md"
# What the walk-through says for a 1B model -> what this test runs on a tiny one; each must be in the docs.
TINY = {
    "MODEL=path/to/Llama-3.2-1B": "MODEL=$TEST_MODEL",
    "CORPUS=my_corpus.txt": "CORPUS=$TEST_CORPUS",
    "model.seq_len=512": "model.seq_len=32",
    "optim.lr=2e-5 train.num_steps=500 train.checkpoint_every=250": "optim.lr=1e-2 train.num_steps=4 "
    "train.checkpoint_every=2",
    "hydra.run.dir=outputs/finetune": "hydra.run.dir=outputs/finetune wandb.mode=disabled",
}


def walkthrough_script(name: str = "walkthrough", tiny_values: Optional[Dict[str, str]] = None) -> str:
    """The bash block between ``<!-- name:start -->`` and ``<!-- name:end -->`` of docs/pretrained.md, each of
    ``tiny_values``' strings (``TINY`` by default) replaced by its tiny value."""
    text = DOCS.read_text()
    block = text.split(f"<!-- {name}:start -->")[1].split(f"<!-- {name}:end -->")[0]
    script = block.split("```bash\n", 1)[1].rsplit("```", 1)[0]
    for doc, tiny in (TINY if tiny_values is None else tiny_values).items():
        assert doc in script, f"docs/pretrained.md no longer says {doc!r}: update TINY"
        script = script.replace(doc, tiny)
    return script


@pytest.mark.slow
@pytest.mark.long
def test_fine_tuning_walkthrough_of_the_docs(tmp_path):
    """docs/pretrained.md's commands on a tiny Llama whose directory holds a tokenizer.json trained here:
    tokenize with it, fine-tune at d = 2 (the loss falls), export at the end and from the checkpoint
    (equal), load the export with transformers and generate."""
    import subprocess

    model_dir, env, prelude = walkthrough_setup(tmp_path)
    done = subprocess.run(
        ["bash", "-c", prelude + walkthrough_script()], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.rstrip().splitlines()[-1].startswith("def fibonacci(n):"), done.stdout  # generated

    summary = json.loads((tmp_path / "outputs" / "finetune" / "summary.json").read_text())
    assert summary["final_loss"] < summary["losses"][0]
    trained, files = read_dir(tmp_path / "finetuned")
    pretrained, _ = read_dir(model_dir)
    assert len(files) == 2 and sorted(trained) == sorted(pretrained)
    assert not torch.equal(
        trained["model.layers.0.mlp.up_proj.weight"], pretrained["model.layers.0.mlp.up_proj.weight"]
    )
    from_checkpoint, _ = read_dir(tmp_path / "finetuned-from-checkpoint")
    assert all(torch.equal(from_checkpoint[k], v) for k, v in trained.items())
    assert (tmp_path / "finetuned" / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def walkthrough_setup(tmp_path: Path) -> Tuple[Path, Dict[str, str], str]:
    """A tiny tied Llama whose directory holds a tokenizer.json trained here on the shipped corpus's first 60 KB
    (written to corpus.txt), scripts/ linked in: (its directory, the environment, a bash prelude) for running a
    walk-through's commands in ``tmp_path``."""
    import os
    import sys

    from transformers import PreTrainedTokenizerFast

    tokenizers = pytest.importorskip(
        "tokenizers", reason="the walk-through needs the extra: pip install -e '.[tokenize]'"
    )

    from pipedream2bw.data import SHIPPED_CORPUS
    from pipedream2bw.pipeline.comm import free_port

    repo = DOCS.parents[1]
    text = __import__("gzip").decompress(SHIPPED_CORPUS.read_bytes())[:60_000].decode("utf-8", "replace")
    (tmp_path / "corpus.txt").write_text(text)
    model_dir = tmp_path / "tiny-llama"
    save_tiny(model_dir, "llama", tied=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [text], tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=alphabet)
    )
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(model_dir)
    (tmp_path / "scripts").symlink_to(repo / "scripts")  # the docs' paths are the repository's

    prelude = f'torchrun() {{ python -m torch.distributed.run --master-port {free_port()} "$@"; }}\nset -e\n'
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(repo),
        "TEST_MODEL": str(model_dir),
        "TEST_CORPUS": str(tmp_path / "corpus.txt"),
    }
    return model_dir, env, prelude


def _prepare_tokens():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_tokens", DOCS.parents[1] / "scripts" / "prepare_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_tokens_says_what_a_tokenizer_needs(tmp_path, monkeypatch):
    """hf:DIR without a tokenizer.json, and tiktoken when its encoding's file cannot be downloaded (a raw
    connection traceback before): a plain message saying what to do."""
    prepare = _prepare_tokens()
    with pytest.raises(SystemExit, match=r"tokenizer.json is not a file; the model directory needs its fast"):
        prepare.make_tokenizer(f"hf:{tmp_path}")
    tiktoken_load = pytest.importorskip("tiktoken.load", reason="the optional extra: pip install -e '.[tokenize]'")
    import requests

    def offline(blobpath):  # what requests raises on a machine without a network
        raise requests.exceptions.ConnectionError(f"Failed to resolve host of {blobpath}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tiktoken_load, "read_file", offline)
    with pytest.raises(SystemExit, match=r"tiktoken:gpt2 needs the encoding's file, which tiktoken downloads on first"):
        prepare.make_tokenizer("tiktoken:gpt2")
