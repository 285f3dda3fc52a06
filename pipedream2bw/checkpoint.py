"""``python -m pipedream2bw.checkpoint consolidate|export-hf PATH``: the checkpoint tools' command line.

An entry point above io/ and models/: ``consolidate`` is io's, ``export-hf`` writes through models' hf_io.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipedream2bw.errors import ConfigError
from pipedream2bw.io import checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipedream2bw.checkpoint", description=checkpoint.__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write the newest weights of a checkpoint as one plain state_dict")
    c.add_argument(
        "path", type=Path, help="a checkpoint, a checkpoints/ directory or a run directory (newest complete one)"
    )
    c.add_argument(
        "--out", type=Path, default=None, help="output file (default: consolidated_step_<n>.pt beside checkpoints/)"
    )
    e = sub.add_parser(
        "export-hf", help="write the newest weights of a model=hf checkpoint as a Hugging Face model directory"
    )
    e.add_argument("path", type=Path, help="a checkpoint, a checkpoints/ directory or a run directory")
    e.add_argument("--out", type=Path, required=True, help="directory to write (config.json, safetensors shards)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        if args.command == "export-hf":
            from pipedream2bw.models.hf_io import export_checkpoint  # transformers only when asked for

            out = export_checkpoint(args.path, args.out)
        else:
            out = checkpoint.consolidate(args.path, args.out)
    except (FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
