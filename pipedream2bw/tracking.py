"""wandb tracking on rank 0: offline by default (no network), online or disabled on request."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, Optional

from pipedream2bw.config import Config

log = logging.getLogger(__name__)


class Tracker:
    """A wandb run in ``run_dir`` (``wandb.mode``: offline, online or disabled)."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.run = None
        if cfg.wandb.mode == "disabled":
            return
        import wandb  # imported here: it is slow to import and only rank 0 needs it

        self.run = wandb.init(
            project=cfg.wandb.project,
            name=cfg.wandb.name,
            mode=cfg.wandb.mode,
            dir=str(run_dir),
            config=dataclasses.asdict(cfg),
            settings=wandb.Settings(silent=True, console="off"),
        )
        log.info("wandb run %s (%s) in %s", self.run.id, cfg.wandb.mode, self.run.dir)

    def log(self, metrics: Dict[str, Any], *, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self, summary: Optional[Dict[str, Any]] = None) -> None:
        if self.run is None:
            return
        for key in ("final_loss", "samples_per_s", "tokens_per_s", "step_time_s"):
            if summary and key in summary:
                self.run.summary[key] = summary[key]
        if summary:
            for stage, peak in enumerate(summary["peak_memory_bytes"]):
                self.run.summary[f"stage{stage}/peak_memory_bytes"] = peak
            for r in summary.get("ranks", []):
                for key in ("peak_device_bytes", "swapped_out_bytes", "stall_s") if r.get("swap") else ():
                    self.run.summary[f"stage{r['stage']}/replica{r['replica']}/swap_{key}"] = r["swap"][key]
        self.run.finish()
