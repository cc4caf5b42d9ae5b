"""Tree-shaped groups (verl_prm.trees): sampling, node values, the tree estimators and the loss over shared prefixes.

References, written as plain loops over the tree from what the papers define and their code does:

* node value = mean outcome of the leaves below the node: SPO-tree (Guo et al. 2025, "Segment Policy Optimization",
  https://github.com/AIFrameResearch/SPO, ``hybrid_inference_strategy._construct_tree``: ``node["reward"] =
  np.mean(child_rewards)``, which is the mean over its leaves in the balanced trees it samples) and TreeRL (Hou et al.
  2025, https://github.com/THUDM/TreeRL, ``tree_node.py``: ``accumulated_value / terminal_in_subtree``);
* SPO-tree's segment advantage ``V(child) - V(parent)`` (``tree_episode_generator.extract_edges_from_tree``,
  adv_method rloo); TreeRL's ``(GA + LA) / sqrt(|L(n)|)``, GA = V(n) - V(root), LA = V(n) - V(parent)
  (arXiv 2506.11902);
* the loss: TreeRL trains one sample per leaf (``parallel_mcts.gather_paths``: a path from the root to each leaf),
  which is how verl's batch holds a tree (each leaf a row); the test checks that the gradient of verl's own policy
  loss over those rows equals that of a loop over the tree's nodes in which each token appears once with the summed
  advantage of the leaves through it.

The scripted policy: a response is H steps ``[d, f, SEP]`` and then EOS; the decision token d is RIGHT with
probability p_h (else WRONG), f a random filler id (so two independently sampled steps never coincide), and the
outcome is 1 iff every decision is RIGHT and the response is complete. Each request is seeded by (its token ids,
how many times those ids were asked for), so a tree and a loop that make the same requests get the same tokens in
any order of completion.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from omegaconf import OmegaConf

from verl_prm.estimators import ESTIMATORS, TREE_ESTIMATORS, MissingStepTensorsError
from verl_prm.trees import Leaf, TreeShape, sample_tree, tree_step_advantages, tree_step_values

SEP, EOS, RIGHT, WRONG = 0, 9, 1, 2
PROMPT = [100, 101, 102]


def step_ends(response) -> list[int]:
    return [t + 1 for t, token in enumerate(response) if token == SEP]


class ScriptedPolicy:
    """The seeded scripted policy (module docstring); ``log_probs=False`` makes a rollout that returns none."""

    def __init__(self, steps: int, seed: int = 0, log_probs: bool = True, p_right=(0.9, 0.5, 0.7, 0.8, 0.6)):
        self.steps, self.seed, self.log_probs, self.p_right = steps, seed, log_probs, p_right
        self.asked: dict[tuple, int] = {}

    def sample(self, ids: list[int], max_tokens: int):
        key = tuple(ids)
        count = self.asked.get(key, 0)
        self.asked[key] = count + 1
        rng = random.Random(f"{self.seed}|{key}|{count}")
        done = list(ids[len(PROMPT):]).count(SEP)
        tokens, log_probs = [], []
        while len(tokens) < max_tokens:
            if done == self.steps:
                tokens.append(EOS)
                log_probs.append(0.0)
                break
            p = self.p_right[done % len(self.p_right)]
            right = rng.random() < p
            step = [RIGHT if right else WRONG, rng.randrange(10, 10**6), SEP]
            probs = [math.log(p if right else 1 - p), -math.log(10**6 - 10), 0.0]
            room = max_tokens - len(tokens)
            tokens += step[:room]
            log_probs += probs[:room]
            done += 1
        return tokens, (log_probs if self.log_probs else None)

    async def generate(self, ids: list[int], max_tokens: int):
        output = self.sample(ids, max_tokens)  # seeded at the call, before any await
        for _ in range(random.Random(f"delay|{tuple(ids)}").randrange(4)):
            await asyncio.sleep(0)  # completions in another order than the requests
        return output


def success(response) -> float:
    decisions = response[0::3][: response.count(SEP)]
    return float(bool(response) and response[-1] == EOS and all(d == RIGHT for d in decisions))


def _reference_tree(policy: ScriptedPolicy, n: int, shape: TreeShape, limit: int) -> list[dict]:
    """The tree written out as a plain sequential loop over rounds (verl_prm.trees docstring), same requests."""
    m, b, k = shape.roots, shape.branch_width, shape.branches_per_response
    leaves = []
    for _ in range(m):
        tokens, lps = policy.sample(PROMPT, limit)
        leaves.append(dict(tokens=tokens, lps=lps, parent=None, fork=0, step=None, fallback=False))
    budget, done, first_round = (n - m) // b, set(), True
    while budget > 0:
        per_leaf = {}
        for i, leaf in enumerate(leaves):
            if shape.branch_rule == "fixed" and (leaf["parent"] is not None or not first_round):
                continue
            ends = step_ends(leaf["tokens"])
            per_leaf[i] = [h for h in range(len(ends) - 1)
                           if leaf["fork"] < ends[h] < limit and (i, h) not in done]
        if shape.branch_rule == "fixed":
            chosen = []
            for i, steps in per_leaf.items():
                count = len(steps)
                chosen += [(i, h) for h in steps] if count <= k else [(i, steps[((j + 1) * count) // (k + 1)])
                                                                      for j in range(k)]
        else:
            chosen = [(i, h) for i, steps in per_leaf.items() for h in steps]
            if shape.branch_rule == "every":
                chosen.sort(key=lambda c: (c[1], c[0]))
            else:
                chosen.sort(key=lambda c: (leaves[c[0]]["lps"][step_ends(leaves[c[0]]["tokens"])[c[1]]], c[1], c[0]))
        chosen = chosen[:budget]
        first_round = False
        if not chosen:
            break
        for i, h in chosen:
            done.add((i, h))
            end = step_ends(leaves[i]["tokens"])[h]
            for _ in range(b):
                tokens, lps = policy.sample(PROMPT + leaves[i]["tokens"][:end], limit - end)
                joined = None if lps is None else leaves[i]["lps"][:end] + lps
                leaves.append(dict(tokens=leaves[i]["tokens"][:end] + tokens, lps=joined, parent=i, fork=end, step=h,
                                   fallback=False))
        budget -= len(chosen)
    for _ in range(budget * b):
        tokens, lps = policy.sample(PROMPT, limit)
        leaves.append(dict(tokens=tokens, lps=lps, parent=None, fork=0, step=None, fallback=True))
    return leaves


def _tree(policy, n, shape, limit=64) -> list[Leaf]:
    return asyncio.run(sample_tree(policy.generate, PROMPT, n, shape, step_ends, limit, label="prompt 0"))


def _as_dicts(leaves: list[Leaf]) -> list[dict]:
    return [dict(tokens=leaf.response_ids, lps=leaf.log_probs, parent=leaf.parent, fork=leaf.fork_tokens,
                 step=leaf.fork_step, fallback=leaf.fallback_root) for leaf in leaves]


# ----------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, n", [
    (TreeShape(roots=2, branch_width=2, branch_rule="every"), 10),
    (TreeShape(roots=1, branch_width=3, branch_rule="every"), 13),
    (TreeShape(roots=2, branch_width=2, branch_rule="fixed", branches_per_response=2), 10),
    (TreeShape(roots=3, branch_width=1, branch_rule="fixed", branches_per_response=1), 6),
    (TreeShape(roots=2, branch_width=2, branch_rule="confidence"), 12),
    (TreeShape(roots=4, branch_width=4, branch_rule="confidence"), 8),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_tree_equals_a_plain_loop(shape, n, seed):
    leaves = _tree(ScriptedPolicy(steps=4, seed=seed), n, shape)
    assert len(leaves) == n
    assert _as_dicts(leaves) == _reference_tree(ScriptedPolicy(steps=4, seed=seed), n, shape, 64)
    for i, leaf in enumerate(leaves):  # every branch continues its parent's prefix up to a step end of the parent
        if leaf.parent is not None:
            parent = leaves[leaf.parent]
            assert leaf.parent < i and leaf.response_ids[: leaf.fork_tokens] == parent.response_ids[: leaf.fork_tokens]
            assert step_ends(parent.response_ids)[leaf.fork_step] == leaf.fork_tokens
            assert leaf.log_probs[: leaf.fork_tokens] == parent.log_probs[: leaf.fork_tokens]
        assert leaf.generated_tokens == len(leaf.response_ids) - leaf.fork_tokens


def test_every_branches_breadth_first_and_fixed_spaces_the_branch_points_evenly():
    # every, m = 2, b = 2, r = 3, H = 3: the candidates are (root, step) for steps 0 and 1; breadth-first takes
    # (0, 0), (1, 0), (0, 1)
    leaves = _tree(ScriptedPolicy(steps=3), 8, TreeShape(roots=2, branch_width=2, branch_rule="every"))
    assert [leaf.parent for leaf in leaves] == [None, None, 0, 0, 1, 1, 0, 0]
    assert [leaf.fork_step for leaf in leaves] == [None, None, 0, 0, 0, 0, 1, 1]
    # fixed, k = 1 of the C = 3 candidates (steps 0, 1, 2 of H = 4): c_floor(1 * 3 / 2) = step 1 of each root
    leaves = _tree(ScriptedPolicy(steps=4), 6, TreeShape(roots=2, branch_width=2, branch_rule="fixed"))
    assert [leaf.parent for leaf in leaves] == [None, None, 0, 0, 1, 1]
    assert [leaf.fork_step for leaf in leaves] == [None, None, 1, 1, 1, 1]


def test_confidence_branches_where_the_policy_was_least_sure():
    shape = TreeShape(roots=3, branch_width=2, branch_rule="confidence")
    leaves = _tree(ScriptedPolicy(steps=4, seed=5), 7, shape)  # one round of 2 points among 9 candidates
    after = {(i, h): leaves[i].log_probs[step_ends(leaves[i].response_ids)[h]] for i in range(3) for h in range(3)}
    chosen = {(leaf.parent, leaf.fork_step) for leaf in leaves[3:]}
    assert len(chosen) == 2
    assert max(after[point] for point in chosen) <= min(after[point] for point in after if point not in chosen)


def test_no_branch_point_left_falls_back_to_independent_roots():
    """One-step responses have no boundary to continue after: the budget's leaves become extra roots, flagged."""
    for rule in ("every", "confidence"):
        leaves = _tree(ScriptedPolicy(steps=1), 7, TreeShape(roots=3, branch_width=2, branch_rule=rule))
        assert [leaf.parent for leaf in leaves] == [None] * 7
        assert [leaf.fallback_root for leaf in leaves] == [False] * 3 + [True] * 4
        assert _as_dicts(leaves) == _reference_tree(ScriptedPolicy(steps=1), 7, TreeShape(3, 2, rule), 64)
    # a response limit that leaves no room after the first step (6 tokens: 2 steps) is no candidate either
    leaves = _tree(ScriptedPolicy(steps=3), 4, TreeShape(roots=2, branch_width=2, branch_rule="every"), limit=6)
    assert [leaf.parent for leaf in leaves] == [None, None, 0, 0]  # step 0 (end 3) only: end 6 has no room
    assert all(len(leaf.response_ids) <= 6 for leaf in leaves)


