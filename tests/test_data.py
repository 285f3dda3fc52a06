"""Token files and validation: memory-mapped data, checks before any group starts, held-out windows,
validation passes through the pipeline that leave training untouched, on every layout and schedule."""

from __future__ import annotations

import ctypes
import dataclasses
import gzip
import importlib.util
import json
import mmap
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helper import run_ok, spawn, train_cli
from reference import reference_eval, reference_train
from test_semantics import assert_losses_close, tiny_config

from pipedream2bw.config import ConfigError, LayerListConfig
from pipedream2bw.data import (
    MicrobatchFeed,
    check_data,
    data_resident_bytes,
    load_splits,
    make_feeds,
    mapped_resident_bytes,
    meta_path,
)
from pipedream2bw.run.preflight import check

VOCAB = 300  # not byte-level: the model's vocabulary comes from the token file's


def write_tokens(path: Path, ids, dtype=np.uint16) -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def token_config(tmp_path: Path, *, schedule="2bw", d=2, w=1, m=4, eval_every=2, num_steps=6, **pipeline):
    """The tiny GPT on a token file of vocabulary 300, the last 20% held out; SGD with momentum
    (replicas sum in another order: Adam would blow round-off up on zero-gradient parameters)."""
    path = tmp_path / "tokens.bin"
    if not path.exists():
        rng = np.random.default_rng(0)  # a learnable sequence: id k+1 follows id k, one id in ten random
        write_tokens(path, np.where(rng.random(6000) < 0.1, rng.integers(0, VOCAB, 6000), np.arange(6000) % VOCAB))
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=m, optim="sgd_momentum", num_steps=num_steps)
    cfg.pipeline = dataclasses.replace(cfg.pipeline, data_parallel=w, **pipeline)
    cfg.model.vocab_size = VOCAB
    cfg.data = dataclasses.replace(cfg.data, path=str(path), val_fraction=0.2)
    cfg.train = dataclasses.replace(cfg.train, eval_every=eval_every, eval_batches=2)
    return cfg


# --- pure: the data -------------------------------------------------------------------------------


def cached_pages(tokens: np.memmap) -> set:
    """Pages of ``tokens``' file in the page cache (mincore): the pages anything has read."""
    raw = tokens._mmap
    vec = (ctypes.c_ubyte * -(-len(raw) // mmap.PAGESIZE))()
    address = np.frombuffer(raw, dtype=np.uint8, count=1).ctypes.data
    assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(raw)), vec) == 0
    return set(np.flatnonzero(np.frombuffer(vec, dtype=np.uint8) & 1).tolist())


