"""scripts/bench.py end to end on a small GPT: its JSON, its target checks and the 2bw memory contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.long
def test_bench_finds_2bw_holds_one_more_weight_copy_than_flush_and_nothing_else(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench.py"),
        "--systems",
        "ours-2bw,ours-flush,torch-1f1b,torch-zbv",  # zbv: two stages per rank, V-shaped
        "--num-layers",
        "2",
        "--d-model",
        "64",
        "--seq-len",
        "32",
        "--num-microbatches",
        "4",
        "--microbatch-size",
        "2",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--memory-steps",
        "3",
        "--device",
        "cpu",
        "--strict",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"ours-2bw", "ours-flush", "torch-1f1b", "torch-zbv"}
    assert all(r["samples_per_s"] > 0 and len(r["peak_rss_per_stage"]) == 2 for r in rows.values())
    assert "ours-2bw / the strongest torch schedule here (torch-" in proc.stdout
    # Where our ranks' time goes: every part of the traced steps named, summing to the step time.
    for rank in rows["ours-2bw"]["breakdown_per_rank"]:
        assert rank["compute"] > 0 and all(v >= 0 for v in rank.values())
    assert len(rows["ours-2bw"]["breakdown_per_rank"]) == 2 and "where each rank's time goes" in proc.stdout

    two, flush = rows["ours-2bw"], rows["ours-flush"]
    weights = two["stage_weight_bytes"]
    assert len(weights) == 2 and all(w > 0 for w in weights)
    for a, b, w in zip(two["peak_tensor_bytes_per_stage"], flush["peak_tensor_bytes_per_stage"], weights):
        assert 0 < a - b <= w, f"2bw peak {a} vs flush peak {b}: the difference should be at most one weight copy ({w})"

    # Only the memory target is set for any configuration; the throughput ones are for the default GPT.
    applying = [c for c in data["targets"] if c["applies"]]
    assert len(applying) == 2 and all(c["met"] and c["target"].startswith("stage ") for c in applying)
    assert "targets:" in proc.stdout and "would be" in proc.stdout


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_bench_system_names_its_optimizer_and_a_correction_only_where_there_is_a_delay():
    bench = _script("bench")
    assert bench.parse_system("ours-2bw") == ("ours-2bw", "adamw", "none")
    assert bench.parse_system("ours-2bw@muon+error_feedback") == ("ours-2bw", "muon", "error_feedback")
    assert bench.parse_system("torch-zbv@muon") == ("torch-zbv", "muon", "none")
    assert bench.parse_system("ours-2bw@muon+predict_error_feedback")[2] == "predict_error_feedback"
    for bad, why in [
        ("torch-zbv@adamw+lookahead", "ours-2bw only"),
        ("ours-2bw@sgd", "unknown optimizer"),
        ("ours-2bw@adamw+ema", "unknown delay correction"),
        ("theirs-2bw", "unknown system"),
    ]:
        with pytest.raises(ValueError, match=why):
            bench.parse_system(bad)
    assert bench.forward_lead("ours-2bw@muon+error_feedback:lead=1") == ("ours-2bw@muon+error_feedback", 1)
    assert bench.parse_system("ours-flush:lead=2") == ("ours-flush", "adamw", "none")
    assert bench.forward_lead("ours-2bw") == ("ours-2bw", 0)
    for bad in ("torch-1f1b:lead=1", "ours-2bw:lead=x"):
        with pytest.raises(ValueError, match="a forward lead is a count"):
            bench.parse_system(bad)
    assert bench.weight_versions("ours-2bw@muon+predict:newest:lead=1") == ("ours-2bw@muon+predict:lead=1", "newest")
    assert bench.weight_versions("ours-2bw@muon:lead=1") == ("ours-2bw@muon:lead=1", "batch")
    assert bench.parse_system("ours-2bw@muon+predict:newest") == ("ours-2bw", "muon", "predict")
    with pytest.raises(ValueError, match="a rule of ours-2bw"):
        bench.parse_system("ours-flush@muon:newest")


def test_the_throughput_guard_reads_a_small_and_a_large_microbatch_from_the_doc_and_names_what_regressed():
    """bench.py --check's figures (issue 47): the shapes recorded in docs/benchmarks.md, and which fell by more than
    the tolerance. The timed runs themselves are no test (noisy machines); this is what they are compared with."""
    check = _script("bench_check")
    shapes = check.recorded(check.DOC.read_text())
    names = [s.name for s in shapes]
    assert names == ["small microbatch", "large microbatch"]
    for shape in shapes:
        assert "--microbatch-size" in shape.argv and 0 < shape.efficiency <= 1, shape
    lines = check.verdicts(
        shapes, {"small microbatch": shapes[0].efficiency - 0.06, "large microbatch": 1.0}, tolerance=0.05
    )
    assert lines[0].lstrip().startswith("REGRESSED") and "small microbatch" in lines[0]
    assert lines[1].lstrip().startswith("ok")
    with pytest.raises(ValueError, match="no throughput guard table"):
        check.recorded("# Benchmarks\n")


@pytest.mark.slow
@pytest.mark.long
def test_bench_convergence_times_each_setting_to_the_flush_loss_against_torch(tmp_path):
    """A few steps of the grid, then --time-to-loss: every setting that reached the loss is timed at 2 ranks beside
    torch's strongest schedules, and the ratio printed is the table's."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_convergence.py"), "--steps=12", "--seeds=0", "--lrs=3e-3"]
    cmd += ["--optimizers=adamw", "--corrections=none", "--eval-every=3", "--num-layers=1", "--d-model=32"]
    cmd += ["--seq-len=32", "--time-to-loss", "--target-loss=4.5", "--bench-repeats=1", "--no-plot"]
    cmd += [f"--out={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    ttl = result["time_to_loss"]
    runs = {r["schedule"]: r for r in result["runs"]}
    assert ttl["target"] == 4.5 and ttl["ours"] == "ours-2bw@adamw+none" and ttl["theirs"].endswith("@adamw")
    ours, theirs = ttl["systems"][ttl["ours"]], ttl["systems"][ttl["theirs"]]
    for system, schedule in [(ours, "2bw"), (theirs, "flush")]:  # the first evaluation at or below the target
        assert system["steps"] == next(c["step"] for c in runs[schedule]["val_losses"] if c["loss"] <= 4.5)
    assert ttl["ratio"] == pytest.approx(ours["time_s"] / theirs["time_s"])
    assert f"{ttl['ratio']:.2f}x the time to" in proc.stdout


def test_bench_convergence_report_only_without_runs_says_so(tmp_path):
    # issue 43: --report-only before any run ended in a raw FileNotFoundError (writing results.json)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_convergence.py"), "--report-only", f"--out={tmp_path / 'x'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("run without --report-only first (or name their --out)"), proc.stderr


def test_the_size_limits_are_checked(tmp_path):
    # issue 43: docs/develop.md states modules under 800 lines and functions under 80; CI checked neither
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_sizes.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_sizes
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    (tmp_path / "pipedream2bw").mkdir()
    (tmp_path / "partitioner").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(85))
    (tmp_path / "pipedream2bw" / "big.py").write_text(f"def long():\n{body}" + "\n" * 720)
    assert check_sizes.oversized(tmp_path) == [
        "pipedream2bw/big.py: 806 lines (limit: under 800)",
        "pipedream2bw/big.py::long: 86 lines (limit: under 80)",
    ]


