"""Typed configuration of the verl trainer hook (the ``verl_prm`` section of verl's config) and the startup
validation of a whole run config.

The estimator knobs (alpha, best_of_k, clip, ...) stay in ``algorithm.pav`` (``PavConfig``, read by the
estimators). This module adds what the hook needs around them: where the prover critic is and how it is run,
how responses are split into steps, and where the critic's worker group is placed::

    verl_prm:
      critic:    {path, format, max_tokens_per_batch, dtype}
      steps:     {delimiter, regex, max_tokens, max_steps, code_rule, code_depth}
      placement: {pool, n_gpus_per_node, nnodes}
      diagnostics: {reference, signal_threshold}
      refresh:   {every, window, directory}
      tree:      {roots, branch_width, branch_rule, branches_per_response}
      score_outcome_estimators: true

``verl_prm.integrations.verl.run_config.validate_run_config(config)`` checks a composed verl config (DictConfig
or dict) before any model is loaded with these checks and returns the typed ``HookConfig`` and ``PavConfig``.
Every error names the config key and the fix.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl_prm.checks import empty_match_problem, is_class_path
from verl_prm.choices import (
    EXACT_CRITIC_FORMAT,
    ROLLOUT_CRITIC_FORMAT,
    TREE_CRITIC_FORMAT,
    SHARDABLE_FORMATS,
    BranchRule,
    CodeStepRule,
    CriticDtype,
    CriticFormat,
    OffloadMode,
    PlacementPool,
    PrefixRule,
    ShardMode,
    Truncation,
)
from verl_prm.settings import check_bounds, check_choices, from_mapping, setting

__all__ = [
    "EXACT_CRITIC_FORMAT",
    "ROLLOUT_CRITIC_FORMAT",
    "TREE_CRITIC_FORMAT",
    "ConfigError",
    "CriticSection",
    "DiagnosticsSection",
    "HOOK_TRAINER_NAME",
    "HookConfig",
    "PlacementSection",
    "RefreshSection",
    "StepsSection",
    "read_hook_config",
]

# formats that load no critic weights
WEIGHTLESS_FORMATS = (EXACT_CRITIC_FORMAT, ROLLOUT_CRITIC_FORMAT, TREE_CRITIC_FORMAT)
DEFAULT_DELIMITER = "\n\n"  # verl_prm.steps.DEFAULT_DELIMITER (kept here so the check imports no tensor code)
# The name verl's ``trainer.v1.trainer_mode`` selects the hook by (verl_prm.integrations.verl.hook_trainer.PavSyncTrainer).
HOOK_TRAINER_NAME = "pav_sync"
# The verl agent loop that samples a training group as a tree (verl_prm.integrations.verl.tree_rollout).
TREE_AGENT_LOOP_NAME = "pav_tree"


class ConfigError(ValueError):
    """A verl-prm setting in the run config is invalid; the message names the key and the fix."""


@dataclass
class CriticSection:
    """``verl_prm.critic``: the prover critic that scores the steps."""

    path: Optional[str] = setting(None, "Hugging Face checkpoint directory (or hub id) of the prover critic. "
                                  "Required when the hook runs, except with format exact or rollout (then null).")
    format: CriticFormat = setting("value_head", "Checkpoint format (docs/critic.md): value_head (the native one: "
                                   "token-classification head, num_labels=1, as `verl-prm train` writes), qwen_prm "
                                   "(separator token with a two-class head, Qwen2.5-Math-PRM style), pure_prm, "
                                   "math_shepherd (+/- logits of the LM head at a tag token), rlhflow (a verdict "
                                   "turn per step), value_head_lm (Skywork-style value head); exact: no checkpoint, "
                                   "the closed-form values of the exact prover options.prover ('module:Class'); "
                                   "rollout: no checkpoint, Monte-Carlo values sampled from the run's rollout "
                                   "replicas (n_mc, prefix_rule and the mc_* keys; docs/step_values.md); tree: no "
                                   "checkpoint, each group sampled as a tree (verl_prm.tree) whose node values are "
                                   "the mean outcome of the leaves below them.")
    options: dict[str, Any] = setting(factory=dict, doc="Options of the format, e.g. {separator: '<extra_0>'} "
                                      "(qwen_prm), {tag: 'ки'} (math_shepherd), {prover: 'module:Class', <the "
                                      "prover's options>} (exact; e.g. +verl_prm.critic.options.prover="
                                      "verl_prm.apps.arithmetic.prover:ArithmeticProver "
                                      "+verl_prm.critic.options.step_accuracy=0.8).")
    max_tokens_per_batch: int = setting(16384, "Token budget of one critic micro-batch (sequences are packed or "
                                        "length-bucketed up to it).")
    dtype: CriticDtype = setting("auto", "Parameter dtype of the critic: auto (bf16 on GPU, fp32 on CPU), "
                                 "bfloat16, float16, float32.")
    truncation: Truncation = setting("error", "A prompt + response longer than the critic's context: error "
                                     "(names the sample) or left_prompt (drop prompt tokens from the left; never "
                                     "response tokens).")
    allow_pickle: bool = setting(False, "Also load a checkpoint whose weights are pickle only (pytorch_model.bin): "
                                 "unpickling can run arbitrary code, so the default loads safetensors only.")
    calibration: str = setting("auto", "Post-hoc calibration of a checkpoint critic's values: auto (the "
                               "checkpoint's calibration.json when it has one; `verl-prm train` writes it), none "
                               "(the raw values), or the path of a calibration file fitted for these weights. "
                               "Unused with formats exact and rollout.")
    n_mc: int = setting(4, "Format rollout and verl_prm.refresh: continuations sampled per step prefix, through "
                        "the run's rollout replicas with the rollout's sampling settings, scored by the run's reward "
                        "function.")
    prefix_rule: PrefixRule = setting("every", "Format rollout and verl_prm.refresh: which prefixes are sampled: "
                                      "every (every step but the last), fixed (prefixes_per_response evenly "
                                      "spaced steps), first_pit (bisection for the first zero-value step of each "
                                      "failed response, about log2(H) prefixes).")
    prefixes_per_response: int = setting(4, "The number of steps sampled per response under prefix_rule=fixed.")
    mc_token_budget: Optional[int] = setting(None, "The most continuation tokens one training step may generate "
                                             "(null: no bound). A prefix is sampled only if n_mc x its continuation "
                                             "limit fits; the others hold the value of the step before them "
                                             "(pav/mc_prefixes_skipped).")
    mc_success_threshold: float = setting(0.5, "A continuation (format rollout) or a leaf (format tree) "
                                          "succeeds iff its reward is greater than this (verl's rule-based "
                                          "scorers give 1 or 0/-1).")
    pool_group_samples: bool = setting(True, "Format rollout and verl_prm.refresh: the other responses of the "
                                       "group that begin with a sampled prefix's tokens are samples of its value "
                                       "too; their outcomes are pooled with the continuations' (unbiased; "
                                       "pav/mc_pooled_samples).")
    prior_strength: float = setting(0.0, "Shrinkage s of a sampled success rate toward a prior, (successes + s "
                                    "prior) / (samples + s): format rollout, toward the group's success rate "
                                    "before Best-of-K; format tree, a node's value (its leaves the samples) toward "
                                    "the group's success rate; verl_prm.refresh, the labels toward the learned "
                                    "PAV's values (with samples + s trials). 0: the plain rate.", low=0.0)


@dataclass
class StepsSection:
    """``verl_prm.steps``: how a response is split into steps (verl_prm.steps.split_steps)."""

    delimiter: Optional[str] = setting("\n\n", "A step ends at this text delimiter (\"\\n\" for one line per "
                                       "step). The escapes \\n, \\r, \\t and \\\\ are decoded, because a shell and "
                                       "Hydra pass verl_prm.steps.delimiter='\\n' as backslash-n.")
    regex: Optional[str] = setting(None, "A regex whose matches end a step; replaces the delimiter (set "
                                   "delimiter=null).")
    max_tokens: Optional[int] = setting(None, "Fixed-size steps of this many tokens instead of text delimiters "
                                        "(set delimiter=null).")
    max_steps: Optional[int] = setting(None, "Merge trailing steps so that a response has at most this many (the "
                                       "merge count is a metric).")
    code_rule: Optional[CodeStepRule] = setting(None, "Code responses: a step rule of verl_prm.steps.code instead "
                                                "of the text rules (set delimiter=null): block (Python statements "
                                                "found by ast; the indentation rule when the text does not parse), "
                                                "line or indent.")
    code_depth: int = setting(0, "With code_rule: the statement nesting depth that still starts a step (1: a "
                              "function's signature, then each statement of its body).")

    def split(self, response_ids, response_mask, tokenizer):
        """``verl_prm.steps.StepSplit`` of a batch of responses under this rule (the hook and the reward
        manager both split through here, so the steps the critic scores are the steps the metrics count)."""
        if self.code_rule is not None:
            from verl_prm.steps.code import code_split_steps

            return code_split_steps(response_ids, response_mask, tokenizer, self.code_rule, depth=self.code_depth,
                                    max_steps=self.max_steps)
        from verl_prm.steps import split_steps

        return split_steps(response_ids, response_mask, tokenizer, self.delimiter, regex=self.regex,
                           max_tokens=self.max_tokens, max_steps=self.max_steps)


@dataclass
class PlacementSection:
    """``verl_prm.placement``: the verl resource pool of the critic's worker group."""

    pool: PlacementPool = setting("colocated", "colocated: the critic's workers share verl's global pool (the "
                                  "actor and rollout GPUs); own: a pool of n_gpus_per_node x nnodes, which verl's "
                                  "GPU check counts.")
    n_gpus_per_node: int = setting(1, "Only for pool=own: GPUs per node of the critic's own pool.")
    nnodes: int = setting(1, "Only for pool=own: nodes of the critic's own pool.")
    offload: OffloadMode = setting("none", "Between scorings: none keeps the critic's weights on its GPUs; cpu "
                                   "moves them to host memory after each scoring and back before the next (for a "
                                   "critic sharing GPUs with the rollout and the actor; the cost is logged as "
                                   "timing_s/pav_critic_offload).")
    shard: ShardMode = setting("none", "none: every critic worker holds a full replica; fsdp: the critic is "
                               "sharded across the pool's workers with FSDP2 (a critic that does not fit one GPU; "
                               "format value_head, safetensors).")


