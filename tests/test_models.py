"""Models from config and weights tied across stages: oracles, the command line, re-partitioned resume, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from custom_models import tuple_layers
from dist_helper import run_ok
from reference import reference_eval, reference_run, reference_train
from test_semantics import assert_losses_close, tiny_config
from torch import nn

from pipedream2bw.config import Config, ConfigError, LayerListConfig, OptimConfig, PartitionConfig
from pipedream2bw.io import checkpoint
from pipedream2bw.pipeline.comm import torchrun_command
from pipedream2bw.run.runner import run

TIE = ["0.tok.weight", "5.out.weight"]  # tiny_config's GPT: embedding, 3 blocks, norm, head


def tied_config(schedule: str, d: int, *, steps: int = 6) -> Config:
    # SGD with momentum: Adam turns the reduction-order noise of a sum over stages (instead of
    # over microbatches, as one process sums) into lr-sized steps of near-zero gradients.
    cfg = tiny_config(schedule=schedule, num_stages=d, num_microbatches=4, optim="sgd_momentum", num_steps=steps)
    cfg.model.tie_embeddings = True
    cfg.pipeline.check_ties = True  # fails the run on the first step whose tied copies differ in any bit
    return cfg


def assert_tied_result(run_dir: Path, summary: dict, cfg: Config, *, steps_checked: int) -> dict:
    weights = torch.load(Path(run_dir) / "final_model.pt")
    reference = tied_config(cfg.pipeline.schedule, 1, steps=cfg.train.num_steps)  # the same 8 sequences per batch
    expected, expected_losses = reference_train(reference, delayed=cfg.pipeline.schedule == "2bw")
    assert weights.keys() == expected.keys()  # both names of the tie, as the tied model's state_dict
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    # One tensor under both names (torch.save keeps the sharing), equal to the reference's tie.
    assert weights[TIE[0]].untyped_storage().data_ptr() == weights[TIE[1]].untyped_storage().data_ptr()
    (tie,) = summary["ties"]
    assert tie["names"] == TIE and tie["checked_steps"] == steps_checked, tie
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("schedule,d,w", [("flush", 2, 2), ("gpipe", 2, 1), ("2bw", 2, 2), ("2bw", 4, 2)])
def test_tied_gpt_with_data_parallelism_matches_the_reference(tmp_path, schedule, d, w):
    # w=2: the tie's gradient is summed over d stages x 2 replicas, then averaged over the replicas.
    # Regression (2bw + tie + w=2): the tie defers APPLY(t), and batch t+1's last backward re-armed
    # the data-parallel reducer before it, so the step used the replica's own gradient, then crashed.
    cfg = tied_config(schedule, d)
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size = w, 2 // w
    summary = run_ok(cfg, tmp_path, timeout_s=240)
    assert_tied_result(tmp_path, summary, cfg, steps_checked=6)
    # one exchange per step on each holder (the first and last stage's replicas), none elsewhere
    holders = [6 if s in (0, d - 1) else 0 for s in range(d) for _ in range(w)]
    assert sorted(summary["tie_allreduce_calls"]) == sorted(holders)


@pytest.mark.slow
@pytest.mark.parametrize("w", [1, 2])
def test_tied_gpt_clipped_by_the_global_norm_counts_the_tie_once(tmp_path, w):
    # Regression (ties with clipping): the norm must see the tie's gradient summed over its stages,
    # counted once, as clip_grad_norm_ on the tied model does; the clip is active on every step.
    cfg = tied_config("2bw", 2)
    cfg.optim.clip_grad_norm = 1e-3
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size = w, 2 // w
    summary = run_ok(cfg, tmp_path)
    reference = tied_config("2bw", 1)
    reference.optim.clip_grad_norm = 1e-3
    expected = reference_run(reference, delayed=True)
    assert min(expected.grad_norms) > cfg.optim.clip_grad_norm
    torch.testing.assert_close(torch.tensor(summary["grad_norms"]), torch.tensor(expected.grad_norms))
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected.weights)


@pytest.mark.slow
def test_tied_gpt_2bw_fp16_with_two_replicas_equals_the_scaled_reference(tmp_path):
    """2bw + tie + w=2 under fp16 loss scaling (the scaler's agreement defers APPLY too): the 2bw
    reference with the same scales, at fp16's tolerance (two replicas sum in another order)."""
    cfg = tied_config("2bw", 2)
    cfg.train.precision, cfg.train.loss_scale, cfg.train.loss_scale_growth_interval = "fp16", 1024.0, 2
    cfg.pipeline.data_parallel, cfg.pipeline.microbatch_size = 2, 1
    summary = run_ok(cfg, tmp_path)
    reference = tied_config("2bw", 1)
    reference.train = cfg.train
    info = {}
    expected, losses = reference_train(reference, delayed=True, balance=summary["balance"], info=info)
    assert summary["loss_scale"]["per_step"] == info["loss_scales"] and max(info["loss_scales"]) > 1024.0
    fp16_close = dict(rtol=1e-3, atol=1e-4)
    weights = torch.load(tmp_path / "final_model.pt")
    torch.testing.assert_close(weights, expected, **fp16_close)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(losses), **fp16_close)


