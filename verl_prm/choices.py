"""Every choice a setting of verl-prm takes, defined once as a ``Literal`` type, with its runtime tuple.

A config field is annotated with the type (``format: CheckpointFormat = "value_head"``); the validation, the
command lines' ``choices=`` and the generated ``pav.yaml`` read the tuple (``typing.get_args`` of the type), so a
new choice is added here and nowhere else. What each choice means is documented at the field that takes it.

This module imports nothing heavy, so that a command's ``--help`` and argument checks load no torch or omegaconf.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "AGGREGATIONS", "CALIBRATION_METHODS", "CHECKPOINT_FORMATS", "CODE_SPLIT_RULES", "CODE_STEP_RULES", "COMPILE_MODES", "CRITIC_DTYPES",
    "GENERATOR_BACKENDS", "HEAD_FITS", "LABEL_STRATEGIES", "MIN_FORM_BASELINES",
    "MIXED_PRECISIONS", "OFFLOAD_MODES", "PRECISIONS", "Precision", "PLACEMENT_POOLS", "PREFIX_RULES", "PRIME_REWARD_MASKS", "PROCESS_TERMS",
    "SHARDABLE_FORMATS", "BRANCH_RULES", "SHARD_MODES", "SUCCESS_LABELS", "TRAINED_FORMATS", "TRUNCATIONS",
    "Aggregation", "BranchRule", "CalibrationMethod", "CheckpointFormat", "CodeSplitRule", "CodeStepRule", "CompileMode", "CriticDtype",
    "GeneratorBackend", "HeadFit", "LabelStrategy", "MinFormBaseline", "MixedPrecision",
    "OffloadMode", "PlacementPool", "PrefixRule", "PrimeRewardMask", "ProcessTerm", "ShardMode", "ShardableFormat",
    "SuccessLabels", "TrainedFormat", "Truncation",
    "TREE_RL_SCALES", "TREE_SEGMENT_WEIGHTS", "TreeRlScale", "TreeSegmentWeight",
    "VALUE_SOURCES", "ValueSourceName",
]

# Estimator knobs (algorithm.pav; verl_prm.config.PavConfig).
Aggregation = Literal["min", "max", "mean", "sum", "product", "last"]
ProcessTerm = Literal["progress", "value"]
CompileMode = Literal["auto", "always", "never"]
MinFormBaseline = Literal["token", "step", "none"]
PrimeRewardMask = Literal["step_end", "response"]
# The tree estimators' conventions (verl_prm.trees.tree_step_advantages): TreeRL's paper or its code's scale; a
# node's tokens weighed once per leaf below it (verl's rows) or once (SPO-tree's edges).
TreeRlScale = Literal["paper", "code"]
TreeSegmentWeight = Literal["per_leaf", "once"]

# Where a verl run's step values come from (verl_prm.critic.source; each source is an entry of
# verl_prm.integrations.verl.sources.SOURCES): a checkpoint critic (a learned PAV or a public PRM), an exact
# prover, Monte-Carlo samples from the rollout replicas, or the node values of tree-shaped groups.
ValueSourceName = Literal["checkpoint", "exact", "sampled", "tree"]
# The prover critic's checkpoint formats (verl_prm.critic.format; the keys of verl_prm.critic.formats.FORMATS).
CheckpointFormat = Literal["value_head", "qwen_prm", "pure_prm", "math_shepherd", "rlhflow", "value_head_lm",
                           "token_logprob"]
ShardableFormat = Literal["value_head"]
CriticDtype = Literal["auto", "bfloat16", "float16", "float32"]
Truncation = Literal["error", "left_prompt"]
# Which step prefixes Monte-Carlo values are sampled at (verl_prm.critic.sampled), and the labeler's subset.
PrefixRule = Literal["every", "fixed", "first_pit"]
LabelStrategy = Literal["every", "first_pit"]
# Where a tree-shaped group branches (verl_prm.trees; verl_prm.tree.branch_rule).
BranchRule = Literal["every", "fixed", "confidence"]
SuccessLabels = Literal["every", "outcome"]
# Rules of verl_prm.steps.code that a setting can name; the splitter also takes "delimiter" (the text rule, which
# the settings set by their own keys).
CodeStepRule = Literal["line", "block", "indent"]
CodeSplitRule = Literal[CodeStepRule, "delimiter"]

# Placement of the critic's workers in a verl run.
PlacementPool = Literal["colocated", "own"]
OffloadMode = Literal["none", "cpu"]
ShardMode = Literal["none", "fsdp"]

# `verl-prm train` and `verl-prm label`.
CalibrationMethod = Literal["platt", "isotonic", "none"]
HeadFit = Literal["adam", "newton"]
# the critic checkpoint format `verl-prm train` writes (verl_prm.critic.formats: value_head, token_logprob)
TrainedFormat = Literal["value_head", "token_logprob"]
MixedPrecision = Literal["auto", "no", "bf16", "fp16"]
# the compute precision of the generation engine and the CPU loop (verl_prm.precision: "auto" reads the CPU's flags)
Precision = Literal["auto", "bfloat16", "float32"]
GeneratorBackend = Literal["hf", "vllm"]

AGGREGATIONS = get_args(Aggregation)
PROCESS_TERMS = get_args(ProcessTerm)
COMPILE_MODES = get_args(CompileMode)
MIN_FORM_BASELINES = get_args(MinFormBaseline)
PRIME_REWARD_MASKS = get_args(PrimeRewardMask)
TREE_RL_SCALES = get_args(TreeRlScale)
TREE_SEGMENT_WEIGHTS = get_args(TreeSegmentWeight)
CHECKPOINT_FORMATS = get_args(CheckpointFormat)
VALUE_SOURCES = get_args(ValueSourceName)
SHARDABLE_FORMATS = get_args(ShardableFormat)
CRITIC_DTYPES = get_args(CriticDtype)
TRUNCATIONS = get_args(Truncation)
PREFIX_RULES = get_args(PrefixRule)
BRANCH_RULES = get_args(BranchRule)
LABEL_STRATEGIES = get_args(LabelStrategy)
SUCCESS_LABELS = get_args(SuccessLabels)
CODE_STEP_RULES = get_args(CodeStepRule)
CODE_SPLIT_RULES = get_args(CodeSplitRule)
PLACEMENT_POOLS = get_args(PlacementPool)
OFFLOAD_MODES = get_args(OffloadMode)
SHARD_MODES = get_args(ShardMode)
CALIBRATION_METHODS = get_args(CalibrationMethod)
HEAD_FITS = get_args(HeadFit)
TRAINED_FORMATS = get_args(TrainedFormat)
MIXED_PRECISIONS = get_args(MixedPrecision)
PRECISIONS = get_args(Precision)
GENERATOR_BACKENDS = get_args(GeneratorBackend)
