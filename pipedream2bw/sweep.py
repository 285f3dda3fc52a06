"""Hydra multirun sweep: each job launches a distributed training run, the sweep tabulates them.

    python -m pipedream2bw.sweep -m pipeline.num_stages=1,2,4 pipeline.schedule=2bw,flush,gpipe

Every job (one point of the sweep) launches ``python -m pipedream2bw.train <its overrides>``
on ``sweep.nproc`` local ranks (default ``num_stages * data_parallel * tensor_parallel``) through torch's
elastic launch API, in its own directory, waits, and records the run's measured throughput,
per-stage peak memory, final loss and, when summary.json has them, the planner's predicted
figures. A job that fails (bad config, crash, ``sweep.timeout_s``) is recorded with its error
and the sweep goes on. At the end the table is printed sorted by ``sweep.objective``, best first,
and written as ``sweep.csv`` and ``sweep.json`` in the sweep directory. Every job's wandb run is
in the group ``sweep.name`` (default: the sweep directory).

Each job returns its ``sweep.objective`` figure (e.g. samples_per_s, final_val_loss), so that an
optimizing sweeper can search: ``hydra/sweeper=optuna`` (pip install 'pipedream2bw[optuna]'). A
failed job returns the worst value for the sweeper's direction (-inf when maximizing, +inf when
minimizing), so the search moves away from it and goes on.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipedream2bw.config import Config, register_configs
from pipedream2bw.errors import ConfigError
from pipedream2bw.io.fileio import atomic_write
from pipedream2bw.run import preflight
from pipedream2bw.run.launch import LaunchError, launch_train, worker_threads
from pipedream2bw.train import _run_stamp

# a submitit job (hydra/launcher=slurm) imports this module to run main() and resolves hydra.sweep.dir there
OmegaConf.register_new_resolver("pd2bw_run_stamp", _run_stamp, replace=True)

log = logging.getLogger("pipedream2bw.sweep")

RESULT_FILE = "sweep_job.json"  # one job's row, in its directory
COLUMNS = [  # the printed table; sweep.csv and sweep.json hold every field
    ("job", "job", "{}"),
    ("status", "status", "{}"),
    ("schedule", "schedule", "{}"),
    ("num_stages", "d", "{}"),
    ("data_parallel", "w", "{}"),
    ("num_microbatches", "m", "{}"),
    ("microbatch_size", "b", "{}"),
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("predicted_samples_per_s", "pred samples/s", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("final_loss", "loss", "{:.4f}"),
    ("final_val_loss", "val loss", "{:.4f}"),
    ("max_peak_memory_mib", "peak MiB", "{:.0f}"),
    ("bubble_fraction", "bubble", "{:.2f}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("threads_per_rank", "threads", "{}"),  # OMP_NUM_THREADS of each rank (launch.worker_threads)
    ("error", "error", "{}"),
]
OBJECTIVES = {  # sweep.objective -> the direction in which it gets better
    "samples_per_s": "maximize",
    "tokens_per_s": "maximize",
    "final_loss": "minimize",
    "final_val_loss": "minimize",
    "step_time_s": "minimize",
    "max_peak_memory_mib": "minimize",
}


def train_overrides(task_overrides: List[str], *, group: str) -> List[str]:
    """The job's overrides for the training run: the sweep's own (``sweep.*``) dropped, the
    wandb group added unless the user set one."""
    out = [o for o in task_overrides if not re.match(r"^[+~]*sweep\.", o)]
    if not any(re.match(r"^[+~]*wandb\.group=", o) for o in out):
        out.append(f"wandb.group='{group}'")
    return out


def job_row(
    job: int, overrides: List[str], run_dir: Path, wall_s: float, error: Optional[str], *, threads: str = ""
) -> Dict[str, Any]:
    """One job's row: its settings and figures from its summary.json, or its error."""
    row: Dict[str, Any] = {"job": job, "overrides": " ".join(overrides), "run_dir": str(run_dir), "wall_s": wall_s}
    row["threads_per_rank"] = threads or "all cores"
    summary_path = run_dir / "summary.json"
    if error is not None or not summary_path.is_file():
        return {**row, "status": "failed", "error": error or "no summary.json"}
    s = json.loads(summary_path.read_text())
    peaks = s["peak_memory_bytes"]
    row.update(
        status="ok",
        error="",
        **{
            k: s[k]
            for k in (
                "schedule",
                "num_stages",
                "data_parallel",
                "num_microbatches",
                "microbatch_size",
                "global_batch_size",
            )
        },
        samples_per_s=s["samples_per_s"],
        tokens_per_s=s["tokens_per_s"],
        step_time_s=s["step_time_s"],
        final_loss=s["final_loss"],
        final_val_loss=s.get("final_val_loss"),
        peak_memory_bytes=peaks,
        max_peak_memory_mib=max(peaks) / 2**20,
        predicted_samples_per_s=s.get("predicted_samples_per_s"),
        predicted_peak_memory_bytes=s.get("predicted_peak_memory_bytes"),
        bubble_fraction=(s.get("trace") or {}).get("bubble_fraction"),
    )
    return row


