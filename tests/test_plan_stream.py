"""The planner streams weights (swap.weights) where a stage would not fit otherwise (issue 36): planner only, no
training; the bandwidths and compute rates are the presets' assumptions."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from partitioner.auto import apply_choices, apply_plan, make_request, plan_config
from partitioner.cost import LayerCost, Segments, StageContext, StageCost, segment_costs
from partitioner.planner import _streams, stage_contexts, stage_table, table
from partitioner.profile import analytic_gpt
from partitioner.topology import GIB
from pipedream2bw.config import ConfigError, default_plan_choices, validate
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
    return analytic_gpt(cfg.model, cfg.optim, plan.microbatch_size, cfg.topology, precision=plan.precision)


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
    run = llama13b(partition=dict(mode="auto"))
    optim, train = apply_choices(run.optim, run.train, best, precision="bf16")
    pipeline, swap = apply_plan(run.pipeline, run.swap, best, world_size=4, num_layers=43)
    assert (swap.weights, swap.optimizer, swap.stages) == (True, "host", best.stream_stages)
    run = default_plan_choices(dataclasses.replace(run, pipeline=pipeline, swap=swap, optim=optim, train=train))
    assert validate(run, world_size=4) == best.balance
    plain = dataclasses.replace(best, stream_stages=[], swap_stages=[])
    with pytest.raises(ConfigError, match="the plan decides which stages stream"):
        apply_plan(run.pipeline, swap, plain, world_size=4, num_layers=43)


def test_a_stage_streams_only_where_it_would_not_fit_otherwise():
    cfg = llama13b(model=dict(num_layers=8), partition=dict(microbatch_sizes=[2]))
    best = plan_config(cfg)[0]
    assert best.stream_stages and len(best.stream_stages) < best.num_stages, best.stream_stages
    seg = Segments(_layers(cfg, best))
    ctxs = stage_contexts(
        cfg.topology,
        best.rank_map,
        schedule=best.schedule,
        num_microbatches=best.num_microbatches,
        recompute=best.recompute,
        swap=False,
        swap_resident=best.swap_resident,
        runtime_bytes=cfg.topology.runtime_overhead_gib * GIB,
    )
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


@pytest.mark.parametrize("window", [0, 1, 2])
def test_streamed_stall_follows_the_copy_stream(window):
    # uneven layers: copies of 1-4 s against forwards of 1 s, backwards of 2 s (the gradients out add their copy)
    layers = [LayerCost(str(k), 1.0, 2.0, (k + 1) * 10**9, 0, 0, 0, optimizer_bytes=8) for k in range(4)]
    seg, bw = Segments(layers), 1e9
    ctx = StageContext(0, 1, 1, 1, stream=True, stream_window=window, host_device_bw=bw)
    got = segment_costs(seg, 0, 4, ctx)
    t = [c.param_bytes / bw for c in layers]
    fwd = _copy_stream(t, [c.forward_s for c in layers], window=window)
    bwd_compute = [c.backward_s + tk for c, tk in zip(layers, t)][::-1]  # gradients leave on the compute stream
    bwd = _copy_stream(t[::-1], bwd_compute, window=window) + sum(t)
    if window <= 1:  # exact: the copy in flight overlaps the layer computing
        assert float(got["stream_fwd_s"]) == pytest.approx(fwd) and float(got["stream_s"]) == pytest.approx(fwd + bwd)
    else:  # a longer window smooths uneven layers: the model is an upper bound
        assert float(got["stream_s"]) >= fwd + bwd - 1e-9
    assert float(got["stall_s"]) == float(got["stream_s"])  # no activation swapping: one microbatch
    assert float(got["weights"]) + float(got["gradients"]) == device_bytes_model(
        [c.param_bytes for c in layers], window=window
    )
    assert float(got["host_bytes"]) == 2 * 10 * 10**9 + 10 * 10**9 + 4 * 8  # two versions, gradients, state


@pytest.mark.parametrize(
    "change",
    [
        dict(train=dict(precision="fp16")),
        dict(optim=dict(clip_grad_norm=1.0)),
        dict(train=dict(on_nonfinite="skip")),
        dict(train=dict(eval_every=10)),
        dict(model=dict(tie_embeddings=True)),
        dict(train=dict(weight_dtype="compute")),
        dict(partition=dict(stream=False)),
        dict(topology=dict(device="cpu"), partition=dict(costs="analytic")),
    ],
    ids=lambda change: ",".join(f"{k}.{kk}" for k, v in change.items() for kk in v),
)
def test_the_planner_never_streams_what_the_runtime_refuses(change):
    assert _streams(make_request(llama13b()), 1) and not _streams(make_request(llama13b()), 2)  # w > 1: refused
    assert not _streams(make_request(llama13b(**change)), 1)