@pytest.mark.skipif(sys.platform != "linux", reason="page residency (mincore, /proc/self/smaps) as Linux reports it")
def test_token_file_is_memory_mapped_and_the_feed_reads_only_the_windows_it_draws(tmp_path):
    # 4 GiB of uint16 ids as a sparse file (no disk, no time; nothing of it cached): what the feed
    # reads is exactly what the page cache holds afterwards, and a whole read would show at once.
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(4 << 30)
    cfg = token_config(tmp_path)
    cfg.data.path = str(path)
    train, val = load_splits(cfg.data)
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap) and len(train) + len(val) == 2 << 30
    assert cached_pages(train) == set()
    feed = MicrobatchFeed(train, seq_len=16, microbatch_size=2, num_microbatches=4, seed=0, num_replicas=2)
    batches = 25
    for k in range(batches * 4):
        x, y = feed.microbatch(k)
        assert x.shape == y.shape == (2, 16) and x.dtype == torch.int64
    # The pages of the windows drawn (17 ids of 2 bytes each, on 1 or 2 pages), and no other.
    touched = {
        page
        for t in range(batches)
        for start in feed.starts(t).tolist()
        for page in range(start * 2 // mmap.PAGESIZE, ((start + 17) * 2 - 1) // mmap.PAGESIZE + 1)
    }
    assert cached_pages(train) == touched and 0 < len(touched) <= batches * 16 * 2
    # ...and this process maps none of them any more: its memory does not grow with the batches read.
    assert data_resident_bytes(feed) == mapped_resident_bytes(train) == 0


def test_validation_windows_never_meet_training_windows(tmp_path):
    # ids = positions: a window's ids say where it was read.
    n = 4000
    cfg = token_config(tmp_path)
    cfg.data.path = str(write_tokens(tmp_path / "positions.bin", np.arange(n)))
    num_train = n - int(n * cfg.data.val_fraction)
    feeds = [
        make_feeds(cfg.data, seq_len=16, microbatch_size=2, num_microbatches=4, seed=1, num_replicas=2, replica=r)
        for r in (0, 1)
    ]
    seen_val = set()
    for k in range(200):
        for train_feed, val_feed in feeds:
            x, y = train_feed.microbatch(k)
            assert int(y.max()) < num_train  # the last id of a training window is still training data
            assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))  # contiguous windows
            if k < 16:
                vx, vy = val_feed.microbatch(k)
                assert int(vx.min()) >= num_train and torch.equal(vy - vx, torch.ones_like(vx))
                seen_val.update(vx[:, 0].tolist())
    assert len(seen_val) > 16  # the held-out part is really sampled, not one window
    # Every evaluation sees the same held-out windows.
    again = make_feeds(cfg.data, seq_len=16, microbatch_size=2, num_microbatches=4, seed=1, num_replicas=2, replica=0)[
        1
    ]
    assert all(torch.equal(again.inputs(k), feeds[0][1].inputs(k)) for k in range(8))


def test_bad_data_is_rejected_with_the_value_and_the_fix(tmp_path):
    cfg = token_config(tmp_path)

    def rejects(match, **data):
        bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))
        with pytest.raises(ConfigError, match=match):
            check(bad, world_size=2)

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 100 + b"\x01")
    rejects(
        r"odd.bin\) has 201 bytes, not a multiple of 2: not a file of uint16 token ids; set data.token_dtype",
        path=str(odd),
    )
    big = write_tokens(tmp_path / "big_ids.bin", [1, 2, 999] + [3] * 200)
    rejects(
        r"holds token id 999 \(first id >= 300 at position 2\), but model.vocab_size is 300: .* set "
        r"model.vocab_size=1000",
        path=str(big),
    )
    short = write_tokens(tmp_path / "short.bin", [1] * 17)
    rejects(
        r"short.bin\) has 14 tokens to train on after holding out data.val_fraction \(0.2\), fewer than model.seq_len "
        r"\+ 2 \(18\)",
        path=str(short),
    )
    rejects(
        r"data.val_fraction \(0.001\) of data.path holds 6 tokens, fewer than model.seq_len \+ 2 \(18\) for one "
        r"validation window",
        val_fraction=0.001,
    )
    rejects(r"train.eval_every needs held-out data: set data.val_fraction", val_fraction=0.0)
    as32 = write_tokens(tmp_path / "as32.bin", [5] * 200, dtype=np.uint32)
    meta_path(as32).write_text(json.dumps({"dtype": "uint32", "num_tokens": 200}))
    rejects(
        r"holds uint32 ids \(says .*as32.bin.json\), but data.token_dtype is uint16; set data.token_dtype=uint32",
        path=str(as32),
        token_dtype="uint16",
    )
    # The default (auto) takes the dtype its description names (regression, issue 35: the default was uint16,
    # and docs/pretrained.md hard-coded uint32, which every vocabulary of 65,536 or fewer then refused)
    auto = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(as32), val_fraction=0.1))
    assert auto.data.token_dtype == "auto"
    check(auto, world_size=2)
    train, val = load_splits(auto.data)
    assert train.dtype == np.uint32 and len(train) + len(val) == 200 and set(train.tolist()) == {5}
    cfg.model.vocab_size = 200
    with pytest.raises(ConfigError, match=r"model.vocab_size \(200\) must be >= 256 for byte-level text"):
        check(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=None)), world_size=2)


