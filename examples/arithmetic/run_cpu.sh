#!/usr/bin/env bash
# The arithmetic recipe on CPU, end to end, one command (no downloads):
#
#   bash examples/arithmetic/run_cpu.sh [WORK_DIR]
#
# data -> SFT of a ~0.9 M parameter Qwen2 from scratch -> `verl-prm label` -> `verl-prm train` -> GRPO and
# PAV-GRPO (the plugin's estimator on verl DataProtos, verl's policy loss, transformers generation) ->
# evaluation (accuracy table, critic AUROC, best-of-N and PAV beam search, plots). Rerun to resume: finished
# stages are skipped. Results: WORK_DIR/results/results.md, results.json (with the settings and the package
# versions) and WORK_DIR/results/*.png.
#
# Deterministic for a given machine and package versions: every stage runs torch on 1 thread (the recipe's
# `threads` setting; `--threads N` changes it, and with it possibly the numbers) and seeds its own generators.
# Measured times and numbers: docs/arithmetic.md.
set -euo pipefail
WORK_DIR=${1:-${WORK_DIR:-runs/arithmetic_cpu}}
exec python3 -m verl_prm.recipes.arithmetic --scale cpu --work-dir "$WORK_DIR"
