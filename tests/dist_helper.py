"""Runs a function on N local ranks over gloo: free port, forkserver, per-rank logs, timeout, teardown."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from pipedream2bw.config import Config
from pipedream2bw.models import build_gpt_layers
from pipedream2bw.pipeline.comm import free_port
from pipedream2bw.run.runner import run


@dataclass
class RankResult:
    rank: int
    exitcode: int  # -9 when the helper had to kill it at the deadline
    log: str


def _child(fn: Callable, args: Sequence[Any], rank: int, world_size: int, port: int, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    code = 0
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(
    fn: Callable, *, world_size: int, args: Sequence[Any] = (), log_dir: Path, timeout_s: float = 120
) -> List[RankResult]:
    """Runs ``fn(*args)`` on ``world_size`` ranks; kills what is still alive after ``timeout_s``."""
    ctx = multiprocessing.get_context("forkserver")
    port = free_port()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_child, args=(fn, args, rank, world_size, port, str(log_dir / f"rank{rank}.log")))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [
        RankResult(rank, -9 if p.exitcode is None else p.exitcode, (log_dir / f"rank{rank}.log").read_text())
        for rank, p in enumerate(procs)
    ]


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def children(pid: int) -> List[int]:
    """The PIDs of ``pid``'s child processes (Linux' /proc): torchrun's workers are its agent's children."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def cli_config(*overrides: str) -> Config:
    """The Config ``python -m pipedream2bw.train *overrides`` trains: configs/ composed with the overrides, every
    default of configs/ included, then typed as ``train.main`` types it. A test that compares a launched run with
    an in-process one builds the latter's config here, from the same overrides (issue 32: references built in
    Python lacked configs/optim/default.yaml's error feedback and differed from loss 3 on)."""
    from hydra import compose, initialize_config_dir

    from pipedream2bw.config import TINY_ENV, from_hydra, register_configs, tiny

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = from_hydra(compose(config_name="config", overrides=list(overrides)))
    return tiny(cfg) if os.environ.get(TINY_ENV, "0") not in ("", "0") else cfg


