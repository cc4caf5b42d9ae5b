"""Exact prover critics: the values of a prover known in closed form, in place of a learned critic.

A learned prover critic estimates ``V(prefix)`` = the probability that a fixed prover, continuing from the
prefix, ends with a correct answer. For a task whose prover is scripted (e.g. the arithmetic recipe's prover,
which writes each remaining result correctly with probability p), that probability can be computed exactly.
With an exact critic, PAV runs with the true progress values, which separates "does progress help?" from
"can we learn the critic?".

Pieces:

- ``build_exact_prover``: the prover named by ``verl_prm.critic.options.prover`` (``"module:Class"``, imported
  when a run builds it: the application that owns a prover names it, the library names none), built by the
  class's ``from_options`` from the other options.
- ``ExactProver``: the protocol a prover implements (``from_options`` and ``values``).
- ``ExactCritic``: what a ``ProverCriticWorker`` holds for ``verl_prm.critic.source=exact``; it has the
  ``ProverCritic`` entry points ``score_policy_batch`` and ``score_texts`` and returns ``CriticScores``.
- ``ExactPrefixCritic``: the search's ``PrefixCritic`` (``verl_prm.search``: best-of-N, beam search).

Config of a verl run::

    verl_prm.critic.source=exact
    +verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver
    +verl_prm.critic.options.step_accuracy=0.8
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Mapping, Protocol, Sequence

import torch

from verl_prm.checks import is_class_path
from verl_prm.critic.scorer import CriticScores
from verl_prm.steps import decode_with_char_ends, step_char_spans

__all__ = [
    "ExactCritic",
    "ExactPrefixCritic",
    "ExactProver",
    "ProverOptionError",
    "build_exact_prover",
    "step_texts_at_char_ends",
]


class ProverOptionError(ValueError):
    """An option of an exact prover is missing, unknown or out of range; ``option`` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class ExactProver(Protocol):
    """An exact prover of one task.

    ``from_options(options)`` builds it from ``verl_prm.critic.options`` (without ``prover``) and raises
    ``ProverOptionError`` naming a bad option. ``values(prompt_text, step_texts, sample, complete=True)``
    returns ``[v_0, ..., v_H]``: v_0 the value of the prompt, v_h the value after step h, i.e. of the prefix
    ``"".join(step_texts[:h])``; ``complete``: the last step ends the response (its value is the outcome).
    Errors are ValueErrors naming ``sample``.
    """

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ExactProver": ...

    def values(self, prompt_text: str, step_texts: Sequence[str], sample: int, complete: bool = True) -> list[float]: ...


def build_exact_prover(prover: Any, options: Mapping[str, Any] | None = None) -> ExactProver:
    """The exact prover ``prover`` (a ``"module:Class"`` string or the class itself), built by the class's
    ``from_options(options)``.

    Raises:
        ValueError: a target that is not ``"module:Class"``, cannot be imported or has no ``from_options``.
        ProverOptionError: a bad option (raised by the prover class; names the option).
    """
    cls = prover
    if isinstance(prover, str):
        if not is_class_path(prover):
            raise ValueError(f"an exact prover is named 'module:Class', got {prover!r}")
        module_name, attr = prover.split(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"the exact prover {prover!r} cannot be imported: {error}") from None
    if not callable(getattr(cls, "from_options", None)):
        raise ValueError(f"the exact prover {cls!r} has no from_options(options) (the ExactProver protocol)")
    return cls.from_options(dict(options or {}))


