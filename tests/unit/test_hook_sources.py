"""The trainer hook's parts without Ray: the batch it reads (``step_batch``), each source of step values
(``value_sources``: one interface, a typed ``StepValues``) and the advantage phase, whose estimator gets the step
tensors through verl's own ``_compute_advantage`` (``advantage.estimator_step_inputs``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl_support import MemoryQueue

from verl_prm.config import read_pav_config
from verl_prm.config.hook import read_hook_config
from verl_prm.steps import split_steps

TEXTS = [("a1\nb2\nc3", True, 1.0), ("a1\nb9", True, 0.0), ("a1\nb2\nc", False, 0.0), ("x\ny", True, 1.0),
         ("x\nz\nw", True, 1.0)]
PROMPTS = ["p one", "p one", "p one", "q", "q"]


def stored_batch(tokenizer):
    """Two prompt groups (uids u0, u1) of verl rows as TransferQueue keeps them (jagged), the third response
    without EOS; the last row is verl's padding (a copy of the fourth)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows, keys, tags = [], [], []
    for i, ((text, eos, reward), prompt) in enumerate(zip(TEXTS, PROMPTS)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
        rm_scores = torch.zeros(len(ids))
        rm_scores[-1] = reward
        uid = "u0" if i < 3 else "u1"
        rows.append({"prompts": torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                     "responses": torch.tensor(ids), "response_mask": torch.ones(len(ids), dtype=torch.long),
                     "rm_scores": rm_scores, "uid": uid, "data_source": "toy", "reward_model": {"ground_truth": str(i)},
                     "extra_info": {"index": i}})
        keys.append(f"{uid}_{i}_0")
        tags.append({"status": "success", "is_padding": i == 4})
    return list_of_dict_to_tensordict(rows), keys, tags


def padded(tokenizer):
    """The right-padded responses and their mask, built here from TEXTS."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if e else [])
           for t, e, _ in TEXTS]
    width = max(map(len, ids))
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for b, row in enumerate(ids):
        responses[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    return responses, mask, ids


@pytest.fixture
def step_batch(bpe_small):
    from verl_prm.integrations.verl.step_batch import read_step_batch

    stored, keys, tags = stored_batch(bpe_small)
    return read_step_batch(stored, keys, tags, 7, bpe_small, read_hook_config({"steps": {"delimiter": "\n"}}).steps,
                           [bpe_small.eos_token_id])


def test_read_step_batch_pads_splits_and_reads_outcomes(step_batch, bpe_small):
    responses, mask, ids = padded(bpe_small)
    assert torch.equal(step_batch.responses, responses) and torch.equal(step_batch.response_mask, mask)
    split = split_steps(responses, mask, bpe_small, "\n")
    assert torch.equal(step_batch.split.step_ids, split.step_ids)
    assert step_batch.split.num_steps.tolist() == [3, 2, 3, 2, 3]
    assert step_batch.truncated.tolist() == [False, False, True, False, False]
    assert step_batch.outcomes.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert step_batch.uids == ["u0", "u0", "u0", "u1", "u1"] and step_batch.step == 7
    assert step_batch.real_rows.tolist() == [True] * 4 + [False]
    assert step_batch.response_ids() == ids
    assert step_batch.prompt_ids() == [bpe_small(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert step_batch.ground_truths == ["0", "1", "2", "3", "4"] and step_batch.data_sources == ["toy"] * 5
    # left-padded prompts, then the responses' valid tokens
    prompt_width = step_batch.prompts.shape[1]
    assert step_batch.attention_mask[:, prompt_width:].equal(mask)
    assert step_batch.attention_mask[3, :prompt_width].tolist()[-1] == 1


class ShardedCritic:
    """A two-worker stand-in for the critic worker group: v_h = the position of step h's end, v_0 = the row's
    attention length, computed from each shard's own rows (so the rows must come back in the batch's order)."""

    world_size = 2

    def compute_step_values(self, shards):
        from verl import DataProto

        batch = shards.batch
        features = torch.ones(len(shards), batch["step_ends"].shape[1] + 1, 3) if shards.meta_info.get(
            "with_features") else None
        tensors = {"step_values": batch["step_ends"].float(), "prompt_values": batch["attention_mask"].sum(-1).float(),
                   "num_steps": batch["num_steps"]}
        if features is not None:
            tensors["features"] = features
        return DataProto.from_dict(tensors=tensors, meta_info={"metrics": {"pav_critic_offload_s": [0.5, 0.25]}})


def test_critic_worker_values_are_typed_and_in_the_batch_order(step_batch):
    from verl_prm.integrations.verl.step_batch import StepValues
    from verl_prm.integrations.verl.value_sources import CriticWorkerValues

    values = CriticWorkerValues(ShardedCritic(), reports_offload=True).values(step_batch, with_features=True)
    assert isinstance(values, StepValues)
    assert values.step_values.dtype == torch.float32
    assert torch.equal(values.step_values, step_batch.split.step_ends.float())
    assert torch.equal(values.prompt_values, step_batch.attention_mask.sum(-1).float())
    assert values.timing == {"pav_critic_offload": 0.5} and values.seconds > 0
    assert values.features.shape == (5, step_batch.split.step_ends.shape[1] + 1, 3)
    assert CriticWorkerValues(ShardedCritic()).values(step_batch).timing == {}


def test_critic_worker_values_count_the_public_prm_text_flags(step_batch):
    """A public PRM's per-response flags (CriticScores.separator_text / special_text) become pav/* counts."""
    from verl_prm.integrations.verl.value_sources import CriticWorkerValues

    class Flagging(ShardedCritic):
        def compute_step_values(self, shards):
            output = super().compute_step_values(shards)
            output.batch["separator_text"] = output.batch["num_steps"] == 3  # rows 0, 2, 4
            output.batch["special_text"] = torch.zeros(len(output), dtype=torch.bool)
            return output

    expected = 3.0
    assert CriticWorkerValues(Flagging()).values(step_batch).metrics == {
        "pav/critic_separator_text_responses": expected, "pav/critic_special_text_responses": 0.0}
    assert CriticWorkerValues(ShardedCritic()).values(step_batch).metrics == {}  # formats without the flags


