"""Every feature with every other (docs/design.md section 9): covering arrays of runs against the reference.

CI runs the pairwise array; ``pytest -m matrix_full`` the 3-wise one. Cells with the same number of
ranks share one spawn (matrix.MatrixRunner); each cell is one test, named by its features.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Tuple

import pytest
import torch
from matrix import (
    CLIP,
    EVAL_EVERY,
    EXTRA,
    LAYER_PRESETS,
    NUM_STEPS,
    PRESETS,
    REFUSED,
    RESUME_STEP,
    SKIP_BATCH,
    Cell,
    MatrixRunner,
    cell_config,
    covering_array,
    error_line,
    feasible,
    poisoned_layers,
    refusal,
    tolerance,
    uncovered,
)
from reference import Reference, reference_eval, reference_newest, reference_run

from pipedream2bw.config import ConfigError, validate
from pipedream2bw.pipeline.schedule import in_flight
from pipedream2bw.run.model import RunModel
from pipedream2bw.run.start import check_weight_stream

PAIRWISE = covering_array(2)


@functools.lru_cache(maxsize=None)
def three_wise() -> Tuple[Cell, ...]:
    """The 3-wise array: made when a test asks for it (about 10 s of CPU), not in every collection."""
    return tuple(covering_array(3))


def pytest_generate_tests(metafunc):
    """test_three_wise's cells, where the session's mark expression can select it (``-m matrix_full``); elsewhere
    none (deselected anyway), so that collecting the default suite does not build the 3-wise array."""
    if metafunc.definition.name == "test_three_wise":
        cells = three_wise() if _selects(metafunc.config, {m.name for m in metafunc.definition.iter_markers()}) else ()
        metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


def _selects(config, markers) -> bool:
    """Whether ``-m``'s expression selects a test with ``markers``; True where that cannot be told."""
    expr = config.getoption("markexpr")
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression

        return bool(Expression.compile(expr).evaluate(lambda name, **_: name in markers))
    except Exception:  # noqa: BLE001 -- pytest's parser moved or changed: build the array
        return True


@pytest.fixture(scope="session")
def matrix(request, tmp_path_factory):
    """The runner of every matrix cell this session selected (so that cells with as many ranks share a spawn)."""
    selected = [
        item.callspec.params["cell"]
        for item in request.session.items
        if hasattr(item, "callspec") and isinstance(item.callspec.params.get("cell"), Cell)
    ]
    runner = MatrixRunner(tmp_path_factory.mktemp("matrix"), list(dict.fromkeys(selected)))
    start = time.monotonic()
    yield runner
    failed = [cid for cid, r in runner.results.items() if r.error is not None]
    print(
        f"\nmatrix: {len(runner.results)} cells in {time.monotonic() - start:.1f} s "
        f"(spawned groups by world size: { {k: round(v, 1) for k, v in sorted(runner.group_s.items())} }); "
        f"failed: {failed or 'none'}"
    )
    for cid in failed:
        print(f"  {cid}: {error_line(runner.results[cid].error)}")


