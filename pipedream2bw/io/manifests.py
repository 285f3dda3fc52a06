"""Finding checkpoints, and the settings a resume takes from them, by their manifests alone: torch-free, so that
the launcher can check ``train.resume`` before any rank starts in the time a config check takes (io/checkpoint.py,
which imports torch, reads and verifies the checkpoints themselves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pipedream2bw.config.newest import follow_checkpoint

DIRNAME = "checkpoints"
MANIFEST = "manifest.json"


def complete_checkpoints(root: Path) -> List[Path]:
    """Checkpoint directories with a manifest, newest first (not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit() and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def read_manifest(path: Path) -> Optional[Dict[str, Any]]:
    """The manifest of the checkpoint at ``path``, or None where it is missing or not a JSON object."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def checkpoints_root(path: Path) -> Path:
    """A checkpoints directory, given it or the run directory that holds one."""
    return path / DIRNAME if (path / DIRNAME).is_dir() else path


def candidates(root: Path) -> List[Path]:
    """The checkpoints a resume from ``root`` may choose, best first: those of the lineage whose newest
    checkpoint was written last (by ``written_at``; another run's in the same directory are never
    chosen over it), newest step first, with any whose manifest is unreadable among them by step."""
    found = complete_checkpoints(root)
    manifests = {p: read_manifest(p) for p in found}
    readable = [p for p in found if manifests[p] is not None]
    if not readable:
        return found
    latest = max(readable, key=lambda p: (manifests[p].get("written_at", 0), int(p.name[5:])))
    lineage = manifests[latest].get("lineage")
    return [p for p in found if manifests[p] is None or manifests[p].get("lineage") == lineage]


def resumable_steps(path: Path) -> Optional[List[int]]:
    """The steps a resume from ``path`` (a checkpoint, a checkpoints/ directory or a run directory) could start at,
    newest first, by their manifests alone (no file verified: a check before any rank starts); None where ``path``
    holds no complete checkpoint."""
    path = Path(path)
    found = [path] if (path / MANIFEST).is_file() else candidates(checkpoints_root(path))
    manifests = [read_manifest(p) for p in found]
    steps = [m["step"] for m in manifests if m is not None and isinstance(m.get("step"), int)]
    return sorted(steps, reverse=True) if found else None


def first_candidate(path: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The checkpoint a resume from ``path`` (a checkpoint, a checkpoints/ directory or a run directory) takes unless
    its files fail verification, with its manifest, by manifests alone (io/checkpoint.py's ``select`` verifies: a
    corrupt one gives the previous of its lineage); None where ``path`` holds none with a readable manifest."""
    path = Path(path)
    found = [path] if (path / MANIFEST).is_file() else candidates(checkpoints_root(path))
    return next(((p, m) for p, m in ((p, read_manifest(p)) for p in found) if m is not None), None)


def resumed_settings(cfg: Any, run_dir: Optional[Path]) -> Any:
    """``cfg`` (a ``Config``) resuming the checkpoint ``train.resume`` takes (under auto, in ``run_dir``; None: not
    known, as to the launcher's precheck of a run directory Hydra refuses), as found by its manifest alone, in the
    precheck and on every rank: where pipeline.weight_versions or optim.delay_correction is what 'auto' chose, the
    checkpoint's (config/newest.py's ``follow_checkpoint``). rank 0 verifies the checkpoint later (run/start.py's
    ``choose_checkpoint``) and compares its settings with what this returns.

    Raises:
        ConfigError: ``train.resume_strict`` and the checkpoint's rule or correction does not run with this run's keys.
    """
    t = cfg.train
    if t.resume == "never" or (t.resume == "auto" and run_dir is None):
        return cfg
    found = first_candidate(run_dir if t.resume == "auto" else Path(t.resume))
    if found is None:
        return cfg
    path, manifest = found
    recorded = manifest.get("training_settings")  # absent in checkpoints of earlier versions: nothing to follow
    recorded = recorded if isinstance(recorded, dict) else None
    return follow_checkpoint(cfg, recorded, where=path, strict=t.resume_strict)
