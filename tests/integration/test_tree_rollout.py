"""Tree-shaped groups in verl's loop (verl_prm.critic.source=tree): verl's agent loop pav_tree over a scripted LLM
server client (its n sessions run concurrently, as verl's agent-loop worker runs them), the startup errors, and a
2-step main_ppo on the CPU loop."""

from __future__ import annotations

import asyncio

import pytest
import torch
from verl_support import PLUGIN_OVERRIDES, compose_verl, parity_reward_file

from verl_prm.config.hook import ConfigError, read_hook_config
from verl_prm.integrations.verl.run_config import check_source_settings

N, ROOTS, WIDTH, RESPONSE_LENGTH, STEP_TOKENS = 6, 2, 2, 24, 4
TREE_OVERRIDES = [
    "verl_prm.critic.source=tree", "verl_prm.critic.path=null", "verl_prm.steps.delimiter=null",
    f"verl_prm.steps.max_tokens={STEP_TOKENS}", f"verl_prm.tree.roots={ROOTS}", f"verl_prm.tree.branch_width={WIDTH}",
    f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
    "actor_rollout_ref.rollout.prompt_length=32", "trainer.device=cpu", "data.train_batch_size=2",
    "algorithm.adv_estimator=pav_grpo", "trainer.v1.trainer_mode=pav_sync",
]


class ScriptedServer:
    """verl's ``LLMServerClient.generate`` over a seeded random policy on token ids 5..24: the tokens depend only on
    the prompt ids and how often that prompt was asked for (so any order of calls gives the same tree), EOS (id 2)
    with probability 1/8 per token, cut at ``max_tokens``; log-probs ``-(token % 7) / 4`` unless ``log_probs`` is
    False. Records every request."""

    def __init__(self, log_probs: bool = True):
        self.asked: dict[tuple, int] = {}
        self.requests: list[tuple[str, list[int], dict]] = []
        self.generated = 0
        self.log_probs = log_probs

    def tokens(self, prompt_ids, index: int, max_tokens: int) -> list[int]:
        generator = torch.Generator().manual_seed(hash((tuple(prompt_ids), index)) % (2**31))
        out = []
        while len(out) < max_tokens:
            if torch.rand((), generator=generator) < 1 / 8:
                out.append(2)
                break
            out.append(int(torch.randint(5, 25, (), generator=generator)))
        return out

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        await asyncio.sleep(0)  # let the sessions interleave, as with a real server
        self.requests.append((request_id, list(prompt_ids), dict(sampling_params)))
        key = tuple(prompt_ids)
        index = self.asked.get(key, 0)
        self.asked[key] = index + 1
        ids = self.tokens(prompt_ids, index, int(sampling_params["max_tokens"]))
        self.generated += len(ids)
        log_probs = [-(t % 7) / 4 for t in ids] if self.log_probs else None
        return TokenOutput(token_ids=ids, log_probs=log_probs, extra_fields={"global_steps": 3})


@pytest.fixture
def chat_tokenizer(bpe_small):
    """The test tokenizer with a plain chat template (the agent loop builds prompts through it)."""
    import copy

    tokenizer = copy.deepcopy(bpe_small)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def _agent_loop(config, server, tokenizer):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from verl_prm.integrations.verl.tree_rollout import PavTreeAgentLoop

    return PavTreeAgentLoop(trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tokenizer,
                            processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data))


def _sessions(config, server, tokenizer, uid="prompt-0", n=N):
    """The n sessions of one prompt, run concurrently as verl's AgentLoopWorker._run_prompt runs them."""
    messages = [{"role": "user", "content": "add 3 and 4"}]

    async def run_all():
        loops = [_agent_loop(config, server, tokenizer) for _ in range(n)]
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
        return await asyncio.gather(*[loop.run(dict(params), uid=uid, session_id=i, raw_prompt=messages)
                                      for i, loop in enumerate(loops)])

    return asyncio.run(run_all())


