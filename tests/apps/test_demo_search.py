"""The search algorithms (verl_prm.search) on the demo's planted sub-sequence task with exact critics: PAV beam
search against best-of-N and beam search on Q at equal tokens, prover strength, the compute counters, greedy step
search with the exact prover's progress."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from search_support import RecordingCritic, RecordingSampler

from verl_prm.apps.demo.search import ToySearchTask
from verl_prm.search import (
    BeamConfig,
    BestOfNConfig,
    CachedCritic,
    GreedyConfig,
    Node,
    beam_search,
    best_of_n,
    greedy_step_search,
)


@pytest.fixture(scope="module")
def toy() -> ToySearchTask:
    return ToySearchTask(150, policy_gamma=2.0, step_tokens=2, seed=0)


def _accuracy(task, results) -> float:
    return sum(task.reward(r.node) for r in results) / len(results)


def _mean_tokens(results) -> float:
    return sum(r.compute.generated_tokens for r in results) / len(results)


def test_pav_beam_beats_best_of_n_and_beam_on_q_at_equal_tokens(toy):
    """The PAV paper's search result on the planted task: Q^pi of a weak policy fitted to 16 rollouts per state
    is 0 almost everywhere, so beam search on Q is nearly blind; the progress of a prover of the right strength
    (mu_10) guides it. Best-of-N with the (exact at the end) ORM gets at least as many tokens."""
    problems = list(range(toy.num_problems))
    q = lambda: CachedCritic(toy.critic(rollouts=16, seed=1))
    pav = beam_search(problems, toy, q(), CachedCritic(toy.critic(10.0)), BeamConfig(beam_width=8, alpha=1.0, seed=3))
    on_q = beam_search(problems, toy, q(), None, BeamConfig(beam_width=8, alpha=0.0, seed=3))
    bon_n = math.ceil(_mean_tokens(pav) / 6.0)  # responses average ~7.5 tokens (EOS has p ~ 1/15 per token)
    bon = best_of_n(problems, toy, q(), BestOfNConfig(n=bon_n, seed=3))
    assert _mean_tokens(bon) >= _mean_tokens(pav) >= _mean_tokens(on_q)
    acc_pav, acc_q, acc_bon = _accuracy(toy, pav), _accuracy(toy, on_q), _accuracy(toy, bon)
    assert acc_pav >= acc_bon + 0.08, (acc_pav, acc_bon)
    assert acc_pav >= acc_q + 0.06, (acc_pav, acc_q)
    # The answer is chosen by Q as an ORM: every chosen beam has the highest Q among its final beams, and a
    # solved problem's answer has Q = 1 (finished states are exact).
    for result in pav:
        assert result.score == (1.0 if toy.reward(result.node) else result.score)


def _candidate_progress(task: ToySearchTask, gamma: float) -> float:
    """Mean |A^mu| of steps sampled by the base policy from early prefixes (the first three steps) that do not
    end the response: after them a prover can still write y* (4 tokens) in the positions left. (A step that
    writes EOS without y* loses everything for every prover, so it is excluded: no prover is "too strong" for
    it.)"""
    responses = task.sample_responses(list(range(40)), 8, [0] * 40)
    nodes = [Node(r.problem, r.steps[:h]) for group in responses for r in group for h in range(min(r.num_steps, 3))]
    samples = task.sample_steps(nodes, 1, [1] * len(nodes))
    pairs = [(node, node.extend(group[0])) for node, group in zip(nodes, samples) if not group[0].finished]
    assert len(pairs) > 300
    critic = CachedCritic(task.critic(gamma))
    compute: dict = {}
    progress = critic.values([c for _, c in pairs], compute) - critic.values([p for p, _ in pairs], compute)
    return float(progress.abs().mean())


def test_too_strong_and_too_weak_provers_give_no_progress(toy):
    right = _candidate_progress(toy, 10.0)
    strong = _candidate_progress(toy, 1e4)
    weak = _candidate_progress(toy, 1.0)
    assert right > 0.02
    assert strong < 0.1 * right and weak < 0.1 * right, (weak, right, strong)


def test_compute_counters_add_up_and_prefixes_are_scored_once(toy):
    problems = list(range(30))
    sampler = RecordingSampler(toy)
    q_inner, p_inner = RecordingCritic(toy.critic(rollouts=16, seed=1)), RecordingCritic(toy.critic(10.0))
    config = BeamConfig(beam_width=4, samples_per_beam=3, alpha=0.5, seed=0)
    results = beam_search(problems, sampler, CachedCritic(q_inner), CachedCritic(p_inner), config)
    for critic in (q_inner, p_inner):
        keys = [key for key, _, _ in critic.scored]
        assert len(keys) == len(set(keys)), "a prefix was scored twice"
    # Batched: one sampler round and at most one call per critic and round (+ the final ORM pass, cached).
    rounds = 10 // 2
    assert q_inner.calls <= rounds + 1 and p_inner.calls <= rounds
    for result in results:
        p = result.problem
        mine = [t for _, problem, t in sampler.steps if problem == p]
        assert result.compute.generated_tokens == sum(mine)
        assert result.compute.step_samples == len(mine)
        scored = [t for c in (q_inner, p_inner) for _, problem, t in c.scored if problem == p]
        assert result.compute.critic_tokens == sum(scored)
        assert result.compute.critic_sequences == len(scored)
        # the root spawns N * M candidates, every later round M per unfinished beam
        assert len(mine) >= config.beam_width * config.samples_per_beam
        assert (len(mine) - config.beam_width * config.samples_per_beam) % config.samples_per_beam == 0
        assert result.node.finished
    # alpha = 0: the prover is never called
    p_inner2 = RecordingCritic(toy.critic(10.0))
    beam_search(problems, toy, CachedCritic(toy.critic()), CachedCritic(p_inner2), BeamConfig(beam_width=2, alpha=0.0))
    assert p_inner2.calls == 0
    # best-of-N: tokens are the sampled responses' tokens; ORM = exact reward with the exact critic
    sampler = RecordingSampler(toy)
    results = best_of_n(problems, sampler, CachedCritic(toy.critic()), BestOfNConfig(n=6))
    for result in results:
        mine = [t for problem, t in sampler.responses if problem == result.problem]
        assert result.compute.generated_tokens == sum(mine) and result.compute.step_samples == 6
        assert result.score == toy.reward(result.node)


def test_greedy_with_exact_prover_progress_on_toy(toy):
    problems = list(range(60))
    sampler = RecordingSampler(toy)
    config = GreedyConfig(threshold=0.0, accept_on="progress", max_retries=7, max_backtracks=2, max_steps=5)
    results = greedy_step_search(problems, sampler, CachedCritic(toy.critic(10.0)), config)
    per_prefix = Counter((key, problem) for key, problem, _ in sampler.steps)
    assert max(per_prefix.values()) <= 1 + config.max_retries
    for result in results:
        assert result.compute.step_samples <= config.max_step_samples
        assert result.info["backtracks"] <= config.max_backtracks
        assert result.node.finished
    # accepting only steps that do not lose the prover's value finds y* far more often than the base policy
    assert _accuracy(toy, results) > 0.2


# ------------------------------------------------------------------------------------------------ scripted task


def test_demo_search_sweep_flags_are_sweep_config_fields():
    """The demo's sweep flags are SweepConfig's (the library's search command shares them)."""
    import dataclasses

    from verl_prm.apps.demo.search import search_parser
    from verl_prm.search.config import SweepConfig

    sweep = {f.name for f in dataclasses.fields(SweepConfig)}
    assert sweep <= {a.dest for a in search_parser()._actions}


def test_demo_search_sweep_settings_are_checked_by_the_sweep_config(tmp_path):
    """`verl-prm demo search` parses the sweep's flags next to its own; run_sweep checks them as SweepConfig."""
    from verl_prm.apps.demo.search import main

    with pytest.raises(ValueError, match=r"n \(--n\) lists 2 more than once"):
        main(["--output-dir", str(tmp_path / "toy"), "--problems", "2", "--n", "2,2"])
