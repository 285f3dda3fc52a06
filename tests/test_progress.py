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


def _screen(raw: str) -> list:
    """The lines a terminal shows for ``raw``: '\\r' returns to column 0, '\\n' starts a line, escapes skipped."""
    lines, line, col = [], [], 0
    for ch in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw):
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            line[col : col + 1] = [ch]
            col += 1
    return lines + ["".join(line).rstrip()]


def test_a_log_line_or_a_warning_does_not_land_on_the_bar_line(tmp_path, monkeypatch):
    # issue 35: a log line written while the bar was drawn (the last validation losses, logged by finish()
    # before it closes the bar) continued the bar's line: "train: 67%|...| 2/3 [...]validation loss ...".
    import logging
    import warnings

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr("sys.stderr", tty)  # the console handler writes where the bar draws, as a run's do
        handler = logging.StreamHandler(tty)
        logging.getLogger().addHandler(handler)
        try:
            bar = progress_bar(3)
            bar.update(2)
            bar.refresh()
            logging.getLogger("pipedream2bw.run.step_hooks").warning("validation loss 4.5")
            warnings.warn("a torch warning", UserWarning, stacklevel=1)
            bar.update(1)
            bar.close()
        finally:
            logging.getLogger().removeHandler(handler)
    os.set_blocking(master, False)
    chunks = []
    while True:
        try:
            chunks.append(os.read(master, 1 << 16))
        except (BlockingIOError, OSError):
            break
    os.close(master)
    screen = _screen(b"".join(chunks).decode())
    # a line of its own, the bar's text nowhere on it (an earlier test may have set a "[rank r]" log prefix)
    assert any(line.endswith("validation loss 4.5") and "|" not in line for line in screen), screen
    assert any(line.endswith("UserWarning: a torch warning") for line in screen), screen
    assert not any("train" in line and "warning" in line for line in screen), screen
    assert any("3/3" in line for line in screen), screen  # the bar, redrawn below, finishes


def test_off_a_terminal_a_step_line_comes_at_once_and_at_least_every_10_s(tmp_path, monkeypatch):
    # issue 43: the default run (log_every 10, ~1.5 s a step on a loaded 2-core machine) printed nothing until its
    # 10th step, then a line every 10 steps when not on a terminal
    from pipedream2bw.run import step_hooks

    clock = iter(float(s) for s in range(0, 1000, 4))  # each step takes 4 s
    monkeypatch.setattr(step_hooks.time, "perf_counter", lambda: next(clock))
    lines = []
    monkeypatch.setattr(step_hooks, "log", SimpleNamespace(info=lambda msg, *args: lines.append(msg % args)))
    cfg = Config(train=TrainConfig(num_steps=20, log_every=100), wandb=WandbConfig(mode="disabled"))
    worker = SimpleNamespace(stats=SimpleNamespace(losses=[], lrs=[], grad_norms=[]))
    bar = progress_bar(20, file=io.StringIO())  # not a terminal: no bar
    on_step = step_hooks.progress_callback(
        cfg.train, worker, Tracker(cfg.wandb, tmp_path), bar, samples_per_step=8, seq_len=64
    )
    for t in range(20):
        worker.stats.losses.append(5.0)
        worker.stats.lrs.append(1e-3)
        worker.stats.grad_norms.append(None)
        on_step(t)
    steps = [int(m.group(1)) for m in (re.match(r"step (\d+)/", line) for line in lines) if m]
    assert steps == [1, 4, 7, 10, 13, 16, 19, 20], lines  # the first, every 12 s (3 steps of 4 s), the last


def test_bf16_on_a_cpu_without_native_bfloat16_is_told(tmp_path):
    # issue 43: bench_precision.py --device cpu ran bf16 at 0.76 samples/s on an AVX2-only CPU (fp32: 71), unwarned
    from pipedream2bw.run.logs import native_bf16_cpu

    (tmp_path / "avx2").write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    (tmp_path / "bf16").write_text("flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n")
    assert not native_bf16_cpu(str(tmp_path / "avx2"))
    assert native_bf16_cpu(str(tmp_path / "bf16")) and native_bf16_cpu(str(tmp_path / "absent"))
