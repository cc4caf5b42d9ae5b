"""`verl-prm train`: train a PAV on step labels (label shards of `verl-prm label` or of a converter).

    verl-prm train --labels labels/ --init PATH_TO_CAUSAL_LM --output-dir pav/ [options]
    verl-prm train --labels labels/ --init POLICY --output-dir critic/ --format token_logprob [--head-l2 1]
    accelerate launch --num_processes 8 -m verl_prm.apps.cli train ...     (several GPUs, DDP)

Every flag is a field of ``verl_prm.training.config.TrainConfig`` (its default and doc are the flag's).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from verl_prm.cli_types import add_dataclass_arguments
from verl_prm.training.config import TrainConfig

__all__ = ["main", "train_parser"]


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm train", description="train a process advantage verifier (PAV): "
                                "soft-label cross-entropy at each step's last token; or, with --format "
                                "token_logprob, fit a logistic head on the --init model's own token log-probs "
                                "over each step (docs/critic.md)")
    init = p.add_mutually_exclusive_group(required=True)  # exactly one of a checkpoint and a new model's config
    add_dataclass_arguments(p, TrainConfig, groups={"init": init, "init_config": init})
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = train_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from verl_prm.training.trainer import train  # torch: not at `verl-prm train --help`

    summary = train(TrainConfig(**vars(args)))
    print(json.dumps(summary, default=float))
    return 0


if __name__ == "__main__":  # python -m verl_prm.training.cli (the same as `verl-prm train`)
    raise SystemExit(main())