@pytest.mark.parametrize("rule", ["every", "confidence"])
def test_agent_loop_sessions_return_the_leaves_of_one_tree(rule, chat_tokenizer):
    """Session i returns leaf i of the tree ``sample_tree`` samples directly with the same policy; every request of
    the tree shares one sticky request id; every leaf's extra fields say its parent and generated tokens."""
    from verl_prm.trees import sample_tree

    config = compose_verl(PLUGIN_OVERRIDES + TREE_OVERRIDES + [f"verl_prm.tree.branch_rule={rule}"])
    server = ScriptedServer()
    outputs = _sessions(config, server, chat_tokenizer)
    assert {request_id for request_id, _, _ in server.requests} == {"pav-tree-prompt-0"}
    prompt_ids = server.requests[0][1]
    assert all(output.prompt_ids == prompt_ids for output in outputs)

    direct = ScriptedServer()
    hook = read_hook_config(config.verl_prm)

    async def generate(ids, max_tokens):
        output = await direct.generate("x", prompt_ids=ids, sampling_params={"max_tokens": max_tokens})
        return output.token_ids, output.log_probs

    def step_ends(ids):
        split = hook.steps.split(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), chat_tokenizer)
        return [int(e) + 1 for e in split.step_ends[0, : int(split.num_steps[0])]]

    leaves = asyncio.run(sample_tree(generate, prompt_ids, N, hook.tree.shape(), step_ends, RESPONSE_LENGTH))
    assert [output.response_ids for output in outputs] == [leaf.response_ids for leaf in leaves]
    parents = [output.extra_fields["pav_tree_parent"] for output in outputs]
    assert parents == [-1 if leaf.parent is None else leaf.parent for leaf in leaves]
    assert parents[:ROOTS] == [-1] * ROOTS and all(p >= 0 for p in parents[ROOTS:])
    for output, leaf in zip(outputs, leaves):
        assert output.extra_fields["pav_tree_generated_tokens"] == len(leaf.response_ids) - leaf.fork_tokens
        assert output.extra_fields["min_global_steps"] == 3
        parent = output.extra_fields["pav_tree_parent"]
        if parent >= 0:  # a branch shares its parent's tokens up to the fork
            fork = output.extra_fields["pav_tree_fork_tokens"]
            assert output.response_ids[:fork] == outputs[parent].response_ids[:fork]
    # the generated tokens are the tree's: each shared prefix generated once
    assert server.generated == sum(o.extra_fields["pav_tree_generated_tokens"] for o in outputs)
    assert server.generated < sum(len(o.response_ids) for o in outputs)


def test_confidence_branching_without_log_probs_is_an_error(chat_tokenizer):
    config = compose_verl(PLUGIN_OVERRIDES + TREE_OVERRIDES + ["verl_prm.tree.branch_rule=confidence"])
    with pytest.raises(Exception) as error:
        _sessions(config, ScriptedServer(log_probs=False), chat_tokenizer)
    assert "confidence" in str(error.value) and "log" in str(error.value)


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.n=5"),
    ("actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.n=1"),
    ("actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.n=2"),  # n = roots: a branch budget of 0
    ("actor_rollout_ref.rollout.max_model_len=40",
     "actor_rollout_ref.rollout.max_model_len=40 cannot take a step prefix of a full-length response: "
     "verl_prm.critic.source=tree"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=pav_tree",
     "actor_rollout_ref.rollout.agent.default_agent_loop=pav_tree would sample the validation groups as trees"),
])
def test_tree_run_errors_name_the_key(override, message):
    from verl_prm.integrations.verl.run_config import check_tree_run

    config = compose_verl(PLUGIN_OVERRIDES + TREE_OVERRIDES + [override])
    with pytest.raises(ConfigError) as error:
        check_tree_run(config, read_hook_config(config.verl_prm))
    assert message in str(error.value)


def test_tree_run_passes_the_startup_check_without_those_overrides():
    from verl_prm.integrations.verl.run_config import check_tree_run

    config = compose_verl(PLUGIN_OVERRIDES + TREE_OVERRIDES)
    check_tree_run(config, read_hook_config(config.verl_prm))


@pytest.mark.parametrize("section, message", [
    ({"critic": {"source": "tree", "path": "/x"}}, "verl_prm.critic.path='/x' is unused with verl_prm.critic.source=tree"),
    ({"critic": {"source": "tree"}, "placement": {"pool": "own"}}, "verl_prm.placement.pool=own is unused"),
    ({"critic": {"source": "tree", "group_prior_strength": float("nan")}},
     "verl_prm.critic.group_prior_strength must be >= 0 (a finite number), got nan"),
    ({"critic": {"format": "tree"}}, "verl_prm.critic.format=tree is no checkpoint format: the value source is a "
                                     "setting of its own now: set verl_prm.critic.source=tree"),
    ({"critic": {"source": "tree", "success_threshold": float("inf")}},
     "verl_prm.critic.success_threshold must be a finite number"),
    ({"tree": {"roots": 0}}, "verl_prm.tree.roots must be an integer >= 1, got 0"),
    ({"tree": {"branch_width": 0}}, "verl_prm.tree.branch_width must be an integer >= 1, got 0"),
    ({"tree": {"branch_rule": "often"}}, "verl_prm.tree.branch_rule must be one of ('every', 'fixed', 'confidence')"),
])
def test_tree_section_errors_name_the_key(section, message):
    with pytest.raises(ConfigError) as error:
        check_source_settings(read_hook_config(section))
    assert message in str(error.value)