def _prepare_tokens():
    spec = importlib.util.spec_from_file_location(
        "prepare_tokens", Path(__file__).resolve().parents[1] / "scripts" / "prepare_tokens.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TEXT = "def f(x):\n    return x + 1\n\nf(2)  # caf\u00e9\n" * 40


def test_prepare_tokens_writes_a_token_file_training_accepts(tmp_path):
    prepare = _prepare_tokens()
    gz = tmp_path / "text.txt.gz"
    gz.write_bytes(gzip.compress(TEXT.encode()))
    meta = prepare.prepare([gz], tmp_path / "bytes.bin", tokenizer="bytes")
    ids = np.fromfile(tmp_path / "bytes.bin", dtype=np.uint16)
    assert bytes(ids.astype(np.uint8)) == TEXT.encode() and ids.max() < 256
    assert json.loads(meta_path(tmp_path / "bytes.bin").read_text()) == meta
    assert (meta["num_tokens"], meta["dtype"], meta["vocab_size"], meta["tokenizer"]) == (
        len(TEXT.encode()),
        "uint16",
        256,
        "bytes",
    )
    cfg = token_config(tmp_path)
    cfg.data.path, cfg.model.vocab_size = str(tmp_path / "bytes.bin"), 256
    check(cfg, world_size=2)
    # A subword tokenizer from a local tokenizer.json (trained here: nothing downloaded).
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the optional extra is not installed: pip install 'pipedream2bw[tokenize]'"
    )
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT],
        tokenizers.trainers.BpeTrainer(
            vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    plain = tmp_path / "text.txt"
    plain.write_text(TEXT)
    meta = prepare.prepare([plain], tmp_path / "bpe.bin", tokenizer=f"tokenizers:{tmp_path / 'tokenizer.json'}")
    ids = np.fromfile(tmp_path / "bpe.bin", dtype=meta["dtype"])
    assert (
        tok.decode(ids.tolist()) == TEXT
        and len(ids) < len(TEXT.encode()) / 2
        and meta["vocab_size"] == tok.get_vocab_size()
    )
    cfg.data.path, cfg.model.vocab_size = str(tmp_path / "bpe.bin"), meta["vocab_size"]
    check(cfg, world_size=2)


def test_prepare_tokens_says_how_much_invalid_utf8_a_text_tokenizer_saw_replaced(tmp_path, capsys):
    # issue 35: a text tokenizer's input was decoded with errors="replace" without a word.
    prepare = _prepare_tokens()
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the optional extra is not installed: pip install 'pipedream2bw[tokenize]'"
    )
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "latin1.txt"
    text.write_bytes(b"a a\ncaf\xe9 a\na\n\xff\xfe a\n")  # Latin-1 bytes: 3 invalid on lines 2 and 4
    args = [str(text), "--out", str(tmp_path / "t.bin"), "--tokenizer", f"tokenizers:{tmp_path / 'tokenizer.json'}"]
    prepare.main(args)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"prepare_tokens.py: 3 bytes of invalid UTF-8 on 2 lines (the first: {text} line 2) were tokenized as U+FFFD; "
        "convert the text to UTF-8 first (iconv -f <its encoding> -t utf-8), or use --tokenizer bytes, which keeps "
        "the bytes as they are"
    ]
    assert json.loads(meta_path(tmp_path / "t.bin").read_text())["replaced_bytes"] == 3
    text.write_bytes("a caf\u00e9\n".encode())  # valid UTF-8: nothing said
    prepare.main(args)
    assert capsys.readouterr().err == ""


BAD_FILES = {  # what a token file holds -> the error every rank must give
    "odd_size": (b"\x01\x00" * 100 + b"\x01", r"has 201 bytes, not a multiple of 2: not a file of uint16 token ids"),
    "id_over_vocab": (
        np.array([7] * 99 + [300] * 101, dtype=np.uint16).tobytes(),
        r"holds token id 300 \(first id >= 300 at position 99\)",
    ),
    "too_short": (
        np.array([7] * 17, dtype=np.uint16).tobytes(),
        r"has 17 tokens to train on, fewer than model.seq_len \+ 2 \(18\)",
    ),
}


