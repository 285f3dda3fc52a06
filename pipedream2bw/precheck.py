"""The training entry point's first look at its command line: composes the config and checks it before the
rendezvous store, Hydra's run directory and the model are made, so that a mistake is one line, at once.

Under torchrun every rank checks the same command line and finds the same mistake: rank 0 prints it; the
other ranks wait for torchrun to stop them (it does once rank 0 exits) and print it only if rank 0 did not
(a mistake only they can see). The rank that reports it also writes it to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``), so that torchrun's failure summary names it as the root cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
_HELP = "; python -m pipedream2bw.train --help lists every key"
PEER_WAIT_S = 15.0
"""How long a rank other than 0 waits, under torchrun, for rank 0 to report the mistake and torchrun to stop it."""


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _hydra_error(e: BaseException, overrides: Sequence[str], config_name: str) -> str:
    """Hydra's composition error as one line; an override of a key no schema has gets the key meant."""
    from hydra.errors import MissingConfigException

    text = str(e)
    if text.startswith("Could not override '"):
        key = text[len("Could not override '") :].split("'", 1)[0]
        added = [f"+{o}" if o.split("=", 1)[0] == key else o for o in overrides]
        try:  # added with +, the key reaches check_known_keys, which names the closest valid key
            from pipedream2bw.config import check_known_keys

            check_known_keys(_compose(added, config_name))
        except Exception as again:  # ConfigError (the usual case), or Hydra's refusal of the + form
            if "unknown config key" in str(again):  # without check_known_keys' advice on the + form
                return _first_line(again).split("; a key added with +")[0] + _HELP
        return f"unknown config key: {key}{_HELP}"
    if isinstance(e, MissingConfigException):  # model=gtp: the options, without the schemas (base_*)
        missing = text.split("Could not find '", 1)[-1].split("'", 1)[0]
        options = [o for o in (getattr(e, "options", None) or []) if not o.startswith("base_")]
        if "/" in missing and options:
            group, option = missing.rsplit("/", 1)
            return f"{group}={option}: no such option in {group}; use one of {', '.join(options)}"
    cause = e.__cause__
    return _first_line(e) + (f": {_first_line(cause)}" if cause is not None else "")


def _compose(overrides: Sequence[str], config_name: str, *, hydra: bool = False):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra)


