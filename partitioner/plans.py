"""Plans as data: the ``Plan`` the planner makes and the runtime reads, its tables, and its file (YAML)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

import yaml

from partitioner.cost import MEMORY_PARTS
from partitioner.topology import GIB
from pipedream2bw.errors import ConfigError
from pipedream2bw.io.fileio import atomic_write_text


@dataclass(frozen=True)
class Plan:
    """A configuration the runtime can run, with what the cost model predicts for it."""

    schedule: str
    num_stages: int
    data_parallel: int
    microbatch_size: int
    num_microbatches: int
    global_batch_size: int
    balance: List[int]
    rank_map: List[List[int]]
    recompute: bool
    swap_stages: List[int]
    objective: str
    topology: str
    devices: int
    memory_per_device_bytes: int
    costs: str  # 'profile' or 'analytic'
    predicted_batch_time_s: float
    predicted_samples_per_s: float
    predicted_stage_time_s: List[float]  # per microbatch, forward + backward + p2p + stall
    predicted_peak_memory_bytes: List[int]
    predicted_memory_breakdown: List[Dict[str, int]] = field(default_factory=list)
    model: Dict[str, object] = field(default_factory=dict)
    swap_resident: int = 1  # microbatches whose activations stay on device on a swapping stage
    precision: str = "fp32"  # train.precision the costs were taken for (resolved: fp32, bf16, fp16)
    sharded: bool = False  # optim.sharded: masters and optimizer state 1/w per replica
    weight_dtype: str = "fp32"  # train.weight_dtype the memory was counted for
    stream_stages: List[int] = field(default_factory=list)  # swap.weights: these stages (all of swap_stages) stream
    weight_prefetch: int = 1  # swap.weight_prefetch the streamed stages were costed with
    predicted_stall_s: List[float] = field(default_factory=list)  # per stage and microbatch: swapping's + streaming's
    predicted_host_step_s: List[float] = field(default_factory=list)  # per stage and batch: its host optimizer step
    predicted_host_sum_s: List[float] = field(default_factory=list)  # per stage and batch: host sums of its gradients
    predicted_stage_bound: List[str] = field(default_factory=list)  # per stage: its busiest resource (cost.RESOURCES)
    # per stage and batch: its replicas' gradient all-reduce (a streamed stage's: its host sums' over gloo) and the
    # part of it the training thread waits for; per stage: its host bytes (streamed state, swapped activations)
    predicted_allreduce_s: List[float] = field(default_factory=list)
    predicted_exposed_s: List[float] = field(default_factory=list)
    predicted_host_bytes: List[int] = field(default_factory=list)
    predicted_bound: str = ""  # the slowest stage's busiest resource: what bounds the plan
    host: str = ""  # the host's figures (partitioner.host) that its host steps were costed with
    host_optimizer: bool = False  # swap.optimizer=host on every stage: a plan that may stream (stream_stages or none)
    # pipeline.tensor_parallel: each stage's layers split over t ranks of one node (partitioner/tensor.py); rank_map
    # then counts tensor groups: (stage s, replica r) runs on ranks rank_map[s][r] * t .. rank_map[s][r] * t + t - 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False  # the costs split the norms' and the replicated activations along the sequence
    predicted_steps_factor: float = 1.0  # steps to a loss over a synchronous schedule's (time_to_loss.steps_factor)
    schedule_choice: Dict[str, float] = field(default_factory=dict)  # schedule=auto: each candidate's best plan's
    # batch time x steps factor (seconds a synchronous step's worth of progress; .inf: not known to reach the loss)
    schedule_factors: Dict[str, float] = field(default_factory=dict)  # schedule=auto: each candidate's best plan's
    # steps factor (under pipeline.weight_versions=newest 2bw's depends on its plan's depth; .inf: not known)

    @property
    def steps_on_host(self) -> bool:
        """Whether the plan's stages step their optimizers on the host (it streams, or keeps the state there)."""
        return self.host_optimizer or bool(self.stream_stages)

    @property
    def num_ranks(self) -> int:
        """Ranks the plan runs on: d x w x t."""
        return self.num_stages * self.data_parallel * self.tensor_parallel

    @property
    def mesh(self) -> str:
        """``'8 x 16 x 8'``: stages x replicas x tensor ranks (the mesh, tensor innermost)."""
        return f"{self.num_stages} x {self.data_parallel} x {self.tensor_parallel}"

    @property
    def boundaries(self) -> List[int]:
        """First layer of each stage."""
        return [sum(self.balance[:s]) for s in range(self.num_stages)]

    def row(self) -> Dict[str, str]:
        """One line of the CLI's table."""
        schedule = {"schedule": self.schedule} if self.schedule_choice else {}  # schedule=auto's plans differ in it
        return {
            **schedule,
            "d x w x t": self.mesh,
            "b": str(self.microbatch_size),
            "m": str(self.num_microbatches),
            "recompute": "yes" if self.recompute else "no",
            "sharded": "yes" if self.sharded else "no",
            "swap": _ranges(self.swap_stages) or "-",
            "stream": _ranges(self.stream_stages) or "-",
            "balance": _short(self.balance),
            "samples/s": f"{self.predicted_samples_per_s:.4g}",
            "bound": self.predicted_bound or "-",
            "batch s": f"{self.predicted_batch_time_s:.4g}",
            "peak GiB": f"{max(self.predicted_peak_memory_bytes) / GIB:.3g}",
        }


