"""Monte-Carlo step labels: seed rollouts from the policy, values of step prefixes from the prover.

For a prompt x and a seed rollout y = a_1..a_H (steps by :mod:`verl_prm.steps`), the label of step h is

    q_h = n_success_h / n_mc,   n_success_h = #{j <= n_mc : R(y[:end_h] + c_j) = 1},  c_j ~ prover(. | x, y[:end_h])

an unbiased estimate of Q^prover(s_h, a_h) with standard error sqrt(Q (1 - Q) / n_mc). The terminal step of a
response that ended at EOS needs no rollouts: its value is the outcome R(y) (stored with n_mc = 0).

Strategies:

* ``every``: every step prefix gets n_mc continuations (cost n_cov * H * n_mc rollouts per prompt).
* ``first_pit``: in a **failed** rollout, binary search for the first pit, the first step after which the
  value "falls to 0", meaning: **zero successes out of n_mc continuations** of that prefix. The search assumes
  that the value stays 0 once it is 0 (a wrong step is not repaired), so it costs about log2(H) prefixes.
  Steps at and after the pit get q = 0 (measured, or inferred with n_mc = 0); measured steps before it keep
  their q; the other steps before it stay unlabelled (q = NaN). With n_mc samples a step whose true value is
  small but positive reads as 0 with probability (1 - Q)^n_mc, so the pit found is the first step whose value
  is below about 1/n_mc. Successful rollouts are labelled at every prefix (``success_labels="every"``) or
  only by their outcome at the terminal step (``success_labels="outcome"``).

All rollouts of a batch of prompts advance together: every generation call carries the requests of all of
them (one call for ``every``, one per binary-search round for ``first_pit``), which is what batching engines
and vLLM's prefix cache need.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from verl_prm.labeling.generators import Generator, derive_seed
from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.scoring import OutcomeScorer

__all__ = ["LabelSettings", "MonteCarloLabeler", "first_pit_search_step"]

STRATEGIES = ("every", "first_pit")


@dataclass(frozen=True)
class LabelSettings:
    n_cov: int = 4
    n_mc: int = 8
    strategy: str = "every"
    success_labels: str = "every"
    delimiter: str = "\n\n"
    step_regex: str | None = None
    max_steps: int | None = None
    # code responses: a rule of verl_prm.steps.code ("block", "line", "indent") instead of delimiter/step_regex
    code_rule: str | None = None
    code_depth: int = 0
    prompt_value: bool = True
    seed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.n_cov < 1 or self.n_mc < 1:
            raise ValueError(f"n_cov and n_mc must be >= 1, got n_cov={self.n_cov}, n_mc={self.n_mc}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.success_labels not in ("every", "outcome"):
            raise ValueError(f"success_labels must be 'every' or 'outcome', got {self.success_labels!r}")
        if self.code_rule is not None:
            from verl_prm.config.hook import CODE_STEP_RULES

            if self.code_rule not in CODE_STEP_RULES:
                raise ValueError(f"code_rule must be one of {CODE_STEP_RULES}, got {self.code_rule!r}")
            if self.step_regex is not None:
                raise ValueError("pass either a code rule or a step regex, not both")
        if self.code_depth < 0:
            raise ValueError(f"code_depth must be >= 0, got {self.code_depth}")

    def step_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the steps of ``text`` under these settings."""
        if self.code_rule is not None:
            from verl_prm.steps.code import code_step_char_spans

            spans = code_step_char_spans(text, self.code_rule, depth=self.code_depth, max_steps=self.max_steps)
        else:
            from verl_prm.steps import step_char_spans

            spans = step_char_spans(text, self.delimiter, regex=self.step_regex, max_steps=self.max_steps)
        return [tuple(span) for span in spans]


