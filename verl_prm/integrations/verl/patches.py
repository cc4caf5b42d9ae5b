"""``verl-prm patches check|apply``: the upstreamable verl patches in ``patches/``.

Each ``patches/*.diff`` is a unified diff against verl 0.9.1 with paths ``a/verl/...``/``b/verl/...``, applied
with ``-p1`` in the directory that holds the ``verl`` package (site-packages for a wheel install). The plugin
works on unpatched verl; the patches remove the workarounds it needs (see ``patches/README.md``).

    verl-prm patches check              # dry run of every patch against the installed verl
    verl-prm patches apply              # apply them (all or nothing: every patch is checked first)
    verl-prm patches check --target DIR # another directory that holds a verl package (e.g. a checkout)
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
import verl_prm

__all__ = ["PatchStatus", "apply_patches", "check_patches", "find_patches", "installed_verl_root", "main"]

# `--help` text: plain text (the module docstring is reST, whose ``markup`` argparse would print as is).
HELP = """Check or apply the upstreamable verl patches in patches/ (unified diffs against verl 0.9.1; the plugin
works without them, each removes one workaround, see patches/README.md).

    verl-prm patches check              # dry run of every patch against the installed verl
    verl-prm patches apply              # apply them (all or nothing: every patch is checked first)
    verl-prm patches check --target DIR # another directory that holds a verl package (e.g. a checkout)"""


def find_patch_dir() -> Path:
    """The repository's ``patches/`` directory (next to the ``verl_prm`` package)."""
    candidate = Path(verl_prm.__file__).resolve().parents[1] / "patches"
    if not candidate.is_dir():
        raise FileNotFoundError(
            f"no patches directory at {candidate}: the patches ship with the source tree (git clone verl-prm); "
            "pass --patch-dir"
        )
    return candidate


def find_patches(patch_dir: Path | None = None) -> list[Path]:
    """The ``*.diff`` files of ``patch_dir``, in name order (their numbers give the order of application)."""
    directory = Path(patch_dir) if patch_dir is not None else find_patch_dir()
    patches = sorted(directory.glob("*.diff"))
    if not patches:
        raise FileNotFoundError(f"no *.diff files in {directory}")
    return patches


def installed_verl_root() -> Path:
    """The directory that holds the installed ``verl`` package (found without importing verl)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("verl is not installed in this environment: pip install 'verl[verl-core]==0.9.1'")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


@dataclass
class PatchStatus:
    patch: Path
    state: str  # "applies", "applied" (already in the target), "conflict"
    detail: str = ""


def _patch_command(patch: Path, target: Path, *, dry_run: bool, reverse: bool = False) -> list[str]:
    if shutil.which("patch"):
        command = ["patch", "-p1", "--batch", "--forward", "-d", str(target), "-i", str(patch)]
        if reverse:
            command = ["patch", "-p1", "--batch", "--reverse", "-d", str(target), "-i", str(patch)]
        if dry_run:
            command.append("--dry-run")
        return command
    if shutil.which("git"):
        command = ["git", "-C", str(target), "apply", "-p1"]
        if reverse:
            command.append("--reverse")
        if dry_run:
            command.append("--check")
        return command + [str(patch)]
    raise FileNotFoundError("neither `patch` nor `git` is installed: install one of them to check the patches")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=False)


def check_patch(patch: Path, target: Path) -> PatchStatus:
    """Dry-run ``patch`` against ``target``: it applies, is already applied, or conflicts."""
    forward = _run(_patch_command(patch, target, dry_run=True))
    if forward.returncode == 0:
        return PatchStatus(patch, "applies")
    reverse = _run(_patch_command(patch, target, dry_run=True, reverse=True))
    if reverse.returncode == 0:
        return PatchStatus(patch, "applied")
    return PatchStatus(patch, "conflict", (forward.stdout + forward.stderr).strip())


def check_patches(target: Path | None = None, patch_dir: Path | None = None) -> list[PatchStatus]:
    root = Path(target) if target is not None else installed_verl_root()
    if not (root / "verl").is_dir():
        raise FileNotFoundError(f"{root} holds no verl package (expected {root / 'verl'})")
    return [check_patch(patch, root) for patch in find_patches(patch_dir)]


def apply_patches(target: Path | None = None, patch_dir: Path | None = None) -> list[PatchStatus]:
    """Apply every patch that is not applied yet; nothing is changed unless all of them apply or are applied."""
    root = Path(target) if target is not None else installed_verl_root()
    statuses = check_patches(root, patch_dir)
    conflicts = [status for status in statuses if status.state == "conflict"]
    if conflicts:
        names = ", ".join(status.patch.name for status in conflicts)
        raise RuntimeError(f"not applying anything: {names} do not apply to {root}:\n"
                           + "\n".join(status.detail for status in conflicts))
    for status in statuses:
        if status.state == "applies":
            result = _run(_patch_command(status.patch, root, dry_run=False))
            if result.returncode != 0:
                raise RuntimeError(f"{status.patch.name} failed to apply to {root}: {result.stdout}{result.stderr}")
            status.state = "applied now"
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-prm patches", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("check", "apply"))
    parser.add_argument("--target", type=Path, default=None,
                        help="directory that holds the verl package (default: the installed verl's site-packages)")
    parser.add_argument("--patch-dir", type=Path, default=None, help="directory of the *.diff files")
    args = parser.parse_args(argv)
    try:
        if args.action == "check":
            statuses = check_patches(args.target, args.patch_dir)
        else:
            statuses = apply_patches(args.target, args.patch_dir)
    except (FileNotFoundError, ModuleNotFoundError, RuntimeError) as error:
        print(f"verl-prm patches {args.action}: {error}", file=sys.stderr)
        return 1
    for status in statuses:
        print(f"{status.state:>12}  {status.patch.name}")
        if status.detail:
            print("              " + status.detail.replace("\n", "\n              "))
    return 1 if any(status.state == "conflict" for status in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
