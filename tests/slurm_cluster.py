"""A one-node SLURM cluster under a temporary directory: munged, slurmctld and slurmd, started and torn down.

Debian's packages (``apt-get install -y slurm-wlm munge``, SLURM 22.05) run it as root with no systemd
and no cgroups: processes tracked by /proc (``proctrack/linuxproc``), no task plugin, munge with its key
and socket in the directory, clients pointed there by ``SLURM_CONF``. The scheduler is tuned to turn a
requeued job around in seconds (``cred_expire=5``, ``sched_interval=1``, ``KillWait=5``: about 140 s
with the defaults). No accounting: ``sacct`` has nothing, submitit reports a finished job as UNKNOWN.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

INSTALL = "apt-get install -y slurm-wlm munge"
BINARIES = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "squeue", "scontrol")
CPUS = 4  # declared to SLURM (config_overrides): room for a 2-rank job and a sweep's jobs side by side


def missing() -> Optional[str]:
    """Why no cluster can start here (a binary missing, not root) and the command that installs them; None if it can."""
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if absent:
        return f"SLURM binaries missing ({', '.join(absent)}): install them with `{INSTALL}` (as root)"
    if os.geteuid() != 0:
        return "the test SLURM cluster runs its daemons as root (SlurmUser=root, munged --force)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Cluster:
    """A running one-node cluster; ``env`` is the environment its clients (sbatch, srun, submitit) need."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: List[subprocess.Popen] = []
        self.env: Dict[str, str] = {}

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=pd2bwtest",
                    "SlurmctldHost=localhost",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r / 'munge/munge.socket'},cred_expire=5",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log/slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log/slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "SchedulerParameters=sched_interval=1,bf_interval=1",
                    "SlurmdParameters=config_overrides",  # CPUS may exceed the machine's cores
                    "ReturnToService=2",
                    "KillWait=5",
                    "MinJobAge=300",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
                    "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self, timeout_s: float = 30.0) -> "Cluster":
        """Starts munged, slurmctld, slurmd and waits until the node is idle.

        Raises:
            RuntimeError: a daemon did not come up in ``timeout_s`` (its log's tail in the message).
        """
        self._write_config()
        r, m = self.root, self.root / "munge"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={m / 'munge.key'}", "--force"], check=True)
        os.chmod(m / "munge.key", 0o400)
        self._spawn(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={m / 'munge.socket'}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ]
        )
        self._wait(lambda: (m / "munge.socket").exists(), "munged", m / "munged.log", timeout_s)
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=env)
        self._spawn([_which("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)], env=env)
        self.env = {"SLURM_CONF": str(self.conf)}

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")

        self._wait(idle, "slurmctld/slurmd", r / "log/slurmctld.log", timeout_s)
        return self

    def _spawn(self, cmd: List[str], env: Optional[Dict[str, str]] = None) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.out", "ab")
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait(self, ready, what: str, log: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
                self.stop()
                raise RuntimeError(
                    f"{what} did not come up ({'exited: ' + str(dead) if dead else 'timed out'}):\n{tail}"
                )
            time.sleep(0.2)

    def run(self, *cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A client command (sbatch, squeue, scontrol, ...) against this cluster."""
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}
        return subprocess.run(list(cmd), env=env, capture_output=True, text=True, check=check, **kwargs)

    def wait_job(self, job_id: str, timeout_s: float) -> str:
        """Waits until the job has left the queue (no accounting: squeue forgets it after MinJobAge); its last state.

        Raises:
            TimeoutError: still queued or running after ``timeout_s``.
        """
        deadline, state = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            out = self.run("scontrol", "show", "job", job_id, "-o", check=False).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "REQUEUE_HOLD"):
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state or 'unknown'} after {timeout_s:g} s")

    def stop(self) -> None:
        """Cancels every job, stops the daemons (SIGTERM, then SIGKILL) and the processes of jobs left over."""
        if self.env:
            self.run("scancel", "--user=root", check=False)
            deadline = time.monotonic() + 15
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        for pid in self._leftovers():  # slurmstepd and job processes: this cluster's SLURM_CONF in their environment
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _leftovers(self) -> List[int]:
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if int(proc.name) != os.getpid() and mark in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except (OSError, ValueError):
                continue
        return pids
