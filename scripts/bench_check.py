"""The throughput guard's figures: ours-2bw's pipeline efficiency recorded in docs/benchmarks.md per shape, and
today's against them (``scripts/bench.py --check`` runs the shapes; this module only reads and compares)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Dict, List, NamedTuple

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
# A row of the guard's table: | name | `bench.py arguments` | recorded efficiency | ...
_ROW = re.compile(r"^\|\s*(?P<name>[^|`]+?)\s*\|\s*`(?P<argv>[^`]*)`\s*\|\s*(?P<eff>[0-9]*\.[0-9]+)\s*\|")
MARKER = "<!-- bench.py --check reads the table below -->"


class Recorded(NamedTuple):
    """One shape the guard runs: its name (small / large microbatch), its bench.py arguments, the efficiency
    recorded for ours-2bw."""

    name: str
    argv: List[str]
    efficiency: float


def recorded(text: str) -> List[Recorded]:
    """The guard's shapes from the first table after ``MARKER`` in ``text`` (docs/benchmarks.md).

    Raises:
        ValueError: no marker, or no row under it.
    """
    if MARKER not in text:
        raise ValueError(f"no throughput guard table in the benchmarks doc (a table after {MARKER!r})")
    rows: List[Recorded] = []
    for line in text.split(MARKER, 1)[1].splitlines():
        if rows and not line.startswith("|"):
            break
        m = _ROW.match(line)
        if m:
            rows.append(Recorded(m["name"], shlex.split(m["argv"]), float(m["eff"])))
    if not rows:
        raise ValueError(f"the throughput guard table after {MARKER!r} has no row '| name | `arguments` | 0.xx |'")
    return rows


def verdicts(shapes: List[Recorded], today: Dict[str, float], *, tolerance: float) -> List[str]:
    """One line per shape: today's efficiency against the recorded one, 'REGRESSED' where it fell by more
    than ``tolerance``; ``today`` maps a shape's name to its efficiency."""
    lines = []
    for shape in shapes:
        eff = today[shape.name]
        verdict = "REGRESSED" if eff < shape.efficiency - tolerance else "ok"
        lines.append(
            f"{verdict:>9}  {shape.name}: ours-2bw efficiency {eff:.2f}, recorded {shape.efficiency:.2f} "
            f"({eff - shape.efficiency:+.2f}; tolerance {tolerance:.2f})"
        )
    return lines


def main(argv=None) -> int:
    """Prints the guard's recorded shapes and figures (what ``scripts/bench.py --check`` compares with)."""
    import argparse

    parser = argparse.ArgumentParser(
        description="The throughput guard's recorded shapes and ours-2bw efficiencies (docs/benchmarks.md); "
        "scripts/bench.py --check measures today's against them."
    )
    parser.add_argument("--doc", type=Path, default=DOC, help="the page with the guard's table (default: %(default)s)")
    args = parser.parse_args(argv)
    for shape in recorded(args.doc.read_text()):
        print(f"{shape.name}: recorded {shape.efficiency:.2f}  bench.py {shlex.join(shape.argv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
