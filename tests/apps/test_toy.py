"""The embedded demo (verl_prm.apps.demo): exact prover values, the plugin path of the RL update, determinism, and
`verl-prm demo --quick` end to end."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from verl_prm.apps.demo.env import PlantedTask, kmp_transitions
from verl_prm.apps.demo.policy import MadePolicy, sequence_log_probs

OVERLAPPING = (1, 2, 1, 3)  # self-overlapping: after "1 2 1 2" the matched length is 2, not 0


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def verl_loaded():
    from verl_prm.apps.demo.policy_gradient import import_verl

    import_verl()


def _longest_match(planted: tuple[int, ...], text: list[int]) -> int:
    """Longest suffix of ``text`` that is a prefix of ``planted`` (the reference for the automaton)."""
    for k in range(min(len(planted), len(text)), 0, -1):
        if tuple(text[-k:]) == planted[:k]:
            return k
    return 0


@pytest.mark.parametrize("planted", [(3, 8, 5, 11), OVERLAPPING, (2, 2, 2), (4, 5, 4, 5, 4, 6)])
def test_automaton_matches_longest_suffix_prefix(planted):
    vocab = 14
    table = kmp_transitions(planted, vocab)
    length = len(planted)
    for state in range(length):
        for token in range(1, vocab):
            expected = _longest_match(planted, list(planted[:state]) + [token])
            assert int(table[state, token]) == expected, (state, token)
        assert int(table[state, vocab]) == length + 1  # EOS before success: dead
    assert (table[length] == length).all() and (table[length + 1] == length + 1).all()


def test_automaton_rejects_bad_planted_sequences():
    with pytest.raises(ValueError, match="token 14 is EOS"):
        PlantedTask(planted=(3, 14))
    with pytest.raises(ValueError, match="longer than the sequence length"):
        PlantedTask(planted=tuple(range(1, 12)))


@pytest.mark.parametrize("planted", [(3, 8, 5, 11), OVERLAPPING])
@pytest.mark.parametrize("gamma", [3.0, 10.0])
def test_exact_values_match_monte_carlo(planted, gamma):
    task = PlantedTask(planted=planted)
    values = task.value_table(gamma)
    generator = torch.Generator().manual_seed(0)
    a, b, c, d = planted
    prefixes = [
        [],
        [a],
        [a, b],
        [5, a, b, c],
        [a, b, a, b],  # a self-overlap for OVERLAPPING
        [9, 9, 9, 9, 9, 9, 9, a],  # late: little room left
        [a, b, c, d, 9],  # success already
        [a, b, 14],  # EOS before success
    ]
    n = 4000
    for prefix in prefixes:
        tokens = torch.tensor([prefix], dtype=torch.long).reshape(1, len(prefix))
        state = int(task.states(tokens)[0, -1])
        exact = float(values[len(prefix), state])
        estimate = float(task.monte_carlo_values(tokens, gamma, n, generator)[0])
        stderr = math.sqrt(max(exact * (1 - exact), 1e-4) / n)
        assert abs(estimate - exact) <= 4 * stderr + 1e-9, (prefix, exact, estimate)
    # the empty prefix against whole prover samples (the sampler used for the warm start)
    samples = task.sample_prover(gamma, 20000, generator)
    rate = float(task.rewards(samples).mean())
    exact = float(values[0, 0])
    assert abs(rate - exact) <= 4 * math.sqrt(exact * (1 - exact) / 20000)


def test_step_values_follow_the_prefix_states():
    task = PlantedTask(planted=OVERLAPPING)
    table = task.value_table(10.0)
    tokens = torch.tensor([[1, 2, 1, 2, 1, 3, 7, 7, 7, 7], [1, 2, 14, 14, 14, 14, 14, 14, 14, 14]])
    step_values, prompt_values = task.step_values(tokens, table)
    assert torch.allclose(prompt_values, table[0, 0].float().expand(2))
    # sample 0: matched lengths 1 2 3 2 3 4(success) then success stays
    expected = [table[1, 1], table[2, 2], table[3, 3], table[4, 2], table[5, 3]] + [1.0] * 5
    assert torch.allclose(step_values[0], torch.tensor(expected, dtype=torch.float32))
    assert float(step_values[1, 2]) == 0.0  # EOS before success
    assert task.rewards(tokens).tolist() == [1.0, 0.0]
    assert task.response_mask(tokens)[1].tolist() == [1, 1, 1] + [0] * 7


def test_made_policy_is_autoregressive_and_sampler_matches_logits():
    torch.manual_seed(0)
    policy = MadePolicy()
    tokens = torch.randint(1, 15, (4, 10))
    logits = policy.logits(tokens)
    for d in range(10):
        changed = tokens.clone()
        changed[:, d:] = torch.randint(1, 15, (4, 10 - d))
        assert torch.allclose(policy.logits(changed)[:, : d + 1], logits[:, : d + 1], atol=1e-6)
    # the lean sampler draws from the same conditionals: replay it with the full forward pass
    sampled = policy.sample(8, torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(5)
    replay = torch.zeros(8, 10, dtype=torch.long)
    done = torch.zeros(8, dtype=torch.bool)
    for t in range(10):
        probs = torch.softmax(policy.logits(replay)[:, t], dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1) + 1
        token = torch.where(done, torch.full_like(token, 14), token)
        replay[:, t] = token
        done |= token == 14
    assert torch.equal(sampled, replay)


def _mixed_batch(task: PlantedTask, seed: int = 0) -> torch.Tensor:
    """Policy samples plus prover samples: a batch with successes, failures and early EOS."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    policy = MadePolicy()
    return torch.cat([policy.sample(24, generator), task.sample_prover(30.0, 24, generator)])