def check_step_accuracy(value: Any) -> float:
    """``step_accuracy`` as a float: a real number (no bool), finite, in (0, 1]; else ``ProverOptionError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProverOptionError("step_accuracy", f"step_accuracy must be a number in (0, 1], got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ProverOptionError("step_accuracy", f"step_accuracy must be a finite number in (0, 1], got {value}")
    return value


def step_texts_at_char_ends(text: str, char_ends: Sequence[int], sample: int) -> list[str]:
    """The step texts of ``text`` whose steps end (exclusive) at ``char_ends``: step h is
    ``text[char_ends[h-1]:char_ends[h]]`` (from 0 for h = 0); the last step runs to the end of ``text`` (text
    after the last step end, e.g. whitespace, belongs to it). Ends must not decrease and lie in the text."""
    previous = 0
    for h, end in enumerate(char_ends):
        if not previous <= end <= len(text):
            raise ValueError(
                f"sample {sample}: step {h} ends at character {end}, outside [{previous}, {len(text)}] of the "
                "response text; step_char_ends must be the split's (verl_prm.steps.split_steps)"
            )
        previous = end
    starts = [0] + list(char_ends[:-1])
    steps = [text[s:e] for s, e in zip(starts, char_ends)]
    if steps:
        steps[-1] = text[starts[-1]:]
    return steps


def _decode_prompt_texts(tokenizer, prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[str]:
    """The policy prompts as text: unmasked ids decoded with special tokens kept (as
    ``verl_prm.critic.sequences.decode_prompts``)."""
    keep = prompt_mask.cpu() != 0
    rows = prompts.cpu().tolist()
    return [
        tokenizer.decode([t for t, k in zip(row, krow) if k], skip_special_tokens=False,
                         clean_up_tokenization_spaces=False)
        for row, krow in zip(rows, keep.tolist())
    ]


class ExactCritic:
    """A critic whose values come from an exact prover (``verl_prm.critic.source=exact``): no checkpoint, no
    forward pass. It reads text: the steps of each response as the step split found them.

    Attributes mirror ``ProverCritic`` where the worker and the search read them: ``device`` (cpu),
    ``best_of_k`` (1: the estimators apply Best-of-K), ``packing`` ("none"), ``tokenizer`` (None: there are no
    critic tokens).
    """

    def __init__(self, prover: ExactProver):
        if not callable(getattr(prover, "values", None)):
            raise ValueError(f"ExactCritic needs a prover with values(prompt_text, step_texts, sample), got {prover!r}")
        self.prover = prover
        self.device = torch.device("cpu")
        self.best_of_k = 1
        self.packing = "none"
        self.tokenizer = None

    @classmethod
    def from_options(cls, prover: Any = None, **options: Any) -> "ExactCritic":
        """The exact critic of ``prover`` (``"module:Class"`` or the class; ``build_exact_prover(prover, options)``)."""
        if prover is None:
            raise ValueError(
                "ExactCritic.from_options needs prover, the exact prover's 'module:Class' "
                "(verl_prm.critic.options.prover)"
            )
        return cls(build_exact_prover(prover, options))

    # ------------------------------------------------------------------ entry points
    def score_steps(
        self,
        prompt_texts: Sequence[str],
        step_texts: Sequence[Sequence[str]],
        *,
        num_step_slots: int | None = None,
        sample_offset: int = 0,
    ) -> CriticScores:
        """Values of responses given as step texts (each response complete: its last step ends it).

        Returns CriticScores (fp32): prompt_values [B], step_values [B, S] (S = ``num_step_slots``, default the
        largest H), num_steps [B] = ``len(step_texts[b])``.
        """
        if len(prompt_texts) != len(step_texts):
            raise ValueError(f"ExactCritic: {len(prompt_texts)} prompts but {len(step_texts)} responses")
        rows = [
            self._values(prompt, steps, sample_offset + b, complete=True)
            for b, (prompt, steps) in enumerate(zip(prompt_texts, step_texts))
        ]
        num_steps = torch.tensor([len(steps) for steps in step_texts], dtype=torch.long)
        width = int(num_steps.max()) if len(rows) else 0
        if num_step_slots is not None:
            if num_step_slots < width:
                raise ValueError(f"num_step_slots={num_step_slots} is smaller than the largest step count {width}")
            width = num_step_slots
        prompt_values = torch.tensor([row[0] for row in rows], dtype=torch.float32)
        step_values = torch.zeros(len(rows), width, dtype=torch.float32)
        for b, row in enumerate(rows):
            step_values[b, : len(row) - 1] = torch.tensor(row[1:], dtype=torch.float32)
        return CriticScores(prompt_values, step_values, num_steps)

    def score_policy_batch(
        self,
        prompts: torch.Tensor,
        responses: torch.Tensor,
        attention_mask: torch.Tensor,
        split,
        policy_tokenizer=None,
        *,
        prompt_texts: Sequence[str] | None = None,
        sample_offset: int = 0,
    ) -> CriticScores:
        """Score a verl rollout batch (the ``ProverCritic.score_policy_batch`` signature).

        The response texts and step ends are ``split.texts`` / ``split.step_char_ends`` when the split carries
        them (``split_steps`` fills them), else the responses are decoded with the policy tokenizer and step h
        ends after the last character of token ``split.step_ends[b, h]``. Prompt texts: ``prompt_texts``, else
        the policy prompts decoded with special tokens kept. ``num_steps`` equals ``split.num_steps``;
        ``step_values`` is [B, S] with S = ``split.step_ends.shape[1]``.
        """
        batch = responses.shape[0]
        prompt_len = prompts.shape[1]
        num_steps = [int(n) for n in split.num_steps.cpu().tolist()]
        has_text = len(split.texts) == batch and tuple(split.step_char_ends.shape[:1]) == (batch,)
        if not has_text or prompt_texts is None:
            if policy_tokenizer is None:
                raise ValueError(
                    "ExactCritic.score_policy_batch reads text: pass policy_tokenizer (and/or a split with texts "
                    "and step_char_ends plus prompt_texts)"
                )
        if has_text:
            texts = list(split.texts)
            char_ends = split.step_char_ends.cpu()
        else:
            decoded = decode_with_char_ends(policy_tokenizer, responses, attention_mask[:, prompt_len:])
            texts = decoded.texts
            ends = split.step_ends.cpu().clamp(min=0)
            char_ends = decoded.char_ends.gather(1, ends) if ends.shape[1] else ends
        if prompt_texts is None:
            prompt_texts = _decode_prompt_texts(policy_tokenizer, prompts, attention_mask[:, :prompt_len])
        if len(prompt_texts) != batch:
            raise ValueError(f"ExactCritic: {len(prompt_texts)} prompt texts for {batch} responses")
        step_texts = [
            step_texts_at_char_ends(texts[b], char_ends[b, : num_steps[b]].tolist(), sample_offset + b)
            for b in range(batch)
        ]
        return self.score_steps(list(prompt_texts), step_texts, num_step_slots=int(split.step_ends.shape[1]),
                                sample_offset=sample_offset)

    def score_texts(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        delimiter: str = "\n\n",
        regex: str | None = None,
        max_steps: int | None = None,
    ) -> CriticScores:
        """Score complete responses given as text; steps by ``verl_prm.steps.step_char_spans`` (``delimiter``
        or ``regex``, as ``ProverCritic.score_texts``)."""
        if len(prompts) != len(responses):
            raise ValueError(f"score_texts: {len(prompts)} prompts but {len(responses)} responses")
        step_texts = [
            [response[s:e] for s, e in step_char_spans(response, delimiter, regex=regex, max_steps=max_steps)]
            for response in responses
        ]
        return self.score_steps(list(prompts), step_texts)

    # ------------------------------------------------------------------ internals
    def _values(self, prompt_text: str, steps: Sequence[str], sample: int, complete: bool) -> list[float]:
        values = self.prover.values(prompt_text, list(steps), sample, complete=complete)
        return checked_values(values, len(steps), sample)


def checked_values(values: Sequence[float], num_steps: int, sample: int) -> list[float]:
    """A prover's ``[v_0..v_H]`` as floats, checked: H + 1 entries, each finite and in [0, 1]."""
    values = [float(v) for v in values]
    if len(values) != num_steps + 1:
        raise ValueError(
            f"sample {sample}: the exact prover returned {len(values)} values for {num_steps} steps "
            f"(expected v_0..v_H, {num_steps + 1})"
        )
    for h, v in enumerate(values):
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            where = "the prompt" if h == 0 else f"step {h - 1}"
            raise ValueError(f"sample {sample}: the exact prover's value at {where} is {v}, not a probability in [0, 1]")
    return values


