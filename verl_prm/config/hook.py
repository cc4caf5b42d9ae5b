"""Typed configuration of the verl trainer hook (the ``verl_prm`` section of verl's config) and the checks of the
section on its own.

The estimator knobs (alpha, best_of_k, clip, ...) stay in ``algorithm.pav`` (``PavConfig``, read by the
estimators). This module adds what the hook needs around them: where the prover critic is and how it is run,
how responses are split into steps, and where the critic's worker group is placed::

    verl_prm:
      critic:    {source, path, format, max_tokens_per_batch, dtype, n_mc, success_threshold, ...}
      steps:     {delimiter, regex, max_tokens, max_steps, code_rule, code_depth}
      placement: {pool, n_gpus_per_node, nnodes, offload, shard}
      diagnostics: {reference, signal_threshold}
      refresh:   {every, window, directory, prior_strength}
      tree:      {roots, branch_width, branch_rule, branches_per_response}
      score_outcome_estimators: true

Each number's bounds are declared on its field (``setting(..., low=...)``) and checked by ``check_bounds`` on
every section. What a value source (``verl_prm.critic.source``) needs is declared by the source
(``verl_prm.integrations.verl.sources``) and checked with the rest of the run config, before Ray starts, by
``verl_prm.integrations.verl.run_config.validate_run_config``. Every error names the config key and the fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl_prm.checks import empty_match_problem, is_class_path
from verl_prm.critic.exact import ExactCritic, ProverOptionError
from verl_prm.choices import (
    SHARDABLE_FORMATS,
    BranchRule,
    CheckpointFormat,
    CodeStepRule,
    CriticDtype,
    OffloadMode,
    PlacementPool,
    PrefixRule,
    ShardMode,
    Truncation,
    ValueSourceName,
)
from verl_prm.config.names import HOOK_TRAINER_NAME, REWARD_MANAGER_NAME, TREE_AGENT_LOOP_NAME
from verl_prm.settings import check_bounds, check_choices, from_mapping, setting
from verl_prm.steps import DEFAULT_DELIMITER, split_steps
from verl_prm.steps.code import code_split_steps
from verl_prm.trees import TreeShape

__all__ = [
    "ConfigError",
    "CriticSection",
    "DiagnosticsSection",
    "HOOK_TRAINER_NAME",
    "HookConfig",
    "PlacementSection",
    "REWARD_MANAGER_NAME",
    "RENAMED_SETTINGS",
    "RefreshSection",
    "StepsSection",
    "TREE_AGENT_LOOP_NAME",
    "TreeSection",
    "read_hook_config",
    "select_key",
]

# Settings renamed in verl-prm 0.x (issue: one registry of value sources): the old key -> the new one. A config that
# still names an old key is refused with the new name (docs/verl.md, "Renamed settings").
RENAMED_SETTINGS = {
    "verl_prm.critic.mc_success_threshold": "verl_prm.critic.success_threshold",
    "verl_prm.critic.prior_strength": "verl_prm.critic.group_prior_strength (sources sampled and tree) or "
                                      "verl_prm.refresh.prior_strength (the refresh's labels)",
}
# The value sources verl_prm.critic.format used to name: format=<old> -> source=<new>.
RENAMED_FORMATS = {"exact": "exact", "rollout": "sampled", "tree": "tree"}


class ConfigError(ValueError):
    """A verl-prm setting in the run config is invalid; the message names the key and the fix."""


@dataclass
class CriticSection:
    """``verl_prm.critic``: where the step values come from (``source``) and the settings of each source."""

    source: ValueSourceName = setting("checkpoint", "Where the step values come from (docs/step_values.md; "
                                      "verl_prm.integrations.verl.sources): checkpoint (a critic checkpoint at "
                                      "path, a learned PAV or a public PRM, in the given format), exact (no "
                                      "checkpoint: the closed-form values of the exact prover options.prover "
                                      "('module:Class')), sampled (no checkpoint: Monte-Carlo values sampled from "
                                      "the run's rollout replicas; n_mc, prefix_rule and the mc_* keys), tree (no "
                                      "checkpoint: each group sampled as a tree (verl_prm.tree) whose node values "
                                      "are the mean outcome of the leaves below them).")
    path: Optional[str] = setting(None, "Hugging Face checkpoint directory (or hub id) of the prover critic. "
                                  "Required with source checkpoint; null with the other sources.")
    format: CheckpointFormat = setting("value_head", "Source checkpoint: the checkpoint's format (docs/critic.md): "
                                       "value_head (the native one: token-classification head, num_labels=1, as "
                                       "`verl-prm train` writes by default), qwen_prm (separator token with a "
                                       "two-class head, Qwen2.5-Math-PRM style), pure_prm, math_shepherd (+/- logits "
                                       "of the LM head at a tag token), rlhflow (a verdict turn per step), "
                                       "value_head_lm (Skywork-style value head), token_logprob (a causal LM and a "
                                       "logistic head on its token log-probs over each step, as `verl-prm train "
                                       "--format token_logprob` writes; shard none only).")
    options: dict[str, Any] = setting(factory=dict, doc="Options of the format, e.g. {separator: '<extra_0>'} "
                                      "(qwen_prm), {tag: 'ки'} (math_shepherd); with source exact {prover: "
                                      "'module:Class', <the prover's options>} (e.g. "
                                      "+verl_prm.critic.options.prover="
                                      "verl_prm.apps.arithmetic.prover:ArithmeticProver "
                                      "+verl_prm.critic.options.step_accuracy=0.8).")
    max_tokens_per_batch: int = setting(16384, "Token budget of one critic micro-batch (sequences are packed or "
                                        "length-bucketed up to it).", low=1)
    dtype: CriticDtype = setting("auto", "Parameter dtype of the critic: auto (bf16 on GPU, fp32 on CPU), "
                                 "bfloat16, float16, float32.")
    truncation: Truncation = setting("error", "A prompt + response longer than the critic's context: error "
                                     "(names the sample) or left_prompt (drop prompt tokens from the left; never "
                                     "response tokens).")
    allow_pickle: bool = setting(False, "Also load a checkpoint whose weights are pickle only (pytorch_model.bin): "
                                 "unpickling can run arbitrary code, so the default loads safetensors only.")
    calibration: str = setting("auto", "Source checkpoint: post-hoc calibration of the checkpoint's values: auto "
                               "(the checkpoint's calibration.json when it has one; `verl-prm train` writes it), "
                               "none (the raw values), or the path of a calibration file fitted for these "
                               "weights.")
    n_mc: int = setting(4, "Source sampled and verl_prm.refresh: continuations sampled per step prefix, through "
                        "the run's rollout replicas with the rollout's sampling settings, scored by the run's reward "
                        "function.", low=1)
    prefix_rule: PrefixRule = setting("every", "Source sampled and verl_prm.refresh: which prefixes are sampled: "
                                      "every (every step but the last), fixed (prefixes_per_response evenly "
                                      "spaced steps), first_pit (bisection for the first zero-value step of each "
                                      "failed response, about log2(H) prefixes).")
    prefixes_per_response: int = setting(4, "The number of steps sampled per response under prefix_rule=fixed.",
                                         low=1)
    mc_token_budget: Optional[int] = setting(None, "The most continuation tokens one training step may generate "
                                             "(null: no bound; a budget of zero would sample nothing: use an "
                                             "outcome-only estimator instead). A prefix is sampled only if n_mc x "
                                             "its continuation limit fits; the others hold the value of the step "
                                             "before them (pav/mc_prefixes_skipped).", low=1)
    success_threshold: float = setting(0.5, "Sources sampled and tree, and verl_prm.refresh: a response, a "
                                       "continuation or a tree's leaf succeeds iff its reward is greater than this "
                                       "(verl's rule-based scorers give 1 or 0/-1).", finite=True)
    pool_group_samples: bool = setting(True, "Source sampled and verl_prm.refresh: the other responses of the "
                                       "group that begin with a sampled prefix's tokens are samples of its value "
                                       "too; their outcomes are pooled with the continuations' (unbiased; "
                                       "pav/mc_pooled_samples).")
    group_prior_strength: float = setting(0.0, "Sources sampled and tree: shrinkage s of a sampled success rate "
                                          "(a prefix's continuations, a tree node's leaves) toward the group's "
                                          "success rate v_0, (successes + s v_0) / (samples + s), before "
                                          "Best-of-K. 0: the plain rate.", low=0.0)


@dataclass
class StepsSection:
    """``verl_prm.steps``: how a response is split into steps (verl_prm.steps.split_steps)."""

    delimiter: Optional[str] = setting(DEFAULT_DELIMITER, "A step ends at this text delimiter (\"\\n\" for one line per "
                                       "step). The escapes \\n, \\r, \\t and \\\\ are decoded, because a shell and "
                                       "Hydra pass verl_prm.steps.delimiter='\\n' as backslash-n.")
    regex: Optional[str] = setting(None, "A regex whose matches end a step; replaces the delimiter (set "
                                   "delimiter=null).")
    max_tokens: Optional[int] = setting(None, "Fixed-size steps of this many tokens instead of text delimiters "
                                        "(set delimiter=null).", low=1)
    max_steps: Optional[int] = setting(None, "Merge trailing steps so that a response has at most this many (the "
                                       "merge count is a metric).", low=1)
    code_rule: Optional[CodeStepRule] = setting(None, "Code responses: a step rule of verl_prm.steps.code instead "
                                                "of the text rules (set delimiter=null): block (Python statements "
                                                "found by ast; the indentation rule when the text does not parse), "
                                                "line or indent.")
    code_depth: int = setting(0, "With code_rule: the statement nesting depth that still starts a step (1: a "
                              "function's signature, then each statement of its body).", low=0)

    def split(self, response_ids, response_mask, tokenizer):
        """``verl_prm.steps.StepSplit`` of a batch of responses under this rule (the hook and the reward
        manager both split through here, so the steps the critic scores are the steps the metrics count)."""
        if self.code_rule is not None:
            return code_split_steps(response_ids, response_mask, tokenizer, self.code_rule, depth=self.code_depth,
                                    max_steps=self.max_steps)
        return split_steps(response_ids, response_mask, tokenizer, self.delimiter, regex=self.regex,
                           max_tokens=self.max_tokens, max_steps=self.max_steps)


@dataclass
class PlacementSection:
    """``verl_prm.placement``: the verl resource pool of the critic's worker group."""

    pool: PlacementPool = setting("colocated", "colocated: the critic's workers share verl's global pool (the "
                                  "actor and rollout GPUs); own: a pool of n_gpus_per_node x nnodes, which verl's "
                                  "GPU check counts.")
    n_gpus_per_node: int = setting(1, "Only for pool=own: GPUs per node of the critic's own pool.", low=1)
    nnodes: int = setting(1, "Only for pool=own: nodes of the critic's own pool.", low=1)
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
                                      "(pav/zero_outcome_groups_with_signal).", low=0.0)


