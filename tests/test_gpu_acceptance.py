"""scripts/gpu_acceptance.py without a GPU: its dry run, and its verdicts on results written by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from pipedream2bw.memory.precision import param_memory

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "scripts" / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_every_check_and_finds_their_options(tmp_path, capsys):
    ga = _script()
    assert ga.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| pass |") == len(ga.checks(tmp_path)) == 5


def test_verdicts_follow_the_targets(tmp_path):
    ga = _script()
    precision = {"gpu": True, "ratio": 0.96, "rows": {}}
    precision["rows"] = {k: {"samples_per_s": 10.0, "peak_memory_bytes": 2**30} for k in ("ours", "plain-autocast")}
    (tmp_path / "p.json").write_text(json.dumps(precision))
    assert ga._bench_precision(tmp_path / "p.json")[1]
    (tmp_path / "p.json").write_text(json.dumps({**precision, "ratio": 0.94}))
    assert not ga._bench_precision(tmp_path / "p.json")[1]
    rows = [
        {"schedule": "2bw", "precision": "bf16", "weight_dtype": wd, "params": 1000, "peak_bytes": 1000 * total}
        for wd, total in (("fp32", 21.0), ("compute", 20.0))
    ]
    (tmp_path / "m.json").write_text(json.dumps({"memory_kind": "CUDA max allocated", "rows": rows}))
    assert param_memory("bf16", schedule="2bw", optimizer="adamw", weight_dtype_name="compute").total == 20
    assert ga._bench_memory(tmp_path / "m.json")[1]
    rows[1]["peak_bytes"] = 1000 * 30.0  # 50% over param_memory's 20 B
    (tmp_path / "m.json").write_text(json.dumps({"memory_kind": "CUDA max allocated", "rows": rows}))
    assert not ga._bench_memory(tmp_path / "m.json")[1]
    (tmp_path / "t.txt").write_text("3 passed, 1 skipped in 2.0s\n")  # a skipped gpu test is not a pass
    assert not ga._pytest_gpu(tmp_path / "t.txt")[1]
    one_gpu = f"SKIPPED [1] tests/test_semantics.py:115: {ga.ONE_GPU_SKIP}\n"
    (tmp_path / "t.txt").write_text(one_gpu + "3 passed, 1 skipped in 2.0s\n")  # NCCL: one GPU per rank
    assert ga._pytest_gpu(tmp_path / "t.txt")[1]
    (tmp_path / "t.txt").write_text(one_gpu + "3 passed, 2 skipped in 2.0s\n")  # and one skipped for another reason
    assert not ga._pytest_gpu(tmp_path / "t.txt")[1]
    stream = {"device": "cuda", "layers": 8, "layer_bytes": 2**20, "window": 1, "model_streamed_bytes": 2**21}
    stream |= {"stall_s": 0.1, "streamed_samples_per_s": 1.0, "plain_samples_per_s": 2.0, "bit_for_bit": True}
    stream |= {"plain_peak_device_bytes": 2**24, "streamed_peak_device_bytes": 2**22, "reduction": 4.0}
    (tmp_path / "s.json").write_text(json.dumps(stream))
    assert ga._bench_stream(tmp_path / "s.json")[1]
    (tmp_path / "s.json").write_text(json.dumps({**stream, "bit_for_bit": False}))
    assert not ga._bench_stream(tmp_path / "s.json")[1]
    (tmp_path / "s.json").write_text(json.dumps({**stream, "streamed_samples_per_s": 0.9}))  # 0.45x resident
    assert not ga._bench_stream(tmp_path / "s.json")[1]