def _ranges(values: Sequence[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out, i, v = [], 0, list(values)
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[j + 1] == v[j] + 1:
            j += 1
        out.append(str(v[i]) if i == j else f"{v[i]}-{v[j]}")
        i = j + 1
    return ",".join(out)


def _short(values: Sequence[int]) -> str:
    """[1,1,1,1,2] -> '1x4,2': balance lists of deep pipelines stay readable."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(str(values[i]) if j - i == 1 else f"{values[i]}x{j - i}")
        i = j
    return ",".join(out)


def table(plans: Sequence[Plan]) -> str:
    """Plain-text table, best plan first."""
    if not plans:
        return "(no plan)"
    rows = [{"#": str(k), **p.row()} for k, p in enumerate(plans)]
    if not any(p.steps_on_host for p in plans):  # the columns only where a plan streams weights or steps on the host
        rows = [{c: v for c, v in r.items() if c not in ("stream", "bound")} for r in rows]
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    lines += ["  ".join(r[c].rjust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _stage_layers(plan: Plan, s: int) -> str:
    """Stage s's layers, ``first-last``; under zbv (a balance of 2d chunks) its two chunks', s and 2d-1-s."""
    bounds = [sum(plan.balance[:v]) for v in range(len(plan.balance) + 1)]
    held = (s, len(plan.balance) - 1 - s) if len(plan.balance) == 2 * plan.num_stages else (s,)
    return ",".join(f"{bounds[v]}-{bounds[v + 1] - 1}" for v in held)


def stage_table(plan: Plan) -> str:
    """Per-stage predictions of one plan: layers, time per microbatch, memory and its parts (GiB, whole names);
    for a plan that streams weights, also whether each stage streams, its stall per microbatch (ms), its host
    optimizer step and its host sums of its gradients over the microbatches per batch (s), and its busiest resource
    (compute, copy or host)."""
    widths = [max(len(p), 7) for p in MEMORY_PARTS]
    streams = plan.steps_on_host
    lines = [
        f"{'stage':>5} {'layers':>9} {'ms/mb':>9} "
        + (f"{'stream':>6} {'stall ms':>9} {'step s':>8} {'sums s':>8} {'bound':>7} " if streams else "")
        + f"{'peak GiB':>9}  "
        + " ".join(f"{p:>{w}}" for p, w in zip(MEMORY_PARTS, widths))
    ]
    for s in range(plan.num_stages):
        layers = _stage_layers(plan, s)
        parts = plan.predicted_memory_breakdown[s] if plan.predicted_memory_breakdown else {}
        stall = plan.predicted_stall_s[s] if plan.predicted_stall_s else 0.0
        step = plan.predicted_host_step_s[s] if plan.predicted_host_step_s else 0.0
        sums = plan.predicted_host_sum_s[s] if plan.predicted_host_sum_s else 0.0
        bound = plan.predicted_stage_bound[s] if plan.predicted_stage_bound else "-"
        streamed = f"{'yes' if s in plan.stream_stages else 'no':>6} {stall * 1e3:>9.3f} {step:>8.3f} {sums:>8.3f} "
        streamed += f"{bound:>7} "
        lines.append(
            f"{s:>5} {layers:>9} {plan.predicted_stage_time_s[s] * 1e3:>9.3f} "
            + (streamed if streams else "")
            + f"{plan.predicted_peak_memory_bytes[s] / GIB:>9.3f}  "
            + " ".join(f"{parts.get(p, 0) / GIB:>{w}.3f}" for p, w in zip(MEMORY_PARTS, widths))
        )
    return "\n".join(lines)


BOUNDS = {  # cost.RESOURCES in words
    "compute": "the devices' compute",
    "copy": "the host-device copies",
    "host": "the host's optimizer step and gradient sums",
}


def bound_line(plan: Plan) -> str:
    """What a plan that steps on the host predicts, what bounds it, and the host figures it took."""
    slowest = plan.predicted_stage_bound.index(plan.predicted_bound) if plan.predicted_stage_bound else 0
    return (
        f"predicted {plan.predicted_samples_per_s:.4g} samples/s ({plan.predicted_batch_time_s:.4g} s a batch), bound "
        f"by {BOUNDS.get(plan.predicted_bound, plan.predicted_bound)} (stage {slowest}); {plan.host}"
    )


# ---------------------------------------------------------------- plan files


def plan_to_text(p: Plan) -> str:
    header = "# pipedream2bw plan: run it with partition=file partition.path=<this file>; edit balance/flags freely.\n"
    return header + yaml.safe_dump(dataclasses.asdict(p), sort_keys=False, default_flow_style=None, width=120)


def plan_from_text(text: str, *, source: str = "plan") -> Plan:
    """Parses a plan file's text.

    Raises:
        ConfigError: not a plan (unknown or missing keys), naming them.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from e
    names = {f.name for f in dataclasses.fields(Plan)}
    required = {
        f.name
        for f in dataclasses.fields(Plan)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if not isinstance(data, dict) or set(data) - names or required - set(data):
        got = set(data) if isinstance(data, dict) else set()
        raise ConfigError(
            f"{source} is not a plan file: unknown keys {sorted(got - names)}, missing keys {sorted(required - got)}; "
            f"write one with `python -m partitioner plan ...`"
        )
    _check_types(data, source)
    return Plan(**data)


def _check_types(data: Dict[str, object], source: str) -> None:
    """Refuses a plan value of the wrong type (``balance: abc``, ``num_stages: "2"``), naming it: an
    edited plan must fail here, not as a TypeError or a comparison that reads 2 != 2 later.

    Raises:
        ConfigError: naming the key, its value and the type it needs.
    """
    import typing

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v):
        return is_int(v) or isinstance(v, float)

    checks = {
        int: (is_int, "an integer"),
        float: (is_number, "a number"),
        str: (lambda v: isinstance(v, str), "a string"),
        bool: (lambda v: isinstance(v, bool), "true or false"),
        List[int]: (lambda v: isinstance(v, list) and all(map(is_int, v)), "a list of integers"),
        List[float]: (lambda v: isinstance(v, list) and all(map(is_number, v)), "a list of numbers"),
        List[List[int]]: (
            lambda v: isinstance(v, list) and all(isinstance(r, list) and all(map(is_int, r)) for r in v),
            "a list of lists of integers",
        ),
    }
    hints = typing.get_type_hints(Plan)
    for key, value in data.items():
        hint = hints[key]
        if typing.get_origin(hint) is dict:
            ok, what = isinstance(value, dict), "a mapping"
        elif hint in checks:
            ok, what = checks[hint][0](value), checks[hint][1]
        else:
            continue
        if not ok:
            raise ConfigError(
                f"{source}: {key} ({value!r}) must be {what}; correct it, or write the plan again with "
                f"`python -m partitioner plan ...`"
            )


def save_plan(p: Plan, path) -> Path:
    """Writes the plan atomically (complete or absent) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, plan_to_text(p), mode=0o644)
    return path


def load_plan(path) -> Plan:
    """Reads a plan file.

    Raises:
        ConfigError: missing or not a plan.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"partition.path ({path}) is not a file; "
            f"write a plan with `python -m partitioner plan ...` and point partition.path at it"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"partition.path ({path}) cannot be read as a plan file (YAML text): {type(e).__name__}: {e}; "
            f"write a plan with `python -m partitioner plan ...` and point partition.path at it"
        ) from e
    return plan_from_text(text, source=str(path))
