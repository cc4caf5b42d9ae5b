"""The `pav` reward manager in verl's reward loop on a local Ray, and the trainer hook's advantage phase
(TransferQueue + a CPU critic worker group) against the pieces called directly."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl_support import PLUGIN_OVERRIDES, compose_verl, responses_for



# ---------------------------------------------------------------------------------------------- reward loop


@pytest.mark.ray
def test_pav_reward_manager_in_verl_reward_loop(ray_local, policy_dir, gsm8k_rows, bpe_small):
    """verl's RewardLoopManager with the `pav` manager on GSM8K rows: the streaming path (one worker call per
    trajectory, as verl's agent loop makes it: one float) and the batch path (rm_scores), plus verl's
    validation metrics over the extra info."""
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.metric_utils import process_validation_metrics
    from verl.utils.reward_score import default_compute_score

    from verl_prm.steps import split_steps

    config = compose_verl(PLUGIN_OVERRIDES + [f"actor_rollout_ref.model.path={policy_dir}", "reward.num_workers=2"])
    manager = RewardLoopManager(config=config, rm_resource_pool=None)
    assert manager.reward_loop_worker_handles is not None  # rule-based: the streaming path is on

    samples = responses_for(gsm8k_rows[:2], bpe_small)
    tokenizer = bpe_small
    prompt_ids = [tokenizer(row["prompt"][0]["content"])["input_ids"] for row, _, _ in samples]
    expected = []
    for row, text, ids in samples:
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        split = split_steps(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), tokenizer)
        ends = split.step_char_ends[0, : int(split.num_steps[0])].tolist()
        expected.append({
            "score": float(default_compute_score(row["data_source"], decoded, row["reward_model"]["ground_truth"])),
            "num_steps": int(split.num_steps[0]),
            "spans": [[s, e] for s, e in zip([0] + ends[:-1], ends)],
            "truncated": float(ids[-1] != tokenizer.eos_token_id),
        })
    assert [e["score"] for e in expected] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert min(e["num_steps"] for e in expected) >= 1 and max(e["num_steps"] for e in expected) >= 3

    def sample_proto(index: int):
        from verl import DataProto

        row, _, ids = samples[index]
        prompt = torch.tensor(prompt_ids[index])
        response = torch.tensor(ids)
        return DataProto.from_dict(
            tensors={
                "prompts": prompt[None], "responses": response[None],
                "attention_mask": torch.ones(1, len(prompt) + len(response), dtype=torch.long),
            },
            non_tensors={
                "data_source": np.array([row["data_source"]]),
                "reward_model": np.array([row["reward_model"]], dtype=object),
                "extra_info": np.array([row["extra_info"]], dtype=object),
                "__num_turns__": np.array([2]),
            },
        )

    # streaming path: the agent loop's call, one trajectory at a time
    import ray

    worker = manager.reward_loop_worker_handles[0]
    results = ray.get([worker.compute_score.remote(sample_proto(i)) for i in range(len(samples))])
    for result, exp in zip(results, expected):
        assert isinstance(result["reward_score"], float) and result["reward_score"] == exp["score"]
        info = result["reward_extra_info"]
        assert info["acc"] == exp["score"]
        assert info["pav_num_steps"] == exp["num_steps"]
        assert json.loads(info["pav_step_spans"]) == exp["spans"]
        assert info["pav_truncated"] == exp["truncated"]

    # batch path (colocated reward): verl pads prompts left and responses right
    from verl import DataProto

    width_p = max(len(p) for p in prompt_ids)
    width_r = max(len(ids) for _, _, ids in samples)
    prompts = torch.full((len(samples), width_p), tokenizer.pad_token_id)
    responses = torch.full((len(samples), width_r), tokenizer.pad_token_id)
    mask = torch.zeros(len(samples), width_p + width_r, dtype=torch.long)
    for i, (p, (_, _, ids)) in enumerate(zip(prompt_ids, samples)):
        prompts[i, width_p - len(p):] = torch.tensor(p)
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, width_p - len(p): width_p + len(ids)] = 1
    batch = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={
            "data_source": np.array([row["data_source"] for row, _, _ in samples]),
            "reward_model": np.array([row["reward_model"] for row, _, _ in samples], dtype=object),
            "extra_info": np.array([row["extra_info"] for row, _, _ in samples], dtype=object),
        },
    )
    output = manager.compute_rm_score(batch)
    lengths = torch.tensor([len(ids) for _, _, ids in samples])
    rm_scores = output.batch["rm_scores"]
    assert torch.equal(rm_scores[torch.arange(len(samples)), lengths - 1], torch.tensor([e["score"] for e in expected]))
    assert rm_scores.sum().item() == sum(e["score"] for e in expected)
    assert [json.loads(s) for s in output.non_tensor_batch["pav_step_spans"]] == [e["spans"] for e in expected]

    # validation: verl's metric reduction over the extra info (spans are text: skipped, numbers averaged)
    infos = {key: list(output.non_tensor_batch[key]) for key in output.meta_info["reward_extra_keys"]}
    metrics = process_validation_metrics(
        [row["data_source"] for row, _, _ in samples], [str(i // 3) for i in range(len(samples))], infos
    )
    per_source = metrics["openai/gsm8k"]
    assert per_source["acc"]["mean@3"] == pytest.approx(1 / 3)
    assert per_source["pav_num_steps"]["mean@3"] == pytest.approx(np.mean([e["num_steps"] for e in expected]))
    assert "pav_step_spans" not in per_source


# ---------------------------------------------------------------------------------------------- trainer hook


@pytest.fixture(scope="module")
def transfer_queue(ray_local):
    import transfer_queue as tq

    conf = OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    tq.init(conf)
    yield tq
    tq.close()


def put_trajectories(tq, tokenizer, samples, partition="train") -> tuple[list[str], list[dict], list[list[int]]]:
    """Write trajectories to TransferQueue as verl's agent loop does (jagged fields, keys uid_session_index)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields, tags, prompts = [], [], [], []
    uids: dict[int, str] = {}
    for i, (row, _, ids) in enumerate(samples):
        group = i // 3
        uid = uids.setdefault(group, str(uuid.uuid4()))
        prompt = tokenizer(row["prompt"][0]["content"])["input_ids"][:40]
        score = float(i % 3 == 0)
        rm_scores = torch.zeros(len(ids))
        rm_scores[-1] = score
        keys.append(f"{uid}_{i % 3}_0")
        fields.append({
            "prompts": torch.tensor(prompt), "responses": torch.tensor(ids),
            "response_mask": torch.ones(len(ids), dtype=torch.long), "rm_scores": rm_scores, "uid": uid,
        })
        tags.append({"status": "success", "prompt_len": len(prompt), "response_len": len(ids),
                     "seq_len": len(prompt) + len(ids)})
        prompts.append(prompt)
    tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags)
    return keys, tags, prompts


