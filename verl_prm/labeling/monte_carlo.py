"""Monte-Carlo step labels: seed rollouts from the policy, values of step prefixes from the prover.

For a prompt x and a seed rollout y = a_1..a_H (steps by :mod:`verl_prm.steps`), the label of step h is the success
rate of ``n_mc`` prover continuations of the prefix (:mod:`verl_prm.monte_carlo`, which also picks the prefixes by
``prefix_rule`` and runs the first-pit search):

    q_h = n_success_h / n_mc,   n_success_h = #{j <= n_mc : R(y[:end_h] + c_j) = 1},  c_j ~ prover(. | x, y[:end_h])

The terminal step of a response that ended at EOS needs no rollouts: its value is the outcome R(y) (stored with
n_mc = 0). Under ``first_pit``, steps at and after the pit get q = 0 (measured, or inferred with n_mc = 0),
measured steps before it keep their q and the other steps stay unlabelled (q = NaN); so do the steps that
``fixed`` does not pick. The prompt value V(x) is the success rate of n_mc continuations of the prompt alone.

All rollouts of a batch of prompts advance together: every generation call carries the requests of all of
them (one call for ``every``/``fixed``, one per binary-search round for ``first_pit``), which is what batching
engines and vLLM's prefix cache need.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from verl_prm.choices import CodeStepRule, PrefixRule, SuccessLabels
from verl_prm.labeling.generators import Generator, derive_seed
from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.monte_carlo import PrefixCounts, PrefixRequest, ResponseSteps, estimate_prefixes
from verl_prm.settings import check_bounds, check_choices, setting

__all__ = ["LabelSettings", "MonteCarloLabeler"]


@dataclass(frozen=True)
class LabelSettings:
    """What `verl-prm label` labels and how (its flags are these fields: verl_prm.labeling.cli)."""

    n_cov: int = setting(4, "Seed rollouts of the policy per prompt.", low=1)
    n_mc: int = setting(8, "Prover continuations per step prefix.", low=1)
    prefix_rule: PrefixRule = setting("every", "Which step prefixes are continued (verl_prm.monte_carlo): every, "
                                      "fixed (--prefixes-per-response evenly spaced steps) or first_pit (bisection "
                                      "for the first zero-value step of each failed rollout).")
    prefixes_per_response: int = setting(4, "With --prefix-rule fixed: steps continued per rollout.", low=1)
    success_labels: SuccessLabels = setting("every", "With --prefix-rule first_pit: label successful rollouts at "
                                            "every prefix, or only by their outcome.")
    delimiter: str = setting("\n\n", "Step delimiter (the escapes \\n, \\t, ... are decoded by the command "
                             "line).")
    step_regex: str | None = setting(None, "Steps end at the matches of this regex instead of the delimiter.")
    max_steps: int | None = setting(None, "Merge the steps beyond this count into the last.", low=1)
    code_rule: CodeStepRule | None = setting(None, "Code responses: steps by a rule of verl_prm.steps.code instead "
                                             "of the delimiter or the regex (block: Python statements by ast; line; "
                                             "indent), as verl_prm.steps.code_rule in the trainer hook.")
    code_depth: int = setting(0, "With --code-rule: the statement depth that still starts a step (1: each "
                              "statement of a function).", low=0)
    prompt_value: bool = setting(True, "Also label V(prompt) (continuations of the bare prompt).",
                                 flag="--no-prompt-value")
    seed: int = setting(0, "Seed of the sampling.", low=0)
    source: str = setting("", "The prover's name or path, stored with the labels.")

    def __post_init__(self) -> None:
        check_bounds(self, lambda name: name)
        check_choices(self, lambda name: name)
        if self.code_rule is not None and self.step_regex is not None:
            raise ValueError("pass either a code rule or a step regex, not both")
        if self.code_rule is None and self.code_depth != 0:
            raise ValueError(f"code_depth (--code-depth {self.code_depth}) applies to a code rule only (the statement "
                             "depth of code steps): add --code-rule block (or line, indent), or drop --code-depth")

    def step_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the steps of ``text`` under these settings."""
        # torch (verl_prm.steps): not at `verl-prm label --help`, whose flags come from these settings
        from verl_prm.steps import code as code_steps, step_char_spans

        if self.code_rule is not None:
            spans = code_steps.code_step_char_spans(text, self.code_rule, depth=self.code_depth, max_steps=self.max_steps)
        else:
            spans = step_char_spans(text, self.delimiter, regex=self.step_regex, max_steps=self.max_steps)
        return [tuple(span) for span in spans]


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

    def _seed_rollouts(self, items: Sequence[PromptItem], prompt_texts: Sequence[str]) -> list[_Rollout]:
        s = self.settings
        seeds = [derive_seed(s.seed, "seed", item.index) for item in items]
        seed_completions = self._generate(self.policy, list(prompt_texts), s.n_cov, seeds)
        outcomes = iter(self._outcomes([(item, sample.text) for item, samples in zip(items, seed_completions)
                                        for sample in samples]))
        rollouts = []
        for item, prompt_text, samples in zip(items, prompt_texts, seed_completions):
            for r, sample in enumerate(samples):
                spans = s.step_spans(sample.text)
                score, outcome = next(outcomes)
                H = len(spans)
                rollouts.append(_Rollout(item, prompt_text, r, sample.text, sample.finished, spans, score, outcome,
                                         q=[math.nan] * H, n_success=[0] * H, n_mc=[0] * H))
        return rollouts

    def _sample(self, rollouts: list[_Rollout], requests: list[PrefixRequest]) -> list[PrefixCounts]:
        """Continue each requested prefix (step -1: the prompt alone) n_mc times with the prover, in one
        generation call, and count the successes.

        The call holds the requests row by row (steps in order), the prompts last: the transformers back end
        seeds each micro-batch from the seeds in it, so this order keeps the batches, and the labels, of the
        labeler's earlier versions (the recipe's published labels are reproduced).
        """
        order = sorted(range(len(requests)), key=lambda i: (requests[i].step < 0, requests[i].row, requests[i].step))
        counts = self._sample_in_order(rollouts, [requests[i] for i in order])
        result: list[PrefixCounts] = [None] * len(requests)  # type: ignore[list-item]
        for position, i in enumerate(order):
            result[i] = counts[position]
        return result

    def _sample_in_order(self, rollouts: list[_Rollout], requests: list[PrefixRequest]) -> list[PrefixCounts]:
        s = self.settings
        prefixes, texts, seeds = [], [], []
        for request in requests:
            rollout = rollouts[request.row]
            prefix = "" if request.step < 0 else rollout.response[: rollout.spans[request.step][1]]
            prefixes.append(prefix)
            texts.append(rollout.prompt_text + prefix)
            seeds.append(derive_seed(s.seed, "v0", rollout.item.index) if request.step < 0 else
                         derive_seed(s.seed, "mc", rollout.item.index, rollout.rollout_index, request.step))
        completions = self._generate(self.prover, texts, s.n_mc, seeds)
        outcomes = iter(self._outcomes([(rollouts[request.row].item, prefix + sample.text) for request, prefix, samples
                                        in zip(requests, prefixes, completions) for sample in samples]))
        return [PrefixCounts(successes=sum(int(next(outcomes)[1]) for _ in samples), continuations=len(samples),
                             tokens=sum(sample.num_tokens for sample in samples)) for samples in completions]

    def label(self, items: Sequence[PromptItem], prompt_texts: Sequence[str]) -> list[dict]:
        """Label ``items`` (rendered as ``prompt_texts``); returns label rows (see :mod:`.format`), ordered by
        prompt then rollout."""
        s = self.settings
        rollouts = self._seed_rollouts(items, prompt_texts)
        responses = [ResponseSteps(num_steps=len(r.spans), success=r.outcome == 1.0, last_known=r.finished)
                     for r in rollouts]
        first_rows = {id(r.item): row for row, r in reversed(list(enumerate(rollouts)))}
        estimates = estimate_prefixes(
            responses, lambda requests: self._sample(rollouts, requests), prefix_rule=s.prefix_rule, n_mc=s.n_mc,
            prefixes_per_response=s.prefixes_per_response, success_labels=s.success_labels,
            prompt_rows=[first_rows[id(item)] for item in items if id(item) in first_rows] if s.prompt_value else (),
        )
        prompt_counts = {id(rollouts[row].item): count for (row, step), count in estimates.counts.items() if step < 0}
        for (row, step), count in estimates.counts.items():
            if step >= 0:
                rollout = rollouts[row]
                rollout.n_success[step], rollout.n_mc[step] = count.successes, count.continuations
                rollout.q[step] = count.success_rate
        for row, rollout in enumerate(rollouts):
            H = len(rollout.spans)
            if H and rollout.finished:  # the terminal value is the outcome: no rollouts needed
                rollout.q[H - 1] = rollout.outcome
            if estimates.pits.get(row, H) < H:
                rollout.first_pit = estimates.pits[row]
                for h in range(rollout.first_pit, H):
                    if rollout.n_mc[h] == 0:
                        rollout.q[h] = 0.0  # inferred: no recovery after a pit
        return [self._row(rollout, prompt_counts.get(id(rollout.item))) for rollout in rollouts]

    def _row(self, rollout: _Rollout, prompt: PrefixCounts | None) -> dict:
        s = self.settings
        ground_truth = rollout.item.ground_truth
        return dict(
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
            prompt_value=prompt.success_rate if prompt is not None else math.nan,
            prompt_n_success=int(prompt.successes) if prompt is not None else 0,
            prompt_n_mc=int(prompt.continuations) if prompt is not None else 0,
            outcome=float(rollout.outcome),
            score=float(rollout.score),
            finished=bool(rollout.finished),
            strategy=s.prefix_rule,
            source=s.source,
        )
