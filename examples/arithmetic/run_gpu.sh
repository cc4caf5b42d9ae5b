#!/usr/bin/env bash
# The arithmetic recipe at GPU scale on one H100/H200: a ~25 M parameter Qwen2 trained from scratch on
# "(((a+b)*c)-d) mod 97" problems with 3-6 operations, no downloads.
#
#   bash examples/arithmetic/run_gpu.sh [WORK_DIR] [recipe options, e.g. --rl-seeds 0 --rl-steps 100]
#
# The same stages and the same verl command as the CPU run (run_cpu.sh), at --scale gpu: data, SFT,
# Monte-Carlo labels (vLLM back end), PAV training, then every RL arm (GRPO, PAV-GRPO with the exact prover,
# PAV-GRPO with the learned PAV) and seed through `python -m verl.trainer.main_ppo` with the plugin
# (+verl_prm=pav), built by verl_prm.apps.arithmetic.verl_rl.main_ppo_command: the run settings are the
# scale's, the device block selects vLLM instead of the CPU platform's `hf` rollout. Each run's command is
# written to WORK_DIR/rl/<arm>_seed<seed>/command.sh, its log next to it. The stages that hold the GPU (sft,
# label, pav, evaluate) each run in a process of their own, whose exit frees the GPU for the next.
#
# Every stage resumes: finished stages and runs are skipped (their DONE.json), verl resumes from its checkpoints
# (trainer.resume_mode=auto). Results: $WORK_DIR/results/results.md and the PNGs next to it.
set -euo pipefail
WORK_DIR=${1:-${WORK_DIR:-$HOME/verl_prm/arithmetic_gpu}}
shift || true
exec python3 -m verl_prm.apps.arithmetic --scale gpu --work-dir "$WORK_DIR" "$@"