def make_hook_trainer(policy_dir, critic_dir, policy_tokenizer, pool_prefix, critic_overrides=None,
                      steps_overrides=("verl_prm.steps.delimiter='\\n'",)):
    """The registered trainer, built by verl's constructor, with its critic worker group on a CPU resource pool
    (verl's ResourcePoolManager only makes GPU pools, so the pool is the one verl's _setup would hand over).
    ``critic_overrides`` replace ``verl_prm.critic.path=<critic_dir>`` (e.g. an exact critic)."""
    from verl.single_controller.ray import RayResourcePool, ResourcePoolManager
    from verl.trainer.ppo.v1 import get_trainer_cls

    critic = list(critic_overrides) if critic_overrides is not None else [f"verl_prm.critic.path={critic_dir}"]
    config = compose_verl(PLUGIN_OVERRIDES + critic + list(steps_overrides) + [
        f"actor_rollout_ref.model.path={policy_dir}", "trainer.device=cpu",
        "algorithm.pav.alpha=2.0", "algorithm.pav.clip=0.5",
        "actor_rollout_ref.rollout.n=3", "data.train_batch_size=2",
    ])
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    trainer.tokenizer = policy_tokenizer
    trainer.resource_pool_manager = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
    trainer.resource_pool_manager.resource_pool_dict["global_pool"] = RayResourcePool(
        process_on_nodes=[2], use_gpu=False, max_colocate_count=1, name_prefix=pool_prefix
    )
    trainer.init_value_sources()
    trainer.global_steps = 1  # verl's fit() sets it before the first step
    return trainer


@pytest.fixture(scope="module")
def hook_trainer(transfer_queue, policy_dir, critic_dir, bpe_small):
    return make_hook_trainer(policy_dir, critic_dir, bpe_small, "pav_test_pool")


@pytest.mark.ray
def test_hook_trainer_is_sync_everywhere_verl_checks(hook_trainer):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    assert hook_trainer.trainer_mode == "sync"
    assert hook_trainer.registered_trainer_mode == "pav_sync"
    assert type(hook_trainer.replay_buffer) is ReplayBuffer  # the sync trainer's buffer, not ReplayBufferAsync
    assert hook_trainer.parameter_sync_step == 1
    assert hook_trainer.value_source.group.world_size == 2


