"""The config reference, read from the config dataclasses' field docstrings: ``--help``'s keys and docs/config.md."""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import inspect
import os
import re
import textwrap
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from pipedream2bw import config as config_module
from pipedream2bw.config import Config, LayerListConfig, register_configs

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
HIDDEN_PREFIXES = ("Removed", "Internal")  # a field whose docstring starts so is left out of --help and the docs
HELP_WIDTH = 120  # --help's lines wrap here (the meaning column's continuation lines under its first)


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its dotted name, default (as the composed config gives it), type and docstring."""

    name: str
    default: Any
    type: str
    doc: str

    @property
    def summary(self) -> str:
        """The docstring's first sentence on one line, whole (--help wraps it, never cuts it)."""
        text = " ".join(self.doc.replace("``", "").split())
        m = re.search(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z])", text)
        return text[: m.start() + 1] if m else text


def field_docs(cls: type) -> Dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (a string literal right after the field), by name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def sections() -> List[Tuple[str, type, str]]:
    """(key prefix, schema, what selects it) for every section of ``Config``, in its order; ``model``
    twice: the GPT's keys and a layer-list factory's (``model=custom``, ``model=hf_gpt2``)."""
    out: List[Tuple[str, type, str]] = []
    for f in dataclasses.fields(Config):
        if f.default_factory is dataclasses.MISSING:
            continue  # a plain top-level key (seed): listed under ""
        schema = f.default_factory
        if f.name == "model":
            out.append(("model", schema, "model=gpt (the default), model=gpt175b"))
            hf = getattr(config_module, "HFModelConfig", None)
            if hf is not None:
                out.append(("model", hf, "model=hf, model=hf_llama: a transformers causal LM"))
            out.append(("model", LayerListConfig, "model=custom, model=hf_gpt2: a layer-list factory (`_target_`)"))
        elif f.name == "optim":
            out.append(("optim", schema, "optim=default; optim=custom takes `_target_` and its keys"))
        else:
            out.append((f.name, schema, ""))
    out.append(("", Config, ""))
    return out


def keys(composed: Optional[Dict[str, Any]] = None) -> List[Tuple[str, str, List[Key]]]:
    """Every user-facing key, by section: (prefix, what selects it, keys).

    Args:
        composed: the default composed config as a plain dict (``configs/config.yaml``'s values over
            the dataclasses' defaults); None: the dataclasses' defaults alone.
    """
    out = []
    for prefix, schema, selects in sections():
        docs = field_docs(schema)
        values = (composed or {}).get(prefix, {}) if prefix else (composed or {})
        use_composed = prefix != "model" or schema is type(Config().model)  # the composed model is the GPT
        rows = []
        for f in dataclasses.fields(schema):
            if prefix == "" and f.default_factory is not dataclasses.MISSING:
                continue  # a section, listed on its own
            doc = docs.get(f.name, "")
            if doc.startswith(HIDDEN_PREFIXES):
                continue
            if use_composed and isinstance(values, dict) and f.name in values:
                default = values[f.name]
            elif f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None
            name = f"{prefix}.{f.name}" if prefix else f.name
            if schema is LayerListConfig and f.name == "target":
                name = "model._target_"
            rows.append(Key(name, default, str(f.type), doc))
        out.append((prefix, selects, rows))
    return out


def fmt(value: Any) -> str:
    """A default as one writes it on the command line (``null``, ``true``, ``[0, 1]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def compose(overrides: Sequence[str] = (), *, config_name: str = "config", hydra: bool = False) -> Any:
    """configs/ composed as the entry points compose it (a DictConfig), before ``from_hydra``.

    Args:
        overrides: command-line overrides.
        config_name: ``config`` (training) or ``sweep``.
        hydra: also return the ``hydra`` section (its help header, run and sweep directories).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_configs()
    OmegaConf.register_new_resolver("pd2bw_run_stamp", lambda: os.environ.get("PD2BW_RUN_STAMP", "plan"), replace=True)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra)