@dataclass
class DiagnosticsSection:
    """``verl_prm.diagnostics``: metrics that compare the critic's process term with an exact reference
    (``verl_prm.diagnostics``; docs/verl.md, "Metrics"). The reference never enters the advantages."""

    reference: Optional[dict[str, Any]] = setting(None, "Options of an exact prover, as verl_prm.critic.options "
                                                  "for format exact: {prover: 'module:Class', <the prover's "
                                                  "options>}. The hook scores the batch's steps with it too and "
                                                  "logs pav/process_corr, pav/abs_adv_* and "
                                                  "pav/zero_outcome_groups_with_signal; null: no reference, no such "
                                                  "metrics.")
    signal_threshold: float = setting(0.01, "|A_h| above this counts as a process signal "
                                      "(pav/zero_outcome_groups_with_signal).")


@dataclass
class RefreshSection:
    """``verl_prm.refresh``: the learned PAV's value head refitted during the run to values sampled from the
    rollout replicas (``verl_prm.critic.refresh``; docs/step_values.md). Off by default."""

    every: int = setting(0, "Refresh every this many training steps (0: never): on such a step the batch's step "
                         "values are also sampled with the verl_prm.critic n_mc, prefix_rule and mc_* settings (as "
                         "format rollout samples them), written as labels, and the value head is refitted; the "
                         "step's advantages use the values the PAV gave before the refit.")
    window: int = setting(4, "The head is fitted to the labels of the last this many refreshes.")
    directory: Optional[str] = setting(None, "Where the labels (the label format `verl-prm train` reads) and the "
                                       "state a resume needs are written; null: "
                                       "<trainer.default_local_dir>/pav_refresh.")