def test_advantage_path_equals_the_registered_estimator(verl_loaded):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl_prm.apps.demo.policy_gradient import (RLConfig, algorithm_config, build_batch, compute_advantages,
                                                    exact_values, parsed_algorithm_config)

    task = PlantedTask()
    tokens = _mixed_batch(task)
    values = exact_values(task, 10.0)
    for cfg in (RLConfig(alpha=1.0), RLConfig(alpha=3.0, norm_adv_by_std=False)):
        config = algorithm_config(cfg)
        data, inputs = build_batch(task, tokens, values)
        rewards = data.batch["token_level_rewards"].sum(dim=1)
        assert 0 < float(rewards.sum()) < tokens.shape[0]
        # the step tensors of docs/concepts.md, every token a step
        mask = data.batch["response_mask"]
        assert torch.equal(inputs.num_steps, mask.sum(dim=1))
        assert torch.equal(inputs.step_ids, torch.where(mask.bool(), torch.arange(10).expand(48, 10), -1))
        last = inputs.num_steps - 1
        assert torch.equal(data.batch["token_level_rewards"].gather(1, last[:, None]).squeeze(1), rewards)
        compute_advantages(data, inputs, config)
        direct, _ = get_adv_estimator_fn("pav_grpo")(
            token_level_rewards=data.batch["token_level_rewards"],
            response_mask=mask,
            index=data.non_tensor_batch["uid"],
            config=config,
            step_ids=inputs.step_ids,
            step_values=inputs.step_values,
            prompt_values=inputs.prompt_values,
            num_steps=inputs.num_steps,
        )
        assert torch.equal(data.batch["advantages"], direct)
        # the hot-loop config (pav parsed once, input checks off) gives the same advantages
        fast = compute_advantages(*build_batch(task, tokens, values), parsed_algorithm_config(config))
        assert torch.equal(fast.batch["advantages"], direct)
        # and by hand: one group; out_i + alpha * (v_t - v_{t-1}) on every valid token
        centred = rewards - rewards.mean()
        outcome = centred / (rewards.std() + 1e-6) if cfg.norm_adv_by_std else centred
        step_values, prompt_values = values(tokens)
        progress = torch.diff(torch.cat([prompt_values[:, None], step_values], dim=1), dim=1)
        expected = (outcome[:, None] + cfg.alpha * progress) * mask
        assert torch.allclose(direct, expected, atol=1e-5)
    # alpha = 0 is verl's own grpo
    config = algorithm_config(RLConfig(alpha=0.0))
    data = compute_advantages(*build_batch(task, tokens, values), config)
    grpo, _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,  # verl's compute_advantage passes it so
        config=config,
    )
    assert torch.allclose(data.batch["advantages"], grpo, atol=1e-6)