def failure_reason(run_dir: Path, launch_error: str) -> str:
    """The most telling line the failed run logged (its config error or the first rank's failure)."""
    logs = [run_dir / "train.log", *sorted((run_dir / "launch").glob("**/stderr.log"))]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.is_file())
    for pattern in (r"bad configuration: (.*)", r"(rank \d+ \(stage \d+\) failed: .*)", r"^(\w*Error: .*)$"):
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            return f"{match.group(1).strip()} ({launch_error})"
    return launch_error


def run_job(cfg: Config, task_overrides: List[str], *, job: int, run_dir: Path, group: str) -> Dict[str, Any]:
    """Launches one training run, waits for it and returns its row; never raises for a failed run."""
    overrides = train_overrides(task_overrides, group=group)
    p = cfg.pipeline
    nproc = cfg.sweep.nproc or p.num_stages * p.data_parallel * p.tensor_parallel
    log.info("job %d: %d processes: %s", job, nproc, " ".join(overrides))
    start, error = time.monotonic(), None
    try:
        # a bad config fails here, without starting processes
        preflight.check(cfg, world_size=nproc, local_world_size=nproc)
        launch_train(overrides, nproc=nproc, run_dir=run_dir, timeout_s=cfg.sweep.timeout_s)
    except ConfigError as e:
        error = f"bad configuration: {e}"
    except LaunchError as e:
        error = failure_reason(run_dir, str(e))
    except Exception as e:  # the launcher itself failed (e.g. rendezvous): still only this job
        error = f"launch failed: {type(e).__name__}: {e}"
    row = job_row(job, overrides, run_dir, time.monotonic() - start, error, threads=worker_threads(nproc))
    atomic_write(run_dir / RESULT_FILE, (json.dumps(row, indent=2) + "\n").encode())
    log.info("job %d %s%s", job, row["status"], f": {error}" if error else f": {row['samples_per_s']:.1f} samples/s")
    return row


def check_objective(cfg: Config) -> Optional[str]:
    """``sweep.objective``'s natural direction ('maximize' or 'minimize'); None without an objective.

    Raises:
        ConfigError: an unknown objective, or final_val_loss without validation (every job would fail it).
    """
    objective = cfg.sweep.objective
    if objective is None:
        return None
    if objective not in OBJECTIVES:
        raise ConfigError(f"sweep.objective ({objective!r}) is unknown; use one of {list(OBJECTIVES)} or null")
    if objective == "final_val_loss" and not cfg.train.eval_every:
        raise ConfigError(
            "sweep.objective (final_val_loss) needs validation: set train.eval_every (e.g. to train.num_steps) "
            "and data.val_fraction (e.g. 0.1)"
        )
    return OBJECTIVES[objective]


def sweeper_direction(sweeper: Any, natural: str) -> str:
    """The direction the Hydra sweeper optimizes in (its ``direction`` setting, as Optuna's), else ``natural``."""
    direction = sweeper.get("direction") if hasattr(sweeper, "get") else None
    if isinstance(direction, (list, tuple)) or OmegaConf.is_list(direction):
        direction = direction[0] if len(direction) == 1 else None
    direction = str(getattr(direction, "name", direction) or natural).lower()
    if direction not in ("maximize", "minimize"):
        raise ConfigError(
            f"hydra.sweeper.direction ({direction!r}) must be one direction, maximize or minimize, for one "
            "sweep.objective"
        )
    return direction


def objective_value(row: Dict[str, Any], objective: str, direction: str) -> float:
    """The job's figure for the sweeper: ``row[objective]``, or the worst value for ``direction``
    when the job failed or the figure is missing or not finite (a diverged loss)."""
    value = row.get(objective) if row["status"] == "ok" else None
    if value is None or not math.isfinite(value):
        return -math.inf if direction == "maximize" else math.inf
    return float(value)


def sort_rows(rows: List[Dict[str, Any]], *, objective: Optional[str] = "samples_per_s") -> List[Dict[str, Any]]:
    """Best ``objective`` first (fastest without one); failed jobs last, in job order."""
    sign = -1.0 if OBJECTIVES.get(objective or "samples_per_s") == "maximize" else 1.0
    key = objective or "samples_per_s"
    return sorted(rows, key=lambda r: (r["status"] != "ok" or r.get(key) is None, sign * (r.get(key) or 0.0), r["job"]))


