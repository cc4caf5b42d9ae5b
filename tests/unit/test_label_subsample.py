"""Fewer continuations drawn from labels already made (verl_prm.labeling.subsample)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from verl_prm.labeling.format import read_labels, rows_to_table
from verl_prm.labeling.subsample import subsample_counts, subsample_labels


@pytest.mark.parametrize("total, m", [(4, 1), (4, 2), (4, 3), (8, 3)])
def test_subsampled_successes_follow_the_hypergeometric_pmf(total, m):
    """s' of m continuations out of N with s successes: P(s' = k) = C(s, k) C(N - s, m - k) / C(N, m) (the pmf
    written here from its definition). 40,000 draws per s; every cell within 5 standard errors of the pmf (a
    false failure has probability below 1e-5 over all cells)."""
    draws = 40_000
    rng = np.random.default_rng(0)
    for s in range(total + 1):
        successes, counts = subsample_counts(np.full(draws, s), np.full(draws, total), m, rng)
        assert (counts == m).all()
        for k in range(m + 1):
            pmf = math.comb(s, k) * math.comb(total - s, m - k) / math.comb(total, m)
            frequency = float(np.mean(successes == k))
            assert abs(frequency - pmf) <= 5 * math.sqrt(max(pmf * (1 - pmf), 1e-12) / draws) + 1e-12, (s, k)


def test_counts_at_or_below_m_and_unsampled_ones_stay():
    rng = np.random.default_rng(1)
    successes, counts = subsample_counts(np.array([0, 1, 2, 1, 0]), np.array([0, 1, 2, 4, 0]), 2, rng)
    assert counts.tolist() == [0, 1, 2, 2, 0]
    assert successes[:3].tolist() == [0, 1, 2] and successes[4] == 0
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="m must be an integer >= 1"):
            subsample_counts(np.array([1]), np.array([2]), bad, rng)
    with pytest.raises(ValueError, match="0 <= n_success <= n_mc"):
        subsample_counts(np.array([3]), np.array([2]), 1, rng)


def _row(prompt_index, rollout_index, n_success, n_mc, prompt_counts=(3, 4), strategy="every"):
    q = [s / n if n else 1.0 for s, n in zip(n_success, n_mc)]
    return {"prompt_index": prompt_index, "rollout_index": rollout_index, "data_source": "test",
            "prompt": f"prompt {prompt_index}", "ground_truth": "1", "response": "a\nb\nc",
            "step_starts": [0, 2, 4][:len(n_mc)], "step_ends": [1, 3, 5][:len(n_mc)], "q": q,
            "n_success": list(n_success), "n_mc": list(n_mc), "first_pit": -1,
            "prompt_value": prompt_counts[0] / prompt_counts[1], "prompt_n_success": prompt_counts[0],
            "prompt_n_mc": prompt_counts[1], "outcome": 1.0, "score": 1.0, "finished": True, "strategy": strategy,
            "source": "policy"}


def test_subsampled_labels_keep_exact_steps_draw_each_prompt_once_and_stay_valid(tmp_path):
    rows = [_row(0, r, [r % 5, 2, 0], [4, 4, 0]) for r in range(4)] + [_row(1, 0, [4, 0], [4, 4], (0, 4))]
    path = tmp_path / "shard-00000.parquet"
    import pyarrow.parquet as pq

    pq.write_table(rows_to_table(rows), path)
    frame = read_labels(tmp_path)
    out = subsample_labels(frame, 2, seed=0)
    assert out["n_mc"].tolist() == [[2, 2, 0]] * 4 + [[2, 2]]
    for before, after in zip(frame.itertuples(), out.itertuples()):
        for s, n, q, s0, n0 in zip(after.n_success, after.n_mc, after.q, before.n_success, before.n_mc):
            if n0 == 0:  # the exact terminal step keeps its label
                assert (s, n, q) == (0, 0, 1.0)
            else:
                assert n == 2 and max(0, 2 - (n0 - s0)) <= s <= min(2, s0) and q == s / 2
    # the prompt's value is drawn once: the same on every rollout of prompt 0; prompt 1 had no success to draw
    assert out.loc[:3, "prompt_value"].nunique() == 1 and out.loc[:3, "prompt_n_mc"].tolist() == [2] * 4
    assert out.loc[4, "prompt_value"] == 0.0 and out.loc[4, ["n_success"]].item() == [2, 0]
    rows_to_table(out.to_dict("records"))  # the subsampled rows pass the label format's checks
    assert subsample_labels(frame, 2, seed=0).equals(out)  # seeded


def test_labels_of_a_first_pit_search_or_disagreeing_prompt_counts_are_refused():
    frame = pd.DataFrame([_row(0, 0, [1], [4], strategy="first_pit")])
    with pytest.raises(ValueError, match="strategy 'first_pit'.*--prefix-rule every"):
        subsample_labels(frame, 1, seed=0)
    frame = pd.DataFrame([_row(0, 0, [1], [4]), _row(0, 1, [1], [4], prompt_counts=(1, 4))])
    with pytest.raises(ValueError, match="prompt_index 0 disagree on the prompt's counts"):
        subsample_labels(frame, 1, seed=0)