@functools.lru_cache(maxsize=None)
def reference(cell: Cell, *, delayed: bool, skip: bool, clip: bool, corrected: bool = True) -> Reference:
    """The single-process run of ``cell``'s model, data and step rules on (1, 1), rounding where the
    cell's first layout sends (and, resumed, from RESUME_STEP on where its second one does), its microbatch
    gradients summed as the replicas of that layout sum them. ``corrected`` False: no delay correction."""
    cfg = cell_config(cell, layout=(1, 1))
    if not clip:
        cfg.optim.clip_grad_norm = None
    if not corrected:
        cfg.optim.delay_correction = "none"
    balances = [cell_config(cell, layout=layout).pipeline.balance for layout in cell.layouts()]
    if cell.newest and delayed:  # pipeline.weight_versions=newest: its own rule, at the cell's layout(s)
        first = cell_config(cell)
        first.optim.delay_correction = cfg.optim.delay_correction
        relayout = (RESUME_STEP, balances[1], cell.layouts()[1][1]) if cell.resume else None
        return reference_newest(first, balance=balances[0], relayout=relayout)
    layers = poisoned_layers(cfg, call=SKIP_BATCH * cfg.pipeline.num_microbatches + 1) if skip else None
    return reference_run(
        cfg,
        delayed=delayed,
        layers=layers,
        balance=balances[0],
        relayout=(RESUME_STEP, balances[1]) if cell.resume else None,
        keep=range(EVAL_EVERY, NUM_STEPS + 1, EVAL_EVERY) if cell.validation else (),
        replicas=[w for _, w in cell.layouts()] * (2 // len(cell.layouts())),
    )


def check_cell(cell: Cell, runs) -> None:
    """The cell's last run against the reference: final weights, every step's loss, learning rate and
    gradient norm (where the run agreed on one), skipped steps, loss scales (fp16), validation losses;
    and that each feature did act (tie across stages, swapped bytes, resume from the checkpoint)."""
    tol = tolerance(cell)
    ref = reference(cell, delayed=cell.schedule == "2bw", skip=cell.skip, clip=cell.clip)
    summary, weights = runs.summaries[-1], runs.weights[-1]
    assert summary["tensor_parallel"] == cell.t and len(summary["ranks"]) == cell.world_size
    assert weights.keys() == ref.weights.keys()
    # final_model.pt holds the float32 masters, also where the versions are stored in the compute dtype
    torch.testing.assert_close(weights, ref.weights, **tol)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref.losses), **tol)
    assert summary["lrs"] == pytest.approx(ref.lrs, rel=1e-12)
    assert summary["skipped_steps"] == ref.skipped_steps == ([SKIP_BATCH] if cell.skip else [])
    agreed = [t for t, n in enumerate(summary["grad_norms"]) if n is not None and t not in ref.skipped_steps]
    if cell.clip or cell.skip or cell.precision == "fp16":  # a step rule that needs the global norm
        assert len(agreed) == NUM_STEPS - len(ref.skipped_steps), summary["grad_norms"]
    torch.testing.assert_close(
        torch.tensor([summary["grad_norms"][t] for t in agreed], dtype=torch.float64),
        torch.tensor([ref.grad_norms[t] for t in agreed], dtype=torch.float64),
        **(tol or dict(rtol=1e-5, atol=1e-6)),
    )
    if cell.clip:
        assert all(n > CLIP for n in ref.grad_norms if math.isfinite(n))  # clipping acted on every step
    if cell.precision == "fp16":
        assert summary["loss_scale"]["per_step"] == ref.loss_scales[summary["first_step"] :]  # this run's steps
    if cell.validation:
        val = summary["val_losses"]
        assert [v["step"] for v in val] == list(ref.snapshots)
        balances = [cell_config(cell, layout=layout).pipeline.balance for layout in cell.layouts()]
        expected = [
            reference_eval(
                cell_config(cell, layout=(1, 1)),
                ref.snapshots[n],
                balance=balances[1] if cell.resume and n > RESUME_STEP else balances[0],
            )
            for n in ref.snapshots
        ]
        torch.testing.assert_close(torch.tensor([v["loss"] for v in val]), torch.tensor(expected), **tol)
    if cell.tied:
        (tie,) = summary["ties"]
        # across the first and last stage; under zbv both on rank 0 (chunks 0 and 2d-1)
        assert tie["stages"] == ([0] if cell.v else sorted({0, summary["num_stages"] - 1}))
    if cell.stream:  # every stage streamed its weights, in validation passes too; the replicas reduced host gradients
        streamed = [r["stream"] for r in summary["ranks"]]
        assert all(st is not None and st["loads"] > 0 and st["grad_bytes_out"] > 0 for st in streamed), streamed
        assert all((st["eval_loads"] > 0) == cell.validation for st in streamed), streamed
        w = summary["data_parallel"]
        assert all((r["allreduce_calls"] > 0) == (w > 1) for r in summary["ranks"]), summary["ranks"]
    if cell.forward_lead:  # stages before the last ran forwards ahead of 1F1B's bound (where m leaves room)
        first = runs.summaries[0]
        d, m = first["num_stages"], cell_config(cell).pipeline.num_microbatches
        held = [(r["stage"], r["peak_in_flight"]) for r in first["ranks"]]
        assert held == [(s, in_flight(cell.schedule, s, d, m, forward_lead=cell.forward_lead)) for s, _ in held]
        assert any(n > in_flight(cell.schedule, s, d, m) for s, n in held), held  # m caps it on the first stages
    if cell.swap:
        swapped = [r["swap"]["swapped_out"] for s in runs.summaries for r in s["ranks"] if r["swap"]]
        assert swapped and max(swapped) > 0
    if cell.resume:
        assert summary["first_step"] == RESUME_STEP and summary["resumed_from"].endswith(f"step_{RESUME_STEP:08d}")
        assert (summary["num_stages"], summary["data_parallel"]) == cell.layouts()[1]
        # ...and the run it resumed from trained the same steps up to the checkpoint
        torch.testing.assert_close(
            torch.tensor(runs.summaries[0]["losses"][:RESUME_STEP]), torch.tensor(ref.losses[:RESUME_STEP]), **tol
        )


def differs(a: dict, b: dict, tol: dict) -> bool:
    """Whether ``a`` and ``b`` are further apart than ``tol`` allows (what check_cell would catch)."""
    try:
        torch.testing.assert_close(a, b, **tol)
    except AssertionError:
        return True
    return False


