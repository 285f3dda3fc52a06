"""The training launcher: ``pipedream2bw-train --nproc-per-node 4 [overrides]`` (``python -m pipedream2bw.launch``).

It checks the command line in this one process before any rank starts, as ``deepspeed`` and ``accelerate launch``
do: a mistake is one line on stderr and exit status 2, in seconds, with no rank, store or run directory made.
Otherwise it runs torchrun's elastic launch (``torch.distributed.run``) here, in-process, with the same
arguments and ``-m pipedream2bw.train``, and reports how the run ended in at most one line of its own:

- 0 when every rank finished; 2 when a rank refused the run (it printed why: a mistake only the ranks can see,
  e.g. a run directory in use or a checkpoint of another model);
- 128 + the signal's number on Ctrl-C or SIGTERM (130, 143): torchrun passes the signal to the ranks, which stop
  at an agreed step with a checkpoint once training runs, and exit at once, quietly, before;
- 1 when a rank failed, naming the rank and the cause its error file gives, in place of torchrun's
  ``ChildFailedError`` traceback.

Arguments: torchrun's options first (``--nproc-per-node``, ``--nnodes``, ``--rdzv-*``, ...), then the Hydra
overrides (and Hydra's ``-m``/``--multirun``). ``--help`` after the options prints the training's keys. Without
``--nproc-per-node`` it launches ``pipeline.num_stages x pipeline.data_parallel`` ranks (under partition=manual).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import List, Optional, Sequence, Tuple

EXIT_BAD_INPUT = 2
"""A refused command line or configuration (argparse's status for bad arguments, as the ranks' refusals)."""
USAGE = (
    "usage: pipedream2bw-train [torchrun options: --nproc-per-node N, --nnodes, --rdzv-*, ...] [overrides]\n"
    "       (also python -m pipedream2bw.launch ...; pipedream2bw-train --help lists every key of the overrides)"
)
_FLAG_ONLY = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--virtual-local-rank"}
"""torchrun's options that take no value (``-m``/``--module`` is not one here: the launcher names the module)."""


def split_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(torchrun's options, the training's arguments): the options are the leading ``-`` tokens (with the value
    of each that takes one, ``--nproc-per-node 4`` or ``--nproc-per-node=4``); the training's arguments start at
    the first other token, or at Hydra's ``-m``/``--multirun``/``--help``."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg in ("-m", "--multirun", "-h", "--help"):
            break
        i += 1 if ("=" in arg or arg in _FLAG_ONLY) else 2
    return argv[: min(i, len(argv))], argv[i:]


def _world_size(args) -> Tuple[Optional[int], int]:
    """(ranks in all, ranks on this node) that torchrun's parsed ``args`` start; None in all for an elastic
    ``--nnodes MIN:MAX``, which only the rendezvous decides."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    nproc = determine_local_world_size(args.nproc_per_node)
    low, high = parse_min_max_nnodes(args.nnodes)
    return (nproc * high if low == high else None), nproc


def _option(options: Sequence[str], *names: str) -> Optional[str]:
    """The value of the last of torchrun's ``options`` named one of ``names`` (``--x V`` or ``--x=V``), or None."""
    value = None
    for i, arg in enumerate(options):
        name, eq, v = arg.partition("=")
        if name in names:
            value = v if eq else (options[i + 1] if i + 1 < len(options) else None)
    return value


def _plain_world_size(options: Sequence[str]) -> Optional[Tuple[Optional[int], int]]:
    """``_world_size`` read from the options themselves where they are numbers (``--nproc-per-node 4``,
    ``--nnodes 2`` or ``2:2``; None in all for an elastic ``MIN:MAX``); None where torchrun's parser must count
    (``--nproc-per-node gpu``)."""
    nproc = _option(options, "--nproc-per-node", "--nproc_per_node") or "1"
    low, _, high = (_option(options, "--nnodes") or "1").partition(":")
    if not (nproc.isdigit() and low.isdigit() and (high or low).isdigit()):
        return None
    return (int(nproc) * int(low) if low == (high or low) else None), int(nproc)