@dataclass
class TreeSection:
    """``verl_prm.tree``: the shape of a tree-shaped group (``verl_prm.critic.format=tree``; verl_prm.trees): the
    ``actor_rollout_ref.rollout.n`` responses of a prompt are ``roots`` complete responses, then ``branch_width``
    continuations at each of (n - roots) / branch_width branch points at step boundaries."""

    roots: int = setting(2, "Complete responses sampled first (m).", low=1)
    branch_width: int = setting(2, "Continuations sampled at each branch point (b); each is a leaf.", low=1)
    branch_rule: BranchRule = setting("every", "Where the branch points are: every (step boundaries breadth-first: "
                                      "the first boundary of every response, then the second, ...), fixed "
                                      "(branches_per_response evenly spaced boundaries of each root), confidence "
                                      "(the boundaries after which the policy's next token was least probable, "
                                      "from the rollout's log-probs).")
    branches_per_response: int = setting(1, "branch_rule=fixed: the branch points of each root; then rollout.n "
                                         "= roots x (1 + branches_per_response x branch_width).", low=1)


@dataclass
class HookConfig:
    """``verl_prm``: everything the trainer hook needs besides the estimator knobs (``algorithm.pav``)."""

    critic: CriticSection = field(default_factory=CriticSection)
    steps: StepsSection = field(default_factory=StepsSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    diagnostics: DiagnosticsSection = field(default_factory=DiagnosticsSection)
    refresh: RefreshSection = field(default_factory=RefreshSection)
    tree: TreeSection = field(default_factory=TreeSection)
    score_outcome_estimators: bool = setting(True, "With an outcome-only estimator (e.g. the grpo baseline) still "
                                             "score the steps and log the pav/* metrics (the advantages stay "
                                             "verl's own); false skips the critic for such runs.")


def read_hook_config(section: Any) -> HookConfig:
    """``HookConfig`` from the ``verl_prm`` section (DictConfig, dict or None: the defaults).

    Raises ``ConfigError`` for unknown keys or values of the wrong type, and for out-of-range values.
    """
    if isinstance(section, DictConfig):
        section = OmegaConf.to_container(section, resolve=True)
    config = from_mapping(HookConfig, section, "verl_prm", ConfigError)
    if config.steps.delimiter is not None:
        config.steps.delimiter = decode_escapes(config.steps.delimiter)
    for name in ("critic", "steps", "placement", "tree"):
        check_choices(getattr(config, name), lambda key: f"verl_prm.{name}.{key}", ConfigError)
    try:
        check_bounds(config.tree, lambda key: f"verl_prm.tree.{key}")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _check_ranges(config)
    return config


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}


