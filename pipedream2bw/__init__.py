"""PipeDream-2BW: pipeline-parallel training with double-buffered weights and 1F1B without flushes.

The public API (docs/develop.md, "Python API"): ``from pipedream2bw import Config, run`` with the config's
section classes, the GPT builders and loss (``build_gpt_layers``, ``lm_loss``) and the token data
(``open_tokens``, ``MicrobatchFeed``). Imported on first use, so that ``import pipedream2bw.io.fileio`` (or any
one module) loads only what that module needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipedream2bw import moved

__version__ = "0.1.0"
moved.install()  # the old module paths, with a DeprecationWarning

# name -> the module that defines it
_API = {
    "run": "pipedream2bw.run.runner",
    "Config": "pipedream2bw.config",
    "ConfigError": "pipedream2bw.errors",
    "PipelineConfig": "pipedream2bw.config",
    "GPTConfig": "pipedream2bw.config",
    "LayerListConfig": "pipedream2bw.config",
    "HFModelConfig": "pipedream2bw.config",
    "OptimConfig": "pipedream2bw.config",
    "DataConfig": "pipedream2bw.config",
    "TrainConfig": "pipedream2bw.config",
    "DistConfig": "pipedream2bw.config",
    "WandbConfig": "pipedream2bw.config",
    "SweepConfig": "pipedream2bw.config",
    "TopologyConfig": "pipedream2bw.config",
    "PartitionConfig": "pipedream2bw.config",
    "SwapConfig": "pipedream2bw.config",
    "build_gpt_layers": "pipedream2bw.models.gpt",
    "lm_loss": "pipedream2bw.models.gpt",
    "open_tokens": "pipedream2bw.data.tokens",
    "MicrobatchFeed": "pipedream2bw.data.tokens",
}

__all__ = [
    "run",
    "Config",
    "ConfigError",
    "PipelineConfig",
    "GPTConfig",
    "LayerListConfig",
    "HFModelConfig",
    "OptimConfig",
    "DataConfig",
    "TrainConfig",
    "DistConfig",
    "WandbConfig",
    "SweepConfig",
    "TopologyConfig",
    "PartitionConfig",
    "SwapConfig",
    "build_gpt_layers",
    "lm_loss",
    "open_tokens",
    "MicrobatchFeed",
]  # = _API's keys

if TYPE_CHECKING:
    from pipedream2bw.config import (
        Config,
        DataConfig,
        DistConfig,
        GPTConfig,
        HFModelConfig,
        LayerListConfig,
        OptimConfig,
        PartitionConfig,
        PipelineConfig,
        SwapConfig,
        SweepConfig,
        TopologyConfig,
        TrainConfig,
        WandbConfig,
    )
    from pipedream2bw.data.tokens import MicrobatchFeed, open_tokens
    from pipedream2bw.errors import ConfigError
    from pipedream2bw.models.gpt import build_gpt_layers, lm_loss
    from pipedream2bw.run.runner import run


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'pipedream2bw' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list:
    return sorted({*globals(), *_API})
