"""The unit-test outcome verifier for code: a task's tests run against a candidate in the sandbox.

A `CodeTask` holds what a candidate is tested with; `build_program` assembles the program that runs in the
sandbox; `verify` / `verify_many` run it and return a `Verdict` (passed + the sandbox's failure reason).

Task kinds:

* ``"humaneval"`` (HumanEval, and any task in its format): ``prompt`` is the code the model continues (imports,
  the signature and docstring of ``entry_point``, sometimes helper functions); ``tests`` defines
  ``check(candidate)``. The program is::

      prompt + completion            (the completion continues the function body)
      prompt + "\\n" + completion     (the completion defines ``def <entry_point>(`` itself, e.g. a chat
                                      answer: the prompt's imports and helpers stay available)
      + "\\n\\n" + tests + "\\n\\ncheck(<entry_point>)\\n"

* ``"assert"`` (MBPP): ``prompt`` is optional setup code (MBPP's ``test_setup_code``), ``tests`` a block of
  ``assert`` statements. The program is ``prompt + "\\n" + completion + "\\n\\n" + tests + "\\n"``.

The completion is first passed through `extract_code`: a chat answer's first fenced code block (```python,
```py or a bare ```); text without a fence is used as it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from verl_prm.code.sandbox import run_many, run_program
from verl_prm.code.sandbox_config import RunResult, SandboxConfig

__all__ = ["CodeTask", "Verdict", "build_program", "extract_code", "verify", "verify_many", "TASK_KINDS"]

TASK_KINDS = ("humaneval", "assert")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeTask:
    """One code task (module docstring: kinds and how the program is assembled).

    Attributes:
        task_id: a name for messages ("HumanEval/0", "mbpp/11").
        kind: "humaneval" or "assert".
        prompt: code written before the completion (HumanEval: the prompt the model continues; MBPP: setup).
        tests: the test code (HumanEval: defines ``check``; MBPP: asserts).
        entry_point: the function under test (HumanEval; optional for "assert").
    """

    task_id: str
    kind: str
    prompt: str
    tests: str
    entry_point: str = ""

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.task_id}: kind must be one of {TASK_KINDS}, got {self.kind!r}")
        if self.kind == "humaneval" and not self.entry_point:
            raise ValueError(f"task {self.task_id}: a humaneval task needs entry_point (the function check() tests)")
        if not self.tests.strip():
            raise ValueError(f"task {self.task_id}: the task has no tests; a verifier without tests passes anything")

    def to_ground_truth(self) -> str:
        """The task as the JSON text stored in verl's ``reward_model.ground_truth``."""
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_ground_truth(cls, ground_truth: Any) -> "CodeTask":
        """The task from verl's ground truth: the JSON text of `to_ground_truth`, or the dict itself."""
        if isinstance(ground_truth, (bytes, bytearray)):
            ground_truth = ground_truth.decode()
        if isinstance(ground_truth, str):
            try:
                ground_truth = json.loads(ground_truth)
            except ValueError:
                raise ValueError(
                    f"code ground truth is not JSON: {ground_truth[:80]!r}; write rows with "
                    "verl_prm.code.data (reward_model.ground_truth = CodeTask.to_ground_truth())"
                ) from None
        if not isinstance(ground_truth, dict):
            raise ValueError(f"code ground truth must be a JSON object of a CodeTask, got {type(ground_truth).__name__}")
        known = {k: ground_truth[k] for k in ("task_id", "kind", "prompt", "tests", "entry_point") if k in ground_truth}
        missing = {"task_id", "kind", "prompt", "tests"} - set(known)
        if missing:
            raise ValueError(f"code ground truth lacks {sorted(missing)} (has {sorted(ground_truth)})")
        return cls(**known)


@dataclass
class Verdict:
    """The verifier's outcome for one candidate: ``passed``, the sandbox's ``reason`` and the run itself."""

    task_id: str
    passed: bool
    reason: str
    detail: str
    run: RunResult

    @property
    def score(self) -> float:
        return 1.0 if self.passed else 0.0


def extract_code(text: str) -> str:
    """The code in a completion: the first fenced block (```python / ```py / ```), an unterminated fence
    running to the end; text without a fence as it is."""
    if "```" not in text:
        return text
    match = _FENCE.search(text)
    return match.group(1) if match else text


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def build_program(task: CodeTask, completion: str) -> str:
    """The program that tests ``completion`` on ``task`` (module docstring)."""
    code = extract_code(completion)
    if task.kind == "humaneval":
        head = task.prompt + "\n" + code if _defines(code, task.entry_point) else task.prompt + code
        return f"{head}\n\n{task.tests}\n\ncheck({task.entry_point})\n"
    return f"{task.prompt}\n{code}\n\n{task.tests}\n"


def _verdict(task: CodeTask, run: RunResult) -> Verdict:
    return Verdict(task.task_id, run.passed, run.reason, run.detail, run)


def verify(task: CodeTask, completion: str, config: SandboxConfig | None = None) -> Verdict:
    """Run ``task``'s tests against ``completion`` in the sandbox."""
    return _verdict(task, run_program(build_program(task, completion), config))


def verify_many(
    pairs: Sequence[tuple[CodeTask, str]],
    config: SandboxConfig | None = None,
    *,
    max_workers: int | None = None,
    progress: bool = False,
) -> list[Verdict]:
    """`verify` over ``(task, completion)`` pairs, at most ``max_workers`` sandboxes at once; input order."""
    runs = run_many([build_program(t, c) for t, c in pairs], config, max_workers=max_workers, progress=progress)
    return [_verdict(task, run) for (task, _), run in zip(pairs, runs)]
