#!/usr/bin/env bash
# The arithmetic recipe on CPU, end to end, one command (about 15 minutes on 2 cores; no downloads):
#
#   bash examples/arithmetic/run_cpu.sh [WORK_DIR]
#
# data -> SFT of a ~0.9 M parameter Qwen2 from scratch -> `verl-prm label` -> `verl-prm train` -> GRPO and
# PAV-GRPO (the plugin's estimator on verl DataProtos, verl's policy loss, transformers generation) ->
# evaluation (accuracy table, critic AUROC, best-of-N and PAV beam search, plots). Rerun to resume: finished
# stages are skipped. Results: WORK_DIR/results/results.md and WORK_DIR/results/*.png.
set -euo pipefail
WORK_DIR=${1:-${WORK_DIR:-runs/arithmetic_cpu}}
exec python3 -m verl_prm.recipes.arithmetic --scale cpu --work-dir "$WORK_DIR"
