"""fileio: a write that fails leaves the old file as it was; and the modules that write stay below the stage worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipedream2bw.io import fileio

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), SystemExit("bad token id")])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, error):
    # prepare_tokens streams into atomic_open and may sys.exit mid-file: SystemExit must clean up too.
    path = tmp_path / "summary.json"
    fileio.atomic_write_json(path, {"step": 1})
    with pytest.raises(type(error)):
        with fileio.atomic_open(path) as f:
            f.write(b'{"step": 2, "trunc')
            raise error
    assert path.read_text() == '{\n  "step": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    fileio.atomic_write_text(path, "done")
    assert path.read_text() == "done" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()  # as open() makes it, not mkstemp's 0600


def test_writers_do_not_import_the_stage_worker():
    # results imported stage for a type hint, which put checkpoint (and the partitioner's writers) above the worker.
    code = (
        "import sys; import pipedream2bw.io.fileio; assert 'torch' not in sys.modules, 'fileio imports torch'; "
        "import pipedream2bw.io.checkpoint, pipedream2bw.run.results, partitioner.topology, partitioner.planner; "
        "bad = sorted(m for m in ('pipedream2bw.run.stage', 'pipedream2bw.pipeline.comm') "
        "if m in sys.modules); assert not bad, bad"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
