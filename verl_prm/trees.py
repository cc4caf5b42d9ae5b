"""Tree-shaped groups: a prompt's n responses sampled as a tree, the tree's node values and its advantages.

**Sampling** (:func:`sample_tree`). ``m = roots`` complete responses are sampled independently; then, in rounds,
branch points are chosen among the leaves' step boundaries and each gets ``b = branch_width`` continuations of the
prompt + the leaf's response tokens up to the boundary, until the group holds ``n = m + r b`` leaves
(``r = TreeShape.branch_points(n)``). Every leaf is a complete response (the shared prefix + its continuation).
A candidate branch point is a pair (leaf, step h) with

* ``end_h > fork_tokens`` of the leaf (strictly after the prefix it shares with its parent: the boundaries inside
  that prefix are the parent's),
* ``h < H - 1`` (not the leaf's last step: there must be something to continue),
* ``end_h < max_response_tokens`` (room for a continuation), and
* not branched yet.

Each round takes ``min(budget left, candidates)`` points by the rule (``verl_prm.choices.BRANCH_RULES``), and
generates their continuations concurrently:

* ``every``: breadth-first: the lowest step index first, ties by leaf index;
* ``fixed``: ``branches_per_response = k`` boundaries of each root, evenly spaced over its C candidates
  ``c_0 < ... < c_{C-1}``: ``c_{floor((j + 1) C / (k + 1))}`` for j < k (all C when C <= k), as
  ``verl_prm.monte_carlo.fixed_prefix_steps`` spaces the sampled prefixes; only roots branch, in one round
  (``r = m k``: a root with C < k candidates leaves k - C points to the fallback);
* ``confidence``: where the policy was least sure: the lowest log-probability (from the rollout) of the first
  token after the boundary, ties by step, then leaf. TreeRL's EPTree forks at the tokens of highest ``-log p``
  (Hou et al. 2025, https://github.com/THUDM/TreeRL, ``entropy_chain_local_manager.py``: ``entropy_value =
  -node.log_prob_list[token_idx]``, sorted descending); here the forks are restricted to step boundaries, so the
  branch points are nodes of the step tensors. A NaN log-prob there is an error naming the leaf and its request
  (NaN has no order).

Fallback: when budget is left but no candidate (e.g. every response has one step), the remaining ``b`` leaves
of each unused branch point are sampled as extra independent roots (``Leaf.fallback_root``): the group still has
n leaves, and the trees are then partly a plain GRPO group.

**Node values** (:func:`tree_step_values`). The node of step h of a leaf is its response prefix up to the step's
end, and the leaf itself (the whole response) is a node too; a node's value is the mean outcome (success: 0/1) of
the group's leaves that begin with that prefix (SPO-tree's and TreeRL's "value of a node = mean reward of the
leaves below it"), a Monte-Carlo estimate from the tree itself.

**Advantages** (:func:`tree_step_advantages`): TreeRL's ``(GA + LA) / sqrt(|L(n)|)`` and SPO-tree's
``V(n) - V(parent(n))`` per segment of a leaf, the leaf's own node last (:func:`with_leaf_nodes`: the tokens after
the last step end, e.g. EOS, and all tokens of a response with no step); the estimators ``tree_rl`` and
``spo_tree`` (``verl_prm.estimators``) put them on the tokens. Where this differs from the peers' code by design,
and the options that reproduce them: docs, step_values, "Tree-shaped groups". Each leaf is its own training row
with its own per-token advantages (TreeRL's ``gather_paths``: one path per leaf), so the tokens of a node shared by
|L(n)| leaves enter the policy loss |L(n)| times; their gradient equals that of the node's tokens once with the
summed advantage of its leaves (``tests/unit/test_trees.py`` checks this on verl's policy loss).

This module imports no verl.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from verl_prm.choices import (BRANCH_RULES, TREE_RL_SCALES, TREE_SEGMENT_WEIGHTS, BranchRule, TreeRlScale,
                              TreeSegmentWeight)
from verl_prm.monte_carlo import fixed_prefix_steps, prefix_match_sums

__all__ = [
    "TREE_ADVANTAGE_RULES",
    "Leaf",
    "TreeShape",
    "TreeValues",
    "sample_tree",
    "tree_step_advantages",
    "tree_step_values",
    "with_leaf_nodes",
]

# generate(prompt_ids, max_tokens) -> (token_ids, log_probs or None)
Generate = Callable[[list[int], int], Awaitable[tuple[list[int], "list[float] | None"]]]
StepEnds = Callable[[list[int]], Sequence[int]]
TreeAdvantageRule = Literal["tree_rl", "spo_tree"]
TREE_ADVANTAGE_RULES = ("tree_rl", "spo_tree")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class TreeShape:
    """The shape of a tree-shaped group: ``roots`` (m) independent responses first, then branch points of
    ``branch_width`` (b) continuations each, chosen by ``branch_rule``; ``branches_per_response`` (k) is the
    number of branch points per root under the rule ``fixed``."""

    roots: int
    branch_width: int
    branch_rule: BranchRule
    branches_per_response: int = 1

    def __post_init__(self) -> None:
        _positive_int("roots (independent responses of a tree)", self.roots)
        _positive_int("branch_width (continuations per branch point)", self.branch_width)
        _positive_int("branches_per_response (branch points per root, rule fixed)", self.branches_per_response)
        if self.branch_rule not in BRANCH_RULES:
            raise ValueError(f"branch_rule must be one of {BRANCH_RULES}, got {self.branch_rule!r}")

    def branch_points(self, n: int) -> int:
        """The number of branch points r = (n - m) / b of a group of n leaves; ValueError when n cannot be
        reached (n < m, n - m not a multiple of b), when r = 0 (no branch: a plain GRPO group) or, for the rule
        ``fixed``, when r != m k."""
        m, b = self.roots, self.branch_width
        if isinstance(n, bool) or not isinstance(n, int) or n < m:
            raise ValueError(f"rollout n={n!r} is fewer leaves than roots={m}: lower roots or raise rollout n")
        if (n - m) % b:
            low = m + ((n - m) // b) * b
            raise ValueError(
                f"rollout n={n} cannot be reached: n - roots = {n - m} is not a multiple of branch_width={b}; "
                f"use n = roots + r * branch_width (e.g. {low} or {low + b}) or change roots/branch_width")
        r = (n - m) // b
        if r == 0:
            raise ValueError(
                f"rollout n={n} = roots={m} leaves a branch budget of 0: the group would be plain GRPO; raise "
                f"rollout n to roots + r * branch_width (e.g. {m + b}) or lower roots")
        if self.branch_rule == "fixed" and r != m * self.branches_per_response:
            want = m * (1 + self.branches_per_response * b)
            raise ValueError(
                f"branch_rule fixed with roots={m}, branches_per_response={self.branches_per_response} and "
                f"branch_width={b} makes roots x (1 + branches_per_response x branch_width) = {want} leaves, but "
                f"rollout n={n}: set rollout n={want} or change branches_per_response")
        return r


@dataclass(frozen=True)
class Leaf:
    """One complete response of a tree. ``log_probs``: per response token, from the rollout (None if it returned
    none); ``parent``: index of the leaf it branched from (None for a root); ``fork_tokens``: response tokens it
    shares with the parent (0 for a root), so it generated ``len(response_ids) - fork_tokens``; ``fork_step``: the
    parent's step after which it branched; ``fallback_root``: an extra independent root sampled because no
    branch point was left (module docstring)."""

    response_ids: list[int]
    log_probs: list[float] | None
    parent: int | None
    fork_tokens: int
    fork_step: int | None
    fallback_root: bool = False

    @property
    def generated_tokens(self) -> int:
        return len(self.response_ids) - self.fork_tokens


def _checked_generation(where: str, output, max_tokens: int) -> tuple[list[int], list[float] | None]:
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        raise RuntimeError(f"{where}: generate must return (token_ids, log_probs or None), got {type(output)}")
    tokens, log_probs = list(output[0]), output[1]
    if len(tokens) > max_tokens:
        raise RuntimeError(f"{where}: the rollout returned {len(tokens)} tokens for max_tokens={max_tokens}")
    if log_probs is not None:
        log_probs = [float(x) for x in log_probs]
        if len(log_probs) != len(tokens):
            raise RuntimeError(f"{where}: the rollout returned {len(log_probs)} log-probs for {len(tokens)} tokens")
    return tokens, log_probs


def _checked_ends(where: str, ends: Sequence[int], length: int) -> list[int]:
    ends = [int(e) for e in ends]
    if any(not 0 < e <= length for e in ends) or any(a >= b for a, b in zip(ends, ends[1:])):
        raise ValueError(f"{where}: step_ends must be strictly ascending ends in (0, {length}] (the response's "
                         f"length), got {ends}: fix the step rule")
    return ends


class _Tree:
    """The leaves so far, their step ends and the branched points (``sample_tree``'s state)."""

    def __init__(self, prompt_ids: list[int], shape: TreeShape, step_ends: StepEnds, limit: int, label: str):
        self.prompt_ids, self.shape, self.step_ends, self.limit, self.label = prompt_ids, shape, step_ends, limit, label
        self.leaves: list[Leaf] = []
        self.ends: list[list[int]] = []
        self.branched: set[tuple[int, int]] = set()
        self.rounds = 0

    def add(self, leaf: Leaf) -> None:
        where = f"{self.label}, leaf {len(self.leaves)}"
        self.ends.append(_checked_ends(where, self.step_ends(list(leaf.response_ids)), len(leaf.response_ids)))
        self.leaves.append(leaf)

    def candidates(self, index: int) -> list[int]:
        """The steps of leaf ``index`` it may branch after (module docstring)."""
        leaf, ends = self.leaves[index], self.ends[index]
        return [h for h in range(len(ends) - 1) if leaf.fork_tokens < ends[h] < self.limit
                and (index, h) not in self.branched]

    def log_prob_after(self, index: int, step: int) -> float:
        leaf = self.leaves[index]
        if leaf.log_probs is None:
            raise ValueError(
                f"{self.label}, leaf {index}: branch_rule confidence reads the rollout's log-prob of the token after "
                "each step boundary, but the rollout returned none: enable the rollout's log-probs or use "
                "branch_rule every or fixed")
        token = self.ends[index][step]
        value = leaf.log_probs[token]
        # NaN would sort anywhere (every comparison with it is False): refuse rather than branch where the
        # candidate list's order happens to put it
        if math.isnan(value):
            request = "its root request" if leaf.parent is None else \
                f"the continuation of leaf {leaf.parent} after step {leaf.fork_step}"
            raise ValueError(
                f"{self.label}, leaf {index}: branch_rule confidence reads the log-prob of the token after step "
                f"{step} (response token {token}), and {request} returned NaN, which has no order: fix the rollout's "
                "log-probs (a NaN from an overflow in the sampler's logits, or a backend that fills missing "
                "log-probs with NaN) or use branch_rule every or fixed")
        return value

    def choose(self, budget: int) -> list[tuple[int, int]]:
        """This round's branch points (leaf, step), at most ``budget``, by the shape's rule."""
        rule = self.shape.branch_rule
        if rule == "fixed":  # one round, roots only
            points = []
            if self.rounds:
                return points
            for index, leaf in enumerate(self.leaves):
                if leaf.parent is None and not leaf.fallback_root:
                    steps = self.candidates(index)
                    points += [(index, steps[j]) for j in fixed_prefix_steps(len(steps),
                                                                          self.shape.branches_per_response)]
            return points[:budget]
        points = [(index, h) for index in range(len(self.leaves)) for h in self.candidates(index)]
        if rule == "every":
            points.sort(key=lambda point: (point[1], point[0]))
        else:
            points.sort(key=lambda point: (self.log_prob_after(*point), point[1], point[0]))
        return points[:budget]


async def sample_tree(generate: Generate, prompt_ids: Sequence[int], n: int, shape: TreeShape, step_ends: StepEnds,
                      max_response_tokens: int, *, label: str = "prompt") -> list[Leaf]:
    """Sample one prompt's group of ``n`` leaves as a tree of ``shape`` (module docstring).

    ``generate(prompt_ids, max_tokens)`` awaits ``(token_ids, log_probs or None)``; ``step_ends(response_ids)``
    gives the exclusive end of each step; a continuation after step end e gets ``max_tokens =
    max_response_tokens - e``. ``label`` names the prompt in errors. Returns exactly n leaves in a deterministic
    order: the m roots, then each round's branches (points in the rule's order, then their b continuations), then
    the fallback roots; a leaf's ``parent`` indexes this list.
    """
    budget = shape.branch_points(n)
    _positive_int("max_response_tokens", max_response_tokens)
    prompt = [int(t) for t in prompt_ids]
    tree = _Tree(prompt, shape, step_ends, max_response_tokens, label)
    roots = await asyncio.gather(*(generate(list(prompt), max_response_tokens) for _ in range(shape.roots)))
    for i, output in enumerate(roots):
        tokens, log_probs = _checked_generation(f"{label}, root {i}", output, max_response_tokens)
        tree.add(Leaf(tokens, log_probs, None, 0, None))
    while budget:
        points = tree.choose(budget)
        if not points:
            break
        requests = []
        for index, step in points:
            tree.branched.add((index, step))
            end = tree.ends[index][step]
            requests += [(index, step, end)] * shape.branch_width
        outputs = await asyncio.gather(*(generate(prompt + tree.leaves[index].response_ids[:end],
                                                  max_response_tokens - end) for index, _, end in requests))
        for (index, step, end), output in zip(requests, outputs):
            parent = tree.leaves[index]
            tokens, log_probs = _checked_generation(f"{label}, branch of leaf {index} after step {step}", output,
                                                    max_response_tokens - end)
            joined = None if parent.log_probs is None or log_probs is None else parent.log_probs[:end] + log_probs
            tree.add(Leaf(parent.response_ids[:end] + tokens, joined, index, end, step))
        budget -= len(points)
        tree.rounds += 1
    extra = budget * shape.branch_width
    outputs = await asyncio.gather(*(generate(list(prompt), max_response_tokens) for _ in range(extra)))
    for i, output in enumerate(outputs):
        tokens, log_probs = _checked_generation(f"{label}, fallback root {i}", output, max_response_tokens)
        tree.add(Leaf(tokens, log_probs, None, 0, None, fallback_root=True))
    return tree.leaves


class TreeValues(NamedTuple):
    """Node values of tree-shaped groups (:func:`tree_step_values`): ``step_values`` [B, S] float32 and
    ``leaf_counts`` [B, S] int64 of each step's node, ``prompt_values`` [B] float32 (the root), and
    ``response_values`` [B] float32 and ``response_leaf_counts`` [B] int64 of each response's own node (its leaf:
    the whole response, so also the tokens after its last step end, e.g. EOS)."""

    step_values: torch.Tensor
    leaf_counts: torch.Tensor
    prompt_values: torch.Tensor
    response_values: torch.Tensor
    response_leaf_counts: torch.Tensor


def tree_step_values(group_ids: Sequence[Hashable], responses: Sequence[Sequence[int]],
                     step_ends: Sequence[Sequence[int]], outcomes, width: int | None = None) -> TreeValues:
    """Node values of tree-shaped groups (:class:`TreeValues`), S = ``width`` when given (a step tensor's width),
    else the most steps of a row.

    The rows of one group id are the leaves of one tree. For row b and its step h (end e = ``step_ends[b][h]``,
    exclusive, in response tokens) the node is the prefix ``responses[b][:e]``;

        leaf_counts[b, h] = |L|,  L = {rows c of b's group : responses[c][:e] == responses[b][:e]} (b included),
        step_values[b, h] = mean_{c in L} outcomes[c],     prompt_values[b] = mean outcome of b's group,

    and the response's own node (its leaf) is the prefix e = len(responses[b]): ``response_values[b]``,
    ``response_leaf_counts[b]`` by the same formulas, so a leaf holds its own outcome (and that of identical
    leaves), also when no step ends at its last token (the tokens after the last step end, e.g. EOS) or it has no
    step at all. SPO-tree's code averages a node's children's values instead (``hybrid_inference_strategy.
    _construct_tree``), the same in its balanced trees; TreeRL's averages its leaves, as here (docs:
    step_values, "Tree-shaped groups"). Entries at h >= num_steps are 0 in both (the step tensors' contract
    ignores them; a count of 0 marks "no node"). ``outcomes`` in [0, 1] (0/1 successes: the values are success
    rates). The prefixes are matched exactly by ``verl_prm.monte_carlo.prefix_match_sums`` (incremental: O(B T +
    B S |ends of the group|) dictionary work).
    """
    rows = len(responses)
    if not len(group_ids) == rows == len(step_ends) == len(outcomes):
        raise ValueError(f"{len(group_ids)} group ids, {rows} responses, {len(step_ends)} step_ends and "
                         f"{len(outcomes)} outcomes: give one of each per row")
    values = [float(x) for x in (outcomes.tolist() if isinstance(outcomes, torch.Tensor) else outcomes)]
    for b, x in enumerate(values):
        if not 0.0 <= x <= 1.0:  # NaN fails too
            raise ValueError(f"row {b}: outcome {x} is not in [0, 1]; node values are success rates: pass 0/1 "
                             "successes (e.g. outcome > the success threshold)")
    ends = [_checked_ends(f"row {b}", row_ends, len(responses[b])) for b, row_ends in enumerate(step_ends)]
    queries = [(b, e) for b, row_ends in enumerate(ends) for e in row_ends]
    # the leaves' own nodes in the same pass: one query per row at its full length (an empty response, e.g. a
    # padding row, has no token to credit: its own outcome, one leaf)
    nonempty = [b for b, response in enumerate(responses) if len(response)]
    sums = prefix_match_sums(group_ids, responses, values, queries + [(b, len(responses[b])) for b in nonempty],
                             longer_only=False)
    step_sums = sums[: len(queries)]
    leaf_sums = [(x, 1) for x in values]
    for b, leaf_sum in zip(nonempty, sums[len(queries):]):
        leaf_sums[b] = leaf_sum
    most_steps = max((len(row) for row in ends), default=0)
    if width is None:
        width = most_steps
    elif width < most_steps:
        raise ValueError(f"width {width} is below the {most_steps} steps of a row: pass at least the most steps")
    step_values = torch.zeros(rows, width, dtype=torch.float64)
    leaf_counts = torch.zeros(rows, width, dtype=torch.int64)
    if queries:
        at = ([b for b, row_ends in enumerate(ends) for _ in row_ends],
              [h for row_ends in ends for h in range(len(row_ends))])
        totals, counts = (torch.tensor(column, dtype=torch.float64) for column in zip(*step_sums))
        step_values[at], leaf_counts[at] = totals / counts, counts.long()
    leaf_totals = torch.tensor([total for total, _ in leaf_sums], dtype=torch.float64)
    response_leaf_counts = torch.tensor([count for _, count in leaf_sums], dtype=torch.int64)
    group_sums: dict[Hashable, list[float]] = {}
    for group, x in zip(group_ids, values):
        entry = group_sums.setdefault(group, [0.0, 0])
        entry[0] += x
        entry[1] += 1
    prompt_values = torch.tensor([group_sums[g][0] / group_sums[g][1] for g in group_ids], dtype=torch.float64)
    return TreeValues(step_values.float(), leaf_counts, prompt_values.float(),
                      (leaf_totals / response_leaf_counts.clamp(min=1)).float(), response_leaf_counts)


def with_leaf_nodes(step_values: torch.Tensor, leaf_counts: torch.Tensor, num_steps: torch.Tensor,
                    response_values: torch.Tensor, response_leaf_counts: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The node values and leaf counts [B, S + 1] of each response's steps followed by its own node (its leaf):
    column h < num_steps[b] is step h's node, column num_steps[b] the leaf (``response_values``,
    ``response_leaf_counts``), later columns as given (ignored). Read by :func:`tree_step_advantages` with
    ``num_steps + 1`` nodes, a leaf whose leaf set equals its last step's (nothing after the last step end, or no
    other leaf through the last step) joins that step's segment; one whose last step is shared (a branch whose
    continuation ends no step, e.g. only EOS) is a segment of its own below it, and a response with no step is
    the leaf right below the prompt."""
    rows, width = step_values.shape
    values = torch.cat([step_values.float(), step_values.new_zeros(rows, 1, dtype=torch.float32)], dim=1)
    counts = torch.cat([leaf_counts, leaf_counts.new_zeros(rows, 1)], dim=1)
    at = num_steps.to(values.device).long().clamp(min=0, max=width)[:, None]
    values = values.scatter(1, at, response_values.to(values.device, values.dtype)[:, None])
    counts = counts.scatter(1, at, response_leaf_counts.to(counts.device, counts.dtype)[:, None])
    return values, counts


def tree_step_advantages(rule: TreeAdvantageRule, step_values: torch.Tensor, prompt_values: torch.Tensor,
                         leaf_counts: torch.Tensor, num_steps: torch.Tensor, *, scale: TreeRlScale = "paper",
                         group_leaves: torch.Tensor | None = None,
                         segment_weight: TreeSegmentWeight = "per_leaf") -> torch.Tensor:
    """Advantage [B, S] of each step's segment of a leaf, from its node values (vectorised, any device).

    A segment is a maximal run of steps whose nodes have the same leaf set: along a leaf the leaf sets shrink, so
    a segment starts at step 0 and wherever ``leaf_counts`` changes. For step h of row b, n its node, V(n) =
    ``step_values[b, h]``, p = parent(n) the node of the step before the segment's first step (the prompt, value
    V(root) = ``prompt_values[b]``, for the first segment), |L(n)| = ``leaf_counts[b, h]``:

    * ``spo_tree``: A = V(n) - V(p) (SPO-tree, Guo et al. 2025, https://github.com/AIFrameResearch/SPO,
      ``tree_episode_generator.extract_edges_from_tree``: ``advantage = child_reward - parent_reward``, adv_method
      rloo);
    * ``tree_rl``, ``scale="paper"``: A = (GA + LA) / sqrt(|L(n)|), GA = V(n) - V(root), LA = V(n) - V(p)
      (TreeRL, Hou et al. 2025, arXiv 2506.11902, https://github.com/THUDM/TreeRL);
    * ``tree_rl``, ``scale="code"``: TreeRL's code (``tree_node.leaf_normalize``: each leaf's reward minus the
      mean of the other N - 1 leaves; ``compute_weighted_update`` with weighted_value_style sqrt: a node's value
      divided by sqrt of its leaves before the differences; ``parallel_mcts.gather_paths`` with
      use_state_value_reward: state value + local difference):

          A = s(n) + (s(n) - s(p)),   s(x) = N / (N - 1) (V(x) - V(root)) / sqrt(|L(x)|),   s(root) = 0,

      N = ``group_leaves[b]``, the leaves of b's tree (the factor is 1 for N = 1, where every V(x) = V(root)).

    ``segment_weight="once"`` divides each advantage by |L(n)|: a node's tokens appear in the |L(n)| rows of its
    leaves, so their summed gradient is then that of the node once with its advantage, as SPO-tree's code trains
    each edge once. Entries at h >= num_steps are 0. Counts below 1 are read as 1 (no division by 0; real nodes
    have >= 1).
    """
    if rule not in TREE_ADVANTAGE_RULES:
        raise ValueError(f"rule must be one of {TREE_ADVANTAGE_RULES}, got {rule!r}")
    if scale not in TREE_RL_SCALES:
        raise ValueError(f"scale must be one of {TREE_RL_SCALES}, got {scale!r}")
    if segment_weight not in TREE_SEGMENT_WEIGHTS:
        raise ValueError(f"segment_weight must be one of {TREE_SEGMENT_WEIGHTS}, got {segment_weight!r}")
    if leaf_counts.shape != step_values.shape:
        raise ValueError(f"leaf_counts has shape {tuple(leaf_counts.shape)} but step_values "
                         f"{tuple(step_values.shape)}: one count per step value")
    rows, width = step_values.shape
    values = step_values.float()
    root = prompt_values.to(values.device, values.dtype)[:, None]
    counts = leaf_counts.to(values.device)
    sizes = counts.clamp(min=1).to(values.dtype)
    steps = torch.arange(width, device=values.device)
    starts = torch.ones_like(counts, dtype=torch.bool)
    starts[:, 1:] = counts[:, 1:] != counts[:, :-1]
    # index of the segment's first step: the running max of the start positions
    first = torch.where(starts, steps[None, :], torch.zeros_like(steps)[None, :]).cummax(dim=1).values
    before = torch.cat([root, values[:, :-1]], dim=1)  # before[:, h] = V of the step before h (the prompt for h = 0)
    parent = before.gather(1, first)
    if rule == "spo_tree":
        advantages = values - parent
    elif scale == "paper":
        advantages = (values - root + values - parent) / sizes.sqrt()
    else:
        if group_leaves is None:
            raise ValueError("tree_rl with scale code needs group_leaves (the leaves N of each row's tree)")
        leaves = group_leaves.to(values.device, values.dtype)[:, None]
        factor = torch.where(leaves > 1, leaves / (leaves - 1).clamp(min=1), torch.ones_like(leaves))
        state = factor * (values - root) / sizes.sqrt()
        # s(parent): the prompt's is 0 (its value is V(root)); any count reads it as 0
        parent_sizes = torch.cat([torch.ones_like(sizes[:, :1]), sizes[:, :-1]], dim=1).gather(1, first)
        advantages = 2.0 * state - factor * (parent - root) / parent_sizes.sqrt()
    if segment_weight == "once":
        advantages = advantages / sizes
    valid = steps[None, :] < num_steps.to(values.device)[:, None]
    return torch.where(valid, advantages, torch.zeros_like(advantages))