@pytest.mark.parametrize("shape, n, message", [
    (TreeShape(roots=4, branch_width=2, branch_rule="every"), 3, r"rollout n=3 is fewer leaves than roots=4"),
    (TreeShape(roots=2, branch_width=3, branch_rule="every"), 7,
     r"n - roots = 5 is not a multiple of branch_width=3; use n = roots \+ r \* branch_width \(e.g. 5 or 8\)"),
    (TreeShape(roots=4, branch_width=2, branch_rule="every"), 4, r"branch budget of 0: the group would be plain GRPO"),
    (TreeShape(roots=2, branch_width=2, branch_rule="fixed", branches_per_response=2), 8,
     r"makes roots x \(1 \+ branches_per_response x branch_width\) = 10 leaves, but rollout n=8"),
])
def test_an_unreachable_group_size_names_the_keys(shape, n, message):
    with pytest.raises(ValueError, match=message):
        shape.branch_points(n)
    with pytest.raises(ValueError, match=message):
        _tree(ScriptedPolicy(steps=3), n, shape)


@pytest.mark.parametrize("kwargs, message", [
    (dict(roots=0, branch_width=2, branch_rule="every"), "roots .* integer >= 1, got 0"),
    (dict(roots=1, branch_width=True, branch_rule="every"), "branch_width .* integer >= 1, got True"),
    (dict(roots=1, branch_width=2, branch_rule="fixed", branches_per_response=0), "branches_per_response"),
    (dict(roots=1, branch_width=2, branch_rule="entropy"), "branch_rule must be one of"),
])
def test_a_bad_shape_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TreeShape(**kwargs)


