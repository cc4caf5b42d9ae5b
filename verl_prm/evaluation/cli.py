"""`verl-prm eval processbench`: the command line of ``verl_prm.evaluation.processbench`` (first-error F1 of a
process verifier). Its arguments are parsed and checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verl_prm.cli_types import finite_float

__all__ = ["build_parser", "main"]


def _grid(text: str) -> tuple[float, float, int]:
    """``START:STOP:COUNT`` of the tuning grid (``processbench.threshold_grid``)."""
    try:
        start, stop, count = text.split(":")
        start, stop = finite_float()(start), finite_float()(stop)
        if int(count) < 1:
            raise ValueError(count)
        return start, stop, int(count)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"must be START:STOP:COUNT (finite numbers, COUNT >= 1), got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm eval processbench", description="First-error F1 of a process "
                                "verifier on ProcessBench-format rows (or PRM800K rows).")
    p.add_argument("--input", required=True, help="jsonl/json/parquet rows")
    p.add_argument("--format", choices=("auto", "processbench", "prm800k"), default="auto")
    p.add_argument("--critic", default=None, help="critic checkpoint (HF directory)")
    p.add_argument("--critic-format", default="value_head")
    p.add_argument("--scores-field", default=None, help="read step scores from this field instead of a critic")
    p.add_argument("--score", choices=("values", "progress"), default="values",
                   help="threshold the critic's values or their progress (PAV)")
    p.add_argument("--best-of-k", type=int, default=1)
    p.add_argument("--threshold", type=finite_float(), default=None, help="fixed threshold (no tuning)")
    p.add_argument("--thresholds", type=_grid, default=None,
                   help="tuning grid START:STOP:COUNT (default 0:1:101 for values, -1:1:201 for progress)")
    p.add_argument("--tune-fraction", type=finite_float(0.0, 1.0, low_open=True, high_open=True), default=0.5, help="share of samples used to tune the threshold")
    p.add_argument("--prompt-format", default="{problem}\n\n", help="what the critic reads before the steps")
    p.add_argument("--separator", default="\\n\\n", help="text between steps (escapes decoded)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write per-sample predictions (jsonl) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # torch: not at `verl-prm eval processbench --help`
    from verl_prm.evaluation.processbench import evaluate, read_first_error_samples

    samples = read_first_error_samples(args.input, args.format, args.scores_field)
    if not samples:
        raise SystemExit(f"{args.input}: no samples")
    report = evaluate(args, samples)
    predictions = report.pop("_predictions")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            for row in predictions:
                f.write(json.dumps(row) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
