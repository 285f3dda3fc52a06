"""Preemption: a signal (SIGTERM from SLURM or Kubernetes) makes every rank stop at one agreed step, checkpointed.

A scheduler that preempts a job sends SIGTERM to its processes and kills them a grace period later
(SLURM: 30 s by default; Kubernetes: 30 s). torchrun forwards the signal to its workers and waits
30 s for them; ``srun`` sends it to every process at once. Either way some ranks see it and some
may not (yet), at different points of their schedule. Here:

- a handler (``Watch``) only notes the first signal of ``train.preempt_signals`` (SIGTERM and SIGINT by
  default: Ctrl-C stops a run as a preemption does; Ctrl-C again, ``AGAIN_AFTER_S`` later, exits at once);
- after every step t, each rank starts summing its flag over all ranks in the background
  (``Agreement``, one scalar all-reduce per step on a gloo group of its own, waited with
  ``dist.timeout_s``) and, after step t+1, reads the sum of step t: every rank reads the same sum
  after the same step, so all stop after the same step, with W(t+2), within two steps of the signal;
- the stop is a checkpoint of that step (written whatever ``train.checkpoint_every``), then a
  ``Preempted`` exception out of the stage's loop. A stage reaches its step using only what its
  neighbours send before their own step (``evaluate``'s argument), so no rank waits on one that stopped.

The entry point then writes summary.json (``"preempted"``) and exits with 128 + the signal's number
(143 for SIGTERM), the status of a process ended by that signal: schedulers and launchers count it
as a failure, so ``srun --requeue``, a Kubernetes restart policy or torchrun ``--max-restarts``
start the job again, and ``train.resume=auto`` continues from the checkpoint, bit for bit.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Dict, Optional, Sequence

import torch

from pipedream2bw.config import UNCATCHABLE, signal_numbers  # noqa: F401  (re-exported)
from pipedream2bw.errors import ConfigError

log = logging.getLogger(__name__)
AGAIN_AFTER_S = 2.0
"""A second SIGINT this long after the first aborts at once (Ctrl-C twice). Sooner, it is the same Ctrl-C
arriving twice: the terminal sends it to every process, and torchrun passes its own on to its workers."""


class Preempted(BaseException):
    """Every rank stopped after ``step`` steps on a preemption signal, with a checkpoint of that step.

    A ``BaseException``, as ``KeyboardInterrupt``: the stage's loop lets it through without reporting
    a failure, and no ``except Exception`` on the way mistakes it for one.
    """

    def __init__(self, step: int, signum: int, received: Optional[Dict[str, int]] = None):
        got = "" if not received or len(received) < 2 else f" (ranks got {describe(received)})"
        super().__init__(f"preempted by {signal.Signals(signum).name}{got}: stopped after step {step}, checkpointed")
        self.step, self.signum, self.received = step, signum, dict(received or {})

    @property
    def exit_code(self) -> int:
        """128 + the signal's number: what a process ended by that signal reports (143 for SIGTERM)."""
        return 128 + self.signum


def describe(received: Dict[str, int]) -> str:
    """E.g. 'SIGTERM on 1 rank, SIGUSR1 on 3 ranks'."""
    return ", ".join(f"{name} on {n} rank{'s' if n > 1 else ''}" for name, n in received.items())


class Watch:
    """Notes the first of ``signals`` this process receives (its handlers only set a flag); a context
    manager that installs them and puts the previous ones back. Outside the main thread (where Python
    cannot install handlers) it installs none and says so."""

    def __init__(self, signals: Sequence[str]):
        self.signals = signal_numbers(signals)
        self.received: Optional[int] = None
        self._at = 0.0  # when the first signal came (time.monotonic())
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received, self._at = signum, time.monotonic()
        elif signum == signal.SIGINT and time.monotonic() - self._at >= AGAIN_AFTER_S:
            # Ctrl-C again: the user does not want to wait for the checkpoint. No logging here (a handler may
            # interrupt a thread holding the logging lock): one write, then leave as SIGINT's default would.
            os.write(2, b"interrupted again: exiting at once, without a checkpoint of the last steps\n")
            os._exit(128 + signal.SIGINT)

    def __enter__(self) -> "Watch":
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.warning("train.preempt_signals: not in the main thread, so no handler: a signal ends the run unsaved")
            return self
        for signum in self.signals.values():
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        installed = bool(self._previous)
        self._previous.clear()
        if installed and self.received is not None and exc_type is not None and issubclass(exc_type, ConfigError):
            # A refused run that was told to stop meanwhile (torchrun stops the other ranks once one refuses) stops
            # now, as the signal would have made it: a peer left to report the refusal itself waited 15 s for it
            # and printed it again (precheck.report)
            signal.raise_signal(self.received)


class Agreement:
    """Every rank's decision to stop, the same on all: ``after_step(t)`` after each step t (in order).

    Args:
        watch: this process's signal flag.
        channel: a ``comm.AsyncSum`` over all ranks (its own gloo group: a CPU scalar, no device sync);
            None for one process, which decides alone after the step in which it got the signal (a gloo
            all-reduce over one rank cost 1-2 ms a step).
        last_step: the run's last step index (``num_steps - 1``): no sum is started after it.
    """

    def __init__(self, watch: Watch, channel: Any, *, last_step: int):
        self.watch, self.channel, self.last_step = watch, channel, last_step
        self._pending = False
        self.signum = 0  # the signal every rank reports once they stop (agreed_signal: one some rank got)
        self.received: Dict[str, int] = {}  # once they stop: how many ranks got each signal, by name
        self._order = sorted(watch.signals.values())  # one flag per signal the run watches, the same on every rank

    def after_step(self, t: int) -> bool:
        """Whether every rank stops now, after step t (some rank had a signal by its step t-1).

        Raises:
            RuntimeError: the sum failed or took longer than ``dist.timeout_s``.
        """
        if self.channel is None:
            if self.watch.received is not None:
                self.signum = self.watch.received
            return self.watch.received is not None
        stop = False
        if self._pending:
            counts = self.channel.wait().tolist()  # per watched signal: how many ranks got it
            self._pending = False
            if any(counts):
                stop, self.signum = True, agreed_signal(dict(zip(self._order, counts)))
                self.received = {signal.Signals(n).name: int(c) for n, c in zip(self._order, counts) if c}
        if not stop and t < self.last_step:
            got = self.watch.received
            flag = torch.tensor([float(n == got) for n in self._order], dtype=torch.float64)
            self.channel.start(flag, what=f"the preemption flag of step {t}")
            self._pending = True
        return stop


def agreed_signal(counts: Dict[int, float]) -> int:
    """The signal every rank reports, from how many ranks got each: the one most ranks got, the lowest
    number among equals; always one that some rank received (an average of their numbers was not: SIGTERM (15)
    on one rank and SIGUSR1 (10) on another reported SIGUSR2 (12), which nobody sent; issue 34)."""
    return min((n for n, c in counts.items() if c > 0), key=lambda n: (-counts[n], n))
