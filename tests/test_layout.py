"""The package's layers (pyproject's [tool.importlinter], checked by lint-imports in CI): what those contracts
cannot say, as tests."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipedream2bw"


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_config_imports_no_torch_distributed():
    # import-linter forbids only whole external packages (torch), and config needs torch.optim: checked here.
    found = {
        f"{path.name}: {name}"
        for path in sorted((PACKAGE / "config").glob("*.py"))
        for name in _imports(path)
        if name == "torch.distributed" or name.startswith("torch.distributed.")
    }
    assert not found, found
