"""The run's typed config: its schema (dataclasses Hydra composes), the checks of its values, the reference docs.
Imports only errors, hydra and omegaconf; torch once an optimizer is named or built (``_LAZY``), so that the
launcher composes and checks a command line without it. Nothing of data, models, io, or torch.distributed.
"""

import importlib

from pipedream2bw.config.schema import (
    BACKENDS,
    LR_SCHEDULERS,
    ON_NONFINITE,
    PRECISIONS,
    SCHEDULES,
    TINY_ENV,
    UNCATCHABLE,
    WANDB_MODES,
    WEIGHT_DTYPES,
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
    check_known_keys,
    default_plan_choices,
    even_balance,
    from_hydra,
    gpt_balance,
    layer_list_config,
    model_num_layers,
    register_configs,
    swap_stages,
    target_optim_config,
    tiny,
)
from pipedream2bw.config.validate import (
    SAVE_FINAL,
    require_file,
    signal_numbers,
    v_schedule_refusal,
    validate,
    validate_steps,
)
from pipedream2bw.errors import ConfigError  # re-exported: users' code imports it from here

_LAZY = ("ELEMENTWISE_OPTIMIZERS", "build_optimizer", "optimizer_class", "optimizer_name", "param_groups")
"""config.optim's names, which import torch: imported at their first use (PEP 562)."""


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("pipedream2bw.config.optim"), name)
    globals()[name] = value
    return value


__all__ = [
    "ConfigError",
    "v_schedule_refusal",
    "SCHEDULES",
    "WANDB_MODES",
    "BACKENDS",
    "LR_SCHEDULERS",
    "ON_NONFINITE",
    "PRECISIONS",
    "WEIGHT_DTYPES",
    "UNCATCHABLE",
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
    "Config",
    "register_configs",
    "optimizer_class",
    "optimizer_name",
    "param_groups",
    "build_optimizer",
    "even_balance",
    "TINY_ENV",
    "tiny",
    "model_num_layers",
    "gpt_balance",
    "swap_stages",
    "ELEMENTWISE_OPTIMIZERS",
    "signal_numbers",
    "validate_steps",
    "default_plan_choices",
    "SAVE_FINAL",
    "require_file",
    "validate",
    "from_hydra",
    "check_known_keys",
    "layer_list_config",
    "target_optim_config",
]
