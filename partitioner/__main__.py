"""``python -m partitioner plan [hydra overrides]``: plan a model for a topology and save the plan.

Composes the repo's configs/ as training does, e.g.::

    python -m partitioner plan model=gpt175b topology=cluster topology.nodes=192 train.global_batch_size=1536
    python -m partitioner plan --out plan.yaml topology=cpu train.global_batch_size=64

prints the chosen plan and the runners-up as a table, the chosen plan's stages, and writes the
plan file (``--out``, else ``partition.path``, else ``outputs/plans/<date>/<time>/plan.yaml``).
Exit code 2 with the reason when nothing fits.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from partitioner import time_to_loss
from partitioner.planner import bound_line, save_plan, stage_table, table
from pipedream2bw.config.optimizers import correction_in_effect

USAGE = (
    "usage: python -m partitioner plan [--out FILE] [hydra overrides, e.g. model=gpt topology=dgx "
    "train.global_batch_size=512]"
)
HELP_FLAGS = ("-h", "--help")
HELP = f"""{USAGE}

commands:
  plan    plan a model for a topology, print the best plans and write the chosen one to a plan file
          (python -m partitioner plan --help lists the config groups)"""
PLAN_HELP = f"""{USAGE}

Composes configs/ as training does, plans, prints the chosen plan and the runners-up as a table and
the chosen plan's stages, and writes the plan file (--out FILE, else partition.path, else
outputs/plans/<date>/<time>/plan.yaml), which `torchrun ... -m pipedream2bw.train partition=file
partition.path=<file>` runs. Exit code 2 with the reason when nothing fits. Examples:

  python -m partitioner plan --out plan.yaml topology=cpu train.global_batch_size=64
  python -m partitioner plan model=gpt175b topology=cluster topology.nodes=192 train.global_batch_size=1536

== Configuration groups ==
Compose your configuration from those groups (group=option)

{{groups}}

Any key of the config can be overridden (key=value): python -m pipedream2bw.train --help lists them
with their defaults."""


def compose(overrides):
    """The run's Config from configs/ and ``overrides`` (as ``pipedream2bw.train`` composes it)."""
    from pipedream2bw.config import from_hydra
    from pipedream2bw.config.docs import compose as compose_configs

    return from_hydra(compose_configs(overrides))


def config_groups() -> str:
    """configs/' groups and their options, one line each (``model: custom, gpt, ...``), as the training --help."""
    from pipedream2bw.config.docs import config_groups as groups

    return "\n".join(f"{group}: {', '.join(options)}" for group, options in groups().items())


