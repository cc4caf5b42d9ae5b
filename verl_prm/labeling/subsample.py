"""Fewer continuations from Monte-Carlo labels already made: labels of ``n_mc = m`` drawn from labels of more.

A step labelled with ``s`` accepted continuations out of ``N`` keeps, for ``m < N``, the successes of ``m`` of
its ``N`` continuations chosen uniformly without replacement: ``s' ~ Hypergeometric(s, N - s, m)``,

    P(s' = k) = C(s, k) C(N - s, m - k) / C(N, m).

The ``N`` continuations are exchangeable draws of the prover, so ``s'`` has exactly the distribution of the
successes of ``m`` fresh continuations (Binomial(m, p) given the prefix's value p). Labels of ``n_mc = 1, 2``
for a label-budget comparison therefore come from one labelling run at ``n_mc = 4`` without new generation; the
cost of each setting is measured apart (``verl-prm label`` at each ``n_mc`` on the same problems).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["subsample_counts", "subsample_labels"]


def subsample_counts(n_success: np.ndarray, n_mc: np.ndarray, m: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise ``(s', n')``: where ``n_mc > m``, ``s' ~ Hypergeometric(n_success, n_mc - n_success, m)`` and
    ``n' = m``; elsewhere (``n_mc <= m``: too few to subsample, 0: not sampled) the counts as they are."""
    if isinstance(m, bool) or int(m) != m or m < 1:
        raise ValueError(f"subsample_counts: m must be an integer >= 1, got {m!r}")
    n_success = np.asarray(n_success, dtype=np.int64)
    n_mc = np.asarray(n_mc, dtype=np.int64)
    if n_success.shape != n_mc.shape:
        raise ValueError(f"subsample_counts: n_success {n_success.shape} and n_mc {n_mc.shape} differ in shape")
    if ((n_success < 0) | (n_success > n_mc)).any():
        raise ValueError("subsample_counts: every count needs 0 <= n_success <= n_mc")
    drawn = n_mc > m
    successes = n_success.copy()
    if drawn.any():
        successes[drawn] = rng.hypergeometric(n_success[drawn], n_mc[drawn] - n_success[drawn], int(m))
    return successes, np.where(drawn, int(m), n_mc)


def subsample_labels(frame: pd.DataFrame, m: int, seed: int) -> pd.DataFrame:
    """Label rows (``verl_prm.labeling.format.read_labels``) with every sampled step and prompt value reduced to
    ``m`` continuations (:func:`subsample_counts`); ``q`` and ``prompt_value`` are the new rates. Steps whose
    label was not sampled (``n_mc = 0``: exact terminal steps, or not labelled) keep theirs.

    A prompt's value is repeated on every rollout of the prompt: it is drawn once per prompt
    (``prompt_index``, ``prompt``) and written to each of its rows. Only rows labelled at every step prefix
    (strategy ``every``) are taken: a first-pit search chose its prefixes by the full counts."""
    not_every = frame.index[frame["strategy"] != "every"]
    if len(not_every):
        row = frame.loc[not_every[0]]
        raise ValueError(f"subsample_labels: row {not_every[0]} (prompt_index {row['prompt_index']}) has strategy "
                         f"{row['strategy']!r}; only labels of every step prefix (--prefix-rule every) subsample")
    rng = np.random.default_rng(seed)
    out = frame.copy()
    lengths = out["n_mc"].map(len).to_numpy()
    flat_success = np.concatenate([np.asarray(v, dtype=np.int64) for v in out["n_success"]] or [np.zeros(0, int)])
    flat_mc = np.concatenate([np.asarray(v, dtype=np.int64) for v in out["n_mc"]] or [np.zeros(0, int)])
    flat_q = np.concatenate([np.asarray(v, dtype=np.float64) for v in out["q"]] or [np.zeros(0)])
    successes, counts = subsample_counts(flat_success, flat_mc, m, rng)
    q = np.where(counts > 0, successes / np.maximum(counts, 1), flat_q)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    out["n_success"] = [successes[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    out["n_mc"] = [counts[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    out["q"] = [q[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    # one draw per prompt, written to each of its rows
    spread = out.groupby(["prompt_index", "prompt"], sort=True)[["prompt_n_success", "prompt_n_mc"]].nunique()
    if (spread > 1).any(axis=None):
        index = spread[(spread > 1).any(axis=1)].index[0]
        raise ValueError(f"subsample_labels: the rows of prompt_index {index[0]} disagree on the prompt's counts "
                         "(prompt_n_success, prompt_n_mc); a prompt's value is the same on every rollout of it")
    prompts = out.groupby(["prompt_index", "prompt"], sort=True).head(1)
    drawn_success, drawn_mc = subsample_counts(prompts["prompt_n_success"].to_numpy(),
                                               prompts["prompt_n_mc"].to_numpy(), m, rng)
    by_prompt = {key: (s, n) for key, s, n in zip(zip(prompts["prompt_index"], prompts["prompt"]), drawn_success,
                                                  drawn_mc)}
    keys = list(zip(out["prompt_index"], out["prompt"]))
    new_success = np.array([by_prompt[key][0] for key in keys], dtype=np.int64)
    new_mc = np.array([by_prompt[key][1] for key in keys], dtype=np.int64)
    out["prompt_n_success"] = new_success.astype(np.int32)
    out["prompt_n_mc"] = new_mc.astype(np.int32)
    out["prompt_value"] = np.where(new_mc > 0, new_success / np.maximum(new_mc, 1), out["prompt_value"].to_numpy())
    return out
