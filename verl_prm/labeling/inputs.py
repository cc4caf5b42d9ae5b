"""Prompts with ground truths for labelling: verl parquet rows or jsonl with configurable fields."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["PromptItem", "read_prompts", "render_prompt"]


@dataclass(frozen=True)
class PromptItem:
    """One prompt to label. ``prompt`` is a chat (list of {role, content}) or plain text."""

    index: int
    prompt: Any
    ground_truth: Any
    data_source: str
    extra_info: dict = field(default_factory=dict)


def plain_python(value: Any) -> Any:
    """numpy arrays/records from parquet -> plain lists/dicts."""
    if isinstance(value, np.ndarray):
        return [plain_python(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [plain_python(v) for v in value]
    if isinstance(value, dict):
        return {k: plain_python(v) for k, v in value.items()}
    return value


def read_prompts(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "reward_model.ground_truth",
    data_source_field: str = "data_source",
    data_source: str | None = None,
    answer_regex: str | None = None,
    limit: int | None = None,
) -> list[PromptItem]:
    """Read prompts from a verl parquet file (``prompt`` chat list, ``reward_model.ground_truth``,
    ``data_source``, ``extra_info``) or a jsonl file (fields named by the arguments; dotted names reach into
    nested dicts). ``data_source`` overrides the field for every row. ``answer_regex`` extracts the ground truth
    from the answer field by its first group (e.g. ``'#### (.*)'`` for GSM8K's ``answer``).
    """
    path = Path(path)
    if path.suffix == ".parquet":
        records = [plain_python(r) for r in pd.read_parquet(path).to_dict(orient="records")]
    elif path.suffix in (".jsonl", ".json"):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        raise ValueError(f"prompts file {path}: expected .parquet (verl rows) or .jsonl")
    if limit is not None:
        records = records[:limit]
    pattern = re.compile(answer_regex) if answer_regex else None

    def get(record: dict, dotted: str, row: int) -> Any:
        value: Any = record
        for key in dotted.split("."):
            if not isinstance(value, dict) or key not in value:
                raise KeyError(
                    f"{path} row {row}: no field {dotted!r} (fields: {sorted(record)}); set the field option "
                    "(--prompt-field / --answer-field / --data-source-field) to the right name"
                )
            value = value[key]
        return value

    items = []
    for row, record in enumerate(records):
        answer = get(record, answer_field, row)
        if pattern is not None:
            match = pattern.search(str(answer))
            if match is None:
                raise ValueError(f"{path} row {row}: --answer-regex {answer_regex!r} does not match {answer!r}")
            answer = match.group(1).strip()
        source = data_source if data_source is not None else get(record, data_source_field, row)
        extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
        items.append(PromptItem(row, get(record, prompt_field, row), answer, str(source), dict(extra or {})))
    return items


def render_prompt(prompt: Any, tokenizer=None) -> str:
    """The text the policy reads for a prompt.

    A chat (list of {role, content}) goes through the tokenizer's chat template with the generation prompt.
    Documented fallback when the tokenizer has no chat template (tiny test tokenizers): the message contents
    joined by "\\n", followed by "\\n". Plain strings are used as they are.
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        raise ValueError(f"prompt must be a string or a chat list of {{role, content}} dicts, got {prompt!r:.200}")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "\n".join(str(m["content"]) for m in prompt) + "\n"