@pytest.mark.slow
def test_tied_gpt_2bw_validates_at_four_stages(tmp_path):
    # Regression (2bw + tie + validation at d >= 3): only the tie's holders (the first and last stage) deferred
    # APPLY(t), so stage 2 ran the validation pass after its step at once and waited for the last stage, which
    # reached the pass only after batch t+1's backwards, for which it needed stage 2's next activation: every rank
    # timed out. Every stage now defers when any does, so the pass comes at the same point of each schedule.
    cfg = tied_config("2bw", 4)
    cfg.data = dataclasses.replace(cfg.data, val_fraction=0.1)
    cfg.train = dataclasses.replace(cfg.train, eval_every=2, eval_batches=1)
    cfg.dist.timeout_s = 60
    summary = run_ok(cfg, tmp_path)
    reference = tied_config("2bw", 1)
    reference.data = cfg.data  # the same held-out tail
    expected, expected_losses = reference_train(reference, delayed=True)
    weights = torch.load(tmp_path / "final_model.pt")
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    assert [v["step"] for v in summary["val_losses"]] == [2, 4, 6]
    assert_losses_close([summary["final_val_loss"]], [reference_eval(cfg, weights)])


def test_tied_gpt_2bw_matches_delayed_rule_and_resumes_at_another_depth(tmp_path):
    """d=2 straight (checkpoint at step 3), then d=4 resumed from that checkpoint: both end on the
    2bw reference's weights, the copies bit-identical after every step, one tensor per tie saved."""
    cfg = tied_config("2bw", 2)
    cfg.train.checkpoint_every = 3
    straight = run_ok(cfg, tmp_path / "d2")
    weights = assert_tied_result(tmp_path / "d2", straight, cfg, steps_checked=6)
    # ...and the pipeline trained the tie, not two copies of it: without the exchange each stage
    # steps on its own half of the gradient and the head leaves the embedding.
    untied, _ = reference_train(
        tiny_config(schedule="2bw", num_stages=1, num_microbatches=4, optim="sgd_momentum"), delayed=True
    )
    assert not torch.allclose(weights[TIE[1]], untied[TIE[1]], atol=1e-3)

    ckpt = tmp_path / "d2" / "checkpoints" / "step_00000003"
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    assert manifest["ties"] == [TIE]
    head = torch.load(ckpt / checkpoint.layer_file(5))
    assert TIE[1] not in head["weights"] and TIE[1] not in head["optimizer"]  # stored once, with layer 0
    assert TIE[0] in torch.load(ckpt / checkpoint.layer_file(0))["optimizer"]
    consolidated = torch.load(checkpoint.consolidate(ckpt, tmp_path / "c.pt"))
    assert consolidated[TIE[1]].untyped_storage().data_ptr() == consolidated[TIE[0]].untyped_storage().data_ptr()

    resumed_cfg = tied_config("2bw", 4)
    resumed_cfg.train.resume = str(ckpt)
    resumed = run_ok(resumed_cfg, tmp_path / "d4")
    assert resumed["first_step"] == 3
    assert_tied_result(tmp_path / "d4", resumed, resumed_cfg, steps_checked=3)
    # A model is never silently untied: the untied GPT refuses this checkpoint.
    with pytest.raises(
        ConfigError, match=r"tied parameters \[\['0.tok.weight', '5.out.weight'\]\], but this model ties none"
    ):
        checkpoint.check_ties(manifest, [], ckpt)


