#!/usr/bin/env bash
# PAV-GRPO on MATH with a public PRM as the step scorer: Qwen2.5-Math-PRM-7B beside the Qwen2.5-0.5B-Instruct
# policy on one H100/H200. No labels and no training of a critic: the PRM judges whether each step is correct,
# which is not the progress of a prover (docs/step_values.md, "Learned PAV and public PRMs"), but it covers math.
#
#   python examples/data_preprocess/math_dataset.py --local_save_dir ~/data/math
#   bash examples/pav_grpo/run_qwen2_5_0_5b_math_pav_qwen_prm_7b.sh [more overrides]
#   PRM_PATH=/local/copy/of/Qwen2.5-Math-PRM-7B bash ...    # default: the hub id (downloaded on first use)
#
# Differs from the GRPO baseline (run_qwen2_5_0_5b_math_grpo_baseline.sh) only in the verl-prm block (and the
# experiment name). The settings, and why:
# - format=qwen_prm: the model card's input (its chat template and system prompt, each step followed by
#   <extra_0>) and value (P(positive) of the two-class head at each <extra_0>; docs/critic.md), rebuilt from the
#   policy's prompt and step texts.
# - dtype=bfloat16: 7.07B parameters without an LM head x 2 bytes = 13.2 GiB of weights.
# - max_tokens_per_batch=16384: one micro-batch's activations are 16,384 x (3,584 + 2 x 18,944) x 2 bytes =
#   1.27 GiB (one layer's MLP at a time), so scoring needs 14.5 GiB. Larger micro-batches would grow the
#   activations linearly for little speed (one is already a 2.3e14-FLOP forward; not measured on a GPU). The
#   longest input (1,024 prompt + 2,048 response tokens + the card's system prompt and separators, about
#   3,150) is below the budget and the PRM's 4,096-token context (a longer one stops the run naming the sample:
#   truncation=error).
# - placement.pool=colocated, offload=cpu: the PRM shares the one GPU with vLLM (gpu_memory_utilization=0.5)
#   and the actor, and holds it only while scoring: its weights wait in host memory (13.2 GiB of RAM) between
#   scorings and are copied in and out each step (timing_s/pav_critic_offload), so the rollout's KV cache and
#   the actor's update never share the GPU with them (docs/gpu.md, "Which placement for which critic").
# - algorithm.pav.best_of_k=1: the PRM's values are probabilities that a step is correct, not a prover's
#   success rate, so Best-of-K's transform 1 - (1 - v)^K has no meaning for them.
# The actor's attention is chosen at startup (verl_prm.integrations.verl.attention), as in the baseline; the
# PRM's own is flash_attention_2 where flash-attn is installed, else sdpa.
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
PRM_PATH=${PRM_PATH:-Qwen/Qwen2.5-Math-PRM-7B}
DATA_DIR=${DATA_DIR:-$HOME/data/math}
ADV_ESTIMATOR=${ADV_ESTIMATOR:-pav_grpo}
PAV_ALPHA=${PAV_ALPHA:-3.0}
PROJECT=${PROJECT:-verl_prm_math}

python3 -m verl.trainer.main_ppo \
    "hydra.searchpath=[pkg://verl_prm.config]" \
    +verl_prm=pav \
    verl_prm.critic.path="$PRM_PATH" \
    verl_prm.critic.format=qwen_prm \
    verl_prm.critic.dtype=bfloat16 \
    verl_prm.critic.max_tokens_per_batch=16384 \
    verl_prm.steps.delimiter='\n\n' \
    verl_prm.placement.pool=colocated \
    verl_prm.placement.offload=cpu \
    algorithm.pav.alpha="$PAV_ALPHA" \
    algorithm.pav.best_of_k=1 \
    algorithm.adv_estimator="$ADV_ESTIMATOR" \
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
    trainer.experiment_name="qwen2_5_0_5b_math_qwen_prm_7b_${ADV_ESTIMATOR}_alpha${PAV_ALPHA}" \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=3 \
    "$@"