class _Payload:
    """Unpickling this calls os.system: what a crafted meta.pkl would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_nanogpt_meta_pkl_describes_the_vocabulary_without_running_code(tmp_path, caplog):
    # nanoGPT writes meta.pkl ({'vocab_size', 'itos', 'stoi'}) beside train.bin: read as the .json
    # sidecar is, by an unpickler that looks up no class or function, so a payload cannot run.
    import pickle

    cfg = token_config(tmp_path)  # the GPT's vocabulary is 300; the file's ids are below it
    meta = tmp_path / "meta.pkl"
    meta.write_bytes(pickle.dumps({"vocab_size": 300, "itos": {0: "a"}, "stoi": {"a": 0}}))
    with caplog.at_level("WARNING", logger="pipedream2bw.data"):
        info = check_data(cfg.data, vocab_size=50304, seq_len=16, need_val=False)
    assert info.vocab_size == 300 and info.vocab_source == str(meta)
    assert "the model's vocabulary (50304) is 168x the data's (300, from " in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipedream2bw.data"):
        check_data(cfg.data, vocab_size=512, seq_len=16, need_val=False)
    assert "vocabulary" not in caplog.text  # within 2x: no warning
    marker = tmp_path / "ran"
    meta.write_bytes(pickle.dumps({"vocab_size": _Payload(marker)}))
    try:
        with pytest.raises(ConfigError, match=r"meta.pkl \(the description of .*tokens.bin\) cannot be read: refusing"):
            check_data(cfg.data, vocab_size=300, seq_len=16, need_val=False)
    finally:
        assert not marker.exists(), "the payload in meta.pkl ran"
    (tmp_path / "tokens.bin.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokens.bin.json \(the description of .*\) cannot be read"):
        check_data(cfg.data, vocab_size=300, seq_len=16, need_val=False)


@pytest.mark.slow
def test_each_bad_token_file_stops_every_rank_before_any_group_starts(tmp_path):
    runs = []
    for bad, (content, _) in BAD_FILES.items():
        (tmp_path / f"{bad}.bin").write_bytes(content)
        runs.append(
            [
                f"data.path={tmp_path / bad}.bin",
                "model.vocab_size=300",
                "model.seq_len=16",
                "pipeline.num_stages=2",
                "pipeline.num_microbatches=2",
                "wandb.mode=disabled",
                f"hydra.run.dir={tmp_path / bad}",
            ]
        )
    results = spawn(train_cli, world_size=2, args=(runs,), log_dir=tmp_path / "logs", timeout_s=240)
    for r in results:  # each rank on its own: exit 2 with the error, no process group ever started
        assert r.exitcode == 0 and "process group was started" not in r.log, r.log
        assert r.log.count("EXIT 2") == len(BAD_FILES), r.log
        for bad, (_, error) in BAD_FILES.items():
            assert re.search(rf"\[rank {r.rank}\] bad configuration: data.path \(.*{bad}.bin\) {error}", r.log), (
                bad,
                r.log,
            )


# --- the pipeline on a token file -------------------------------------------------------------------

LAYOUTS = {  # name -> (d, w, m, pipeline extras): the same global batch of 8 windows
    "1x1": (1, 1, 4, {}),
    "2x1": (2, 1, 4, {}),
    "2x2": (2, 2, 2, {"recompute": True}),
    "4x1": (4, 1, 4, {}),  # with swapping on stage 0 and sends batched with receives
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2bw on every layout with validation every 2 of 6 steps, and 4x1 again without validation."""
    base = tmp_path_factory.mktemp("token_runs")
    out = {}
    for name, (d, w, m, extra) in [*LAYOUTS.items(), ("4x1-no-eval", LAYOUTS["4x1"])]:
        cfg = token_config(base, d=d, w=w, m=m, eval_every=0 if name.endswith("no-eval") else 2, **extra)
        if d == 4:
            cfg.swap = dataclasses.replace(cfg.swap, stages=[0], resident=0, min_bytes=0)
            # NCCL's transfer mode (each send started with the next receive, no receive posted early), on
            # gloo: the mode in which validation transfers on training's channels would be taken for training's.
            cfg.dist.batch_p2p = True
        summary = run_ok(cfg, base / name)
        out[name] = (cfg, summary, torch.load(base / name / "final_model.pt"))
    return out


