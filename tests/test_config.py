"""Hydra configs through compose(), and bad input rejected with the value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipedream2bw.config import (
    Config,
    ConfigError,
    GPTConfig,
    even_balance,
    from_hydra,
    gpt_balance,
    register_configs,
    validate,
)

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def make(*overrides: str) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def test_default_config_is_the_readme_run():
    cfg = make()
    assert isinstance(cfg, Config)
    assert (cfg.pipeline.schedule, cfg.pipeline.num_stages, cfg.model.name, cfg.wandb.mode) == (
        "2bw",
        4,
        "gpt",
        "offline",
    )
    assert validate(cfg, world_size=4) == [2, 2, 1, 3]  # [emb, b0] [b1, b2] [b3] [b4, norm, head]


def _differences(a, b, prefix: str = "") -> list:
    """The keys where two configs (dataclasses, walked field by field) differ, with both values."""
    import dataclasses

    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return [
            d
            for f in dataclasses.fields(a)
            for d in _differences(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}.")
        ]
    return [] if a == b else [f"{prefix[:-1]}: command line {a!r}, Config() {b!r}"]


def test_the_command_line_and_the_dataclasses_have_the_same_defaults():
    # issue 43: OptimConfig() was AdamW without a correction, the command line Muon with error feedback
    assert _differences(from_hydra(make()), Config()) == []


@pytest.mark.parametrize(
    "overrides, kwargs, correction",
    [
        ([], {}, "predict"),  # the default: muon under newest (its own prediction: tests/test_newest.py)
        (["optim.delay_correction=error_feedback"], {"delay_correction": "error_feedback"}, "error_feedback"),
        (["optim.name=adamw"], {"name": "adamw"}, "none"),  # kept the default's error feedback (issue 43)
        (
            ["optim.name=adamw", "optim.delay_correction=error_feedback"],
            {"name": "adamw", "delay_correction": "error_feedback"},
            "error_feedback",
        ),
        (["optim.name=muon", "optim.delay_correction=none"], {"name": "muon", "delay_correction": "none"}, "none"),
    ],
)
def test_a_named_optimizer_gets_its_own_delay_correction(overrides, kwargs, correction):
    from pipedream2bw.config import OptimConfig

    assert make(*overrides).optim.delay_correction == correction
    assert Config(optim=OptimConfig(**kwargs)).optim.delay_correction == correction


def test_interface_names_override():
    cfg = make(
        "pipeline.schedule=gpipe",
        "pipeline.num_stages=2",
        "pipeline.num_microbatches=3",
        "pipeline.microbatch_size=5",
        "pipeline.balance=[3,5]",
        "model.num_layers=5",
        "model.d_model=64",
        "model.num_heads=2",
        "model.seq_len=32",
        "model.vocab_size=300",
        "optim.name=sgd",
        "optim.lr=0.1",
        "+optim.kwargs.momentum=0.9",
        "train.num_steps=7",
        "seed=5",
        "wandb.mode=disabled",
    )
    assert cfg.pipeline.balance == [3, 5] and cfg.optim.kwargs == {"momentum": 0.9} and cfg.model.vocab_size == 300
    assert validate(cfg, world_size=2) == [3, 5]


def test_typed_schema_rejects_wrong_types():
    with pytest.raises(Exception, match="num_stages"):
        make("pipeline.num_stages=four")


@pytest.mark.parametrize(
    "overrides,world_size,match",
    [
        (
            ["pipeline.num_microbatches=2"],
            4,
            r"num_microbatches \(2\) must be >= pipeline.num_stages \(4\) for 2bw .*; raise pipeline.num_microbatches "
            r"to 4",
        ),
        (["pipeline.num_stages=9", "model.num_layers=5"], 9, r"num_stages \(9\) is more than the model's 8 layers"),
        (
            ["pipeline.balance=[2,2,2,1]"],
            4,
            r"balance \(\[2, 2, 2, 1\]\) must list 4 positive layer counts .* summing to the model's 8 layers; e.g. "
            r"pipeline.balance=\[2, 2, 1, 3\]",
        ),
        (["pipeline.balance=[4,4]"], 4, r"must list 4 positive layer counts"),
        ([], 6, r"world size \(6\) is not divisible by pipeline.num_stages \(4\); launch a multiple of 4 ranks"),
        (
            ["pipeline.data_parallel=2"],
            4,
            r"world size \(4\) must equal pipeline.num_stages \(4\) x pipeline.data_parallel \(2\) = 8; launch with "
            r"torchrun --nproc-per-node 8 or set pipeline.data_parallel=1",
        ),
        (
            ["train.global_batch_size=100"],
            4,
            r"global_batch_size \(100\) must equal .* = 64; use a multiple of data_parallel x microbatch_size = 8",
        ),
        (
            ["train.global_batch_size=96"],
            4,
            r"global_batch_size \(96\) must equal .* = 64; set pipeline.num_microbatches=12",
        ),
        (
            ["pipeline.schedule=pipedream"],
            4,
            r"pipeline.schedule \('pipedream'\) is unknown; use one of \['2bw', 'flush', 'zb1p', 'zbv', 'gpipe'\]",
        ),
        (["optim.name=adamx"], 4, r"optim.name \('adamx'\) is not a torch.optim optimizer; use one of .*'adamw'"),
        (
            ["+optim.kwargs.momentm=0.9", "optim.name=sgd"],
            4,
            r"optim.kwargs \(\{'momentm': 0.9\}\) are not valid for SGD",
        ),
        (["model.num_heads=3"], 4, r"num_heads \(3\) must divide model.d_model \(128\)"),
        (["wandb.mode=cloud"], 4, r"wandb.mode \('cloud'\) is unknown"),
        (["train.warmup_steps=10", "train.num_steps=10"], 4, r"warmup_steps \(10\) must be in \[0, train.num_steps"),
        # issue 43: blamed optim.warmup_steps, then a ZeroDivisionError: each number's own range comes first
        (["train.num_steps=-5"], 4, r"^train.num_steps \(-5\) must be >= 1"),
        (["model.num_heads=0"], 4, r"^model.num_heads \(0\) must be >= 1"),
    ],
)
def test_bad_input_names_value_and_fix(overrides, world_size, match):
    with pytest.raises(ConfigError, match=match):
        validate(make(*overrides), world_size=world_size)


def test_even_balance_gives_extras_to_middle_stages():
    assert even_balance(8, 4) == [2, 2, 2, 2]
    assert even_balance(7, 4) == [2, 2, 2, 1]  # then the first stage: the LM head makes the last one heavy
    assert even_balance(6, 4) == [1, 2, 2, 1]
    assert even_balance(5, 1) == [5]
    assert even_balance(3, 2) == [2, 1]


def test_gpt_balance_spreads_blocks_and_adds_the_cheap_end_layers():
    assert gpt_balance(GPTConfig(num_layers=8), 2) == [5, 6]  # [emb + 4 blocks] [4 blocks + norm + head]
    assert gpt_balance(GPTConfig(num_layers=8), 4) == [3, 2, 2, 4]
    assert gpt_balance(GPTConfig(num_layers=8), 1) == [11]
    assert gpt_balance(GPTConfig(num_layers=3), 4) == even_balance(6, 4)  # fewer blocks than stages


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["dist.batch_p2p=true"], "NCCL or dist.batch_p2p"),
        (["swap.enabled=true"], "swap.enabled/swap.stages"),
        (["pipeline.recompute=true"], "pipeline.recompute"),
    ],
)
def test_zbv_refuses_what_it_is_not_proven_with_in_one_line(overrides, key):
    cfg = make("pipeline.schedule=zbv", "pipeline.num_stages=2", *overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    why = "pipeline.schedule=zbv (two chunks a rank) is proven on gloo without"
    assert str(e.value).startswith(f"{why} {key}")
    assert "\n" not in str(e.value) and "or use pipeline.schedule=zb1p" in str(e.value)


def test_zbv_balance_lists_two_chunks_a_stage():
    cfg = make("pipeline.schedule=zbv", "pipeline.num_stages=2")
    assert validate(cfg, world_size=2) == gpt_balance(cfg.model, 4)  # chunks 0 and 3 on rank 0, 1 and 2 on rank 1
    cfg = make("pipeline.schedule=zbv", "pipeline.num_stages=2", "pipeline.balance=[4,4]")
    with pytest.raises(ConfigError, match=r"must list 4 positive layer counts \(one per chunk: zbv runs 2 a stage\)"):
        validate(cfg, world_size=2)


# pipeline.check_ties where every tie is one parameter on one rank: it reported 0 steps checked, as if it had checked
@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["pipeline.schedule=zbv", "pipeline.num_stages=2", "pipeline.num_microbatches=4"], "on rank 0 under"),
        (["pipeline.num_stages=1"], r"on the one stage \(pipeline.num_stages=1\)"),
        (["model.tie_embeddings=false", "pipeline.num_stages=2"], r"no tied weights \(model.tie_embeddings=false\)"),
    ],
)
def test_check_ties_is_refused_where_there_are_no_copies_to_compare(overrides, why):
    tied = ["model.tie_embeddings=true", "pipeline.check_ties=true"]
    with pytest.raises(
        ConfigError, match=rf"^pipeline.check_ties \(true\) compares .*{why}.*set pipeline.check_ties=false$"
    ):
        validate(make(*tied, *overrides), world_size=int(make(*overrides).pipeline.num_stages))
    validate(make(*tied, "pipeline.num_stages=2"), world_size=2)  # embedding and head on two stages: two copies


def test_check_ties_of_a_layer_list_is_refused_where_no_tie_spans_stages():
    from pipedream2bw.pipeline.ties import Tie
    from pipedream2bw.run.start import check_tie_check

    cfg = make("pipeline.check_ties=true", "pipeline.num_stages=2")
    tie = Tie(names=("0.w", "3.w"), shape=(4, 4))
    check_tie_check(cfg, [tie], [2, 2])  # layers 0 and 3 on stages 0 and 1
    with pytest.raises(ConfigError, match=r"every tied weight \(\[\['0.w', '3.w'\]\]\) is one parameter on the rank"):
        check_tie_check(cfg, [tie], [4, 2])
    zbv = make("pipeline.check_ties=true", "pipeline.num_stages=2", "pipeline.schedule=zbv")
    with pytest.raises(ConfigError, match="is one parameter on the rank"):
        check_tie_check(zbv, [tie], [1, 1, 1, 1])  # chunks 0 and 3: rank 0's
    with pytest.raises(ConfigError, match="the model has no tied weights"):
        check_tie_check(cfg, [], [2, 2])
