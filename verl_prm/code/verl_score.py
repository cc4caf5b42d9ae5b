"""verl reward functions for code: run the task's unit tests on the response in the sandbox.

Use in a verl run (``custom_reward_function`` in verl's signature; works with the ``pav`` and ``naive`` reward
managers)::

    reward.custom_reward_function.path=pkg://verl_prm.code.verl_score
    reward.custom_reward_function.name=compute_score
    +reward.custom_reward_function.reward_kwargs.timeout_s=10      # optional sandbox limits

and in ``verl-prm label`` / ``verl-prm search``: ``--reward-fn verl_prm/code/verl_score.py:compute_score``.

``ground_truth`` is a `CodeTask` as JSON (``reward_model.ground_truth`` of the rows of ``verl_prm.code.data``)
or a dict. The result is ``{"score": 1.0 | 0.0, "acc": same, "reason": <sandbox reason>}``: verl logs ``acc``
as the validation metric, and ``reason`` (text) tells why a response failed. ``data_source`` is not used to
pick the scorer (the task kind in the ground truth decides), so any data source name works.

``compute_score_batch`` takes lists (verl's ``batch`` reward manager signature) and runs the sandboxes in
parallel (a bounded pool).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from verl_prm.code.sandbox_config import SandboxConfig
from verl_prm.code.verifier import CodeTask, verify, verify_many

__all__ = ["compute_score", "compute_score_batch", "sandbox_config"]

def sandbox_config(**kwargs: Any) -> SandboxConfig:
    """A `SandboxConfig` from reward kwargs, one per field of it (unknown keys are an error: a typo must not
    silently pass)."""
    known = [field.name for field in dataclasses.fields(SandboxConfig)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"verl_prm.code.verl_score: unknown reward_kwargs {unknown}; known: {known}")
    return SandboxConfig(**kwargs)


def _result(verdict) -> dict:
    return {"score": verdict.score, "acc": verdict.score, "reason": verdict.reason}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs: Any) -> dict:
    """Unit-test outcome of one response: 1.0 iff the program runs to its end with every test passing."""
    limits = {k: v for k, v in kwargs.items() if k not in ("reward_router_address", "reward_model_tokenizer")}
    return _result(verify(CodeTask.from_ground_truth(ground_truth), solution_str, sandbox_config(**limits)))


def compute_score_batch(data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                        extra_infos: Sequence[dict | None] | None = None, *, max_workers: int | None = None,
                        **kwargs: Any) -> list[dict]:
    """`compute_score` over lists, sandboxes in parallel (at most ``max_workers``, default the CPU count)."""
    if not len(data_sources) == len(solution_strs) == len(ground_truths):
        raise ValueError(
            f"compute_score_batch: {len(data_sources)} data sources, {len(solution_strs)} solutions, "
            f"{len(ground_truths)} ground truths"
        )
    pairs = [(CodeTask.from_ground_truth(g), s) for g, s in zip(ground_truths, solution_strs)]
    return [_result(v) for v in verify_many(pairs, sandbox_config(**kwargs), max_workers=max_workers)]
