"""Typed configuration of the plugin, read from verl's config tree.

The estimator knobs live under ``algorithm.pav`` in verl's config (verl passes ``algorithm`` to every
estimator as ``config``). Unknown keys and out-of-range values are errors at the first read, with the key named.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl_prm.advantages import (
    AGGREGATIONS,
    COMPILE_MODES,
    MIN_FORM_BASELINES,
    PRIME_REWARD_MASKS,
    check_softmin_temperature,
    process_scores,
)
from verl_prm.checks import check_number

if TYPE_CHECKING:
    import torch

__all__ = ["PavConfig", "read_pav_config"]

PROCESS_TERMS = ("progress", "value")


@dataclass
class PavConfig:
    """Knobs of the PAV estimators (``algorithm.pav.*``)."""

    # Weight of the process term: adv = out + alpha * A_h. The PAV paper used 3-5 for online RL with
    # REINFORCE and 0.5 for beam search (0.2 for its largest model).
    alpha: float = 3.0
    # Best-of-K transform of the raw critic values, v -> 1 - (1 - v)^K, before progress is taken. Use K > 1 when
    # the critic was trained on Monte-Carlo labels of the base policy and the prover is its Best-of-K policy
    # (the paper's best provers were Bo4). K = 1 uses the critic values as they are.
    best_of_k: int = 1
    # "progress": A_h = v_h - v_{h-1} (the method). "value": v_h itself, the reward-hackable ablation of the
    # paper's App. G; it warns.
    process_term: str = "progress"
    # Clip the process term to [-clip, clip]; None: no clipping.
    clip: Optional[float] = None
    # Divide the process term by its std over the real steps of the batch.
    normalize: bool = False
    # No process term for responses that were truncated (no EOS). Needs the `truncated` tensor.
    drop_truncated: bool = False
    # Validate the step tensors and token_level_rewards (finite) against the contract, in one host read per batch.
    # Errors name the sample. Off: no checks and no host read, so NaN or inf inputs reach the advantages; a step id
    # outside [-1, S - 1] (S = step_values columns) is clamped into that range, so it reads its own response's row
    # (the last step column, or "no step"), never another response's value.
    check_inputs: bool = True
    # How the per-token lookup runs: "auto" (one kernel made by torch.compile for batches of >= 1M tokens,
    # compiled once per process; eager below or if compilation fails, with a warning), "always", "never".
    compile: str = "auto"
    # prm_aggregate only: how the step scores of a response become one score (Pan et al. 2023) ...
    aggregation: str = "min"
    # ... its weight w in reward = R + w * aggregate ...
    aggregate_weight: float = 1.0
    # ... and whether the outcome R is part of the reward (False: the process score alone).
    aggregate_with_outcome: bool = True
    # Small constant of the std normalisations.
    epsilon: float = 1e-6
    # pav_pure only (PURE's min-form credit assignment): temperature T of the softmin over a response's steps
    # (PURE: 0.1; 0: the hard minimum; else >= 1e-30, where -p/T stays finite in float32) ...
    min_form_temperature: float = 0.1
    # ... PURE's leave-one-out baseline of the step rewards: "token" (the other responses' reward per token times
    # the step's tokens; PURE's README and training script), "step" (their mean step reward: favours fewer steps,
    # and PURE saw it reward-hacked), "none" ...
    min_form_baseline: str = "token"
    # ... no advantage on the token that ends each step but the last (PURE's step-separator tokens) ...
    zero_separator_advantage: bool = True
    # ... no advantage on the response's last token (PURE's EOS, in its reward mask). Off: the EOS keeps the
    # outcome term, the gradient of the decision to stop ...
    zero_eos_advantage: bool = False
    # ... and whiten the advantages as PURE does by default (zero-advantage tokens out of the count).
    min_form_whiten: bool = True
    # pav_prime only (PRIME's leave-one-out process returns): whiten the returns over the batch's response tokens ...
    whiten_returns: bool = True
    # ... and where the leave-one-out baseline applies: "step_end" (one reward per step, at its last token) or
    # "response" (every response token, PRIME's own mask: a baseline times the tokens left, a length term).
    prime_reward_mask: str = "step_end"

    def __post_init__(self) -> None:
        for name in ("alpha", "aggregate_weight", "epsilon", "min_form_temperature") + (
            ("clip",) if self.clip is not None else ()
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"algorithm.pav.{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("normalize", "drop_truncated", "check_inputs", "aggregate_with_outcome",
                     "zero_separator_advantage", "zero_eos_advantage", "min_form_whiten", "whiten_returns"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"algorithm.pav.{name} must be true or false, got {getattr(self, name)!r}")
        # NaN or inf in any float knob would turn every advantage into NaN: finite and in range, at startup.
        check_number("algorithm.pav.alpha", self.alpha, 0.0)
        check_number("algorithm.pav.aggregate_weight", self.aggregate_weight)
        if self.clip is not None:
            check_number("algorithm.pav.clip", self.clip, 0.0, low_open=True)
        check_number("algorithm.pav.epsilon", self.epsilon, 0.0, low_open=True)
        if (isinstance(self.best_of_k, bool) or not isinstance(self.best_of_k, (int, float))
                or not math.isfinite(self.best_of_k) or int(self.best_of_k) != self.best_of_k or self.best_of_k < 1):
            raise ValueError(f"algorithm.pav.best_of_k must be an integer >= 1, got {self.best_of_k}")
        self.best_of_k = int(self.best_of_k)
        if self.process_term not in PROCESS_TERMS:
            raise ValueError(f"algorithm.pav.process_term must be one of {PROCESS_TERMS}, got {self.process_term!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"algorithm.pav.compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"algorithm.pav.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        check_softmin_temperature("algorithm.pav.min_form_temperature", self.min_form_temperature)
        if self.min_form_baseline not in MIN_FORM_BASELINES:
            raise ValueError(
                f"algorithm.pav.min_form_baseline must be one of {MIN_FORM_BASELINES}, got {self.min_form_baseline!r}"
            )
        if self.prime_reward_mask not in PRIME_REWARD_MASKS:
            raise ValueError(
                f"algorithm.pav.prime_reward_mask must be one of {PRIME_REWARD_MASKS}, got {self.prime_reward_mask!r}"
            )

    @property
    def uses_values(self) -> bool:
        return self.process_term == "value"

    def process_scores(self, step_values: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
        """``verl_prm.advantages.process_scores`` of the step tensors under these knobs (Best-of-K, the process
        term, clip, normalize, epsilon); ``keep`` [B] bool: responses that get a process score (None: all)."""
        return process_scores(step_values, prompt_values, num_steps, best_of_k_k=self.best_of_k,
                              use_values=self.uses_values, clip=self.clip, normalize=self.normalize, keep=keep,
                              epsilon=self.epsilon)


def _warn_values() -> None:
    # Python's default warning filter shows it once per call site, so a training loop is not flooded.
    warnings.warn(
        "algorithm.pav.process_term='value' rewards the prover's value Q^mu instead of its progress A^mu. The "
        "PAV paper (App. G) found this reward-hackable: the policy learns steps that keep Q high without "
        "progress (e.g. restating the problem). Use it only as an ablation.",
        UserWarning,
        stacklevel=3,
    )


def read_pav_config(algorithm_config: Any) -> PavConfig:
    """``PavConfig`` from verl's algorithm config (DictConfig, dict, verl's ``AlgoConfig`` or None).

    The knobs are read from its ``pav`` entry; a missing entry gives the defaults.
    """
    if isinstance(algorithm_config, PavConfig):
        return algorithm_config
    pav = None
    if algorithm_config is not None:
        getter = getattr(algorithm_config, "get", None)
        pav = getter("pav", None) if getter is not None else getattr(algorithm_config, "pav", None)
    if pav is None:
        config = PavConfig()
    elif isinstance(pav, PavConfig):
        config = pav
    else:
        if isinstance(pav, DictConfig):
            pav = OmegaConf.to_container(pav, resolve=True)
        if not isinstance(pav, dict):
            raise TypeError(f"algorithm.pav must be a mapping of PAV options, got {type(pav).__name__}")
        known = {f.name: f for f in fields(PavConfig)}
        unknown = sorted(set(pav) - set(known))
        if unknown:
            raise ValueError(f"unknown algorithm.pav keys {unknown}. Known keys: {', '.join(known)}")
        config = PavConfig(**pav)
    if config.uses_values:
        _warn_values()
    return config
