"""The planner streams weights (swap.weights) where a stage would not fit otherwise (issue 36): planner only, no
training; the bandwidths and compute rates are the presets' assumptions."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from partitioner.auto import apply_choices, apply_plan, make_request, plan_config, run_overrides
from partitioner.cost import RESOURCES, LayerCost, Segments, StageContext, StageCost, host_step_overlaps, segment_costs
from partitioner.host import HostProfile
from partitioner.planner import _LEFT_OUT, HostFigures, _streams, bound_line, stage_contexts, stage_table, table
from partitioner.profile import analytic_gpt
from partitioner.topology import GIB, Link
from pipedream2bw.config import ConfigError, TopologyConfig, default_plan_choices, validate
from pipedream2bw.memory.stream import device_bytes_model


@functools.lru_cache(maxsize=None)
def _composed():
    from partitioner.__main__ import compose

    return compose(["model=llama13b", "topology=commodity", "train.global_batch_size=64"])


def llama13b(**sections):
    """docs/memory.md's example: a Llama-2-13B-shaped GPT, global batch 64, on the commodity server; ``sections``:
    {section: {key: value}} changed (composed once: Hydra takes most of a second per composition)."""
    cfg = _composed()
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **keys) for name, keys in sections.items()}
    )


def _layers(cfg, plan):
    b, precision = plan.microbatch_size, plan.precision
    return analytic_gpt(cfg.model, cfg.optim, b, cfg.topology, precision=precision, weight_dtype=plan.weight_dtype)


def test_zb1p_plan_never_streams_and_names_flush_where_only_streaming_fits():
    # zb1p refuses swapping, streaming and recomputation (config/validate.py): the search leaves them out, and "no
    # plan fits" offers flush with them, not the partition.* keys that zb1p would then refuse.
    with pytest.raises(ConfigError, match="no plan fits") as err:
        plan_config(llama13b(pipeline=dict(schedule="zb1p")))
    msg = str(err.value)
    assert "with flush's swapping, streaming and recomputation (pipeline.schedule=flush " in msg, msg
    assert "(partition.stream=true) it fits" not in msg, msg
    req = make_request(llama13b(pipeline=dict(schedule="zb1p")))
    assert (req.swap, req.stream, req.recompute) == (False, False, False)  # the search's own choices, too
    offered = [name for name, _, applies, _ in _LEFT_OUT if applies(req)]
    assert not {"activation swapping", "weight streaming", "recomputation"} & set(offered), offered


def test_the_planner_refuses_zbv_on_a_cuda_topology_in_one_line():
    # zbv plans exist (partitioner/vplan.py, issue 46), but zbv runs on gloo only: a CUDA topology's run is NCCL's
    with pytest.raises(ConfigError, match=r"^pipeline.schedule=zbv runs on gloo only and topology '\w+'") as e:
        plan_config(llama13b(pipeline=dict(schedule="zbv")))
    assert "\n" not in str(e.value) and "plan zb1p, or a CPU topology" in str(e.value)


def test_llama13b_on_four_24gib_gpus_fits_only_by_streaming_and_runs_as_planned():
    cfg = llama13b()
    with pytest.raises(ConfigError, match="no plan fits") as err:  # 20 B a parameter: 65 GB a device at d = 4
        plan_config(llama13b(partition=dict(stream=False)))
    assert "with weight streaming (partition.stream=true) it fits: 4 x 1" in str(err.value)  # what to change
    plans = plan_config(cfg)
    best = plans[0]
    assert best.data_parallel == 1 and best.stream_stages and best.stream_stages == best.swap_stages
    assert max(best.predicted_peak_memory_bytes) <= 24 * GIB
    layers, bounds = _layers(cfg, best), [*best.boundaries, sum(best.balance)]
    for s in best.stream_stages:  # the runtime's own model of a streamed stage's weights and gradients
        parts = best.predicted_memory_breakdown[s]
        own = [c.param_bytes for c in layers[bounds[s] : bounds[s + 1]]]
        assert parts["weights"] + parts["gradients"] == device_bytes_model(own, window=best.weight_prefetch)
        assert parts["optimizer"] == 0 and best.predicted_stall_s[s] > 0
    assert "stream" in table(plans).splitlines()[0] and "stall ms" in stage_table(best)
    # what partition=auto|file then runs: the plan's streamed stages, with what streaming needs; and it validates
    # what the plan steps on the host: optim.name=adamw, whose 'auto' is no correction (Muon's prediction would refuse
    # the host optimizer)
    run = llama13b(partition=dict(mode="auto"), optim=dict(name="adamw", delay_correction="none"))
    optim, train = apply_choices(run.optim, run.train, best, precision="bf16")
    pipeline, swap = apply_plan(run.pipeline, run.swap, best, world_size=4, num_layers=43)
    assert (swap.weights, swap.optimizer, swap.stages) == (True, "host", best.stream_stages)
    run = default_plan_choices(dataclasses.replace(run, pipeline=pipeline, swap=swap, optim=optim, train=train))
    assert validate(run, world_size=4) == best.balance
    plain = dataclasses.replace(best, stream_stages=[], swap_stages=[])
    with pytest.raises(ConfigError, match="the plan decides which stages stream"):
        apply_plan(run.pipeline, swap, plain, world_size=4, num_layers=43)


def _plan_contexts(cfg, plan, *, swap: bool, **extra):
    """The planner's per-stage contexts of ``plan`` (its layout, schedule and microbatches) on ``cfg``'s topology."""
    return stage_contexts(
        cfg.topology,
        plan.rank_map,
        schedule=plan.schedule,
        num_microbatches=plan.num_microbatches,
        recompute=plan.recompute,
        swap=swap,
        swap_resident=plan.swap_resident,
        runtime_bytes=cfg.topology.runtime_overhead_gib * GIB,
        **extra,
    )


def test_a_stage_streams_only_where_it_would_not_fit_otherwise():
    cfg = llama13b(model=dict(num_layers=8), partition=dict(microbatch_sizes=[4]))
    best = plan_config(cfg)[0]
    assert best.stream_stages and len(best.stream_stages) < best.num_stages, best.stream_stages
    seg = Segments(_layers(cfg, best))
    ctxs = _plan_contexts(cfg, best, swap=False)
    bounds = [*best.boundaries, seg.n]
    for s, ctx in enumerate(ctxs):  # every stage of a streaming plan has its optimizer on the host
        plain = StageCost.of(seg, bounds[s], bounds[s + 1], dataclasses.replace(ctx, host_optimizer=True))
        assert (plain["memory"] > best.memory_per_device_bytes) == (s in best.stream_stages), s


def _copy_stream(times, compute, *, window):
    """Event by event, what stream.py does in one pass: copies on one stream, serially; take(k) first issues the
    copy ``window`` layers ahead, then waits for k's own (window 0: loads k then). Returns the stall."""
    issued, copy_end, now = {}, 0.0, 0.0

    def issue(q, at):
        nonlocal copy_end
        copy_end = max(at, copy_end) + times[q]
        issued[q] = copy_end

    for q in range(min(window, len(times))):
        issue(q, 0.0)
    for k in range(len(times)):
        if k + window < len(times) and window:
            issue(k + window, now)
        if k not in issued:
            issue(k, now)
        now = max(now, issued[k]) + compute[k]
    return now - sum(compute)