def config_groups() -> Dict[str, List[str]]:
    """configs/' groups and their options (``model: [custom, gpt, ...]``), without the schemas (``base_*``)
    that register_configs adds, and without Hydra's own groups."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        def walk(parent: str) -> Iterator[Tuple[str, List[str]]]:
            for group in sorted(loader.list_groups(parent)):
                path = f"{parent}/{group}" if parent else group
                if path == "hydra" or path.startswith("hydra/"):
                    continue
                options = [o for o in loader.get_group_options(path) if not o.startswith("base_")]
                if options:
                    yield path, options
                yield from walk(path)

        return dict(walk(""))


def help_text(argv: Sequence[str], *, config_name: str = "config") -> str:
    """An entry point's ``--help``: its usage (the config's ``hydra.help.header``), the config groups,
    and every user-facing key with its default (after ``argv``'s overrides) and a one-line meaning."""
    from omegaconf import OmegaConf

    overrides = [a for a in argv if not a.startswith("-")]
    dcfg = compose(overrides, config_name=config_name, hydra=True)
    header = str(dcfg.hydra.help.header).rstrip()
    composed = OmegaConf.to_container(dcfg, resolve=False)
    composed.pop("hydra", None)
    lines = [
        header,
        "",
        "== Configuration groups ==",
        "Compose your configuration from those groups (group=option)",
        "",
    ]
    lines += [f"{group}: {', '.join(options)}" for group, options in config_groups().items()]
    lines += [
        "",
        "== Keys ==",
        "Override any key (key=value; +key=value adds one a factory takes). Defaults as composed now;",
        "docs/config.md explains each in full.",
    ]
    for prefix, selects, rows in keys(composed):
        lines.append("")
        lines.append(f"{prefix or 'top level'}{f' [{selects}]' if selects else ''}:")
        width = max(len(f"{k.name}={fmt(k.default)}") for k in rows)
        for k in rows:
            first = f"  {f'{k.name}={fmt(k.default)}':<{width}}  "
            wrapped = textwrap.wrap(k.summary, width=max(HELP_WIDTH - len(first), 40), break_on_hyphens=False)
            lines.append(first + (wrapped[0] if wrapped else ""))
            lines += [" " * len(first) + more for more in wrapped[1:]]
    lines += ["", "Use --hydra-help to view Hydra's own options (launchers, sweepers, logging)."]
    return "\n".join(lines)


def markdown() -> str:
    """docs/config.md: every key's default and full docstring, section by section (scripts/gen_config_docs.py)."""
    from omegaconf import OmegaConf

    composed = OmegaConf.to_container(compose(), resolve=False)
    groups = config_groups()
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the docstrings in pipedream2bw/config/schema.py; do not "
        "edit. tests/test_docs.py checks it is up to date. -->",
        "",
        "Hydra composes `configs/config.yaml`; override any key on the command line (`key=value`), pick a",
        "config group's option (`group=option`), add a key a model factory takes (`+model.width=512`).",
        "Defaults are those of the default composition (`configs/config.yaml` over the dataclasses).",
        "`python -m pipedream2bw.train --help` lists the same keys with one line each.",
        "",
        "Config groups: "
        + "; ".join(f"`{g}`: {', '.join(f'`{o}`' for o in opts)}" for g, opts in groups.items())
        + ".",
    ]
    for prefix, selects, rows in keys(composed):
        schema = next(s for p, s, sel in sections() if p == prefix and sel == selects)
        title = f"`{prefix}`" if prefix else "Top level"
        out += ["", f"## {title}" + (f" ({selects})" if selects else ""), ""]
        if schema.__doc__ and not schema.__doc__.startswith(f"{schema.__name__}("):  # its own docstring
            out += [" ".join(schema.__doc__.split()), ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        for k in rows:
            doc = " ".join(k.doc.split()).replace("|", "\\|")
            out.append(f"| `{k.name}` | `{fmt(k.default)}` | {doc} |")
    return "\n".join(out) + "\n"


def all_keys() -> List[str]:
    """Every key a command line may set (``pipeline.schedule``, ..., ``model._target_``, ``seed``)."""
    return [k.name for _, _, rows in keys() for k in rows]


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse help for the scripts: the description as written, each option's default after its help unless the
    help names it already (argparse's ArgumentDefaultsHelpFormatter said "(default: ...)" twice there)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default not in (None, argparse.SUPPRESS, False)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):  # argparse shows nothing for an option without help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if not self._shows_default(action) or "default" in text else f"{text} (default: %(default)s)"
