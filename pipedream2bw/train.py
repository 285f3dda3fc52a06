"""Thin @hydra.main entry point: ``torchrun --nproc-per-node 4 -m pipedream2bw.train [overrides]``."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipedream2bw import precheck
from pipedream2bw.config import TINY_ENV, Config, from_hydra, register_configs, tiny
from pipedream2bw.errors import ConfigError
from pipedream2bw.io import rundir
from pipedream2bw.io.fileio import atomic_write_text
from pipedream2bw.pipeline import comm
from pipedream2bw.run import logs, slurm
from pipedream2bw.run.preempt import Preempted
from pipedream2bw.run.runner import run

log = logging.getLogger("pipedream2bw.train")

_STAMP_ENV = "PD2BW_RUN_STAMP"
_store = None  # the rendezvous store, connected before Hydra so that all ranks agree on the run directory
_record_subdir: Optional[str] = ".hydra"  # hydra.output_subdir as the user set it: where _write_record writes


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    slurm.set_rank_env()  # hydra/launcher=slurm runs this in every task of the job, each a rank (not via cli)
    run_dir = HydraConfig.get().runtime.output_dir
    logs.quiet_ranks(comm.env_rank()[0])
    try:
        cfg: Config = from_hydra(dcfg)  # the DictConfig stops here
        if os.environ.get(TINY_ENV, "0") not in ("", "0"):
            cfg = tiny(cfg)
        run(cfg, run_dir, store=_store, on_start=lambda: _write_record(dcfg, run_dir))
    except ConfigError as e:  # before any process group started; reported once (precheck.report)
        rank, world_size, _ = comm.env_rank()
        precheck.report(f"bad configuration: {e}", rank=rank, world_size=world_size, emit=log.error)
        if rank == 0 and world_size == 1:  # several ranks share the directory: another may be opening its train.log
            _remove_if_only_log(Path(run_dir))
        _exit(2)
    except Preempted as e:  # checkpointed and summarized; a non-zero status gets the job requeued
        log.warning("exiting with %d: %s", e.exit_code, e)
        if slurm.job_id() is not None and comm.env_rank()[0] == 0:
            slurm.requeue()  # every rank has stopped, checkpointed: SLURM starts the job again, it resumes
        _exit(e.exit_code)
    except BaseException as e:  # already logged with its cause by the runner
        log.error("exiting after failure: %s: %s", type(e).__name__, e)
        precheck.write_error_file(f"{type(e).__name__}: {e}")  # torchrun's summary names it
        _exit(1)


def _remove_if_only_log(run_dir: Path) -> None:
    """Removes the run directory of a refused launch when it holds nothing but the train.log Hydra opened for it
    (and its date folder when that is then empty): a refused launch leaves no run behind. One rank only: with several,
    rank 0 removing it raced another rank's Hydra opening train.log there (a traceback instead of the refusal's line);
    the launcher refuses most mistakes before any rank starts, and a directory left behind holds the refusal's log."""
    try:
        if {p.name for p in run_dir.iterdir()} - {"train.log", rundir.LOCK}:  # the lock: a refused resume took it
            return
        (run_dir / "train.log").unlink(missing_ok=True)
        (run_dir / rundir.LOCK).unlink(missing_ok=True)
        run_dir.rmdir()
        run_dir.parent.rmdir()  # outputs/<date>/ when this was its only run; fails (kept) otherwise
    except OSError:
        pass


def _write_record(dcfg: DictConfig, run_dir: str) -> None:
    """Rank 0 writes Hydra's record of the run (config.yaml, hydra.yaml, overrides.yaml in ``.hydra/``)
    once the run is accepted: a relaunch refused for its config or its checkpoint leaves the record of
    the run directory it was pointed at as it was."""
    if comm.env_rank()[0] != 0 or _record_subdir is None:
        return
    hydra_cfg = HydraConfig.get()
    out = Path(run_dir) / _record_subdir
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", OmegaConf.to_yaml(dcfg))
    atomic_write_text(out / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})))
    atomic_write_text(out / "overrides.yaml", OmegaConf.to_yaml(list(hydra_cfg.overrides.task)))


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


def _run_stamp() -> str:
    return os.environ[_STAMP_ENV]


# At import, not in cli(): a submitit job (hydra/launcher=slurm) imports this module to run main(), and
# resolves hydra.sweep.dir there, with the stamp its submitter set (SLURM passes the environment on).
OmegaConf.register_new_resolver("pd2bw_run_stamp", _run_stamp, replace=True)

HELP_FLAGS = ("--help", "-h")


def print_help(argv, *, config_name: str) -> None:
    """Our --help in place of Hydra's: usage, the config groups, every user-facing key with its default and
    a one-line meaning (Hydra's lists the schemas as groups and the config as YAML, with no meanings)."""
    from pipedream2bw.config.docs import help_text

    print(help_text(argv, config_name=config_name))


def cli() -> None:
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print_help(sys.argv[1:], config_name="config")
        return
    rank, world_size, _ = comm.env_rank()
    mistake = precheck.check(
        sys.argv[1:], world_size=world_size, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    )
    if mistake is not None:  # before the store, Hydra's run directory and the model: one line, at once
        precheck.report(f"bad configuration: {mistake}", rank=rank, world_size=world_size)
        _exit(2)
    register_configs()
    slurm.set_rank_env()  # srun without torchrun: each task a rank (before the ranks agree on the run stamp)
    _agree_on_run_stamp()
    # rank 0 alone asks whether a live run holds the directory: it takes the lock itself soon after, and another
    # rank, later here, would find that lock
    unusable = precheck.check_run_dir(sys.argv[1:], config_name="config", live=rank == 0)
    if unusable is not None:  # before Hydra makes the directory and opens train.log in it
        precheck.report(f"bad configuration: {unusable}", rank=rank, world_size=world_size)
        _exit(2)
    global _record_subdir
    for arg in [a for a in sys.argv[1:] if a.startswith("hydra.output_subdir=")]:
        sys.argv.remove(arg)
        value = arg.split("=", 1)[1]
        _record_subdir = None if value in ("null", "None", "") else value
    # Hydra would write .hydra/ before the run is checked; rank 0 writes it once accepted (_write_record).
    sys.argv.append("hydra.output_subdir=null")
    if comm.env_rank()[0] != 0:
        # Hydra's own messages (a multirun's "Launching N jobs", each job's overrides) once, from rank 0
        sys.argv.append("hydra/hydra_logging=disabled")
    try:
        main()
    except SystemExit as e:  # main() itself leaves with os._exit: this is Hydra refusing the command line
        if e.code not in (0, None):  # a key typo, train.num_steps=abc, an output directory it cannot create
            _exit(2)  # bad input, as ConfigError; Hydra printed why
        raise


if __name__ == "__main__":
    cli()
