"""MATH as verl parquet rows (the layout of verl's examples/data_preprocess/math_dataset.py).

    python examples/data_preprocess/math_dataset.py --local_save_dir ~/data/math             # from the HF hub
    python examples/data_preprocess/math_dataset.py --local_save_dir ~/data/math \
        --test_jsonl data/math500_test.jsonl --split_test 100                      # offline, jsonl

Each row: data_source "DigitalLearningGmbH/MATH-lighteval" (verl's default_compute_score compares the last
\\boxed{} of the response with the ground truth), a chat prompt asking for blank-line separated steps and the
answer in \\boxed{}, reward_model.ground_truth the reference answer (the jsonl's `answer`, else the last
\\boxed{} of `solution`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step, separating the steps with a blank line, and output the final answer within \\boxed{}."


def ground_truth(record: dict) -> str:
    if record.get("answer"):
        return str(record["answer"])
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(record["solution"])
    if boxed is None:
        raise ValueError(f"MATH record without an answer or a \\boxed{{}} solution: {record['problem'][:80]!r}")
    return remove_boxed(boxed)


def make_row(record: dict, split: str, index: int) -> dict:
    """One verl RL row from a MATH record {problem, solution[, answer]}."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": record["problem"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth(record)},
        "extra_info": {"split": split, "index": index},
    }


def make_rows(records, split: str) -> list[dict]:
    return [make_row(record, split, index) for index, record in enumerate(records)]


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_hub(split: str) -> list[dict]:
    try:
        import datasets

        return list(datasets.load_dataset(DATA_SOURCE, split=split))
    except Exception as error:
        raise SystemExit(
            f"could not load {DATA_SOURCE} from the Hugging Face hub ({error}); offline, pass --test_jsonl"
        ) from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_save_dir", default="~/data/math")
    parser.add_argument("--train_jsonl", default=None, help="offline: MATH train records (problem, solution[, answer])")
    parser.add_argument("--test_jsonl", default=None, help="offline: MATH test records, e.g. math500_test.jsonl")
    parser.add_argument("--split_test", type=int, default=0,
                        help="offline without a train jsonl: use the first N test records as train, the rest as test")
    args = parser.parse_args(argv)

    if args.test_jsonl is None:
        train, test = load_hub("train"), load_hub("test")
    else:
        test = read_jsonl(args.test_jsonl)
        if args.train_jsonl is not None:
            train = read_jsonl(args.train_jsonl)
        elif args.split_test > 0:
            train, test = test[: args.split_test], test[args.split_test :]
        else:
            raise SystemExit("offline mode needs --train_jsonl, or --split_test N to carve train rows from the test set")
    import pandas as pd

    out = Path(os.path.expanduser(args.local_save_dir))
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(make_rows(train, "train")).to_parquet(out / "train.parquet")
    pd.DataFrame(make_rows(test, "test")).to_parquet(out / "test.parquet")
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
