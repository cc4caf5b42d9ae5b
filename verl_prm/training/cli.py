"""`verl-prm train`: train a PAV on step labels (label shards of `verl-prm label` or of a converter).

    verl-prm train --labels labels/ --init PATH_TO_CAUSAL_LM --output-dir pav/ [options]
    accelerate launch --num_processes 8 -m verl_prm.apps.cli train ...     (several GPUs, DDP)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from verl_prm.cli_types import finite_float
from verl_prm.training.calibration import CALIBRATION_METHODS, DEFAULT_CALIBRATION, MIN_CALIBRATION_LABELS

__all__ = ["main"]


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm train", description="train a process advantage verifier (PAV): "
                                "soft-label cross-entropy at each step's last token")
    p.add_argument("--labels", nargs="+", required=True, help="label shards or directories of shards")
    p.add_argument("--output-dir", required=True, help="checkpoints and metrics; rerun to resume")
    init = p.add_mutually_exclusive_group(required=True)
    init.add_argument("--init", help="HF checkpoint: a causal LM (backbone; new one-logit head) or a PAV")
    init.add_argument("--init-config", help="config.json (file or directory) of a new model with random weights")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --init)")
    p.add_argument("--eval-labels", nargs="+", default=None, help="held-out label shards (default: split)")
    p.add_argument("--eval-fraction", type=finite_float(0.0, 1.0, high_open=True), default=None, help="share of "
                   "prompts held out when no --eval-labels (split by prompt; default 0.1)")
    p.add_argument("--calibration", choices=CALIBRATION_METHODS, default=DEFAULT_CALIBRATION,
                   help="map fitted on the held-out labels at the end and stored as checkpoint/calibration.json, "
                   "applied by ProverCritic (default platt: sigmoid(a logit(v) + b), a > 0; strictly increasing, so "
                   "the ranking and every step's sign are kept; 2 parameters fit from few labels). isotonic: "
                   f"pool-adjacent-violators, any monotone shape, more labels. Needs >= {MIN_CALIBRATION_LABELS} held-out labels")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per rollout (longer: labels beyond are "
                   "dropped and reported)")
    p.add_argument("--batch-size", type=int, default=8, help="rollouts per process per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--lr", type=finite_float(0.0, low_open=True), default=1e-5)
    p.add_argument("--min-lr-ratio", type=finite_float(0.0, 1.0), default=0.0, help="cosine decays to lr * this")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=finite_float(0.0), default=0.0)
    p.add_argument("--grad-clip", type=finite_float(0.0), default=1.0, help="0 = off")
    p.add_argument("--no-balance", action="store_true", help="uniform instead of class-balanced sampling")
    p.add_argument("--best-of-k", type=int, default=1, help="train on the Best-of-K prover's values (labels "
                   "from the base policy's counts)")
    p.add_argument("--no-prompt-value", action="store_true", help="do not train V(prompt) at the prompt's end")
    p.add_argument("--freeze-backbone", action="store_true", help="train only the value head (a linear read-out of "
                   "the --init model's features, e.g. a backbone taught to check steps beforehand)")
    p.add_argument("--head-fit", choices=("adam", "newton"), default="adam", help="how the value head is fitted: "
                   "adam (--max-steps sampled AdamW steps) or, with --freeze-backbone, newton (the head's convex loss "
                   "minimised on all training labels at once by Newton's method, --max-steps iterations at most)")
    p.add_argument("--eval-every", type=int, default=0, help="0 = only at the end")
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--save-every", type=int, default=0, help="0 = only at the end")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (>= 1); the one just "
                   "written, at the end the final model, is never removed")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints in --output-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = train_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from verl_prm.training.trainer import TrainConfig, train

    config = TrainConfig(
        labels=args.labels, output_dir=args.output_dir, init=args.init, init_config=args.init_config,
        tokenizer=args.tokenizer, eval_labels=args.eval_labels, eval_fraction=args.eval_fraction,
        max_length=args.max_length, batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_steps=args.max_steps, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, balance=not args.no_balance,
        best_of_k=args.best_of_k, use_prompt_value=not args.no_prompt_value,
        freeze_backbone=args.freeze_backbone, head_fit=args.head_fit, eval_every=args.eval_every,
        eval_batch_size=args.eval_batch_size, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
        resume=not args.no_resume, seed=args.seed, mixed_precision=args.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing, cpu=args.cpu, log_every=args.log_every,
        progress=not args.no_progress, calibration=args.calibration,
    )
    summary = train(config)
    print(json.dumps(summary, default=float))
    return 0


if __name__ == "__main__":  # python -m verl_prm.training.cli (the same as `verl-prm train`)
    raise SystemExit(main())