def test_tree_run_refuses_data_its_default_scorer_cannot_score(tmp_path):
    """A reward that cannot score a leaf: without a custom reward function, a data_source verl's default scorer
    does not know stops the run at startup."""
    import pandas as pd

    from verl_prm.integrations.verl.run_config import check_tree_run

    path = tmp_path / "train.parquet"
    pd.DataFrame({"data_source": ["my_task"], "prompt": [[{"role": "user", "content": "1+1"}]]}).to_parquet(path)
    config = compose_verl(PLUGIN_OVERRIDES + TREE_OVERRIDES + [f"data.train_files={path}"])
    with pytest.raises(ConfigError) as error:
        check_tree_run(config, read_hook_config(config.verl_prm))
    assert "'my_task'" in str(error.value) and "reward.custom_reward_function" in str(error.value)


# ---------------------------------------------------------------------------------------------- main_ppo on CPU


@pytest.fixture(scope="module")
def tree_loop_run(tmp_path_factory):
    """verl's main_ppo for 2 steps on the CPU loop (hf rollout) with tree-shaped groups: 4 leaves per prompt,
    2 roots and one branch point of 2 continuations, PAV-GRPO on the node values."""
    from verl_prm.apps.cpu_loop import main_ppo_args, prepare, run_main_ppo

    work = tmp_path_factory.mktemp("tree_loop")
    prepare(work)
    reward = parity_reward_file(work)
    args = main_ppo_args(work, "pav_grpo", steps=2, run_name="pav_grpo_tree", extra=[
        "verl_prm.critic.source=tree", "verl_prm.critic.path=null", "verl_prm.tree.roots=2",
        "verl_prm.tree.branch_width=2", "verl_prm.tree.branch_rule=confidence",
        "actor_rollout_ref.rollout.calculate_log_probs=True", f"reward.custom_reward_function.path={reward}"])
    return run_main_ppo(args, work / "tree.jsonl", work / "tree.log", timeout=600)


@pytest.mark.slow
def test_main_ppo_two_steps_with_tree_groups_on_cpu(tree_loop_run):
    result = tree_loop_run
    assert result.returncode == 0, f"main_ppo exited {result.returncode}; log tail:\n{result.tail()}"
    records = {record["step"]: record["data"] for record in result.metrics}
    assert sorted(records) == [1, 2], f"logged steps {sorted(records)}; log tail:\n{result.tail()}"
    for step, metrics in records.items():
        assert metrics["pav/tree_groups"] == 4, f"step {step}: {metrics['pav/tree_groups']} trees"
        # 4 prompts x (2 roots + 2 branch leaves), unless a prompt fell back to extra roots
        assert metrics["pav/tree_branch_leaves"] == 8 - 2 * metrics["pav/tree_fallback_groups"]
        assert metrics["pav/tree_generated_tokens"] == (metrics["pav/tree_root_tokens"]
                                                        + metrics["pav/tree_branch_tokens"])
        # every leaf is trained on: verl's own count of the batch's response tokens (16 responses)
        trained = metrics["response_length/mean"] * 16
        assert metrics["pav/tree_trained_tokens"] == pytest.approx(trained, rel=1e-5)
        # the shared prefixes are generated once: fewer generated than trained tokens when a branch happened
        if metrics["pav/tree_branch_leaves"] > 0:
            assert metrics["pav/tree_generated_share"] < 1.0
        assert 0.0 < metrics["pav/v0_mean"] < 1.0, f"step {step}: v0 {metrics['pav/v0_mean']}"
        assert metrics["actor/grad_norm"] > 0, f"step {step}: actor grad norm {metrics['actor/grad_norm']}"
        # validation is not sampled as trees: no tree metric under val-core; the training generation was timed
        assert metrics["timing_s/gen"] > 0