def test_demo_advantages_take_the_trainer_hooks_path(verl_loaded, monkeypatch):
    """The demo's advantages: verl's compute_advantage_for_multi_trajectories -> compute_advantage -> the registered
    estimator, which reads the step tensors from estimator_step_inputs (they are not on the DataProto), as in the
    trainer hook's advantage phase."""
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.trainer.ppo.v1 import utils as verl_v1_utils

    from verl_prm.apps.demo.policy_gradient import RLConfig, algorithm_config, build_batch, compute_advantages, exact_values
    from verl_prm.estimators import MissingStepTensorsError

    task = PlantedTask()
    tokens = _mixed_batch(task, seed=2)
    config = algorithm_config(RLConfig(alpha=1.0))
    data, inputs = build_batch(task, tokens, exact_values(task, 10.0))
    assert not {"step_ids", "step_values", "prompt_values", "num_steps"} & set(data.batch.keys())
    assert not inputs.truncated.any()  # T tokens end an episode: V(T, k) is terminal
    calls = []

    def recorded(batch, **kwargs):
        calls.append(kwargs["adv_estimator"])
        return compute_advantage(batch, **kwargs)

    monkeypatch.setattr(verl_v1_utils, "compute_advantage", recorded)
    compute_advantages(data, inputs, config)
    assert calls == ["pav_grpo"]
    assert data.batch["advantages"].shape == tokens.shape
    # verl's function alone, without the context, gives the estimator's error naming the context
    with pytest.raises(MissingStepTensorsError, match="estimator_step_inputs"):
        compute_advantage(build_batch(task, tokens, exact_values(task, 10.0))[0], adv_estimator="pav_grpo",
                          config=config)


def test_rl_step_takes_the_policy_gradient_of_verls_loss(verl_loaded):
    from verl_prm.apps.demo.policy_gradient import RLConfig, actor_config, algorithm_config, build_batch, exact_values, rl_step

    task = PlantedTask()
    tokens = _mixed_batch(task, seed=1)
    for mode in ("token-mean", "seq-mean-token-sum"):
        cfg = RLConfig(loss_agg_mode=mode)
        torch.manual_seed(3)
        policy = MadePolicy()
        reference = MadePolicy()
        reference.load_state_dict(policy.state_dict())
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        advantages = rl_step(policy, optimizer, *build_batch(task, tokens, exact_values(task, 10.0)),
                             algorithm_config(cfg), actor_config(cfg))
        # reference: plain policy gradient -sum(adv * log pi) with verl's aggregation, one SGD step
        mask = task.response_mask(tokens).float()
        terms = -advantages * sequence_log_probs(reference, tokens) * mask
        loss = terms.sum() / mask.sum() if mode == "token-mean" else terms.sum(dim=1).mean()
        loss.backward()
        for after, before in zip(policy.parameters(), reference.parameters()):
            assert torch.allclose(after, before.detach() - before.grad, atol=1e-6)


def test_short_seeded_run_is_deterministic(verl_loaded):
    from verl_prm.apps.demo.policy_gradient import RLConfig, make_base_policy, train_rl

    task = PlantedTask()
    cfg = RLConfig(iterations=25, snapshots=(10,))
    runs = [train_rl(task, make_base_policy(task, seed=3), cfg, seed=3) for _ in range(2)]
    assert np.array_equal(runs[0].accuracy, runs[1].accuracy)
    for key, value in runs[0].final_state.items():
        assert torch.equal(value, runs[1].final_state[key]), key
    assert runs[0].mean_abs_process[0] > 0
    other = train_rl(task, make_base_policy(task, seed=4), cfg, seed=4)
    assert any(not torch.equal(v, other.final_state[k]) for k, v in runs[0].final_state.items())


def test_pass_at_n_matches_the_combinatorial_definition():
    from verl_prm.apps.demo.policy_gradient import pass_at_n

    for n, c in [(20, 0), (20, 3), (20, 20), (50, 7)]:
        ns = [1, 2, 5, 10, 20]
        expected = [1 - math.comb(n - c, k) / math.comb(n, k) for k in ns]
        assert np.allclose(pass_at_n(n, c, ns), expected)
    with pytest.raises(ValueError, match="needs at least"):
        pass_at_n(10, 1, [11])


def test_iterations_to_and_the_sample_efficiency_line():
    from verl_prm.apps.demo.report import sample_efficiency_line
    from verl_prm.apps.demo.policy_gradient import iterations_to

    accuracy = np.array([0.0] * 20 + [1.0] * 30)
    assert iterations_to(accuracy, 0.9, 10) == 29  # iterations 19..28 average 0.9
    assert iterations_to(np.zeros(50), 0.9, 10) is None
    line = "sample efficiency (iterations to 90% accuracy, outcome-only / PAV): "
    assert sample_efficiency_line([300, 500], [100, 100], 600) == line + "4.0x"
    assert sample_efficiency_line([None, 300], [100, 100], 600) == line + ">4.5x"
    assert sample_efficiency_line([300, 300], [None, 100], 600) == line + "<0.9x"
    assert sample_efficiency_line([None, 300], [None, 100], 600).startswith(line + "n/a")