def decode_escapes(text: str) -> str:
    """``\\n``, ``\\r``, ``\\t`` and ``\\\\`` in ``text`` -> newline, return, tab, backslash (nothing else)."""
    return re.sub(r"\\([nrt\\])", lambda match: _ESCAPES[match.group(1)], text)


def _check_ranges(config: HookConfig) -> None:
    _check_critic_section(config.critic, config.placement)
    _check_steps_section(config.steps)
    _check_placement_section(config.placement, config.critic)
    _check_diagnostics_section(config.diagnostics)
    _check_refresh_section(config.refresh, config.critic, config.placement)


def _check_critic_section(critic: CriticSection, placement: PlacementSection) -> None:
    """The critic's own knobs and those of its format (exact, rollout, tree)."""
    if critic.format == EXACT_CRITIC_FORMAT:
        _check_exact_critic_section(critic)
    if critic.format == ROLLOUT_CRITIC_FORMAT:
        _check_rollout_critic_section(critic, placement)
    if critic.max_tokens_per_batch < 1:
        raise ConfigError(f"verl_prm.critic.max_tokens_per_batch must be >= 1, got {critic.max_tokens_per_batch}")
    if not isinstance(critic.calibration, str) or not critic.calibration:
        raise ConfigError(f"verl_prm.critic.calibration must be auto, none or a calibration.json path, got "
                          f"{critic.calibration!r}")
    if critic.format == TREE_CRITIC_FORMAT:
        _check_tree_critic_section(critic, placement)
    if critic.format in WEIGHTLESS_FORMATS and critic.calibration != "auto":
        raise ConfigError(f"verl_prm.critic.calibration={critic.calibration!r} is unused with verl_prm.critic.format="
                          f"{critic.format} (no checkpoint's values to calibrate): remove the override")
    if critic.calibration not in ("auto", "none") and not Path(critic.calibration).exists():
        raise ConfigError(f"verl_prm.critic.calibration={critic.calibration!r} does not exist: name a calibration.json "
                          "written by `verl-prm train` for this critic's weights, or use auto / none")


