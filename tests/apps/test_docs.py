"""The docs site: the generated parts (CLI help, config reference, package map) come from the code and fail
loudly when they cannot; `mkdocs build --strict` passes; the README's links resolve."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "tools" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks():
    return _hooks()


def _flat_fields(cls, prefix):
    keys = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            keys.update(_flat_fields(type(default), f"{prefix}.{f.name}"))
        else:
            keys[f"{prefix}.{f.name}"] = default
    return keys


@pytest.mark.parametrize("section, module, name", [
    ("algorithm.pav", "verl_prm.config", "PavConfig"),
    ("verl_prm", "verl_prm.config.hook", "HookConfig"),
])
def test_config_reference_lists_every_field_with_its_default(hooks, section, module, name):
    cls = getattr(importlib.import_module(module), name)
    expected = _flat_fields(cls, section)
    table = hooks.config_table(section)
    rows = re.findall(r"^\| `([\w.]+)` \| (.*?) \| (.+) \|$", table, re.M)
    assert [key for key, _, _ in rows] == list(expected)  # every field, in the dataclass's order
    for key, default, meaning in rows:
        assert default == hooks.format_default(expected[key]), key
        assert len(meaning) > 10, (key, meaning)
    assert "| `verl_prm.steps.delimiter` | `\"\\n\\n\"` |" in hooks.config_table("verl_prm")


def test_config_docs_come_from_each_fields_doc(hooks):
    table = hooks.config_table("algorithm.pav")
    assert "| `algorithm.pav.alpha` | `3.0` | Weight of the process term: adv = outcome advantage + alpha * A_h." in table
    assert "| `algorithm.pav.clip` | `null` | Clip the process term to [-clip, clip]; null: no clipping. |" in table


def test_a_field_without_a_comment_fails_the_build(hooks):
    from verl_prm.settings import setting

    @dataclasses.dataclass
    class Knobs:
        first: int = setting(1, "Documented.")
        second: float = 0.5

    with pytest.raises(ValueError, match=r"Knobs\.second \(x\.second\) has no doc: declare it"):
        hooks.config_rows(Knobs, "x")


def test_cli_help_is_what_the_command_prints(hooks):
    generated = hooks.cli_help(("bench", "gpu"))
    env = {**os.environ, "COLUMNS": hooks.HELP_COLUMNS}
    printed = subprocess.run([sys.executable, "-m", "verl_prm.apps.cli", "bench", "gpu", "--help"], capture_output=True,
                             text=True, env=env, timeout=120, check=True).stdout
    assert generated == printed.rstrip("\n")
    from verl_prm.apps.cli import COMMANDS, usage

    assert hooks.cli_help() == usage().rstrip("\n")
    every = hooks.cli_all()
    for words in COMMANDS:  # every registered command has its section and its usage line
        assert f"## verl-prm {' '.join(words)}\n" in every
        assert f"$ verl-prm {' '.join(words)} --help\nusage: " in every


def test_unknown_directives_and_commands_fail(hooks):
    with pytest.raises(ValueError, match=r"unknown docs directive <!-- gen:tables x -->"):
        hooks.render("text\n<!-- gen:tables x -->\n")
    with pytest.raises(ValueError, match=r"gen:cli: no command 'verl-prm frobnicate'"):
        hooks.render("<!-- gen:cli frobnicate -->\n")
    with pytest.raises(ValueError, match=r"gen:config: unknown section 'trainer'"):
        hooks.render("<!-- gen:config trainer -->\n")
    assert hooks.render("no directives here\n") == "no directives here\n"


def test_package_map_marks_the_verl_glue(hooks):
    table = hooks.package_map()
    rows = {name: (layer, verl) for layer, name, verl
            in re.findall(r"^\| ([\w ]+) \| `(verl_prm[\w./]*)` \| .*? \| (yes|) \|$", table, re.M)}
    for glue in ("verl_prm.integrations.verl.plugin", "verl_prm.integrations.verl.hook_trainer",
                 "verl_prm.integrations.verl.reward_manager", "verl_prm.integrations.verl.critic_worker"):
        assert rows[glue] == ("verl glue", "yes"), glue
    # the step tensors' context: the glue that verl calls, importing no verl itself
    assert rows["verl_prm.integrations.verl.advantage"] == ("verl glue", ""), "advantage"
    assert rows["verl_prm.integrations.trl"][0] == "TRL glue"
    assert rows["verl_prm.apps.cpu_loop"][0] == "application"
    # the math knows nothing of verl (the layering rule of docs/layout.md)
    for pure in ("verl_prm.advantages/", "verl_prm.advantages.progress", "verl_prm.advantages.fused",
                 "verl_prm.estimators", "verl_prm.steps/", "verl_prm.critic.packing", "verl_prm.critic.scorer"):
        assert rows[pure] == ("library", ""), pure


def test_metrics_table_lists_every_logged_metric():
    names = set()
    for path in (ROOT / "verl_prm").rglob("*.py"):
        if path.parent.name == "bench":  # benchmark table headers (e.g. a pav/grpo ratio), not logged metrics
            continue
        names.update(re.findall(r"[\"'](pav/[\w/]+)[\"']", path.read_text()))
    assert names, "no pav/* metric names found in the code"
    pages = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    missing = sorted(name for name in names if f"`{name}`" not in pages)
    assert not missing, f"metrics logged by the code but not documented in docs/: {missing}"


def test_readme_links_resolve_and_readme_stays_short():
    """A landing page: at most 120 lines, at most 5 result rows; every result is on docs/results.md (in the
    site's nav), which the README links."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    measured = readme.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in measured.splitlines() if line.startswith("| ") and not line.startswith("| claim |")]
    assert 0 < len(rows) <= 5, f"{len(rows)} result rows in the README: move the rest to docs/results.md"
    assert "](docs/results.md)" in measured
    assert "results.md" in (ROOT / "mkdocs.yml").read_text()
    targets = re.findall(r"\]\(((?:docs/)[^)#]+)(?:#[^)]*)?\)", readme)
    assert targets
    for target in targets:
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_mkdocs_build_strict_passes(tmp_path):
    """The CI build: strict mode turns a broken link, anchor, nav entry or API reference into a failure
    (5-16 s on the 2-core machine)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.skip('mkdocs/mkdocstrings-python not installed: pip install -e ".[docs]" to build the docs')
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verl_page = (site / "verl" / "index.html").read_text()
    assert "verl_prm.placement.nnodes" in verl_page and "algorithm.pav.best_of_k" in verl_page
    assert "verl-prm bench gpu --help" in (site / "benchmarks" / "index.html").read_text()
    assert 'id="verl_prm.steps.split_steps"' in (site / "api" / "steps" / "index.html").read_text()
    assert (site / "demo" / "accuracy_vs_iterations.png").is_file()
    shutil.rmtree(site)
