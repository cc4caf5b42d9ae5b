"""The ``token_logprob`` critic's math: a step's value from the policy's own confidence in the step's tokens.

A causal LM read with teacher forcing gives every response token ``x_t`` its log-probability
``l_t = log p(x_t | x_<t)`` (:func:`token_logprobs`). Per step h, over its tokens ``T_h``
(:func:`step_token_ranges`), the statistics (:func:`step_logprob_stats`)

    min_h = min_{t in T_h} l_t,    mean_h = mean_{t in T_h} l_t,
    result_h = min_k sum_{t in R_hk} l_t        (optional; min_h where the step has no result)

with ``R_hk`` the tokens of the k-th result the step claims (:func:`result_claims`: the matches of a regex in the
step's text), and their prefix minima over steps 1..h (:func:`prefix_min`), since a prefix is only as sound as
its weakest step. The value is a logistic head on the standardised features (:func:`head_values`):

    f_h = [prefix_min_1..h(stats), stats_h],    v_h = sigmoid(w . (f_h - m) / s + b),    v_0 = sigmoid(c)

(``c`` a constant fitted from the training prompts' values). The format that reads checkpoints of this critic is
:mod:`verl_prm.critic.token_logprob_format`; the fit is :mod:`verl_prm.training.token_logprob`; the files of its
head are :mod:`verl_prm.critic.token_logprob_head`.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch

__all__ = ["STEP_STATISTICS", "RESULT_STATISTIC", "LOGIT_CHUNK_ELEMENTS", "statistic_names", "feature_names",
           "step_token_ranges", "step_logprob_stats", "prefix_min", "cumulative_min", "step_features",
           "overlapping_tokens", "token_char_offsets", "result_span", "result_claims",
           "logit_chunk_tokens", "token_logprobs", "head_values"]

STEP_STATISTICS = ("min_logprob", "mean_logprob")
RESULT_STATISTIC = "result_logprob"
PREFIX = "prefix_min_"
# the [tokens, vocabulary] float32 logits of one chunk hold at most this many elements (256 MiB)
LOGIT_CHUNK_ELEMENTS = 2**26


def statistic_names(result: bool) -> tuple[str, ...]:
    """The per-step statistics, in column order: min and mean, and the result's when ``result``."""
    return STEP_STATISTICS + ((RESULT_STATISTIC,) if result else ())


def feature_names(result: bool) -> tuple[str, ...]:
    """The head's features, in column order: the prefix minima of the statistics, then the step's own."""
    names = statistic_names(result)
    return tuple(PREFIX + name for name in names) + names