@pytest.mark.ray
def test_hook_advantage_phase_equals_the_pieces(hook_trainer, transfer_queue, gsm8k_rows, critic_dir, bpe_small):
    """trainer._compute_advantage (TransferQueue in and out, critic worker group) == split_steps + ProverCritic +
    the registered estimator called directly; metrics from the same values."""
    from verl_prm.critic import ProverCritic

    critic = ProverCritic.from_pretrained(str(critic_dir), format="value_head", device="cpu")
    # same vocabulary: the critic reads the policy ids as they are
    check_advantage_phase(hook_trainer, transfer_queue, responses_for(gsm8k_rows[:2], bpe_small), bpe_small,
                          lambda *batch: critic.score_policy_batch(*batch, None), {"delimiter": "\n"})


@pytest.mark.ray
def test_hook_with_a_critic_of_another_vocabulary(transfer_queue, policy_dir, critic_dir_other_vocab, gsm8k_rows,
                                                  bpe_small):
    """The critic re-reads the split's text in its own vocabulary: the hook sends where the steps end in the text."""
    from verl_prm.critic import ProverCritic

    trainer = make_hook_trainer(policy_dir, critic_dir_other_vocab, bpe_small, "pav_test_pool_other_vocab")
    critic = ProverCritic.from_pretrained(str(critic_dir_other_vocab), format="value_head", device="cpu")
    # another vocabulary: it re-reads the split's text
    check_advantage_phase(trainer, transfer_queue, responses_for(gsm8k_rows[:2], bpe_small), bpe_small,
                          lambda *batch: critic.score_policy_batch(*batch, bpe_small), {"delimiter": "\n"})


