#!/usr/bin/env bash
# The GRPO baseline of run_qwen2_5_0_5b_gsm8k_pav_grpo.sh: the same run with algorithm.adv_estimator=grpo and
# nothing else changed. The advantages are verl's own grpo; the hook still scores the steps with the critic, so
# the pav/* metrics of both runs can be compared (add verl_prm.score_outcome_estimators=false to skip the
# critic and run plain verl GRPO).
set -xeuo pipefail
ADV_ESTIMATOR=grpo exec bash "$(dirname "$0")/run_qwen2_5_0_5b_gsm8k_pav_grpo.sh" "$@"
