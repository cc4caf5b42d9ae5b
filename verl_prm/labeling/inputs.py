"""Prompts with ground truths for labelling: verl parquet rows or jsonl with configurable fields."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["PromptItem", "default_ground_truth", "read_jsonl_records", "read_prompts", "render_prompt"]

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


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


def read_jsonl_records(path: str | Path):
    """Yield ``(line number, record)`` for each non-blank line of a UTF-8 jsonl file; a line that is not UTF-8
    or not JSON (e.g. a file cut short) raises ValueError naming the file and the line (1-based)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path} line {number}: not UTF-8 text ({error}); convert the file to UTF-8, e.g. "
                                 "iconv -f latin1 -t utf-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                cut = " (the last line: was the file cut short?)" if not raw.endswith(b"\n") else ""
                raise ValueError(f"{path} line {number}: not valid JSON{cut}: {error.msg} at column {error.colno}; "
                                 f"the line starts {line[:80]!r}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {number}: expected a JSON object per line, got "
                                 f"{type(record).__name__}")
            yield number, record


def _gsm8k_answer(answer: str) -> str | None:
    # verl's examples/data_preprocess/gsm8k.py: the number after "####", thousands separators removed
    if "####" not in answer:
        return None
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if match is None:
        raise ValueError("a GSM8K answer with '####' but no number after it: pass --answer-regex")
    return match.group(1).replace(",", "")


def _math_answer(answer: str) -> str | None:
    # verl's examples/data_preprocess/math_dataset.py: the content of the last \boxed{} of the solution
    if "\\boxed" not in answer:
        return None
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(answer)
    if boxed is None or not boxed.startswith("\\boxed"):
        raise ValueError("a MATH solution with an unclosed \\boxed{: pass --answer-regex")
    return remove_boxed(boxed)


def default_ground_truth(data_source: str, answer: Any) -> tuple[Any, str | None]:
    """The ground truth verl's scorer expects for ``answer`` of a known data source, as verl's preprocessing
    extracts it; returns ``(ground truth, rule name or None)``.

    * GSM8K (``openai/gsm8k``): an answer holding ``#### <number>`` (the raw data set's whole solution) ->
      that number without commas. verl's gsm8k scorer compares the response's number with the ground truth.
    * MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``): a solution
      holding ``\\boxed{...}`` -> the content of its last box.

    Anything else (other data sources, answers that are already extracted, non-strings) is returned unchanged.
    """
    if not isinstance(answer, str):
        return answer, None
    if data_source in GSM8K_SOURCES:
        extracted = _gsm8k_answer(answer)
        return (answer, None) if extracted is None else (extracted, "GSM8K '#### <number>'")
    if data_source in MATH_SOURCES:
        extracted = _math_answer(answer)
        return (answer, None) if extracted is None else (extracted, "MATH last \\boxed{}")
    return answer, None


def read_prompts(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "reward_model.ground_truth",
    data_source_field: str = "data_source",
    data_source: str | None = None,
    answer_regex: str | None = None,
    limit: int | None = None,
    notes: list[str] | None = None,
) -> list[PromptItem]:
    """Read prompts from a verl parquet file (``prompt`` chat list, ``reward_model.ground_truth``,
    ``data_source``, ``extra_info``) or a jsonl file (fields named by the arguments; dotted names reach into
    nested dicts). ``data_source`` overrides the field for every row. ``answer_regex`` extracts the ground truth
    from the answer field by its first group (e.g. ``'#### (.*)'`` for GSM8K's ``answer``); without it, known data
    sources get verl's own extraction (:func:`default_ground_truth`), and a sentence saying so for how many rows
    is appended to ``notes``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    if path.suffix == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise ValueError(f"prompts file {path} is not a readable parquet file ({error}); was it cut short?") from None
        records = [plain_python(r) for r in frame.to_dict(orient="records")]
        lines: list[int] | None = None
    elif path.suffix in (".jsonl", ".json"):
        numbered = list(read_jsonl_records(path))
        records, lines = [record for _, record in numbered], [number for number, _ in numbered]
    else:
        raise ValueError(f"prompts file {path}: expected .parquet (verl rows) or .jsonl")
    if limit is not None:
        records = records[:limit]
    pattern = re.compile(answer_regex) if answer_regex else None

    def where(row: int) -> str:  # rows count from 0 (the resume key); jsonl lines from 1
        return f"{path} row {row}" + (f" (line {lines[row]})" if lines is not None else "")

    def get(record: dict, dotted: str, row: int) -> Any:
        value: Any = record
        for key in dotted.split("."):
            if not isinstance(value, dict) or key not in value:
                raise KeyError(
                    f"{where(row)}: no field {dotted!r} (fields: {sorted(record)}); set the field option "
                    "(--prompt-field / --answer-field / --data-source-field) to the right name"
                )
            value = value[key]
        return value

    items = []
    extracted: dict[tuple[str, str], int] = {}
    for row, record in enumerate(records):
        answer = get(record, answer_field, row)
        source = data_source if data_source is not None else get(record, data_source_field, row)
        if pattern is not None:
            match = pattern.search(str(answer))
            if match is None:
                raise ValueError(f"{where(row)}: --answer-regex {answer_regex!r} does not match {answer!r}")
            answer = match.group(1).strip()
        else:
            try:
                answer, rule = default_ground_truth(str(source), answer)
            except ValueError as error:
                raise ValueError(f"{where(row)}: {error} (answer {answer!r:.200})") from None
            if rule is not None:
                extracted[(str(source), rule)] = extracted.get((str(source), rule), 0) + 1
        extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
        items.append(PromptItem(row, get(record, prompt_field, row), answer, str(source), dict(extra or {})))
    if notes is not None:
        for (source, rule), count in sorted(extracted.items()):
            notes.append(f"ground truth of {count} of {len(items)} rows (data_source {source!r}): the {rule} of "
                         f"{answer_field!r}, as verl's preprocessing extracts it; --answer-regex overrides this")
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
