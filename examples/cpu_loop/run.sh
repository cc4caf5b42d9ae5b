#!/usr/bin/env bash
# verl's own training loop on CPU: GRPO, then PAV-GRPO, through `python -m verl.trainer.main_ppo` on a tiny
# Qwen2 built locally (no downloads, no GPU). About 2 minutes per run on 2 cores, mostly Ray and worker start-up.
#
#   bash examples/cpu_loop/run.sh [WORK_DIR] [extra main_ppo overrides for both runs]
#
# 1. `python -m verl_prm.apps.cpu_loop prepare` writes WORK_DIR/policy (a Qwen2ForCausalLM with random weights,
#    the arithmetic recipe's character tokenizer), WORK_DIR/critic (a value-head prover critic) and
#    WORK_DIR/data/{train,val}.parquet (arithmetic problems in verl's RL layout).
# 2. main_ppo runs twice with the same data, seeds and batch: algorithm.adv_estimator=grpo, then pav_grpo.
#    The verl-prm parts are the plugin's config group (+verl_prm=pav: trainer hook, pav reward manager, startup
#    checks) and the CPU settings below (docs/cpu_loop.md explains each). verl's console logger prints one line
#    per step with the pav/* metrics; its file logger writes WORK_DIR/<estimator>.jsonl.
set -euo pipefail
WORK_DIR=${1:-${WORK_DIR:-runs/cpu_loop}}
shift || true
STEPS=${STEPS:-2}
SCORE_FILE=$(python3 -c "import verl_prm.apps.arithmetic.score as s; print(s.__file__)")
# bf16 (over float32 master weights) where the CPU has native bf16 matrix instructions, float32 elsewhere
# (docs/cpu_loop.md: how the precision is chosen)
if grep -qwE 'amx_bf16|avx512_bf16|bf16' /proc/cpuinfo 2>/dev/null; then
    ROLLOUT_DTYPE=bfloat16 PARAM_DTYPE=bf16
else
    ROLLOUT_DTYPE=float32 PARAM_DTYPE=fp32
fi

python3 -m verl_prm.apps.cpu_loop prepare "$WORK_DIR"

for ADV_ESTIMATOR in grpo pav_grpo; do
    VERL_FILE_LOGGER_PATH=$WORK_DIR/$ADV_ESTIMATOR.jsonl python3 -m verl.trainer.main_ppo \
        "hydra.searchpath=[pkg://verl_prm.config]" \
        +verl_prm=pav \
        verl_prm.critic.path="$WORK_DIR/critic" \
        verl_prm.critic.dtype=float32 \
        verl_prm.steps.delimiter=null \
        verl_prm.steps.max_tokens=8 \
        verl_prm.placement.pool=colocated \
        algorithm.adv_estimator=$ADV_ESTIMATOR \
        algorithm.use_kl_in_reward=False \
        reward.custom_reward_function.path="$SCORE_FILE" \
        reward.custom_reward_function.name=compute_score \
        data.train_files="$WORK_DIR/data/train.parquet" \
        data.val_files="$WORK_DIR/data/val.parquet" \
        data.train_batch_size=4 \
        data.val_batch_size=8 \
        data.max_prompt_length=64 \
        data.max_response_length=32 \
        data.truncation=error \
        data.dataloader_num_workers=0 \
        actor_rollout_ref.model.path="$WORK_DIR/policy" \
        actor_rollout_ref.actor.optim.lr=1e-3 \
        actor_rollout_ref.actor.ppo_mini_batch_size=4 \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
        actor_rollout_ref.actor.use_kl_loss=False \
        actor_rollout_ref.actor.entropy_coeff=0 \
        actor_rollout_ref.rollout.n=4 \
        actor_rollout_ref.rollout.temperature=1.0 \
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
        actor_rollout_ref.rollout.max_num_seqs=16 \
        actor_rollout_ref.rollout.val_kwargs.do_sample=False \
        actor_rollout_ref.rollout.val_kwargs.n=1 \
        `# --- the CPU platform (verl_prm.integrations.verl.platform) ---` \
        trainer.device=cpu \
        trainer.n_gpus_per_node=1 \
        trainer.nnodes=1 \
        +ray_kwargs.ray_init.num_gpus=1 \
        ray_kwargs.ray_init.num_cpus=16 \
        transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
        actor_rollout_ref.actor.strategy=fsdp2 \
        actor_rollout_ref.rollout.name=hf \
        actor_rollout_ref.rollout.dtype=$ROLLOUT_DTYPE \
        actor_rollout_ref.rollout.free_cache_engine=False \
        actor_rollout_ref.rollout.enable_chunked_prefill=False \
        actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
        actor_rollout_ref.rollout.agent.num_workers=1 \
        actor_rollout_ref.model.use_remove_padding=False \
        +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
        actor_rollout_ref.actor.fsdp_config.param_offload=False \
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
        ++actor_rollout_ref.actor.fsdp_config.mixed_precision="{param_dtype:$PARAM_DTYPE,reduce_dtype:fp32,buffer_dtype:fp32}" \
        ++actor_rollout_ref.ref.fsdp_config.mixed_precision="{param_dtype:$PARAM_DTYPE,reduce_dtype:fp32,buffer_dtype:fp32}" \
        `# --- the run ---` \
        trainer.critic_warmup=0 \
        trainer.logger='[console,file]' \
        trainer.project_name=verl_prm_cpu_loop \
        trainer.experiment_name=$ADV_ESTIMATOR \
        trainer.default_local_dir="$WORK_DIR/checkpoints/$ADV_ESTIMATOR" \
        trainer.resume_mode=disable \
        trainer.val_before_train=False \
        trainer.test_freq=-1 \
        trainer.save_freq=-1 \
        trainer.total_training_steps=$STEPS \
        trainer.total_epochs=100 \
        "$@"
done
