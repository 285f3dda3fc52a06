"""The package's old module paths (before its folders were its layers), importable for one more release with a
DeprecationWarning naming the new one: ``from pipedream2bw.runner import run`` broke without a word (issue 43)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    **{m: f"pipeline.{m}" for m in ("agreement", "boundary", "comm", "layout", "schedule", "ties", "versions")},
    **{m: f"run.{m}" for m in ("evaluate", "lr_schedule", "preempt", "results", "runner", "runtime", "stage")},
    **{m: f"io.{m}" for m in ("fileio", "timeline", "tracking")},
    **{m: f"memory.{m}" for m in ("host_optim", "loss_scale", "memprobe", "precision", "sharding", "swap")},
    "hf_io": "models.hf_io",
    "config_docs": "config.docs",
}
"""Old module (under pipedream2bw.) -> where it lives now. pipedream2bw.config and .data are packages now, with
the same names; pipedream2bw.launch is the launcher now (its old functions: pipedream2bw.run.launch)."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``pipedream2bw.<old>`` as the module it moved to, warning once per old path."""

    def find_spec(self, fullname, path, target=None):
        package, _, name = fullname.partition(".")
        if package == "pipedream2bw" and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = f"pipedream2bw.{MOVED[spec.name.split('.', 1)[1]]}"
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there (the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the module it moved to is already executed


def install() -> None:
    """Puts the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