class ExactPrefixCritic:
    """An exact prover as the search's prefix critic (``verl_prm.search.nodes.PrefixCritic``)::

        critic = CachedCritic(ExactPrefixCritic(ExactCritic.from_options("arithmetic_mod", step_accuracy=0.8),
                                                prompt_texts))

    ``score_nodes(nodes)`` returns ``[v_0..v_H]`` per node (``node.steps`` are step texts; a finished node's
    last step ends the response) and 0 critic tokens per node (no model reads anything).

    Args:
        critic_or_prover: an ``ExactCritic`` or an exact prover (``values``).
        prompts: the prompt text of each problem (index = ``node.problem``).
    """

    def __init__(self, critic_or_prover, prompts: Sequence[str]) -> None:
        self.prover = getattr(critic_or_prover, "prover", critic_or_prover)
        if not callable(getattr(self.prover, "values", None)):
            raise ValueError(f"ExactPrefixCritic needs an ExactCritic or a prover with values(), got {critic_or_prover!r}")
        self.prompts = list(prompts)

    def score_nodes(self, nodes) -> tuple[list[list[float]], list[int]]:
        values = []
        for node in nodes:
            if not 0 <= node.problem < len(self.prompts):
                raise ValueError(f"problem {node.problem}: no prompt text (ExactPrefixCritic has {len(self.prompts)})")
            steps = [str(step) for step in node.steps]
            raw = self.prover.values(self.prompts[node.problem], steps, node.problem, complete=bool(node.finished))
            values.append(checked_values(raw, len(steps), node.problem))
        return values, [0] * len(nodes)
