#!/usr/bin/env bash
# PAV-GRPO on HumanEval-style code tasks: Qwen2.5-Coder-0.5B-Instruct policy, outcome = unit tests run in the
# verl-prm sandbox, a prover critic (PAV) scoring every statement-level step, one H100/H200.
#
#   python examples/code/prepare_humaneval.py --local_save_dir ~/data/humaneval      # or prepare_mbpp.py
#   CRITIC_PATH=/path/to/pav bash examples/code/run_qwen2_5_coder_0_5b_humaneval_pav_grpo.sh [more overrides]
#
# The same verl overrides as examples/pav_grpo/run_qwen2_5_0_5b_gsm8k_pav_grpo.sh, plus the code parts:
# - the outcome reward is verl_prm.code.verl_score.compute_score (the task's unit tests in the sandbox; the
#   ground truth of the rows of verl_prm.code.data is the task as JSON);
# - steps are code blocks: the `ast` rule of verl_prm.steps.code at depth 1, i.e. a chat answer's function
#   signature and each statement of its body (with the body of a loop or if) is a step; CODE_STEP_RULE=line
#   makes each line a step, CODE_STEP_RULE=indent uses the indentation regex (verl_prm.steps.code.block_regex).
# ADV_ESTIMATOR=grpo runs the GRPO baseline with nothing else changed.
# The actor's attention is chosen at startup (verl_prm.integrations.verl.attention): flash_attention_2 with
# remove-padding where flash-attn is installed, else sdpa on padded batches (one log line says which).
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-Coder-0.5B-Instruct}
CRITIC_PATH=${CRITIC_PATH:-$HOME/models/pav_qwen2_5_coder_0_5b_humaneval}
DATA_DIR=${DATA_DIR:-$HOME/data/humaneval}
ADV_ESTIMATOR=${ADV_ESTIMATOR:-pav_grpo}
PAV_ALPHA=${PAV_ALPHA:-3.0}
PROJECT=${PROJECT:-verl_prm_code}
CODE_STEP_RULE=${CODE_STEP_RULE:-block}
SANDBOX_TIMEOUT_S=${SANDBOX_TIMEOUT_S:-10}

python3 -m verl.trainer.main_ppo \
    "hydra.searchpath=[pkg://verl_prm.config]" \
    +verl_prm=pav \
    verl_prm.critic.path="$CRITIC_PATH" \
    verl_prm.critic.format=value_head \
    verl_prm.critic.max_tokens_per_batch=32768 \
    verl_prm.steps.delimiter=null \
    verl_prm.steps.code_rule="$CODE_STEP_RULE" \
    verl_prm.steps.code_depth=1 \
    verl_prm.steps.max_steps=48 \
    verl_prm.placement.pool=colocated \
    reward.custom_reward_function.path=pkg://verl_prm.code.verl_score \
    reward.custom_reward_function.name=compute_score \
    +reward.custom_reward_function.reward_kwargs.timeout_s="$SANDBOX_TIMEOUT_S" \
    algorithm.pav.alpha="$PAV_ALPHA" \
    algorithm.pav.best_of_k=1 \
    algorithm.adv_estimator="$ADV_ESTIMATOR" \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=32 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding='${verl_prm.flash_attn:}' \
    +actor_rollout_ref.model.override_config.attn_implementation='${verl_prm.attn_implementation:}' \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
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
    trainer.experiment_name="qwen2_5_coder_0_5b_humaneval_${ADV_ESTIMATOR}_alpha${PAV_ALPHA}" \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=10 \
    "$@"
