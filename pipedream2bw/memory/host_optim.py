"""Optimizer state and update on the host (swap.optimizer=host), as KARMA and ZeRO-Offload do."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
from torch import nn

from pipedream2bw.config.optim import optimizer_class, optimizer_of
from pipedream2bw.config.optimizers import is_muon
from pipedream2bw.config.schema import OptimConfig
from pipedream2bw.pipeline.versions import WeightVersions, version_of_batch

# ``after(weights)``: a check of the new weights W(t+1) (host copies, bit for bit the device's), run once they are made
After = Optional[Callable[[Sequence[torch.Tensor]], None]]
# ``span(t, start, end)``: the host step of batch t ran from start to end (perf_counter), on its own thread
Span = Optional[Callable[[int, float, float], None]]


# torch optimizers whose fused CPU kernel (``fused=True``) the host step takes: on this project's 2-core CPU (shared,
# 2026-11-26, scripts/bench_host_step.py) fused AdamW stepped 4 to 5x torch's default per-tensor loop, which foreach
# did not beat (0.7x); SGD with momentum and Adagrad gained nothing fused, so they keep torch's default.
FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW)


def host_kernel(cfg: OptimConfig) -> OptimConfig:
    """``cfg`` with the CPU kernel the host step runs: ``fused=True`` for the optimizer that steps the elementwise
    parameters (optim.name, or optim.muon_others under Muon) where it is one of ``FUSED_ON_CPU``, unless
    optim.kwargs already chooses (``fused`` or ``foreach``). The fused kernel rounds some elements differently
    from the per-tensor loop, no farther from a float64 step (scripts/bench_host_step.py measures it), and the
    same way whatever the thread count (tested): runs stay reproducible.
    """
    if "fused" in cfg.kwargs or "foreach" in cfg.kwargs or cfg.delay_correction == "lookahead":  # lookahead: NAdam
        return cfg
    cls = optimizer_class(cfg.muon_others) if is_muon(cfg) else optimizer_of(cfg)
    if not issubclass(cls, FUSED_ON_CPU):
        return cfg
    return dataclasses.replace(cfg, kwargs={**cfg.kwargs, "fused": True})


def node_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of the machine's where that is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def free_cores(*, cores: int, ranks: int, rank_threads: int) -> int:
    """The cores of a node per rank that its ``ranks``' compute leaves free, each rank computing on ``rank_threads``
    (torch's intra-op threads: 1 under torchrun with several ranks on the node): what a rank's host work (its
    background host step) may run on without taking turns with compute."""
    return max(0, cores - ranks * rank_threads) // max(1, ranks)


def host_threads(*, cores: int, ranks: int, rank_threads: int) -> int:
    """The intra-op threads a rank's background host step takes: its ``free_cores``, at least 1. Where none is free
    the step takes turns with the ranks' compute on their cores, and a team of more OpenMP threads than cores only
    waits for itself (each region's barrier spins for a thread without a core: on this project's 2-core CPU a
    2-thread step ran 40 to 96 M parameters/s where one thread ran 1485; docs/memory.md). The planner charges the step
    by the same rule (``partitioner/cost.py``'s ``host_free_cores``)."""
    return max(1, free_cores(cores=cores, ranks=ranks, rank_threads=rank_threads))


@dataclasses.dataclass(frozen=True)
class HostStepFigures:
    """What the host's optimizer step costs, from ``measure_host_step``."""

    params_per_s: float  # parameters the host step (``host_kernel``'s) steps per second
    copy_bytes_per_s: float  # host memory bandwidth: bytes read plus written per second (``copy_bandwidth``)
    bytes_per_param: float  # bytes the step must read and write per parameter (``step_bytes``; AdamW: 28)
    threads: int  # torch's intra-op threads during the measurement

    @property
    def bound_params_per_s(self) -> float:
        """The bandwidth bound: no step of a parameter is faster than moving its bytes."""
        return self.copy_bytes_per_s / self.bytes_per_param


def copy_bandwidth(nbytes: int = 128 * 2**20, *, repeats: int = 5) -> float:
    """Host memory bandwidth, bytes read plus written per second: the better median, over ``repeats`` after one, of a
    copy of ``nbytes`` between two buffers already touched (counted 2 x nbytes) and of an in-place add of one such
    buffer to another (``a += b``, counted 3 x nbytes, what an optimizer step does: its writes go where it read, so
    no cache line is read for ownership first, which makes a copy's writes cost a read too on x86)."""
    a, b = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    rates = []
    for op, moved in ((lambda: b.copy_(a), 2 * nbytes), (lambda: b.add_(a), 3 * nbytes)):
        times = []
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        rates.append(moved / statistics.median(times[1:]))
    return max(rates)


def adam_step_bytes(grad_dtype: torch.dtype = torch.float32) -> int:
    """Bytes an Adam(W) step reads and writes per float32 parameter: the weight and both moments read and written,
    the gradient read."""
    return 3 * 2 * 4 + torch.empty(0, dtype=grad_dtype).element_size()


def step_bytes(optimizer: torch.optim.Optimizer) -> float:
    """Bytes per parameter that a step of ``optimizer`` (stepped once, so its state exists) reads and writes: each
    parameter and its state tensors read and written, its gradient read (AdamW over float32: 28; SGD with momentum:
    20; without: 12). Scalars in the state (Adam's step count) are left out."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    moved = 0
    for p in params:
        state = [v for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.numel() == p.numel()]
        moved += 2 * (p.numel() * p.element_size() + sum(v.numel() * v.element_size() for v in state))
        moved += p.grad.numel() * p.grad.element_size()
    return moved / sum(p.numel() for p in params)


@functools.lru_cache(maxsize=None)
def measure_host_step(
    num_params: int = 2**23,
    *,
    optimizer: str = "adamw",
    num_tensors: int = 8,
    threads: Optional[int] = None,
    repeats: int = 5,
) -> HostStepFigures:
    """Measures, once per process and arguments (cached), the host step: parameters per second of ``optimizer``
    (a torch.optim name, elementwise: adamw, adam, sgd, ...; its defaults, ``host_kernel``'s kernel) over
    ``num_params`` float32 parameters in ``num_tensors`` tensors (the median of ``repeats`` steps after one that
    makes the state), the bytes a parameter's step moves, and the host's bandwidth, for the planner's time model.

    Args:
        threads: torch's intra-op threads to measure with (restored after); None: as set now.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        params = [nn.Parameter(torch.randn(num_params // num_tensors)) for _ in range(num_tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        cfg = host_kernel(OptimConfig(name=optimizer, kwargs={"momentum": 0.9} if optimizer == "sgd" else {}))
        opt = optimizer_of(cfg)(params, lr=1e-3, **cfg.kwargs)
        times = []
        for _ in range(repeats + 1):  # the first makes the state
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times[1:])
        n, moved = sum(p.numel() for p in params), step_bytes(opt)
        del params, opt
        return HostStepFigures(
            params_per_s=n / step_s,
            copy_bytes_per_s=copy_bandwidth(repeats=repeats),
            bytes_per_param=moved,
            threads=torch.get_num_threads(),
        )
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def synchronous_host_step(versions: Any) -> Iterator[None]:
    """Times a synchronous host step's work (what a background thread would run) on the training thread, as
    ``_Pending`` times the thread's: its wall clock into ``versions.host_step_s``, all of it into ``host_step_wait_s``
    (training waits for all of it) and its CPU time into ``host_step_cpu_s``."""
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        wall = time.perf_counter() - start
        versions.host_step_s += wall
        versions.host_step_wait_s += wall
        versions.host_step_cpu_s += time.thread_time() - cpu


class BackgroundStep(WeightVersions):
    """``WeightVersions`` whose step may leave the training thread (``background``, 2bw only, swap.host_step).

    W(t+1) is first read by batch t+2's forward, so ``step(t)`` takes batch t's gradients on the calling thread (the
    all-reduce waits, the scaling) and leaves the optimizer step, and whatever makes W(t+1) in its replica, to a
    thread of its own, which runs while batch t+1 computes (``_host_work``: the subclass's). Whatever reads what that
    thread writes waits for it first (``settle``): the forward of a batch that uses W(t+1) (``module_for_batch``),
    the next step or skip, ``set_lr``, ``newest`` (export, validation), ``state`` (checkpoints) and ``load_state``.
    The arithmetic is the same, in the same order: bit for bit the synchronous step. An exception in the thread is
    raised by the ``settle`` that waits for it.
    """

    def __init__(self, module: nn.Module, *, background: bool = False, threads: Optional[int] = None, **kwargs):
        super().__init__(module, **kwargs)
        assert not background or self.schedule == "2bw", "a background host step needs 2bw (config validation)"
        self.background = background
        self.threads = threads  # the thread's intra-op threads (``host_threads``); None: as the process's
        # synchronous (not background), the same three over the step's part the thread would run, on the training
        # thread, all of it waited for (``_on_this_thread``)
        self.host_step_s = 0.0  # seconds the background thread spent stepping
        self.host_step_cpu_s = 0.0  # ... of which it ran on a core (its CPU time; the rest it waited for one)
        self.host_step_wait_s = 0.0  # seconds the calling thread waited for it: the part not hidden
        self._pending: Optional[_Pending] = None

    @torch.no_grad()
    def step(
        self,
        batch_index: int,
        *,
        grad_scale: float,
        before_bucket: Callable[[int], None] = lambda i: None,
        after: After = None,
        span: Span = None,
    ) -> None:
        """``WeightVersions.step``; ``background``: the optimizer's part runs on a thread (the class docstring).

        ``after(weights)`` runs on the new weights once they are made (on the thread in the background);
        ``span(t, start, end)`` is told when a background step ran.
        """
        if not self.background:
            super().step(batch_index, grad_scale=grad_scale, before_bucket=before_bucket)
            if after is not None:
                with self._on_this_thread():
                    after(list(self.newest().parameters()))
            return
        self.settle()  # the masters hold W(t) once the previous step is done
        t = batch_index
        src = self._params[self._replica_holding(version_of_batch(self.schedule, t))]
        newest, dst_index = self._replica_holding(t), self._destination(t)
        dst = self._params[dst_index]
        for bucket_index, bucket in enumerate(self.buckets):  # the all-reduce waits stay on the calling thread
            before_bucket(bucket_index)
            self._take_gradients(bucket, src, dst, grad_scale)
        self.holds[dst_index] = t + 1
        work = self._host_work(newest, dst_index, after)
        pending = _Pending(t, dst_index, span, threads=self.threads)
        pending.thread = threading.Thread(
            target=pending.run,
            args=(work,),
            name=f"host-step-{t}",
            daemon=True,  # bounded work; a training thread that failed elsewhere does not wait for it
        )
        self._pending = pending
        pending.thread.start()

    def _on_this_thread(self) -> contextlib.AbstractContextManager:
        """Times the step's work where it runs on the training thread (``synchronous_host_step``); nothing in the
        background, where the thread's run is timed (``_Pending``)."""
        return contextlib.nullcontext() if self.background else synchronous_host_step(self)

    def _prepare_destination(self, dst_index: int, t: int) -> None:
        """``WeightVersions._prepare_destination``, timed where synchronous (``_on_this_thread``)."""
        with self._on_this_thread():
            super()._prepare_destination(dst_index, t)

    def _step_bucket(self, bucket: Sequence[int], optimizer: torch.optim.Optimizer, dst: Sequence[nn.Parameter]):
        """``WeightVersions._step_bucket``, timed where synchronous (``_on_this_thread``)."""
        with self._on_this_thread():
            super()._step_bucket(bucket, optimizer, dst)

    def _host_work(self, newest: int, dst_index: int, after: After) -> Callable[[], None]:
        """What the background thread does (made on the calling thread): the optimizers step the masters, which have
        their gradients, and W(t+1) ends in replica ``dst_index`` (``newest`` holds W(t)); then ``after``."""
        raise NotImplementedError

    def settle(self) -> None:
        """Waits for the background step, if one runs, and raises what it raised (with a note naming it)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        start = time.perf_counter()
        pending.thread.join()
        self.host_step_wait_s += time.perf_counter() - start
        self.host_step_s += pending.end - pending.start
        self.host_step_cpu_s += pending.cpu_s
        if pending.error is not None:
            pending.error.add_note(
                f"raised by the host optimizer step of batch {pending.t}, which runs on a thread of its own "
                "(swap.host_step=background; swap.host_step=sync runs it on the training thread)"
            )
            raise pending.error
        self._settled()
        if pending.span is not None:
            pending.span(pending.t, pending.start, pending.end)

    def _settled(self) -> None:
        """After a background step is joined, on the calling thread: nothing here."""

    def module_for_batch(self, batch_index: int) -> nn.Module:
        """``WeightVersions.module_for_batch``, after the background step that writes that replica, if one runs."""
        if self._pending is not None and self.replica_for_batch(batch_index) == self._pending.dst_index:
            self.settle()
        return super().module_for_batch(batch_index)

    def newest(self) -> nn.Module:
        self.settle()
        return super().newest()

    def skip(self, batch_index: int) -> None:
        self.settle()
        super().skip(batch_index)

    def set_lr(self, lr: float) -> None:
        self.settle()  # the thread's optimizer reads the learning rate
        super().set_lr(lr)

    def state(self) -> dict:
        self.settle()  # a checkpoint holds the step's result
        return super().state()

    def load_state(self, **state) -> None:
        self.settle()
        super().load_state(**state)


class HostOptimizerVersions(BackgroundStep):
    """``WeightVersions`` whose optimizers step host copies of the weights.

    The master parameters (what the optimizers own, with their state: Adam's two moments)
    live in host memory and always hold the newest version W(t). Closing batch t, each
    bucket's gradient (scaled on the device) is copied to the host, the optimizer steps there,
    and the result is copied into the device replica that will hold W(t+1). The device keeps
    the weight versions and the gradient being accumulated, but no optimizer state. The update
    rule is unchanged (docs/design.md section 2); on a GPU the host's float32 arithmetic may round
    differently from the GPU's.

    ``background`` (``BackgroundStep``): the thread steps the masters and copies W(t+1) into its device replica (on
    CUDA on a copy stream of its own, after batch t's last use of that replica).
    """

    def __init__(self, module: nn.Module, *, background: bool = False, **kwargs):
        super().__init__(module, background=background, **kwargs)
        device = next(module.parameters()).device
        cuda = background and device.type == "cuda"
        # CUDA: W(t+1) goes to the device on a stream of its own, after batch t's use of the replica (``ready``)
        # and before the next use (``settle``: the compute stream waits for ``_copied``).
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._copied: Optional[torch.cuda.Event] = None

    def _make_masters(self, module: nn.Module) -> List[nn.Parameter]:
        """Host copies of the weights (pinned when the module is on a GPU); optimizer state is made lazily, so none
        is on the device."""
        pin = next(module.parameters()).device.type == "cuda"
        return [
            nn.Parameter(
                p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone(),
                requires_grad=p.requires_grad,
            )
            for p in module.parameters()
        ]

    def _prepare_destination(self, dst_index: int, t: int) -> None:
        """Nothing: the masters hold W(t), and every parameter of the destination is overwritten from them."""

    def _attach_master(self, i: int, dst: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
        """The host master of parameter ``i`` takes a host copy of its (scaled) gradient."""
        # a gradient in another dtype (bf16) is cast to the master's on the host: the fused kernel takes one dtype
        self.master[i].grad = None if grad is None else grad.to("cpu").to(self.master[i].dtype)

    def _detach_master(self, i: int, dst: nn.Parameter) -> None:
        """After its bucket's host step: the new weights W(t+1) go to the device replica ``dst``."""
        self.master[i].grad = None
        dst.copy_(self.master[i], non_blocking=True)

    @torch.no_grad()
    def load_state(self, **state) -> None:
        """``WeightVersions.load_state``, then the host masters take the newest version (they always hold it)."""
        super().load_state(**state)
        for master, p in zip(self.master, self.replicas[0].parameters()):  # replica 0 holds the newest after a load
            master.copy_(p)

    def _host_work(self, newest: int, dst_index: int, after: After) -> Callable[[], None]:
        ready = None
        if self._copy_stream is not None:  # batch t's last use of the destination replica is queued before this
            ready = torch.cuda.Event()
            ready.record()
        return lambda: self._host_step(self._params[dst_index], ready, after)

    def _host_step(self, dst: Sequence[nn.Parameter], ready: Optional[torch.cuda.Event], after: After) -> None:
        """The background thread: the buckets' optimizer steps on the masters, W(t+1) into ``dst``, ``after``."""
        with torch.no_grad():  # grad mode is per thread
            if self._copied is not None:  # the previous step's copies read the masters this step writes
                self._copied.synchronize()
            for optimizer in self.optimizers:
                optimizer.step()
            if self._copy_stream is None:
                for i, d in enumerate(dst):
                    self._detach_master(i, d)
            else:
                with torch.cuda.stream(self._copy_stream):
                    self._copy_stream.wait_event(ready)
                    for i, d in enumerate(dst):
                        self._detach_master(i, d)
                    self._copied = torch.cuda.Event()
                    self._copied.record(self._copy_stream)
            if after is not None:
                after(self.master)

    def _settled(self) -> None:
        if self._copied is not None:  # the compute stream reads W(t+1) after its copy
            torch.cuda.current_stream(self._copy_stream.device).wait_event(self._copied)


class _Pending:
    """One background host step: its batch, the replica it writes, and how it ended."""

    def __init__(self, t: int, dst_index: int, span: Span, *, threads: Optional[int] = None):
        self.t, self.dst_index, self.span, self.threads = t, dst_index, span, threads
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.start = self.end = self.cpu_s = 0.0

    def run(self, fn: Callable[[], None]) -> None:
        """The thread: ``fn`` on ``threads`` intra-op threads (OpenMP's count is the calling thread's; torch's
        setting, which threads started later take, is put back), timed by the wall clock and by its CPU time."""
        self.start, cpu = time.perf_counter(), time.thread_time()
        before = torch.get_num_threads()
        try:
            if self.threads is not None and self.threads != before:
                torch.set_num_threads(self.threads)
            fn()
        except BaseException as e:  # raised on the training thread by ``settle``
            self.error = e
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
            self.cpu_s = time.thread_time() - cpu
            self.end = time.perf_counter()