def config_ranks(overrides: Sequence[str]) -> Optional[int]:
    """pipeline.num_stages x pipeline.data_parallel x pipeline.tensor_parallel of the composed config under
    partition=manual (the ranks to launch when --nproc-per-node is not given); None where the plan decides them or
    the config does not compose."""
    from omegaconf import OmegaConf

    from pipedream2bw import precheck
    from pipedream2bw.config import register_configs

    if any(a.startswith("-") for a in overrides):  # a multirun, Hydra's flags
        return None
    register_configs()
    try:
        cfg = precheck._compose([a for a in overrides if not a.startswith(("hydra.", "hydra/"))], "config")
    except Exception:  # noqa: BLE001 - the check that follows names the mistake
        return None
    if OmegaConf.select(cfg, "partition.mode") != "manual":
        return None
    d, w = OmegaConf.select(cfg, "pipeline.num_stages"), OmegaConf.select(cfg, "pipeline.data_parallel")
    t = OmegaConf.select(cfg, "pipeline.tensor_parallel", default=1)
    shape = (d, w, t)
    return d * w * t if all(isinstance(n, int) and n > 0 for n in shape) else None


def check(overrides: Sequence[str], *, world_size: Optional[int], local_world_size: int) -> Optional[str]:
    """The first mistake of the training's arguments, as one line, or None (``precheck.check``)."""
    from pipedream2bw import precheck

    if world_size is None:  # elastic: the ranks check it, once the rendezvous has counted them
        return None
    busy = precheck.live_run_dir(overrides)  # first: the config's checks import torch, seconds under load
    if busy is not None:
        return busy
    mistake = precheck.check(overrides, world_size=world_size, local_world_size=local_world_size)
    # a hydra.run.dir named on the command line (the default one, stamped, only the ranks agree on): a link planted in
    # it, not writable (in use by a live run: found first, above; rank 0 looks again when it starts)
    return mistake if mistake is not None else precheck.check_run_dir(overrides, live=False)


def _quiet_torchrun() -> None:
    """torchrun's agent's warnings (a line per rank it stops, each signal) off the console: the launcher reports
    the end of the run itself, in one line. torch sets a level on each of its loggers: each is raised."""
    manager = logging.Logger.manager
    for name in ["torch.distributed", *list(manager.loggerDict)]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class _Interrupted:
    """Ctrl-C as SIGTERM: torchrun passes the signal it gets to the ranks, and a rank still importing dies of
    SIGTERM quietly where SIGINT printed a KeyboardInterrupt traceback per rank (147 lines for 4); a rank that
    trains stops at an agreed step with a checkpoint on either (``train.preempt_signals``)."""

    def __init__(self, args) -> None:
        self.got = False
        handled = [s.strip() for s in str(getattr(args, "signals_to_handle", "")).split(",") if s.strip()]
        self.active = "SIGINT" in handled  # torch >= 2.7 names them (an older one keeps its own SIGINT handler)
        if self.active:
            args.signals_to_handle = ",".join(s for s in handled if s != "SIGINT")
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        self.got = True
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's handler: it stops the ranks with SIGTERM


def _failure_line(error) -> Tuple[int, str]:
    """(exit status, line) for torchrun's ``ChildFailedError``: the first failed rank, its status and cause."""
    rank, failure = error.get_first_failure()
    code = failure.exitcode
    if code == EXIT_BAD_INPUT:
        return EXIT_BAD_INPUT, ""  # the rank printed why
    if code > 128 or code < 0:  # a rank stopped by a signal (preempted: 128 + its number), or killed by one
        signum = code - 128 if code > 128 else -code
        return 128 + signum, ""  # the ranks said so (preempted, checkpointed) or the signal was ours
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    cause = str(message or "").strip().splitlines()
    why = cause[0] if cause and "<N/A>" not in cause[0] else "see the lines above"
    return 1, f"pipedream2bw-train: rank {rank} failed with exit status {code}: {why}"


