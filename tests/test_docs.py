"""The docs cannot go stale: runnable blocks run, the others are checked against the config schema and
``--help``, example outputs match what their commands print, docs/config.md is what the generator writes."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest

from pipedream2bw.config import TINY_ENV, from_hydra
from pipedream2bw.config.docs import compose, config_groups, markdown

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell"}
README_MAX_LINES = 250


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, first line, info string words and text."""

    page: Path
    line: int
    info: tuple
    text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> List[Block]:
    out, info, start, body = [], None, 0, []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            if info is None:
                info, start, body = tuple(line[3:].split()), n, []
            else:
                out.append(Block(page, start, info, "\n".join(body) + "\n"))
                info = None
        elif info is not None:
            body.append(line)
    assert info is None, f"{page}: unclosed code block at line {start}"
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.info[:1] and b.info[0] in SHELL and "runnable" in b.info]
CHECKED = [b for b in ALL if b.info[:1] and b.info[0] in SHELL and "runnable" not in b.info]
OUTPUTS = [b for b in ALL if "expected-output" in b.info]


def commands(text: str) -> List[List[str]]:
    """The block's commands as argument lists: continuations joined, comments dropped, split at && ; |."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in prose-like shell (a for loop's body): not a command
            continue
        cmd: List[str] = []
        for tok in tokens + [";"]:
            if tok in ("&&", ";", "|", "||"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    return out


# ---- checks of the blocks that do not run ------------------------------------------------------------


def _sweep_value(value: str) -> bool:
    depth, top_comma = 0, False
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        top_comma |= ch == "," and depth == 0
    return top_comma or re.match(r"^(choice|range|interval|tag|glob)\(", value) is not None


def check_overrides(args: List[str], *, config_name: str) -> None:
    """Every ``group=option`` names an option of configs/, every ``key=value`` a key of the composed config,
    and the overrides (sweep values aside) compose into a typed Config."""
    groups = config_groups()
    plain, swept = [], []
    for a in args:
        if a.startswith("hydra/launcher="):  # ours (configs/hydra/launcher/) or a plugin's
            name = a.split("=", 1)[1]
            assert (ROOT / "configs" / "hydra" / "launcher" / f"{name}.yaml").is_file() or name in (
                "basic",
                "submitit_slurm",
                "submitit_local",
            ), f"{a}: no launcher {name!r}"
        if a in ("-m", "--multirun") or "$" in a or a.startswith(("hydra.", "hydra/", "--")):
            continue
        assert "=" in a, f"not an override: {a!r}"
        key, value = a.split("=", 1)
        if key.lstrip("+~") in groups and not _sweep_value(value):
            assert value in groups[key.lstrip("+~")], f"{a}: no option {value!r} in {groups[key]}"
        (swept if _sweep_value(value) else plain).append(a)
    from omegaconf import OmegaConf

    cfg = compose(plain, config_name=config_name)
    from_hydra(cfg)  # types and entries
    missing = object()
    for a in swept:
        key = a.split("=", 1)[0].lstrip("+~")
        if key not in groups:
            assert OmegaConf.select(cfg, key, default=missing) is not missing, f"{a}: no key {key}"


@functools.lru_cache(maxsize=None)
def help_of(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{argv} --help exits {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def check_command(cmd: List[str], *, check: bool = True) -> Optional[str]:
    """Checks one command (only classifies it without ``check``); returns what kind it was (None: not ours)."""
    while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):  # VAR=value prefixes
        cmd = cmd[1:]
    if not cmd:
        return None
    if cmd[0] == "pipedream2bw-train" or cmd[:3] == ["python", "-m", "pipedream2bw.launch"]:
        from pipedream2bw.launch import split_args

        _, train_args = split_args(cmd[1 if cmd[0] == "pipedream2bw-train" else 3 :])
        if check:
            check_overrides(train_args, config_name="config")
        return "train"
    if cmd[0] == "torchrun":
        assert "-m" in cmd, cmd
        i = cmd.index("-m")
        assert cmd[i + 1] == "pipedream2bw.train", cmd
        if check:
            check_overrides(cmd[i + 2 :], config_name="config")
        return "train"
    if cmd[0] == "sbatch":  # sbatch [its options] scripts/slurm/<script>.sbatch <training overrides>
        i = next(i for i, a in enumerate(cmd) if a.endswith(".sbatch"))
        assert (ROOT / cmd[i]).is_file(), f"no script {cmd[i]}"
        if check:
            check_overrides(cmd[i + 1 :], config_name="config")
        return "sbatch"
    if cmd[0] != "python" or len(cmd) < 2:
        return None
    if cmd[1] == "-m" and cmd[2] in ("pipedream2bw.train", "pipedream2bw.sweep"):
        if check:
            check_overrides(cmd[3:], config_name="config" if cmd[2].endswith("train") else "sweep")
        return cmd[2]
    if cmd[1] == "-m" and cmd[2] == "partitioner":
        assert cmd[3] == "plan", cmd
        args = cmd[4:]
        if "--out" in args:
            i = args.index("--out")
            args = args[:i] + args[i + 2 :]
        if check:
            check_overrides(args, config_name="config")
        return "partitioner"
    if cmd[1] == "-m" and cmd[2] == "pipedream2bw.checkpoint":
        assert not check or cmd[3] in help_of("-m", "pipedream2bw.checkpoint"), cmd
        return "checkpoint"
    if cmd[1].startswith("scripts/"):
        assert (ROOT / cmd[1]).is_file(), f"no script {cmd[1]}"
        text = help_of(cmd[1]) if check else ""
        for flag in (a.split("=", 1)[0] for a in cmd[2:] if a.startswith("--") and check):
            assert flag in text, f"{cmd[1]} has no option {flag}"
        return "script"
    return None


@pytest.mark.parametrize("block", CHECKED, ids=[b.id for b in CHECKED])
def test_shell_block_names_real_keys_scripts_and_options(block):
    # GPU and multi-node blocks cannot run here: their keys, groups, scripts and options must still exist.
    for cmd in commands(block.text):
        check_command(cmd)


def test_checks_catch_a_stale_key_a_missing_script_and_a_removed_option():
    with pytest.raises(Exception, match="pipeline.num_stagez"):
        check_command(["torchrun", "-m", "pipedream2bw.train", "pipeline.num_stagez=2"])
    with pytest.raises(AssertionError, match="no option 'gpt3'"):
        check_command(["python", "-m", "pipedream2bw.sweep", "-m", "model=gpt3", "pipeline.num_stages=1,2"])
    with pytest.raises(AssertionError, match="no key train.num_stepz"):
        check_command(["python", "-m", "pipedream2bw.sweep", "-m", "train.num_stepz=1,2"])
    with pytest.raises(AssertionError, match="no script"):
        check_command(["python", "scripts/bench_everything.py"])
    with pytest.raises(AssertionError, match="no launcher 'slurmm'"):
        check_command(["python", "-m", "pipedream2bw.train", "-m", "hydra/launcher=slurmm"])
    with pytest.raises(AssertionError, match="no script scripts/slurm/trian.sbatch"):
        check_command(["sbatch", "--nodes", "2", "scripts/slurm/trian.sbatch"])
    with pytest.raises(AssertionError, match="has no option --colour"):
        check_command(["python", "scripts/show_schedule.py", "--colour"])
    assert check_command(["python", "-m", "partitioner", "plan", "--out", "p.yaml", "topology=dgx"]) == "partitioner"


def launch_of(cmd: List[str]) -> Optional[tuple]:
    """(ranks launched, the training's overrides) of a one-node training command (torchrun or the launcher) with a
    numeric --nproc-per-node; None for any other command (several nodes, a variable, a multirun)."""
    from pipedream2bw.launch import split_args

    while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
        cmd = cmd[1:]
    if cmd[:1] == ["torchrun"] and "-m" in cmd:
        options, overrides = cmd[1 : cmd.index("-m")], cmd[cmd.index("-m") + 2 :]
    elif cmd[:1] == ["pipedream2bw-train"]:
        options, overrides = split_args(cmd[1:])
    else:
        return None
    nproc = [b for a, b in zip(options, options[1:]) if a == "--nproc-per-node"]
    nproc += [a.split("=", 1)[1] for a in options if a.startswith("--nproc-per-node=")]
    if "--nnodes" in options or not nproc or not nproc[0].isdigit() or "-m" in overrides:
        return None
    if any("$" in a for a in overrides):
        return None
    return int(nproc[0]), overrides


# what a block's earlier commands make (a token file, a run to resume): absent when a command is checked alone
MADE_EARLIER = ("is not a file; point data.path at", "is neither 'auto', 'never' nor an existing path")


@pytest.mark.long  # ~45 commands composed and checked: 12 s of CPU, 24-80 s on 2 loaded cores
def test_every_training_command_passes_the_launch_check_for_its_ranks():
    # issue 43: docs/memory.md's "torchrun --nproc-per-node 2 ... swap.weights=true" kept the default 4 stages:
    # "world size (2) is not divisible by pipeline.num_stages (4)"; keys alone (the check above) cannot see that
    from pipedream2bw import precheck

    refused = []
    for block in CHECKED + RUNNABLE:
        for cmd in commands(block.text):
            launch = launch_of(cmd)
            if launch is not None:
                mistake = precheck.check(launch[1], world_size=launch[0], local_world_size=launch[0])
                if mistake is not None and not any(m in mistake for m in MADE_EARLIER):
                    refused.append(f"{block.id}: {' '.join(cmd)}\n  -> {mistake}")
    assert not refused, "\n".join(refused)


def test_every_page_has_shell_blocks_the_checks_recognise():
    kinds = {check_command(cmd, check=False) for b in CHECKED + RUNNABLE for cmd in commands(b.text)}
    assert {"train", "pipedream2bw.sweep", "partitioner", "checkpoint", "script", "sbatch"} <= kinds, kinds
    assert len(RUNNABLE) >= 5


# ---- runnable blocks -----------------------------------------------------------------------------------


@pytest.fixture
def doc_cwd(tmp_path):
    """A fresh working directory as the repository's root, for what the docs' commands name there: scripts/,
    examples/ and the shipped corpus; no file the docs do not say how to get (a corpus.txt was made up here)."""
    for name in ("scripts", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "pipedream2bw").mkdir()  # no __init__.py: the installed package still imports
    (tmp_path / "pipedream2bw" / "data").symlink_to(ROOT / "pipedream2bw" / "data")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
@pytest.mark.long
def test_runnable_block_runs_at_tiny_size(block, doc_cwd):
    env = {**os.environ, TINY_ENV: "1", "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=doc_cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, f"{block.id}:\n{block.text}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


MAX_RANKS_RUN = 4  # a command that starts more (docs/sharding.md's 8) is checked for its ranks above, not run
MAKERS = (["python", "-c"], ["python", "-m", "partitioner", "plan", "--out"])  # what a later training line reads


def training_runs(block: Block) -> List[str]:
    """The block's one-node training commands of at most MAX_RANKS_RUN ranks, in order, each as written, and
    before each the lines of the block that make its inputs (a token file, a plan)."""
    out = []
    for cmd in commands(block.text):
        launch = launch_of(cmd)
        if (launch is not None and launch[0] <= MAX_RANKS_RUN) or any(cmd[: len(m)] == m for m in MAKERS):
            out.append(shlex.join(cmd))
    return out if any(launch_of(shlex.split(c)) for c in out) else []


NOT_RUN = {"docs/data.md:12": "corpus.txt stands for the user's own text files"}
TRAINS = [b for b in CHECKED if training_runs(b) and b.id not in NOT_RUN]


@pytest.mark.slow
@pytest.mark.long  # ~12 blocks, ~20 tiny trainings: 3-8 min on 2 cores
@pytest.mark.parametrize("block", TRAINS, ids=[b.id for b in TRAINS])
def test_every_one_node_training_command_runs_as_written(block, doc_cwd):
    # issue 43: the check above composes a command; a command can compose and still fail as written (a file it
    # reads, a resume of the line before, a model's extras): here each runs, in its block's order, at tiny size
    script = "\n".join(training_runs(block))
    env = {**os.environ, TINY_ENV: "1", "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=doc_cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{block.id}:\n{script}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def test_the_runs_cover_every_one_node_training_command():
    ran = {c for b in TRAINS for c in training_runs(b)}
    left = [
        f"{b.id.rsplit(':', 1)[0]}: {shlex.join(c)}"  # the page, not its line: an edit above moves the line
        for b in CHECKED
        for c in commands(b.text)
        if launch_of(c) is not None and shlex.join(c) not in ran
    ]
    assert left == [
        "docs/data.md: torchrun --nproc-per-node 4 -m pipedream2bw.train data.path=data/corpus.bin "
        "model.vocab_size=256 data.val_fraction=0.05 train.eval_every=50",  # NOT_RUN
        "docs/sharding.md: torchrun --nproc-per-node 8 -m pipedream2bw.train pipeline.num_stages=2 "
        "pipeline.data_parallel=4 pipeline.num_microbatches=4 optim.sharded=true optim.name=adamw",  # 8 ranks
    ], left


FITS_ONLY_SPLIT = "docs/planner.md"  # its block under "A model that fits only with `t > 1`"


@pytest.mark.slow
@pytest.mark.long  # a plan and a 4-rank training of 40 steps under torch.profiler's memory events: ~1-2 min loaded
def test_the_model_that_fits_only_at_t_2_is_planned_so_and_trains_within_its_memory(doc_cwd, tmp_path):
    # issue 44: the planning command as written plans 2 x 1 x 2 and no plan at t = 1; the training command, composed
    # from its text at full size (not the tiny run), names the plan's values, trains (the loss falls) and every
    # rank's measured peak tensor bytes stay within the plan's memory per device.
    import json

    from dist_helper import spawn
    from test_sharding import train_measured

    from partitioner.__main__ import compose as compose_run
    from partitioner.auto import plan_config
    from partitioner.plans import load_plan
    from pipedream2bw.config import ConfigError

    block = next(b for b in ALL if b.id.startswith(FITS_ONLY_SPLIT) and "plan_t2.yaml" in b.text)
    plan_cmd, train_cmd = commands(block.text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(TINY_ENV, None)
    proc = subprocess.run(plan_cmd, cwd=doc_cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "chosen plan (#0): mesh 2 x 1 x 2" in proc.stdout, proc.stdout + proc.stderr
    plan = load_plan(doc_cwd / "plan_t2.yaml")
    with pytest.raises(ConfigError, match=r"no plan fits"):
        plan_config(compose_run(plan_cmd[plan_cmd.index("--out") + 2 :]), search_tensor=False)  # t = 1 only
    cfg = compose_run(train_cmd[train_cmd.index("pipedream2bw.train") + 1 :])
    p = cfg.pipeline
    assert (p.num_stages, p.data_parallel, p.tensor_parallel, p.microbatch_size, p.num_microbatches, p.balance) == (
        plan.num_stages, plan.data_parallel, plan.tensor_parallel, plan.microbatch_size, plan.num_microbatches,
        plan.balance,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    results = spawn(train_measured, world_size=4, args=([cfg], [str(run_dir)]), log_dir=logs, timeout_s=400)
    assert all(r.exitcode == 0 for r in results), "\n".join(r.log for r in results)
    summary = json.loads((run_dir / "summary.json").read_text())
    peaks = [int((run_dir / f"peak_rank{r}.txt").read_text()) for r in range(4)]
    losses = summary["losses"]
    print(f"peaks {peaks} of {plan.memory_per_device_bytes}; losses {losses[:2]} .. {losses[-2:]}")
    print(f"samples/s {summary['samples_per_s']:.1f}; predicted peaks {plan.predicted_peak_memory_bytes}")
    assert max(peaks) <= plan.memory_per_device_bytes, (peaks, plan.memory_per_device_bytes)
    assert summary["final_loss"] < summary["losses"][0] - 0.5


# ---- example outputs ------------------------------------------------------------------------------------


def output_pattern(expected: str) -> re.Pattern:
    """``...`` alone on a line stands for any lines (none included), within a line for any text."""
    parts = []
    for line in expected.splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(r"[^\n]*".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    return re.compile("".join(parts))


@pytest.mark.parametrize(
    "block",
    # ``long`` in the info string: a command of 15 s or more (docs/planner.md's GPT-3 plan over 1536 devices), in the
    # long tier as the runnable blocks are
    [pytest.param(b, marks=pytest.mark.long) if "long" in b.info else b for b in OUTPUTS],
    ids=[b.id for b in OUTPUTS],
)
def test_example_output_is_what_its_command_prints(block, tmp_path):
    first, _, expected = block.text.partition("\n")
    assert first.startswith("$ "), f"{block.id}: an expected-output block starts with '$ command'"
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(TINY_ENV, None)
    proc = subprocess.run(first[2:], shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    printed = "\n".join(line.rstrip() for line in proc.stdout.splitlines()) + "\n"
    assert output_pattern(expected).fullmatch(printed), f"{block.id}: the page shows\n{expected}\nit prints\n{printed}"


def test_output_pattern():
    assert output_pattern("a\n...\nz ... s\n").fullmatch("a\nb\nc\nz 1.5 s\n")
    assert output_pattern("a\n...\nz\n").fullmatch("a\nz\n")
    assert not output_pattern("a\nb\n").fullmatch("a\nc\n")


# ---- generated pages and size ---------------------------------------------------------------------------


def test_config_reference_is_up_to_date():
    # docs/config.md is written by scripts/gen_config_docs.py from pipedream2bw/config/schema.py's field docstrings.
    assert (ROOT / "docs" / "config.md").read_text() == markdown(), "run: python scripts/gen_config_docs.py"


def test_readme_fits_on_a_few_screens_and_links_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for page in PAGES:
        for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", page.read_text()):
            base = ROOT if page.name == "README.md" else page.parent
            assert (base / link).is_file() or (ROOT / link).is_file(), f"{page.name} links {link}, which is missing"


def _layout_picture() -> str:
    """docs/develop.md's picture of the layers: the first code block of its "Layout" section."""
    text = (ROOT / "docs" / "develop.md").read_text()
    section = text[text.index("## Layout\n") :]
    return section.split("```\n", 2)[1]


def test_layout_picture_shows_every_module_in_its_folder():
    # A folder's paragraph runs from the line naming it ("  run/", "| models/", "partitioner/") to the next folder's.
    folder_line = re.compile(r"^(?:\|\s*|\s*)([a-z_]+)/\s")
    paragraphs: dict = {}
    current = None
    for line in _layout_picture().splitlines():
        m = folder_line.match(line)
        if m:
            current = m.group(1)
        if current is not None:
            paragraphs[current] = paragraphs.get(current, "") + line + "\n"
    picture = _layout_picture()
    missing = []
    for path in sorted((ROOT / "pipedream2bw").rglob("*.py")) + sorted((ROOT / "partitioner").glob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py" and rel.parent.name != "pipedream2bw":
            continue  # a folder's own docstring, not a module of its layer
        if rel.parent == Path("pipedream2bw"):  # the entry points, errors.py: anywhere in the picture
            found = path.name == "__init__.py" or re.search(rf"\b{re.escape(path.name)}\b", picture)
        else:
            folder = rel.parent.name
            found = re.search(rf"\b{re.escape(path.name)}\b", paragraphs.get(folder, ""))
        if not found:
            missing.append(str(rel))
    assert not missing, f"docs/develop.md's Layout picture lacks {missing}: add each to its folder's paragraph"