def test_confidence_without_log_probs_is_an_error_naming_the_leaf_and_the_fix():
    shape = TreeShape(roots=2, branch_width=2, branch_rule="confidence")
    with pytest.raises(ValueError, match="prompt 0, leaf 0: branch_rule confidence reads the rollout's log-prob.*"
                                         "enable the rollout's log-probs or use branch_rule every or fixed"):
        _tree(ScriptedPolicy(steps=3, log_probs=False), 6, shape)
    # the other rules need none
    leaves = _tree(ScriptedPolicy(steps=3, log_probs=False), 6, TreeShape(2, 2, "every"))
    assert all(leaf.log_probs is None for leaf in leaves)


def test_confidence_with_a_nan_log_prob_is_an_error_naming_the_request_and_the_fix():
    """A NaN key would sort anywhere (every comparison with NaN is False): the branch points would be wherever the
    candidate list put them. Leaf 1's root request returns a bad log-prob for the token after its first step."""
    policy = ScriptedPolicy(steps=3, seed=1)

    async def generate(ids, max_tokens):
        tokens, log_probs = policy.sample(ids, max_tokens)
        if len(ids) == len(PROMPT) and policy.asked[tuple(ids)] == 2:  # the second root
            log_probs = list(log_probs)
            log_probs[step_ends(tokens)[0]] = float("nan")
        return tokens, log_probs

    shape = TreeShape(roots=2, branch_width=2, branch_rule="confidence")
    with pytest.raises(ValueError, match=r"prompt 0, leaf 1: branch_rule confidence reads the log-prob of the token "
                                         r"after step 0 \(response token 3\), and its root request returned NaN, "
                                         r"which has no order: fix the rollout's log-probs .* or use branch_rule "
                                         "every or fixed"):
        asyncio.run(sample_tree(generate, PROMPT, 6, shape, step_ends, 64, label="prompt 0"))


