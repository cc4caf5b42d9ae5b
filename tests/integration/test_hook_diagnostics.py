"""``verl_prm.diagnostics.reference``: the trainer hook scores the batch's steps with an exact reference prover too
and logs the ``pav/*`` diagnostics of ``verl_prm.diagnostics``; the reference never reaches the advantages.

The hook's advantage phase runs without a Ray cluster: ``PavSyncTrainer._compute_advantage`` on a trainer holding
what it reads (verl's constructor is not run), with TransferQueue replaced by an in-memory store and the critic
worker called in-process."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from verl_support import PLUGIN_OVERRIDES, MemoryQueue, compose_verl

from verl_prm.config.hook import ConfigError

PROVER = "verl_prm.apps.arithmetic.prover:ArithmeticProver"
REFERENCE = [f"+verl_prm.diagnostics.reference.prover={PROVER}", "+verl_prm.diagnostics.reference.step_accuracy=0.8"]


def test_slipped_steps_marks_the_step_where_the_value_drops_to_zero():
    from verl_prm.diagnostics import slipped_steps

    # values after each step (v_0 the prompt's): a right response, one that slips at step 1 (and stays at 0), one
    # whose prompt is already lost (nothing slips), one that slips at its last real step, the slot after is padding
    step_values = torch.tensor([[0.8, 0.9, 1.0], [0.8, 0.0, 0.0], [0.0, 0.0, 0.0], [0.8, 0.0, 0.0]])
    prompt_values = torch.tensor([0.7, 0.7, 0.0, 0.7])
    num_steps = torch.tensor([3, 3, 3, 2])
    expected = torch.tensor([[False, False, False], [False, True, False], [False, False, False],
                             [False, True, False]])
    assert torch.equal(slipped_steps(step_values, prompt_values, num_steps), expected)
    # a first step that loses the prompt's value slips; no slots: an empty mask
    assert slipped_steps(torch.tensor([[0.0, 0.0]]), torch.tensor([0.5]), torch.tensor([2])).tolist() == [[True, False]]
    assert slipped_steps(torch.zeros(2, 0), torch.ones(2), torch.zeros(2, dtype=torch.long)).shape == (2, 0)


# ---------------------------------------------------------------------------------------------- startup


@pytest.mark.parametrize("overrides, message", [
    (["+verl_prm.diagnostics.reference.step_accuracy=0.8"],
     "verl_prm.diagnostics.reference needs prover, the 'module:Class' of the exact prover"),
    (["+verl_prm.diagnostics.reference.prover=verl_prm.no_such_module:Prover"],
     "verl_prm.diagnostics.reference.prover: the exact prover 'verl_prm.no_such_module:Prover' cannot be imported"),
    ([f"+verl_prm.diagnostics.reference.prover={PROVER}", "+verl_prm.diagnostics.reference.step_accuracy=1.5"],
     "verl_prm.diagnostics.reference.step_accuracy: step_accuracy must be a finite number in (0, 1], got 1.5"),
    ([f"+verl_prm.diagnostics.reference.prover={PROVER}", "+verl_prm.diagnostics.reference.step_accuracy=nan"],
     "verl_prm.diagnostics.reference.step_accuracy must be a finite number, got nan"),
    (["verl_prm.diagnostics.signal_threshold=-0.1"],
     "verl_prm.diagnostics.signal_threshold must be >= 0 (a finite number), got -0.1"),
    (["verl_prm.diagnostics.signal_threshold=inf"],
     "verl_prm.diagnostics.signal_threshold must be >= 0 (a finite number), got inf"),
    (["+verl_prm.diagnostics.colour=red"], "Known keys of verl_prm.diagnostics: reference, signal_threshold"),
    (REFERENCE + ["algorithm.adv_estimator=grpo", "verl_prm.score_outcome_estimators=false"],
     "verl_prm.diagnostics.reference is set, but this run scores no steps"),
])
def test_startup_rejects_a_bad_reference(overrides, message, critic_dir):
    from verl_prm.integrations.verl.run_config import validate_run_config

    config = compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"] + overrides)
    with pytest.raises(ConfigError) as error:
        validate_run_config(config)
    assert message in str(error.value)


def test_startup_reads_the_reference(critic_dir):
    from verl_prm.integrations.verl.run_config import validate_run_config

    hook, _ = validate_run_config(compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"] + REFERENCE))
    assert hook.diagnostics.reference == {"prover": PROVER, "step_accuracy": 0.8}
    assert hook.diagnostics.signal_threshold == 0.01
    hook, _ = validate_run_config(compose_verl(PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}"]))
    assert hook.diagnostics.reference is None


# ---------------------------------------------------------------------------------------------- the hook


def arithmetic_batch(tokenizer):
    """Three problems x three responses (verl rows: prompt ids, response ids, rewards, uid): a group with the
    reference solution (reward 1), a slip and a truncated half; a group with the same; a group of failures only
    (slips at two steps and a truncated slip: no outcome signal). Plus one padding row (a copy of the first)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from verl_prm.apps.arithmetic.task import Problem, solution_lines

    problems = [Problem(5, (("+", 7), ("*", 3), ("-", 4)), 13), Problem(2, (("*", 5), ("+", 9), ("*", 2)), 11),
                Problem(4, (("+", 2), ("+", 6), ("*", 3)), 7)]
    rows, keys, tags = [], [], []
    for i, problem in enumerate(problems):
        correct = "\n".join(solution_lines(problem))
        slip_1 = "\n".join(solution_lines(problem, 1, (problem.values[1] + 1) % problem.modulus))
        slip_2 = "\n".join(solution_lines(problem, 2, (problem.values[2] + 1) % problem.modulus))
        texts = [(correct, True, 1.0), (slip_1, True, 0.0), (correct[: len(correct) // 2], False, 0.0)]
        if i == 2:
            texts = [(slip_1, True, 0.0), (slip_2, True, 0.0), (slip_1[: len(slip_1) // 2], False, 0.0)]
        prompt = tokenizer(problem.prompt_text, add_special_tokens=False)["input_ids"]
        for j, (text, eos, reward) in enumerate(texts):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            rm_scores = torch.zeros(len(ids))
            rm_scores[-1] = reward
            rows.append({"prompts": torch.tensor(prompt), "responses": torch.tensor(ids),
                         "response_mask": torch.ones(len(ids), dtype=torch.long), "rm_scores": rm_scores,
                         "uid": f"problem{i}"})
            keys.append(f"problem{i}_{j}_0")
            tags.append({"status": "success"})
    rows.append(dict(rows[0]))
    keys.append("problem0_3_0")
    tags.append({"status": "success", "is_padding": True})
    return list_of_dict_to_tensordict(rows), keys, tags


def hook_trainer(config, tokenizer, critic_dir, policy_tokenizer_path=None):
    """A ``PavSyncTrainer`` holding what its advantage phase reads, with the run's validated config and an
    in-process critic worker (world size 1; ``critic_dir`` None for format=exact, which reads the text with the
    tokenizer saved at ``policy_tokenizer_path``)."""
    from verl_prm.config.hook import build_exact_critic
    from verl_prm.integrations.verl.sources import critic_worker_kwargs
    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker
    from verl_prm.integrations.verl.hook_trainer import PavSyncTrainer
    from verl_prm.integrations.verl.run_config import validate_run_config
    from verl_prm.integrations.verl.value_sources import CriticWorkerValues, ExactReferenceValues

    hook, pav = validate_run_config(config)
    worker = ProverCriticWorker(str(critic_dir) if critic_dir else None, critic_worker_kwargs(hook),
                                policy_tokenizer_path=policy_tokenizer_path)
    worker.init_model()
    reference = hook.diagnostics.reference
    trainer = object.__new__(PavSyncTrainer)  # verl's constructor would start its workers
    trainer.config, trainer.hook_config, trainer.pav_config, trainer.tokenizer = config, hook, pav, tokenizer
    trainer.global_steps, trainer._eos_ids = 1, [tokenizer.eos_token_id]
    trainer.value_source = CriticWorkerValues(SimpleNamespace(world_size=1,
                                                              compute_step_values=worker.compute_step_values))
    trainer.reference = (ExactReferenceValues(build_exact_critic(reference, "verl_prm.diagnostics.reference"),
                                              tokenizer) if reference else None)
    return trainer


def advantage_phase(trainer, stored, keys, tags, monkeypatch):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base

    from verl_prm.integrations.verl import hook_trainer as module

    queue = MemoryQueue(stored)
    monkeypatch.setattr(module, "tq", queue)  # what the hook reads
    monkeypatch.setattr(trainer_base, "tq", queue)  # what verl's own advantage phase reads and writes
    metrics: dict = {}
    trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    return queue.written, metrics


def test_hook_logs_the_diagnostics_of_the_reference_and_keeps_the_advantages(bpe_small, critic_dir, monkeypatch,
                                                                             worker_env):
    """A learned (value_head) critic with the arithmetic prover as reference: the logged pav/* diagnostics equal
    ``verl_prm.diagnostics`` applied to the critic's and the prover's values of the real rows, computed here from
    the critic and the prover directly; the advantages are bit-equal to those of the run without a reference."""
    from verl_prm.apps.arithmetic.prover import ArithmeticProver
    from verl_prm.apps.arithmetic.task import STEP_REGEX
    from verl_prm.critic import ProverCritic
    from verl_prm.diagnostics import process_term_diagnostics
    from verl_prm.steps import split_steps

    tokenizer = bpe_small
    run = PLUGIN_OVERRIDES + [f"verl_prm.critic.path={critic_dir}", "verl_prm.steps.delimiter=null",
                              f"verl_prm.steps.regex='{STEP_REGEX}'", "algorithm.pav.alpha=2.0",
                              "verl_prm.diagnostics.signal_threshold=0.001"]
    stored, keys, tags = arithmetic_batch(tokenizer)
    with_reference, metrics = advantage_phase(hook_trainer(compose_verl(run + REFERENCE), tokenizer, critic_dir),
                                              stored, keys, tags, monkeypatch)
    without, plain_metrics = advantage_phase(hook_trainer(compose_verl(run), tokenizer, critic_dir), stored, keys,
                                             tags, monkeypatch)
    for field in ("advantages", "returns"):
        assert torch.equal(with_reference[field].to_padded_tensor(padding=0.0), without[field].to_padded_tensor(padding=0.0))
    assert "pav/process_corr" not in plain_metrics

    # the pieces, called directly, on the 9 real rows
    real = len(keys) - 1
    responses = torch.nested.to_padded_tensor(stored["responses"], tokenizer.pad_token_id)[:real]
    response_mask = torch.nested.to_padded_tensor(stored["response_mask"], 0)[:real]
    prompt_rows = [row.tolist() for row in stored["prompts"].unbind()][:real]
    width = max(map(len, prompt_rows))
    prompts = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompt_rows])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_rows])
    split = split_steps(responses, response_mask, tokenizer, None, regex=STEP_REGEX)
    learned = ProverCritic.from_pretrained(str(critic_dir), format="value_head", device="cpu").score_policy_batch(
        prompts, responses, torch.cat([prompt_mask, response_mask], dim=1), split, None)
    prover = ArithmeticProver(0.8)
    prompt_texts = [tokenizer.decode(p, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                    for p in prompt_rows]
    exact_rows = [prover.values(prompt_texts[b], split.step_texts(b), b) for b in range(real)]

    num_steps = split.num_steps
    slots = split.step_ends.shape[1]

    def progress(rows):  # A_h = v_h - v_{h-1}, v_{-1} the prompt's value (PAV, Setlur et al. 2024, eq. 2)
        out = torch.zeros(real, slots, dtype=torch.float64)
        for b, row in enumerate(rows):
            for h in range(int(num_steps[b])):
                out[b, h] = row[h + 1] - row[h]
        return out

    learned_rows = [[float(learned.prompt_values[b])] + learned.step_values[b, : int(num_steps[b])].tolist()
                    for b in range(real)]
    slipped = torch.zeros(real, slots, dtype=torch.bool)
    for b, row in enumerate(exact_rows):
        for h in range(int(num_steps[b])):
            slipped[b, h] = row[h] > 0 and row[h + 1] == 0
    assert slipped.sum() >= 5 and slipped.sum(dim=1).max() == 1  # the slips and the truncated halves' last steps
    groups = torch.tensor([b // 3 for b in range(real)])
    outcomes = torch.tensor([1.0 if b % 3 == 0 and b < 6 else 0.0 for b in range(real)])
    expected = process_term_diagnostics(progress(learned_rows), num_steps, slipped, outcomes, groups, 3, 0.001,
                                        exact=progress(exact_rows))
    assert expected.pop("pav/zero_outcome_groups") == pytest.approx(1 / 3)
    assert metrics["pav/outcome_zero_signal_groups"] == pytest.approx(1 / 3)  # the same share, logged once
    for name, value in expected.items():
        assert math.isfinite(value), name
        assert metrics[name] == pytest.approx(value, abs=1e-5), name
    assert plain_metrics["pav/zero_outcome_groups_with_signal"] == metrics["pav/zero_outcome_groups_with_signal"]
    # the exact term: a slip loses the whole value, a right step gains a little
    assert metrics["pav/exact_abs_adv_slipped"] > 3 * metrics["pav/exact_abs_adv_right"]


def test_an_exact_critic_against_its_own_prover_correlates_perfectly(bpe_small, monkeypatch, tmp_path, worker_env):
    """format=exact with the same prover as reference: correlation 1 and the learned scales equal the exact ones."""
    from verl_prm.apps.arithmetic.task import STEP_REGEX

    run = PLUGIN_OVERRIDES + ["verl_prm.critic.source=exact", f"+verl_prm.critic.options.prover={PROVER}",
                              "+verl_prm.critic.options.step_accuracy=0.8", "verl_prm.steps.delimiter=null",
                              f"verl_prm.steps.regex='{STEP_REGEX}'"] + REFERENCE
    stored, keys, tags = arithmetic_batch(bpe_small)
    bpe_small.save_pretrained(tmp_path)
    trainer = hook_trainer(compose_verl(run), bpe_small, None, policy_tokenizer_path=str(tmp_path))
    _, metrics = advantage_phase(trainer, stored, keys, tags, monkeypatch)
    assert metrics["pav/process_corr"] == pytest.approx(1.0, abs=1e-9)
    assert metrics["pav/abs_adv_right"] == pytest.approx(metrics["pav/exact_abs_adv_right"], abs=1e-7)
    assert metrics["pav/abs_adv_slipped"] == pytest.approx(metrics["pav/exact_abs_adv_slipped"], abs=1e-7)
