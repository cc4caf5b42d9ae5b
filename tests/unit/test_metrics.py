"""``verl_prm.metrics.pav_metrics``: the per-batch ``pav/*`` metrics of the verl hook and TRL, against a loop."""

from __future__ import annotations

import statistics

import pytest
import torch

from verl_prm.metrics import pav_metrics


def test_pav_metrics_equal_a_loop_over_the_real_steps():
    scores = torch.tensor([[0.5, -0.25, 9.0], [0.0, 9.0, 9.0], [9.0, 9.0, 9.0], [0.1, 0.2, 0.3]])
    num_steps = torch.tensor([2, 1, 0, 3])  # the 9s lie past each response's steps
    prompt_values = torch.tensor([0.5, 0.0, 1.0, 0.2])
    truncated = torch.tensor([False, True, False, False])
    metrics = pav_metrics(scores, prompt_values, num_steps, truncated, best_of_k_k=2, critic_seconds=1.5)
    real = [float(scores[b, h]) for b in range(4) for h in range(int(num_steps[b]))]
    # Best-of-K value of the prompt: 1 - (1 - v)^K (PAV paper, Sec. 4)
    v0 = [1 - (1 - float(v)) ** 2 for v in prompt_values]
    assert metrics == pytest.approx({
        "pav/steps_per_response": 6 / 4, "pav/zero_step_share": 1 / 4,
        "pav/process_term/mean": statistics.fmean(real), "pav/process_term/std": statistics.stdev(real),
        "pav/v0_mean": statistics.fmean(v0), "pav/critic_seconds": 1.5, "pav/truncated_share": 1 / 4,
    })


def test_pav_metrics_of_an_empty_batch_are_zero():
    metrics = pav_metrics(torch.zeros(0, 0), torch.zeros(0), torch.zeros(0, dtype=torch.long),
                          torch.zeros(0, dtype=torch.bool), best_of_k_k=1, critic_seconds=0.0)
    assert set(metrics.values()) == {0.0} and len(metrics) == 7
