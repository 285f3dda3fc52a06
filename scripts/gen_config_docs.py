"""Writes docs/config.md, the configuration reference, from the field docstrings in pipedream2bw/config/schema.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipedream2bw.config.docs import markdown  # noqa: E402  (after the path: runs from a checkout)
from pipedream2bw.io.fileio import atomic_write_text  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="gen_config_docs.py",
        description="Write docs/config.md from pipedream2bw/config/schema.py's field docstrings "
        "(tests/test_docs.py checks it is up to date).",
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "config.md"), help="the file to write")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    args = parser.parse_args(argv)
    text, out = markdown(), Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'stale: run python scripts/gen_config_docs.py'}")
        return 0 if same else 1
    atomic_write_text(out, text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
