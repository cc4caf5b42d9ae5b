"""The ``verl-prm`` command line: a thin dispatcher to the recipes, each a module with ``main(argv)``."""

from __future__ import annotations

import importlib
import sys

# command words -> "module:function"; each function parses its own arguments.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("verl_prm.toy.demo:main", "the planted sub-sequence experiment of the PAV paper, on CPU"),
    ("bench", "advantages"): ("verl_prm.bench.advantages:main", "time the estimators against verl's grpo"),
    ("bench", "steps"): ("verl_prm.bench.steps:main", "time step segmentation"),
    ("bench", "critic"): ("verl_prm.bench.critic:main", "packed vs per-prefix vs padded critic scoring"),
    ("label",): ("verl_prm.labeling.cli:main", "Monte-Carlo step labels from a prover"),
    ("train",): ("verl_prm.training.cli:main", "train a PAV on step labels"),
    ("search",): ("verl_prm.search.cli:main", "best-of-N, beam search on Q + alpha*A, greedy step search"),
    ("eval", "processbench"): ("verl_prm.evaluation.processbench:main", "first-error F1 of a PRM (ProcessBench)"),
    ("recipe", "arithmetic"): ("verl_prm.recipes.arithmetic.pipeline:main", "the arithmetic recipe end to end"),
    ("patches",): ("verl_prm.patching:main", "check or apply the upstreamable verl patches"),
}


def usage() -> str:
    lines = ["usage: verl-prm COMMAND [ARGS...]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<20} {help_text}")
    lines.append("")
    lines.append("Run `verl-prm COMMAND --help` for the arguments of a command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, (target, _) in sorted(COMMANDS.items(), key=lambda item: -len(item[0])):
        if tuple(argv[: len(words)]) == words:
            module_name, function_name = target.split(":")
            function = getattr(importlib.import_module(module_name), function_name)
            result = function(argv[len(words) :])
            return int(result or 0)
    if argv and argv[0] not in ("-h", "--help"):
        print(f"verl-prm: unknown command {' '.join(argv)!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    print(usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