def check(argv: Sequence[str], *, world_size: int, local_world_size: int, config_name: str = "config") -> Optional[str]:
    """The first mistake of a training command line, as one line, or None (None also where it cannot tell
    here: a multirun, Hydra's own flags, a model or partition whose checks need the model built or a plan).

    Checks what the runner's ``preflight.check`` checks for the GPT under a manual partition, and for every
    model what composing the config and typing it (``from_hydra``) checks, with the rule and correction a resume
    takes from its checkpoint (io/manifests.py's ``resumed_settings``)."""
    if any(a.startswith("-") for a in argv):  # --multirun, --cfg job, --info, ...: Hydra's business
        return None
    overrides: List[str] = [a for a in argv if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    from pipedream2bw.config import register_configs

    register_configs()
    with _quiet():
        return _check(overrides, config_name, world_size=world_size, local_world_size=local_world_size, argv=argv)


@contextlib.contextmanager
def _quiet():
    """The check logs none of the validation's warnings: the run logs each once, from rank 0 (``logs.quiet_ranks``),
    where this check would print it once more in the launcher and once in every rank."""
    package = logging.getLogger("pipedream2bw")
    level = package.level
    package.setLevel(logging.ERROR)
    try:
        yield
    finally:
        package.setLevel(level)


def _check(
    overrides: List[str], config_name: str, *, world_size: int, local_world_size: int, argv: Sequence[str] = ()
) -> Optional[str]:
    from hydra.errors import HydraException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from pipedream2bw.config import TINY_ENV, GPTConfig, default_plan_choices, from_hydra, tiny, validate
    from pipedream2bw.config.ranges import check_ranges
    from pipedream2bw.errors import ConfigError
    from pipedream2bw.io.manifests import resumed_settings

    try:
        dcfg = _compose(overrides, config_name)
    except (HydraException, OmegaConfBaseException) as e:
        return _hydra_error(e, overrides, config_name)
    try:
        cfg = from_hydra(dcfg)
        if os.environ.get(TINY_ENV, "0") not in ("", "0"):
            cfg = tiny(cfg)
        check_ranges(cfg)  # (validate's first check) then the resume's, before the checks that import torch
        check_resume(cfg.train)
        # the checkpoint's rule and correction where 'auto' chose them, as the ranks will resume it, so that its
        # refusal comes before any rank starts and what follows checks what runs (under auto, in hydra.run.dir)
        cfg = resumed_settings(cfg, _run_dir(argv, config_name) if cfg.train.resume == "auto" else None)
        if isinstance(cfg.model, GPTConfig) and cfg.partition.mode == "manual":
            plan = default_plan_choices(cfg)
            # the config's own checks first: they import torch only for the optimizer, so a mistake before it is
            # found without torch (1-2 s of a check, more under load); the run's checks (data files) import it
            validate(plan, world_size=world_size, local_world_size=local_world_size)
            from pipedream2bw.run.preflight import check as preflight_check

            preflight_check(plan, world_size=world_size, local_world_size=local_world_size)
    except ConfigError as e:
        return str(e)
    except MissingMandatoryValue as e:  # model=custom without model._target_
        key = getattr(e, "full_key", None) or "a value"
        return f"{key} has no value (??? in configs/); set it: {key}=..."
    except (HydraException, OmegaConfBaseException) as e:  # e.g. a value of the wrong type in to_object
        return _first_line(e)
    return None


def check_resume(train) -> None:
    """``train.resume=PATH`` before any rank starts: PATH holds a checkpoint, and its newest (by its manifest alone:
    the ranks verify the files, the model and the settings) is not already at ``train.num_steps``.

    Raises:
        ConfigError: naming the path and what to set, in the words rank 0 would use.
    """
    if train.resume in ("auto", "never"):
        return
    from pipedream2bw.errors import ConfigError
    from pipedream2bw.io.manifests import resumable_steps

    path = Path(train.resume)
    if not path.exists():  # validate says so, in its own words
        return
    steps = resumable_steps(path)
    if steps is None:
        raise ConfigError(
            f"train.resume ({train.resume}) holds no complete checkpoint with intact files; "
            f"point it at another checkpoint or use train.resume=never"
        )
    if steps and steps[0] >= train.num_steps:
        raise ConfigError(
            f"checkpoint {path} is at step {steps[0]}, and train.num_steps is {train.num_steps}: nothing left to "
            f"train; to train further, raise train.num_steps (e.g. train.num_steps={2 * steps[0]}), or start afresh "
            "with train.resume=never"
        )


def check_run_dir(argv: Sequence[str], *, config_name: str = "config", live: bool = True) -> Optional[str]:
    """What makes the run directory this command line names (``hydra.run.dir``, resolved as Hydra will) unusable,
    as one line, or None: checked before Hydra makes it and opens ``train.log`` there, which would fail with raw
    tracebacks (a directory under a file, or not writable) or append through a link planted in it. The directory
    is made here, as Hydra makes it next. None also where it cannot tell: a multirun or Hydra's own flags, a
    directory it cannot resolve (Hydra then reports that itself). ``live``: also refuse a directory a live run
    holds (rank 0, or the launcher, before any rank: a later rank of the same launch would find rank 0's own lock)."""
    run_dir = _run_dir(argv, config_name)
    if run_dir is None:
        return None
    from pipedream2bw.errors import ConfigError
    from pipedream2bw.io import rundir

    where = f"hydra.run.dir ({run_dir})"
    fix = "point hydra.run.dir at a directory this user can write"
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        made = "is not a directory" if existing == run_dir else f"cannot be made: {existing} is a file"
        return f"{where} {made}; {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{where} cannot be written: {existing} is not writable (a read-only directory or file system); {fix}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)  # as Hydra would next: what access() cannot foresee (/proc/x)
    except OSError as e:
        return f"{where} cannot be made: {e.strerror or e} ({e.filename or run_dir}); {fix}"
    log_file = run_dir / "train.log"
    if log_file.exists() and not log_file.is_symlink() and not log_file.is_file():
        return f"{where} holds a train.log that is not a file, where the run logs; remove it, or {fix}"
    try:
        rundir.check_no_links(run_dir)
    except ConfigError as e:
        return str(e)
    return _in_use(run_dir) if live else None


def _run_dir(argv: Sequence[str], config_name: str) -> Optional[Path]:
    """``hydra.run.dir`` of the command line, resolved as Hydra will; None for a multirun, Hydra's flags or a
    directory Hydra would refuse itself."""
    if any(a.startswith("-") for a in argv):
        return None
    from omegaconf import OmegaConf

    from pipedream2bw.config import register_configs

    register_configs()
    try:
        return Path(str(OmegaConf.select(_compose(argv, config_name, hydra=True), "hydra.run.dir")))
    except Exception:  # noqa: BLE001 - Hydra's own refusal, which Hydra reports
        return None


def _in_use(run_dir: Path) -> Optional[str]:
    """The one line refusing ``run_dir`` when a live run holds it (refused before Hydra appends this run's refusal
    to the live run's train.log), else None."""
    from pipedream2bw.io import rundir

    holder = rundir.live_holder(run_dir)
    if holder is None:
        return None
    return (
        f"run directory {run_dir.resolve()} is in use by a live run ({holder}); wait for it to end, "
        f"or start this one in another directory (hydra.run.dir=...)"
    )


def live_run_dir(argv: Sequence[str], *, config_name: str = "config") -> Optional[str]:
    """The launcher's first check: the run directory the command line names is held by a live run (read only:
    nothing made), found before the checks that import torch."""
    run_dir = _run_dir(argv, config_name)
    return _in_use(run_dir) if run_dir is not None and run_dir.is_dir() else None


def write_error_file(message: str) -> None:
    """Writes ``message`` where torchrun's agent reads a worker's failure (its summary's root cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # torch's ErrorHandler format; the summary prints py_callstack, here the message alone
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    except OSError:
        pass  # the message is on the console as well


def report(message: str, *, rank: int, world_size: int, emit=None) -> None:
    """Reports a refused configuration once: rank 0 reports it; another rank under torchrun waits for torchrun to
    stop it after rank 0 exits, and reports it only if that does not happen (rank 0 found no mistake).

    Args:
        message: the line, e.g. ``bad configuration: ...``.
        emit: prints the line (default: to stderr, ``[rank R] `` first when there are several ranks).
    """
    if rank != 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(PEER_WAIT_S)  # an error file written before would be torchrun's root cause: the first in time
    write_error_file(message)
    if emit is not None:
        emit(message)
    else:
        prefix = f"[rank {rank}] " if world_size > 1 else ""
        print(f"{prefix}{message}", file=sys.stderr, flush=True)