def _check_steps_section(steps: StepsSection) -> None:
    """Exactly one step rule (delimiter, regex, max_tokens or code_rule), each in range."""
    if steps.regex is not None:
        try:
            pattern = re.compile(steps.regex)
        except re.error as error:
            raise ConfigError(f"verl_prm.steps.regex {steps.regex!r} is not a valid regex: {error}") from None
        problem = empty_match_problem(pattern)
        if problem is not None:
            raise ConfigError(f"verl_prm.steps.regex {steps.regex!r} {problem}: make it match at least one "
                              r"character (e.g. '\n\n+') or look ahead for a marker (e.g. '(?=Step \d)')")
    if steps.max_tokens is not None and steps.max_tokens < 1:
        raise ConfigError(f"verl_prm.steps.max_tokens must be >= 1 or null, got {steps.max_tokens}")
    if steps.max_steps is not None and steps.max_steps < 1:
        raise ConfigError(f"verl_prm.steps.max_steps must be >= 1 or null, got {steps.max_steps}")
    if steps.regex is not None and steps.max_tokens is not None:
        raise ConfigError("verl_prm.steps: set either regex (text steps) or max_tokens (fixed-size steps), not both")
    if steps.regex is not None and steps.delimiter not in (None, DEFAULT_DELIMITER):
        raise ConfigError(
            f"verl_prm.steps.regex replaces the delimiter: set verl_prm.steps.delimiter=null (got {steps.delimiter!r})"
        )
    if steps.max_tokens is not None and steps.delimiter not in (None, DEFAULT_DELIMITER):
        raise ConfigError(
            "verl_prm.steps.max_tokens replaces the delimiter: set verl_prm.steps.delimiter=null "
            f"(got {steps.delimiter!r})"
        )
    if steps.code_rule is not None:
        others = {"delimiter": steps.delimiter if steps.delimiter != DEFAULT_DELIMITER else None,
                  "regex": steps.regex, "max_tokens": steps.max_tokens}
        if any(value is not None for value in others.values()):
            raise ConfigError(
                "verl_prm.steps.code_rule replaces the text rules: set "
                + " ".join(f"verl_prm.steps.{key}=null" for key, value in others.items() if value is not None)
            )
    if steps.code_depth < 0:
        raise ConfigError(f"verl_prm.steps.code_depth must be >= 0, got {steps.code_depth}")
    if steps.code_rule is None and steps.max_tokens is None and steps.regex is None and not steps.delimiter:
        raise ConfigError(
            "verl_prm.steps needs a step rule: a non-empty delimiter, a regex, or max_tokens (fixed-size steps)"
        )


def _check_placement_section(placement: PlacementSection, critic: CriticSection) -> None:
    """Offload, sharding and an own pool only where the critic has weights that can use them."""
    weightless = critic.format in WEIGHTLESS_FORMATS
    if weightless and (placement.offload != "none" or placement.shard != "none"):
        raise ConfigError(
            f"verl_prm.placement.offload/shard are unused with verl_prm.critic.format={critic.format} (no critic "
            "weights): set verl_prm.placement.offload=none and verl_prm.placement.shard=none"
        )
    if placement.shard == "fsdp" and critic.format not in SHARDABLE_FORMATS:
        raise ConfigError(
            f"verl_prm.placement.shard=fsdp supports verl_prm.critic.format {SHARDABLE_FORMATS}, got "
            f"{critic.format!r}: set verl_prm.placement.shard=none"
        )
    if placement.shard == "fsdp" and critic.allow_pickle:
        raise ConfigError("verl_prm.placement.shard=fsdp reads safetensors only: set verl_prm.critic.allow_pickle=false")
    if placement.pool == "own" and (placement.n_gpus_per_node < 1 or placement.nnodes < 1):
        raise ConfigError(
            "verl_prm.placement.pool=own needs n_gpus_per_node >= 1 and nnodes >= 1, got "
            f"{placement.n_gpus_per_node} x {placement.nnodes}"
        )