def test_critic_learns_prover_values_from_monte_carlo_labels():
    from verl_prm.apps.demo.critic import (
        CriticConfig,
        balanced_weights,
        label_prefixes,
        train_toy_critic,
    )
    from verl_prm.apps.demo.policy_gradient import make_base_policy
    from verl_prm.training.losses import soft_label_bce

    task = PlantedTask()
    generator = torch.Generator().manual_seed(0)
    sequences = task.sample_prover(10.0, 6, generator)
    tokens, lengths, labels = label_prefixes(task, sequences, 10.0, 400, generator)
    assert lengths.numel() == int((task.response_mask(sequences).sum(dim=1) + 1).sum())
    exact = task.value_table(10.0)
    for row in range(lengths.numel()):
        prefix = tokens[row : row + 1, : int(lengths[row])]
        v = float(exact[int(lengths[row]), int(task.states(prefix)[0, -1])])
        assert abs(float(labels[row]) - v) <= 4 * math.sqrt(max(v * (1 - v), 1e-4) / 400) + 1e-9
    # soft-label cross-entropy and class balance
    q = torch.tensor([0.1, 0.2, 0.9])
    z = torch.tensor([0.3, -1.0, 2.0])
    w = balanced_weights(q)
    assert torch.allclose(w, torch.tensor([0.75, 0.75, 1.5]))
    manual = -(w * (q * torch.log(torch.sigmoid(z)) + (1 - q) * torch.log(1 - torch.sigmoid(z)))).sum() / w.sum()
    assert torch.allclose(soft_label_bce(z, q, w), manual)  # the PAV trainer's loss, with weights
    # a small critic gets the values to within a few hundredths (mean |A| is ~0.05 here)
    config = CriticConfig(policy_sequences=512, prover_sequences=512, steps=600)
    _, quality = train_toy_critic(task, make_base_policy(task, 0), 10.0, config, seed=0)
    assert quality["value_mae"] < 0.05, quality
    assert abs(quality["prompt_value"] - quality["exact_prompt_value"]) < 0.05, quality


