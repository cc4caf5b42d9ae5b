"""The sampling critic (verl_prm.critic.source=sampled) in the trainer hook: a fake LLM server client over the
scripted policy of verl_prm.labeling.closed_form_task (token ids in, token ids out, as verl's LLMServerClient),
the hook's advantage phase on TransferQueue, and the startup errors."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest
import torch
from verl_support import PLUGIN_OVERRIDES, compose_verl, parity_reward_file

from verl_prm.config.hook import ConfigError, read_hook_config
from verl_prm.integrations.verl.run_config import check_source_settings
from verl_prm.labeling.generators import derive_seed
from verl_prm.labeling.closed_form_task import (
    ScriptedStepGenerator,
    ScriptedStepTask,
    exact_prefix_value,
    scripted_step_score,
)

H, P_CORRECT, N_MC, RESPONSE_LENGTH = 4, 0.7, 24, 96
TASK = ScriptedStepTask(num_steps=H)
# verl loads a custom reward function from a file: this one re-exports the scripted task's outcome
REWARD_FILE = Path(__file__).resolve().parent / "scripted_reward.py"
ROLLOUT_OVERRIDES = [
    "verl_prm.critic.source=sampled", f"verl_prm.critic.n_mc={N_MC}",
    f"reward.custom_reward_function.path={REWARD_FILE}", "reward.custom_reward_function.name=scripted_step_score",
    f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}", "actor_rollout_ref.rollout.prompt_length=32",
    "trainer.device=cpu", "actor_rollout_ref.rollout.n=3", "data.train_batch_size=2",
]


class ScriptedClient:
    """verl's ``LLMServerClient.generate`` over the scripted policy: decodes the prompt ids, writes the remaining
    steps (seeded by the prompt ids and how often they were asked for), returns their ids + EOS, cut at
    ``max_tokens``. Records the calls in ``events``."""

    def __init__(self, tokenizer, events):
        self.tokenizer = tokenizer
        self.generator = ScriptedStepGenerator(P_CORRECT)
        self.asked: dict[tuple, int] = {}
        self.events = events

    def continuation(self, prompt_ids: list[int], index: int) -> list[int]:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        [[sample]] = self.generator.generate([text], 1, [derive_seed("client", *prompt_ids, index)])
        return self.tokenizer(sample.text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.events.append(("generate", dict(sampling_params)))
        key = tuple(prompt_ids)
        index = self.asked.get(key, 0)
        self.asked[key] = index + 1
        token_ids = self.continuation(list(prompt_ids), index)[: sampling_params["max_tokens"]]
        self.events.append(("tokens", len(token_ids)))
        return TokenOutput(token_ids=token_ids)


class CheckpointRecorder:
    def __init__(self, events):
        self.events = events

    def update_weights(self, global_steps=None):
        self.events.append(("update_weights", global_steps))

    def sleep_replicas(self):
        self.events.append(("sleep", None))


def _rows(tokenizer):
    """Two prompts x three responses of H steps; step 0's digit differs per response (distinct prefixes)."""
    rows = []
    steps_of = [["x", "x", "x", "x"], ["x", "y", "x", "x"], ["y", "x", "x", "x"],
                ["x", "x", "y", "x"], ["x", "x", "x", "x"], ["x", "x", "x", "y"]]
    for i, letters in enumerate(steps_of):
        text = "\n\n".join(f"{letter}={(i + h) % 10}" for h, letter in enumerate(letters))
        prompt = tokenizer(TASK.prompt(i // 3), add_special_tokens=False)["input_ids"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((i // 3, text, prompt, ids))
    return rows


def _padded_split(rows, tokenizer):
    """The rows' responses right-padded, their mask, and their "\n\n" steps: what the reference loops read."""
    from verl_prm.steps import split_steps

    width = max(len(ids) for *_, ids in rows)
    responses = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (*_, ids) in enumerate(rows):
        responses[b, : len(ids)], mask[b, : len(ids)] = torch.tensor(ids), 1
    return responses, mask, split_steps(responses, mask, tokenizer, "\n\n")


def _put(tq, rows):
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    uids = {group: str(uuid.uuid4()) for group in {group for group, *_ in rows}}
    keys, fields, tags = [], [], []
    for i, (group, text, prompt, ids) in enumerate(rows):
        rm_scores = torch.zeros(len(ids))
        rm_scores[-1] = scripted_step_score("scripted", text, H)
        keys.append(f"{uids[group]}_{i % 3}_0")
        fields.append({
            "prompts": torch.tensor(prompt), "responses": torch.tensor(ids),
            "response_mask": torch.ones(len(ids), dtype=torch.long), "rm_scores": rm_scores, "uid": uids[group],
            "data_source": "scripted", "reward_model": {"ground_truth": H}, "extra_info": {"index": i},
        })
        tags.append({"status": "success", "prompt_len": len(prompt), "response_len": len(ids),
                     "seq_len": len(prompt) + len(ids)})
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
    return keys, tags


@pytest.fixture(scope="module")
def transfer_queue(ray_local):
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()


def _trainer(policy_dir, tokenizer, events, extra=()):
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_verl(PLUGIN_OVERRIDES + ROLLOUT_OVERRIDES + [f"actor_rollout_ref.model.path={policy_dir}"]
                          + list(extra))
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    trainer.tokenizer = tokenizer
    trainer.get_llm_client = lambda: ScriptedClient(tokenizer, events)
    trainer.checkpoint_manager = CheckpointRecorder(events)
    trainer.init_value_sources()
    trainer.global_steps = 3
    return trainer


def _step_batch(trainer, transfer_queue, keys, tags):
    """The hook's StepBatch of the stored rows (as its advantage phase reads them)."""
    from transfer_queue import KVBatchMeta

    return trainer.read_step_batch(KVBatchMeta(partition_id="train", keys=keys, tags=tags))


@pytest.mark.ray
def test_hook_samples_values_equal_to_a_direct_monte_carlo_loop(transfer_queue, policy_dir, bpe_small):
    from transfer_queue import KVBatchMeta

    tokenizer, events = bpe_small, []
    trainer = _trainer(policy_dir, tokenizer, events)
    rows = _rows(tokenizer)
    keys, tags = _put(transfer_queue, rows)
    tensors = trainer.value_source.values(_step_batch(trainer, transfer_queue, keys, tags))

    # the reference: n continuations of prompt + response[:end_h + 1] for every step but the last, from a fresh
    # client over the same policy, scored by the task; the last step is the outcome, v0 the group's success rate
    reference_client = ScriptedClient(tokenizer, [])
    responses, mask, split = _padded_split(rows, tokenizer)
    assert split.num_steps.tolist() == [H] * len(rows)
    outcomes = [scripted_step_score("scripted", text, H) for _, text, _, _ in rows]
    for b, (group, text, prompt, ids) in enumerate(rows):
        expected = []
        for h in range(H - 1):
            prefix = ids[: int(split.step_ends[b, h]) + 1]
            wins = 0
            for j in range(N_MC):
                continuation = reference_client.continuation(prompt + prefix, j)
                wins += scripted_step_score("scripted", tokenizer.decode(prefix + continuation, skip_special_tokens=True), H)
            expected.append(wins / N_MC)
            # and the estimate is within 4.5 standard errors of the closed form
            exact = exact_prefix_value(tokenizer.decode(prefix, skip_special_tokens=True), H, P_CORRECT)
            assert abs(wins / N_MC - exact) <= 4.5 * math.sqrt(exact * (1 - exact) / N_MC) + 1e-9
        expected.append(outcomes[b])
        assert tensors.step_values[b, :H].tolist() == pytest.approx(expected, abs=1e-6), b
        members = [o for (g, *_), o in zip(rows, outcomes) if g == group]
        assert tensors.prompt_values[b].item() == pytest.approx(sum(members) / len(members))
    values = tensors.sampled
    assert values.prefixes_evaluated == len(rows) * (H - 1) and values.continuations == len(rows) * (H - 1) * N_MC

    # the replicas are woken with the batch's weights (version global_steps - 1) before sampling, put to sleep after;
    # every request carries the rollout's sampling settings and a continuation limit of response_length - prefix
    assert events[0] == ("update_weights", 2) and events[-1] == ("sleep", None)
    assert values.tokens == sum(count for name, count in events if name == "tokens")
    generated = [params for name, params in events if name == "generate"]
    assert len(generated) == values.continuations
    rollout = trainer.config.actor_rollout_ref.rollout
    assert all(p["temperature"] == rollout.temperature and p["top_p"] == rollout.top_p and p["top_k"] == rollout.top_k
               for p in generated)
    assert max(p["max_tokens"] for p in generated) < RESPONSE_LENGTH

    # the advantage phase: pav/mc_* metrics and timing_s/pav_mc's source; the continuations are not in the batch
    events.clear()
    trainer.timing_raw = {}
    metrics: dict = {}
    trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    assert metrics["pav/mc_prefixes_evaluated"] == len(rows) * (H - 1)
    assert metrics["pav/mc_prefixes_skipped"] == 0
    assert metrics["pav/mc_continuations"] == len(rows) * (H - 1) * N_MC
    assert metrics["pav/mc_tokens"] == sum(count for name, count in events if name == "tokens") == values.tokens
    # continuation tokens per token of the batch's responses (every token of a row is a response token here)
    response_tokens = sum(len(ids) for *_, ids in rows)
    assert metrics["pav/mc_token_ratio"] == pytest.approx(metrics["pav/mc_tokens"] / response_tokens)
    assert metrics["pav/mc_token_ratio"] > 1  # N_MC continuations of three prefixes per response
    assert "pav_mc" in trainer.timing_raw and trainer.timing_raw["pav_mc"] > 0
    written = transfer_queue.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages", "responses"])
    assert [len(r) for r in written["responses"].unbind()] == [len(ids) for *_, ids in rows]
    transfer_queue.kv_clear(keys=keys, partition_id="train")


@pytest.mark.ray
def test_hook_token_budget_is_never_exceeded(transfer_queue, policy_dir, bpe_small):
    tokenizer, events = bpe_small, []
    budget = 600
    trainer = _trainer(policy_dir, tokenizer, events, [f"verl_prm.critic.mc_token_budget={budget}"])
    rows = _rows(tokenizer)
    keys, tags = _put(transfer_queue, rows)
    values = trainer.value_source.values(_step_batch(trainer, transfer_queue, keys, tags)).sampled
    generated = [params for name, params in events if name == "generate"]
    # the reservations of the admitted prefixes fit the budget, so the tokens do
    assert sum(p["max_tokens"] for p in generated) <= budget
    assert values.tokens == sum(count for name, count in events if name == "tokens") <= budget
    assert values.prefixes_skipped > 0 and values.prefixes_evaluated + values.prefixes_skipped == len(rows) * (H - 1)
    transfer_queue.kv_clear(keys=keys, partition_id="train")


@pytest.mark.ray
def test_hook_pools_the_group_responses_that_continue_a_sampled_prefix(transfer_queue, policy_dir, bpe_small):
    """verl_prm.critic.pool_group_samples (the default): a sampled prefix's value also counts the outcomes of the
    other responses of its group whose token ids begin with the prefix's and go on past it (a loop over the
    rows, on token ids as the rollout wrote them)."""
    tokenizer, events = bpe_small, []
    trainer = _trainer(policy_dir, tokenizer, events)
    # step h writes x=h or y=h: responses of a group share their prefixes up to their first difference
    rows = []
    for i, letters in enumerate([["x", "x", "x", "x"], ["x", "x", "y", "x"], ["x", "y", "x", "x"],
                                 ["x", "x", "x", "x"], ["x", "x", "x", "y"], ["y", "x", "x", "x"]]):
        text = "\n\n".join(f"{letter}={h}" for h, letter in enumerate(letters))
        prompt = tokenizer(TASK.prompt(i // 3), add_special_tokens=False)["input_ids"]
        rows.append((i // 3, text, prompt, tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
    keys, tags = _put(transfer_queue, rows)
    values = trainer.value_source.values(_step_batch(trainer, transfer_queue, keys, tags))

    reference_client = ScriptedClient(tokenizer, [])
    responses, mask, split = _padded_split(rows, tokenizer)
    outcomes = [scripted_step_score("scripted", text, H) for _, text, _, _ in rows]
    # the client seeds a continuation by its prompt ids and how often they were asked for; the hook asks in the
    # order (step, row), so a prefix two rows share gets the second row's continuations after the first's
    pooled, asked = 0, {}
    for h in range(H - 1):
        for b, (group, _, prompt, ids) in enumerate(rows):
            prefix = ids[: int(split.step_ends[b, h]) + 1]
            first = asked.get(tuple(prompt + prefix), 0)
            asked[tuple(prompt + prefix)] = first + N_MC
            wins = sum(scripted_step_score("scripted", tokenizer.decode(
                prefix + reference_client.continuation(prompt + prefix, j), skip_special_tokens=True), H)
                for j in range(first, first + N_MC))
            others = [o for c, ((g, *_, other), o) in enumerate(zip(rows, outcomes))
                      if c != b and g == group and len(other) > len(prefix) and other[: len(prefix)] == prefix]
            pooled += len(others)
            assert values.step_values[b, h].item() == pytest.approx((wins + sum(others)) / (N_MC + len(others)),
                                                                    abs=1e-6), (b, h)
    assert pooled > 0 and values.sampled.pooled_samples == pooled
    assert values.metrics["pav/mc_pooled_samples"] == pooled
    assert values.metrics["pav/mc_samples_per_value"] == pytest.approx(N_MC + pooled / (len(rows) * (H - 1)))
    assert values.sampled.continuations == len(rows) * (H - 1) * N_MC  # the pooled ones cost nothing
    transfer_queue.kv_clear(keys=keys, partition_id="train")


def test_mc_token_ratio_counts_the_real_rows_response_tokens():
    """pav/mc_token_ratio = continuation tokens / response tokens of the real rows (the padding row's tokens and
    its unsampled steps do not count), from a nested or a padded response mask alike."""
    from verl_prm.critic.sampled import SampledValues
    from verl_prm.integrations.verl.rollout_sampler import mc_metrics

    lengths = [4, 6, 5]
    values = SampledValues(step_values=torch.zeros(3, 2), prompt_values=torch.zeros(3),
                           num_steps=torch.tensor([2, 2, 2]), sampled=torch.tensor([[1, 0], [1, 0], [0, 0]]).bool(),
                           first_pits=[-1, -1, -1], prefixes_evaluated=2, continuations=8, tokens=30, rounds=1)
    real_rows = torch.tensor([True, True, False])
    nested = torch.nested.nested_tensor([torch.ones(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
    padded = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).long()
    for mask in (nested, padded):
        metrics = mc_metrics(values, mask, real_rows)
        assert metrics["pav/mc_token_ratio"] == pytest.approx(30 / (4 + 6))
        assert metrics["pav/mc_sampled_step_share"] == pytest.approx(2 / 4)
    assert mc_metrics(values, padded)["pav/mc_token_ratio"] == pytest.approx(30 / 15)  # no padding: all rows


def test_mc_samples_metrics_count_the_real_rows_values():
    """pav/mc_pooled_samples and pav/mc_samples_per_value over the real rows' sampled values (a padding row's do
    not count)."""
    from verl_prm.critic.sampled import SampledValues
    from verl_prm.integrations.verl.rollout_sampler import mc_metrics
    from verl_prm.monte_carlo import PrefixCounts

    counts = {(0, 0): PrefixCounts(3, 6, 10), (0, 1): PrefixCounts(1, 4, 8), (1, 0): PrefixCounts(2, 5, 9),
              (2, 0): PrefixCounts(0, 9, 4)}
    values = SampledValues(step_values=torch.zeros(3, 3), prompt_values=torch.zeros(3),
                           num_steps=torch.tensor([3, 3, 3]), sampled=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0]]).bool(),
                           first_pits=[-1, -1, -1], counts=counts, pooled={(0, 0): 2, (0, 1): 0, (1, 0): 1, (2, 0): 5},
                           pooled_samples=8)
    metrics = mc_metrics(values, torch.ones(3, 4), torch.tensor([True, True, False]))
    assert metrics["pav/mc_pooled_samples"] == 3.0
    assert metrics["pav/mc_samples_per_value"] == pytest.approx((6 + 4 + 5) / 3)
    assert mc_metrics(values, torch.ones(3, 4))["pav/mc_pooled_samples"] == 8.0


# ---------------------------------------------------------------------------------------------- startup errors


@pytest.mark.parametrize("key, value, message", [
    ("n_mc", 0, "verl_prm.critic.n_mc must be an integer >= 1, got 0"),
    ("mc_token_budget", 0, "verl_prm.critic.mc_token_budget must be an integer >= 1, got 0"),
    ("prefix_rule", "all", "verl_prm.critic.prefix_rule must be one of ('every', 'fixed', 'first_pit'), got 'all'"),
    ("path", "/some/critic", "verl_prm.critic.path='/some/critic' is unused with verl_prm.critic.source=sampled"),
    ("success_threshold", float("nan"), "verl_prm.critic.success_threshold must be a finite number"),
    ("group_prior_strength", -1.0, "verl_prm.critic.group_prior_strength must be >= 0 (a finite number), got -1.0"),
    ("group_prior_strength", float("inf"), "verl_prm.critic.group_prior_strength must be >= 0 (a finite number)"),
    ("mc_success_threshold", 0.5, "verl_prm.critic.mc_success_threshold was renamed: set "
                                  "verl_prm.critic.success_threshold"),
    ("prior_strength", 1.0, "verl_prm.critic.prior_strength was renamed: set verl_prm.critic.group_prior_strength"),
])
def test_sampled_source_section_errors_name_the_key(key, value, message):
    with pytest.raises(ConfigError) as error:
        check_source_settings(read_hook_config({"critic": {"source": "sampled", key: value}}))
    assert message in str(error.value)


def test_old_format_names_of_the_value_sources_are_refused_with_the_new_key():
    for old, new in (("rollout", "sampled"), ("tree", "tree"), ("exact", "exact")):
        with pytest.raises(ConfigError, match=f"set verl_prm.critic.source={new} "):
            read_hook_config({"critic": {"format": old}})
    with pytest.raises(ConfigError, match="verl_prm.critic.format must be one of"):
        read_hook_config({"critic": {"format": "sampled"}})


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.max_model_len=100",
     "actor_rollout_ref.rollout.max_model_len=100 cannot take a step prefix of a full-length response"),
    ("reward.reward_model.enable=True", "reward.reward_model.enable=True (a reward model) cannot score them"),
    ("reward.reward_manager.name=dapo", "reward.reward_manager.name='dapo' (source 'register') may reward"),
    ("+trainer.v1.sync.parameter_sync_step=2", "trainer.v1.sync.parameter_sync_step=2 updates the actor"),
])
def test_sampling_run_errors_name_the_key(override, message):
    from verl_prm.integrations.verl.run_config import check_sampling_run

    config = compose_verl(PLUGIN_OVERRIDES + ROLLOUT_OVERRIDES + [override])
    with pytest.raises(ConfigError) as error:
        check_sampling_run(config)
    assert message in str(error.value)
    # the same config without the override passes
    check_sampling_run(compose_verl(PLUGIN_OVERRIDES + ROLLOUT_OVERRIDES))


# ---------------------------------------------------------------------------------------------- main_ppo on CPU

MC_BUDGET = 1500


@pytest.fixture(scope="module")
def rollout_loop_run(tmp_path_factory):
    """verl's main_ppo for 2 steps on the CPU loop (hf rollout) with the sampling critic: 2 continuations per
    prefix through the LLM server client over the hf replicas, a token budget per step."""
    from verl_prm.apps.cpu_loop import main_ppo_args, prepare, run_main_ppo

    work = tmp_path_factory.mktemp("rollout_loop")
    prepare(work)
    reward = parity_reward_file(work)
    args = main_ppo_args(work, "pav_grpo", steps=2, run_name="pav_grpo_rollout", extra=[
        "verl_prm.critic.source=sampled", "verl_prm.critic.path=null", "verl_prm.critic.n_mc=2",
        f"verl_prm.critic.mc_token_budget={MC_BUDGET}", f"reward.custom_reward_function.path={reward}"])
    return run_main_ppo(args, work / "rollout.jsonl", work / "rollout.log", timeout=600)


@pytest.mark.slow
def test_main_ppo_two_steps_with_the_sampling_critic_on_cpu(rollout_loop_run):
    result = rollout_loop_run
    assert result.returncode == 0, f"main_ppo exited {result.returncode}; log tail:\n{result.tail()}"
    records = {record["step"]: record["data"] for record in result.metrics}
    assert sorted(records) == [1, 2], f"logged steps {sorted(records)}; log tail:\n{result.tail()}"
    for step, metrics in records.items():
        assert metrics["pav/mc_prefixes_evaluated"] > 0, f"step {step}: nothing sampled"
        assert 0 < metrics["pav/mc_tokens"] <= MC_BUDGET, f"step {step}: {metrics['pav/mc_tokens']} tokens"
        assert metrics["pav/mc_continuations"] == 2 * metrics["pav/mc_prefixes_evaluated"]
        # the token ratio against verl's own count of the batch's response tokens (16 responses, no padding rows)
        response_tokens = metrics["response_length/mean"] * 16
        assert metrics["pav/mc_token_ratio"] == pytest.approx(metrics["pav/mc_tokens"] / response_tokens, rel=1e-5)
        assert "pav/mc_prefixes_skipped" in metrics and metrics["timing_s/pav_mc"] > 0
        assert 0.0 < metrics["pav/v0_mean"] < 1.0, f"step {step}: v0 {metrics['pav/v0_mean']}"
        assert metrics["pav/process_term/std"] > 0, f"step {step}: constant process term"
        assert metrics["actor/grad_norm"] > 0, f"step {step}: actor grad norm {metrics['actor/grad_norm']}"


# ---------------------------------------------------------------------------------------------- refresh of a PAV

class LocalCriticGroup:
    """A one-worker stand-in for the critic's RayWorkerGroup: the worker's methods, called in this process."""

    world_size = 1

    def __init__(self, worker):
        self.worker = worker

    def compute_step_values(self, data):
        return self.worker.compute_step_values(data)

    def set_value_head(self, weight, bias):
        return self.worker.set_value_head(weight, bias)


def _refresh_trainer(policy_dir, critic_dir, tokenizer, events, directory, global_steps, extra=()):
    from unittest import mock

    from verl_prm.integrations.verl import sources
    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker
    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    from verl.trainer.ppo.v1 import get_trainer_cls

    # the refresh refits a checkpoint's value head: source checkpoint (format value_head), sampling settings kept
    overrides = [o for o in ROLLOUT_OVERRIDES if not o.startswith("verl_prm.critic.source=")] + [
        "verl_prm.critic.source=checkpoint", f"verl_prm.critic.path={critic_dir}", "verl_prm.critic.dtype=float32", "verl_prm.refresh.every=2",
        "verl_prm.refresh.window=2", f"verl_prm.refresh.directory={directory}",
        f"actor_rollout_ref.model.path={policy_dir}", *extra]
    trainer = get_trainer_cls("pav_sync")(compose_verl(PLUGIN_OVERRIDES + overrides))
    trainer.tokenizer = tokenizer
    trainer.get_llm_client = lambda: ScriptedClient(tokenizer, events)
    trainer.checkpoint_manager = CheckpointRecorder(events)
    worker = ProverCriticWorker(str(critic_dir), critic_worker_kwargs(trainer.hook_config))
    worker.init_model()
    # the worker group on a verl resource pool (sources._critic_group) is this process's worker here
    with mock.patch.object(sources, "_critic_group", lambda _trainer: LocalCriticGroup(worker)):
        trainer.init_value_sources()
    trainer.global_steps = global_steps
    return trainer, worker


@pytest.mark.ray
def test_hook_refresh_refits_the_head_to_the_samples_and_a_resumed_run_starts_with_it(
        transfer_queue, policy_dir, critic_dir, bpe_small, worker_env, tmp_path):
    from transfer_queue import KVBatchMeta

    from verl_prm.critic.refresh import refit_value_head
    from verl_prm.labeling.format import read_labels

    tokenizer, events = bpe_small, []
    directory = tmp_path / "refresh"
    trainer, worker = _refresh_trainer(policy_dir, critic_dir, tokenizer, events, directory, global_steps=2)
    rows = _rows(tokenizer)
    keys, tags = _put(transfer_queue, rows)
    refresh = trainer.value_source
    before = refresh.values(_step_batch(trainer, transfer_queue, keys, tags))
    # the refresh step's own values are the PAV's before its refit; its samples are the labels
    metrics = before.metrics
    labels = read_labels(directory / "labels")
    # per response its H - 1 sampled steps and its outcome; per prompt (2) its value, once
    assert len(labels) == len(rows) and metrics["pav/refresh/labels"] == len(rows) * ((H - 1) + 1) + 2
    state_rows, weight, bias = refresh.store.read(2)
    for b, row in enumerate(labels.itertuples()):
        assert row.n_mc[: H - 1] == [N_MC] * (H - 1) and row.n_mc[H - 1] == 0
        assert row.response == tokenizer.decode(rows[b][3], skip_special_tokens=True)
    # the head on the worker is the maximum-likelihood refit of the stored labels
    fit = refit_value_head([state_rows])
    assert torch.allclose(fit.weight, weight) and fit.bias == pytest.approx(bias)
    assert torch.allclose(worker.critic.adapter.head.weight[0].double(), weight, atol=1e-6)
    after = refresh.values(_step_batch(trainer, transfer_queue, keys, tags))
    assert "pav/refresh/labels" in after.metrics  # (still step 2: scored and refreshed again; the head stays the refit's)
    expected = torch.sigmoid(state_rows.features.double() @ weight + bias)
    labelled = torch.ones(len(rows), H + 1, dtype=torch.bool)
    labelled[:, 0] = torch.tensor([b % 3 == 0 for b in range(len(rows))])  # the prompt value: its group's first row
    got = torch.cat([after.prompt_values[:, None], after.step_values[:, :H]], dim=1)[labelled]
    assert torch.allclose(got.double(), expected, atol=2e-4)  # the head runs in fp32
    _, weight, _ = refresh.store.read(2)  # the second refresh of step 2 replaced the first
    assert torch.allclose(worker.critic.adapter.head.weight[0].double(), weight, atol=1e-6)

    # a resumed run at step 3: a fresh worker from the checkpoint, the head of the refresh at step 2
    refresh.store.close()
    resumed, fresh = _refresh_trainer(policy_dir, critic_dir, tokenizer, events, directory, global_steps=3)
    assert not torch.allclose(fresh.critic.adapter.head.weight[0].double(), weight, atol=1e-3)
    metrics = {}
    resumed._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)
    assert not any(key.startswith("pav/refresh/") for key in metrics)  # step 3 is no refresh step
    assert torch.allclose(fresh.critic.adapter.head.weight[0].double(), weight, atol=1e-6)
    resumed.value_source.store.close()
    with pytest.raises(ConfigError, match=r"other settings \(window: 2 -> 3\)"):
        _refresh_trainer(policy_dir, critic_dir, tokenizer, events, directory, global_steps=3,
                         extra=["verl_prm.refresh.window=3"])
    transfer_queue.kv_clear(keys=keys, partition_id="train")


@pytest.mark.ray
def test_hook_refresh_shrinks_the_sampled_labels_toward_the_pav(
        transfer_queue, policy_dir, critic_dir, bpe_small, worker_env, tmp_path):
    """verl_prm.refresh.prior_strength=s under the refresh: a sampled step's label y of t samples becomes
    (t y + s m) / (t + s) with t + s trials, m the PAV's value of the step before the refit; the prompt's and the
    outcome's labels stay (against the same refresh with s = 0: the same samples from a fresh client)."""
    strength = 2.0
    stored = {}
    for s in (0.0, strength):
        trainer, _ = _refresh_trainer(policy_dir, critic_dir, bpe_small, [], tmp_path / f"refresh_{s}", global_steps=2,
                                      extra=[f"verl_prm.refresh.prior_strength={s}"])
        rows = _rows(bpe_small)
        keys, tags = _put(transfer_queue, rows)
        scored = trainer.value_source.values(_step_batch(trainer, transfer_queue, keys, tags))
        stored[s] = trainer.value_source.store.read(2)[0], scored
        trainer.value_source.store.close()
        transfer_queue.kv_clear(keys=keys, partition_id="train")
    (plain, before), (shrunk, _) = stored[0.0], stored[strength]
    # labelled positions in row order: the prompt (its value on its group's first response only), the H - 1 sampled
    # steps, the outcome (every response has H steps)
    labelled = torch.ones(len(rows), H + 1, dtype=torch.bool)
    labelled[:, 0] = torch.tensor([b % 3 == 0 for b in range(len(rows))])
    pav = torch.cat([before.prompt_values[:, None], before.step_values[:, :H]], dim=1)[labelled].double()
    sampled = torch.tensor([False] + [True] * (H - 1) + [False]).expand(len(rows), -1)[labelled]
    assert len(plain.targets) == len(pav) and (plain.trials[sampled] == N_MC).all()
    expected = torch.where(sampled, (plain.trials * plain.targets + strength * pav) / (plain.trials + strength),
                           plain.targets)
    assert torch.allclose(shrunk.targets, expected, atol=1e-6)
    assert torch.equal(shrunk.trials, torch.where(sampled, plain.trials + strength, plain.trials))
