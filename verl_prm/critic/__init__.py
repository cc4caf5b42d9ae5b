"""The prover critic: checkpoint formats and packed scoring of all steps in one pass.

    from verl_prm.critic import ProverCritic
    critic = ProverCritic.from_pretrained("path/to/pav", format="value_head")
    scores = critic.score_texts(prompts, responses)   # prompt_values [B], step_values [B, S], num_steps [B]

The verl Ray worker that holds a critic in a training run is verl glue:
``verl_prm.integrations.verl.critic_worker.ProverCriticWorker``.
"""

from __future__ import annotations

from verl_prm.critic.formats import FORMATS, CriticFormat
from verl_prm.critic.scorer import CriticScores, ProverCritic, SpanScores

__all__ = ["ProverCritic", "CriticScores", "CriticFormat", "FORMATS", "SpanScores"]