@pytest.mark.slow
def test_custom_tuple_model_planned_by_partition_auto(tmp_path):
    """A factory by import path whose layers pass tuples and dicts (with an integer tensor), planned
    by partition=auto (profiled here) on 2 stages, trains as the single-process model does."""
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=4, optim="adam", num_steps=4)
    cfg.model = LayerListConfig(target="custom_models.tuple_layers", kwargs={"width": 16}, seq_len=16)
    cfg.partition = PartitionConfig(
        mode="auto", depths=[2], microbatch_sizes=[2], repeats=1, swap=False, recompute=False
    )
    cfg.train.global_batch_size = 8
    summary = run_ok(cfg, tmp_path)
    assert summary["num_stages"] == 2 and sum(summary["balance"]) == 5 and summary["plan"]["costs"] == "profile"
    reference = tiny_config(
        schedule="2bw", num_stages=1, num_microbatches=summary["num_microbatches"], optim="adam", num_steps=4
    )
    reference.model, reference.pipeline.microbatch_size = cfg.model, summary["microbatch_size"]
    expected, expected_losses = reference_train(reference, delayed=True)
    torch.testing.assert_close(torch.load(tmp_path / "final_model.pt"), expected)
    assert_losses_close(summary["losses"], expected_losses)


def torchrun(nproc: int, *overrides: str, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        *torchrun_command(nproc),
        "-m",
        "pipedream2bw.train",
        *overrides,
    ]
    return subprocess.run(
        cmd, cwd=cwd, env={**os.environ, "WANDB_SILENT": "true"}, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.slow
@pytest.mark.long
def test_hf_gpt2_with_target_optimizer_from_the_command_line(tmp_path):
    """The README's model=hf_gpt2 (transformers' GPT2Block, tied head) with an optimizer class by
    _target_, 2 stages under 2bw: the weights of the single-process model built from the same config."""
    pytest.importorskip("transformers", reason="model=hf_gpt2 needs the optional extra: pip install -e '.[hf]'")
    proc = torchrun(
        2,
        "model=hf_gpt2",
        "model.n_embd=32",
        "model.n_layer=2",
        "model.n_head=2",
        "model.seq_len=16",
        "optim=custom",
        "optim._target_=torch.optim.SGD",
        "optim.lr=0.2",
        "+optim.momentum=0.9",
        "pipeline.num_stages=2",
        "pipeline.num_microbatches=4",
        "pipeline.microbatch_size=2",
        "pipeline.check_ties=true",
        "train.num_steps=4",
        "train.warmup_steps=1",
        "wandb.mode=disabled",
        "seed=3",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = list((tmp_path / "outputs").glob("*-*-*/*"))  # <date>/<time>, not outputs/latest
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ties"] == [
        {"names": ["0.wte.weight", "4.weight"], "shape": [256, 32], "stages": [0, 1], "checked_steps": 4}
    ]
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=4, num_steps=4)
    cfg.model = LayerListConfig(
        target="pipedream2bw.models.hf_gpt2.build_layers",
        seq_len=16,
        name="hf_gpt2",
        kwargs={"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "tie_embeddings": True},
    )
    cfg.optim = OptimConfig(name="sgd", target="torch.optim.SGD", lr=0.2, kwargs={"momentum": 0.9})
    expected, expected_losses = reference_train(cfg, delayed=True)
    weights = torch.load(run_dir / "final_model.pt")
    torch.testing.assert_close(weights, expected)
    assert_losses_close(summary["losses"], expected_losses)
    assert weights["4.weight"].untyped_storage().data_ptr() == weights["0.wte.weight"].untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "target,message",
    [
        ("no_such_package.layers", r"model._target_ \(no_such_package.layers\) does not import"),
        ("custom_models.no_such_factory", r"module custom_models has no no_such_factory"),
        ("custom_models.not_a_list", r"returned Linear, not a list of nn.Module layers"),
        ("custom_models.shared_buffer_layers", r"buffers shared by layers \(1.scale, 2.scale\) cannot be kept in step"),
        # issue 35: a factory that ignores the indices it is given failed on the first step with a raw shape error
        (
            "custom_models.first_layers_whatever_the_indices",
            r"model._target_ \(custom_models.first_layers_whatever_the_indices\) built Embed as layer 2 for indices "
            r"\[2, 3, 4\], where its whole list \(indices=None\) has Mix: with indices, build exactly",
        ),
        (
            "custom_models.all_layers_whatever_the_indices",
            r"returned 5 layers for the 3 indices \[2, 3, 4\] it was given",
        ),
    ],
)
def test_bad_models_fail_before_any_group_starts(tmp_path, target, message):
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2)
    cfg.model = LayerListConfig(target=target)
    with pytest.raises(ConfigError, match=message):
        run(cfg, tmp_path)
    assert not dist.is_initialized()


