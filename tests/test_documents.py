"""Packed documents (data.packing=documents): the packer, the document mask, the loss mask, and training through
the pipeline exactly as one process trains, at every layout, under 2bw and flush, resumed mid-epoch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helper import run_ok
from hf_models import tiny_hf_config
from reference import reference_eval, reference_run
from test_data import _prepare_tokens
from test_semantics import assert_losses_close, tiny_config

from pipedream2bw.config import ConfigError, GPTConfig, HFModelConfig, LayerListConfig, validate
from pipedream2bw.data import DocumentFeed, Documents, index_path, make_feeds, pack, tokenize_jsonl
from pipedream2bw.models import gpt, hf
from pipedream2bw.models.factory import model_source
from pipedream2bw.models.gpt import build_gpt_layers, lm_loss
from pipedream2bw.run.preflight import check

SEQ_LEN = 16


def write_jsonl(path: Path, num_docs: int = 24, seed: int = 0) -> Path:
    """Documents of 1 to 40 bytes (some longer than SEQ_LEN), one in three a prompt/response pair."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(num_docs):
            text = "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(1, 41))))
            if i % 3 == 0:
                cut = int(rng.integers(0, len(text) + 1))
                f.write(json.dumps({"prompt": text[:cut], "response": text[cut:]}) + "\n")
            else:
                f.write(json.dumps({"text": text}) + "\n")
    return path


def doc_config(tmp_path: Path, *, schedule="2bw", d=2, w=1, m=4, num_steps=6, eval_every=2):
    """The tiny GPT (seq_len 16) on 24 byte-level documents, 1/6 of them held out; 8 rows a batch at every
    layout (b = 8 / (w m)); SGD with momentum (replicas sum in another order)."""
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        write_jsonl(path)
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="sgd_momentum", num_steps=num_steps)
    cfg.pipeline = dataclasses.replace(cfg.pipeline, data_parallel=w, microbatch_size=8 // (w * m))
    cfg.model = dataclasses.replace(cfg.model, seq_len=SEQ_LEN)
    cfg.data = dataclasses.replace(cfg.data, path=str(path), packing="documents", val_fraction=1 / 6)
    cfg.train = dataclasses.replace(cfg.train, eval_every=eval_every, eval_batches=2)
    return cfg


# --- pure: the packer and the feed ---------------------------------------------------------------------------------


def test_packer_keeps_documents_whole_in_order_and_splits_only_the_long_ones():
    lengths = np.array([5, 9, 3, 20, 16, 1])
    pieces = pack(lengths, np.arange(6), 16)
    # (row, document, offset, length): 5 + 9 fill row 0; 3 starts row 1 (5 + 9 + 3 > 16); 20 splits into 16 + 4
    assert pieces.tolist() == [
        [0, 0, 0, 5],
        [0, 1, 0, 9],
        [1, 2, 0, 3],
        [2, 3, 0, 16],
        [3, 3, 16, 4],
        [4, 4, 0, 16],
        [5, 5, 0, 1],
    ]
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 50, 200)
    pieces = pack(lengths, rng.permutation(200), 16)
    fill = np.bincount(pieces[:, 0], weights=pieces[:, 3])
    assert fill.max() <= 16 and np.all(np.diff(pieces[:, 0]) >= 0)
    for doc in range(200):  # each document whole in one row, unless longer than a row
        rows = pieces[pieces[:, 1] == doc]
        assert rows[:, 3].sum() == lengths[doc] and (len(rows) == 1) == (lengths[doc] <= 16)


def test_feed_rows_restart_positions_mask_prompts_and_pad():
    # two documents: "abcd" (prompt "ab"), "xyz": one row of 8 with a slot of padding
    tokens = np.array([1, 2, 3, 4, 7, 8, 9])
    docs = Documents(tokens, np.array([[0, 4, 2], [4, 7, 0]]))
    feed = DocumentFeed(docs, seq_len=8, microbatch_size=1, num_microbatches=1, seed=0, shuffle=False)
    ids, positions, targets, keep = (a[0].tolist() for a in feed.rows(0, 1))
    assert ids == [1, 2, 3, 4, 7, 8, 9, 0]
    assert positions == [0, 1, 2, 3, 0, 1, 2, 0]
    assert targets == [2, 3, 4, 0, 8, 9, 0, 0]
    # a target counts if it is in the document and not in its prompt: 3, 4 of the first, 8, 9 of the second
    assert keep == [False, True, True, False, True, True, False, False]
    (_, _), (_, weights) = feed.microbatch(0)
    assert weights[0].tolist() == [0, 0.25, 0.25, 0, 0.25, 0.25, 0, 0]  # w * m / N = 1 / 4