def test_a_rollout_or_step_rule_that_breaks_the_contract_is_an_error():
    async def too_long(ids, max_tokens):
        return [1] * (max_tokens + 1), None

    with pytest.raises(RuntimeError, match=r"prompt 0, root 0: the rollout returned 9 tokens for max_tokens=8"):
        asyncio.run(sample_tree(too_long, PROMPT, 4, TreeShape(2, 2, "every"), step_ends, 8, label="prompt 0"))

    async def short_log_probs(ids, max_tokens):
        return [1, SEP, 1, SEP], [0.0]

    with pytest.raises(RuntimeError, match="1 log-probs for 4 tokens"):
        asyncio.run(sample_tree(short_log_probs, PROMPT, 4, TreeShape(2, 2, "every"), step_ends, 8))
    policy = ScriptedPolicy(steps=3)
    with pytest.raises(ValueError, match=r"prompt, leaf 0: step_ends must be strictly ascending ends in \(0, 10\]"):
        asyncio.run(sample_tree(policy.generate, PROMPT, 4, TreeShape(2, 2, "every"), lambda r: [3, 3], 64))


# ----------------------------------------------------------------------------------------------------------
# Node values
# ----------------------------------------------------------------------------------------------------------


def _leaves_below(leaves: list[Leaf], i: int, e: int) -> set[int]:
    """The leaves below the node "leaf i's first e response tokens", from the tree's structure alone: when the node
    lies in the part i shares with its parent it is the parent's node; else it is i and, for each child forked from
    i at or after e tokens, the leaves below that child's same node."""
    while leaves[i].parent is not None and e <= leaves[i].fork_tokens:
        i = leaves[i].parent

    def subtree(owner: int) -> set[int]:
        below = {owner}
        for j, leaf in enumerate(leaves):
            if leaf.parent == owner and leaf.fork_tokens >= e:
                below |= subtree(j)
        return below

    return subtree(i)


def _scripted_forest(seeds=(0, 1, 2), n=10, shape=TreeShape(roots=2, branch_width=2, branch_rule="every")):
    """Rows of several trees, interleaved: (group id, leaf, its tree, its index in the tree)."""
    trees = [_tree(ScriptedPolicy(steps=4, seed=seed), n, shape) for seed in seeds]
    rows = [(f"uid{g}", tree[i], tree, i) for i in range(n) for g, tree in enumerate(trees)]
    return rows


def test_tree_step_values_equal_a_loop_over_the_tree_structure():
    rows = _scripted_forest()
    groups = [g for g, *_ in rows]
    responses = [leaf.response_ids for _, leaf, *_ in rows]
    outcomes = [success(r) for r in responses]
    values, counts, prompt_values, *_ = tree_step_values(groups, responses, [step_ends(r) for r in responses],
                                                         outcomes)
    assert values.dtype == torch.float32 and counts.dtype == torch.int64 and values.shape == (len(rows), 4)
    for b, (group, leaf, tree, i) in enumerate(rows):
        tree_outcomes = [success(other.response_ids) for other in tree]
        assert prompt_values[b].item() == pytest.approx(sum(tree_outcomes) / len(tree))
        ends = step_ends(leaf.response_ids)
        for h in range(4):
            if h >= len(ends):
                assert values[b, h] == 0 and counts[b, h] == 0  # padding
                continue
            below = _leaves_below(tree, i, ends[h])
            assert counts[b, h].item() == len(below)
            assert values[b, h].item() == pytest.approx(sum(tree_outcomes[j] for j in below) / len(below))
        if leaf.response_ids[-1] == EOS:  # a leaf's last node: itself alone (no two leaves are equal here)
            assert counts[b, len(ends) - 1] == 1 and values[b, len(ends) - 1] == success(leaf.response_ids)


