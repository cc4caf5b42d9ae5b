"""MkDocs hook: the parts of the docs that come from the code, rendered at build time so they cannot drift.

A page asks for generated text with an HTML comment on a line of its own (invisible where it is not rendered,
e.g. on GitHub); an unknown directive fails the build:

    <!-- gen:cli -->                 `verl-prm --help` (the list of commands)
    <!-- gen:cli WORDS -->           `verl-prm WORDS --help`, e.g. <!-- gen:cli bench gpu -->
    <!-- gen:cli-all -->             every command's help, one section each
    <!-- gen:config algorithm.pav --> the estimator knobs (``verl_prm.config.PavConfig``)
    <!-- gen:config verl_prm -->     the hook's settings (``verl_prm.config.hook.HookConfig``)
    <!-- gen:layout -->              the package map: each module's first docstring line, and which import verl

The config tables read each dataclass field's default and its doc from ``dataclasses.fields`` (declared together
by ``verl_prm.settings.setting``, which also gives pav.yaml its comments and the command lines their help). A field
without a doc is an error that names it: the docs must not list a knob without saying what it does.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
from pathlib import Path
from typing import Any

DIRECTIVE = re.compile(r"^<!-- gen:(?P<kind>[\w-]+)(?P<arg>[^>]*?)\s*-->\s*$", re.M)
HELP_COLUMNS = "100"  # argparse wraps help at $COLUMNS: fixed, so the pages do not depend on the terminal


# ------------------------------------------------------------------------------------------------ CLI help
def cli_help(words: tuple[str, ...] = ()) -> str:
    """The text ``verl-prm WORDS --help`` prints (``verl-prm --help`` for no words), run in this process."""
    from verl_prm.apps.cli import COMMANDS, usage

    if not words:
        return usage().rstrip("\n")
    if words not in COMMANDS:
        raise ValueError(f"gen:cli: no command 'verl-prm {' '.join(words)}'; known: "
                         + ", ".join(" ".join(w) for w in COMMANDS))
    module_name, function_name = COMMANDS[words][0].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    buffer = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        with contextlib.redirect_stdout(buffer):
            function(["--help"])
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise RuntimeError(f"verl-prm {' '.join(words)} --help exited with {exit_.code}") from None
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    text = buffer.getvalue().rstrip("\n")
    if not text.startswith("usage:"):
        raise RuntimeError(f"verl-prm {' '.join(words)} --help printed no usage: {text[:200]!r}")
    return text


def cli_block(words: tuple[str, ...]) -> str:
    command = " ".join(("verl-prm", *words, "--help"))
    return f"```text\n$ {command}\n{cli_help(words)}\n```"


def cli_all() -> str:
    from verl_prm.apps.cli import COMMANDS

    parts = []
    for words, (_, summary) in COMMANDS.items():
        parts.append(f"## verl-prm {' '.join(words)}\n\n{summary[0].upper() + summary[1:]}.\n\n{cli_block(words)}")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------ config tables
def format_default(value: Any) -> str:
    """A default as a user writes it in verl's YAML/Hydra config."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{json.dumps(value)}`"
    if isinstance(value, dict):
        return f"`{json.dumps(value)}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_rows(cls: type, prefix: str) -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every field of a config dataclass; nested dataclasses become dotted keys."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(default):
            rows += config_rows(type(default), key)
            continue
        meaning = f.metadata.get("doc")
        if not meaning:
            raise ValueError(
                f"{cls.__module__}.{cls.__name__}.{f.name} ({key}) has no doc: declare it with "
                "verl_prm.settings.setting(default, doc), where the docs' config reference reads it"
            )
        rows.append((key, format_default(default), meaning))
    return rows


CONFIG_SECTIONS = {
    "algorithm.pav": ("verl_prm.config", "PavConfig"),
    "verl_prm": ("verl_prm.config.hook", "HookConfig"),
}


def config_table(section: str) -> str:
    if section not in CONFIG_SECTIONS:
        raise ValueError(f"gen:config: unknown section {section!r}; known: {', '.join(CONFIG_SECTIONS)}")
    module_name, class_name = CONFIG_SECTIONS[section]
    cls = getattr(importlib.import_module(module_name), class_name)
    rows = config_rows(cls, section)
    out = ["| key | default | meaning |", "|---|---|---|"]
    out += [f"| `{key}` | {_cell(default)} | {_cell(meaning)} |" for key, default, meaning in rows]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ package map
def _imports_verl(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "verl" or a.name.startswith("verl.") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "verl" or node.module.startswith("verl.")):
            return True
    return False


def _summary(tree: ast.Module) -> str:
    doc = ast.get_docstring(tree) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first


def layer_of(module: str) -> str:
    """The layer a module belongs to: the applications (``verl_prm.apps``), the verl glue
    (``verl_prm.integrations.verl``), the TRL glue, or the library."""
    if module == "verl_prm.apps" or module.startswith("verl_prm.apps."):
        return "application"
    if module == "verl_prm.integrations.verl" or module.startswith("verl_prm.integrations.verl."):
        return "verl glue"
    if module.startswith("verl_prm.integrations."):
        return "TRL glue"
    return "library"


LAYER_ORDER = ("library", "verl glue", "TRL glue", "application")


def package_map(package: str = "verl_prm", max_depth: int = 4) -> str:
    """A table of the package's modules (down to ``max_depth`` dots below it), grouped by layer: what each is
    (its docstring's first paragraph) and whether it imports verl (at the top or inside a function). Read from
    the source files, importing nothing."""
    root = Path(importlib.util.find_spec(package).origin).parent
    rows = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).with_suffix("").parts
        is_package = relative[-1] == "__init__"
        parts = relative[:-1] if is_package else relative
        if any(part.startswith("_") for part in parts) or "__pycache__" in relative or len(parts) > max_depth:
            continue
        if not is_package and not (path.parent / "__init__.py").is_file() and path.parent != root:
            continue  # a script in a data folder, not a module
        if not parts:
            continue  # the package itself
        module = ".".join((package, *parts))
        name = module + ("/" if is_package else "")
        tree = ast.parse(path.read_text())
        rows.append((layer_of(module), name, _summary(tree), "yes" if _imports_verl(tree) else ""))
    rows.sort(key=lambda row: (LAYER_ORDER.index(row[0]), row[1].rstrip("/")))
    out = ["| layer | module | what it is | imports verl |", "|---|---|---|---|"]
    out += [f"| {layer} | `{name}` | {_cell(summary)} | {verl} |" for layer, name, summary, verl in rows]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ the hook
def render(markdown: str) -> str:
    """Replace every ``<!-- gen:... -->`` line of a page with the generated text."""

    def replace(match: re.Match) -> str:
        kind, arg = match.group("kind"), match.group("arg").strip()
        if kind == "cli":
            return cli_block(tuple(arg.split())) if arg else f"```text\n$ verl-prm --help\n{cli_help()}\n```"
        if kind == "cli-all":
            return cli_all()
        if kind == "config":
            return config_table(arg)
        if kind == "layout":
            return package_map()
        raise ValueError(f"unknown docs directive <!-- gen:{kind} {arg} -->; see tools/docs_hooks.py")

    return DIRECTIVE.sub(replace, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001  (MkDocs hook signature)
    return render(markdown)