def check_features_matter(cell: Cell) -> None:
    """The delay, the skip, the clipping, the correction (the prediction), the warm-up and Muon each move the
    reference's weights by more than the tolerance: a run that ignored one would fail ``check_cell``."""
    tol, delayed = tolerance(cell), cell.schedule == "2bw"
    ref = reference(cell, delayed=delayed, skip=cell.skip, clip=cell.clip).weights
    if delayed:
        assert differs(ref, reference(cell, delayed=False, skip=cell.skip, clip=cell.clip).weights, tol)
    if cell.skip:
        assert differs(ref, reference(cell, delayed=delayed, skip=False, clip=cell.clip).weights, tol)
    if cell.clip:
        assert differs(ref, reference(cell, delayed=delayed, skip=cell.skip, clip=False).weights, tol)
    if delayed and (cell.correction != "none" or cell.lookahead or cell.predict):  # the delay correction moves them
        assert differs(ref, reference(cell, delayed=True, skip=cell.skip, clip=cell.clip, corrected=False).weights, tol)
    if cell.sync_warmup:  # and the synchronous warm-up
        other = reference(dataclasses.replace(cell, sync_warmup=False), delayed=True, skip=cell.skip, clip=cell.clip)
        assert differs(ref, other.weights, tol)
    if cell.muon and not cell.lookahead:  # and Muon (a look-ahead cell without it would be refused: LOOKAHEAD)
        other = reference(dataclasses.replace(cell, muon=False), delayed=delayed, skip=cell.skip, clip=cell.clip)
        assert differs(ref, other.weights, tol)


def _run_and_check(cell: Cell, matrix: MatrixRunner) -> None:
    runs = matrix.result(cell)
    if runs.error is not None:
        pytest.fail(f"{cell.id}: {error_line(runs.error)}\n{runs.error}", pytrace=False)
    check_cell(cell, runs)
    check_features_matter(cell)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "cell",
    PAIRWISE,
    ids=[c.id for c in PAIRWISE],
)
def test_pairwise(cell, matrix):
    _run_and_check(cell, matrix)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cell", EXTRA, ids=[c.id for c in EXTRA])
def test_extra_cells(cell, matrix):
    """matrix.EXTRA's cells, in the spawns of the arrays' cells with as many ranks."""
    assert refusal(cell) is None and cell not in PAIRWISE
    _run_and_check(cell, matrix)


@pytest.mark.slow
@pytest.mark.matrix_full
@pytest.mark.timeout(1800)
def test_three_wise(cell, matrix):
    _run_and_check(cell, matrix)


# ---- pure ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("strength", [2, pytest.param(3, marks=pytest.mark.long)])
def test_arrays_cover_every_feasible_combination(strength):
    """Every value combination of any ``strength`` factors that some run can have is in a cell; no cell
    breaks a constraint; the ids are unique; the arrays hold the presets and do not change between calls."""
    cells = PAIRWISE if strength == 2 else list(three_wise())
    assert uncovered(cells, strength) == []
    assert all(feasible(dataclasses.asdict(c)) for c in cells)
    assert len({c.id for c in cells}) == len(cells)
    for preset in PRESETS + [row for rows in LAYER_PRESETS.values() for row in rows]:
        assert any(all(getattr(c, k) == v for k, v in preset.items()) for c in cells), preset
    assert covering_array(strength) == cells


def test_refused_combinations_fail_at_config_time_with_their_reason():
    """Each REFUSED combination, and 2bw with m < d (which the cells avoid by construction: m = 8 / w):
    validate(), which every rank runs before any process group starts, raises a ConfigError naming the
    values (swap.weights with tied weights: when the run starts, from the built model's ties, also before any
    group); the generator leaves refused combinations out of the arrays."""
    cell = next(c for c in PAIRWISE if c.schedule == "2bw" and c.d == 4)
    cfg = cell_config(cell)
    cfg.pipeline.num_microbatches = 2
    cases = [(cell, cfg, r"pipeline.num_microbatches \(2\) must be >= pipeline.num_stages \(4\) for 2bw")]
    for _, applies, pattern, _, example in REFUSED:
        refused = Cell(**{**dataclasses.asdict(PAIRWISE[0]), **example})
        assert applies(dataclasses.asdict(refused)) and not feasible(dataclasses.asdict(refused))
        assert all(refusal(c) is None for c in PAIRWISE)  # and the 3-wise array's: feasible (the coverage test)
        cases.append((refused, cell_config(refused), pattern))
    for c, cfg, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            layers = 5 if c.structured else None  # one node of world_size ranks (t divides the ranks per node)
            validate(cfg, world_size=c.world_size, local_world_size=c.world_size, num_layers=layers)
            if cfg.swap.weights:  # what only the built model shows, before any group too (run/start.py)
                tied = RunModel.of(cfg, None, None).tied
                check_weight_stream(cfg, tied, cfg.pipeline.balance, cfg.train.precision)