def first_pit_search_step(lo: int, hi: int, mid_is_zero: bool) -> tuple[int, int]:
    """One step of the binary search for the first zero of a monotone 0/1 sequence on [lo, hi).

    Invariant: every step < lo has value > 0, step hi has value 0 (or hi = H is the "no pit" sentinel).
    ``mid = (lo + hi) // 2`` was measured; returns the new (lo, hi). The search ends when lo == hi = the pit.
    """
    mid = (lo + hi) // 2
    return (lo, mid) if mid_is_zero else (mid + 1, hi)


@dataclass
class _Rollout:
    item: PromptItem
    prompt_text: str
    rollout_index: int
    response: str
    finished: bool
    spans: list[tuple[int, int]]
    score: float
    outcome: float
    q: list[float] = field(default_factory=list)
    n_success: list[int] = field(default_factory=list)
    n_mc: list[int] = field(default_factory=list)
    first_pit: int = -1
    search: tuple[int, int] | None = None  # (lo, hi) of an unfinished first-pit search


class MonteCarloLabeler:
    """Labels batches of prompts. ``policy`` writes the seed rollouts, ``prover`` the continuations (the same
    object when the prover is the base policy; store the counts and apply Best-of-K later).

    ``on_generated(num_sequences)`` is called after each generation call (progress bars).
    """

    def __init__(
        self,
        policy: Generator,
        prover: Generator,
        scorer: OutcomeScorer,
        settings: LabelSettings,
        *,
        on_generated: Callable[[int], None] | None = None,
    ) -> None:
        self.policy = policy
        self.prover = prover
        self.scorer = scorer
        self.settings = settings
        self.on_generated = on_generated
        self.num_generated = 0

    def _generate(self, generator: Generator, texts: list[str], n: int, seeds: list[int]):
        if not texts:
            return []
        completions = generator.generate(texts, n, seeds)
        if len(completions) != len(texts) or any(len(c) != n for c in completions):
            raise RuntimeError(
                f"generator {type(generator).__name__} returned {[len(c) for c in completions]} completions for "
                f"{len(texts)} texts x n={n}"
            )
        self.num_generated += len(texts) * n
        if self.on_generated is not None:
            self.on_generated(len(texts) * n)
        return completions

    def _outcomes(self, pairs: Sequence[tuple[PromptItem, str]]) -> list[tuple[float, float]]:
        """(score, 0/1 outcome) of each (item, full response), scored in one ``score_many`` call."""
        scores = self.scorer.score_many([item.data_source for item, _ in pairs], [response for _, response in pairs],
                                        [item.ground_truth for item, _ in pairs], [item.extra_info for item, _ in pairs])
        return [(score, 1.0 if self.scorer.success(score) else 0.0) for score in scores]

    def _count_successes(self, requests: list[tuple[PromptItem, str, str, int]]) -> list[int]:
        """requests: (item, prompt_text, response_prefix, seed) -> successes among n_mc prover continuations."""
        texts = [prompt + prefix for _, prompt, prefix, _ in requests]
        seeds = [seed for *_, seed in requests]
        completions = self._generate(self.prover, texts, self.settings.n_mc, seeds)
        outcomes = iter(self._outcomes([(item, prefix + sample.text) for (item, _, prefix, _), samples
                                        in zip(requests, completions) for sample in samples]))
        return [sum(int(next(outcomes)[1]) for _ in samples) for samples in completions]

    def _step_seed(self, rollout: _Rollout, h: int) -> int:
        return derive_seed(self.settings.seed, "mc", rollout.item.index, rollout.rollout_index, h)

    def label(self, items: Sequence[PromptItem], prompt_texts: Sequence[str]) -> list[dict]:
        """Label ``items`` (rendered as ``prompt_texts``); returns label rows (see :mod:`.format`), ordered by
        prompt then rollout."""
        s = self.settings
        seeds = [derive_seed(s.seed, "seed", item.index) for item in items]
        seed_completions = self._generate(self.policy, list(prompt_texts), s.n_cov, seeds)
        rollouts: list[_Rollout] = []
        outcomes = iter(self._outcomes([(item, sample.text) for item, samples in zip(items, seed_completions)
                                        for sample in samples]))
        for item, prompt_text, samples in zip(items, prompt_texts, seed_completions):
            for r, sample in enumerate(samples):
                spans = s.step_spans(sample.text)
                score, outcome = next(outcomes)
                H = len(spans)
                rollouts.append(
                    _Rollout(item, prompt_text, r, sample.text, sample.finished, spans, score, outcome,
                             q=[math.nan] * H, n_success=[0] * H, n_mc=[0] * H)
                )

        # Round 0: every prefix that needs continuations under the strategy, the first binary-search
        # midpoints, and the prompt values, all in one generation call.
        requests: list[tuple[PromptItem, str, str, int]] = []
        targets: list[tuple[_Rollout | int, int]] = []  # (rollout, step) or (prompt position, -1)

        def add(rollout: _Rollout, h: int) -> None:
            requests.append((rollout.item, rollout.prompt_text, rollout.response[: rollout.spans[h][1]],
                             self._step_seed(rollout, h)))
            targets.append((rollout, h))

        for rollout in rollouts:
            H = len(rollout.spans)
            if H == 0:
                continue
            if rollout.finished:  # the terminal value is the outcome: no rollouts needed
                rollout.q[H - 1] = rollout.outcome
            label_all = s.strategy == "every" or (rollout.outcome == 1.0 and s.success_labels == "every")
            if label_all:
                for h in range(H - 1 if rollout.finished else H):
                    add(rollout, h)
            elif rollout.outcome == 0.0:
                rollout.search = (0, H - 1 if rollout.finished else H)
                if rollout.search[0] < rollout.search[1]:
                    add(rollout, sum(rollout.search) // 2)
        if s.prompt_value:
            for position, (item, prompt_text) in enumerate(zip(items, prompt_texts)):
                requests.append((item, prompt_text, "", derive_seed(s.seed, "v0", item.index)))
                targets.append((position, -1))

        prompt_counts: dict[int, int] = {}
        while requests:
            counts = self._count_successes(requests)
            answered = targets
            requests, targets = [], []  # the next binary-search round
            for (target, h), count in zip(answered, counts):
                if isinstance(target, int):
                    prompt_counts[target] = count
                    continue
                target.n_success[h], target.n_mc[h], target.q[h] = count, s.n_mc, count / s.n_mc
                if target.search is not None:
                    target.search = first_pit_search_step(*target.search, count == 0)
                    if target.search[0] < target.search[1]:
                        add(target, sum(target.search) // 2)

        rows = []
        position_of = {id(item): position for position, item in enumerate(items)}
        for rollout in rollouts:
            H = len(rollout.spans)
            if rollout.search is not None:
                pit = rollout.search[0]
                if pit < H:
                    rollout.first_pit = pit
                    for h in range(pit, H):
                        if rollout.n_mc[h] == 0:
                            rollout.q[h] = 0.0  # inferred: no recovery after a pit
            position = position_of[id(rollout.item)]
            n_prompt = s.n_mc if s.prompt_value else 0
            success_prompt = prompt_counts.get(position, 0)
            ground_truth = rollout.item.ground_truth
            rows.append(
                dict(
                    prompt_index=int(rollout.item.index),
                    rollout_index=int(rollout.rollout_index),
                    data_source=rollout.item.data_source,
                    prompt=rollout.prompt_text,
                    ground_truth=ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth, default=str),
                    response=rollout.response,
                    step_starts=[int(a) for a, _ in rollout.spans],
                    step_ends=[int(b) for _, b in rollout.spans],
                    q=[float(v) for v in rollout.q],
                    n_success=list(rollout.n_success),
                    n_mc=list(rollout.n_mc),
                    first_pit=int(rollout.first_pit),
                    prompt_value=success_prompt / n_prompt if n_prompt else math.nan,
                    prompt_n_success=int(success_prompt),
                    prompt_n_mc=int(n_prompt),
                    outcome=float(rollout.outcome),
                    score=float(rollout.score),
                    finished=bool(rollout.finished),
                    strategy=s.strategy,
                    source=s.source,
                )
            )
        return rows
