#!/usr/bin/env bash
# Make a PAV for your policy, then train the policy with it (one H100/H200):
#   1. verl-prm label: Monte-Carlo step labels of the base policy on GSM8K train prompts (vLLM back end),
#   2. verl-prm train: a prover critic (PAV) on those labels, initialised from the base policy,
#   3. PAV-GRPO with the trained critic (run_qwen2_5_0_5b_gsm8k_pav_grpo.sh; extra arguments go to verl).
#
#   python examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k
#   bash examples/pav_grpo/run_qwen2_5_0_5b_gsm8k_label_train_pav_grpo.sh [verl overrides]
#
# Each stage resumes when rerun (labels skip finished prompts, training restarts from its newest checkpoint).
# The critic values the Best-of-K prover of the base policy when BEST_OF_K > 1 (the paper's best provers were
# Bo4): the labels keep raw success counts, `verl-prm train --best-of-k` trains on the transformed values, and
# the RL run then uses the critic's values as they are (algorithm.pav.best_of_k=1).
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
WORK_DIR=${WORK_DIR:-$HOME/verl_prm/gsm8k_qwen2_5_0_5b}
LABEL_PROMPTS=${LABEL_PROMPTS:-2000}
N_COV=${N_COV:-4}
N_MC=${N_MC:-8}
BEST_OF_K=${BEST_OF_K:-4}
TRAIN_STEPS=${TRAIN_STEPS:-2000}

verl-prm label \
    --input "$DATA_DIR/train.parquet" \
    --policy "$MODEL_PATH" \
    --output-dir "$WORK_DIR/labels" \
    --backend vllm \
    --n-cov "$N_COV" \
    --n-mc "$N_MC" \
    --prefix-rule first_pit \
    --delimiter '\n\n' \
    --max-new-tokens 1024 \
    --temperature 1.0 \
    --gpu-memory-utilization 0.85 \
    --limit "$LABEL_PROMPTS"

verl-prm train \
    --labels "$WORK_DIR/labels" \
    --output-dir "$WORK_DIR/pav" \
    --init "$MODEL_PATH" \
    --best-of-k "$BEST_OF_K" \
    --max-length 2048 \
    --batch-size 16 \
    --max-steps "$TRAIN_STEPS" \
    --lr 2e-5 \
    --warmup-steps 100 \
    --mixed-precision bf16 \
    --gradient-checkpointing

# the newest checkpoint of the run (checkpoint-NNNNNNN sorts by step)
CRITIC_PATH=$(ls -d "$WORK_DIR"/pav/checkpoint-* | sort | tail -n 1)
export CRITIC_PATH MODEL_PATH DATA_DIR
bash "$(dirname "$0")/run_qwen2_5_0_5b_gsm8k_pav_grpo.sh" "$@"