def main(argv=None) -> int:
    from partitioner.auto import plan_config, plan_optim, plan_rule
    from pipedream2bw.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in HELP_FLAGS:
        print(HELP)
        return 0
    if not argv or argv[0] != "plan":
        print(USAGE, file=sys.stderr)
        return 2
    if any(a in HELP_FLAGS for a in argv[1:]):
        print(PLAN_HELP.format(groups=config_groups()))
        return 0
    args, out = _out_option(argv[1:])
    if args is None:
        print(f"{out}\n{USAGE}", file=sys.stderr)
        return 2
    cfg = compose(args)
    start = time.perf_counter()
    try:
        plans = plan_config(cfg, search_tensor=True)  # t searched: the run line names it (pipeline.tensor_parallel)
    except ConfigError as e:
        print(f"bad configuration: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    best = plans[0]
    from pipedream2bw.config import GPTConfig

    model = (
        f"{cfg.model.num_layers} blocks, d_model {cfg.model.d_model}, seq {cfg.model.seq_len}, "
        f"vocab {cfg.model.vocab_size}"
        if isinstance(cfg.model, GPTConfig)
        else f"{cfg.model.name} ({cfg.model.target}), seq {cfg.model.seq_len}"
    )
    # 2bw: the delay correction its memory counts (optim.delay_correction, 'auto' resolved: config/corrections.py)
    correction = ""
    rule, optim = plan_rule(cfg, best), plan_optim(cfg, best)  # 'auto''s newest: batch where the plan recomputes
    if best.schedule == "2bw":
        correction = f" ({'newest, ' if rule == 'newest' else ''}delay correction {correction_in_effect(optim, '2bw')})"
    print(
        f"model: {model}; "
        f"topology {cfg.topology.name}: {best.devices} devices x {best.memory_per_device_bytes / 2**30:.3g} GiB; "
        f"global batch {best.global_batch_size}; {best.schedule}{correction}; objective {best.objective}; "
        f"{best.costs} costs; planned in {elapsed:.2f} s"
    )
    if best.schedule_choice:
        chosen_rule = rule if best.schedule == "2bw" else cfg.pipeline.weight_versions
        why = dict(factors=best.schedule_factors, weight_versions=chosen_rule)
        print(time_to_loss.describe(best.schedule_choice, optim, best.schedule, **why))
    print(table(plans))
    print(f"\nchosen plan (#0): {mesh_line(best)}; per stage (one rank's figures):\n{stage_table(best)}")
    if best.steps_on_host:
        print(f"\n{bound_line(best)}")
    path = Path(out or cfg.partition.path or Path("outputs", "plans", time.strftime("%Y-%m-%d/%H-%M-%S"), "plan.yaml"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path = save_plan(best, path)
    print(f"\nplan written to {path}; run it with\n  {_run_line(cfg, args, best, path)}")
    return 0


def mesh_line(plan) -> str:
    """The plan's mesh in words: ``'mesh 8 x 16 x 8 (stages x replicas x tensor ranks), 1024 ranks; a tensor group is 8
    consecutive ranks on one node'``."""
    line = f"mesh {plan.mesh} (stages x replicas x tensor ranks), {plan.num_ranks} ranks"
    if plan.tensor_parallel > 1:
        sp = ", sequence parallel" if plan.sequence_parallel else ""
        line += f"; a tensor group is {plan.tensor_parallel} consecutive ranks on one node{sp}"
    return line


def _out_option(args):
    """Splits ``--out FILE`` / ``--out=FILE`` from the Hydra overrides.

    Returns:
        (overrides, the file or None), or (None, an error message) when ``--out`` has no file.
    """
    rest, out = [], None
    it = iter(args)
    for a in it:
        if a == "--out":
            out = next(it, None)
            if out is None:
                return None, "--out needs a file name"
        elif a.startswith("--out="):
            out = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, out


def _run_line(cfg, args, best, path) -> str:
    """The command that trains what was planned: the overrides that shape it (model, optimizer, precision,
    batch...) go along; the planner's own (topology, partition) do not."""
    from partitioner.auto import run_overrides

    nproc = best.num_ranks
    launch = f"torchrun --nproc-per-node {nproc}" if cfg.topology.nodes == 1 else f"torchrun ({nproc} ranks)"
    extra = run_overrides(cfg.optim, best)  # the optimizer a host step runs (auto.host_optimizer)
    extra += [f"pipeline.tensor_parallel={best.tensor_parallel}"] if best.tensor_parallel > 1 else []
    moot = set()
    if cfg.pipeline.schedule == time_to_loss.AUTO:
        extra.append(f"pipeline.schedule={best.schedule}")
        if best.schedule != "2bw":  # 2bw's rule, moot under the others (auto.apply_plan), refused where named
            moot.add("pipeline.weight_versions")
    keys = {a.split("=", 1)[0] for a in extra} | moot
    run_overrides_ = [a for a in args if not a.lstrip("+~").startswith(("topology", "partition"))]
    run_overrides_ = [a for a in run_overrides_ if a.lstrip("+~").split("=", 1)[0] not in keys] + extra
    return f"{launch} -m pipedream2bw.train " + " ".join([*run_overrides_, "partition=file", f"partition.path={path}"])


if __name__ == "__main__":
    sys.exit(main())