class _BadOption(Exception):
    pass


def _parse_torchrun_args(argv: Sequence[str]):
    """torchrun's parsed arguments, or None after one line naming a bad option (argparse printed torchrun's usage,
    30 lines, then the error)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str):
        raise _BadOption(message)

    parser.error = error
    try:
        return parser.parse_args(list(argv))
    except _BadOption as e:
        print(f"pipedream2bw-train: {e}; torchrun's options: torchrun --help", file=sys.stderr, flush=True)
        return None


def launch(argv: Sequence[str]) -> int:
    """Checks ``argv`` (torchrun's options, then the overrides) and runs the training under torchrun.

    Returns:
        The exit status (module docstring).
    """
    options, train_args = split_args(argv)
    if "--module" in options:
        print("pipedream2bw-train: --module is the launcher's (-m pipedream2bw.train); leave it out", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not any(o.startswith(("--nproc-per-node", "--nproc_per_node")) for o in options):
        ranks = config_ranks(train_args)  # torchrun's default is 1, which the default 4 stages refuse
        options = [*options, "--nproc-per-node", str(ranks)] if ranks else options
    if any(a in ("-h", "--help") for a in train_args):
        from pipedream2bw.config.docs import help_text

        print(USAGE, end="\n\n")
        print(help_text(train_args, config_name="config"))
        return 0
    sizes = _plain_world_size(options)  # without torch: the check of a mistake needs none
    args = None
    if sizes is None:  # --nproc-per-node gpu|auto|cpu: torchrun's own parser counts them
        args = _parse_torchrun_args([*options, "-m", "pipedream2bw.train", *train_args])
        if args is None:
            return EXIT_BAD_INPUT
        sizes = _world_size(args)
    world_size, nproc = sizes
    mistake = check(train_args, world_size=world_size, local_world_size=nproc)
    if mistake is not None:
        print(f"bad configuration: {mistake}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    args = args or _parse_torchrun_args([*options, "-m", "pipedream2bw.train", *train_args])
    if args is None:
        return EXIT_BAD_INPUT
    where = f"{nproc} ranks" if world_size == nproc else f"{nproc} ranks on this node"
    print(f"pipedream2bw-train: configuration checked; starting {where} (torchrun)", file=sys.stderr, flush=True)
    return _run(args, nproc)


def _run(args, nproc: int) -> int:
    """torchrun's ``run(args)``, its end as an exit status and at most one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its banner
    interrupted = _Interrupted(args)
    _quiet_torchrun()
    try:
        run(args)
    except ChildFailedError as e:
        code, line = _failure_line(e)
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:  # torchrun stopped the ranks with the same signal
        signum = signal.SIGINT if interrupted.got else e.sigval
        print(f"pipedream2bw-train: stopped by {signum.name}", file=sys.stderr, flush=True)
        return 128 + int(signum)
    except KeyboardInterrupt:  # before torchrun installed its handlers
        print("pipedream2bw-train: stopped by SIGINT", file=sys.stderr, flush=True)
        return 130
    return 0


_OLD_API = ("launch_train", "LaunchError", "worker_threads", "train_args")
"""What pipedream2bw.launch held before it was the launcher (now pipedream2bw.run.launch's)."""


def __getattr__(name: str):
    if name not in _OLD_API:
        raise AttributeError(f"module 'pipedream2bw.launch' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(
        f"pipedream2bw.launch.{name} moved to pipedream2bw.run.launch: import it from there (the old path goes in "
        "the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("pipedream2bw.run.launch"), name)


def cli() -> None:
    """The ``pipedream2bw-train`` console script."""
    try:
        code = launch(sys.argv[1:])
    except BrokenPipeError:  # --help | head
        sys.stdout = None  # nothing more to flush where the reader has gone
        code = 0
    except KeyboardInterrupt:  # Ctrl-C while the check composes the config: nothing started
        print("pipedream2bw-train: stopped by SIGINT", file=sys.stderr, flush=True)
        code = 130
    if sys.stdout is not None:
        sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    cli()