def step_token_ranges(step_end_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """The response tokens ``[lo, hi)`` of each step: the tokens after the previous step's end token up to and
    including its own (``step_end_tokens``: the token holding each step's last character, response-relative,
    non-decreasing, >= 0; the first step starts at token 0):

        lo_h = min(e_{h-1} + 1, e_h),  hi_h = e_h + 1   (e_0 = -1)

    A step whose end token is the previous one's (one token holds the last characters of both) has that token
    alone."""
    ends = np.asarray(step_end_tokens, dtype=np.int64).reshape(-1)
    if ends.size and (ends[0] < 0 or np.any(np.diff(ends) < 0)):
        raise ValueError(f"step end tokens must be >= 0 and non-decreasing, got {ends.tolist()}")
    previous = np.concatenate([[-1], ends[:-1]])
    return list(zip(np.minimum(previous + 1, ends).tolist(), (ends + 1).tolist()))


def step_logprob_stats(token_logprobs: np.ndarray, ranges: Sequence[tuple[int, int]],
                       results: Sequence[Sequence[np.ndarray]] | None = None) -> np.ndarray:
    """[S, 2] (``results`` None) or [S, 3] statistics of a response's steps from its token log-probs ``l_t``:

        min_h = min_{t in T_h} l_t,    mean_h = mean_{t in T_h} l_t,
        result_h = min_k sum_{t in R_hk} l_t   (min_h where step h claims no result)

    ``T_h``: step h's tokens ``[lo, hi)`` (``ranges``, each non-empty); ``R_hk``: the tokens of the k-th result
    step h claims (``results[h]``: one index array per claim; the weakest claim of a step that makes several).
    The min and mean are segment reductions over all steps at once (a gather of every step's tokens, then
    ``minimum.reduceat``; the mean from the cumulative sum)."""
    values = np.asarray(token_logprobs, dtype=np.float64).reshape(-1)
    width = len(STEP_STATISTICS) + (results is not None)
    if not len(ranges):
        return np.zeros((0, width))
    lo, hi = (np.asarray(side, dtype=np.int64) for side in zip(*ranges))
    if np.any(lo < 0) or np.any(hi <= lo) or np.any(hi > values.size):
        raise ValueError(f"step token ranges must be non-empty and inside the {values.size} response tokens, got "
                         f"{list(zip(lo.tolist(), hi.tolist()))}")
    lengths = hi - lo
    starts = np.cumsum(lengths) - lengths  # where each step's tokens begin in the gathered array
    gathered = values[np.repeat(lo - starts, lengths) + np.arange(int(lengths.sum()))]
    out = np.empty((len(lo), width), dtype=np.float64)
    out[:, 0] = np.minimum.reduceat(gathered, starts)
    total = np.concatenate([[0.0], np.cumsum(values)])
    out[:, 1] = (total[hi] - total[lo]) / lengths
    if results is not None:
        if len(results) != len(lo):
            raise ValueError(f"{len(results)} steps of result claims for {len(lo)} steps")
        for h, claims in enumerate(results):
            out[h, 2] = min((values[np.asarray(tokens, dtype=np.int64)].sum() for tokens in claims),
                            default=out[h, 0])
    return out


def prefix_min(stats: np.ndarray) -> np.ndarray:
    """``c[h] = min_{j <= h} stats[j]`` per column: the prefix's statistic over steps 1..h of one response."""
    return np.minimum.accumulate(np.asarray(stats, dtype=np.float64), axis=0)


def cumulative_min(values: np.ndarray, rollout: np.ndarray) -> np.ndarray:
    """``c[i] = min over j <= i with rollout[j] == rollout[i] of values[j]``, per column: :func:`prefix_min` of
    many responses' steps at once, rows in rollout and step order. [N, k] -> [N, k]."""
    frame = pd.DataFrame(np.asarray(values, dtype=np.float64))
    return frame.groupby(np.asarray(rollout), sort=False).cummin().to_numpy()


def step_features(stats: np.ndarray) -> np.ndarray:
    """The head's features of one response's steps (:func:`feature_names`): ``[prefix_min(stats), stats]``,
    [S, k] -> [S, 2k]."""
    stats = np.asarray(stats, dtype=np.float64)
    return np.concatenate([prefix_min(stats), stats], axis=1)


def overlapping_tokens(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """Indices of the tokens whose character range ``[a, b)`` (``offsets``: [T, 2]) shares a character with
    ``[start, end)``: ``a < end and b > start and a < b`` (a token with an empty range holds no character)."""
    a, b = offsets[:, 0], offsets[:, 1]
    return np.flatnonzero((a < end) & (b > start) & (a < b))


def token_char_offsets(char_ends: np.ndarray) -> np.ndarray:
    """[T, 2] character ranges ``[e_{t-1}, e_t)`` of tokens from their character ends ``e_t`` (non-decreasing;
    ``verl_prm.steps.decode_with_char_ends``; e_{-1} = 0). A token that completes no character (a special
    token, the first bytes of a split character) has an empty range."""
    ends = np.asarray(char_ends, dtype=np.int64).reshape(-1)
    return np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1)


def result_span(match: re.Match) -> tuple[int, int] | None:
    """The result a match claims: the span of its first capture group that took part in the match (group 1 of a
    one-group regex; in ``A(x)|B(y)`` the group of the branch that matched); None when none took part or the
    span is empty."""
    for group in range(1, match.re.groups + 1):
        start, end = match.span(group)
        if start >= 0:
            return (start, end) if end > start else None
    return None


def result_claims(text: str, char_ends: np.ndarray, ranges: Sequence[tuple[int, int]], pattern: re.Pattern
                  ) -> list[list[np.ndarray]]:
    """Per step, the token indices of each result it claims: step h's text is the text of its tokens,
    ``text[a_h:b_h]`` with ``a_h`` the start of token ``lo_h`` and ``b_h`` the end of token ``hi_h - 1``
    (``char_ends``: each token's character end in ``text``); every match of ``pattern`` in it (``finditer``,
    the step text alone: ``^``/``$`` see its ends) claims the tokens that share a character with its
    :func:`result_span`."""
    offsets = token_char_offsets(char_ends)
    claims = []
    for lo, hi in ranges:
        begin, finish = int(offsets[lo, 0]), int(offsets[hi - 1, 1])
        mine = []
        for match in pattern.finditer(text[begin:finish]):
            span = result_span(match)
            if span is not None:
                mine.append(overlapping_tokens(offsets, begin + span[0], begin + span[1]))
        claims.append(mine)
    return claims


def logit_chunk_tokens(vocabulary: int, chunk_elements: int = LOGIT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk of :func:`token_logprobs` whose [chunk, vocabulary] logits hold at most ``chunk_elements``
    elements (at least one token)."""
    return max(1, int(chunk_elements) // max(1, int(vocabulary)))


def token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, lm_logits: Callable[[torch.Tensor], torch.Tensor],
                   chunk_tokens: int) -> torch.Tensor:
    """``l_t = z_t[x_t] - logsumexp_v z_t[v]`` in float32, ``z_t = lm_logits(hidden[t])`` the logits predicting
    ``targets[t]`` (``hidden`` [n, H], ``targets`` [n]), ``chunk_tokens`` tokens at a time
    (:func:`logit_chunk_tokens`), so a long response's [n, vocabulary] logits never sit whole in memory.
    Returns [n] float32 on ``hidden``'s device."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = lm_logits(hidden[start:start + chunk_tokens]).float()
        chosen = logits.gather(1, targets[start:start + chunk_tokens, None])[:, 0]
        out[start:start + chunk_tokens] = chosen - torch.logsumexp(logits, dim=-1)
    return out


def head_values(features: np.ndarray, mean: np.ndarray, std: np.ndarray, weight: np.ndarray, bias: float
                ) -> np.ndarray:
    """``v = sigmoid(((f - m) / s) . w + b)`` per row of ``features`` [S, F] (float64), stable for large
    logits."""
    logits = ((np.asarray(features, dtype=np.float64) - mean) / std) @ weight + bias
    return 0.5 * (1.0 + np.tanh(0.5 * logits))