def run_ok(cfg: Config, run_dir: Path, *, timeout_s: float = 120, fn: Optional[Callable] = None) -> dict:
    """Runs the pipeline (``fn(cfg, run_dir)``, ``train`` without) on d * w * t ranks, asserts success, returns
    summary.json."""
    import json

    results = spawn(
        fn or train,
        world_size=cfg.pipeline.num_stages * cfg.pipeline.data_parallel * cfg.pipeline.tensor_parallel,
        args=(cfg, str(run_dir)),
        log_dir=Path(run_dir) / "logs",
        timeout_s=timeout_s,
    )
    bad = [r for r in results if r.exitcode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exit {r.exitcode}\n{r.log}" for r in bad)
    return json.loads((Path(run_dir) / "summary.json").read_text())


def train(cfg: Config, run_dir: str) -> None:
    run(cfg, Path(run_dir))


def train_as_a_script(cfg: Config, run_dir: str) -> None:
    """``run()`` as a user's script calls it: no logging configured; and torch's warning about
    converting a tensor that requires grad to a scalar (once printed by every rank) is an error."""
    import warnings

    logging.getLogger().handlers.clear()
    warnings.filterwarnings("error", message="Converting a tensor with requires_grad=True to a scalar")
    run(cfg, Path(run_dir))


class FailAt(nn.Module):
    """Wraps a layer and misbehaves on its ``call``-th forward: ``how`` is 'raise', 'hang'
    (sleeps for an hour), 'reshape' (drops the last position of its output) or 'kill' (SIGKILLs its process)."""

    def __init__(self, layer: nn.Module, *, call: int, how: str):
        super().__init__()
        self.layer, self.call, self.how, self.calls = layer, call, how, 0

    def forward(self, x):
        self.calls += 1
        out = self.layer(x)
        if self.calls != self.call:
            return out
        if self.how == "hang":
            time.sleep(3600)
        if self.how == "reshape":
            return out[:, :-1]
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault on forward call {self.calls}")


def train_with_fault(cfg: Config, run_dir: str, layer_index: int, call: int, how: str) -> None:
    layers = build_gpt_layers(cfg.model, seed=cfg.seed)
    layers[layer_index] = FailAt(layers[layer_index], call=call, how=how)
    run(cfg, Path(run_dir), layers=layers)


def train_failing_in_setup(cfg: Config, run_dir: str, failing_rank: int) -> None:
    """``run()`` whose ``failing_rank`` raises while it sets up its stage (where it would restore a checkpoint),
    after the process groups started and before the others' set-up collectives (the step agreement's group)."""
    from pipedream2bw.run import build

    step_rule = build.step_rule

    def failing(rt, *args, **kwargs):
        if rt.rank == failing_rank:
            raise RuntimeError("injected set-up fault")
        return step_rule(rt, *args, **kwargs)

    build.step_rule = failing
    run(cfg, Path(run_dir))


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Sleepy(nn.Module):
    """A layer whose forward and backward take fixed times while leaving the CPU free: a rank
    then behaves like a device of its own however few cores the machine has (timeline tests)."""

    def __init__(self, layer: nn.Module, *, forward_s: float, backward_s: float):
        super().__init__()
        self.layer, self.forward_s, self.backward_s = layer, forward_s, backward_s

    def forward(self, x):
        return _Sleep.apply(self.layer(x), self.forward_s, self.backward_s)


def sleepy_layers(
    *, num_layers: int, width: int = 16, vocab_size: int = 256, forward_s: float, backward_s: float
) -> List[nn.Module]:
    """Embedding, linears, LM head: each sleeps ``forward_s``/``backward_s`` per microbatch."""
    torch.manual_seed(0)
    inner = (
        [nn.Embedding(vocab_size, width)]
        + [nn.Linear(width, width) for _ in range(num_layers - 2)]
        + [nn.Linear(width, vocab_size)]
    )
    return [Sleepy(layer, forward_s=forward_s, backward_s=backward_s) for layer in inner]


def train_sleepy(cfg: Config, run_dir: str, forward_s: float, backward_s: float) -> None:
    run(
        cfg,
        Path(run_dir),
        layers=sleepy_layers(num_layers=cfg.pipeline.num_stages, forward_s=forward_s, backward_s=backward_s),
    )


def train_in_own_dir(cfg: Config, base: str) -> None:
    """Each rank with its own run directory (the programmatic API allows it; rank 0 writes the results)."""
    run(cfg, Path(base) / f"rank{os.environ['RANK']}")


class SharedCount:
    """A call counter that ``copy.deepcopy`` shares: both weight replicas of a 2bw stage count together."""

    def __init__(self):
        self.n = 0

    def __deepcopy__(self, memo):
        return self


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad, torch.full_like(weight, float("inf"))


class PoisonAt(nn.Module):
    """Wraps a layer; its ``call``-th forward (1-based; microbatch call-1 of a fresh run) is poisoned:
    ``how`` = 'inf_grad' puts inf into the gradient of the layer's first parameter (nothing else:
    the input's gradient stays finite), 'nan' makes the output NaN."""

    def __init__(self, layer: nn.Module, *, call: int, how: str):
        super().__init__()
        self.layer, self.call, self.how, self.calls = layer, call, how, SharedCount()

    def forward(self, x):
        self.calls.n += 1
        out = self.layer(x)
        if self.calls.n != self.call:
            return out
        if self.how == "nan":
            return out * float("nan")
        return _InfGrad.apply(out, next(self.layer.parameters()))


def poisoned_layers(cfg: Config, layer_index: int, call: int, how: str) -> List[nn.Module]:
    layers = build_gpt_layers(cfg.model, seed=cfg.seed)
    layers[layer_index] = PoisonAt(layers[layer_index], call=call, how=how)
    return layers


def train_poisoned(cfg: Config, run_dir: str, layer_index: int, call: int, how: str) -> None:
    run(cfg, Path(run_dir), layers=poisoned_layers(cfg, layer_index, call, how))


def train_counting_split_backwards(cfg: Config, run_dir: str) -> None:
    """``train``, writing ``split_backwards_rank{r}.json``: the [chunk, k] of every B this rank ran split (the input's
    gradient alone, W later; not those that ran the whole backward, ``chunks.whole``)."""
    import json

    from pipedream2bw.run.stage import StageWorker

    split, ran = [], StageWorker._backward_input

    def counted(worker, k, *args):
        split.append([worker._chunk.index if worker._chunks else worker.stage_index, k])
        return ran(worker, k, *args)

    StageWorker._backward_input = counted
    try:
        run(cfg, Path(run_dir))
    finally:
        StageWorker._backward_input = ran
    rank = int(os.environ["RANK"])
    (Path(run_dir) / f"split_backwards_rank{rank}.json").write_text(json.dumps(split))


def train_cli(runs: Sequence[Sequence[str]]) -> None:
    """``python -m pipedream2bw.train <overrides>`` on this rank once per entry of ``runs``, with process
    groups forbidden (a bad config must stop a run before any group starts); prints ``EXIT <code>``
    where the run would have left the process with that exit code."""
    import runpy

    from pipedream2bw.pipeline import comm

    def no_groups(**kwargs):
        raise AssertionError("a process group was started")

    def leave(code):  # the entry point's os._exit: record it, go on with the next run
        raise SystemExit(code)

    comm.init, os_exit = no_groups, os._exit
    os._exit = leave
    # The run-stamp agreement would have rank 1 connect to a store that rank 0 hosts, and rank 0, refusing its
    # config at once, may leave before rank 1 gets there (torchrun would then stop rank 1; this harness does not):
    # every rank gets the stamp here, so no store is made.
    os.environ.setdefault("PD2BW_RUN_STAMP", time.strftime("%Y-%m-%d/%H-%M-%S"))
    try:
        for overrides in runs:
            sys.argv = ["pipedream2bw.train", *overrides]
            try:
                runpy.run_module("pipedream2bw.train", run_name="__main__")  # as `python -m`: Hydra finds configs/
                code = 0
            except SystemExit as e:
                code = e.code
            print(f"EXIT {code}", flush=True)
    finally:
        os._exit = os_exit
