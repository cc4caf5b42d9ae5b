"""The prover critic: checkpoint formats, packed scoring of all steps in one pass, and a verl Ray worker.

    from verl_prm.critic import ProverCritic
    critic = ProverCritic.from_pretrained("path/to/pav", format="value_head")
    scores = critic.score_texts(prompts, responses)   # prompt_values [B], step_values [B, S], num_steps [B]

The Ray worker (``verl_prm.critic.worker.ProverCriticWorker``) imports verl; it is loaded on first access.
"""

from __future__ import annotations

from verl_prm.critic.formats import FORMATS, CriticFormat
from verl_prm.critic.scorer import CriticScores, ProverCritic

__all__ = ["ProverCritic", "CriticScores", "CriticFormat", "FORMATS", "ProverCriticWorker", "compute_step_values"]


def __getattr__(name: str):
    if name in ("ProverCriticWorker", "compute_step_values"):
        from verl_prm.critic import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'verl_prm.critic' has no attribute {name!r}")
