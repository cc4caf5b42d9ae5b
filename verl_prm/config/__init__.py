"""Typed configuration of the plugin, read from verl's config tree.

The estimator knobs live under ``algorithm.pav`` in verl's config (verl passes ``algorithm`` to every
estimator as ``config``). Unknown keys and out-of-range values are errors at the first read, with the key named.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl_prm.advantages import check_softmin_temperature, process_scores
from verl_prm.choices import (Aggregation, CompileMode, MinFormBaseline, PrimeRewardMask, ProcessTerm, TreeRlScale,
                              TreeSegmentWeight)
from verl_prm.settings import check_bounds, check_choices, setting, setting_type

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_PROCESS_WEIGHT", "PavConfig", "read_pav_config"]

# Largest alpha and aggregate_weight. Every estimator multiplies a process score |p| <= 1e3 (a progress or value
# in [-1, 1], divided by a std >= 1e-3 under normalize) by the weight, so one token's term stays <= 1e9 and its
# square <= 1e18: sums and variances over a batch of 1e6 responses of 1e6 steps stay below float32's 3.4e38.
# (Measured without a bound, rewards +-1e3: pav_prime's whitened returns become NaN from about 1e22, pav_pure's
# from 1e37, the others overflow at 1e39.) The paper's weights are 0.2-5.
MAX_PROCESS_WEIGHT = 1e6


@dataclass
class PavConfig:
    """Knobs of the PAV estimators (``algorithm.pav.*``)."""

    alpha: float = setting(3.0, "Weight of the process term: adv = outcome advantage + alpha * A_h. The PAV "
                           "paper used 3-5 for online RL with REINFORCE and 0.5 for beam search (0.2 for its "
                           "largest model).", low=0.0, high=MAX_PROCESS_WEIGHT)
    best_of_k: int = setting(1, "K of the Best-of-K prover whose progress is the process term (1: the critic's "
                             "values as they are; verl_prm.advantages.best_of_k).", low=1)
    process_term: ProcessTerm = setting("progress", "progress: A_h = v_h - v_{h-1} (the method). value: v_h "
                                        "itself, the reward-hackable ablation of the paper's App. G; it warns.")
    clip: Optional[float] = setting(None, "Clip the process term to [-clip, clip]; null: no clipping.",
                                    low=0.0, low_open=True)
    normalize: bool = setting(False, "Divide the process term by its std over the real steps of the batch.")
    drop_truncated: bool = setting(False, "No process term for responses that were truncated (no EOS); needs "
                                   "the `truncated` tensor (the verl hook supplies it).")
    check_inputs: bool = setting(True, "Validate the step tensors and token_level_rewards (finite) against the "
                                 "contract, in one host read per batch; errors name the sample. false: no checks "
                                 "and no host read, so NaN or inf inputs reach the advantages; a step id outside "
                                 "[-1, S - 1] (S = step_values columns) is clamped into that range, so it reads its "
                                 "own response's row, never another response's value.")
    compile: CompileMode = setting("auto", "How the per-token lookup runs: auto (one fused kernel for batches of "
                                   ">= 1M tokens: on CPUs with AVX-512 a C kernel built once per machine, elsewhere "
                                   "torch.compile, compiled once per process; eager below or if the build fails, "
                                   "with a warning), always, never.")
    aggregation: Aggregation = setting("min", "prm_aggregate only: how the step scores of a response become one "
                                       "score (Pan et al. 2023): their min, max, mean, sum or product, or the last "
                                       "step's score.")
    aggregate_weight: float = setting(1.0, "prm_aggregate only: the weight w in reward = R + w * aggregate.",
                                      low=-MAX_PROCESS_WEIGHT, high=MAX_PROCESS_WEIGHT)
    aggregate_with_outcome: bool = setting(True, "prm_aggregate only: whether the outcome R is part of the reward "
                                           "(false: the process score alone).")
    epsilon: float = setting(1e-6, "Small constant of the std normalisations.", low=0.0, low_open=True)
    min_form_temperature: float = setting(0.1, "pav_pure only (PURE's min-form credit assignment): temperature "
                                          "T of the softmin over a response's steps (PURE: 0.1; 0: the hard "
                                          "minimum; else >= 1e-30, where -p/T stays finite in float32).")
    min_form_baseline: MinFormBaseline = setting("token", "pav_pure only: PURE's leave-one-out baseline of the "
                                                 "step rewards: token (the other responses' reward per token "
                                                 "times the step's tokens; PURE's README and training script), "
                                                 "step (their mean step reward: favours fewer steps, and PURE saw "
                                                 "it reward-hacked), none.")
    zero_separator_advantage: bool = setting(True, "pav_pure only: no advantage on the token that ends each step "
                                             "but the last (PURE's step-separator tokens).")
    zero_eos_advantage: bool = setting(False, "pav_pure only: no advantage on the response's last token (PURE's "
                                       "EOS, in its reward mask); false: the EOS keeps the outcome term, the "
                                       "gradient of the decision to stop.")
    min_form_whiten: bool = setting(True, "pav_pure only: whiten the advantages as PURE does by default "
                                    "(zero-advantage tokens out of the count).")
    whiten_returns: bool = setting(True, "pav_prime only (PRIME's leave-one-out process returns): whiten the "
                                   "returns over the batch's response tokens.")
    prime_reward_mask: PrimeRewardMask = setting("step_end", "pav_prime only: where the leave-one-out baseline "
                                                 "applies: step_end (one reward per step, at its last token) or "
                                                 "response (every response token, PRIME's own mask: a baseline "
                                                 "times the tokens left, a length term).")
    tree_rl_scale: TreeRlScale = setting("paper", "tree_rl only: paper ((GA + LA) / sqrt(|L(n)|), TreeRL's "
                                         "formula) or code (TreeRL's code: each leaf's success minus the mean of "
                                         "the other N - 1 leaves, a factor N/(N - 1), and every node value divided "
                                         "by sqrt(its leaves) before the differences: s(n) + s(n) - s(parent), "
                                         "s = N/(N-1) (V - V(root)) / sqrt(|L|)).")
    tree_segment_weight: TreeSegmentWeight = setting("per_leaf", "tree_rl and spo_tree: per_leaf (a node's tokens "
                                                     "enter the loss once per leaf below it, each leaf a row, as "
                                                     "TreeRL trains its paths) or once (each advantage divided by "
                                                     "the node's leaves, so the summed gradient weighs each node "
                                                     "once, as SPO-tree trains each edge).")

    def __post_init__(self) -> None:
        for f in fields(self):
            if setting_type(PavConfig, f.name)[0] is bool and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"algorithm.pav.{f.name} must be true or false, got {getattr(self, f.name)!r}")
        # NaN, inf or a huge weight would turn advantages into NaN: finite and in range, at startup.
        check_bounds(self, lambda name: f"algorithm.pav.{name}")
        check_choices(self, lambda name: f"algorithm.pav.{name}")
        temperature = self.min_form_temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ValueError(f"algorithm.pav.min_form_temperature must be a number, got {temperature!r}")
        check_softmin_temperature("algorithm.pav.min_form_temperature", temperature)
        self.min_form_temperature = float(temperature)

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