def _check_refresh_section(refresh: RefreshSection, critic: CriticSection, placement: PlacementSection) -> None:
    """A refresh refits a value head: a learned PAV of format value_head, one replica per worker, no calibration
    file for the old head; the sampling knobs are format rollout's (checked as there)."""
    if refresh.every < 0:
        raise ConfigError(f"verl_prm.refresh.every must be >= 0 (0: no refresh), got {refresh.every}")
    if refresh.window < 1:
        raise ConfigError(f"verl_prm.refresh.window must be >= 1, got {refresh.window}")
    if not refresh.every:
        return
    if critic.format != "value_head":
        raise ConfigError(
            f"verl_prm.refresh.every={refresh.every} refits the value head of a learned PAV (verl_prm.critic.format="
            f"value_head), got verl_prm.critic.format={critic.format}: set verl_prm.refresh.every=0"
        )
    if placement.shard != "none":
        raise ConfigError("verl_prm.refresh sets the value head on every critic worker's replica: set "
                          "verl_prm.placement.shard=none, or verl_prm.refresh.every=0")
    if critic.calibration not in ("auto", "none"):
        raise ConfigError(
            f"verl_prm.critic.calibration={critic.calibration!r} maps the values of the checkpoint's head, which "
            "verl_prm.refresh refits to the sampled values: set verl_prm.critic.calibration=none"
        )
    _check_rollout_sampling(critic)


def _check_diagnostics_section(diagnostics: DiagnosticsSection) -> None:
    """A reference names its exact prover (built by ``check_reference_prover`` at startup); a finite threshold."""
    threshold = diagnostics.signal_threshold
    if not math.isfinite(threshold) or threshold < 0:
        raise ConfigError(f"verl_prm.diagnostics.signal_threshold must be a finite number >= 0, got {threshold}")
    if diagnostics.reference is None:
        return
    prover = diagnostics.reference.get("prover")
    if not is_class_path(prover):
        raise ConfigError(
            "verl_prm.diagnostics.reference needs prover, the 'module:Class' of the exact prover whose values the "
            f"diagnostics compare with (got {prover!r}): add +verl_prm.diagnostics.reference.prover=module:Class "
            "(e.g. verl_prm.apps.arithmetic.prover:ArithmeticProver), or set verl_prm.diagnostics.reference=null"
        )


def _check_rollout_critic_section(critic: CriticSection, placement: PlacementSection) -> None:
    """format=rollout: no checkpoint, no critic pool, and sampling knobs in range."""
    if critic.path is not None and str(critic.path).strip() != "":
        raise ConfigError(
            f"verl_prm.critic.path={critic.path!r} is unused with verl_prm.critic.format=rollout (the values are "
            "sampled from the run's own rollout replicas): set verl_prm.critic.path=null"
        )
    if placement.pool != "colocated":
        raise ConfigError(
            "verl_prm.placement.pool=own is unused with verl_prm.critic.format=rollout (no critic workers: the "
            "rollout replicas sample): set verl_prm.placement.pool=colocated"
        )
    _check_rollout_sampling(critic)


def _check_tree_critic_section(critic: CriticSection, placement: PlacementSection) -> None:
    """format=tree: no checkpoint, no critic pool, a finite success threshold (the shape is checked against
    rollout.n by the trainer: ``integrations.verl.tree_rollout.check_tree_run``)."""
    if critic.path is not None and str(critic.path).strip() != "":
        raise ConfigError(
            f"verl_prm.critic.path={critic.path!r} is unused with verl_prm.critic.format=tree (the values are the "
            "tree's own node values): set verl_prm.critic.path=null"
        )
    if placement.pool != "colocated":
        raise ConfigError("verl_prm.placement.pool=own is unused with verl_prm.critic.format=tree (no critic "
                          "workers): set verl_prm.placement.pool=colocated")
    if not math.isfinite(critic.mc_success_threshold):
        raise ConfigError(f"verl_prm.critic.mc_success_threshold must be a finite number, got {critic.mc_success_threshold}")
    if not math.isfinite(critic.prior_strength) or critic.prior_strength < 0:
        raise ConfigError(f"verl_prm.critic.prior_strength must be a finite number >= 0 (0: no shrinkage), got "
                          f"{critic.prior_strength}")