def test_a_failed_bench_system_shows_the_ranks_error_not_torchruns():
    # issue 43: bench.py's dualpipev column read "n/a (ChildFailedError:)"
    bench = _script("bench")
    output = (
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]: ValueError: ScheduleDualPipeV requires n_microbatches (4) >= 2 * num_stages (8)\n"
        "E1126 failed (exitcode: 1) local_rank: 0\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\n"
    )
    reason = bench.SystemFailed("torch-dualpipev", output).reason
    assert reason == "[rank0]: ValueError: ScheduleDualPipeV requires n_microbatches (4) >= 2 * num_stages (8)"


def test_benchmarks_print_their_defaults_in_help():
    # issue 43: a benchmark's --help did not say what a run without options measures
    for name, shown in [("bench.py", "(one process each) (default: 2)"), ("bench_convergence.py", "(default: 300)")]:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), "--help"], capture_output=True, text=True)
        text = " ".join(proc.stdout.split())  # argparse wraps the lines
        assert proc.returncode == 0 and shown in text, (name, proc.stdout)
        assert text.count("default:") == len(re.findall(r"\(default: [^)]*\)", text)), proc.stdout


def test_cpu_per_step_counts_the_steps_after_the_warmup_as_throughput_times_them():
    from pipedream2bw.run.results import cpu_per_step

    # CPU 1 s at the start, steps ending at 3, 4 and 7 s; warm-up 1 leaves steps 2 and 3: (7 - 3) / 2
    assert cpu_per_step(1.0, [3.0, 4.0, 7.0], warmup_steps=1) == 2.0
    assert cpu_per_step(1.0, [3.0, 4.0, 7.0], warmup_steps=0) == 2.0
    assert cpu_per_step(1.0, [3.0], warmup_steps=1) is None  # no step after the warm-up