def test_critic_worker_values_name_the_rows_whose_steps_differ(step_batch):
    from verl_prm.integrations.verl.value_sources import CriticWorkerValues

    class Miscounting(ShardedCritic):
        def compute_step_values(self, shards):
            output = super().compute_step_values(shards)
            output.batch["num_steps"] = output.batch["num_steps"] + (output.batch["step_values"][:, 2] > 0).long()
            return output

    with pytest.raises(RuntimeError, match=r"for samples \[0, 2, 4\] \(keys \['u0_0_0', 'u0_2_0', 'u1_4_0'\]\)"):
        CriticWorkerValues(Miscounting()).values(step_batch)


def test_rollout_sampled_values_wake_sample_and_sleep(step_batch):
    from verl_prm.integrations.verl.step_batch import StepValues
    from verl_prm.integrations.verl.value_sources import RolloutSampledValues

    events, calls = [], []
    manager = SimpleNamespace(update_weights=lambda version: events.append(("wake", version)),
                              sleep_replicas=lambda: events.append(("sleep",)))
    sampled = SimpleNamespace(step_values=torch.full((5, 3), 0.5, dtype=torch.float64), prompt_values=torch.ones(5),
                              num_steps=step_batch.split.num_steps, sampled=torch.ones(5, 3, dtype=torch.bool),
                              prefixes_evaluated=9, prefixes_skipped=1, continuations=18, tokens=40, rounds=2,
                              counts={}, pooled={})

    def step_values(*args, **kwargs):
        events.append(("sample",))
        calls.append((args, kwargs))
        return sampled

    timed = []
    source = RolloutSampledValues(SimpleNamespace(step_values=step_values), manager, 0.5,
                                  timer=lambda name: timed.append(name) or __import__("contextlib").nullcontext())
    values = source.values(step_batch)
    assert isinstance(values, StepValues) and values.sampled is sampled and timed == ["pav_mc"]
    assert values.step_values.dtype == torch.float32 and torch.all(values.step_values == 0.5)
    # the batch's weights are those of the previous step's update
    assert events == [("wake", 6), ("sample",), ("sleep",)]
    args, kwargs = calls[0]
    assert args[0] == step_batch.prompt_ids() and args[1] == step_batch.response_ids()
    assert args[4] == [True, False, False, True, True]  # outcome > success_threshold
    assert args[5] == step_batch.uids and args[7] == ["0", "1", "2", "3", "4"]
    assert kwargs == {"sample_rows": [True, True, True, True, False], "request_tag": "7"}
    # the mc metrics of the real rows: 40 tokens per the 4 real responses' tokens
    real_tokens = int(step_batch.response_mask[:4].sum())
    assert values.metrics["pav/mc_token_ratio"] == pytest.approx(40 / real_tokens)
    assert values.metrics["pav/mc_prefixes_evaluated"] == 9.0


