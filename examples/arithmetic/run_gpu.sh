#!/usr/bin/env bash
# The arithmetic recipe at GPU scale on one H100/H200: a ~25 M parameter Qwen2 trained from scratch on
# "(((a+b)*c)-d) mod 97" problems with 3-6 operations, no downloads.
#
#   bash examples/arithmetic/run_gpu.sh [extra verl overrides for both RL runs]
#
#   1. data, SFT, `verl-prm label` (vLLM back end), `verl-prm train`:
#        python3 -m verl_prm.recipes.arithmetic --scale gpu --stages data,sft,label,pav
#   2. RL twice with verl's own trainer (python3 -m verl.trainer.main_ppo, vLLM rollout) on the policy of step 1:
#      GRPO (algorithm.adv_estimator=grpo), then PAV-GRPO (pav_grpo); same seeds, data and budget, nothing else
#      differs. The verl-prm part is the plugin's config group (+verl_prm=pav: the trainer hook, the pav
#      reward manager, the startup check), the critic of step 1 and algorithm.pav.*.
#   3. verl's model merger turns each run's last FSDP checkpoint into a Hugging Face model; the validation
#      curve (val-core/arithmetic_mod/acc/mean@4, sampled at temperature 1) comes from verl's file logger.
#   4. evaluation (policies, critic step AUROC, best-of-N and PAV beam search, table and plots):
#        python3 -m verl_prm.recipes.arithmetic --scale gpu --stages evaluate
#
# Every stage resumes: finished stages are skipped (their DONE.json), verl resumes from its checkpoints
# (trainer.resume_mode=auto). Results: $WORK_DIR/results/results.md and the PNGs next to it.
set -xeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SCORE_FILE=$REPO/verl_prm/recipes/arithmetic/score.py
WORK_DIR=${WORK_DIR:-$HOME/verl_prm/arithmetic_gpu}
RL_STEPS=${RL_STEPS:-200}
PAV_ALPHA=${PAV_ALPHA:-3.0}
BEST_OF_K=${BEST_OF_K:-4}
SEED=${SEED:-0}
# a step ends right after the result of an operation (verl_prm/recipes/arithmetic/task.py: STEP_REGEX)
STEP_REGEX='=\d+(?=\D)'

python3 -m verl_prm.recipes.arithmetic --scale gpu --work-dir "$WORK_DIR" --stages data,sft,label,pav

# the newest checkpoint of `verl-prm train` (checkpoint-NNNNNNN sorts by step)
CRITIC_PATH=$(ls -d "$WORK_DIR"/pav/checkpoint-* | sort | tail -n 1)

for ADV_ESTIMATOR in grpo pav_grpo; do
    RUN_DIR=$WORK_DIR/verl_rl_$ADV_ESTIMATOR
    mkdir -p "$RUN_DIR"
    if [ ! -f "$RUN_DIR/final/config.json" ]; then
        VERL_FILE_LOGGER_PATH=$RUN_DIR/metrics.jsonl python3 -m verl.trainer.main_ppo \
            "hydra.searchpath=[pkg://verl_prm.config]" \
            +verl_prm=pav \
            verl_prm.critic.path="$CRITIC_PATH" \
            verl_prm.critic.format=value_head \
            "verl_prm.steps.regex='$STEP_REGEX'" \
            verl_prm.placement.pool=colocated \
            algorithm.adv_estimator="$ADV_ESTIMATOR" \
            algorithm.pav.alpha="$PAV_ALPHA" \
            algorithm.pav.best_of_k="$BEST_OF_K" \
            algorithm.use_kl_in_reward=False \
            reward.custom_reward_function.path="$SCORE_FILE" \
            reward.custom_reward_function.name=compute_score \
            data.train_files="$WORK_DIR/data/rl_train.parquet" \
            data.val_files="$WORK_DIR/data/test.parquet" \
            data.train_batch_size=128 \
            data.max_prompt_length=64 \
            data.max_response_length=192 \
            data.filter_overlong_prompts=True \
            data.truncation=error \
            data.seed="$SEED" \
            actor_rollout_ref.model.path="$WORK_DIR/policy" \
            actor_rollout_ref.model.use_remove_padding=True \
            actor_rollout_ref.actor.optim.lr=1e-5 \
            actor_rollout_ref.actor.ppo_mini_batch_size=128 \
            actor_rollout_ref.actor.use_dynamic_bsz=True \
            actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 \
            actor_rollout_ref.actor.use_kl_loss=False \
            actor_rollout_ref.actor.entropy_coeff=0 \
            actor_rollout_ref.rollout.name=vllm \
            actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
            actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
            actor_rollout_ref.rollout.n=8 \
            actor_rollout_ref.rollout.temperature=1.0 \
            actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
            actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
            actor_rollout_ref.rollout.val_kwargs.do_sample=True \
            actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
            actor_rollout_ref.rollout.val_kwargs.n=4 \
            trainer.critic_warmup=0 \
            trainer.logger='["console","file"]' \
            trainer.project_name=verl_prm_arithmetic \
            trainer.experiment_name="arithmetic_${ADV_ESTIMATOR}_alpha${PAV_ALPHA}" \
            trainer.default_local_dir="$RUN_DIR/checkpoints" \
            trainer.resume_mode=auto \
            trainer.n_gpus_per_node=1 \
            trainer.nnodes=1 \
            trainer.val_before_train=True \
            trainer.test_freq=10 \
            trainer.save_freq="$RL_STEPS" \
            trainer.total_training_steps="$RL_STEPS" \
            trainer.total_epochs=1000 \
            "$@"
        python3 -m verl.model_merger merge --backend fsdp \
            --local_dir "$RUN_DIR/checkpoints/global_step_$RL_STEPS/actor" --target_dir "$RUN_DIR/final"
    fi
    python3 -m verl_prm.recipes.arithmetic --scale gpu --work-dir "$WORK_DIR" \
        --import-verl-run "$ADV_ESTIMATOR=$RUN_DIR"
done

python3 -m verl_prm.recipes.arithmetic --scale gpu --work-dir "$WORK_DIR" --stages evaluate
