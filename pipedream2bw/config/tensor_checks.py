"""config/validate.py's checks of pipeline.tensor_parallel > 1 and pipeline.sequence_parallel: what a tensor split
does not compose with, and the sequence split's model and window rules."""

from __future__ import annotations

from typing import Optional

from pipedream2bw.config.schema import Config, GPTConfig, HFModelConfig
from pipedream2bw.errors import ConfigError


def tensor_parallel_refusal(cfg: Config, *, gpt: bool) -> Optional[str]:
    """What of ``cfg`` pipeline.tensor_parallel > 1 does not compose with (one line's tail), or None."""
    p, mdl, sw = cfg.pipeline, cfg.model, cfg.swap
    refusals = [
        (
            not isinstance(mdl, (GPTConfig, HFModelConfig)) or (isinstance(mdl, GPTConfig) and not gpt),
            "splits the built-in GPT (model=gpt) and model=hf's Llama family only, not a user's layer list (no plan "
            "says which of its matrices to split); set pipeline.tensor_parallel=1 for this model",
        ),
        (
            sw.weights or sw.optimizer != "device",  # activation swapping (swap.enabled, swap.stages) composes
            "with swap.weights / swap.optimizer=host: streaming tensor shards and stepping them on the host are not "
            "built; set swap.weights=false swap.optimizer=device",
        ),
        (
            cfg.train.precision == "fp16",
            "with train.precision (fp16): its loss scaler's skip is not proven on split blocks; set "
            "train.precision=bf16 or fp32",
        ),
        (
            cfg.data.packing != "windows",
            f"with data.packing ({cfg.data.packing}): not proven at t > 1; set data.packing=windows",
        ),
        (
            p.schedule == "zb1p",
            "with pipeline.schedule (zb1p): its split backward is not proven on split blocks; use flush or 2bw",
        ),
    ]
    return next((why for refused, why in refusals if refused), None)


def validate_sequence_parallel(cfg: Config) -> None:
    """pipeline.sequence_parallel at t > 1: the built-in GPT's blocks or model=hf's Llama family's decoder layers
    (the families tensor_parallel splits) on whole windows whose tokens t divides."""
    t, mdl = cfg.pipeline.tensor_parallel, cfg.model
    if not cfg.pipeline.sequence_parallel:
        return
    why = "pipeline.sequence_parallel (true)"  # a layer list: tensor_parallel_refusal's
    if mdl.seq_len % t:
        raise ConfigError(
            f"{why} needs model.seq_len ({mdl.seq_len}) divisible by pipeline.tensor_parallel ({t}): each tensor "
            f"rank holds seq_len / t tokens; set model.seq_len to a multiple of {t} or pipeline.sequence_parallel=false"
        )
    if cfg.data.packing != "windows":
        raise ConfigError(
            f"{why} with data.packing ({cfg.data.packing}): packed documents' positions are not split along the "
            "sequence; set data.packing=windows or pipeline.sequence_parallel=false"
        )