def arithmetic_responses_for(problems, tokenizer) -> list[tuple[dict, str, list[int]]]:
    """Per arithmetic problem (a verl row): the reference solution (EOS), one with a slip (EOS) and the first
    half of the reference (no EOS), as responses_for."""
    from verl_prm.apps.arithmetic.task import solution_lines, verl_row

    out = []
    for i, problem in enumerate(problems):
        correct = "\n".join(solution_lines(problem))
        slipped = "\n".join(solution_lines(problem, 1, (problem.values[1] + 1) % problem.modulus))
        for text, eos in ((correct, True), (slipped, True), (correct[: len(correct) // 2], False)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            out.append((verl_row(problem, "train", i), text, ids))
    return out


@pytest.mark.ray
def test_hook_with_an_exact_critic(transfer_queue, policy_dir, bpe_small):
    """format=exact: the worker group starts without a checkpoint (the policy's tokenizer reads the text), and
    the advantage phase equals split_steps + the arithmetic prover on the texts + the estimator."""
    from verl_prm.critic.exact import ExactCritic
    from verl_prm.integrations.verl.critic_group import policy_tokenizer_path
    from verl_prm.apps.arithmetic.task import STEP_REGEX, Problem

    exact = ["verl_prm.critic.source=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
             "+verl_prm.critic.options.step_accuracy=0.8"]
    steps = ["verl_prm.steps.delimiter=null", f"verl_prm.steps.regex='{STEP_REGEX}'"]
    trainer = make_hook_trainer(policy_dir, None, bpe_small, "pav_test_pool_exact", critic_overrides=exact,
                                steps_overrides=steps)
    assert trainer.hook_config.steps.regex == STEP_REGEX
    assert policy_tokenizer_path(trainer.hook_config.critic.path, trainer.config.actor_rollout_ref.model, bpe_small) == str(policy_dir)
    problems = [Problem(5, (("+", 7), ("*", 3), ("-", 4)), 13), Problem(2, (("*", 5), ("+", 9), ("*", 2)), 11)]
    critic = ExactCritic.from_options("verl_prm.apps.arithmetic.prover:ArithmeticProver", step_accuracy=0.8)
    check_advantage_phase(trainer, transfer_queue, arithmetic_responses_for(problems, bpe_small), bpe_small,
                          lambda *batch: critic.score_policy_batch(*batch, bpe_small), {"regex": STEP_REGEX,
                                                                                      "delimiter": None})


def check_advantage_phase(hook_trainer, transfer_queue, samples, bpe_small, score, split_kwargs):
    """``hook_trainer._compute_advantage`` on ``samples`` (triples: rewards 1, 0, 0; the third truncated) ==
    ``split_steps(**split_kwargs)`` + ``score(prompts, responses, attention, split)`` (the critic called
    directly) + the registered estimator called directly with the step tensors; metrics from the same values."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_prm.steps import split_steps
    from verl_prm.integrations.verl.batch_metrics import step_metrics
    from verl_prm.responses import truncated_responses

    tq = transfer_queue
    keys, tags, prompts = put_trajectories(tq, bpe_small, samples)
    metrics: dict = {}
    hook_trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    written = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages", "returns"])
    advantages = written["advantages"].to_padded_tensor(padding=0.0)

    # the pieces, called directly
    tokenizer = bpe_small
    lengths = [len(ids) for _, _, ids in samples]
    width = max(lengths)
    pad = tokenizer.pad_token_id
    responses = torch.full((len(samples), width), pad)
    response_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, (_, _, ids) in enumerate(samples):
        responses[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = 1
    width_p = max(len(p) for p in prompts)
    prompt_tensor = torch.full((len(samples), width_p), pad)
    attention = torch.zeros(len(samples), width_p + width, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_tensor[i, width_p - len(p):] = torch.tensor(p)
        attention[i, width_p - len(p):width_p] = 1
    attention[:, width_p:] = response_mask
    split = split_steps(responses, response_mask, tokenizer, **split_kwargs)
    scores = score(prompt_tensor, responses, attention, split)
    truncated = truncated_responses(responses, torch.tensor(lengths), tokenizer.eos_token_id)
    rm_scores = torch.zeros(len(samples), width)
    rm_scores[torch.arange(len(samples)), torch.tensor(lengths) - 1] = torch.tensor(
        [float(i % 3 == 0) for i in range(len(samples))]
    )
    algorithm = hook_trainer.config.algorithm
    uids = np.array([key.rsplit("_", 2)[0] for key in keys], dtype=object)
    expected, _ = get_adv_estimator_fn(algorithm.adv_estimator)(
        token_level_rewards=rm_scores, response_mask=response_mask, index=uids, config=algorithm,
        step_ids=split.step_ids, step_values=scores.step_values, prompt_values=scores.prompt_values,
        num_steps=split.num_steps, truncated=truncated,
    )

    assert split.num_steps.min() >= 2
    assert advantages.shape == expected.shape
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=1e-5)
    # the process term really is in there: alpha = 0 would give verl's grpo
    assert (advantages * response_mask).std(dim=1).max() > 1e-4

    expected_metrics = step_metrics(scores.step_values, scores.prompt_values, split.num_steps, truncated,
                                    hook_trainer.pav_config, critic_seconds=0.0)
    for name, value in expected_metrics.items():
        if name != "pav/critic_seconds":
            assert metrics[name] == pytest.approx(value, abs=1e-5), name
    assert metrics["pav/truncated_share"] == pytest.approx(1 / 3)
    assert metrics["pav/critic_seconds"] > 0
    # groups (uid) whose outcomes are all equal: GRPO's advantage is zero there
    outcomes: dict = {}
    for uid, reward in zip(uids, rm_scores.sum(dim=1).tolist()):
        outcomes.setdefault(uid, []).append(reward)
    same = [len(set(rewards)) == 1 for rewards in outcomes.values()]
    assert metrics["pav/outcome_zero_signal_groups"] == pytest.approx(sum(same) / len(same))
    tq.kv_clear(keys=keys, partition_id="train")


@pytest.mark.ray
def test_hook_with_grpo_keeps_verl_advantages_and_pav_alpha_zero_equals_them(hook_trainer, transfer_queue, gsm8k_rows, bpe_small):
    from transfer_queue import KVBatchMeta
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    tq = transfer_queue
    samples = responses_for(gsm8k_rows[2:4], bpe_small)
    keys, tags, _ = put_trajectories(tq, bpe_small, samples)
    algorithm = hook_trainer.config.algorithm
    original = algorithm.adv_estimator
    algorithm.adv_estimator = "grpo"
    try:
        metrics: dict = {}
        hook_trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    finally:
        algorithm.adv_estimator = original
    advantages = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])["advantages"]
    raw = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["uid", "response_mask", "rm_scores"])
    data = DataProto(batch=raw.to_padded_tensor())
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    expected = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator="grpo", config=algorithm)
    torch.testing.assert_close(advantages.to_padded_tensor(padding=0.0), expected.batch["advantages"])
    assert metrics["pav/steps_per_response"] >= 2 and "pav/process_term/std" in metrics

    # pav_grpo with alpha = 0 through the hook gives verl's grpo advantages
    alpha = algorithm.pav.alpha
    algorithm.pav.alpha = 0.0
    try:
        hook_trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), {})
    finally:
        algorithm.pav.alpha = alpha
    pav_zero = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages"])["advantages"]
    torch.testing.assert_close(pav_zero.to_padded_tensor(padding=0.0), expected.batch["advantages"],
                               atol=1e-6, rtol=1e-5)
    tq.kv_clear(keys=keys, partition_id="train")