# ---------------------------------------------------------------------------------------------- node values in the hook


def _tree_batch(tokenizer):
    """Two prompts' trees as the hook reads them: prompt a has roots 0, 1 and leaves 2, 3 branched from root 0 after
    its first step (2 tokens, steps of 2 tokens); prompt b one root and a padding row."""
    from verl_prm.config.hook import StepsSection
    from verl_prm.integrations.verl.step_batch import StepBatch

    responses = [[5, 6, 7, 8, 2], [9, 9, 9, 2, 0], [5, 6, 10, 2, 0], [5, 6, 11, 12, 2], [7, 7, 2, 0, 0],
                 [0, 0, 0, 0, 0]]
    lengths = torch.tensor([5, 4, 4, 5, 3, 0])
    ids = torch.tensor(responses)
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    split = StepsSection(delimiter=None, max_tokens=2).split(ids, mask, tokenizer)
    fields = [{"pav_tree_parent": -1, "pav_tree_generated_tokens": 5}, {"pav_tree_parent": -1, "pav_tree_generated_tokens": 4},
              {"pav_tree_parent": 0, "pav_tree_generated_tokens": 2}, {"pav_tree_parent": 0, "pav_tree_generated_tokens": 3},
              {"pav_tree_parent": -1, "pav_tree_generated_tokens": 3}, {}]
    return StepBatch(
        keys=[f"k{i}" for i in range(6)], step=1, real_rows=torch.tensor([True] * 5 + [False]),
        prompts=torch.ones(6, 2, dtype=torch.long), prompt_mask=torch.ones(6, 2, dtype=torch.long), responses=ids,
        response_lengths=lengths, response_mask=mask, split=split, truncated=torch.zeros(6, dtype=torch.bool),
        outcomes=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), uids=["a", "a", "a", "a", "b", "b"], agent_fields=fields)


@pytest.mark.parametrize("strength", [0.0, 2.0])
def test_tree_node_values_are_the_mean_outcome_of_the_leaves_below(strength, bpe_small):
    """Written out for the tree of _tree_batch: the node after root 0's first step ([5, 6]) has leaves 0, 2, 3
    (outcomes 1, 1, 0), every deeper node of prompt a one leaf; shrunk: (k + s v_0) / (L + s)."""
    from verl_prm.integrations.verl.value_sources import TreeNodeValues

    batch = _tree_batch(bpe_small)
    values = TreeNodeValues(0.5, roots=2, prior_strength=strength).values(batch)
    v0 = 2 / 4

    def node(k, leaves):
        return (k + strength * v0) / (leaves + strength)

    assert values.prompt_values[:5].tolist() == [v0] * 4 + [1.0]
    assert batch.split.num_steps.tolist()[:5] == [3, 2, 2, 3, 2]
    expected = {0: [node(2, 3), node(1, 1), node(1, 1)], 1: [node(0, 1), node(0, 1)], 2: [node(2, 3), node(1, 1)],
                3: [node(2, 3), node(0, 1), node(0, 1)]}
    for row, want in expected.items():
        assert values.step_values[row, : len(want)].tolist() == pytest.approx(want), row
    assert values.leaf_counts[0, :3].tolist() == [3, 1, 1] and values.leaf_counts[1, :2].tolist() == [1, 1]
    metrics = values.metrics
    assert metrics["pav/tree_generated_tokens"] == 17 and metrics["pav/tree_root_tokens"] == 12
    assert metrics["pav/tree_branch_tokens"] == 5 and metrics["pav/tree_branch_leaves"] == 2
    assert metrics["pav/tree_trained_tokens"] == 21 and metrics["pav/tree_generated_share"] == pytest.approx(17 / 21)
    # prompt b has 1 root with roots=2 expected: not a fallback (fewer roots than asked is no extra root)
    assert metrics["pav/tree_groups"] == 2 and metrics["pav/tree_fallback_groups"] == 0


def test_tree_node_values_refuse_responses_the_tree_agent_loop_did_not_sample(bpe_small):
    import dataclasses

    from verl_prm.integrations.verl.value_sources import TreeNodeValues

    batch = _tree_batch(bpe_small)
    batch = dataclasses.replace(batch, agent_fields=[{}] + batch.agent_fields[1:])
    with pytest.raises(RuntimeError, match=r"responses \['k0'\] were not sampled by the tree agent loop"):
        TreeNodeValues(0.5, roots=2).values(batch)