def _global_batch(docs, t, *, w, m, b):
    feeds = [
        DocumentFeed(docs, seq_len=SEQ_LEN, microbatch_size=b, num_microbatches=m, seed=5, num_replicas=w, replica=r)
        for r in range(w)
    ]
    parts = [f.microbatch(t * m + j) for f in feeds for j in range(m)]
    ids, positions, targets, weights = (torch.cat([p[i][k] for p in parts]) for i in range(2) for k in range(2))
    return ids, positions, targets, weights / (w * m)  # each token's share of the batch's loss


def test_the_same_batches_at_any_layout_and_resumed_mid_epoch(tmp_path):
    docs = tokenize_jsonl(write_jsonl(tmp_path / "d.jsonl"))
    walked = DocumentFeed(docs, seq_len=SEQ_LEN, microbatch_size=8, num_microbatches=1, seed=5)
    epoch_rows = int(walked._pack_epoch(0)[-1, 0]) + 1
    assert 8 < epoch_rows < 7 * 8 and epoch_rows % 8  # the 7 batches below cross an epoch boundary, mid-batch
    batches = [_global_batch(docs, t, w=1, m=1, b=8) for t in range(7)]
    for w, m, b in [(1, 4, 2), (2, 2, 2), (2, 1, 4), (4, 2, 1)]:
        for t in range(7):
            for got, want in zip(_global_batch(docs, t, w=w, m=m, b=b), batches[t]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"{(w, m, b, t)}")
    # a fresh feed asked for batch 5 first (a run resumed there, mid-epoch) reads what one that walked reads
    for got, want in zip(_global_batch(docs, 5, w=2, m=2, b=2), batches[5]):
        assert torch.equal(got, want)
    # every training token once per epoch: the first epoch's rows hold each document's tokens exactly once
    ids, _, _, _ = walked.rows(0, epoch_rows)
    assert sorted(ids[ids != 0].tolist()) == sorted(docs.tokens[docs.tokens != 0].tolist())
    # each batch's weights sum to w * m = 1 (the mean over its unmasked tokens); each epoch has its own order
    assert all(float(bt[3].sum()) == pytest.approx(1.0) for bt in batches)
    assert not np.array_equal(walked._pack_epoch(0)[:, 1], walked._pack_epoch(1)[:, 1])


def test_a_batch_loss_is_the_mean_over_its_unmasked_tokens(tmp_path):
    # not the mean of per-microbatch means: microbatches hold different numbers of unmasked tokens
    torch.manual_seed(0)
    model, docs = _gpt(), tokenize_jsonl(write_jsonl(tmp_path / "d.jsonl"))
    w, m, b = 2, 2, 2
    feeds = [
        DocumentFeed(docs, seq_len=SEQ_LEN, microbatch_size=b, num_microbatches=m, seed=5, num_replicas=w, replica=r)
        for r in range(w)
    ]
    with torch.no_grad():
        losses = [lm_loss(model(f.inputs(k)), f.targets(k)) for f in feeds for k in range(m)]
        ids, positions, targets, keep = (torch.from_numpy(a) for a in feeds[0].rows(0, w * m * b))
        ce = torch.nn.functional.cross_entropy(
            model((ids, positions)).flatten(0, 1), targets.flatten(), reduction="none"
        )
    counts = [int((f.targets(k)[1] > 0).sum()) for f in feeds for k in range(m)]
    assert len(set(counts)) > 1
    torch.testing.assert_close(torch.stack(losses).mean(), ce[keep.flatten()].mean(), rtol=1e-5, atol=0)


def _gpt():
    cfg = GPTConfig(num_layers=2, d_model=32, num_heads=2, seq_len=SEQ_LEN)
    return torch.nn.Sequential(*build_gpt_layers(cfg, seed=0))


