"""Objects the config names by import path (``_target_`` of a model, its loss, an optimizer)."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from pipedream2bw.errors import ConfigError


def locate(path: str, *, what: str) -> Any:
    """The object at import path ``pkg.module.attr`` (attributes may nest: ``pkg.mod.Class.method``).

    Raises:
        ConfigError: naming ``what`` (the config key), the path and the import error.
    """
    if not isinstance(path, str) or not path or "." not in path:
        raise ConfigError(f"{what} ({path!r}) is not an import path; write it as pkg.module.name")
    parts = path.split(".")
    error: Optional[BaseException] = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and not module_name.startswith(e.name):  # the module exists but its own import failed
                raise ConfigError(f"{what} ({path}): importing {module_name} failed: {e}; install what it needs") from e
            error = e
            continue
        except Exception as e:
            raise ConfigError(f"{what} ({path}): importing {module_name} failed: {type(e).__name__}: {e}") from e
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError as e:
            raise ConfigError(
                f"{what} ({path}): module {module_name} has no {'.'.join(parts[cut:])}; check the name"
            ) from e
        return obj
    raise ConfigError(
        f"{what} ({path}) does not import: {error}; check the path and that its package is installed "
        f"(or on PYTHONPATH on every rank)"
    )