@pytest.mark.slow
def test_token_data_trains_the_same_on_every_layout(runs):
    cfg, summary, weights = runs["1x1"]
    expected, expected_losses = reference_train(cfg, delayed=True)  # the 2BW rule on the training split
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    for name in LAYOUTS:
        torch.testing.assert_close(runs[name][2], weights)
        assert_losses_close(runs[name][1]["losses"], summary["losses"])


@pytest.mark.slow
def test_validation_loss_is_the_same_on_every_layout_and_that_of_the_final_weights(runs):
    cfg, summary, weights = runs["1x1"]
    assert [v["step"] for v in summary["val_losses"]] == [2, 4, 6]
    losses = [v["loss"] for v in summary["val_losses"]]
    assert losses[-1] == summary["final_val_loss"] and len(set(losses)) == 3  # each pass saw newer weights
    for name in LAYOUTS:
        run_cfg, run_summary, run_weights = runs[name]
        assert [v["step"] for v in run_summary["val_losses"]] == [2, 4, 6]
        assert_losses_close([v["loss"] for v in run_summary["val_losses"]], losses)
        # The last pass ran with the weights the run ended with, on the same held-out windows.
        assert_losses_close([run_summary["final_val_loss"]], [reference_eval(run_cfg, run_weights)])
        assert all(r["eval_s"] > 0 for r in run_summary["ranks"])


@pytest.mark.slow
def test_validation_carries_tuple_and_dict_boundaries_as_training_does(tmp_path):
    # Regression (validation on structured boundaries): the pass sent one tensor per crossing and
    # raised NotImplementedError at the first evaluation of a model whose stages pass (hidden, ids)
    # tuples and dicts; it now crosses through the same boundary.Channel as training.
    val_losses = {}
    for d in (1, 2, 4):
        cfg = tiny_config(schedule="2bw", num_stages=d, num_microbatches=4, optim="sgd_momentum", num_steps=4)
        cfg.model = LayerListConfig(target="custom_models.tuple_layers", kwargs={"width": 8}, seq_len=8)
        cfg.data = dataclasses.replace(cfg.data, val_fraction=0.1)
        cfg.train = dataclasses.replace(cfg.train, eval_every=2, eval_batches=1)
        summary = run_ok(cfg, tmp_path / f"d{d}")
        assert [v["step"] for v in summary["val_losses"]] == [2, 4]
        val_losses[d] = [v["loss"] for v in summary["val_losses"]]
        final = reference_eval(cfg, torch.load(tmp_path / f"d{d}" / "final_model.pt"))
        assert_losses_close([summary["final_val_loss"]], [final])
    assert_losses_close(val_losses[2], val_losses[1])
    assert_losses_close(val_losses[4], val_losses[1])


@pytest.mark.slow
def test_validation_leaves_training_bit_identical(runs):
    # 4 stages under 2bw (the most work in flight when a pass starts), with swapping and batched sends.
    _, with_eval, weights = runs["4x1"]
    _, without, plain = runs["4x1-no-eval"]
    assert with_eval["losses"] == without["losses"]
    assert weights.keys() == plain.keys() and all(torch.equal(weights[k], plain[k]) for k in weights)
    assert without["val_losses"] == [] and without["final_val_loss"] is None
    assert with_eval["ranks"][0]["swap"]["swapped_out_bytes"] > 0  # swapping really ran


@pytest.mark.slow
def test_only_the_first_and_last_stages_open_the_data(runs):
    _, summary, _ = runs["4x1"]
    resident = {r["stage"]: r["data_resident_bytes"] for r in summary["ranks"]}
    assert resident[1] is None and resident[2] is None  # middle stages never opened the file
    assert resident[0] == resident[3] == 0  # the ends mapped it, and hold none of its pages after reading


