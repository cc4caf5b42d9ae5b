"""The CPU RL stage of the arithmetic recipe: GRPO or PAV-GRPO through the plugin's estimator and verl's loss.

One iteration (the advantage path of the verl trainer hook, on one process):

1. ``prompts_per_step`` training problems (the same ones for every run with the same seed) x ``group_size``
   samples each from the current policy with transformers (temperature 1), in verl's batch layout;
2. the outcome reward (``task.compute_score``) at each response's last valid token (``token_level_rewards``);
3. for a PAV estimator: steps by ``verl_prm.steps.split_steps`` (``task.STEP_REGEX``: one per operation), the
   prover critic's ``prompt_values``/``step_values`` by ``ProverCritic.score_policy_batch`` (same tokenizer: the
   policy's ids are read as they are);
4. a verl ``DataProto`` with those tensors and ``uid`` (the prompt of each row: the GRPO group) through
   ``verl_prm.estimators.compute_advantage_with_steps`` with verl's ``algorithm`` config (``adv_estimator`` =
   ``pav_grpo`` or ``grpo``, ``algorithm.pav.alpha``/``best_of_k``);
5. verl's own policy loss (``get_policy_loss_fn("vanilla")`` with a real ``ActorConfig``): on-policy with one
   update per batch, so ``old_log_prob = log_prob.detach()`` and the PPO ratio is 1; one AdamW step.

Every ``eval_every`` iterations the policy's sampled accuracy (temperature 1, fixed seeds shared by all runs) on
held-out problems is logged. State (weights, optimizer, metrics) is saved at each evaluation; a rerun resumes
from it and, since prompts and sampling seeds are functions of (seed, iteration), repeats the uninterrupted run.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from verl_prm.recipes.arithmetic.rollout import Rollouts, response_log_probs, sample
from verl_prm.recipes.arithmetic.task import DATA_SOURCE, STEP_REGEX, Problem, compute_score

__all__ = ["RLConfig", "algorithm_config", "build_data", "evaluate_accuracy", "run_rl"]


@dataclass(frozen=True)
class RLConfig:
    """One RL run. ``estimator`` ``grpo`` is the outcome-only baseline (the critic is not used)."""

    estimator: str = "pav_grpo"
    alpha: float = 3.0
    best_of_k: int = 4
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    max_new_tokens: int = 48
    eval_every: int = 5
    eval_samples: int = 2
    loss_agg_mode: str = "token-mean"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("alpha", "lr", "temperature"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"RLConfig.{name} must be finite and >= 0, got {value!r}")
        for name in ("best_of_k", "steps", "prompts_per_step", "group_size", "max_new_tokens", "eval_every",
                     "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)!r}")


def algorithm_config(config: RLConfig):
    """verl's ``algorithm`` section for the run (what the trainer hook passes to the estimator)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "adv_estimator": config.estimator,
        "norm_adv_by_std_in_grpo": True,
        "pav": {"alpha": float(config.alpha), "best_of_k": int(config.best_of_k)},
    })


def actor_config(config: RLConfig):
    """A real verl ``ActorConfig`` for the policy loss (clip ratios, ``clip_ratio_c``, ``global_batch_info``)."""
    from verl.workers.config.actor import ActorConfig

    batch = config.prompts_per_step * config.group_size
    return ActorConfig(strategy="fsdp", rollout_n=config.group_size, ppo_mini_batch_size=batch,
                       ppo_micro_batch_size_per_gpu=batch, loss_agg_mode=config.loss_agg_mode)


def outcome_rewards(rollouts: Rollouts, problems: Sequence[Problem]) -> torch.Tensor:
    """[B] 0/1 verifier outcome of each response (``problems`` indexed by ``rollouts.prompt_index``)."""
    return torch.tensor([compute_score(DATA_SOURCE, text, problems[i].answer)
                         for text, i in zip(rollouts.texts, rollouts.prompt_index)], dtype=torch.float32)


