"""``python -m partitioner plan [hydra overrides]``: plan a model for a topology and save the plan.

Composes the repo's configs/ as training does, e.g.::

    python -m partitioner plan model=gpt175b topology=cluster topology.nodes=128 train.global_batch_size=1536
    python -m partitioner plan topology=cpu train.global_batch_size=64 partition.path=plan.yaml

prints the chosen plan and the runners-up as a table, the chosen plan's stages, and writes the
plan file (``partition.path``, default ``plan.yaml``). Exit code 2 with the reason when nothing fits.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from partitioner.planner import save_plan, stage_table, table

USAGE = "usage: python -m partitioner plan [hydra overrides, e.g. model=gpt topology=dgx train.global_batch_size=512]"


def compose(overrides):
    """The run's Config from configs/ and ``overrides`` (as ``pipedream2bw.train`` composes it)."""
    import os

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from pipedream2bw.config import from_hydra, register_configs

    register_configs()
    OmegaConf.register_new_resolver("pd2bw_run_stamp", lambda: os.environ.get("PD2BW_RUN_STAMP", "plan"), replace=True)
    config_dir = Path(__file__).resolve().parent.parent / "configs"
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return from_hydra(hydra_compose(config_name="config", overrides=list(overrides)))


def main(argv=None) -> int:
    from partitioner.auto import plan_config
    from pipedream2bw.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "plan":
        print(USAGE, file=sys.stderr)
        return 2
    cfg = compose(argv[1:])
    start = time.perf_counter()
    try:
        plans = plan_config(cfg)
    except ConfigError as e:
        print(f"bad configuration: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    best = plans[0]
    from pipedream2bw.config import GPTConfig

    model = (
        f"{cfg.model.num_layers} blocks, d_model {cfg.model.d_model}, seq {cfg.model.seq_len}, vocab {cfg.model.vocab_size}"
        if isinstance(cfg.model, GPTConfig)
        else f"{cfg.model.name} ({cfg.model.target}), seq {cfg.model.seq_len}"
    )
    print(
        f"model: {model}; "
        f"topology {cfg.topology.name}: {best.devices} devices x {best.memory_per_device_bytes / 2**30:.3g} GiB; "
        f"global batch {best.global_batch_size}; {best.schedule}; objective {best.objective}; {best.costs} costs; "
        f"planned in {elapsed:.2f} s"
    )
    print(table(plans))
    print(f"\nchosen plan (#0), per stage:\n{stage_table(best)}")
    path = save_plan(best, cfg.partition.path or "plan.yaml")
    print(f"\nplan written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
