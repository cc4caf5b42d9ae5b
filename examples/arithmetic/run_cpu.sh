#!/usr/bin/env bash
# The arithmetic recipe on CPU, end to end, one command (no downloads):
#
#   bash examples/arithmetic/run_cpu.sh [WORK_DIR] [recipe options, e.g. --rl-seeds 0 --rl-parallel 1]
#
# data -> SFT of a ~0.9 M parameter Qwen2 from scratch -> the SFT policy's per-step accuracy (the exact
# prover's p) -> `verl-prm label` -> `verl-prm train` -> GRPO, PAV-GRPO with the exact prover and PAV-GRPO with
# the learned PAV, 3 seeds each, through verl's own trainer (`python -m verl.trainer.main_ppo` on the plugin's
# CPU platform, 2 runs at a time) -> evaluation (accuracy table with standard errors, sample-efficiency ratios,
# critic AUROC, best-of-N and PAV beam search with both critics, plots). Rerun to resume: finished stages and
# runs are skipped. Results: WORK_DIR/results/results.md, results.json and WORK_DIR/results/*.png.
#
# Needs the cpu-loop extra: pip install "torch==2.13.0+cpu" -e ".[cpu-loop]" (docs/cpu_loop.md).
# Measured times and numbers: docs/arithmetic.md.
set -euo pipefail
WORK_DIR=${1:-${WORK_DIR:-runs/arithmetic_cpu}}
shift || true
exec python3 -m verl_prm.apps.arithmetic --scale cpu --work-dir "$WORK_DIR" "$@"