def test_demo_quick_runs_end_to_end(tmp_path, capsys, verl_loaded):
    from verl_prm.apps.demo.demo import main

    assert main(["--quick", "--workers", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(
        r"sample efficiency \(iterations to 90% accuracy, outcome-only / PAV\): ([<>]?\d+\.\dx|n/a \(.*\))", out[-1]
    ), out[-1]
    for name in ("accuracy_vs_iterations.png", "accuracy_vs_gamma.png", "pass_at_n.png", "results.json"):
        assert (tmp_path / name).stat().st_size > 1000, name
    text = "\n".join(out)
    assert "outcome-only" in text and "Pass@N" in text and "prover sweep" in text
    # the seeded quick run shows the demo's point: PAV (mu_10, alpha 1) reaches 90% and ends above outcome-only
    report = json.loads((tmp_path / "results.json").read_text())
    pav, outcome = report["comparison"]["PAV"], report["comparison"]["outcome-only"]
    assert all(hit is not None for hit in pav["iterations_to_90"]), pav
    assert min(pav["final_accuracy"]) > max(outcome["final_accuracy"]), (pav, outcome)


def test_demo_search_writes_results_summary_and_plot(tmp_path, capsys):
    """`verl-prm demo search` (through the dispatcher): every method at every N on every problem, the summary
    and the plot; the sweep itself is the library's (`verl_prm.search.cli.run_sweep`)."""
    from verl_prm.apps.cli import main

    out = tmp_path / "toy"
    assert main(["demo", "search", "--problems", "30", "--n", "1,2", "--methods", "best_of_n,beam_q,beam_pav,greedy",
                 "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 2 * 30
    assert {(r["method"], r["n"]) for r in records} == {
        ("best_of_n", 3), ("best_of_n", 6), ("beam_q", 1), ("beam_q", 2), ("beam_pav", 1), ("beam_pav", 2),
        ("greedy", 1), ("greedy", 2)}
    summary = (out / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("method,n,problems,accuracy") and len(summary) == 9
    assert (out / "accuracy_vs_compute.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out / 'results.jsonl'}" in capsys.readouterr().out


def test_library_search_has_no_toy_task():
    """The planted task is the demo's: the library's `verl-prm search` takes a data set only."""
    from verl_prm.search.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--task", "toy", "--output-dir", "x"])


def _synthetic_report(learned: bool) -> dict:
    """A report with the fields the plots read: 3 comparison seeds, 2 sweep seeds, every curve crossing the
    axes so that a legend inside them would cover something."""
    from verl_prm.apps.demo.report import PASS_AT_N_NS

    rise = np.clip(np.linspace(-0.5, 1.5, 120), 0, 1)
    curves = {"outcome-only": [list(rise * f) for f in (0.2, 0.5, 0.8)], "PAV": [list(rise ** p) for p in (0.5, 1, 2)]}
    pass_curves = {"base policy (iteration 0)": list(np.linspace(0, 0.4, 11)),
                   "outcome-only": list(np.linspace(0, 0.55, 11)), "PAV": list(np.linspace(0.9, 1, 11))}
    if learned:
        curves["PAV (exact values)"] = [list(rise ** p) for p in (0.7, 1.2, 1.5)]
        pass_curves["PAV (exact values)"] = list(np.linspace(0.5, 1, 11))
    rows = [{"gamma": g, "accuracy": [a - 0.1, a + 0.1], "accuracy_mean": a, "accuracy_min": a - 0.1,
             "accuracy_max": a + 0.1, "mean_abs_progress_base": 0.01 * i}
            for i, (g, a) in enumerate([(1.0, 0.3), (10.0, 0.9), (100.0, 0.5)])]
    assert len(PASS_AT_N_NS) == 11
    return {"settings": {"gamma": 10.0, "learned_critic": learned}, "curves": curves,
            "sweep": {"rows": rows, "outcome_accuracy": 0.5, "accuracy_at": 100, "outcome_iterations_to_90": [None, 50]},
            "pass_at_n": {"curves": pass_curves, "iteration": 100, "base_successes": [1, 2, 3]}}


@pytest.mark.parametrize("learned", [False, True])
def test_demo_plots_label_bands_and_critic_and_keep_legends_off_the_data(learned):
    """Issue 19: every seed band has a legend entry, the learned-critic curve says so, and no legend covers a
    point or a curve (legends are checked against every plotted vertex in display coordinates)."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D

    from verl_prm.apps.demo.plots import demo_figures

    figures = demo_figures(_synthetic_report(learned))
    assert sorted(figures) == ["accuracy_vs_gamma.png", "accuracy_vs_iterations.png", "pass_at_n.png"]
    try:
        labels = {}
        for name, fig in figures.items():
            fig.canvas.draw()
            legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
            assert len(legends) == 1, name
            labels[name] = [t.get_text() for t in legends[0].get_texts()]
            box = legends[0].get_window_extent()
            for ax in fig.axes:
                for artist in ax.get_children():
                    if isinstance(artist, Line2D) and len(artist.get_xdata()) > 1:
                        points = artist.get_transform().transform(np.column_stack([artist.get_xdata(), artist.get_ydata()]))
                    elif isinstance(artist, PolyCollection):
                        points = np.concatenate([p.vertices for p in artist.get_paths()])
                        points = artist.get_transform().transform(points)
                    else:
                        continue
                    inside = ((points[:, 0] > box.x0) & (points[:, 0] < box.x1) &
                              (points[:, 1] > box.y0) & (points[:, 1] < box.y1))
                    assert not inside.any(), (name, artist.get_label())
        pav = "PAV (learned critic)" if learned else "PAV"
        expected = ["outcome-only: mean of 3 seeds", "outcome-only: min to max over seeds", f"{pav}: mean of 3 seeds",
                    f"{pav}: min to max over seeds"]
        if learned:
            expected += ["PAV (exact values): mean of 3 seeds", "PAV (exact values): min to max over seeds"]
        assert labels["accuracy_vs_iterations.png"] == expected
        assert labels["accuracy_vs_gamma.png"] == [f"{pav}: mean of 2 seeds", f"{pav}: min to max over seeds",
                                                   "outcome-only: mean of 2 seeds",
                                                   "mean |A^mu| on base-policy samples (right axis)"]
        assert labels["pass_at_n.png"] == ["base policy (iteration 0)", "outcome-only", pav] + (
            ["PAV (exact values)"] if learned else [])
        assert figures["pass_at_n.png"].axes[0].get_title() == "Pass@N after 100 RL iterations (mean of 3 seeds)"
    finally:
        for fig in figures.values():
            plt.close(fig)