@dataclass
class RefreshSection:
    """``verl_prm.refresh``: the learned PAV's value head refitted during the run to values sampled from the
    rollout replicas (``verl_prm.critic.refresh``; docs/step_values.md). Off by default."""

    every: int = setting(0, "Refresh every this many training steps (0: never): on such a step the batch's step "
                         "values are also sampled with the verl_prm.critic n_mc, prefix_rule, mc_* and "
                         "success_threshold settings (as source sampled samples them), written as labels, and the "
                         "value head is refitted; the step's advantages use the values the PAV gave before the "
                         "refit. Needs source checkpoint with format value_head.", low=0)
    window: int = setting(4, "The head is fitted to the labels of the last this many refreshes.", low=1)
    prior_strength: float = setting(0.0, "Shrinkage s of a sampled step's label toward the learned PAV's value "
                                    "before the refit: a label of t samples is fitted with t + s trials, (successes "
                                    "+ s v_PAV) / (t + s). 0: the plain rate.", low=0.0)
    directory: Optional[str] = setting(None, "Where the labels (the label format `verl-prm train` reads) and the "
                                       "state a resume needs are written; null: "
                                       "<trainer.default_local_dir>/pav_refresh.")


@dataclass
class TreeSection:
    """``verl_prm.tree``: the shape of a tree-shaped group (``verl_prm.critic.source=tree``; verl_prm.trees): the
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

    def shape(self) -> TreeShape:
        """The library's ``TreeShape`` of this section."""
        return TreeShape(roots=self.roots, branch_width=self.branch_width, branch_rule=self.branch_rule,
                         branches_per_response=self.branches_per_response)


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

    Raises ``ConfigError`` for unknown or renamed keys, values of the wrong type, out-of-range values (the bounds
    declared on the fields: ``check_bounds`` on every section) and settings that contradict each other. What
    depends on the value source is checked with the source (``verl_prm.integrations.verl.run_config``).
    """
    if isinstance(section, DictConfig):
        section = OmegaConf.to_container(section, resolve=True)
    _check_renamed(section)
    config = from_mapping(HookConfig, section, "verl_prm", ConfigError)
    if config.steps.delimiter is not None:
        config.steps.delimiter = decode_escapes(config.steps.delimiter)
    for name in _SECTIONS:
        part = getattr(config, name)
        check_choices(part, lambda key: f"verl_prm.{name}.{key}", ConfigError)
        try:
            check_bounds(part, lambda key: f"verl_prm.{name}.{key}")
        except ValueError as error:
            raise ConfigError(str(error)) from None
    _check_critic_section(config.critic)
    _check_steps_section(config.steps)
    _check_placement_section(config.placement, config.critic)
    _check_diagnostics_section(config.diagnostics)
    return config


_SECTIONS = ("critic", "steps", "placement", "diagnostics", "refresh", "tree")


def _check_renamed(section: Any) -> None:
    """A renamed key, or a value source named as a checkpoint format, is an error naming the new key."""
    if not isinstance(section, dict):
        return  # from_mapping names the type
    for old, new in RENAMED_SETTINGS.items():
        group, key = old.split(".")[1:]
        if isinstance(section.get(group), dict) and key in section[group]:
            raise ConfigError(f"{old} was renamed: set {new} (docs/verl.md, \"Renamed settings\")")
    critic = section.get("critic")
    old_format = critic.get("format") if isinstance(critic, dict) else None
    if isinstance(old_format, str) and old_format in RENAMED_FORMATS:
        raise ConfigError(
            f"verl_prm.critic.format={old_format} is no checkpoint format: the value source is a setting of its "
            f"own now: set verl_prm.critic.source={RENAMED_FORMATS[old_format]} (and drop the format override)"
        )


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}


def decode_escapes(text: str) -> str:
    """``\\n``, ``\\r``, ``\\t`` and ``\\\\`` in ``text`` -> newline, return, tab, backslash (nothing else)."""
    return re.sub(r"\\([nrt\\])", lambda match: _ESCAPES[match.group(1)], text)


def _check_critic_section(critic: CriticSection) -> None:
    """A calibration is auto, none or a file name (whether the file exists is checked at startup)."""
    if not isinstance(critic.calibration, str) or not critic.calibration:
        raise ConfigError(f"verl_prm.critic.calibration must be auto, none or a calibration.json path, got "
                          f"{critic.calibration!r}")


def _check_steps_section(steps: StepsSection) -> None:
    """Exactly one step rule (delimiter, regex, max_tokens or code_rule); a regex that can split."""
    if steps.regex is not None:
        try:
            pattern = re.compile(steps.regex)
        except re.error as error:
            raise ConfigError(f"verl_prm.steps.regex {steps.regex!r} is not a valid regex: {error}") from None
        problem = empty_match_problem(pattern)
        if problem is not None:
            raise ConfigError(f"verl_prm.steps.regex {steps.regex!r} {problem}: make it match at least one "
                              r"character (e.g. '\n\n+') or look ahead for a marker (e.g. '(?=Step \d)')")
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
    if steps.code_rule is None and steps.max_tokens is None and steps.regex is None and not steps.delimiter:
        raise ConfigError(
            "verl_prm.steps needs a step rule: a non-empty delimiter, a regex, or max_tokens (fixed-size steps)"
        )


def _check_placement_section(placement: PlacementSection, critic: CriticSection) -> None:
    """Sharding only for a format that can be sharded, from safetensors."""
    if placement.shard == "fsdp" and critic.format not in SHARDABLE_FORMATS:
        raise ConfigError(
            f"verl_prm.placement.shard=fsdp supports verl_prm.critic.format {SHARDABLE_FORMATS}, got "
            f"{critic.format!r}: set verl_prm.placement.shard=none"
        )
    if placement.shard == "fsdp" and critic.allow_pickle:
        raise ConfigError("verl_prm.placement.shard=fsdp reads safetensors only: set verl_prm.critic.allow_pickle=false")


def _check_diagnostics_section(diagnostics: DiagnosticsSection) -> None:
    """A reference names its exact prover (built at startup: ``run_config.check_reference_prover``)."""
    if diagnostics.reference is None:
        return
    prover = diagnostics.reference.get("prover")
    if not is_class_path(prover):
        raise ConfigError(
            "verl_prm.diagnostics.reference needs prover, the 'module:Class' of the exact prover whose values the "
            f"diagnostics compare with (got {prover!r}): add +verl_prm.diagnostics.reference.prover=module:Class "
            "(e.g. verl_prm.apps.arithmetic.prover:ArithmeticProver), or set verl_prm.diagnostics.reference=null"
        )


def build_exact_critic(options: Any, key: str) -> ExactCritic:
    """``ExactCritic`` of the exact prover options at config key ``key`` ({prover: "module:Class", ...}); a prover
    that cannot be imported or a bad option is a ``ConfigError`` naming the option's key."""
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
