"""The SFT policy measured on problems: success, groups of samples without an outcome signal, and its per-step
accuracy p (the exact prover's parameter, :mod:`.prover`). The recipe's ``prover`` stage and the difficulty
sweep (:mod:`.sweep`) both measure with :func:`measure_policy`.

- ``success``: mean outcome (temperature 1);
- ``zero_signal_groups``: share of groups of ``group_size`` samples of one prompt whose outcomes are all equal,
  ``(1 - s)^G + s^G`` in expectation at a per-prompt success s;
- ``step_accuracy``: P(operation step h is right | steps before it are right), pooled over steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from verl_prm.apps.arithmetic.task import prefix_correctness
from verl_prm.apps.arithmetic.model import render

__all__ = ["group_statistics", "measure_policy", "step_accuracy"]


def group_statistics(outcomes: np.ndarray) -> dict:
    """``outcomes`` [prompts, G] 0/1 -> success and the share of groups with no outcome signal (all equal)."""
    outcomes = np.asarray(outcomes, dtype=float)
    if outcomes.ndim != 2 or outcomes.shape[1] < 2:
        raise ValueError(f"outcomes must be [prompts, G >= 2], got shape {outcomes.shape}")
    same = (outcomes == outcomes[:, :1]).all(axis=1)
    return {"success": float(outcomes.mean()), "zero_signal_groups": float(same.mean()),
            "all_fail_groups": float((outcomes.sum(axis=1) == 0).mean()), "group_size": int(outcomes.shape[1])}


def step_accuracy(problems, texts: Sequence[str], prompt_index: Sequence[int]) -> dict:
    """Per-step accuracy of operation steps given a correct prefix (``task.prefix_correctness``), pooled and
    per step index."""
    right: dict[int, list[bool]] = {}
    for text, index in zip(texts, prompt_index):
        problem = problems[index]
        correct = prefix_correctness(problem, text)
        for h in range(len(problem.ops)):
            before = True if h == 0 else (len(correct) >= h and correct[h - 1])
            if not before:
                break
            right.setdefault(h, []).append(len(correct) > h and correct[h])
    pooled = [v for values in right.values() for v in values]
    return {"step_accuracy": float(np.mean(pooled)) if pooled else float("nan"),
            "step_accuracy_by_step": [float(np.mean(right[h])) for h in sorted(right)]}


def measure_policy(policy: Path, problems, *, group_size: int, max_new_tokens: int, seed: int) -> dict:
    """Sample ``group_size`` responses per problem from the policy at ``policy`` (T=1) and measure it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.apps.arithmetic.batch import outcome_rewards
    from verl_prm.apps.arithmetic.rollout import sample

    tokenizer = AutoTokenizer.from_pretrained(str(policy), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32, trust_remote_code=False).eval()
    rollouts = sample(model, tokenizer, [render(tokenizer, p.prompt_text) for p in problems], group_size,
                      max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    outcomes = np.zeros((len(problems), group_size))
    seen = [0] * len(problems)
    for reward, index in zip(outcome_rewards(rollouts, problems).tolist(), rollouts.prompt_index):
        outcomes[index, seen[index]] = reward
        seen[index] += 1
    result = group_statistics(outcomes)
    result.update(step_accuracy(problems, rollouts.texts, rollouts.prompt_index))
    result["response_tokens"] = float(rollouts.response_mask.sum(dim=1).mean())
    return result