def build_data(rollouts: Rollouts, rewards: torch.Tensor, uids: Sequence[str], step_tensors: dict | None = None):
    """The verl ``DataProto`` of a rollout batch: ``responses``, ``response_mask``, ``token_level_rewards``
    (the outcome at the last valid token), the step tensors when given, and ``uid`` (the GRPO group)."""
    from verl import DataProto

    mask = rollouts.response_mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    token_level_rewards = torch.zeros_like(mask)
    token_level_rewards.scatter_(1, last[:, None], rewards[:, None])
    tensors = {"responses": rollouts.responses, "response_mask": mask, "token_level_rewards": token_level_rewards}
    tensors.update(step_tensors or {})
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(list(uids), dtype=object)})


def step_tensors(critic, rollouts: Rollouts, tokenizer, *, return_split: bool = False):
    """``step_ids``/``num_steps`` (one step per operation, ``task.STEP_REGEX``) and the critic's raw
    ``step_values``/``prompt_values``."""
    from verl_prm.steps import split_steps

    split = split_steps(rollouts.responses, rollouts.response_mask, tokenizer, regex=STEP_REGEX)
    scores = critic.score_policy_batch(rollouts.prompts, rollouts.responses, rollouts.attention_mask, split,
                                       policy_tokenizer=tokenizer)
    tensors = {"step_ids": split.step_ids, "num_steps": split.num_steps, "step_values": scores.step_values.float(),
               "prompt_values": scores.prompt_values.float()}
    return (tensors, split) if return_split else tensors