def test_a_custom_models_vocabulary_is_read_from_its_layers_and_checked_before_any_group_starts(tmp_path):
    # Regression (custom-model vocabularies): a layer list had no vocabulary, so a token id over its
    # embedding's rows trained until a window held it, then ended in a bare IndexError on stage 0.
    ids = np.arange(400, dtype=np.uint16) % 200
    ids[50] = 300
    ids.tofile(tmp_path / "tokens.bin")
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2)  # one rank: refused before any group
    cfg.model = LayerListConfig(target="custom_models.tuple_layers", kwargs={"width": 8}, seq_len=8)
    cfg.data.path = str(tmp_path / "tokens.bin")
    over = r"holds token id 300 \(first id >= 256 at position 50\), but the vocabulary of the model's layers"
    with pytest.raises(ConfigError, match=over + r".* build the model's embedding and head for 301 or more ids"):
        run(cfg, tmp_path)  # a factory: Embed's nn.Embedding(256) and Head's nn.Linear(8, 256)
    with pytest.raises(ConfigError, match=over):
        run(cfg, tmp_path, layers=tuple_layers(width=8, seed=0))  # the Python API's layers
    cfg.model.vocab_size = 1000
    with pytest.raises(ConfigError, match=r"model.vocab_size \(1000\) is more than the model's layers take \(256"):
        run(cfg, tmp_path)
    cfg.model.vocab_size = None
    with pytest.raises(ConfigError, match=r"the model's vocabulary is unknown .* set model.vocab_size"):
        run(cfg, tmp_path, layers=[nn.Linear(8, 8), nn.Linear(8, 8)], loss_fn=lambda out, y: out.mean())
    assert not dist.is_initialized()


def test_views_shared_across_layers_are_refused(tmp_path):
    # Distinct Parameters on one storage cannot be exchanged as one tie: refused, naming them.
    emb, head = nn.Embedding(256, 4), nn.Linear(4, 256, bias=False)
    head.weight = nn.Parameter(emb.weight.data)
    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2)
    with pytest.raises(ConfigError, match=r"share memory \(0.weight, 1.weight\)"):
        run(cfg, tmp_path, layers=[emb, head])
    assert not dist.is_initialized()


def compose_typed(*overrides: str) -> Config:
    from hydra import compose, initialize_config_dir

    from pipedream2bw.config import from_hydra, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        return from_hydra(compose(config_name="config", overrides=list(overrides)))


