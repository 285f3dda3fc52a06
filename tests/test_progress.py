"""Rank 0's progress bar: drawn on a terminal with steps/s, the time left, loss and samples/s; silent otherwise."""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import termios
from types import SimpleNamespace

from pipedream2bw.config import Config, TrainConfig, WandbConfig
from pipedream2bw.io.tracking import Tracker, progress_bar
from pipedream2bw.run.step_hooks import progress_callback


def _drive(bar, tmp_path, losses):
    cfg = Config(train=TrainConfig(num_steps=len(losses), log_every=100), wandb=WandbConfig(mode="disabled"))
    worker = SimpleNamespace(stats=SimpleNamespace(losses=[], lrs=[], grad_norms=[]))
    on_step = progress_callback(
        cfg.train, worker, Tracker(cfg.wandb, tmp_path), bar, samples_per_step=8, seq_len=cfg.model.seq_len
    )
    for t, loss in enumerate(losses):
        worker.stats.losses.append(loss)
        worker.stats.lrs.append(cfg.optim.lr)
        worker.stats.grad_norms.append(None)
        on_step(t)
    bar.close()


def test_bar_on_a_terminal_shows_steps_loss_and_samples_per_s(tmp_path):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a fresh pty is 0 columns wide
    with os.fdopen(slave, "w") as tty:
        bar = progress_bar(3, file=tty)
        assert not bar.disable
        _drive(bar, tmp_path, [5.5, 5.25, 4.75])
    os.set_blocking(master, False)
    chunks = []
    while True:
        try:
            chunks.append(os.read(master, 1 << 16))
        except (BlockingIOError, OSError):  # drained (Linux answers EIO once the slave is closed)
            break
    os.close(master)
    shown = b"".join(chunks).decode()
    assert "3/3" in shown and ("step/s" in shown or "s/step" in shown), shown
    assert "loss=4.7500" in shown and "samples_per_s=" in shown, shown
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", shown), shown  # [elapsed<remaining: the ETA


def test_bar_is_silent_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    bar = progress_bar(3, file=out)
    assert bar.disable
    _drive(bar, tmp_path, [5.5, 5.25, 4.75])
    assert out.getvalue() == ""
