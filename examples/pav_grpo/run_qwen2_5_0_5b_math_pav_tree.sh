#!/usr/bin/env bash
# PAV-GRPO on MATH with tree-shaped groups: each prompt's 8 responses are sampled as a tree and the step values
# are the tree's own node values (the mean outcome of the leaves below a node). No critic, no labels, nothing
# sampled beyond the group. Qwen2.5-0.5B-Instruct policy, one H100/H200 (no memory beyond the GRPO run's).
#
#   python examples/data_preprocess/math_dataset.py --local_save_dir ~/data/math
#   bash examples/pav_grpo/run_qwen2_5_0_5b_math_pav_tree.sh [more overrides]
#
# Differs from the GRPO baseline (run_qwen2_5_0_5b_math_grpo_baseline.sh) only in the verl-prm block (and the
# experiment name); docs/step_values.md, "Tree-shaped groups", has the method and its metrics (pav/tree_*).
# The settings, and why a run should start from them:
# - verl_prm.critic.source=tree, no critic path: the trainer hook has verl's agent loop sample each training
#   group as a tree through the run's own vLLM replicas (validation keeps independent samples). A leaf succeeds
#   iff its reward is above verl_prm.critic.success_threshold (0.5; verl's MATH scorer gives 1 or 0).
# - roots=2, branch_width=2 with the baseline's rollout.n=8: 2 complete responses, then 3 branch points of 2
#   continuations each (8 = 2 + 3 x 2). Two roots keep two independent openings in every group (with one, every
#   leaf would share the root's text up to the first branch point); width 2 makes a branch point's node average
#   at least 3 leaves (the response branched from and its 2 continuations) rather than 2. The arithmetic recipe
#   measured this shape (with branch_rule=every) against GRPO (docs/step_values.md, "Results").
# - branch_rule=confidence: branch after the step boundaries where the policy's next token was least probable
#   (SPO-chain's and TreeRL's rule: branch where the policy is unsure, where outcomes part). `every` would put
#   the 3 branch points at the first boundaries of the responses (breadth-first), where a prose answer's
#   opening step is shared and little is decided; the arithmetic recipe used `every` on 6-step answers. The
#   tree agent loop asks the rollout for the log-probs this rule reads.
# - algorithm.pav.best_of_k=4: the node values are success rates of the current policy; the process term is the
#   progress of its Best-of-4 (the PAV paper's best provers were Best-of-4 of the base policy; the arithmetic
#   recipe's tree arm used 4). ADV_ESTIMATOR=tree_rl or spo_tree use the tree methods' own advantages instead
#   (alpha and best_of_k do not apply to them).
# The actor's attention is chosen at startup (verl_prm.integrations.verl.attention), as in the baseline.
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/math}
ADV_ESTIMATOR=${ADV_ESTIMATOR:-pav_grpo}
PAV_ALPHA=${PAV_ALPHA:-3.0}
PROJECT=${PROJECT:-verl_prm_math}

python3 -m verl.trainer.main_ppo \
    "hydra.searchpath=[pkg://verl_prm.config]" \
    +verl_prm=pav \
    verl_prm.critic.source=tree \
    verl_prm.tree.roots=2 \
    verl_prm.tree.branch_width=2 \
    verl_prm.tree.branch_rule=confidence \
    verl_prm.steps.delimiter='\n\n' \
    algorithm.pav.alpha="$PAV_ALPHA" \
    algorithm.pav.best_of_k=4 \
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
    trainer.experiment_name="qwen2_5_0_5b_math_tree_${ADV_ESTIMATOR}_alpha${PAV_ALPHA}" \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=3 \
    "$@"
