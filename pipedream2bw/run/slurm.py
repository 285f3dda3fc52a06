"""SLURM: a task's rank and rendezvous from SLURM's environment, and the requeue of a preempted job.

Rank discipline: a rank is a process with ``RANK`` set by torchrun (``srun torchrun``, one task per
node: scripts/slurm/train.sbatch) or, without torchrun, a task of a SLURM step (one task per rank:
``hydra/launcher=slurm``, submitit's ``tasks_per_node`` = ranks per node). torchrun's variables are
read first: inside torchrun under ``srun`` the ``SLURM_*`` ones describe the torchrun task, not the
rank. Either way ranks are numbered node by node (SLURM's block distribution; torchrun's node rank),
so ``LOCAL_WORLD_SIZE`` ranks share a node, which is what ``pipeline.rank_map`` assumes.

Requeue: SLURM sends a signal some time before the job's time limit (``--signal``; submitit's
``signal_delay_s``, SIGUSR2). When it is one of ``train.preempt_signals`` every rank stops at one step,
checkpointed (pipedream2bw/preempt.py); then rank 0 asks SLURM to requeue the job
(``scontrol requeue``), which starts it again with the same command, hence the same run directory,
where ``train.resume=auto`` (the default) continues from the checkpoint. A job cancelled with
``scancel`` (its ranks get SIGTERM too) is not requeued: it is no longer RUNNING; the run ends preempted.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from typing import Dict, List, Mapping, Optional

log = logging.getLogger(__name__)

PORT_BASE, PORT_SPAN = 20000, 20000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN unless set


def expand_nodelist(nodelist: str) -> List[str]:
    """SLURM's compressed host list (``node[01-03,7],gpu1``) as host names, in order."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
            else:
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return hosts


def tasks_per_node(spec: str) -> List[int]:
    """SLURM's compressed tasks-per-node list (``2(x3),1``) expanded: one count per node."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"unreadable SLURM tasks-per-node list {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def rank_env(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """The torch.distributed variables that a task of a SLURM step (or of submitit's local executor) lacks;
    {} under torchrun or outside a step.

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from the step's task numbering; MASTER_ADDR: the
    step's first node (where rank 0 runs and hosts the rendezvous store); MASTER_PORT: from the job id,
    the same on every node and every requeue of the job, unless set.
    """
    if "RANK" in environ:
        return {}  # torchrun's ranks
    if "SUBMITIT_LOCAL_GLOBALID" in environ:  # hydra/launcher=submitit_local: tasks on this machine
        return {
            "RANK": environ["SUBMITIT_LOCAL_GLOBALID"],
            "WORLD_SIZE": environ["SUBMITIT_LOCAL_NTASKS"],
            "LOCAL_RANK": environ["SUBMITIT_LOCAL_LOCALID"],
            "LOCAL_WORLD_SIZE": environ["SUBMITIT_LOCAL_NTASKS"],
            "MASTER_ADDR": environ.get("MASTER_ADDR") or "127.0.0.1",
            "MASTER_PORT": environ.get("MASTER_PORT")
            or str(PORT_BASE + int(environ.get("SUBMITIT_LOCAL_JOB_ID", "0").split("_")[0] or 0) % PORT_SPAN),
        }
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}  # torchrun's ranks, or a batch script's shell (no step: SLURM_NTASKS is the allocation's)
    node = int(environ.get("SLURM_NODEID", 0))
    counts = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", environ["SLURM_STEP_NUM_TASKS"]))
    hosts = expand_nodelist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "localhost"))
    job_id = int(environ.get("SLURM_ARRAY_JOB_ID") or environ.get("SLURM_JOB_ID", 0))
    task_in_array = int(environ.get("SLURM_ARRAY_TASK_ID") or 0)
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(counts[min(node, len(counts) - 1)]),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or hosts[0],
        "MASTER_PORT": environ.get("MASTER_PORT") or str(PORT_BASE + (job_id + task_in_array) % PORT_SPAN),
    }


def set_rank_env() -> None:
    """Sets ``rank_env()`` in this process's environment (nothing under torchrun or outside SLURM); with
    several ranks on the node and no OMP_NUM_THREADS, one intra-op thread per rank, as torchrun sets: the
    ranks do not oversubscribe the node's cores, and a run gives the same bits as under torchrun (CPU
    reductions split across threads round differently)."""
    env = rank_env()
    if not env:
        return
    os.environ.update(env)
    if int(env["LOCAL_WORLD_SIZE"]) > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def job_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """This SLURM job's id (an array task's own id), None outside SLURM."""
    return environ.get("SLURM_JOB_ID")


def job_state(jid: str) -> Optional[str]:
    """The job's state as ``scontrol show job`` gives it (RUNNING, CANCELLED, ...); None if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bJobState=(\S+)", out.stdout)
    return match.group(1) if match else None


def requeue(environ: Mapping[str, str] = os.environ) -> bool:
    """Asks SLURM to requeue this job (``scontrol requeue``) if it is still running; whether it did. Call on
    rank 0 only, once every rank has stopped checkpointed: SLURM ends every process of the job at once.

    A job that ``scancel`` ended (SIGTERM too, but the job is CANCELLED) is not requeued: SLURM would
    accept the request for a job still completing and bring the cancelled job back.
    """
    jid = job_id(environ)
    if jid is None:
        return False
    state = job_state(jid)
    if state != "RUNNING":
        log.warning("SLURM job %s not requeued: it is %s, not RUNNING (cancelled?)", jid, state or "of unknown state")
        return False
    try:
        out = subprocess.run(["scontrol", "requeue", jid], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("SLURM job %s not requeued: scontrol requeue failed: %s", jid, e)
        return False
    if out.returncode != 0:
        log.error("SLURM job %s not requeued: %s", jid, (out.stderr or out.stdout).strip())
        return False
    log.warning("SLURM job %s requeued: it starts again in this run directory and resumes from the checkpoint", jid)
    return True
