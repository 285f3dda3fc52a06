"""Run results: the summary figures of a run, from the stages' stats."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from pipedream2bw.io.fileio import atomic_write_json

if TYPE_CHECKING:  # annotations only: results (and what imports it) stays below the stage worker
    from pipedream2bw.run.stage import StageStats


def throughput(
    start_time: float, step_end_times: Sequence[float], *, warmup_steps: int, samples_per_step: int
) -> Dict[str, float]:
    """Samples/s over the steps after ``warmup_steps``, and their median step time."""
    times = [start_time, *step_end_times][warmup_steps:]
    steps = [b - a for a, b in zip(times, times[1:])]
    return {
        "samples_per_s": len(steps) * samples_per_step / (times[-1] - times[0]),
        "step_time_s": statistics.median(steps),
    }


def cpu_per_step(start_cpu: float, step_end_cpu: Sequence[float], *, warmup_steps: int) -> Optional[float]:
    """Process CPU seconds (all of a rank's threads) per step after ``warmup_steps``, as ``throughput`` times them:
    the rank's work, which other processes on its cores inflate less than its wall time (None: no such step)."""
    cpu = [start_cpu, *step_end_cpu][warmup_steps:]
    return (cpu[-1] - cpu[0]) / (len(cpu) - 1) if len(cpu) > 1 else None


def summarize(
    stats: List[StageStats], *, meta: Dict[str, Any], warmup_steps: int, samples_per_step: int, seq_len: int
) -> Dict[str, Any]:
    """The summary.json payload: the run's settings, rank 0's losses and timing, every rank's memory.

    ``peak_memory_bytes[s]`` is the largest peak among stage s's replicas."""
    rank0 = stats[0]
    tp = throughput(
        rank0.start_time, rank0.step_end_times, warmup_steps=warmup_steps, samples_per_step=samples_per_step
    )
    return {
        **meta,
        "losses": rank0.losses,
        "lrs": rank0.lrs,
        "grad_norms": rank0.grad_norms,  # the agreed global norm before clipping (null: no agreement ran)
        "skipped_steps": rank0.skipped_steps,  # steps skipped on every stage for a non-finite loss or gradient
        "final_loss": rank0.losses[-1],
        "samples_per_s": tp["samples_per_s"],
        "tokens_per_s": tp["samples_per_s"] * seq_len,
        "step_time_s": tp["step_time_s"],
        "peak_memory_bytes": [
            max(s.peak_memory_bytes for s in stats if s.stage_index == stage) for stage in range(meta["num_stages"])
        ],
        "ranks": [
            {
                "stage": s.stage_index,
                "replica": s.replica,
                "rank": s.rank,
                "allreduce_calls": s.allreduce_calls,
                "allreduce_exposed_s": s.allreduce_exposed_s,
                "agreement_exposed_s": s.agreement_exposed_s,
                "allgather_exposed_s": s.allgather_exposed_s,
                "host_step_s": s.host_step_s,
                "host_step_wait_s": s.host_step_wait_s,
                "host_step_cpu_s": s.host_step_cpu_s,
                "p2p_wait_s": s.p2p_wait_s,
                "cpu_s_per_step": cpu_per_step(s.start_cpu, s.step_end_cpu, warmup_steps=warmup_steps),
                "peak_pending_sends": s.peak_pending_sends,
                "checkpoint_s": s.checkpoint_s,
                "eval_s": s.eval_s,
                "data_resident_bytes": s.data_resident_bytes,
                "weight_bytes": s.weight_bytes,
                "optimizer_state_bytes": s.optimizer_state_bytes,
                "peak_stash_bytes": s.peak_stash_bytes,
                "peak_in_flight": s.peak_in_flight,
                "peak_memory_bytes": s.peak_memory_bytes,
                "swap": s.swap,
                "stream": s.stream,
                "skipped_steps": s.skipped_steps,  # fp16: batches whose step this rank skipped (the same on every rank)
            }
            for s in stats
        ],
    }


def write_summary(summary: Dict[str, Any], run_dir: Path) -> None:
    atomic_write_json(Path(run_dir) / "summary.json", summary)