def _check_rollout_sampling(critic: CriticSection) -> None:
    """The mc_* knobs of format "rollout" and of verl_prm.refresh."""
    if critic.n_mc < 1:
        raise ConfigError(f"verl_prm.critic.n_mc (continuations per step prefix) must be >= 1, got {critic.n_mc}")
    if critic.prefixes_per_response < 1:
        raise ConfigError(
            f"verl_prm.critic.prefixes_per_response must be >= 1, got {critic.prefixes_per_response}"
        )
    if critic.mc_token_budget is not None and critic.mc_token_budget < 1:
        raise ConfigError(
            f"verl_prm.critic.mc_token_budget must be >= 1 or null (no bound), got {critic.mc_token_budget}: a "
            "budget of zero samples nothing; use an outcome-only estimator instead"
        )
    if not math.isfinite(critic.mc_success_threshold):
        raise ConfigError(f"verl_prm.critic.mc_success_threshold must be a finite number, got {critic.mc_success_threshold}")
    if not math.isfinite(critic.prior_strength) or critic.prior_strength < 0:
        raise ConfigError(f"verl_prm.critic.prior_strength must be a finite number >= 0 (0: no shrinkage), got "
                          f"{critic.prior_strength}")


def _check_exact_critic_section(critic: CriticSection) -> None:
    """format=exact: no checkpoint path, and ``options.prover`` naming the exact prover (built by
    ``check_exact_prover`` at startup; here only what needs no import)."""
    if critic.path is not None and str(critic.path).strip() != "":
        raise ConfigError(
            f"verl_prm.critic.path={critic.path!r} is unused with verl_prm.critic.format=exact (the values come "
            "from the exact prover of verl_prm.critic.options.prover, not a checkpoint): set "
            "verl_prm.critic.path=null"
        )
    prover = critic.options.get("prover")
    if not is_class_path(prover):
        raise ConfigError(
            "verl_prm.critic.format=exact needs verl_prm.critic.options.prover, the 'module:Class' of the exact "
            f"prover that gives the values (got {prover!r}): add +verl_prm.critic.options.prover=module:Class "
            "(e.g. verl_prm.apps.arithmetic.prover:ArithmeticProver)"
        )


def check_exact_prover(critic: CriticSection) -> None:
    """Build the exact prover of ``verl_prm.critic.options`` once, so that a prover that cannot be imported or a bad
    prover option fails at startup; errors name the option's key."""
    build_exact_critic(critic.options, "verl_prm.critic.options")


def check_reference_prover(diagnostics: DiagnosticsSection) -> None:
    """The same for ``verl_prm.diagnostics.reference`` (nothing to check when it is null)."""
    if diagnostics.reference is not None:
        build_exact_critic(diagnostics.reference, "verl_prm.diagnostics.reference")


def build_exact_critic(options: Any, key: str):
    """``ExactCritic`` of the exact prover options at config key ``key`` ({prover: "module:Class", ...}); a prover
    that cannot be imported or a bad option is a ``ConfigError`` naming the option's key."""
    from verl_prm.critic.exact import ExactCritic, ProverOptionError

    try:
        return ExactCritic.from_options(**dict(options))
    except ProverOptionError as error:
        raise ConfigError(f"{key}.{error.option}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"{key}.prover: {error}") from None


def select_key(config: Any, dotted: str, default: Any = None) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, None) if getter is not None else getattr(node, part, None)
    return default if node is None else node


def check_critic_path(path: Optional[str], allow_pickle: bool = False) -> None:
    if path is None or str(path).strip() == "":
        raise ConfigError(
            "verl_prm.critic.path is required when the verl-prm trainer hook runs: set "
            "verl_prm.critic.path=/path/to/prover_critic (a Hugging Face checkpoint; `verl-prm train` writes one)"
        )
    path = str(path)
    if "://" in path:  # hdfs:// and the like: verl copies it to a local directory when the worker starts
        return
    from verl_prm.checkpoints import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(path, "critic", allow_pickle=allow_pickle)
    except (FileNotFoundError, CheckpointError) as error:
        raise ConfigError(f"verl_prm.critic.path: {error}") from None


def check_finite_floats(node: Any, key: str) -> None:
    """Every float anywhere under ``node`` (e.g. in ``verl_prm.critic.options``) is finite; the error names its key.

    The typed knobs check their own ranges; this also covers free-form option maps, so no NaN or inf reaches a
    run through any key of the plugin."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        for name, value in node.items():
            check_finite_floats(value, f"{key}.{name}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            check_finite_floats(value, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{key} must be a finite number, got {node}")