def test_rollout_sampled_values_put_the_replicas_to_sleep_after_a_failure(step_batch):
    from verl_prm.integrations.verl.value_sources import RolloutSampledValues

    events = []
    manager = SimpleNamespace(update_weights=lambda version: events.append("wake"),
                              sleep_replicas=lambda: events.append("sleep"))

    def fails(*args, **kwargs):
        raise ValueError("response 1 is too long")

    with pytest.raises(ValueError, match="response 1 is too long"):
        RolloutSampledValues(SimpleNamespace(step_values=fails), manager, 0.5).values(step_batch)
    assert events == ["wake", "sleep"]


def test_exact_reference_values_are_typed_and_errors_name_the_key(step_batch, bpe_small):
    from verl_prm.critic.scorer import CriticScores
    from verl_prm.integrations.verl.step_batch import StepValues
    from verl_prm.integrations.verl.value_sources import ExactReferenceValues

    class Prover:
        def score_policy_batch(self, prompts, responses, attention_mask, split, tokenizer):
            assert tokenizer is bpe_small and torch.equal(attention_mask, step_batch.attention_mask)
            if split.num_steps.max() > 3:
                raise ValueError("sample 1: no such step")
            return CriticScores(prompt_values=torch.zeros(5, dtype=torch.float64),
                                step_values=split.step_ends.double(), num_steps=split.num_steps)

    values = ExactReferenceValues(Prover(), bpe_small).values(step_batch)
    assert isinstance(values, StepValues) and values.step_values.dtype == torch.float32
    assert torch.equal(values.step_values, step_batch.split.step_ends.float())
    step_batch.split.num_steps[0] = 4
    with pytest.raises(ValueError, match="verl_prm.diagnostics.reference: sample 1: no such step"):
        ExactReferenceValues(Prover(), bpe_small).values(step_batch)


class FixedValues:
    """A source of step values: fixed values (a function of the step's index and the row) and 0.25 s."""

    def values(self, batch):
        from verl_prm.integrations.verl.step_batch import StepValues

        slots = batch.split.step_ends.shape[1]
        step_values = (torch.arange(slots)[None, :] + 1.0) / (slots + 1) * torch.linspace(0.2, 1.0, 5)[:, None]
        return StepValues(step_values.float(), torch.full((5,), 0.1), 0.25, metrics={"pav/source_own": 1.0})


def hook(bpe_small, stored, estimator="pav_grpo"):
    """A ``PavSyncTrainer`` as verl's constructor and ``_setup`` leave what the advantage phase reads."""
    from verl_prm.integrations.verl.hook_trainer import PavSyncTrainer

    config = OmegaConf.create({
        "algorithm": {"adv_estimator": estimator, "use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0,
                      "norm_adv_by_std_in_grpo": True, "pav": {"alpha": 2.0, "drop_truncated": True}},
        "actor_rollout_ref": {"rollout": {"n": 3}},
    })
    trainer = object.__new__(PavSyncTrainer)
    trainer.config, trainer.tokenizer, trainer.global_steps = config, bpe_small, 7
    trainer.hook_config = read_hook_config({"steps": {"delimiter": "\n"}})
    trainer.pav_config = read_pav_config(config.algorithm)
    trainer.value_source, trainer.reference, trainer._eos_ids = FixedValues(), None, [bpe_small.eos_token_id]
    return trainer


