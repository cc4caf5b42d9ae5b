#!/usr/bin/env bash
# The GRPO baseline on MATH: Qwen2.5-0.5B-Instruct policy, verl's own grpo advantages, one H100/H200. The MATH
# launchers of this folder (run_qwen2_5_0_5b_math_pav_*.sh) are this run with another verl-prm block.
#
#   python examples/data_preprocess/math_dataset.py --local_save_dir ~/data/math
#   bash examples/pav_grpo/run_qwen2_5_0_5b_math_grpo_baseline.sh [more overrides]
#
# The verl-prm block keeps the plugin's config group (trainer hook pav_sync, reward manager pav: the outcome
# is verl's MATH scorer, the last \boxed{} against the reference) so that every MATH launcher composes the same
# config, with the grpo estimator and verl_prm.score_outcome_estimators=false: no step is scored, this is plain
# verl GRPO. Everything else is the GSM8K launchers' run but the lengths: MATH solutions run longer, so 1,024
# prompt and 2,048 response tokens (GSM8K: 512 and 1,024); the actor's token budgets per GPU (24,576 and
# 32,768) still hold several full sequences.
# The actor's attention is chosen at startup (verl_prm.integrations.verl.attention): flash_attention_2 with
# remove-padding where flash-attn is installed, else sdpa on padded batches (one log line says which).
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/math}
PROJECT=${PROJECT:-verl_prm_math}

python3 -m verl.trainer.main_ppo \
    "hydra.searchpath=[pkg://verl_prm.config]" \
    +verl_prm=pav \
    verl_prm.score_outcome_estimators=false \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding='${verl_prm.flash_attn:}' \
    +actor_rollout_ref.model.override_config.attn_implementation='${verl_prm.attn_implementation:}' \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name="$PROJECT" \
    trainer.experiment_name="qwen2_5_0_5b_math_grpo" \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=3 \
    "$@"