def test_target_entries_compose_to_typed_configs():
    cfg = compose_typed(
        "model=custom",
        "model._target_=my_pkg.build_layers",
        "+model.width=512",
        "model.seq_len=64",
        "+model.loss._target_=my_pkg.loss",
        "+model.loss.smoothing=0.1",
        "optim=custom",
        "optim._target_=torch.optim.SGD",
        "+optim.momentum=0.9",
    )
    assert cfg.model == LayerListConfig(
        target="my_pkg.build_layers",
        kwargs={"width": 512},
        seq_len=64,
        loss="my_pkg.loss",
        loss_kwargs={"smoothing": 0.1},
    )
    assert cfg.optim == OptimConfig(name="sgd", lr=3e-3, kwargs={"momentum": 0.9}, target="torch.optim.SGD")
    assert compose_typed("model=hf_gpt2").model.kwargs["tie_embeddings"] is True
    assert compose_typed("model.tie_embeddings=true").model.tie_embeddings  # the GPT stays the typed default
    with pytest.raises(ConfigError, match=r"needs _partial_: true"):
        compose_typed("optim=custom", "optim._target_=torch.optim.SGD", "optim._partial_=false")
    with pytest.raises(
        ConfigError, match=r"optim._target_ \(torch.nn.Linear\) is .*not a torch.optim.Optimizer subclass"
    ):
        validate_optim(OptimConfig(target="torch.nn.Linear"))


def validate_optim(optim: OptimConfig) -> None:
    from pipedream2bw.config import validate

    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=1)
    cfg.optim = optim
    validate(cfg, world_size=1)


def test_no_decay_groups_by_shape_and_their_checkpoint_state_by_name():
    from pipedream2bw.config import build_optimizer
    from pipedream2bw.pipeline.versions import WeightVersions

    optim = OptimConfig(
        target="torch.optim.AdamW", lr=0.1, kwargs={"weight_decay": 0.5}, no_decay_norms_and_biases=True
    )
    groups = build_optimizer([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 3))], optim).param_groups
    assert [(len(g["params"]), g["params"][0].dim(), g["weight_decay"]) for g in groups] == [(1, 2, 0.5), (1, 1, 0.0)]
    # Groups reorder the optimizer's state positions (2-D first): checkpoints must still key them by the right name.
    torch.manual_seed(0)
    module = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 5))  # [0.weight (3,), 0.bias, 1.weight (5, 3), 1.bias]
    versions = WeightVersions(module, schedule="flush", optimizer_factory=lambda ps: build_optimizer(ps, optim))
    module(torch.randn(4, 3)).square().sum().backward()
    versions.step(0, grad_scale=1.0)
    state = versions.state()
    assert {k: tuple(v["exp_avg"].shape) for k, v in state["optimizer"].items()} == {
        "0.weight": (3,),
        "0.bias": (3,),
        "1.weight": (5, 3),
        "1.bias": (5,),
    }
    copy = WeightVersions(
        nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 5)),
        schedule="flush",
        optimizer_factory=lambda ps: build_optimizer(ps, optim),
    )
    copy.load_state(step=1, weights=state["weights"], previous=None, optimizer=state["optimizer"])
    for name, st in copy.state()["optimizer"].items():
        torch.testing.assert_close(st["exp_avg"], state["optimizer"][name]["exp_avg"])


def test_zbv_refuses_a_tie_across_ranks_before_any_group_starts():
    # A layer list's ties show once it is built (start._check, before any group). Under zbv a tie within a rank's two
    # chunks is one parameter there (the embedding's and the head's, chunks 0 and 3, both on rank 0: runs); one across
    # ranks (chunk 0's layer 1 and chunk 1's layer 2, on ranks 0 and 1) would sum over an exchange: refused.
    from custom_models import masked_layers

    from pipedream2bw.run.model import RunModel
    from pipedream2bw.run.start import _check

    cfg = tiny_config(schedule="zbv", num_stages=2, num_microbatches=2)
    cfg.model = LayerListConfig(target="custom_models.masked_layers", kwargs={"width": 8, "tie": True}, seq_len=8)
    cfg.pipeline.balance = [2, 1, 1, 1]
    layers = masked_layers(width=8, tie=True)
    assert _check(cfg, RunModel.of(cfg, layers, None), world_size=2, local_world_size=2) == [2, 1, 1, 1]
    layers[2].lin.weight = layers[1].lin.weight
    with pytest.raises(ConfigError, match=r"pipeline.schedule=zbv with weights tied across ranks \(\[\['1.lin.weight'"):
        _check(cfg, RunModel.of(cfg, layers, None), world_size=2, local_world_size=2)