def test_bench_convergence_momentum_option_sets_the_optimizer_it_names():
    """+momX (issue 46, momentum under the delay) reaches the built optimizer: Muon's momentum for its matrices
    (the others' AdamW keeps torch's betas), AdamW's beta1; flush takes it too (--flush-corrections none+mom0.9)."""
    import argparse

    import torch

    from pipedream2bw.config.optimizers import build_optimizer, tag_muon_params
    from pipedream2bw.models.gpt import build_gpt_layers

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_convergence
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    args = argparse.Namespace(
        num_microbatches=4, microbatch_size=8, num_layers=1, d_model=32, num_heads=4, seq_len=16, warmup=0,
        data_path=None, val_fraction=0.1, steps=10, eval_every=5, eval_batches=1, scheduler="constant", min_lr=0.0,
    )  # fmt: skip

    def groups(schedule, optimizer, correction):
        cfg = bench_convergence.run_config(
            args, schedule=schedule, optimizer=optimizer, correction=correction, lr=3e-3, seed=0
        )
        model = torch.nn.Sequential(*build_gpt_layers(cfg.model, seed=0))
        tag_muon_params(model, cfg.optim.muon_exclude, edge_layers=("0", str(len(model) - 1)))
        return build_optimizer(list(model.parameters()), cfg.optim, others=torch.optim.AdamW).param_groups

    muon = groups("2bw", "muon", "error_feedback+beta1.5+mom0.8")
    assert sorted(g.get("momentum") for g in muon if "momentum" in g) == [0.8]
    assert [g["betas"] for g in muon if "betas" in g] == [(0.9, 0.999)]
    assert [g["momentum"] for g in groups("2bw", "muon", "error_feedback") if "momentum" in g] == [0.95]
    assert [g["betas"] for g in groups("flush", "adamw", "none+mom0.7")] == [(0.7, 0.999)]
    with pytest.raises(ValueError, match=r"\+momX"):
        groups("2bw", "muon", "error_feedback+bogus0.9")
    with pytest.raises(ValueError, match="not defined for optimizer 'sgd'"):
        groups("2bw", "sgd", "none+mom0.9")


def test_bench_convergence_scheduler_options_set_the_learning_rate_schedule_of_every_run():
    """--scheduler/--warmup/--min-lr (issue 46, the gap under a decaying learning rate) reach flush's and 2bw's
    config alike: the lr warms up, peaks at --lrs and decays to --min-lr at the last step; constant by default."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_convergence
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from pipedream2bw.run.lr_schedule import lr_at

    seen = {}

    def capture(args, out):  # main() parses, then reports: keep the parsed options instead
        seen["args"] = args

    argv = ["--report-only", "--steps", "100", "--scheduler", "cosine", "--warmup", "10", "--min-lr", "3e-4"]
    with (
        mock.patch.object(bench_convergence, "report", capture),
        mock.patch.object(bench_convergence, "_summary", lambda out, spec: {}),
    ):
        bench_convergence.main(argv)
    args = seen["args"]
    for schedule, correction in (("flush", "none"), ("2bw", "error_feedback")):
        cfg = bench_convergence.run_config(
            args, schedule=schedule, optimizer="muon", correction=correction, lr=3e-3, seed=0
        )
        assert (cfg.optim.scheduler, cfg.optim.warmup_steps, cfg.optim.min_lr) == ("cosine", 10, 3e-4)
        lrs = [lr_at(t, cfg.optim, num_steps=cfg.train.num_steps) for t in (0, 9, 10, 99)]
        assert lrs == pytest.approx([3e-4, 3e-3, 3e-3, 3e-4])
    with (
        mock.patch.object(bench_convergence, "report", capture),
        mock.patch.object(bench_convergence, "_summary", lambda out, spec: {}),
    ):
        bench_convergence.main(["--report-only"])
    cfg = bench_convergence.run_config(
        seen["args"], schedule="2bw", optimizer="muon", correction="none", lr=3e-3, seed=0
    )
    assert (cfg.optim.scheduler, cfg.optim.warmup_steps, cfg.optim.min_lr) == ("constant", 0, 0.0)


def test_screen_newest_counts_steps_to_flushs_loss_on_the_rules_curves(tmp_path, capsys):
    """scripts/screen_newest.py validates the rule every --eval-every steps (reference_newest's on_step) and counts a
    horizon's steps to flush's loss at --target-step against those curves, and flush's own first step at it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import screen_newest
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    out = tmp_path / "curves.json"
    args = ["--steps=4", "--eval-every=2", "--target-step=4", "--seeds=0", "--horizons=1,2", "--num-layers=1"]
    screen_newest.main([*args, "--d-model=32", "--seq-len=16", f"--out={out}"])
    curves = json.loads(out.read_text())
    assert set(curves) == {"flush", "h=1", "h=2"} and set(curves["h=2"]["0"]) == {"2", "4"}
    flush, h2 = curves["flush"]["0"], curves["h=2"]["0"]
    assert flush != curves["h=1"]["0"] != h2  # the rule and its horizon change the curve
    reached = next((s for s in ("2", "4") if h2[s] <= flush["4"]), None)
    shown = f"h=2     {'>4' if reached is None else reached}"
    printed = capsys.readouterr().out
    assert shown in printed
    first = next(s for s in ("2", "4") if flush[s] <= flush["4"])  # flush's own first step at its loss at 4
    assert f"  flush   {first}  (seeds [0])" in printed