def test_equal_prefixes_of_independent_roots_are_one_node_and_groups_stay_apart():
    responses = [[1, SEP, 1, SEP, EOS], [1, SEP, 2, SEP, EOS], [1, SEP, 1, SEP, EOS], [1, SEP, EOS]]
    groups = ["a", "a", "a", "b"]
    values, counts, prompt_values, *_ = tree_step_values(groups, responses, [step_ends(r) for r in responses],
                                                     torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert counts.tolist() == [[3, 2], [3, 1], [3, 2], [1, 0]]
    torch.testing.assert_close(values, torch.tensor([[2 / 3, 1.0], [2 / 3, 0.0], [2 / 3, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(prompt_values, torch.tensor([2 / 3, 2 / 3, 2 / 3, 1.0]))
    # each response's own node: rows 0 and 2 are the same leaf (two leaves below it); an empty response (a padding
    # row) is its own outcome, one leaf
    tree = tree_step_values(groups + ["c"], responses + [[]], [step_ends(r) for r in responses] + [[]],
                            torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]))
    assert tree.response_leaf_counts.tolist() == [2, 1, 2, 1, 1]
    torch.testing.assert_close(tree.response_values, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]))
    # a wider step tensor: the same nodes, then "no node" (count 0, value 0) columns
    wide_values, wide_counts, *_ = tree_step_values(groups, responses, [step_ends(r) for r in responses],
                                                   torch.tensor([1.0, 0.0, 1.0, 1.0]), width=4)
    assert wide_counts.tolist() == [row + [0, 0] for row in counts.tolist()]
    torch.testing.assert_close(wide_values[:, :2], values)
    assert not wide_values[:, 2:].any()


def test_tree_step_values_reject_bad_rows():
    with pytest.raises(ValueError, match=r"row 1: outcome 2.0 is not in \[0, 1\]"):
        tree_step_values(["a", "a"], [[1, SEP], [1, SEP]], [[2], [2]], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"row 0: step_ends must be strictly ascending ends in \(0, 2\]"):
        tree_step_values(["a"], [[1, SEP]], [[3]], [1.0])
    with pytest.raises(ValueError, match="2 group ids, 1 responses"):
        tree_step_values(["a", "b"], [[1]], [[1]], [1.0])
    with pytest.raises(ValueError, match="width 1 is below the 2 steps of a row"):
        tree_step_values(["a"], [[1, SEP, 2, SEP]], [[2, 4]], [1.0], width=1)


# ----------------------------------------------------------------------------------------------------------
# The tree estimators
# ----------------------------------------------------------------------------------------------------------


def _batch(groups, responses, outcomes):
    """verl's tensors of the leaves (right-padded), their step tensors and the node values."""
    width = max(len(r) for r in responses)
    ends = [step_ends(r) for r in responses]
    tree = tree_step_values(groups, responses, ends, outcomes)
    mask = torch.zeros(len(responses), width)
    step_ids = torch.full((len(responses), width), -1, dtype=torch.long)
    rewards = torch.zeros(len(responses), width)
    for b, response in enumerate(responses):
        mask[b, : len(response)] = 1
        start = 0
        for h, end in enumerate(ends[b]):
            step_ids[b, start:end] = h
            start = end
        rewards[b, len(response) - 1] = outcomes[b]
    return dict(token_level_rewards=rewards, response_mask=mask, index=list(groups), step_ids=step_ids,
                step_values=tree.step_values, prompt_values=tree.prompt_values,
                num_steps=torch.tensor([len(e) for e in ends]), leaf_counts=tree.leaf_counts,
                response_values=tree.response_values, response_leaf_counts=tree.response_leaf_counts)


def _reference_advantages(rule: str, rows, outcomes) -> list[list[float]]:
    """Per token of each leaf, from the tree's structure: the node of each step, its leaf set, its segment (the
    steps with the same leaf set) and the segment's parent (the node before it; the prompt for the first); tokens
    after the last step (EOS) belong to the leaf's last node."""
    result = []
    for (group, leaf, tree, i), _ in zip(rows, outcomes):
        tree_outcomes = [success(other.response_ids) for other in tree]
        root = sum(tree_outcomes) / len(tree)
        ends = step_ends(leaf.response_ids)
        sets = [_leaves_below(tree, i, e) for e in ends]
        value = [sum(tree_outcomes[j] for j in s) / len(s) for s in sets]
        step_advantage = []
        for h in range(len(ends)):
            before = [k for k in range(h) if sets[k] != sets[h]]
            parent = value[before[-1]] if before else root
            local = value[h] - parent
            step_advantage.append(local if rule == "spo_tree" else (value[h] - root + local) / math.sqrt(len(sets[h])))
        tokens = []
        for t in range(len(leaf.response_ids)):
            in_step = [h for h, end in enumerate(ends) if t < end]
            tokens.append(step_advantage[in_step[0]] if in_step else step_advantage[-1])
        result.append(tokens)
    return result


CONFIG = OmegaConf.create({"adv_estimator": "tree_rl", "pav": {}})


@pytest.mark.parametrize("rule", TREE_ESTIMATORS)
@pytest.mark.parametrize("shape", [TreeShape(2, 2, "every"), TreeShape(1, 3, "confidence"), TreeShape(3, 1, "fixed")])
def test_tree_estimators_equal_a_loop_over_the_tree(rule, shape):
    n = {"every": 10, "confidence": 10, "fixed": 6}[shape.branch_rule]
    rows = _scripted_forest(seeds=(3, 4, 5, 6), n=n, shape=shape)
    responses = [leaf.response_ids for _, leaf, *_ in rows]
    outcomes = [success(r) for r in responses]
    batch = _batch([g for g, *_ in rows], responses, outcomes)
    advantages, returns = ESTIMATORS[rule](**batch, config=CONFIG)
    expected = _reference_advantages(rule, rows, outcomes)
    for b, row in enumerate(expected):
        torch.testing.assert_close(advantages[b, : len(row)], torch.tensor(row), atol=1e-6, rtol=1e-6)
        assert torch.all(advantages[b, len(row):] == 0)
    assert torch.equal(returns, advantages)


def test_tree_estimators_on_a_tree_worked_by_hand():
    """Leaves [R, S] R, [R, S] W, [W, S] R (two steps each, then EOS); leaf 1 branched from leaf 0 after step 0;
    outcomes 1, 0, 0. V(root) = 1/3; node [R, S]: leaves {0, 1}, V = 1/2; leaf 0's second node V = 1, leaf 1's 0;
    leaf 2 is one segment (both its nodes hold leaf 2 alone), V = 0.
    SPO-tree: leaf 0: 1/2 - 1/3 = 1/6, then 1 - 1/2 = 1/2; leaf 1: 1/6, then -1/2; leaf 2: -1/3, -1/3.
    TreeRL: leaf 0: (1/6 + 1/6) / sqrt(2), then (2/3 + 1/2) / 1; leaf 1: (1/3) / sqrt(2), then (-1/3 - 1/2);
    leaf 2: (-1/3 - 1/3) for both steps."""
    responses = [[RIGHT, SEP, RIGHT, SEP, EOS], [RIGHT, SEP, WRONG, SEP, EOS], [WRONG, SEP, RIGHT, SEP, EOS]]
    batch = _batch(["a"] * 3, responses, [1.0, 0.0, 0.0])
    spo, _ = ESTIMATORS["spo_tree"](**batch, config=CONFIG)
    torch.testing.assert_close(spo, torch.tensor([[1 / 6] * 2 + [1 / 2] * 3, [1 / 6] * 2 + [-1 / 2] * 3,
                                                  [-1 / 3] * 5]))
    tree_rl, _ = ESTIMATORS["tree_rl"](**batch, config=CONFIG)
    first = (1 / 3) / math.sqrt(2)
    torch.testing.assert_close(tree_rl, torch.tensor([[first] * 2 + [7 / 6] * 3, [first] * 2 + [-5 / 6] * 3,
                                                      [-2 / 3] * 5]))


def _issue_batch(groups, responses, rewards, threshold=0.0):
    """As the hook builds it: verl's raw rewards in token_level_rewards, the node values from the successes
    (reward > verl_prm.critic.success_threshold)."""
    batch = _batch(groups, responses, [float(r > threshold) for r in rewards])
    batch["token_level_rewards"] = torch.zeros_like(batch["token_level_rewards"])
    for b, (response, reward) in enumerate(zip(responses, rewards)):
        batch["token_level_rewards"][b, len(response) - 1] = reward
    return batch


def test_a_leaf_with_no_step_is_valued_by_its_success_rate():
    """root -> {A: one step, success (reward 1); B: one step, failure (-1); Z: no step (only EOS), failure (-1)},
    success threshold 0. Every value is a success rate: V(root) = 1/3, V(A) = 1, V(B) = V(Z) = 0.
    SPO-tree (``advantage = child_reward - parent_reward``): A 1 - 1/3 = 2/3, B and Z 0 - 1/3 = -1/3.
    TreeRL ((GA + LA) / sqrt(|L|), the parent the root, |L| = 1): A 2 (2/3) = 4/3, B and Z 2 (-1/3) = -2/3.
    (From Z's raw reward -1 instead: -1 - 1/3 = -4/3 and -8/3.)"""
    responses = [[RIGHT, SEP, EOS], [WRONG, SEP, EOS], [EOS]]
    batch = _issue_batch(["r"] * 3, responses, [1.0, -1.0, -1.0])
    assert batch["num_steps"].tolist() == [1, 1, 0]
    spo, _ = ESTIMATORS["spo_tree"](**batch, config=CONFIG)
    torch.testing.assert_close(spo, torch.tensor([[2 / 3] * 3, [-1 / 3] * 3, [-1 / 3, 0, 0]]))
    tree_rl, _ = ESTIMATORS["tree_rl"](**batch, config=CONFIG)
    torch.testing.assert_close(tree_rl, torch.tensor([[4 / 3] * 3, [-2 / 3] * 3, [-2 / 3, 0, 0]]))


# root -> P (one step) -> {A: a step, success; B: a step, failure; Z: only EOS, failure}, and root -> C: two steps,
# failure. P = [RIGHT, SEP].
BRANCH_TREE = [[RIGHT, SEP, RIGHT, SEP, EOS], [RIGHT, SEP, WRONG, SEP, EOS], [RIGHT, SEP, EOS],
               [WRONG, SEP, WRONG, SEP, EOS]]
BRANCH_OUTCOMES = [1.0, 0.0, 0.0, 0.0]


def test_a_branch_that_ends_no_step_gets_its_own_leaf_value():
    """BRANCH_TREE: V(root) = 1/4, V(P) = 1/3 (A, B, Z below it), V(A) = 1, V(B) = V(Z) = V(C) = 0; C is one
    segment (one leaf below each of its nodes), and so are A's and B's last step with their EOS.
    SPO-tree: P's tokens 1/3 - 1/4 = 1/12 in A, B and Z; A's segment 1 - 1/3 = 2/3, B's 0 - 1/3 = -1/3; Z's EOS,
    the node Z below P, 0 - 1/3 = -1/3 (not P's 1/12); C 0 - 1/4 = -1/4.
    TreeRL: P (1/12 + 1/12) / sqrt(3); A (3/4 + 2/3) / 1 = 17/12; B (-1/4 - 1/3) = -7/12; Z's EOS -7/12;
    C (-1/4 - 1/4) = -1/2."""
    batch = _batch(["t"] * 4, BRANCH_TREE, BRANCH_OUTCOMES)
    spo, _ = ESTIMATORS["spo_tree"](**batch, config=CONFIG)
    p = 1 / 12
    torch.testing.assert_close(spo, torch.tensor([[p, p, 2 / 3, 2 / 3, 2 / 3], [p, p, -1 / 3, -1 / 3, -1 / 3],
                                                  [p, p, -1 / 3, 0, 0], [-1 / 4] * 5]))
    tree_rl, _ = ESTIMATORS["tree_rl"](**batch, config=CONFIG)
    p = (1 / 6) / math.sqrt(3)
    torch.testing.assert_close(tree_rl, torch.tensor([[p, p] + [17 / 12] * 3, [p, p] + [-7 / 12] * 3,
                                                      [p, p, -7 / 12, 0, 0], [-1 / 2] * 5]))


def _treerl_code_advantages(paths: list[list[str]], rewards: list[float]) -> dict[tuple[str, str], float]:
    """TreeRL's code, written out over a tree given as each leaf's path of node names (``tree_node.py``:
    ``leaf_normalize`` sets each leaf's value to its reward minus the mean of the other leaves'; ``leaf_backpropagate``
    adds it to every ancestor's ``accumulated_value`` and counts ``terminal_in_subtree``; ``compute_weighted_update``
    with weighted_value_style sqrt divides each node's accumulated value by sqrt(its terminals);
    ``parallel_mcts.path_from_root_to_node``: value = child / terminals - parent / terminals, state_value = child /
    terminals; ``gather_paths`` with use_state_value_reward: value + state_value). Returns (leaf, node) -> A."""
    n = len(rewards)
    accumulated: dict[str, float] = {"root": 0.0}
    terminals: dict[str, int] = {"root": 0}
    for path, reward in zip(paths, rewards):
        centred = reward - (sum(rewards) - reward) / (n - 1)
        for node in ["root", *path]:
            accumulated[node] = accumulated.get(node, 0.0) + centred
            terminals[node] = terminals.get(node, 0) + 1
    weighted = {node: accumulated[node] / math.sqrt(terminals[node]) for node in accumulated}
    state = {node: weighted[node] / terminals[node] for node in weighted}
    result = {}
    for path in paths:
        for parent, node in zip(["root", *path], path):
            result[(path[-1], node)] = (state[node] - state[parent]) + state[node]
    return result


def test_tree_rl_scale_code_is_treerls_code():
    """BRANCH_TREE as TreeRL's tree: root -> P -> {A, B, Z}, root -> C (each a segment node, the leaves their own
    nodes); tree_rl_scale=code equals TreeRL's code on every token, the paper's scale does not."""
    paths = [["P", "A"], ["P", "B"], ["P", "Z"], ["C"]]
    reference = _treerl_code_advantages(paths, BRANCH_OUTCOMES)
    node_of_token = [["P", "P", "A", "A", "A"], ["P", "P", "B", "B", "B"], ["P", "P", "Z"], ["C"] * 5]
    batch = _batch(["t"] * 4, BRANCH_TREE, BRANCH_OUTCOMES)
    code = OmegaConf.create({"adv_estimator": "tree_rl", "pav": {"tree_rl_scale": "code"}})
    ours, _ = ESTIMATORS["tree_rl"](**batch, config=code)
    for b, (path, nodes) in enumerate(zip(paths, node_of_token)):
        expected = torch.tensor([reference[(path[-1], node)] for node in nodes])
        torch.testing.assert_close(ours[b, : len(nodes)], expected)
    paper, _ = ESTIMATORS["tree_rl"](**batch, config=CONFIG)
    assert not torch.allclose(paper, ours)


@pytest.mark.parametrize("rule", TREE_ESTIMATORS)
def test_segment_weight_once_weighs_each_node_once(rule):
    """tree_segment_weight=once: a token of node n (the prefix up to the end of its step; the whole response for
    a token in no step) appears in the rows of n's leaves; summed over them its advantage is n's advantage once
    (SPO-tree trains each edge once), on trees with nodes of 2 and 3 leaves (LOSS_TREE with other outcomes, so that
    the shared nodes have advantages) and BRANCH_TREE (Z's EOS its own node)."""
    once = OmegaConf.create({"adv_estimator": rule, "pav": {"tree_segment_weight": "once"}})
    for responses, outcomes in ((LOSS_TREE, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), (BRANCH_TREE, BRANCH_OUTCOMES)):
        batch = _batch(["t"] * len(responses), responses, outcomes)
        per_leaf, _ = ESTIMATORS[rule](**batch, config=CONFIG)
        weighted, _ = ESTIMATORS[rule](**batch, config=once)
        summed: dict[tuple, list[float]] = {}
        for b, row in enumerate(responses):
            ends = step_ends(row)
            for t in range(len(row)):
                end = next((e for e in ends if t < e), len(row))
                entry = summed.setdefault((tuple(row[: t + 1]), tuple(row[:end])), [0.0, float(per_leaf[b, t])])
                entry[0] += float(weighted[b, t])
                assert entry[1] == pytest.approx(float(per_leaf[b, t]), abs=1e-6)  # one advantage per node
        assert any(abs(value) > 0.1 for _, value in summed.values())
        assert len(summed) < sum(len(row) for row in responses)  # nodes shared by several rows
        for total, value in summed.values():
            assert total == pytest.approx(value, abs=1e-6)


def test_tree_estimators_need_the_leaf_counts():
    batch = _batch(["a"], [[RIGHT, SEP, EOS]], [1.0])
    batch.pop("leaf_counts")
    for rule in TREE_ESTIMATORS:
        with pytest.raises(MissingStepTensorsError, match=f"{rule}.*needs the step tensor leaf_counts"):
            ESTIMATORS[rule](**batch, config=CONFIG)


def test_a_bad_response_node_is_an_error_naming_the_sample():
    batch = _batch(["t"] * 4, BRANCH_TREE, BRANCH_OUTCOMES)
    for key, value in (("response_values", float("nan")), ("response_values", 1.5), ("response_leaf_counts", 0)):
        bad = dict(batch)
        bad[key] = batch[key].clone()
        bad[key][2] = value
        for rule in TREE_ESTIMATORS:
            with pytest.raises(ValueError, match=f"{rule}: sample 2 has response_values .* a response's own node is "
                                                 r"a success rate in \[0, 1\] over >= 1 leaves"):
                ESTIMATORS[rule](**bad, config=CONFIG)


def test_tree_step_advantages_pad_and_check():
    values = torch.tensor([[0.5, 0.5, 1.0]])
    counts = torch.tensor([[2, 2, 1]])
    out = tree_step_advantages("spo_tree", values, torch.tensor([0.25]), counts, torch.tensor([2]))
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.25, 0.0]]))  # step 2 is past num_steps
    with pytest.raises(ValueError, match=r"leaf_counts has shape \(1, 2\) but step_values \(1, 3\)"):
        tree_step_advantages("tree_rl", values, torch.tensor([0.25]), counts[:, :2], torch.tensor([2]))


