"""GSM8K as verl parquet rows (the layout of verl's examples/data_preprocess/gsm8k.py).

    python examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k                 # from the HF hub
    python examples/data_preprocess/gsm8k.py --local_save_dir ~/data/gsm8k \
        --test_jsonl data/gsm8k_test.jsonl --train_jsonl my_train.jsonl          # offline, jsonl

Each row: data_source "openai/gsm8k" (verl's default_compute_score scores it), a chat prompt that asks for
steps separated by blank lines (the default step delimiter of verl-prm is "\\n\\n") and the final answer after
"####", reward_model.ground_truth the number after "####" of the reference answer. Without a train jsonl in
offline mode, --split_test carves a train split out of the test jsonl (for smoke runs only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = (
    "Let's think step by step, separating the steps with a blank line, and output the final answer after \"####\"."
)


def extract_solution(answer: str) -> str:
    """The number after "####" of a GSM8K reference answer, without thousands separators."""
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if match is None:
        raise ValueError(f"GSM8K answer without '#### <number>': {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def make_row(record: dict, split: str, index: int) -> dict:
    """One verl RL row from a GSM8K record {question, answer}."""
    question = record["question"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(record["answer"])},
        "extra_info": {"split": split, "index": index, "answer": record["answer"], "question": question},
    }


def make_rows(records, split: str) -> list[dict]:
    return [make_row(record, split, index) for index, record in enumerate(records)]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_hub(split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as error:  # pragma: no cover - datasets is a verl dependency
        raise SystemExit("the HF hub path needs `datasets` (pip install datasets), or pass --*_jsonl files") from error
    try:
        return list(datasets.load_dataset("openai/gsm8k", "main", split=split))
    except Exception as error:
        raise SystemExit(
            f"could not load openai/gsm8k from the Hugging Face hub ({error}); offline, pass --test_jsonl/--train_jsonl"
        ) from error


def write_parquet(rows: list[dict], path: Path) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_save_dir", default="~/data/gsm8k", help="where train.parquet and test.parquet go")
    parser.add_argument("--train_jsonl", default=None, help="offline: GSM8K train records (question, answer)")
    parser.add_argument("--test_jsonl", default=None, help="offline: GSM8K test records (question, answer)")
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
    out = Path(os.path.expanduser(args.local_save_dir))
    write_parquet(make_rows(train, "train"), out / "train.parquet")
    write_parquet(make_rows(test, "test"), out / "test.parquet")
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
