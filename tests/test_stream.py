"""Weight streaming (swap.weights, pipedream2bw/memory/stream.py): the same training bit for bit, device bytes
held to the prefetch window, and what it does not compose with refused at config time."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from dist_helper import run_ok, spawn
from test_semantics import tiny_config
from torch import nn

from pipedream2bw.memory.host_optim import HostOptimizerVersions
from pipedream2bw.memory.memprobe import tensor_peak
from pipedream2bw.memory.precision import autocast
from pipedream2bw.memory.sharding import ShardedVersions
from pipedream2bw.memory.stream import StreamedVersions, WeightStream, device_bytes_model, host_bytes_model
from pipedream2bw.memory.swap import CpuBackend, CudaBackend, _FutureTransfer
from pipedream2bw.pipeline import stateful
from pipedream2bw.pipeline.schedule import BACKWARD, FORWARD, STEP, stage_actions
from pipedream2bw.pipeline.stateful import StageSequential
from pipedream2bw.pipeline.versions import WeightVersions
from pipedream2bw.run.model import RecomputeSequential

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ADAM = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731


def _blocks(width: int = 16, depth: int = 3) -> list:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return [*blocks, nn.Tanh(), nn.Linear(width, 1)]  # a layer without weights between streamed ones


def _stage_loop(
    schedule,
    *,
    stream,
    recompute=False,
    precision="fp32",
    window=1,
    layers=None,
    probe=None,
    width=16,
    device="cpu",
    backend=None,
    host_optim=False,
    background=False,
    factory=ADAM,
    num_batches=3,
    weight_dtype=torch.float32,
):
    """Stage 0 of 2 runs its actions (F, B, S) in one process, the output's squared mean as the loss (each layer on
    its random stream, as in the trainer: ``stateful.microbatch_streams``); with
    ``stream``, through StreamedVersions and a WeightStream (``backend``: CpuBackend unless given; ``background``:
    swap.host_step=background); else with its weights on ``device`` (``host_optim``: HostOptimizerVersions; a
    ``weight_dtype`` other than float32, train.weight_dtype=compute: ShardedVersions' float32 masters). Each
    forward first asks for its batch's module, as the stage worker does (``module_for_batch``: a background step
    writing that replica is waited for). Returns (losses, newest weights, stream stats, versions)."""
    dev = torch.device(device)
    layers = layers if layers is not None else _blocks(width)
    module = (RecomputeSequential if recompute and not stream else StageSequential)(*layers)
    if stream:
        versions = StreamedVersions(
            module,
            pin=dev.type == "cuda",
            schedule=schedule,
            optimizer_factory=factory,
            background=background,
            weight_dtype=weight_dtype,
        )
        backend = backend if backend is not None else CpuBackend(overlap=probe is None)
        ws = WeightStream(versions, backend, window=window, recompute=recompute)
    elif weight_dtype != torch.float32:  # train.weight_dtype=compute unstreamed: the trainer's ShardedVersions
        buckets = [list(range(len(list(module.parameters()))))]
        versions, ws = (
            ShardedVersions(
                module.to(dev), schedule=schedule, optimizer_factory=factory, buckets=buckets, num_sharded=0,
                weight_dtype=weight_dtype,
            ),
            None,
        )  # fmt: skip
    else:
        kind = HostOptimizerVersions if host_optim else WeightVersions
        versions, ws = kind(module.to(dev), schedule=schedule, optimizer_factory=factory), None
    del module, layers
    m = 2
    xs = torch.randn(max(num_batches + 1, 4) * m, 3, width, generator=torch.Generator().manual_seed(1)).to(dev)
    xs = xs.to(weight_dtype)  # compute-dtype versions take activations in that dtype (the stage worker's _upcast)
    outs, losses = {}, []
    for a in stage_actions(schedule, stage_index=0, num_stages=2, num_microbatches=m, num_batches=num_batches):
        k = a.index
        with torch.profiler.record_function("compute") if probe else contextlib.nullcontext():
            if a.kind == FORWARD:
                versions.module_for_batch(k // m)
                r = versions.replica_for_batch(k // m)
                with autocast(precision, dev.type), stateful.microbatch_streams(0, k, dev):
                    if ws is not None:
                        ws.begin_forward(k, r)
                        out = ws.forward(versions.replicas[r], k, r, xs[k])
                    else:
                        out = versions.replicas[r](xs[k])
                outs[k] = out.float().pow(2).mean()
                losses.append(outs[k].item())
            elif a.kind == BACKWARD:
                if ws is not None:
                    ws.begin_backward(k)
                outs.pop(k).backward()
                if ws is not None:
                    ws.end_backward(k)
        if a.kind == STEP:
            if ws is not None:
                ws.quiesce()
            versions.step(k, grad_scale=1 / m)
    weights = {n: t.detach().cpu().clone() for n, t in versions.newest().state_dict().items()}
    return losses, weights, ws.close() if ws is not None else None, versions


@pytest.mark.parametrize(
    "schedule,recompute,precision,window",
    [
        ("2bw", False, "fp32", 1),
        ("2bw", True, "bf16", 2),
        ("flush", True, "fp32", 0),
        ("flush", False, "bf16", 1),
        ("gpipe", False, "fp32", 1),
        ("gpipe", True, "bf16", 1),
    ],
)
def test_streamed_stage_trains_bit_for_bit(schedule, recompute, precision, window):
    losses, weights, _, _ = _stage_loop(schedule, stream=False, recompute=recompute, precision=precision)
    s_losses, s_weights, stats, versions = _stage_loop(
        schedule, stream=True, recompute=recompute, precision=precision, window=window
    )
    assert s_losses == losses
    assert weights.keys() == s_weights.keys() and all(torch.equal(weights[n], s_weights[n]) for n in weights)
    assert stats["loads"] >= 2 * len(losses) and stats["grad_bytes_out"] > 0, stats
    # everything of the stage is in host buffers: no parameter, gradient or optimizer state outside them
    host = {f.untyped_storage().data_ptr() for flats in versions.flats for f in flats}
    assert all(p.untyped_storage().data_ptr() in host for r in versions.replicas for p in r.parameters())
    homed = [v for o in versions.optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    assert homed and all(id(v) in versions._homed for v in homed)


class _SlowAdam(torch.optim.Adam):
    """Adam that takes a while to step: a background step is then still running when the next batch starts, and any
    read of what it writes that does not wait for it (``settle``) sees the weights half made or not made at all."""

    def step(self, closure=None):
        time.sleep(0.05)  # a layer's step: 4 layers, 0.2 s, far longer than batch t+1's compute of this small stage
        return super().step(closure)


@pytest.mark.parametrize("recompute,precision,window", [(False, "fp32", 1), (True, "bf16", 2)])
def test_a_streamed_stage_steps_in_the_background_bit_for_bit(recompute, precision, window):
    # swap.host_step=background on a streamed stage (2bw): step t on its thread while batch t+1 streams W(t); batch
    # t+2's forward, the first to read W(t+1), waits for it. The same losses and weights as the synchronous streamed
    # step and as the stage unstreamed, bit for bit, over 6 batches (the thread's step runs behind a slow Adam, so a
    # read that did not wait would see W(t-1) or a half-stepped W(t+1)).
    kw = dict(recompute=recompute, precision=precision, num_batches=6)
    slow = lambda params: _SlowAdam(params, lr=0.01)  # noqa: E731
    base, base_weights, _, _ = _stage_loop("2bw", stream=False, **kw)
    sync, sync_weights, _, _ = _stage_loop("2bw", stream=True, window=window, **kw)
    bg, bg_weights, stats, versions = _stage_loop(
        "2bw", stream=True, window=window, background=True, factory=slow, **kw
    )
    assert bg == sync == base
    for weights in (sync_weights, bg_weights):
        assert weights.keys() == base_weights.keys() and all(torch.equal(weights[n], base_weights[n]) for n in weights)
    assert versions.background and versions._pending is None and stats["loads"] > 0
    # the steps ran on the thread (0.05 s a layer: the slow Adam's), and training waited for less than all of them:
    # batch t+1 computed meanwhile
    assert versions.host_step_s > 5 * 0.05 * len(versions.optimizers)
    assert versions.host_step_wait_s < versions.host_step_s


def test_gradients_are_added_to_the_host_accumulators_off_the_training_thread():
    # issue 42: the training thread spent 2.4 s of 4 batches (H200) adding each microbatch's gradient to the host
    # accumulators (StreamedVersions.add_grad). A worker thread adds them now, in the order made; the training thread
    # only reports them (on_grad) and waits for the last before the step. Bit for bit, on both gradient paths.
    threads = []
    real_add = StreamedVersions.add_grad

    def add_grad(self, replica, i, g):
        threads.append(threading.current_thread().name)
        return real_add(self, replica, i, g)

    base, base_weights, _, _ = _stage_loop("2bw", stream=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamedVersions, "add_grad", add_grad)
        for backend in (CpuBackend(), _GradsOnWorker()):
            threads.clear()
            losses, weights, stats, _ = _stage_loop("2bw", stream=True, backend=backend)
            assert losses == base and all(torch.equal(weights[n], base_weights[n]) for n in base_weights)
            assert threads and all(name.startswith("stream-grads") for name in threads), set(threads)
            assert stats["grad_wait_s"] >= 0


def test_batch_t_plus_2_takes_each_layer_once_its_background_step_is_done_not_the_whole_step():
    # issue 42: the training thread waited for batch t's whole host step before batch t+2's first layer. The step now
    # runs layer by layer in forward order and each copy of W(t+1) waits for its own layer's step only: batch t+2's
    # first layer is taken while step t still steps the later layers (a slow Adam: 0.05 s a layer). Bit for bit.
    ends = {}  # id(first parameter of the bucket) -> when its step ended, per step

    class _Timed(_SlowAdam):
        def step(self, closure=None):
            super().step(closure)
            ends.setdefault(id(self.param_groups[0]["params"][0]), []).append(time.perf_counter())

    taken = []  # (k, layer, replica, time) of each copy the forwards take
    real_take = WeightStream.take

    def take(self, key):
        out = real_take(self, key)
        taken.append((*key, time.perf_counter()))
        return out

    kw = dict(num_batches=5)
    base, base_weights, _, _ = _stage_loop("2bw", stream=False, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WeightStream, "take", take)
        timed = lambda params: _Timed(params, lr=0.01)  # noqa: E731
        bg, bg_weights, _, versions = _stage_loop("2bw", stream=True, background=True, factory=timed, **kw)
    assert bg == base and all(torch.equal(bg_weights[n], base_weights[n]) for n in base_weights)
    first, last = versions.layers[0][1][0], versions.layers[-1][1][0]  # first parameter of the first and last layer
    starts = versions.master[first], versions.master[last]
    m = 2
    overlapped = 0
    for t in range(1, 3):  # steps 1 and 2 (step 0 is waited at once: batch 1 shares its replica)
        # batch t+2's first microbatch's forward: its first layer's copy, in the replica step t wrote
        first_take = min(when for k, j, _, when in taken if k == m * (t + 2) and j == 0)
        first_done, last_done = ends[id(starts[0])][t], ends[id(starts[1])][t]
        assert first_take >= first_done  # never before its own layer's step
        overlapped += first_take < last_done  # ... but before the step's last layer was done
    assert overlapped >= 1, (ends, taken)


@pytest.mark.timeout(60)  # a copy left waiting for a failed step hangs
def test_a_background_step_that_fails_raises_on_the_training_thread_through_the_layer_it_was_making():
    # batch t+2's copies wait for their layer's step (layer_ready): a step that raises must reach the training thread
    # through the copy that waited for it, not leave the copy waiting (a hang) nor hand out an unstepped layer
    class _Fails(torch.optim.Adam):
        calls = 0

        def step(self, closure=None):
            type(self).calls += 1
            if type(self).calls > 6:  # the second background step (4 layers a step), on its first layer
                raise RuntimeError("host step failed on purpose")
            return super().step(closure)

    with pytest.raises(RuntimeError, match="host step failed on purpose"):
        _stage_loop("2bw", stream=True, background=True, factory=lambda p: _Fails(p, lr=0.01), num_batches=5)


@pytest.mark.parametrize("schedule,recompute,window", [("2bw", False, 1), ("2bw", True, 2), ("flush", False, 0)])
def test_compute_dtype_streamed_versions_train_as_the_unstreamed_compute_run_bit_for_bit(schedule, recompute, window):
    # train.weight_dtype=compute on a streamed stage: bf16 versions in the host buffers (half the bytes of each copy
    # to the device), float32 masters and float32 gradient sums on the host. The same losses and weights (the float32
    # masters, and the bf16 versions) as the unstreamed compute run (ShardedVersions), synchronous and, under 2bw,
    # with the step in the background behind a slow Adam.
    kw = dict(recompute=recompute, precision="bf16", weight_dtype=torch.bfloat16, num_batches=4, width=64)
    base, base_weights, _, base_versions = _stage_loop(schedule, stream=False, **kw)
    runs = [_stage_loop(schedule, stream=True, window=window, **kw)]
    if schedule == "2bw":
        slow = lambda params: _SlowAdam(params, lr=0.01)  # noqa: E731
        runs.append(_stage_loop(schedule, stream=True, window=window, background=True, factory=slow, **kw))
    fp32, *_, fp32_versions = _stage_loop(schedule, stream=True, window=window, **{**kw, "weight_dtype": torch.float32})
    assert fp32 != base  # the bf16 versions are in effect
    for losses, weights, stats, versions in runs:
        assert losses == base
        assert weights.keys() == base_weights.keys() and all(torch.equal(weights[n], base_weights[n]) for n in weights)
        assert all(w.dtype == torch.bfloat16 for w in weights.values())
        masters = versions.final_state()
        assert all(torch.equal(masters[n], t) for n, t in base_versions.final_state().items())
        assert all(m.dtype == torch.float32 for m in versions.master) and masters.keys() == weights.keys()
        # each layer's copy to the device is half the bytes (each parameter padded to 64 bytes: a bias of 1 element
        # is 64 either way)
        assert stats["loads"] > 0 and sum(versions.layer_bytes) <= 0.51 * sum(fp32_versions.layer_bytes)
        host = {f.untyped_storage().data_ptr() for flats in versions.flats for f in flats}
        assert all(p.untyped_storage().data_ptr() in host for r in versions.replicas for p in r.parameters())


def test_compute_dtype_checkpoints_resume_across_streamed_and_unstreamed():
    # A streamed compute-dtype stage saves what the unstreamed compute run saves (float32 versions, the float32
    # masters and optimizer state as whole "shards"), and each loads the other's state: the same masters, versions
    # and optimizer state.
    kw = dict(precision="bf16", weight_dtype=torch.bfloat16)
    *_, streamed = _stage_loop("2bw", stream=True, **kw)
    *_, plain = _stage_loop("2bw", stream=False, **kw)
    a, b = streamed.state(), plain.state()
    assert a.keys() == b.keys() and a["step"] == b["step"]
    for key in ("weights", "previous"):
        assert all(t.dtype == torch.float32 for t in a[key].values())
    for name, piece in b["shards"].items():
        assert a["shards"][name].keys() == piece.keys() and a["shards"][name]["range"] == piece["range"]
    from pipedream2bw.io.checkpoint import assemble_shards

    def loaded(state, into):  # as run/build.py restore hands a checkpoint in (masters assembled from the shards)
        shapes = {n: t.shape for n, t in state["weights"].items()}
        whole = assemble_shards([state["shards"]], shapes)
        weights = {**state["weights"], **whole["masters"]}
        if isinstance(into, ShardedVersions):
            into.load_state(step=state["step"], weights=state["weights"], previous=state["previous"],
                            optimizer=whole["optimizer"], masters=whole["masters"])  # fmt: skip
        else:
            into.load_state(
                step=state["step"], weights=weights, previous=state["previous"], optimizer=whole["optimizer"]
            )
        return into.state()

    def fresh(stream):
        module = StageSequential(*_blocks())
        if stream:
            return StreamedVersions(
                module, pin=False, schedule="2bw", optimizer_factory=ADAM, weight_dtype=torch.bfloat16
            )
        buckets = [list(range(len(list(module.parameters()))))]
        return ShardedVersions(module, schedule="2bw", optimizer_factory=ADAM, buckets=buckets, num_sharded=0,
                               weight_dtype=torch.bfloat16)  # fmt: skip

    for state, into in ((a, fresh(False)), (b, fresh(True))):
        again = loaded(state, into)
        for key in ("weights", "previous"):
            assert all(torch.equal(state[key][n], again[key][n]) for n in state[key])
        for name, piece in state["shards"].items():
            assert torch.equal(piece["master"], again["shards"][name]["master"])
            # (Adam's step of a 1-element parameter comes back from ShardedVersions shaped [1]: compared flat)
            got = again["shards"][name]["state"]
            assert all(torch.equal(v.reshape(-1), got[k].reshape(-1)) for k, v in piece["state"].items())


class _DropNorm(nn.Module):
    """Linear, dropout, then a BatchNorm over the features: a random mask and running statistics each forward."""

    def __init__(self, width: int):
        super().__init__()
        self.lin, self.drop, self.bn = nn.Linear(width, width), nn.Dropout(0.3), nn.BatchNorm1d(width)

    def forward(self, x):
        h = self.drop(self.lin(x))
        return self.bn(h.flatten(0, -2)).view_as(h)


@pytest.mark.parametrize("recompute", [False, True])
def test_streamed_layers_draw_their_own_dropout_masks_and_count_batchnorm_once(recompute):
    # As the stage's StageSequential: each layer reseeded on its own stream before its forward (a streamed stage drew
    # every layer's mask from one stream), and a recomputed forward puts its BatchNorm statistics back (they counted
    # twice). Weights and running statistics (in the state dict) bit for bit.
    def layers():
        torch.manual_seed(0)
        return [_DropNorm(16), _DropNorm(16), nn.Linear(16, 1)]

    losses, weights, _, _ = _stage_loop("flush", stream=False, recompute=recompute, layers=layers())
    s_losses, s_weights, _, _ = _stage_loop("flush", stream=True, recompute=recompute, layers=layers())
    assert s_losses == losses
    assert any("running_mean" in n for n in weights) and weights.keys() == s_weights.keys()
    assert all(torch.equal(weights[n], s_weights[n]) for n in weights)


class _GradsOnWorker(CpuBackend):
    """CpuBackend whose gradients leave as CudaBackend's do: copied on the offload worker (each a little late),
    read by the stream only once landed."""

    def grad_to_host(self, g):
        host = self.pool.get(g.numel() * g.element_size())
        tensor, keep = host.view(g.dtype).view(g.shape), [g]

        def copy():
            time.sleep(0.002)  # still in flight when the layer's sink returns
            tensor.copy_(keep.pop())

        transfer = _FutureTransfer(self._out.submit(copy), host=host)
        transfer.tensor = tensor
        return transfer


def test_gradients_copied_out_asynchronously_reach_the_step_whole_and_in_order():
    # WeightStream's path for a backend that copies gradients out asynchronously (CudaBackend's), run on the CPU:
    # each microbatch's gradients are added once landed, in the order made, and the step waits for the last.
    losses, weights, _, _ = _stage_loop("2bw", stream=False)
    s_losses, s_weights, stats, _ = _stage_loop("2bw", stream=True, backend=_GradsOnWorker())
    assert s_losses == losses
    assert all(torch.equal(weights[n], s_weights[n]) for n in weights)
    assert stats["grad_bytes_out"] > 0


def _two_microbatches(ws: WeightStream, versions: StreamedVersions) -> None:
    """Two microbatches of one batch through replica 0 of a flush stage (forward, backward), then ``grads_landed``."""
    x = torch.randn(2, 3, 16)
    for k in range(2):
        ws.begin_forward(k, 0)
        out = ws.forward(versions.replicas[0], k, 0, x[k : k + 1])
        ws.begin_backward(k)
        out.pow(2).mean().backward()
        ws.end_backward(k)
    ws.grads_landed()


def test_the_gradients_a_norm_reads_are_whole_once_landed():
    # The step agreement (clipping, on_nonfinite=skip) reads the host gradients at CLOSE, before the step's quiesce:
    # StageWorker.close calls grads_landed first. With gradients still in flight, the norm would miss a microbatch.
    torch.manual_seed(0)
    versions = StreamedVersions(nn.Sequential(*_blocks()), pin=False, schedule="flush", optimizer_factory=ADAM)
    ws = WeightStream(versions, _GradsOnWorker(), window=1, recompute=False)
    _two_microbatches(ws, versions)
    got = [p.grad.clone() for p in versions.replicas[0].parameters()]
    ws.quiesce()  # everything landed: the sums cannot change any more
    assert all(torch.equal(g, p.grad) for g, p in zip(got, versions.replicas[0].parameters()))
    ws.close()


@pytest.mark.parametrize("backend", [CpuBackend, _GradsOnWorker])
def test_each_gradient_is_reported_once_it_is_in_the_host_accumulator(backend):
    # Data parallelism (StageWorker._host_grad_ready): the reducer starts a layer's all-reduce once the batch's last
    # microbatch has added each of its gradients. ``on_grad(k, replica, i)`` must come after the add (not when a copy
    # leaves, on a GPU), once per microbatch and parameter, with the microbatch it belongs to.
    torch.manual_seed(0)
    versions = StreamedVersions(nn.Sequential(*_blocks()), pin=False, schedule="flush", optimizer_factory=ADAM)
    ws = WeightStream(versions, backend(), window=1, recompute=False)
    params = versions.replicas[0].parameters()
    heard = []

    def on_grad(k, r, i):
        p = list(versions.replicas[r].parameters())[i]
        heard.append((k, r, i, p.grad.clone()))

    ws.on_grad = on_grad
    _two_microbatches(ws, versions)
    n = len(list(versions.replicas[0].parameters()))
    assert sorted((k, i) for k, _, i, _ in heard) == [(k, i) for k in range(2) for i in range(n)]
    assert all(r == 0 for _, r, _, _ in heard)
    last = {i: g for k, _, i, g in heard if k == 1}  # what the reducer would sum: the batch's whole gradient
    assert all(torch.equal(last[i], p.grad) for i, p in enumerate(params))
    ws.close()


class _GradsInline(CudaBackend):
    """CudaBackend as it was before gradients left on the offload stream: each read where the backward made it
    (a synchronous copy on the compute stream)."""

    def grad_to_host(self, g):
        return None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule,recompute,precision", [("2bw", False, "fp32"), ("gpipe", True, "bf16")])
def test_a_streamed_cuda_stage_copies_gradients_off_the_compute_stream_bit_for_bit(schedule, recompute, precision):
    # The same stage on the GPU three ways: weights on the device with the optimizer on the host
    # (HostOptimizerVersions, as swap.optimizer=host: the same host Adam), streamed with the gradients copied out on
    # the offload stream, and streamed with the synchronous copy it replaced. Every loss and weight bit for bit.
    cuda = torch.device("cuda")
    kw = dict(recompute=recompute, precision=precision, width=64)
    base, base_weights, _, _ = _stage_loop(schedule, stream=False, device=cuda, host_optim=True, **kw)
    runs = {
        name: _stage_loop(schedule, stream=True, device=cuda, backend=backend, window=2, **kw)
        for name, backend in (("stream", CudaBackend(cuda)), ("inline", _GradsInline(cuda)))
    }
    for name, (losses, weights, _, _) in runs.items():
        assert losses == base, name
        assert weights.keys() == base_weights.keys(), name
        assert all(torch.equal(weights[n], base_weights[n]) for n in weights), name
    st, inline = runs["stream"][2], runs["inline"][2]
    assert st["grad_bytes_out"] == inline["grad_bytes_out"] > 0
    # the gradients went out on the offload stream (its busy time is measured there); inline, nothing used it
    assert st["copy_out_s"] > 0 and inline["copy_out_s"] == 0, (st, inline)
    # the stall (compute waiting for weight copies, measured on the compute stream) and the step's wait for the
    # last gradient copies are reported
    assert st["loads"] > 0 and st["stall_s"] >= 0 and st["grad_wait_s"] >= 0 and st["copy_in_s"] > 0, st


@pytest.mark.slow  # three profiled runs (torch.profiler's memory events)
def test_streamed_stage_device_bytes_fall_to_the_prefetch_window():
    # 8 equal layers of 256 x 256 float32 (256 KiB each), 2bw with Adam: without streaming the stage holds two
    # versions, the gradients and two moments (5 x 2 MiB); streamed, the window: (window + 1) layers' copies and
    # one layer's gradients. Measured while the stage computes (torch.profiler's live tensor bytes, copies inline);
    # the host step's own temporaries, host memory on a GPU, are not the device's.
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(256, 256, bias=False) for _ in range(8)]

    def peak(stream, window=1):
        with tensor_peak(torch.device("cpu"), within="compute") as box:
            *_, versions = _stage_loop("2bw", stream=stream, window=window, layers=layers(), probe=True, width=256)
        return box["bytes"], versions

    plain, _ = peak(False)
    for window in (1, 2):
        streamed, versions = peak(True, window)
        model = device_bytes_model(versions.layer_bytes, window=window)
        assert plain >= 5 * streamed, (plain, streamed)
        assert abs(streamed - model) <= 0.1 * model, (window, streamed, model)


def _config(schedule: str, num_stages: int, *, recompute: bool, precision: str):
    cfg = tiny_config(schedule=schedule, num_stages=num_stages, num_microbatches=4, num_steps=3)
    cfg.pipeline.recompute = recompute
    cfg.train.precision = precision
    return cfg


def _train(cfg, stream: bool, *, poison: Optional[int] = None):
    """Trains ``cfg`` (``stream``: every stage streams its weights); ``poison``: an inf in layer 1's gradient on its
    ``poison``-th backward (matrix.poisoned_layers). Returns (summary.json, final_model.pt)."""
    cfg = dataclasses.replace(cfg, swap=dataclasses.replace(cfg.swap))
    if stream:
        cfg.swap.enabled, cfg.swap.weights, cfg.swap.optimizer = True, True, "host"
        cfg.swap.resident, cfg.swap.min_bytes = 0, 4096  # activations of waiting microbatches swap too
    else:  # the streamed run's optimizer steps on the host: a CUDA AdamW, and torch's default CPU loop, which the
        cfg.swap.optimizer = "host"  # host step's fused kernel replaces (memory/host_optim.py), round otherwise
    run_dir = Path(tempfile.mkdtemp(prefix="stream-"))
    try:
        if poison is None:
            summary = run_ok(cfg, run_dir)
        else:
            results = spawn(
                _train_poisoned,
                world_size=cfg.pipeline.num_stages * cfg.pipeline.data_parallel,
                args=(cfg, str(run_dir), poison),
                log_dir=run_dir / "logs",
            )
            assert all(r.exitcode == 0 for r in results), [r.log for r in results]
            summary = json.loads((run_dir / "summary.json").read_text())
        return summary, torch.load(run_dir / "final_model.pt")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _train_poisoned(cfg, run_dir: str, call: int) -> None:
    from matrix import poisoned_layers

    from pipedream2bw.run.runner import run

    run(cfg, Path(run_dir), layers=poisoned_layers(cfg, call=call))


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,num_stages,recompute,precision",
    [
        ("2bw", 2, False, "fp32"),  # two versions on the host; stage 0 also swaps activations (resident 0)
        ("gpipe", 1, True, "bf16"),  # recomputation takes each layer again in backward; autocast
        # one GPU (NCCL, one rank): pinned host buffers, the copy streams, and both 2bw versions on the host
        pytest.param("2bw", 1, False, "bf16", marks=[pytest.mark.gpu, CUDA], id="cuda-2bw-bf16"),
        pytest.param("flush", 1, True, "fp32", marks=[pytest.mark.gpu, CUDA], id="cuda-flush-recompute"),
    ],
)
def test_streaming_gives_the_same_training_bit_for_bit(schedule, num_stages, recompute, precision, request):
    cfg = _config(schedule, num_stages, recompute=recompute, precision=precision)
    if request.node.callspec.id.startswith("cuda"):
        cfg.dist.backend = "nccl"
    base, base_weights = _train(cfg, stream=False)
    summary, weights = _train(cfg, stream=True)
    assert weights.keys() == base_weights.keys()
    assert all(torch.equal(weights[k], base_weights[k]) for k in weights)  # not to round-off: bit for bit
    assert summary["losses"] == base["losses"]
    for r in summary["ranks"]:
        st = r["stream"]
        assert st is not None and st["loads"] > 0 and st["grad_bytes_out"] > 0, st
        # swap.host_step=auto: under 2bw a streamed stage's host step runs on its own thread, else on the training
        # thread, all of it waited for; timed either way
        assert r["host_step_s"] > 0, r["host_step_s"]
        assert (r["host_step_wait_s"] == r["host_step_s"]) == (schedule != "2bw"), r
        # every layer with weights travels in each forward of 4 microbatches x 3 steps, and again in backward
        assert st["loads"] > 4 * 3 * st["layers"], st


COMPOSED = {
    # global clipping (the norm over host gradients, every step clipped: 0.05 is below each step's norm),
    # on_nonfinite=skip (an inf in layer 1's gradient, on stage 0, in batch 1's first backward: step 1 skipped on
    # both stages) and a validation pass through streamed weights after every step, across a stage boundary
    "clip-skip-eval-d2": dict(num_stages=2, data_parallel=1, clip=0.05, eval_every=1, skip=1),
    # the host gradients all-reduced over 2 replicas, a bucket per layer; with clipping (the norm counted once)
    "dp-clip-d1w2": dict(num_stages=1, data_parallel=2, clip=0.05, eval_every=0, skip=None),
    # bf16 versions streamed (train.weight_dtype=compute): float32 host masters and sums, the norm over the float32
    # sums, validation through the bf16 copies, the masters as the final weights; against the unstreamed compute run
    "bf16-compute-clip-eval-d2": dict(num_stages=2, data_parallel=1, clip=0.05, eval_every=1, skip=None, bf16=True),
    # fp16: the loss scaler's finite check and unscaling over the host-accumulated gradients (the step agreement's
    # norm of the host sums, as with clipping); the overflowing batch 1 is skipped and the scale halved on both stages
    "fp16-clip-overflow-d2": dict(num_stages=2, data_parallel=1, clip=0.05, eval_every=0, skip=1, fp16=True),
}


@pytest.mark.slow
@pytest.mark.long  # 4 launches, ~75 s on the loaded 2-core machine; the matrix's streamed cells cover these pairs
@pytest.mark.parametrize("case", list(COMPOSED))  # in the default tier (against the reference, to round-off)
def test_streaming_composes_bit_for_bit(case):
    """Streamed == unstreamed, bit for bit, with what a streamed stage used to refuse: every loss, the agreed
    gradient norms, the skipped step, the validation losses and the final weights; the passes streamed, the
    replicas all-reduced."""
    c = COMPOSED[case]
    m = 2
    cfg = tiny_config(schedule="2bw", num_stages=c["num_stages"], num_microbatches=m, num_steps=3)
    cfg.pipeline.data_parallel = c["data_parallel"]
    cfg.optim.clip_grad_norm = c["clip"]
    cfg.train.eval_every, cfg.train.eval_batches = c["eval_every"], 1
    cfg.data.val_fraction = 0.1 if c["eval_every"] else 0.0
    if c.get("bf16"):
        cfg.train.precision, cfg.train.weight_dtype = "bf16", "compute"
    poison = None
    if c.get("fp16"):  # the loss scaler skips the step that overflows, whatever train.on_nonfinite says
        cfg.train.precision, poison = "fp16", c["skip"] * m + 1
    elif c["skip"] is not None:
        cfg.train.on_nonfinite, poison = "skip", c["skip"] * m + 1
    base, base_weights = _train(cfg, stream=False, poison=poison)
    summary, weights = _train(cfg, stream=True, poison=poison)
    assert weights.keys() == base_weights.keys()
    assert all(torch.equal(weights[k], base_weights[k]) for k in weights)
    skipped = [] if c["skip"] is None else [c["skip"]]
    assert summary["skipped_steps"] == base["skipped_steps"] == skipped
    norms = [n for t, n in enumerate(summary["grad_norms"]) if t not in skipped]
    assert norms == [n for t, n in enumerate(base["grad_norms"]) if t not in skipped]
    assert summary["losses"] == base["losses"] and all(n is not None and n > c["clip"] for n in norms)  # all clipped
    assert summary["val_losses"] == base["val_losses"]
    for r in summary["ranks"]:
        assert r["stream"]["eval_loads"] == (3 * m * r["stream"]["layers"] if c["eval_every"] else 0), r["stream"]
        assert r["allreduce_calls"] == (3 * r["stream"]["layers"] if c["data_parallel"] > 1 else 0), r


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["swap.weights=true", "swap.optimizer=host"], r"swap.weights \(true\) with no stage swaps; set swap.enabled"),
        (["swap.weights=true", "swap.enabled=true"], r"optimizer steps where its weights live.*swap.optimizer=host"),
        (["swap.weight_prefetch=-1"], r"swap.weight_prefetch \(-1\) must be >= 0"),
        (  # compute-dtype versions step in the background only where every stage streams
            ["swap.weights=true", "swap.stages=[0]", "swap.optimizer=host", "train.precision=bf16"]
            + ["train.weight_dtype=compute", "optim.name=adamw", "swap.host_step=background"],
            r"swap.host_step \(background\) with train.weight_dtype \(compute\).*stream every stage",
        ),
    ],
)
def test_unsupported_streaming_is_refused_at_config_time(overrides, match):
    from test_config import make

    from pipedream2bw.config import ConfigError, validate

    validate(make("swap.weights=true", "swap.enabled=true", "swap.optimizer=host"), world_size=4)
    with pytest.raises(ConfigError, match=match):
        validate(make(*overrides), world_size=4)


def test_streaming_validates_with_what_it_composes_with():
    """What a streamed stage used to refuse and now composes with (test_streaming_composes_bit_for_bit)."""
    from test_config import make

    from pipedream2bw.config import validate

    on = ["swap.weights=true", "swap.enabled=true", "swap.optimizer=host"]
    validate(make(*on, "pipeline.data_parallel=2", "optim.clip_grad_norm=1.0", "train.on_nonfinite=skip"), world_size=8)
    validate(make(*on, "train.eval_every=5", "data.val_fraction=0.1", "train.precision=bf16"), world_size=4)
    bf16 = ["train.precision=bf16", "train.weight_dtype=compute", "optim.name=adamw"]  # float32 host masters
    validate(make(*on, *bf16, "swap.host_step=background", "optim.clip_grad_norm=1.0"), world_size=4)


def test_tied_weights_on_a_streamed_stage_are_refused():
    from pipedream2bw.config import ConfigError
    from pipedream2bw.pipeline import ties
    from pipedream2bw.run.start import check_weight_stream

    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2)
    cfg.swap.weights, cfg.swap.stages, cfg.swap.optimizer = True, [1], "host"
    tie = ties.Tie(names=("0.weight", "3.weight"), shape=(4, 4))
    check_weight_stream(cfg, [], [2, 2], "fp32")
    with pytest.raises(ConfigError, match=r"tied weights \[\['0.weight', '3.weight'\]\] on a streamed stage"):
        check_weight_stream(cfg, [tie], [2, 2], "fp32")
    cfg.swap.stages = [0]
    check_weight_stream(cfg, [], [2, 2], "fp16")  # train.precision=auto resolved to fp16 streams too (issue 42)


@pytest.mark.parametrize(
    "schedule,weight_dtype", [("2bw", torch.float32), ("flush", torch.float32), ("flush", torch.bfloat16)]
)
def test_the_host_bytes_model_is_what_the_streamed_buffers_take(schedule, weight_dtype):
    # run/start.py refuses a host that cannot hold a plan's streamed buffers from host_bytes_model, on meta layers:
    # it must be what StreamedVersions' pool takes once the stage has stepped (Adam: two moments; each parameter's
    # step count, a 4-byte scalar, is the only state it leaves out); bf16 versions: float32 sums and masters
    precision = "bf16" if weight_dtype == torch.bfloat16 else "fp32"
    *_, versions = _stage_loop(schedule, stream=True, weight_dtype=weight_dtype, precision=precision)
    with torch.device("meta"):
        layers = _blocks()
    versions_held = 2 if schedule == "2bw" else 1
    model = host_bytes_model(layers, versions=versions_held, optimizer_factor=2.0, weight_dtype=weight_dtype)
    num_params = sum(1 for _ in versions.replicas[0].parameters())
    assert model <= versions.pool.allocated_bytes <= model + 4 * num_params, (model, versions.pool.allocated_bytes)


def test_a_small_host_is_refused_naming_the_bytes_and_the_setting():
    from pipedream2bw.config import ConfigError
    from pipedream2bw.pipeline.layout import default_layout
    from pipedream2bw.run.model import RunModel
    from pipedream2bw.run.start import check_stream_host_memory

    cfg = tiny_config(schedule="2bw", num_stages=2, num_microbatches=2)
    cfg.swap.weights, cfg.swap.stages, cfg.swap.optimizer = True, [1], "host"
    model, layout = RunModel.of(cfg, None, None), default_layout(2, 1, ranks_per_node=2)
    with torch.device("meta"):
        need = host_bytes_model(model.whole()[3:], versions=2, optimizer_factor=2.0)  # stage 1: layers 3..5, Adam
    for rank in (0, 1):  # both ranks on one host: each counts the host's streamed stages (stage 1 only)
        check_stream_host_memory(cfg, model, [3, 3], layout, rank=rank, local_world_size=2, available=need)
        with pytest.raises(ConfigError, match=rf"stages \[1\], 1 ranks\) need {need} bytes .* has {need - 1} bytes"):
            check_stream_host_memory(cfg, model, [3, 3], layout, rank=rank, local_world_size=2, available=need - 1)
    # one rank per host: rank 0's host streams nothing
    check_stream_host_memory(cfg, model, [3, 3], layout, rank=0, local_world_size=1, available=0)


def test_checkpoint_state_round_trips_into_host_buffers():
    # A checkpoint (WeightVersions.state) of a streamed stage, loaded into a fresh one: the same versions and
    # optimizer state, and the loaded weights still live in the stage's host buffers (load_state copies in place).
    *_, versions = _stage_loop("2bw", stream=True)
    state = versions.state()
    fresh = StreamedVersions(nn.Sequential(*_blocks()), pin=False, schedule="2bw", optimizer_factory=ADAM)
    host = {f.untyped_storage().data_ptr() for flats in fresh.flats for f in flats}
    fresh.load_state(**state)
    again = fresh.state()
    for key in ("weights", "previous"):
        assert all(torch.equal(state[key][n], again[key][n]) for n in state[key])
    assert all(
        torch.equal(state["optimizer"][n][k], again["optimizer"][n][k])
        for n in state["optimizer"]
        for k in state["optimizer"][n]
    )
    assert all(p.untyped_storage().data_ptr() in host for r in fresh.replicas for p in r.parameters())


@pytest.mark.slow
@pytest.mark.long  # three launches: 42 s on the loaded machine
def test_a_streamed_stage_resumes_through_the_trainer_bit_for_bit(tmp_path):
    """4 steps straight == 2 steps, a checkpoint, a resume and 2 more, on a streamed stage (2bw: both versions and
    Adam's state go through the checkpoint into the host buffers): every loss and the final weights, bit for bit."""
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2, num_steps=4)
    cfg.swap.enabled, cfg.swap.weights, cfg.swap.optimizer = True, True, "host"
    cfg.train.checkpoint_every = 2
    straight = run_ok(cfg, tmp_path / "straight")
    first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=2))
    run_ok(first, tmp_path / "resumed")
    resumed = run_ok(cfg, tmp_path / "resumed")  # train.resume=auto: from the run directory's checkpoint of step 2
    assert resumed["first_step"] == 2 and resumed["ranks"][0]["stream"]["loads"] > 0
    assert resumed["losses"] == straight["losses"]
    a, b = torch.load(tmp_path / "resumed" / "final_model.pt"), torch.load(tmp_path / "straight" / "final_model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # three in-process launches of one rank (9 s on the loaded machine)
def test_compute_dtype_runs_resume_across_streamed_and_unstreamed_through_the_trainer(tmp_path):
    """bf16 versions (train.weight_dtype=compute): 2 steps unstreamed, a checkpoint, 2 more streamed (the checkpoint's
    float32 masters and optimizer state, from shard files, into the host buffers) == 4 steps unstreamed, bit for bit:
    every loss and the final weights (the float32 masters). The streamed run writes the same checkpoint files."""
    cfg = tiny_config(schedule="2bw", num_stages=1, num_microbatches=2, num_steps=4)
    cfg.train.precision, cfg.train.weight_dtype, cfg.train.checkpoint_every = "bf16", "compute", 2
    cfg.swap.optimizer = "host"
    straight = run_ok(cfg, tmp_path / "straight")
    first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=2))
    run_ok(first, tmp_path / "resumed")
    streamed = dataclasses.replace(cfg, swap=dataclasses.replace(cfg.swap, enabled=True, weights=True))
    resumed = run_ok(streamed, tmp_path / "resumed")  # train.resume=auto: the unstreamed run's checkpoint of step 2
    assert resumed["first_step"] == 2 and resumed["ranks"][0]["stream"]["loads"] > 0
    assert resumed["losses"] == straight["losses"]
    a, b = torch.load(tmp_path / "resumed" / "final_model.pt"), torch.load(tmp_path / "straight" / "final_model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in a.values())
    # the streamed run's checkpoint of step 4 holds the files the unstreamed run's does (the masters' shard files)
    runs = (tmp_path / "resumed", tmp_path / "straight")
    names = [sorted(p.name for p in d.glob("*/step_00000004/*.pt")) for d in runs]
    assert any("shard_rank" in n for n in names[0]) and names[0] == names[1], names