def _uneven_layers():
    """4 layers of 1-4 GB of float32 weights (one matrix each: 64-byte aligned in any dtype), 1 s forwards, 2 s
    backwards, Adam's state (2 x the weights)."""
    gb = 10**9
    return [LayerCost(str(k), 1.0, 2.0, (k + 1) * gb, 0, 0, 0, optimizer_bytes=2 * (k + 1) * gb) for k in range(4)]


@pytest.mark.parametrize("weight_copy_bytes", [4, 2], ids=["fp32", "compute"])
@pytest.mark.parametrize("window", [0, 1, 2])
def test_streamed_stall_follows_the_copy_stream(window, weight_copy_bytes):
    # uneven layers: copies of 1-4 s (float32; half with bf16 versions) against forwards of 1 s, backwards of 2 s (the
    # gradients out, in the versions' dtype, add their copy)
    layers = _uneven_layers()
    seg, bw = Segments(layers), 1e9
    ctx = StageContext(
        0, 1, 1, 1, stream=True, stream_window=window, host_device_bw=bw, weight_copy_bytes=weight_copy_bytes
    )
    got = segment_costs(seg, 0, 4, ctx)
    own = [c.param_bytes * weight_copy_bytes // 4 for c in layers]  # StreamedVersions.layer_bytes: the versions' dtype
    t = [nbytes / bw for nbytes in own]
    fwd = _copy_stream(t, [c.forward_s for c in layers], window=window)
    bwd_compute = [c.backward_s + tk for c, tk in zip(layers, t)][::-1]  # gradients leave on the compute stream
    bwd = _copy_stream(t[::-1], bwd_compute, window=window) + sum(t)
    if window <= 1:  # exact: the copy in flight overlaps the layer computing
        assert float(got["stream_fwd_s"]) == pytest.approx(fwd) and float(got["stream_s"]) == pytest.approx(fwd + bwd)
    else:  # a longer window smooths uneven layers: the model is an upper bound
        assert float(got["stream_s"]) >= fwd + bwd - 1e-9
    assert float(got["stall_s"]) == float(got["stream_s"])  # no activation swapping: one microbatch
    assert float(got["weights"]) + float(got["gradients"]) == device_bytes_model(own, window=window)


@pytest.mark.parametrize("weight_dtype", ["fp32", "compute"])
@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_a_streamed_stage_holds_on_the_host_what_the_runtime_s_model_says(schedule, weight_dtype):
    # the planner's host bytes of a streamed stage against stream.host_bytes_model (what run/start.py checks the host
    # against, itself tested against the buffers StreamedVersions takes): per version its weights (bf16 with compute)
    # and a float32 gradient accumulator, Adam's state and, with compute-dtype versions, the float32 masters. The
    # planner had counted one accumulator for all versions (2bw: 20 B a parameter where the runtime takes 24).
    import torch
    from torch import nn

    from pipedream2bw.memory.precision import param_memory, versions_held
    from pipedream2bw.memory.stream import host_bytes_model

    wc = param_memory("bf16", schedule=schedule, optimizer="adam", weight_dtype_name=weight_dtype).weight_copy
    ctx = StageContext(0, 1, 1, 1, schedule=schedule, stream=True, weight_copy_bytes=wc)
    got = segment_costs(Segments(_uneven_layers()), 0, 4, ctx)
    with torch.device("meta"):
        modules = [nn.Linear(1000, (k + 1) * 250_000, bias=False) for k in range(4)]  # (k + 1) GB of float32
    dtype = torch.bfloat16 if wc == 2 else torch.float32
    model = host_bytes_model(modules, versions=versions_held(schedule), optimizer_factor=2.0, weight_dtype=dtype)
    assert float(got["host_bytes"]) == model
    assert float(got["optimizer"]) == 0  # all of it on the host


_IDS = lambda change: ",".join(f"{k}.{kk}" for k, v in change.items() for kk in v)  # noqa: E731


@pytest.mark.parametrize(
    "change",
    [
        dict(model=dict(tie_embeddings=True)),
        dict(partition=dict(stream=False)),
        dict(topology=dict(device="cpu"), partition=dict(costs="analytic")),
    ],
    ids=_IDS,
)
def test_the_planner_never_streams_what_the_runtime_refuses(change):
    assert _streams(make_request(llama13b()), 1) and _streams(make_request(llama13b()), 2)  # w > 1 composes
    assert not _streams(make_request(llama13b()), 1, 2)  # the runtime refuses a tensor split with swap.weights
    assert not _streams(make_request(llama13b(**change)), 1)


@pytest.mark.parametrize(
    "change",
    [
        dict(train=dict(precision="fp16")),
        dict(optim=dict(clip_grad_norm=1.0)),
        dict(train=dict(on_nonfinite="skip")),
        dict(train=dict(eval_every=10)),
        dict(train=dict(weight_dtype="compute")),
    ],
    ids=_IDS,
)
def test_the_planner_streams_what_the_runtime_composes_with(change):
    # config/validate.py's _validate_weight_stream lets these stream (issue 42): the planner had still left them out
    # (fp16: the loss scaler's checks over the host gradients, this branch)
    req = make_request(llama13b(**change))
    assert _streams(req, 1) and req.stream


def test_a_bf16_plan_with_compute_dtype_versions_streams_half_the_bytes_and_its_run_line_says_so(
    fixed_host, capsys, tmp_path
):
    # train.weight_dtype=compute under bf16 (issue 42 item 1): a streamed stage's device window holds bf16 layers, its
    # copies and gradients on the link are 2 B a parameter, its host holds stream.host_bytes_model's bytes; the plan
    # records the dtype and its run line carries it; with clipping and validation, which streaming composes with
    import torch

    from partitioner.__main__ import main
    from pipedream2bw.memory.stream import host_bytes_model
    from pipedream2bw.models.gpt import build_gpt_layers

    keys = dict(optim=dict(name="adamw", delay_correction="none", clip_grad_norm=1.0))
    cfg = llama13b(train=dict(weight_dtype="compute", eval_every=50), **keys)
    best, fp32 = plan_config(cfg)[0], plan_config(llama13b(**keys))[0]
    assert best.weight_dtype == "compute" and best.stream_stages and fp32.weight_dtype == "fp32"
    layers, bounds = _layers(cfg, best), [*best.boundaries, sum(best.balance)]
    # bf16 weights are not cast by autocast: a block saves no bf16 copy of its matrices (12 C^2 of them) a microbatch
    block, fp32_block = layers[1], _layers(cfg, dataclasses.replace(best, weight_dtype="fp32"))[1]
    assert fp32_block.saved_bytes - block.saved_bytes == 2 * 12 * cfg.model.d_model**2
    ctxs = _plan_contexts(cfg, best, swap=True, weight_copy_bytes=2, waits=[True] * best.num_stages)
    for s in best.stream_stages:
        parts, own = best.predicted_memory_breakdown[s], layers[bounds[s] : bounds[s + 1]]
        assert parts["weights"] + parts["gradients"] == device_bytes_model(
            [c.param_bytes // 2 for c in own], window=best.weight_prefetch
        )
        assert parts["optimizer"] == 0
    s = best.stream_stages[0]
    stage = StageCost.of(
        Segments(layers), bounds[s], bounds[s + 1], dataclasses.replace(ctxs[s], stream=True, host_optimizer=True)
    )
    with torch.device("meta"):
        modules = build_gpt_layers(cfg.model, seed=0, indices=range(bounds[s], bounds[s + 1]))
    model = host_bytes_model(modules, versions=2, optimizer_factor=2.0, weight_dtype=torch.bfloat16)  # AdamW
    assert stage["host_bytes"] == model
    # the link's bytes halve: a stage of the same layers stalls less with bf16 versions than with float32 ones
    plain = StageCost.of(
        Segments(layers),
        bounds[s],
        bounds[s + 1],
        dataclasses.replace(ctxs[s], stream=True, host_optimizer=True, weight_copy_bytes=4),
    )
    assert stage["stream_s"] < plain["stream_s"] and stage["memory"] < plain["memory"]
    out = tmp_path / "plan.yaml"
    args = ["model=llama13b", "topology=commodity", "train.global_batch_size=64", "train.weight_dtype=compute"]
    assert main(["plan", "--out", str(out), *args, "optim.name=adamw", "optim.clip_grad_norm=1.0"]) == 0
    run_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "train.weight_dtype=compute" in run_line and "optim.clip_grad_norm=1.0" in run_line
    # what partition=auto|file then runs validates: streaming with compute-dtype versions, clipping and validation
    run = llama13b(partition=dict(mode="auto"), train=dict(weight_dtype="compute", eval_every=50), **keys)
    optim, train = apply_choices(run.optim, run.train, best, precision="bf16")
    pipeline, swap = apply_plan(run.pipeline, run.swap, best, world_size=4, num_layers=43)
    run = default_plan_choices(dataclasses.replace(run, pipeline=pipeline, swap=swap, optim=optim, train=train))
    assert run.train.weight_dtype == "compute" and run.swap.weights
    assert validate(run, world_size=4) == best.balance


# ---- the host as the third resource (issue 42 item 6) ----------------------------------------------------------


def _host_stage(*, step_bw, copy_bw=10e9, host_step="auto", stream=True, m=4, **host):
    """One stage of 4 layers (1 GB of float32 weights each, AdamW state 2 GB, 10 ms forward, 20 ms backward) whose
    optimizer steps on the host, with the host stepping ``step_bw`` bytes/s and copying ``copy_bw``; ``host``: more
    of StageContext's host fields."""
    layers = [LayerCost(str(k), 0.01, 0.02, 10**9, 0, 0, 0, optimizer_bytes=2 * 10**9) for k in range(4)]
    ctx = StageContext(
        0,
        2,
        m,
        1,
        stream=stream,
        host_optimizer=True,
        host_device_bw=25e9,
        host_step_bw=step_bw,
        host_copy_bw=copy_bw,
        host_step=host_step,
        **host,
    )
    return {k: float(v) for k, v in segment_costs(Segments(layers), 0, 4, ctx).items()}


def test_a_stage_whose_host_step_dominates_is_reported_host_bound():
    slow, fast = _host_stage(step_bw=1e9, host_step="sync"), _host_stage(step_bw=1e12, copy_bw=1e12, host_step="sync")
    # AdamW: read the gradient, read and write weights and both moments: 3 x 4 GB + 2 x 8 GB at 1 GB/s; and W(t) copied
    # into the replica that the step writes W(t+1) in (float32 streamed versions): 4 GB at the copy bandwidth
    assert slow["host_step_s"] == pytest.approx(28.0 + 0.4) and fast["host_step_s"] == pytest.approx(0.028 + 0.004)
    assert RESOURCES[int(slow["bound"])] == "host" and slow["batch_s"] > slow["host_step_s"]
    assert RESOURCES[int(fast["bound"])] == "compute" and fast["batch_s"] < slow["batch_s"] / 10
    # the host's sums of a streamed stage's gradients: the first microbatch copied, three added (1.5 copies each)
    assert slow["host_sum_s"] == pytest.approx((1 + 3 * 1.5) * 4e9 / 10e9)


def test_background_host_step_overlaps_the_next_batch_and_sync_adds_it():
    # a stage that keeps its weights on the device (swap.optimizer=host): the runtime's auto steps it on a thread
    sync = _host_stage(step_bw=1e9, host_step="sync", stream=False)
    background = _host_stage(step_bw=1e9, host_step="auto", stream=False)
    link = 2 * 4e9 / 25e9  # gradients out, new weights in, at the step
    device = 4 * 4 * (0.01 + 0.02)  # 4 microbatches of 4 layers
    assert sync["batch_s"] == pytest.approx(device + link + 28.0)
    assert background["batch_s"] == pytest.approx(max(device + link / 2, 28.0 + link / 2))
    assert background["step_s"] == pytest.approx(link / 2)  # what the training thread does at the step
    fast = _host_stage(step_bw=1e12, host_step="background", stream=False)
    assert fast["batch_s"] == pytest.approx(device + link / 2)  # hidden: the device's batch is the longer
    # a streamed stage steps on its thread under auto too (stream.py), on the training thread with sync
    auto = _host_stage(step_bw=1e9)["batch_s"]
    assert _host_stage(step_bw=1e9, host_step="sync")["batch_s"] > auto
    assert auto == _host_stage(step_bw=1e9, host_step="background")["batch_s"]
    assert not host_step_overlaps(StageContext(0, 2, 4, 1, schedule="flush", host_step="background"))
    # compute-dtype versions (bf16: 2 B) step on the training thread unless streamed (run/build.py: ShardedVersions)
    assert not host_step_overlaps(StageContext(0, 2, 4, 1, weight_copy_bytes=2, host_optimizer=True))
    assert host_step_overlaps(StageContext(0, 2, 4, 1, weight_copy_bytes=2, host_optimizer=True, stream=True))


def test_with_no_core_free_of_the_ranks_compute_the_host_step_and_copies_take_turns_with_it():
    # the bug (bench_stream --data-parallel 2 on 2 cores: predicted 1.7x the measured samples/s): the model overlapped
    # a host step, and on a CPU the copies, with compute although every core computed; the runtime's host step ran
    # 10-14 ms of CPU a batch, and 46-59 ms waiting for a core
    for stream in (True, False):  # a streamed stage; a stage with its optimizer on the host (swap.optimizer=host)
        free = _host_stage(step_bw=1e9, stream=stream, host_free_cores=1.0)
        sync = _host_stage(step_bw=1e9, stream=stream, host_step="sync")
        shared = _host_stage(step_bw=1e9, stream=stream, host_free_cores=0.0)
        assert free["batch_s"] < sync["batch_s"]  # a core of its own: the step overlaps the next batch
        assert shared["batch_s"] == pytest.approx(sync["batch_s"]) and shared["step_s"] == sync["step_s"]
    # a CPU "device": the copies are worker threads' memcpys; with a core free they overlap compute, else they add,
    # running while compute waits for them (its stall)
    cpu = {f: _host_stage(step_bw=1e12, copy_bw=1e12, host_is_device=True, host_free_cores=f) for f in (1.0, 0.0)}
    copy = 4 * 2 * 4e9 / 25e9  # 4 microbatches each bring the 4 GB of weights in twice (forward, backward)
    stalled = 4 * cpu[1.0]["stall_s"]
    assert 0 < stalled < copy and cpu[0.0]["batch_s"] == pytest.approx(cpu[1.0]["batch_s"] - stalled + copy)


def test_the_planner_counts_the_cores_a_nodes_ranks_leave_free():
    topo = TopologyConfig(device="cpu", devices_per_node=2)
    kw = dict(schedule="2bw", num_microbatches=4, recompute=False, swap=False, swap_resident=1, runtime_bytes=0.0)
    for rank_map, host, free in [
        ([[0, 1]], HostFigures(cores=2), 0.0),  # two replicas on 2 cores, a thread each
        ([[0]], HostFigures(cores=2), 0.0),  # one rank on torch's default threads: every core
        ([[0]], HostFigures(cores=2, omp_threads=1), 1.0),  # OMP_NUM_THREADS=1
        ([[0, 1]], HostFigures(), math.inf),  # no figure
    ]:
        assert stage_contexts(topo, rank_map, host=host, **kw)[0].host_free_cores == free
    gpus = TopologyConfig(name="dgx", device="cuda", devices_per_node=8, cores=None)
    ctx = stage_contexts(gpus, [[0, 1, 2, 3, 4, 5, 6, 7]], host=HostFigures(cores=64), **kw)[0]
    assert ctx.host_free_cores == 7.0


FIXED_HOST = HostProfile(step_params_per_s=5e7, copy_bytes_per_s=2e9, kernel="fused", cores=2)


def test_the_host_figures_are_measured_once_and_cached(tmp_path, monkeypatch):
    import partitioner.host as host

    calls = []
    monkeypatch.setattr(host, "measure_host_step", lambda: calls.append("step") or 1e8)
    monkeypatch.setattr(host, "measure_copy", lambda: calls.append("copy") or 3e9)
    monkeypatch.setattr(host, "measure_reduce", lambda: calls.append("reduce") or 1e9)
    first = host.host_profile(cache_dir=tmp_path)
    assert calls == ["step", "copy", "reduce"] and len(list(tmp_path.glob("host-*.json"))) == 1
    for _ in range(2):  # a plan's request, then another process's: the cached figures
        assert make_request(llama13b(partition=dict(cache_dir=str(tmp_path)))).host.step_bw == 1e8 * 28
    assert host.host_profile(cache_dir=tmp_path) == first and calls == ["step", "copy", "reduce"]
    assert first.step_bytes_per_s == 28e8 and "100 M parameters/s" in first.describe()


@pytest.fixture
def fixed_host(monkeypatch):
    """This test's host figures, not this machine's (planning streams: it would measure them)."""
    import partitioner.host as host

    monkeypatch.setattr(host, "host_profile", lambda **kw: FIXED_HOST)
    return FIXED_HOST


def test_a_streamed_plan_prints_its_host_step_column_and_what_bounds_it(fixed_host):
    cfg = llama13b(optim=dict(name="adamw", delay_correction="none"))
    plans = plan_config(cfg)
    best = plans[0]
    layers, bounds = _layers(cfg, best), [*best.boundaries, sum(best.balance)]
    share = max(1.0, best.num_stages / fixed_host.cores)  # one node: its ranks take turns on its 2 cores
    for s in range(best.num_stages):
        own = layers[bounds[s] : bounds[s + 1]]
        traffic = sum(3 * c.param_bytes + 2 * c.optimizer_bytes for c in own)
        # a streamed stage's float32 versions: W(t) copied into the replica the step writes W(t+1) in, first
        copy = sum(c.param_bytes for c in own) if s in best.stream_stages else 0
        expected = traffic * share / fixed_host.step_bytes_per_s + copy * share / fixed_host.copy_bytes_per_s
        assert best.predicted_host_step_s[s] == pytest.approx(expected)
    rows = stage_table(best).splitlines()
    header = rows[0].split()
    assert "step s" in rows[0] and "sums s" in rows[0] and "bound" in header
    for s, row in enumerate(rows[1:]):
        assert f"{best.predicted_host_step_s[s]:.3f}" in row.split() and best.predicted_stage_bound[s] in row.split()
    assert best.predicted_bound == "host" and "bound" in table(plans).splitlines()[0]
    line = bound_line(best)
    assert f"{best.predicted_samples_per_s:.4g} samples/s" in line and "bound by the host's optimizer step" in line
    assert fixed_host.describe() in line and best.host == fixed_host.describe()


def test_muon_plans_that_stream_step_adamw_on_the_host_and_say_so(fixed_host, capsys, tmp_path):
    from partitioner.__main__ import main

    cfg = llama13b()  # the default optimizer: Muon with the prediction and error feedback
    assert cfg.optim.name == "muon"
    best = plan_config(cfg)[0]
    assert best.stream_stages and run_overrides(cfg.optim, best) == ["optim.name=adamw"]
    # costed as what runs: AdamW's state on the host, with no correction (optim.name=adamw's 'auto')
    adamw = plan_config(llama13b(optim=dict(name="adamw", delay_correction="none")))[0]
    assert best.predicted_host_step_s == adamw.predicted_host_step_s
    with pytest.raises(ConfigError, match=r"optim.name \(muon\) with a plan whose stages step .* optim.name=adamw"):
        apply_choices(cfg.optim, cfg.train, best, precision="bf16")  # partition=auto|file: refused, naming the fix
    resident = dataclasses.replace(best, stream_stages=[], swap_stages=[], host_optimizer=False)
    assert run_overrides(cfg.optim, resident) == []  # Muon on the devices
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--out", str(out), "model=llama13b", "topology=commodity", "train.global_batch_size=64"]) == 0
    run_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "optim.name=adamw" in run_line and "optim.name=muon" not in run_line


def test_where_only_the_optimizer_state_must_leave_the_plan_keeps_it_on_the_host_and_streams_nothing(fixed_host):
    # 8 blocks at b = 2: no plan with the state on the devices; with it on the host every stage fits unstreamed, which
    # is faster than streaming (its host sums); before, the search dropped that split and found no plan at all
    cfg = llama13b(model=dict(num_layers=8), partition=dict(microbatch_sizes=[2]), optim=dict(name="adamw"))
    # (at t = 1: a tensor width of 4 holds it too, issue 44; the runtime's partition=auto plans t = 1 unless pinned)
    with pytest.raises(ConfigError, match="no plan fits"):
        plan_config(
            llama13b(model=dict(num_layers=8), partition=dict(microbatch_sizes=[2], stream=False)), search_tensor=False
        )
    best = plan_config(cfg, search_tensor=False)[0]
    assert best.host_optimizer and best.steps_on_host and not best.stream_stages
    assert all(parts["optimizer"] == 0 for parts in best.predicted_memory_breakdown)
    assert "step s" in stage_table(best) and all(step > 0 for step in best.predicted_host_step_s)
    pipeline, swap = apply_plan(cfg.pipeline, cfg.swap, best, world_size=4, num_layers=11)
    assert (swap.optimizer, swap.weights, swap.stages) == ("host", False, [])


# ---- data-parallel streamed stages: the replicas' gloo all-reduce of the host gradients (issue 42) -------------


def _reduce_chain(a, b):
    """Event by event, what the runtime does (comm.GradReducer fed by WeightStream.on_grad, whose ``_sink`` of layer
    q reports layer q+1's added gradients): bucket q (layer q's ``a[q]`` s all-reduce) starts when the last
    microbatch's backward (layers last first, ``b[q]`` s each) has left layer q-1, bucket 0 when it ends, each after
    the bucket before it on the group; returns how long the chain outlasts that backward."""
    clock, ready = 0.0, {}
    for q in reversed(range(len(a))):
        clock += b[q]
        if q + 1 < len(a):
            ready[q + 1] = clock
    ready[0], end = clock, 0.0
    for q in reversed(range(len(a))):
        end = max(end, ready[q]) + a[q]
    return max(0.0, end - clock)


def _dp_stage(layers, *, w, replica_bw=1e9, host_reduce_bw=math.inf, host_is_device=False, i=0, j=None, share=1.0):
    ctx = StageContext(
        0,
        1,
        4,
        w,
        stream=True,
        swap=True,
        host_optimizer=True,
        host_device_bw=25e9,
        host_step_bw=1e12,
        host_copy_bw=1e10,
        host_reduce_bw=host_reduce_bw,
        host_is_device=host_is_device,
        host_share=share,
        replica_link=Link("intra-node", replica_bw, 0.0),
    )
    return {k: float(v) for k, v in segment_costs(Segments(layers), i, len(layers) if j is None else j, ctx).items()}


def test_a_replicated_streamed_stage_is_charged_its_host_gradients_all_reduce_as_the_runtime_runs_it():
    # uneven layers (0.1-0.4 GB float32; one without weights), backwards of 5-60 ms: the all-reduce of each layer's
    # float32 sums at the slower of the replicas' link and the host's gloo figure, hidden only behind the rest of the
    # last microbatch's backward
    sizes, backs = [4e8, 1e8, 0, 3e8, 2e8], [0.06, 0.005, 0.01, 0.04, 0.02]
    layers = [
        LayerCost(str(k), 0.01, b, int(n), 0, 0, 0, optimizer_bytes=int(2 * n))
        for k, (n, b) in enumerate(zip(sizes, backs))
    ]
    one = _dp_stage(layers, w=1)
    for w, link, gloo in [(2, 1e9, math.inf), (4, 50e9, 2e9), (2, 1e9, 0.5e9)]:
        st = _dp_stage(layers, w=w, replica_bw=link, host_reduce_bw=gloo)
        a = [2 * (w - 1) / w * n / min(link, gloo) for n in sizes]
        assert st["allreduce_s"] == pytest.approx(sum(a))
        for i in range(len(layers)):  # every segment, as the planner's dynamic program evaluates them
            for j in range(i + 1, len(layers) + 1):
                seg = _dp_stage(layers, w=w, replica_bw=link, host_reduce_bw=gloo, i=i, j=j)
                assert seg["exposed_s"] == pytest.approx(_reduce_chain(a[i:j], backs[i:j]), abs=1e-12), (w, i, j)
        # the training thread waits for it at the step: the batch's; each layer's sums flattened for it: one more host
        # copy (the host's sums, hidden here behind the device) and host memory until the step
        assert st["batch_s"] == pytest.approx(one["batch_s"] + st["exposed_s"])
        assert st["host_sum_s"] == pytest.approx(one["host_sum_s"] + sum(sizes) / 1e10)
        assert st["host_bytes"] == pytest.approx(one["host_bytes"] + sum(sizes))
        assert st["buffers"] == one["buffers"] and st["optimizer"] == 0  # nothing flattened on the device
    # a node's ranks beyond its cores take turns on the host's part of it too (gloo's copies and sums)
    slow = _dp_stage(layers, w=2, replica_bw=50e9, host_reduce_bw=2e9, share=2.0)
    assert slow["allreduce_s"] == pytest.approx(
        2 * _dp_stage(layers, w=2, replica_bw=50e9, host_reduce_bw=2e9)["allreduce_s"]
    )
    # on a CPU the host is the device: the whole all-reduce adds
    cpu = _dp_stage(layers, w=2, host_is_device=True)
    assert cpu["exposed_s"] == pytest.approx(cpu["allreduce_s"]) and cpu["allreduce_s"] > 0


def _cpu_stage(*, w, free, host_is_device=True, schedule="2bw"):
    """An unstreamed stage of 4 layers (10 MB of float32 weights each, F 10 ms, B 30 ms, AdamW step 5 ms) on w
    replicas over a 1.5 GB/s link, this host's gloo all-reduce 0.5 GB/s and host copies 5 GB/s."""
    layer = LayerCost("block", 0.01, 0.03, int(1e7), 0, 0, 0, optimizer_bytes=int(2e7), step_s=0.005)
    ctx = StageContext(0, 2, 4, w, schedule=schedule, replica_link=Link("gloo", 1.5e9, 0.0), host_reduce_bw=0.5e9)
    ctx = dataclasses.replace(ctx, host_copy_bw=5e9, host_is_device=host_is_device, host_free_cores=free)
    return {k: float(v) for k, v in segment_costs(Segments([layer] * 4), 0, 4, ctx).items()}


def test_a_cpu_stage_s_replicas_all_reduce_adds_where_no_core_is_free():
    # the bug (issue 42: bench_stream --data-parallel 2 on 2 cores, the plain stage's predicted samples/s 1.7x the
    # measured): the model hid a CPU stage's gloo all-reduce behind the batch's last backward, at the topology's link;
    # its bucket (pipeline.bucket_mb: 25 MiB, the whole stage) starts at the backward's end, gloo's threads take turns
    # with compute on the ranks' cores, at this host's gloo figure; the training thread also copies the weights' bytes
    # three times a batch beside the step (scaled gradients, W(t) into W(t+1)'s replica, the flattened bucket)
    cpu, w1 = _cpu_stage(w=2, free=0.0), _cpu_stage(w=1, free=0.0)
    assert cpu["allreduce_s"] == pytest.approx(4e7 / 0.5e9) and cpu["backward_s"] > cpu["allreduce_s"]
    assert cpu["exposed_s"] == pytest.approx(cpu["allreduce_s"])
    assert cpu["step_s"] == pytest.approx(0.02 + 3 * 4e7 / 5e9) and w1["step_s"] == pytest.approx(0.02 + 2 * 4e7 / 5e9)
    assert cpu["batch_s"] == pytest.approx(4 * 4 * 0.04 + cpu["allreduce_s"] + cpu["step_s"])
    assert _cpu_stage(w=1, free=0.0, schedule="flush")["step_s"] == pytest.approx(0.02 + 4e7 / 5e9)  # W(t) is W(t+1)'s
    # a core free of compute: hidden behind the last backward as before (not measured: this CPU has no core to spare);
    # a GPU's: the link's, hidden, no copies charged
    assert _cpu_stage(w=2, free=1.0)["exposed_s"] == 0.0
    gpu = _cpu_stage(w=2, free=0.0, host_is_device=False)
    assert gpu["allreduce_s"] == pytest.approx(4e7 / 1.5e9) and gpu["exposed_s"] == 0.0
    assert gpu["step_s"] == pytest.approx(0.02)
    # the planner takes a CPU topology's cores (topology.cores) for the rule; a GPU plan's host has no figure unless it
    # may stream (partitioner.host)
    cfg = llama13b(partition=dict(stream=False))
    assert make_request(cfg, topology=dataclasses.replace(cfg.topology, device="cpu", cores=2)).host.cores == 2
    assert make_request(cfg).host.cores == 0


def test_replicas_sharing_a_node_share_its_host_memory(fixed_host):
    # 8 devices on one node: 4 stages x 2 replicas, every stage streamed, keep 675 GiB on the node's host (each
    # replica its versions, float32 sums, flattened sums and AdamW state): a plan with 2 TiB of host memory, none with
    # the preset's 512 GiB (where 8 x 1 holds 289 GiB)
    def replicated(host_gib):
        topo = dict(devices_per_node=8, host_memory_gib=host_gib)
        cfg = llama13b(optim=dict(name="adamw", delay_correction="none"), topology=topo)
        plans = plan_config(cfg, search_tensor=False, runners_up=8)
        return [p for p in plans if p.stream_stages and p.data_parallel > 1]

    big = replicated(2048)
    assert big and all(sum(p.predicted_host_bytes) * p.data_parallel > 512 * GIB for p in big)
    assert all(p.predicted_exposed_s[0] > 0 for p in big)  # its gloo all-reduce, charged
    assert not replicated(512)


TINY_PLAN = [
    "model=gpt", "model.num_layers=3", "model.d_model=32", "model.num_heads=2", "model.seq_len=16",
    "train.global_batch_size=8", "optim.name=adamw", "optim.delay_correction=none", "train.num_steps=3",
    "train.warmup_steps=1", "train.log_every=100", "wandb.mode=disabled",
]  # fmt: skip
# two small "GPUs" (0.6 MiB each: the 6-layer GPT's weights, gradients and AdamW state need more) and one stage
TINY_MACHINE = [
    "topology=commodity", "topology.devices_per_node=2", "topology.runtime_overhead_gib=0",
    "topology.memory_per_device_gib=0.0006", "topology.host_memory_gib=4", "partition.depths=[1]",
]  # fmt: skip


@pytest.mark.slow  # two 2-rank trainings (about 20 s on the loaded 2-core machine)
def test_the_planner_s_data_parallel_streamed_plan_trains_as_the_unstreamed_run_bit_for_bit(fixed_host, tmp_path):
    from dist_helper import run_ok

    from partitioner.__main__ import compose
    from partitioner.planner import save_plan

    with pytest.raises(ConfigError, match="no plan fits"):  # without streaming: nothing fits
        plan_config(compose([*TINY_PLAN, *TINY_MACHINE, "partition.stream=false"]))
    best = plan_config(compose([*TINY_PLAN, *TINY_MACHINE]))[0]
    assert (best.num_stages, best.data_parallel, best.stream_stages) == (1, 2, [0])
    assert best.predicted_allreduce_s[0] > 0  # the replicas' host all-reduce, charged
    save_plan(best, tmp_path / "streamed.yaml")  # and the same split with the weights on the devices
    save_plan(dataclasses.replace(best, stream_stages=[], swap_stages=[]), tmp_path / "resident.yaml")
    runs = {}
    for name in ("streamed", "resident"):  # the planner's run line: partition=file with its plan
        cfg = compose([*TINY_PLAN, "partition=file", f"partition.path={tmp_path / name}.yaml"])
        cfg.pipeline.num_stages, cfg.pipeline.data_parallel = 1, 2  # run_ok's ranks: torchrun's --nproc-per-node 2
        summary = run_ok(cfg, tmp_path / name)
        runs[name] = summary, torch.load(tmp_path / name / "final_model.pt")
    (streamed, weights), (resident, base) = runs["streamed"], runs["resident"]
    assert streamed["losses"] == resident["losses"] and weights.keys() == base.keys()
    assert all(torch.equal(weights[k], base[k]) for k in weights)
    for r in streamed["ranks"]:  # both replicas streamed, each layer's sums all-reduced every step
        assert r["stream"]["loads"] > 0 and r["allreduce_calls"] == 3 * r["stream"]["layers"], r
    assert all(r["stream"] is None for r in resident["ranks"])


def test_a_measured_profile_of_compute_dtype_weights_saves_no_autocast_casts_of_them():
    # issue 42: the measured layer profile ran float32 weights under autocast whatever train.weight_dtype said, so it
    # counted (and timed) the bf16 copies of the matmul weights that autocast saves for backward; with the weights
    # stored in bf16 (train.weight_dtype=compute) there are none. The parameters' and the optimizer's bytes stay
    # float32's (the runtime steps float32 masters).
    from partitioner.profile import profile_layer
    from pipedream2bw.config import GPTConfig, OptimConfig
    from pipedream2bw.models import build_gpt_layers

    cfg, optim = GPTConfig(num_layers=1, d_model=64, num_heads=2, seq_len=16), OptimConfig(name="adamw")
    cpu = torch.device("cpu")

    def profile(weight_dtype):
        block = build_gpt_layers(cfg, seed=0, indices=[1])[0]
        return profile_layer(block, cfg, optim, "block", 2, device=cpu, precision="bf16", weight_dtype=weight_dtype)

    fp32, compute = profile("fp32"), profile("compute")
    block = build_gpt_layers(cfg, seed=0, indices=[1])[0]
    matmul = sum(p.numel() for n, p in block.named_parameters() if p.dim() == 2)  # qkv, proj, fc, fc_proj
    assert compute.saved_bytes <= fp32.saved_bytes - 2 * matmul, (fp32.saved_bytes, compute.saved_bytes, matmul)
    assert compute.param_bytes == fp32.param_bytes == 4 * sum(p.numel() for p in block.parameters())
    assert compute.optimizer_bytes == fp32.optimizer_bytes > 0


@pytest.mark.slow
@pytest.mark.long  # two spawned gloo ranks, twice (about 30 s on the loaded 2-core machine)
def test_bench_stream_data_parallel_runs_the_replicas_bit_for_bit(tmp_path):
    # scripts/bench_stream.py --data-parallel 2: each replica on microbatches of its own, the streamed run's host sums
    # all-reduced a layer at a time as the trainer does; it exits non-zero unless streamed == plain, bit for bit
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "dp2.json"
    cmd = [sys.executable, str(root / "scripts" / "bench_stream.py"), "--device", "cpu", "--data-parallel", "2"]
    cmd += ["--layers", "2", "--d-model", "32", "--num-heads", "2", "--batches", "3", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["bit_for_bit"] and report["data_parallel"] == 2 and report["bytes_to_host"] > 0
    for run in ("plain", "streamed"):  # the step's all-reduce wait: summed over every batch, and per timed batch (2)
        assert 0 <= 2 * report[f"{run}_allreduce_wait_per_batch_s"] <= report[f"{run}_allreduce_wait_s"]
