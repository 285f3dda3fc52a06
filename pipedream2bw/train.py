"""Thin @hydra.main entry point: ``torchrun --nproc-per-node 4 -m pipedream2bw.train [overrides]``."""

from __future__ import annotations

import logging
import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipedream2bw import comm
from pipedream2bw.config import TINY_ENV, Config, from_hydra, register_configs, tiny
from pipedream2bw.errors import ConfigError
from pipedream2bw.runner import run

log = logging.getLogger("pipedream2bw.train")

_STAMP_ENV = "PD2BW_RUN_STAMP"
_store = None  # the rendezvous store, connected before Hydra so that all ranks agree on the run directory


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    try:
        cfg: Config = from_hydra(dcfg)  # the DictConfig stops here
        if os.environ.get(TINY_ENV, "0") not in ("", "0"):
            cfg = tiny(cfg)
        run(cfg, HydraConfig.get().runtime.output_dir, store=_store)
    except ConfigError as e:
        log.error("bad configuration: %s", e)  # before any process group started
        _exit(2)
    except BaseException as e:  # already logged with its cause by the runner
        log.error("exiting after failure: %s: %s", type(e).__name__, e)
        _exit(1)


def _exit(code: int) -> None:
    """Leaves at once: a failed rank must not wait on peers or pending transfers at interpreter exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _agree_on_run_stamp() -> None:
    """Sets PD2BW_RUN_STAMP on every rank to the start time of the first rank to ask, for hydra.run.dir."""
    global _store
    rank, world_size, _ = comm.env_rank()
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    if world_size > 1 and _STAMP_ENV not in os.environ:
        _store = comm.make_store(
            rank=rank, world_size=world_size, timeout_s=float(os.environ.get("PD2BW_STORE_TIMEOUT_S", 300))
        )
        # Agreed once per launch, not per attempt: a job that torchrun restarts keeps its run
        # directory and resumes from the checkpoints there (train.resume=auto).
        stamp = comm.agree_on_string(comm.launch_scope(_store), "run_stamp", stamp)
    os.environ.setdefault(_STAMP_ENV, stamp)


HELP_FLAGS = ("--help", "-h")


def print_help(argv, *, config_name: str) -> None:
    """Our --help in place of Hydra's: usage, the config groups, every user-facing key with its default and
    a one-line meaning (Hydra's lists the schemas as groups and the config as YAML, with no meanings)."""
    from pipedream2bw.config_docs import help_text

    print(help_text(argv, config_name=config_name))


def cli() -> None:
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print_help(sys.argv[1:], config_name="config")
        return
    register_configs()
    OmegaConf.register_new_resolver("pd2bw_run_stamp", lambda: os.environ[_STAMP_ENV], replace=True)
    _agree_on_run_stamp()
    if comm.env_rank()[0] != 0:
        sys.argv.append("hydra.output_subdir=null")  # rank 0 alone writes .hydra/ into the shared run dir
        # Hydra's own messages (a multirun's "Launching N jobs", each job's overrides) once, from rank 0
        sys.argv.append("hydra/hydra_logging=disabled")
    main()


if __name__ == "__main__":
    cli()
