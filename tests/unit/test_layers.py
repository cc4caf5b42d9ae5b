"""The package's two layers, read from the code's own imports (ast, every module, imports inside functions
included): the library never imports an application (``verl_prm.apps``), directly, lazily or by a
``"module:attr"`` string, and no two modules import each other, directly or through others."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

import verl_prm

PACKAGE_DIR = Path(verl_prm.__file__).parent
APPS = "verl_prm.apps"


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ["verl_prm", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def _known(name: str) -> str | None:
    """The module that ``name`` (a module, or a module's attribute) refers to, if it is one of ours."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """The modules of this package that ``module`` imports anywhere in its code, or names in a string
    ``"package.module"`` / ``"package.module:attr"`` (how a lazy target is written)."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":")[0]
            if text in MODULES:  # a string names a module only when it is the module's whole name
                targets = [text]
        for target in targets:
            known = _known(target)
            if known is not None and known != module:
                found.add(known)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def is_application(module: str) -> bool:
    return module == APPS or module.startswith(APPS + ".")


def test_the_graph_sees_lazy_and_string_imports():
    """The reader of imports finds what the rule is about (else the tests below could not fail)."""
    assert "verl_prm.integrations.verl.hook_trainer" in GRAPH["verl_prm.integrations.verl.plugin"]  # a string
    assert "verl_prm.integrations.verl.platform.fixes" in GRAPH["verl_prm.integrations.verl.platform"]  # in a function
    assert "verl_prm.apps.arithmetic.prover" in GRAPH["verl_prm.apps.arithmetic.verl_rl"]
    assert len(MODULES) > 80


def test_no_library_module_imports_an_application():
    upward = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() if not is_application(module)
                    for target in targets if is_application(target))
    assert upward == [], "library modules that import applications:\n" + "\n".join(upward)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_find_cycles_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    cycles = find_cycles(GRAPH)
    assert cycles == [], "import circles:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_docstrings_point_at_the_docs_not_at_a_missing_file(module):
    assert "DESIGN.md" not in MODULES[module].read_text(), f"{module} cites DESIGN.md, which users do not have"


TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layer", ["unit"])
def test_library_tests_import_no_application(layer):
    """tests/unit tests the library alone: no file of it imports ``verl_prm.apps`` (anywhere in its code)."""
    offenders = []
    for path in sorted((TESTS_DIR / layer).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names if is_application(name)]
    assert offenders == [], "library tests that import applications:\n" + "\n".join(offenders)


def test_every_folder_of_python_modules_is_a_package():
    """setuptools' find_packages skips a folder without ``__init__.py``: its modules would be missing from a wheel."""
    folders = {path.parent for path in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f.relative_to(PACKAGE_DIR)) for f in folders if not (f / "__init__.py").is_file()) == []


# ------------------------------------------------------------------------------------- function length

# Lines of code counted by tools/code_stats.py (no blank lines, comments or docstrings), which reports them:
#   python tools/code_stats.py
_spec = importlib.util.spec_from_file_location("code_stats", TESTS_DIR.parent / "tools" / "code_stats.py")
code_stats = sys.modules.setdefault("code_stats", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(code_stats)

MAX_FUNCTION_LINES = 80


def test_code_lines_skip_blank_lines_comments_and_docstrings():
    source = ('"""module\n\ndocstring"""\n\n\ndef f(x):\n    """doc"""\n    # a comment\n\n    y = (x +\n'
              '         1)  # trailing\n    return y\n')
    assert code_stats.code_line_numbers(source) == {6, 10, 11, 12}


def test_function_lengths_count_each_function_and_its_nested_ones(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("class A:\n    def f(self):\n        def g():\n            return 1\n\n        return g()\n")
    lengths = {f.name: f.code_lines for f in code_stats.function_lengths(path, tmp_path)}
    assert lengths == {"m.py::A.f": 4, "m.py::A.f.<locals>.g": 2}


def test_no_function_is_longer_than_80_lines_of_code():
    """Every function of the package, applications included: at most 80 lines of code."""
    too_long = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for function in code_stats.function_lengths(path, PACKAGE_DIR.parent):
            if function.code_lines > MAX_FUNCTION_LINES:
                too_long.append(f"{function.name} (line {function.lineno}): {function.code_lines} > "
                                f"{MAX_FUNCTION_LINES}")
    assert too_long == [], "functions over their limit of lines of code; split them:\n" + "\n".join(too_long)


def test_the_package_imports_no_study_and_no_test_helper():
    """studies/ and tests/ stay out of the wheel (pyproject: packages verl_prm* only): no module imports them."""
    outside = {"studies", "tests", "scripted_code", "search_support", "sandbox_support", "verl_support", "tiny_model"}
    offenders = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            offenders += [f"{module}:{node.lineno} {name}" for name in names if name.split(".")[0] in outside]
    assert offenders == [], "package modules that import what the wheel does not hold:\n" + "\n".join(offenders)


def test_test_fixtures_stay_out_of_the_package():
    """A module only tests use lives under tests/ (the wheel holds verl_prm* only): the random tiny LM writer is
    there; the closed-form task stays a library module because ``verl-prm bench gpu`` labels it for its training
    section (with the real Monte-Carlo labeller, on a bare machine)."""
    assert "verl_prm.labeling.tiny_model" not in MODULES and (TESTS_DIR / "tiny_model.py").is_file()
    assert "verl_prm.labeling.scripted" not in MODULES
    assert "verl_prm.labeling.closed_form_task" in GRAPH["verl_prm.apps.bench.gpu"]


# ------------------------------------------------------------------------------------- imports inside functions

MAX_IMPORTS_IN_FUNCTIONS = 10


def verl_prm_imports_in_functions(path: Path) -> list[tuple[int, bool]]:
    """(line, commented) of each import of a ``verl_prm`` module (or a relative import) inside a function body
    of the file at ``path``; commented: a comment on its first line or on the line above."""
    source = path.read_text()
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.ImportFrom):
                    names = ["." if child.level else child.module or ""]
                else:
                    names = [alias.name for alias in child.names]
                if any(name == "." or name.split(".")[0] == "verl_prm" for name in names):
                    line = lines[child.lineno - 1]
                    above = lines[child.lineno - 2].strip() if child.lineno > 1 else ""
                    found.append((child.lineno, "#" in line or above.startswith("#")))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return found


def test_imports_in_functions_are_found_with_their_comments(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import verl_prm.steps\n\n\ndef f():\n    import json\n    from verl_prm import steps\n\n"
                    "    # torch: why\n    from verl_prm.steps import code\n\n    class A:\n"
                    "        def g(self):\n            from . import x  # why\n")
    assert verl_prm_imports_in_functions(path) == [(6, False), (9, True), (13, True)]


def test_the_library_imports_itself_at_module_top():
    """At most 10 imports of ``verl_prm`` inside the library's functions (``verl_prm.apps`` aside), each with a
    comment saying why (an import cycle, a ``--help`` free of torch, an optional dependency)."""
    inside, uncommented = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.relative_to(PACKAGE_DIR).parts[0] == "apps":
            continue
        for line, commented in verl_prm_imports_in_functions(path):
            where = f"{path.relative_to(PACKAGE_DIR.parent)}:{line}"
            inside.append(where)
            if not commented:
                uncommented.append(where)
    assert uncommented == [], "imports inside functions without a comment saying why:\n" + "\n".join(uncommented)
    assert len(inside) <= MAX_IMPORTS_IN_FUNCTIONS, "move imports to the module top:\n" + "\n".join(inside)
