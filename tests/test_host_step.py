"""swap.host_step=background (pipedream2bw/memory/host_optim.py): the host optimizer step of batch t runs on a thread
of its own while batch t+1 computes; bit for bit the synchronous step, waited for by whatever reads its result."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from pipedream2bw.config import OptimConfig
from pipedream2bw.memory.host_optim import (
    HostOptimizerVersions,
    host_kernel,
    host_threads,
    measure_host_step,
)
from pipedream2bw.memory.sharding import ShardedVersions
from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD, STEP, stage_actions

M = 2  # microbatches per batch


def _versions(background: bool, factory=None, threads=None) -> HostOptimizerVersions:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    factory = factory or (lambda p: torch.optim.AdamW(p, lr=0.05))
    # two buckets, last parameters first, as build.py makes them
    return HostOptimizerVersions(
        module,
        schedule="2bw",
        optimizer_factory=factory,
        buckets=[[5, 4, 3, 2], [1, 0]],
        background=background,
        threads=threads,
    )


def _train(versions: HostOptimizerVersions, batches: int, *, states=None, after=None):
    """Stage 0 of 2 under 2bw (batch t+1's forwards run before batch t's step); the losses."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(M * batches)]
    outs, losses = {}, []
    for a in stage_actions("2bw", stage_index=0, num_stages=2, num_microbatches=M, num_batches=batches):
        k = a.index
        if a.kind == FORWARD:
            outs[k] = versions.module_for_batch(k // M)(xs[k]).pow(2).mean()
            losses.append(outs[k].item())
        elif a.kind == BACKWARD:
            outs.pop(k).backward()
        elif a.kind == STEP:
            versions.set_lr(0.05 / (k + 1))  # the schedule changes the learning rate every step
            versions.step(k, grad_scale=1 / M, **({} if after is None else {"after": after}))
            if states is not None:
                states.append(versions.state())  # a checkpoint after every step
    versions.settle()
    return losses


def _same_state(a: dict, b: dict) -> bool:
    return all(
        a[part].keys() == b[part].keys()
        and all(
            torch.equal(a[part][n], b[part][n])
            if torch.is_tensor(a[part][n])
            else all(torch.equal(torch.as_tensor(a[part][n][k]), torch.as_tensor(b[part][n][k])) for k in a[part][n])
            for n in a[part]
        )
        for part in ("weights", "previous", "optimizer")
    )


def test_background_host_step_is_bit_for_bit_the_synchronous_one():
    sync_states, bg_states = [], []
    sync, bg = _versions(False), _versions(True)
    sync_losses = _train(sync, 4, states=sync_states)
    bg_losses = _train(bg, 4, states=bg_states)
    assert bg_losses == sync_losses  # the forwards read W(t+1) only after the step that makes it
    assert len(bg_states) == 4 and all(_same_state(s, b) for s, b in zip(sync_states, bg_states))  # checkpoints wait
    assert bg.host_step_s > 0  # it did step in the background


def _sharded_on_host() -> ShardedVersions:
    """swap.optimizer=host with optim.sharded or train.weight_dtype=compute (run/build.py): ShardedVersions' host
    masters, stepped on the training thread."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return ShardedVersions(
        module,
        schedule="2bw",
        optimizer_factory=lambda p: torch.optim.AdamW(p, lr=0.05),
        buckets=[[5, 4, 3, 2], [1, 0]],
        num_sharded=0,
        host=True,
    )


@pytest.mark.parametrize("make", [lambda: _versions(False), _sharded_on_host], ids=["host", "sharded-host"])
def test_a_synchronous_host_step_is_timed_too_all_of_it_waited_for(monkeypatch, make):
    # regression: swap.host_step=sync (and flush, zbv: a step at once) reported host_step_s 0.0 in summary.json, as
    # if the host's step took no time; it runs on the training thread, which waits for all of it
    sync = make()
    step, slept = torch.optim.AdamW.step, []

    def slow_step(self, *args, **kwargs):  # a host step of at least 20 ms per bucket, whatever this machine's speed
        start = time.perf_counter()
        while time.perf_counter() - start < 0.02:
            pass
        slept.append(time.perf_counter() - start)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", slow_step)
    _train(sync, 3)
    assert len(slept) == 3 * 2  # 3 steps of 2 buckets
    assert sync.host_step_s >= sum(slept) and sync.host_step_wait_s == sync.host_step_s
    assert 0 < sync.host_step_cpu_s <= sync.host_step_s * 1.05  # its CPU time: the spin ran on a core


def test_the_next_batch_runs_while_the_step_is_pending_and_the_one_after_waits():
    gate = threading.Event()

    class Gated(torch.optim.SGD):
        def step(self, closure=None):
            assert gate.wait(timeout=30), "the test never opened the gate"
            return super().step(closure)

    versions = _versions(True, factory=lambda p: Gated(p, lr=0.5))
    x = torch.ones(2, 8)
    before = [p.clone() for p in versions.module_for_batch(0).parameters()]
    versions.module_for_batch(0)(x).sum().backward()
    versions.step(0, grad_scale=1.0)  # returns while the optimizer is held at the gate
    assert versions.module_for_batch(1) is versions.replicas[0]  # batch 1 runs with W(0): no wait
    assert versions._pending is not None
    threading.Timer(0.05, gate.set).start()
    m2 = versions.module_for_batch(2)  # batch 2 reads W(1): waits for the step
    assert versions._pending is None
    assert all(not torch.equal(p, q) for p, q in zip(m2.parameters(), before))  # and gets W(1), not W(-1)


@pytest.mark.parametrize(
    "cores, ranks, rank_threads, threads",
    [
        (2, 2, 1, 1),  # this project's CPU at w = 2 (one thread a rank): no core free, one thread
        (2, 1, 2, 1),  # one rank on torch's default threads (all cores): not a team of 2 beside its compute
        (2, 1, 1, 1),  # OMP_NUM_THREADS=1: the other core
        (64, 8, 1, 7),  # a GPU node: 8 ranks leave 56 cores, 7 each
        (4, 8, 1, 1),  # ranks beyond the cores: still one
    ],
)
def test_the_host_steps_threads_are_the_cores_the_nodes_ranks_leave_free(cores, ranks, rank_threads, threads):
    # the bug: the thread took the process's intra-op threads, a team of 2 beside a 2-thread compute on 2 cores,
    # whose barriers spin for a thread without a core (docs/memory.md: 40-96 M parameters/s against 1485 at one)
    assert host_threads(cores=cores, ranks=ranks, rank_threads=rank_threads) == threads


def test_the_background_step_runs_on_its_threads_and_leaves_torchs_setting_as_it_was():
    seen = []

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            seen.append((threading.current_thread() is not threading.main_thread(), torch.get_num_threads()))
            return super().step(closure)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        versions = _versions(True, factory=lambda p: Counting(p, lr=0.5), threads=1)
        _train(versions, 2)
        assert seen and all(seen_on_thread and n == 1 for seen_on_thread, n in seen)  # two buckets, two steps
        later = []  # a thread started afterwards (the next step's, a worker's) takes torch's setting, put back
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 2 and later == [2]
        assert 0 < versions.host_step_cpu_s <= versions.host_step_s  # its CPU time: what of its wall ran on a core
    finally:
        torch.set_num_threads(before)


def test_an_exception_in_the_thread_surfaces_on_the_training_thread():
    versions = _versions(True)
    _train(versions, 1)

    def check(weights):
        raise FloatingPointError("non-finite weights after the step")

    versions.module_for_batch(1)(torch.ones(2, 8)).sum().backward()
    versions.step(1, grad_scale=1.0, after=check)  # the check of W(2) runs on the thread
    with pytest.raises(FloatingPointError) as info:
        versions.module_for_batch(3)  # uses W(2): waits, and raises what the thread raised
    assert "host optimizer step of batch 1" in "".join(getattr(info.value, "__notes__", []))
    versions.settle()  # raised once, then nothing pending: the end of training does not hang or raise again


@pytest.mark.slow
@pytest.mark.parametrize(
    "d,backend",
    [
        # two trainings per depth (29 to 47 s on the loaded machine); the unit tests above hold the rules
        pytest.param(1, "gloo", marks=pytest.mark.long),
        pytest.param(2, "gloo", marks=pytest.mark.long),
        # one GPU: gradients copied out of the device, the step on the host thread, W(t+1) copied back in
        pytest.param(
            1,
            "nccl",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_a_pipeline_trains_bit_for_bit_with_the_step_in_the_background(tmp_path, d, backend):
    """Through the trainer (gloo on CPU, or NCCL on one GPU), 2bw, d stages: swap.host_step=background (the default
    'auto' under 2bw) gives sync's losses and final weights bit for bit, and the trace shows the step on its own
    thread."""
    import json

    from dist_helper import run_ok
    from test_semantics import tiny_config

    out = {}
    for mode in ("sync", "background"):
        cfg = tiny_config(schedule="2bw", num_stages=d, num_microbatches=2, num_steps=4)
        cfg.swap.optimizer, cfg.swap.host_step, cfg.dist.backend = "host", mode, backend
        cfg.pipeline.trace, cfg.pipeline.trace_first_step, cfg.pipeline.trace_steps = True, 1, 2
        summary = run_ok(cfg, tmp_path / mode)
        out[mode] = summary, torch.load(tmp_path / mode / "final_model.pt")
    (sync, sync_w), (bg, bg_w) = out["sync"], out["background"]
    assert bg["losses"] == sync["losses"]
    assert bg_w.keys() == sync_w.keys() and all(torch.equal(bg_w[k], sync_w[k]) for k in bg_w)
    assert all(r["host_step_s"] > 0 for r in bg["ranks"])
    # synchronous: timed too (it was 0.0), on the training thread, which waits for all of it
    assert all(r["host_step_s"] > 0 and r["host_step_wait_s"] == r["host_step_s"] for r in sync["ranks"])
    trace = json.loads((tmp_path / "background" / "trace.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "hoststep"]
    assert sorted(e["pid"] for e in steps) == sorted(list(range(d)) * 2)  # each rank, each traced step
    assert all(e["tid"] == 3 for e in steps)  # on the host optimizer's row, beside the compute


def test_background_is_refused_where_nothing_can_overlap_the_step():
    from test_semantics import tiny_config

    from pipedream2bw.config import ConfigError, validate

    cfg = tiny_config(schedule="flush", num_stages=2, num_microbatches=2)
    cfg.swap.optimizer, cfg.swap.host_step = "host", "background"
    with pytest.raises(ConfigError, match=r"swap.host_step \(background\) with pipeline.schedule \('flush'\)"):
        validate(cfg, world_size=2)
    cfg.swap.host_step = "auto"  # flush steps on the training thread: no error
    validate(cfg, world_size=2)
    cfg.swap.host_step = "later"
    with pytest.raises(ConfigError, match=r"swap.host_step \('later'\) is unknown"):
        validate(cfg, world_size=2)


def _muon_pair(device: str):
    """Two Muon steps' setups over the same matrices: the parameters and state on ``device``, and on the host with the
    Newton-Schulz iterations sent to ``device`` (``orthogonalize_on``, as build_versions does for swap.optimizer=host).
    """
    from pipedream2bw.config.optimizers import Muon, orthogonalize_on

    torch.manual_seed(0)
    weights = [torch.randn(48, 24), torch.randn(24, 80)]  # both orientations (the iteration transposes a tall one)
    on_device = [nn.Parameter(w.to(device)) for w in weights]
    on_host = [nn.Parameter(w.clone()) for w in weights]
    kw = dict(lr=0.02, adjust_lr_fn="match_rms_adamw", weight_decay=0.1)
    host_opt = Muon(on_host, **kw)
    assert orthogonalize_on(host_opt, torch.device(device)) == 1
    return (on_device, Muon(on_device, **kw)), (on_host, host_opt)


def test_muon_finds_its_orthogonalizer_inside_composites():
    from pipedream2bw.config import OptimConfig, build_optimizer
    from pipedream2bw.config.optimizers import MUON_ROLE, orthogonalize_on

    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]
    setattr(params[0], MUON_ROLE, True)
    setattr(params[1], MUON_ROLE, False)
    opt = build_optimizer(params, OptimConfig(name="muon", delay_correction="error_feedback"))  # EF(Muon + AdamW)
    assert orthogonalize_on(opt, torch.device("cpu")) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_muon_with_host_state_orthogonalizes_on_the_device_bit_for_bit():
    # swap.optimizer=host with optim.name=muon: the momentum stays on the host, each matrix goes to the GPU for its
    # Newton-Schulz iterations (bfloat16 there, as the device step's) and comes back: the same weights as Muon
    # stepping on the GPU, bit for bit, and no matrix product on the host.
    (dev, dev_opt), (host, host_opt) = _muon_pair("cuda")
    g = torch.Generator().manual_seed(1)
    matmul_devices = set()
    real = torch.addmm

    def spy(*args, **kwargs):
        matmul_devices.add(args[0].device.type)
        return real(*args, **kwargs)

    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in host]
        for p, q, gr in zip(dev, host, grads):
            p.grad, q.grad = gr.cuda(), gr.clone()
        dev_opt.step()
        torch.addmm = spy
        try:
            host_opt.step()
        finally:
            torch.addmm = real
    assert matmul_devices == {"cuda"}
    assert all(torch.equal(p.cpu(), q.detach()) for p, q in zip(dev, host))
    assert all(q.device.type == "cpu" for q in host) and all(
        st["momentum_buffer"].device.type == "cpu" for st in host_opt.state.values()
    )


@pytest.mark.parametrize(
    "cfg,fused",
    [
        (OptimConfig(name="adamw"), True),
        (OptimConfig(name="Adam", kwargs={"betas": (0.9, 0.95)}), True),
        (OptimConfig(name="adamw", kwargs={"foreach": False}), False),  # the user chose a kernel: kept
        (OptimConfig(name="sgd", kwargs={"momentum": 0.9}), False),  # fused gained nothing measured: torch's default
        (OptimConfig(name="muon"), True),  # the kernel of muon_others (adamw); Muon's own step is unchanged
        (OptimConfig(name="muon", muon_others="sgd"), False),
        (OptimConfig(name="muon", delay_correction="lookahead"), False),  # NAdam: no fused kernel
        (OptimConfig(target="torch.optim.AdamW"), True),
    ],
)
def test_the_host_step_takes_the_fused_kernel_where_torch_has_a_faster_one(cfg, fused):
    out = host_kernel(cfg)
    assert out.kwargs.get("fused", False) is fused
    assert {k: v for k, v in out.kwargs.items() if k != "fused" or not fused} == dict(cfg.kwargs)


def test_the_fused_host_step_is_reproducible_at_any_thread_count():
    # The fused kernel rounds some elements otherwise than torch's per-tensor loop (scripts/bench_host_step.py measures
    # how far each is from a float64 step); runs must still give the same bits, run to run and at 1 or 2 threads.
    def run(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            g = torch.Generator().manual_seed(0)
            p = nn.Parameter(torch.randn(100_003, generator=g))  # an odd size: a vectorized body and a scalar tail
            opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, **host_kernel(OptimConfig(name="adamw")).kwargs)
            for k in range(3):
                p.grad = torch.randn(p.shape, generator=g) * 10.0**-k
                opt.step()
            return p.detach()
        finally:
            torch.set_num_threads(before)

    one = run(1)
    assert torch.equal(one, run(1)) and torch.equal(one, run(2))


def test_measure_host_step_gives_the_planner_its_figures_once():
    figures = measure_host_step(2**16, num_tensors=2, threads=1, repeats=1)
    assert figures.params_per_s > 0 and figures.copy_bytes_per_s > 0 and figures.threads == 1
    assert figures.bytes_per_param == 28  # AdamW: weight and two moments read and written, the gradient read
    assert figures.bound_params_per_s == figures.copy_bytes_per_s / 28
    assert measure_host_step(2**16, num_tensors=2, threads=1, repeats=1) is figures  # cached: measured once
    # per optimizer: SGD with momentum moves the weight and its buffer both ways, and the gradient
    assert measure_host_step(2**16, optimizer="sgd", num_tensors=2, threads=1, repeats=1).bytes_per_param == 20


def test_background_is_accepted_on_a_streamed_stage():
    # swap.weights once refused swap.host_step=background ("streamed stages step their host layers synchronously");
    # StreamedVersions now steps on the thread (tests/test_stream.py::test_a_streamed_stage_steps_in_the_background...)
    from test_semantics import tiny_config

    from pipedream2bw.config import validate

    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2)
    cfg.swap.weights, cfg.swap.enabled, cfg.swap.optimizer, cfg.swap.host_step = True, True, "host", "background"
    validate(cfg, world_size=2)


def test_a_bf16_gradient_reaches_the_float32_master_cast():
    # torch lets no bf16 gradient sit on a float32 parameter, and the fused kernel takes one dtype: a gradient in the
    # compute dtype (a bf16 transfer) is cast to the master's on the host
    versions = _versions(False)
    p = versions._params[0][0]
    grad = torch.randn(p.shape).to(torch.bfloat16)
    versions._attach_master(0, p, grad)
    assert versions.master[0].grad.dtype == torch.float32 and torch.equal(versions.master[0].grad, grad.float())
