"""Choice names shared by the library and the command lines, in a module that imports nothing, so that a
command's ``--help`` and argument checks load no torch (or omegaconf)."""

from __future__ import annotations

__all__ = ["AGGREGATIONS", "CODE_STEP_RULES"]

# How the step scores of a response become one score (verl_prm.advantages.aggregate_step_scores).
AGGREGATIONS = ("min", "max", "mean", "sum", "product", "last")
# verl_prm.steps.code.CODE_STEP_RULES without "delimiter" (the text rules cover it); a test holds them equal.
CODE_STEP_RULES = ("line", "block", "indent")
# Which step prefixes Monte-Carlo values are continued at (verl_prm.monte_carlo), and how a first-pit search labels
# successful responses.
PREFIX_RULES = ("every", "fixed", "first_pit")
SUCCESS_LABELS = ("every", "outcome")
