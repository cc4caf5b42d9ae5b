"""Size figures of the package, read from its source (ast and tokenize; nothing is imported).

    python tools/code_stats.py                 lines of code (library, applications), the longest functions,
                                               and how many internal imports sit inside functions
    python tools/code_stats.py --top 20        the 20 longest functions
    python tools/code_stats.py --lazy          also list each import of verl_prm that sits inside a function

A line of code is a line that holds a token other than a comment, a docstring (the first string statement of a
module, class or function) or whitespace. A function's length is the lines of code from its ``def`` line to its
last line, nested functions included. ``tests/unit/test_layers.py`` uses ``function_lengths`` for its limit of
80 lines of code per library function.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENDMARKER, tokenize.ENCODING}


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_line_numbers(source: str) -> set[int]:
    """The numbers of the lines of ``source`` that hold code (see the module docstring)."""
    docstrings = _docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED_TOKENS:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


@dataclass(frozen=True)
class Function:
    name: str  # "verl_prm/module.py::Class.function" (nested: "outer.<locals>.inner")
    lineno: int
    code_lines: int


def function_lengths(path: Path, root: Path = ROOT) -> list[Function]:
    """Every function and method of ``path`` with its lines of code (nested ones listed too, with their own),
    named by ``path`` relative to ``root``."""
    where = path.relative_to(root).as_posix() + "::"
    source = path.read_text()
    code = code_line_numbers(source)
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                length = sum(1 for line in range(child.lineno, child.end_lineno + 1) if line in code)
                found.append(Function(where + qualname, child.lineno, length))
                visit(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, str(path)), "")
    return found


def python_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def library_files(root: Path = ROOT) -> list[Path]:
    """The modules of ``root``/verl_prm outside ``apps/``."""
    apps = root / "verl_prm" / "apps"
    return [p for p in python_files(root / "verl_prm") if apps not in p.parents]


def application_files(root: Path = ROOT) -> list[Path]:
    return python_files(root / "verl_prm" / "apps")


def internal_imports(path: Path) -> list[tuple[int, bool]]:
    """Each import statement of ``path`` that imports from verl_prm: (line, whether it sits inside a function)."""
    found: list[tuple[int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                if any(alias.name.split(".")[0] == "verl_prm" for alias in child.names):
                    found.append((child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                if child.level or (child.module or "").split(".")[0] == "verl_prm":
                    found.append((child.lineno, in_function))
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10, help="how many of the longest library functions to list")
    parser.add_argument("--lazy", action="store_true", help="list the imports of verl_prm inside functions")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout to measure (default: this one), e.g. one made by `git worktree add`")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    library, apps = library_files(root), application_files(root)
    for label, files in (("library (verl_prm/ without apps/)", library), ("applications (verl_prm/apps/)", apps)):
        lines = sum(len(code_line_numbers(p.read_text())) for p in files)
        print(f"{label}: {len(files)} files, {lines} lines of code")
    functions = sorted((f for p in library for f in function_lengths(p, root)), key=lambda f: -f.code_lines)
    print(f"\nthe {args.top} longest library functions (lines of code):")
    for function in functions[: args.top]:
        print(f"  {function.code_lines:4d}  {function.name}")
    long_apps = sorted((f for p in apps for f in function_lengths(p, root) if f.code_lines > 80),
                       key=lambda f: -f.code_lines)
    print(f"\napplication functions over 80 lines of code: {len(long_apps)}")
    for function in long_apps:
        print(f"  {function.code_lines:4d}  {function.name}")
    for label, files in (("library", library), ("applications", apps), ("all of verl_prm", library + apps)):
        imports = [(p, line, lazy) for p in files for line, lazy in internal_imports(p)]
        lazy = [item for item in imports if item[2]]
        share = len(lazy) / len(imports) if imports else 0.0
        print(f"\n{label}: {len(lazy)} of {len(imports)} imports of verl_prm sit inside functions ({share:.0%})"
              if label == "library" else f"{label}: {len(lazy)} of {len(imports)} inside functions ({share:.0%})")
        if args.lazy and label != "all of verl_prm":
            for path, line, _ in lazy:
                print(f"  {path.relative_to(root).as_posix()}:{line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