def test_the_estimator_gets_the_step_tensors_through_verls_own_compute_advantage(bpe_small, monkeypatch):
    """verl's ``_compute_advantage`` (KL, rollout correction, estimator, write-back) runs unchanged; the trainer
    only values the steps and hands them to the registered estimator through ``estimator_step_inputs``."""
    import verl  # noqa: F401  (the plugin registers the estimators)
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base

    from verl_prm.estimators import ESTIMATORS
    from verl_prm.integrations.verl import hook_trainer

    stored, keys, tags = stored_batch(bpe_small)
    queue = MemoryQueue(stored)
    monkeypatch.setattr(hook_trainer, "tq", queue)  # what the hook reads
    monkeypatch.setattr(trainer_base, "tq", queue)  # what verl reads and writes
    trainer, metrics = hook(bpe_small, stored), {}
    result = hook_trainer.PavSyncTrainer._compute_advantage(trainer, KVBatchMeta(partition_id="train", keys=keys,
                                                                                  tags=tags), metrics)
    assert result == "written by verl"
    advantages = queue.written["advantages"].to_padded_tensor(padding=0.0)

    # the reference: the library's split and the estimator called with every tensor, as verl's compute_advantage
    # would with patch 0001
    responses, mask, ids = padded(bpe_small)
    split = split_steps(responses, mask, bpe_small, "\n")
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(5), mask.sum(1) - 1] = torch.tensor([r for *_, r in TEXTS])
    expected, _ = ESTIMATORS["pav_grpo"](
        token_level_rewards=rewards, response_mask=mask, index=np.array(["u0"] * 3 + ["u1"] * 2, dtype=object),
        config=trainer.config.algorithm, step_ids=split.step_ids, step_values=FixedValues().values(
            SimpleNamespace(split=split)).step_values, prompt_values=torch.full((5,), 0.1), num_steps=split.num_steps,
        truncated=torch.tensor([False, False, True, False, False]))
    torch.testing.assert_close(advantages, expected)
    assert (advantages[0] - advantages[0, 0]).abs().max() > 1e-3  # a process term, not only the outcome
    assert metrics["pav/critic_seconds"] == 0.25 and metrics["pav/source_own"] == 1.0
    assert metrics["pav/truncated_share"] == pytest.approx(1 / 4)  # of the four real rows

    # the context ends with the phase: verl's function alone gives the estimator's own error
    with pytest.raises(ValueError, match="needs the step tensors"):
        trainer_base.PPOTrainer._compute_advantage(trainer, KVBatchMeta(partition_id="train", keys=keys, tags=tags),
                                                   {})


def test_the_trainer_hook_does_not_copy_verls_advantage_phase():
    """The hook's ``_compute_advantage`` neither reads verl's fields nor writes back: verl's own does."""
    import inspect

    from verl_prm.integrations.verl.hook_trainer import PavSyncTrainer

    source = inspect.getsource(PavSyncTrainer._compute_advantage)
    assert "super()._compute_advantage(batch, metrics)" in source
    for verl_step in ("kv_batch_put", "apply_kl_penalty", "compute_rollout_correction", "response_to_nested"):
        assert verl_step not in inspect.getsource(inspect.getmodule(PavSyncTrainer)), verl_step


def test_the_hook_docstring_names_verls_chain_to_the_estimator():
    """The verl functions the docstring names between the hook and the estimator exist, and each calls the next
    (read from verl's own source), the last looking the estimator up in verl's registry."""
    import importlib
    import inspect

    from verl_prm.integrations.verl import hook_trainer

    chain = [("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_advantage"),
             ("verl.trainer.ppo.v1.utils", "compute_advantage_for_multi_trajectories"),
             ("verl.trainer.ppo.ray_trainer", "compute_advantage"), ("verl.trainer.ppo.core_algos", "get_adv_estimator_fn")]
    doc = " ".join(hook_trainer.__doc__.split())
    functions = []
    for module, attribute in chain:
        assert f"``{module}.{attribute}``" in doc, attribute
        target = importlib.import_module(module)
        for part in attribute.split("."):
            target = getattr(target, part)
        functions.append(target)
    for caller, callee in zip(functions, functions[1:]):
        assert f"{callee.__name__}(" in inspect.getsource(caller), (caller.__name__, callee.__name__)
    assert "advantage.verl_estimator" in doc and "estimator_step_inputs" in doc


def test_an_outcome_estimator_keeps_verls_advantages(bpe_small, monkeypatch):
    """grpo through the hook: the pav/* metrics are logged, the advantages are verl's grpo (no step tensors)."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.v1 import trainer_base

    from verl_prm.integrations.verl import hook_trainer

    stored, keys, tags = stored_batch(bpe_small)
    queue = MemoryQueue(stored)
    monkeypatch.setattr(hook_trainer, "tq", queue)
    monkeypatch.setattr(trainer_base, "tq", queue)
    trainer, metrics = hook(bpe_small, stored, estimator="grpo"), {}
    trainer.hook_config = read_hook_config({"steps": {"delimiter": "\n"}, "score_outcome_estimators": True})
    hook_trainer.PavSyncTrainer._compute_advantage(trainer, KVBatchMeta(partition_id="train", keys=keys, tags=tags),
                                                   metrics)
    _, mask, _ = padded(bpe_small)
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(5), mask.sum(1) - 1] = torch.tensor([r for *_, r in TEXTS])
    expected, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["u0"] * 3 + ["u1"] * 2, dtype=object))
    torch.testing.assert_close(queue.written["advantages"].to_padded_tensor(padding=0.0), expected)
    assert metrics["pav/steps_per_response"] == pytest.approx((3 + 2 + 3 + 2) / 4)