@pytest.mark.slow
def test_validation_under_flush_and_gpipe_and_after_a_resume(tmp_path):
    # flush for 4 steps with a checkpoint, then gpipe (one weight version too) with sends batched with
    # receives, resumed to 6 steps: the pass after step 4, whose loss the checkpoint could not hold
    # yet, runs again first, on the same weights.
    cfg = token_config(tmp_path, schedule="flush", num_steps=4)
    cfg.train.checkpoint_every = 4
    first = run_ok(cfg, tmp_path / "run")
    assert [v["step"] for v in first["val_losses"]] == [2, 4]
    cfg.pipeline.schedule, cfg.train.num_steps, cfg.dist.batch_p2p = "gpipe", 6, True
    summary = run_ok(cfg, tmp_path / "run")
    assert summary["first_step"] == 4 and [v["step"] for v in summary["val_losses"]] == [2, 4, 6]
    assert_losses_close([v["loss"] for v in summary["val_losses"][:2]], [v["loss"] for v in first["val_losses"]])
    assert_losses_close(
        [summary["final_val_loss"]], [reference_eval(cfg, torch.load(tmp_path / "run" / "final_model.pt"))]
    )


@pytest.mark.slow
def test_validation_under_zbv_flows_through_the_v_as_one_process_does(tmp_path):
    # zbv (issue 46): a pass runs chunk 0 on rank 0, chunks 1 and 2 on rank 1 (2 hands 1's output over in memory),
    # chunk 3 and the loss on rank 0. Its losses after steps 2 and 4 are one process's on the same weights (flush at
    # d=1: the same update), and the last is the final weights' in one process.
    runs = {}
    for schedule, d in (("zbv", 2), ("flush", 1)):
        cfg = token_config(tmp_path, schedule=schedule, d=d, num_steps=4)
        runs[schedule] = (cfg, run_ok(cfg, tmp_path / schedule), torch.load(tmp_path / schedule / "final_model.pt"))
    (cfg, summary, weights), (_, expected, expected_weights) = runs["zbv"], runs["flush"]
    torch.testing.assert_close(weights, expected_weights)  # the passes leave training as flush's
    assert [v["step"] for v in summary["val_losses"]] == [2, 4]
    assert_losses_close([v["loss"] for v in summary["val_losses"]], [v["loss"] for v in expected["val_losses"]])
    assert_losses_close([summary["final_val_loss"]], [reference_eval(cfg, weights)])


@pytest.mark.slow
@pytest.mark.long
def test_validation_under_zbv_at_three_ranks_with_tied_embeddings(tmp_path):
    # d=3: rank 1's legs are chunk 1 (from rank 0, to rank 2) and chunk 4 (from rank 2, to rank 0), both peers on one
    # evaluation group; the tie (chunks 0 and 5) on rank 0. Weights and the final pass against one process.
    cfg = token_config(tmp_path, schedule="zbv", d=3, m=6, num_steps=4)
    cfg.model.num_layers, cfg.model.tie_embeddings = 4, True  # 6 layers: one a chunk
    summary = run_ok(cfg, tmp_path / "run")
    weights = torch.load(tmp_path / "run" / "final_model.pt")
    ref = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule="flush", num_stages=1))
    expected, expected_losses = reference_train(ref, delayed=False)
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    assert [v["step"] for v in summary["val_losses"]] == [2, 4]
    assert_losses_close([summary["final_val_loss"]], [reference_eval(cfg, weights)])


def test_a_token_file_is_scanned_once_for_the_check_at_start_and_the_runners(tmp_path, monkeypatch):
    # The entry point checks the config at start (precheck) and the runner validates it again: one read of the ids.
    from pipedream2bw.data import tokens as data_mod

    cfg = token_config(tmp_path)
    reads = []
    scan = data_mod._scan
    monkeypatch.setattr(data_mod, "_scan", lambda *a, **k: reads.append(a[0]) or scan(*a, **k))
    check(cfg, world_size=2)
    check(cfg, world_size=2)
    assert len(reads) == 1
    write_tokens(Path(cfg.data.path), [7] * 300)  # the file changed: read again
    check(cfg, world_size=2)
    assert len(reads) == 2