def _two_documents():
    ids = torch.randint(0, 256, (1, SEQ_LEN))
    positions = torch.tensor([list(range(6)) + list(range(10))])  # a document of 6 tokens, then one of 10
    return ids, positions


def test_no_token_attends_across_a_document_boundary():
    torch.manual_seed(0)
    model = _gpt()
    ids, positions = _two_documents()
    other = ids.clone()
    other[0, :6] = torch.randint(0, 256, (6,))  # another first document
    with torch.no_grad():
        packed, changed = model((ids, positions)), model((other, positions))
        alone = model((ids[:, 6:], positions[:, 6:]))  # the second document by itself
    torch.testing.assert_close(changed[:, 6:], packed[:, 6:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-5, atol=1e-6)
    assert (changed[:, :6] - packed[:, :6]).abs().max() > 1e-3  # the first document's own logits did change


def test_the_check_above_fails_without_the_mask(monkeypatch):
    # the same model with plain causal attention (the mask dropped): the second document sees the first
    causal = lambda pos: torch.ones(pos.shape[1], pos.shape[1], dtype=torch.bool).tril()  # noqa: E731
    monkeypatch.setattr(gpt, "document_mask", causal)
    with pytest.raises(AssertionError):
        test_no_token_attends_across_a_document_boundary()


def _grads(model, x, y):
    model.zero_grad()
    lm_loss(model(x).float(), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_masked_targets_and_padding_change_no_gradient(tmp_path):
    torch.manual_seed(0)
    model = _gpt()
    docs = tokenize_jsonl(write_jsonl(tmp_path / "d.jsonl"))
    feed = DocumentFeed(docs, seq_len=SEQ_LEN, microbatch_size=8, num_microbatches=1, seed=5)
    (ids, positions), (targets, weights) = feed.microbatch(0)
    masked, padding = weights == 0, ids == 0  # byte-level letters: id 0 is padding only
    assert padding.any() and (masked & ~padding).any()  # padding, and prompts and documents' last tokens
    grads = _grads(model, (ids, positions), (targets, weights))
    changed_targets = torch.where(masked, torch.randint(0, 256, targets.shape), targets)
    changed_ids = torch.where(padding, torch.randint(1, 256, ids.shape), ids)
    for x, y in [((ids, positions), (changed_targets, weights)), ((changed_ids, positions), (targets, weights))]:
        got = _grads(model, x, y)
        for name in grads:
            torch.testing.assert_close(got[name], grads[name], rtol=1e-5, atol=0)


def _hf(kind: str, *, tied: bool = False) -> HFModelConfig:
    config = tiny_hf_config(kind, tied=tied).to_dict()
    for key in ("architectures", "transformers_version", "model_type"):
        config.pop(key, None)
    return HFModelConfig(model_type=kind, config=config, seq_len=SEQ_LEN)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_hf_families_attend_within_each_document(kind, monkeypatch):
    pytest.importorskip("transformers")
    model = torch.nn.Sequential(*model_source(_hf(kind), seed=0).build())
    ids, positions = _two_documents()
    with torch.no_grad():
        packed = model((ids, positions))
        # each document alone, through the plain path (transformers' own positions and causal attention)
        alone = torch.cat([model(ids[:, :6]), model(ids[:, 6:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(hf, "document_mask", lambda positions: None)  # the mask dropped: causal over the row
    with torch.no_grad():
        assert (model((ids, positions))[:, 6:] - alone[:, 6:]).abs().max() > 1e-4


# --- config: what is refused -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda c: setattr(c.train, "precision", "fp16"), "train.precision=fp16"),
        (lambda c: setattr(c.swap, "optimizer", "host"), "swap.weights/swap.optimizer"),
        (lambda c: setattr(c.data, "packing", "rows"), "data.packing"),
    ],
)
def test_unproven_combinations_are_refused_in_one_line(tmp_path, change, key):
    cfg = doc_config(tmp_path)
    change(cfg)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("/", "/")) as e:
        validate(cfg, world_size=2)
    assert "\n" not in str(e.value) and ("data.packing=windows" in str(e.value) or key == "data.packing")


def test_layer_lists_and_bad_document_files_are_refused(tmp_path):
    cfg = doc_config(tmp_path)
    cfg.model = LayerListConfig(target="custom_models.tuple_layers", kwargs={"width": 8}, seq_len=8)
    with pytest.raises(ConfigError, match=r"a layer list \(model=custom\)"):
        validate(cfg, world_size=2, num_layers=4)
    cfg = doc_config(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    cfg.data.path = str(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="line 2 is not"):  # before any process group starts
        check(cfg, world_size=2)
    (tmp_path / "t.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    cfg.data.path = str(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match="has no document index"):
        check(cfg, world_size=2)
    cfg.data.path, cfg.data.val_fraction = str(write_jsonl(tmp_path / "one.jsonl", num_docs=1)), 0.5
    with pytest.raises(ConfigError, match="holds 1 documents: 1 to train on and 0 held out"):
        check(cfg, world_size=2)


def test_hf_gpt2_is_refused(tmp_path):
    pytest.importorskip("transformers")
    cfg = doc_config(tmp_path)
    cfg.model = _hf("gpt2")
    with pytest.raises(ConfigError, match="not gpt2") as e:
        check(cfg, world_size=2, num_layers=6)  # 3 blocks + embedding, norm, head
    assert "\n" not in str(e.value)


def test_prepare_tokens_documents_gives_the_batches_of_the_jsonl(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl")
    _prepare_tokens().main([str(jsonl), "--documents", "--out", str(tmp_path / "d.bin")])
    assert index_path(tmp_path / "d.bin").is_file()
    cfg = doc_config(tmp_path)
    feeds = {}
    for path in (jsonl, tmp_path / "d.bin"):
        cfg.data.path = str(path)
        check(cfg, world_size=2)
        feeds[path] = make_feeds(
            cfg.data, seq_len=16, microbatch_size=2, num_microbatches=4, seed=0, num_replicas=1, replica=0
        )
    for k in range(12):
        for a, b in zip(*(torch.utils._pytree.tree_leaves(f[0].microbatch(k)) for f in feeds.values())):
            assert torch.equal(a, b)
        for a, b in zip(*(torch.utils._pytree.tree_leaves(f[1].microbatch(k)) for f in feeds.values())):
            assert torch.equal(a, b)


# --- through the pipeline, against one process ---------------------------------------------------------------------


def reference(cfg, *, delayed):
    """One process on the pipeline's global batch: its w * m microbatches, each replica's gradients summed first."""
    p = cfg.pipeline
    one = dataclasses.replace(
        cfg, pipeline=dataclasses.replace(p, num_microbatches=p.data_parallel * p.num_microbatches)
    )
    return reference_run(one, delayed=delayed, replicas=(p.data_parallel,) * 2)


LAYOUTS = {"1x1": (1, 1, 4), "2x1": (2, 1, 4), "2x2": (2, 2, 2)}  # d, w, m: 8 rows a batch everywhere


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("document_runs")
    out = {}
    for name, (d, w, m) in LAYOUTS.items():
        cfg = doc_config(base, d=d, w=w, m=m)
        out[name] = (cfg, run_ok(cfg, base / name), torch.load(base / name / "final_model.pt"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_documents_train_as_one_process_under_2bw(runs, name):
    cfg, summary, weights = runs[name]
    ref = reference(cfg, delayed=True)
    torch.testing.assert_close(weights, ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)
    assert [v["step"] for v in summary["val_losses"]] == [2, 4, 6]
    assert_losses_close([summary["final_val_loss"]], [reference_eval(cfg, weights)])


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, recompute",
    [
        ("flush", False),
        pytest.param("gpipe", True, marks=pytest.mark.long),
        pytest.param("2bw", True, marks=pytest.mark.long),
    ],
)
def test_packed_documents_train_as_one_process_under_flush_gpipe_and_recompute(tmp_path, schedule, recompute):
    cfg = doc_config(tmp_path, schedule=schedule, d=2, w=2, m=2, eval_every=0)
    cfg.pipeline.recompute = recompute
    summary = run_ok(cfg, tmp_path / "run")
    ref = reference(cfg, delayed=schedule == "2bw")
    torch.testing.assert_close(torch.load(tmp_path / "run" / "final_model.pt"), ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)


@pytest.mark.slow
def test_packed_documents_train_as_one_process_under_zbv(tmp_path):
    # zbv (issue 46): (ids, positions) enter chunk 0 on rank 0, positions cross every chunk boundary beside the
    # activations (rank 1's hand-off from chunk 1 to 2 too), the weighted loss is taken at chunk 3 on rank 0; a
    # validation pass follows the V. Flush's update, against one process.
    cfg = doc_config(tmp_path, schedule="zbv", d=2, w=1, m=4, num_steps=4)
    summary = run_ok(cfg, tmp_path / "run")
    weights = torch.load(tmp_path / "run" / "final_model.pt")
    ref = reference(cfg, delayed=False)
    torch.testing.assert_close(weights, ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)
    assert [v["step"] for v in summary["val_losses"]] == [2, 4]
    assert_losses_close([summary["final_val_loss"]], [reference_eval(cfg, weights)])


@pytest.mark.slow
def test_resume_mid_epoch_is_exact(tmp_path, runs):
    # 6 steps of 8 rows: the 20 training documents fill 4 to 5 batches an epoch, so step 3 is mid-epoch and the
    # run crosses into the next epoch after resuming
    cfg, straight, weights = runs["2x1"]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=3, checkpoint_every=3))
    run_ok(cfg, tmp_path / "run")
    cfg.train.num_steps = 6
    resumed = run_ok(cfg, tmp_path / "run")
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"]
    final = torch.load(tmp_path / "run" / "final_model.pt")
    assert all(torch.equal(final[k], weights[k]) for k in weights)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf_llama_tied", pytest.param("gpt_tied", marks=pytest.mark.long)])
def test_packed_documents_train_tied_models_as_one_process(tmp_path, model):
    # a tied Llama (model=hf) and the GPT with model.tie_embeddings: the head's weight on the last stage is the
    # embedding's on the first, their gradients summed across the stages
    cfg = doc_config(tmp_path, d=2, w=1, m=4, eval_every=0, num_steps=4)
    if model == "hf_llama_tied":
        pytest.importorskip("transformers")
        cfg.model = _hf("llama", tied=True)
    else:
        cfg.model.tie_embeddings = True
    summary = run_ok(cfg, tmp_path / "run")
    ref = reference(cfg, delayed=True)
    torch.testing.assert_close(torch.load(tmp_path / "run" / "final_model.pt"), ref.weights, rtol=1e-5, atol=1e-7)
    assert_losses_close(summary["losses"], ref.losses)


DOCUMENTS_TINY = {
    "MODEL=path/to/Llama-3.2-1B": "MODEL=$TEST_MODEL",
    "PAIRS=pairs.jsonl": "PAIRS=$TEST_PAIRS",
    "model.seq_len=512": "model.seq_len=64",
    "train.eval_every=100": "train.eval_every=2",
    "optim.lr=2e-5 train.num_steps=500": "optim.lr=1e-2 train.num_steps=4",
    "hydra.run.dir=outputs/qa": "hydra.run.dir=outputs/qa wandb.mode=disabled",
}


@pytest.mark.slow
@pytest.mark.long
def test_fine_tuning_on_pairs_walkthrough_of_the_docs(tmp_path):
    """docs/pretrained.md's packed-documents walk-through on a tiny tied Llama with a tokenizer.json trained here:
    tokenize the shipped pairs with it, fine-tune at d = 2 with validation (the loss falls), export, generate."""
    import subprocess

    from test_hf import walkthrough_script, walkthrough_setup

    from pipedream2bw.data.documents import SHIPPED_DOCUMENTS

    model_dir, env, prelude = walkthrough_setup(tmp_path)
    env["TEST_PAIRS"] = str(SHIPPED_DOCUMENTS)
    script = walkthrough_script("documents-walkthrough", DOCUMENTS_TINY)
    done = subprocess.run(
        ["bash", "-c", prelude + script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert 'say about The "assert" statement?\nAnswer: ' in done.stdout, done.stdout  # the prompt, then generated
    summary = json.loads((tmp_path / "outputs" / "qa" / "summary.json").read_text())
    assert summary["final_loss"] < summary["losses"][0] and [v["step"] for v in summary["val_losses"]] == [2, 4]
    assert (tmp_path / "finetuned-qa" / "config.json").is_file()
    assert index_path(tmp_path / "data" / "qa.bin").is_file()