def format_table(rows: List[Dict[str, Any]]) -> str:
    cells = [[name for _, name, _ in COLUMNS]]
    for r in rows:
        cells.append(["-" if r.get(key) is None or r.get(key) == "" else fmt.format(r[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def write_table(
    sweep_dir: Path, rows: List[Dict[str, Any]], *, name: str, objective: Optional[str] = "samples_per_s"
) -> str:
    """Writes sweep.json and sweep.csv (best ``objective`` first) into ``sweep_dir``; returns the printed table."""
    rows = sort_rows(rows, objective=objective)
    payload = {"name": name, "sweep_dir": str(sweep_dir), "objective": objective, "jobs": rows}
    atomic_write(sweep_dir / "sweep.json", (json.dumps(payload, indent=2) + "\n").encode())
    fields = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})
    atomic_write(sweep_dir / "sweep.csv", buf.getvalue().encode())
    return format_table(rows)


def sweep_name(cfg: Config, sweep_dir: Path) -> str:
    return cfg.sweep.name or str(sweep_dir)


class SweepTable(Callback):
    """Hydra callback: once every job of the multirun is done, collect, print and save the table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        # not through a link: a job's run also links <results folder>/latest to it, which is the sweep
        # directory itself when that is one folder below the working directory (hydra.sweep.dir=mysweep)
        found = sorted(sweep_dir.glob(f"*/{RESULT_FILE}"))
        rows = [json.loads(p.read_text()) for p in found if not p.parent.is_symlink()]
        name = config.sweep.name or str(sweep_dir)
        objective = config.sweep.get("objective")
        table = write_table(sweep_dir, rows, name=name, objective=objective)
        failed = sum(r["status"] != "ok" for r in rows)
        print(
            f"\nsweep {name}: {len(rows)} jobs, {failed} failed; {sweep_dir / 'sweep.csv'}, "
            f"{sweep_dir / 'sweep.json'}\n{table}",
            flush=True,
        )
        best = sort_rows(rows, objective=objective)[:1]
        if objective and best and best[0]["status"] == "ok" and best[0].get(objective) is not None:
            print(
                f"best {objective}: {best[0][objective]:.6g}, job {best[0]['job']}: {best[0]['overrides']}", flush=True
            )


@hydra.main(version_base="1.3", config_path="../configs", config_name="sweep")
def main(dcfg: DictConfig) -> Optional[float]:
    """Runs one job; returns its ``sweep.objective`` figure (what an optimizing sweeper minimizes or maximizes).

    Raises:
        ConfigError: a bad ``sweep.objective`` (before the job starts: every job would fail the same way).
    """
    cfg: Config = OmegaConf.to_object(dcfg)
    hc = HydraConfig.get()
    natural = check_objective(cfg)
    direction = sweeper_direction(hc.sweeper, natural) if natural else None
    if natural and direction != natural:
        log.warning(
            "the sweeper %ss sweep.objective (%s), which gets better as it %s",
            direction,
            cfg.sweep.objective,
            "grows" if natural == "maximize" else "falls",
        )
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    sweep_dir = Path(hc.sweep.dir) if multirun else run_dir
    row = run_job(
        cfg,
        list(hc.overrides.task),
        job=hc.job.num if multirun else 0,
        run_dir=run_dir,
        group=sweep_name(cfg, sweep_dir),
    )
    if not multirun:  # a sweep of one: the table goes next to it
        print(write_table(run_dir, [row], name=sweep_name(cfg, sweep_dir), objective=cfg.sweep.objective), flush=True)
    if natural is None:
        return None
    value = objective_value(row, cfg.sweep.objective, direction)
    log.info("job %d: %s = %s", row["job"], cfg.sweep.objective, value)
    return value


NOISY_LOGGERS = ("alembic", "optuna")
"""Third-party loggers quieted to warnings: the Optuna sweeper imports alembic, whose plugins each log a
"setup plugin" line, and Optuna announces its in-memory study (the sweeper logs the study itself)."""


def cli() -> None:
    from pipedream2bw.train import _STAMP_ENV, HELP_FLAGS, print_help

    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print_help(sys.argv[1:], config_name="sweep")
        return
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if any(a.startswith("hydra/sweeper=optuna") for a in sys.argv[1:]):
        import optuna  # it sets its own logger's level when imported: quieted after that

        optuna.logging.set_verbosity(optuna.logging.WARNING)
    register_configs()
    os.environ.setdefault(_STAMP_ENV, time.strftime("%Y-%m-%d/%H-%M-%S"))  # one process: no ranks to agree with
    main()


if __name__ == "__main__":
    cli()