# ----------------------------------------------------------------------------------------------------------
# The loss over shared prefixes
# ----------------------------------------------------------------------------------------------------------


class TinyPolicy(torch.nn.Module):
    """A small causal model: log pi(token | prompt + previous tokens) from a GRU over the ids."""

    def __init__(self, vocab: int = 12, dim: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.gru = torch.nn.GRU(dim, dim, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def log_probs(self, contexts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log pi of ``tokens`` [B, T] after ``contexts`` [B, P] + the tokens before each."""
        ids = torch.cat([contexts, tokens], dim=1)
        hidden, _ = self.gru(self.embed(ids))
        logits = self.head(hidden[:, contexts.shape[1] - 1: -1])
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


# a tree of 6 leaves over a small vocabulary: 0 = SEP, 9 = EOS; prompt [10, 11]; leaves 1-2 branch from leaf 0
# after step 0, leaf 3 from leaf 1 after step 1, leaf 5 from leaf 4 after step 0
LOSS_TREE = [[1, 3, SEP, 1, SEP, 1, SEP, EOS], [1, 3, SEP, 2, SEP, 1, SEP, EOS], [1, 3, SEP, 1, 4, SEP, EOS],
             [1, 3, SEP, 2, SEP, 2, SEP, EOS], [2, SEP, 1, SEP, EOS], [2, SEP, 2, 5, SEP, EOS]]
LOSS_OUTCOMES = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("rule", TREE_ESTIMATORS)
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_the_gradient_over_leaf_rows_equals_each_node_once_with_its_leaves_summed_advantage(rule, loss_agg_mode):
    """verl's policy loss (``compute_policy_loss_vanilla`` + ``agg_loss``) over the leaves as rows, at the rollout's
    parameters (ratio 1), against a loop over the tree's distinct tokens: a token (its context: the prompt and the
    response tokens before it) appears once, with the summed advantage of the leaves through it, weighted as the
    aggregation weighs every row's token (token-mean: 1 / the rows' token count; seq-mean-token-sum: 1 / rows)."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config.actor import FSDPActorConfig

    batch = _batch(["t"] * len(LOSS_TREE), LOSS_TREE, LOSS_OUTCOMES)
    advantages, _ = ESTIMATORS[rule](**batch, config=CONFIG)
    mask = batch["response_mask"]
    model = TinyPolicy().double()
    prompt = torch.tensor([[10, 11]])
    tokens = torch.tensor([row + [0] * (mask.shape[1] - len(row)) for row in LOSS_TREE])
    log_prob = model.log_probs(prompt.expand(len(LOSS_TREE), -1), tokens)
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=len(LOSS_TREE), ppo_micro_batch_size_per_gpu=1)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(log_prob.detach(), log_prob, advantages.double(), mask.double(),
                                                        loss_agg_mode, actor)
    ours = torch.autograd.grad(loss, list(model.parameters()))

    summed: dict[tuple, float] = {}
    for b, row in enumerate(LOSS_TREE):
        for t in range(len(row)):
            summed[tuple(row[: t + 1])] = summed.get(tuple(row[: t + 1]), 0.0) + float(advantages[b, t])
    assert len(summed) < int(mask.sum())  # the tree shares tokens
    weight = 1.0 / float(mask.sum()) if loss_agg_mode == "token-mean" else 1.0 / len(LOSS_TREE)
    reference = 0.0
    for node, total in summed.items():
        context = torch.tensor([[10, 11, *node[:-1]]])
        reference = reference - weight * total * model.log_probs(context, torch.tensor([[node[-1]]]))[0, 0]
    expected = torch.autograd.grad(reference, list(model.parameters()))
    for mine, theirs in zip(ours, expected):
        torch.testing.assert_close(mine, theirs, atol=1e-10, rtol=1e-8)
