"""``TrainConfig``: the settings of `verl-prm train`, each declared once with its default, doc and bounds.

The command line's flags are built from these fields (``verl_prm.training.cli``); the trainer is
``verl_prm.training.trainer.train``. Imports no torch, so that ``verl-prm train --help`` starts fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl_prm.checks import compile_result_regex
from verl_prm.choices import CalibrationMethod, HeadFit, MixedPrecision, TrainedFormat
from verl_prm.settings import check_bounds, check_choices, setting
from verl_prm.training.calibration import MIN_CALIBRATION_LABELS

__all__ = ["DEFAULT_EVAL_FRACTION", "TrainConfig", "flag_key"]

DEFAULT_EVAL_FRACTION = 0.1


def flag_key(name: str) -> str:
    """How an error names setting ``name``: ``"max_steps (--max-steps)"``."""
    return f"{name} (--{name.replace('_', '-')})"


@dataclass
class TrainConfig:
    """Settings of one PAV training run (`verl-prm train --help` lists them with these docs)."""

    labels: list[str] = setting(doc="Label shards or directories of shards (`verl-prm label` or `verl-prm label "
                                "convert` writes them).")
    output_dir: str = setting(doc="Checkpoints and metrics; rerun the same command to resume. With --format "
                              "token_logprob: the checkpoint directory itself.")
    format: TrainedFormat = setting("value_head", "The critic checkpoint format written (docs/critic.md): value_head "
                                    "(a PAV: the model trained with a one-logit head, the options below) or "
                                    "token_logprob (the --init causal LM kept as it is, with a logistic head fitted "
                                    "by Newton's method on the statistics of its own token log-probs over each step "
                                    "and their prefix minima; --head-l2, --result-regex; the Adam and checkpoint "
                                    "options do not apply).")
    result_regex: Optional[str] = setting(None, "With --format token_logprob: a regex whose matches in a step's "
                                          "text are the results the step claims (the first capture group that "
                                          "takes part; e.g. '= *(-?\\d+)\\.?$'); adds the result's summed token "
                                          "log-prob (the weakest claim of the step) to the features. Default: none.")
    overwrite: bool = setting(False, "With --format token_logprob: replace the checkpoint that --output-dir holds "
                              "(default: refused).")
    init: Optional[str] = setting(None, "HF checkpoint: a causal LM (the backbone; a new one-logit head) or a PAV. "
                                  "Exactly one of init and init_config.")
    init_config: Optional[str] = setting(None, "config.json (file or directory) of a new model with random "
                                         "weights (needs --tokenizer).")
    tokenizer: Optional[str] = setting(None, "Tokenizer directory (default: --init).")
    eval_labels: Optional[list[str]] = setting(None, "Held-out label shards (default: prompts split off --labels, "
                                               "--eval-fraction).")
    eval_fraction: Optional[float] = setting(None, f"Share of prompts held out when there are no --eval-labels "
                                             f"(split by prompt; default {DEFAULT_EVAL_FRACTION}).",
                                             low=0.0, high=1.0, high_open=True)
    max_length: Optional[int] = setting(4096, "Tokens per rollout (labels beyond are dropped and reported).", low=1)
    batch_size: int = setting(8, "Rollouts per process per micro-batch.", low=1)
    grad_accum: int = setting(1, "Micro-batches per optimizer step.", low=1)
    max_steps: int = setting(1000, "Optimizer steps (Newton iterations at most with --head-fit newton).", low=1)
    lr: float = setting(1e-5, "Peak learning rate of AdamW.", low=0.0, low_open=True)
    min_lr_ratio: float = setting(0.0, "The cosine schedule decays to lr times this.", low=0.0, high=1.0)
    warmup_steps: int = setting(50, "Linear warm-up steps.", low=0)
    weight_decay: float = setting(0.0, "AdamW's weight decay.", low=0.0)
    grad_clip: float = setting(1.0, "Gradient-norm clip (0: off).", low=0.0)
    balance: bool = setting(True, "Class-balanced sampling of the rollouts (off: uniform).")
    best_of_k: int = setting(1, "Train on the values of the Best-of-K prover, computed from the labels' counts of "
                             "the base policy (verl_prm.labeling.format.best_of_k_from_counts).", low=1)
    use_prompt_value: bool = setting(True, "Also train V(prompt) at the prompt's last token.",
                                     flag="--no-prompt-value")
    freeze_backbone: bool = setting(False, "Train only the value head, a linear read-out of the --init model's "
                                    "features (e.g. a backbone taught to check steps beforehand).")
    head_fit: HeadFit = setting("adam", "How the value head is fitted: adam (--max-steps sampled AdamW steps with "
                                "the schedule above) or, with --freeze-backbone, newton (the head's convex loss "
                                "minimised on all training labels at once by Newton's method, --max-steps "
                                "iterations at most; verl_prm.training.head_fit).")
    head_l2: float = setting(0.0, "With --head-fit newton: the ridge penalty (l2 / 2) |w|^2 on the head's weights "
                             "over standardised features (0: the plain fit, which interpolates when there are about "
                             "as many features as labelled steps).", low=0.0)
    eval_every: int = setting(0, "Evaluate every this many steps (0: only at the end).", low=0)
    eval_batch_size: int = setting(16, "Rollouts per evaluation micro-batch.", low=1)
    save_every: int = setting(0, "Write a checkpoint every this many steps (0: only at the end).", low=0)
    keep_checkpoints: int = setting(2, "Newest checkpoints kept (>= 1); the one just written, at the end the final "
                                    "model, is never removed.")
    resume: bool = setting(True, "Resume from the newest intact checkpoint in --output-dir (off: set earlier "
                           "checkpoints aside and start over).")
    seed: int = setting(0, "Seed of the initialisation, the batches and dropout.", low=0)
    mixed_precision: MixedPrecision = setting("auto", "accelerate's mixed precision: auto (bf16 autocast over float32 "
                                              "weights where the device has native bf16 instructions, else no), no, "
                                              "bf16 or fp16.")
    gradient_checkpointing: bool = setting(False, "Recompute activations in the backward pass (less memory).")
    cpu: bool = setting(False, "Train on CPU even when a GPU is present.")
    log_every: int = setting(10, "Log the training metrics every this many steps.", low=1)
    progress: bool = setting(True, "Show a progress bar.")
    calibration: CalibrationMethod = setting("platt", "Map fitted on the held-out labels at the end, stored as "
                                             "checkpoint/calibration.json and applied by ProverCritic: platt "
                                             "(sigmoid(a logit(v) + b), a > 0; strictly increasing, so the ranking "
                                             "and every step's sign are kept; 2 parameters fit from few labels), "
                                             "isotonic (pool-adjacent-violators, any monotone shape, more labels) "
                                             f"or none. Needs >= {MIN_CALIBRATION_LABELS} held-out labels.")

    def __post_init__(self) -> None:
        if (self.init is None) == (self.init_config is None):
            raise ValueError("give exactly one of init (a checkpoint) and init_config (a config for a new model)")
        if self.init_config is not None and self.tokenizer is None:
            raise ValueError("a model built from init_config needs a tokenizer path (--tokenizer)")
        if self.freeze_backbone and self.init_config is not None:
            raise ValueError("freeze_backbone (--freeze-backbone) with init_config (--init-config) trains a value head "
                             "on a random backbone that never learns: pass --init with a trained model, or drop "
                             "--freeze-backbone")
        check_choices(self, flag_key)
        self._check_format()
        if self.head_fit == "newton" and not self.freeze_backbone:
            raise ValueError("head_fit newton (--head-fit newton) fits the value head on frozen features: it needs "
                             "--freeze-backbone (a whole model trains with --head-fit adam)")
        if self.head_fit == "newton" and self.weight_decay != 0:
            raise ValueError(f"weight_decay (--weight-decay {self.weight_decay}) is AdamW's; --head-fit newton fits the "
                             "head without it: pass --weight-decay 0, or --head-fit adam")
        if self.head_l2 and self.head_fit != "newton" and self.format != "token_logprob":
            raise ValueError(f"head_l2 (--head-l2 {self.head_l2}) is the penalty of --head-fit newton; AdamW's is "
                             "--weight-decay: pass --head-fit newton, or --head-l2 0")
        if self.eval_labels and self.eval_fraction is not None:
            raise ValueError("eval_fraction (--eval-fraction) splits --labels when there are no eval_labels; with "
                             "--eval-labels nothing is split: drop one of the two")
        if isinstance(self.keep_checkpoints, bool) or not isinstance(self.keep_checkpoints, int) \
                or self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints (--keep-checkpoints) must be an integer >= 1, got "
                             f"{self.keep_checkpoints!r}: the newest checkpoint is the model the run produces and is "
                             "always kept; 1 keeps only it")
        check_bounds(self, flag_key)
        if self.calibration != "none" and not self.eval_labels and self.held_out_fraction == 0.0:
            raise ValueError(f"calibration (--calibration {self.calibration}) is fitted on held-out labels, but "
                             "--eval-fraction 0 holds none out: pass --eval-labels or a positive --eval-fraction, "
                             "or --calibration none")

    def _check_format(self) -> None:
        """The settings of --format token_logprob, and those that only it takes."""
        if self.format != "token_logprob":
            for name in ("result_regex", "overwrite"):
                if getattr(self, name):
                    raise ValueError(f"{flag_key(name)} is a setting of --format token_logprob; --format "
                                     f"{self.format} does not take it")
            return
        if self.init is None:
            raise ValueError("format token_logprob (--format token_logprob) keeps the --init causal LM and fits a head "
                             "on its token log-probs: pass --init (a policy checkpoint), not --init-config")
        if self.head_fit != "adam" or self.freeze_backbone:  # the value head's options, named so as not to mislead
            raise ValueError("--head-fit and --freeze-backbone are options of --format value_head; --format "
                             "token_logprob always fits its head by Newton's method on the frozen LM: drop them")
        if self.weight_decay != 0:
            raise ValueError(f"weight_decay (--weight-decay {self.weight_decay}) is AdamW's; --format token_logprob "
                             "fits its head by Newton's method (ridge: --head-l2): pass --weight-decay 0")
        if self.result_regex is not None:
            compile_result_regex(flag_key("result_regex"), self.result_regex)

    @property
    def held_out_fraction(self) -> float:
        """The share of prompts split off --labels for evaluation (when there are no eval_labels)."""
        return DEFAULT_EVAL_FRACTION if self.eval_fraction is None else self.eval_fraction