def evaluate_accuracy(model, tokenizer, prompt_texts: Sequence[str], problems: Sequence[Problem], *, samples: int,
                      max_new_tokens: int, seed: int, temperature: float = 1.0) -> float:
    """Mean verifier outcome of ``samples`` samples per problem (temperature 1 by default: the policy RL trains)."""
    rollouts = sample(model, tokenizer, prompt_texts, samples, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed)
    return float(outcome_rewards(rollouts, problems).mean())


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def run_rl(policy_path: str | Path, critic_path: str | Path | None, train_problems: Sequence[Problem],
           eval_problems: Sequence[Problem], config: RLConfig, output_dir: str | Path, *,
           progress: bool = True) -> dict:
    """Run (or resume, or skip when complete) one RL run; returns its summary (also in ``summary.json``).

    Output: ``metrics.jsonl`` (one line per iteration: batch accuracy, samples so far, loss, mean |A| of the
    process term; one per evaluation: ``eval_accuracy``), ``state.pt`` (resume point), ``final/`` (the trained
    policy, Hugging Face format) and ``summary.json`` (written last: the run is complete).
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from verl_prm.estimators import PAV_ESTIMATORS, compute_advantage_with_steps
    from verl_prm.recipes.arithmetic.model import render

    output_dir = Path(output_dir)
    summary_path = output_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if summary.get("config") == asdict(config):
            return summary
        raise ValueError(f"{output_dir} holds a finished run with other settings ({summary.get('config')}); "
                         "use another output directory or delete it")
    output_dir.mkdir(parents=True, exist_ok=True)
    uses_critic = config.estimator in PAV_ESTIMATORS
    if uses_critic and critic_path is None:
        raise ValueError(f"estimator {config.estimator!r} needs a critic (pass critic_path)")

    import verl  # noqa: F401  (loads the verl-prm plugin: registers pav_grpo)

    tokenizer = AutoTokenizer.from_pretrained(str(policy_path), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(policy_path), dtype=torch.float32, trust_remote_code=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    critic = None
    if uses_critic:
        from verl_prm.critic import ProverCritic

        critic = ProverCritic.from_pretrained(str(critic_path), format="value_head", device="cpu")
    algorithm = algorithm_config(config)
    actor = actor_config(config)
    loss_fn = get_policy_loss_fn(actor.policy_loss.loss_mode)

    train_texts = [render(tokenizer, p.prompt_text) for p in train_problems]
    eval_texts = [render(tokenizer, p.prompt_text) for p in eval_problems]
    metrics_path, state_path = output_dir / "metrics.jsonl", output_dir / "state.pt"
    start, records = 0, []
    if state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state["config"] != asdict(config):
            raise ValueError(f"cannot resume {output_dir}: settings differ ({state['config']} vs {asdict(config)})")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, records = int(state["step"]), list(state["records"])
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def log(record: dict) -> None:
        records.append(record)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def evaluate(step: int) -> None:
        model.eval()
        accuracy = evaluate_accuracy(model, tokenizer, eval_texts, eval_problems, samples=config.eval_samples,
                                     max_new_tokens=config.max_new_tokens, seed=config.seed + 7919)
        log({"step": step, "samples": step * config.prompts_per_step * config.group_size, "eval_accuracy": accuracy})

    def save_state(step: int) -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "records": records, "config": asdict(config)}, tmp)
        tmp.replace(state_path)

    if start == 0 and not any("eval_accuracy" in r for r in records):
        evaluate(0)
    batch_size = config.prompts_per_step * config.group_size
    bar = tqdm(total=config.steps, initial=start, desc=f"RL {config.estimator}", unit="step", disable=not progress)
    for step in range(start, config.steps):
        rng = random.Random(f"rl-prompts-{config.seed}-{step}")
        chosen = [rng.randrange(len(train_problems)) for _ in range(config.prompts_per_step)]
        model.eval()
        rollouts = sample(model, tokenizer, [train_texts[i] for i in chosen], config.group_size,
                          max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                          seed=config.seed * 100_003 + step)
        problems = [train_problems[i] for i in chosen]
        rewards = outcome_rewards(rollouts, problems)
        steps = step_tensors(critic, rollouts, tokenizer) if uses_critic else None
        uids = [f"{step}-{chosen[i]}-{i}" for i in rollouts.prompt_index]
        data = compute_advantage_with_steps(build_data(rollouts, rewards, uids, steps), algorithm)
        model.train()
        log_prob = response_log_probs(model, rollouts)
        loss, loss_metrics = loss_fn(old_log_prob=log_prob.detach(), log_prob=log_prob,
                                     advantages=data.batch["advantages"], response_mask=rollouts.response_mask,
                                     loss_agg_mode=config.loss_agg_mode, config=actor)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        record = {"step": step + 1, "samples": (step + 1) * batch_size, "batch_accuracy": float(rewards.mean()),
                  "loss": float(loss.detach()), "grad_norm": grad_norm,
                  "response_tokens": float(rollouts.response_mask.sum(dim=1).mean())}
        if steps is not None:
            from verl_prm.advantages import best_of_k, step_progress

            values = best_of_k(steps["step_values"], config.best_of_k)
            prompt = best_of_k(steps["prompt_values"], config.best_of_k)
            progress_terms = step_progress(values, prompt, steps["num_steps"])
            valid = torch.arange(values.shape[1])[None, :] < steps["num_steps"][:, None]
            record["mean_abs_progress"] = float(progress_terms.abs()[valid].mean()) if valid.any() else 0.0
        log(record)
        bar.update(1)
        bar.set_postfix(acc=f"{record['batch_accuracy']:.2f}", refresh=False)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            evaluate(step + 1)
            save_state(step + 1)
    bar.close()
    model.eval()
    final = output_dir / "final"
    shutil.rmtree(final, ignore_errors=True)
    model.save_pretrained(final, safe_serialization=True)
    tokenizer.save_pretrained(final)
    evals = [r for r in records if "eval_accuracy" in r]
    summary = {"config": asdict(config), "final_eval_accuracy": evals[-1]["eval_accuracy"],
               "eval_curve": [(r["step"], r["samples"], r["eval_accuracy"]) for r in evals],
               "final_policy": str(final)}
    _write_json(summary_path, summary)
    return summary
