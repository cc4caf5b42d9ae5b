"""`CachedCritic`: a prefix critic behind a cache of prefix values, batched over a search round."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from verl_prm.search.nodes import Compute, Node, PrefixCritic


class CachedCritic:
    """A prefix critic behind a cache of prefix values.

    ``values(nodes)`` scores, in one ``score_nodes`` call, the distinct nodes whose value is not cached yet
    (except those that are prefixes of other nodes of the call), and caches the value of every prefix of each
    scored node (they come out of the same forward pass), so a parent or a beam carried to the next round is
    never scored again. Critic tokens and sequences are added
    to the ``Compute`` of each scored node's problem.
    """

    def __init__(self, critic: PrefixCritic, name: str = "critic") -> None:
        self.critic = critic
        self.name = name
        self._values: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._values)

    def _ensure(self, nodes: Sequence[Node], compute: dict[int, Compute]) -> None:
        missing: dict[Hashable, Node] = {}
        for node in nodes:
            if node.key not in self._values and node.key not in missing:
                missing[node.key] = node
        if not missing:
            return
        # A node that is a prefix of another node of the batch gets its value from that node's pass.
        covered: set = set()
        for node in missing.values():
            for h in range(node.num_steps - 1, -1, -1):
                key = (node.problem, node.steps[:h])
                if key in self._values or key in covered:
                    break
                covered.add(key)
        todo = [node for key, node in missing.items() if key not in covered]
        values, tokens = self.critic.score_nodes(todo)
        if len(values) != len(todo) or len(tokens) != len(todo):
            raise ValueError(f"{self.name}: score_nodes returned {len(values)} results for {len(todo)} nodes")
        for node, node_values, node_tokens in zip(todo, values, tokens):
            if len(node_values) != node.num_steps + 1:
                raise ValueError(
                    f"{self.name}: problem {node.problem}: expected {node.num_steps + 1} values (v_0..v_H) for a "
                    f"node with {node.num_steps} steps, got {len(node_values)}"
                )
            # Fill the prefixes from the longest down; a cached prefix has all of its own prefixes cached.
            self._values[node.key] = float(node_values[-1])
            for h in range(node.num_steps - 1, -1, -1):
                key = (node.problem, node.steps[:h])
                if key in self._values:
                    break
                self._values[key] = float(node_values[h])
            counter = compute.setdefault(node.problem, Compute())
            counter.critic_tokens += int(node_tokens)
            counter.critic_sequences += 1

    def values(self, nodes: Sequence[Node], compute: dict[int, Compute]) -> torch.Tensor:
        """[len(nodes)] float64: the value after each node's last step (``v_0`` for a node without steps)."""
        self._ensure(nodes, compute)
        return torch.tensor([self._values[node.key] for node in nodes], dtype=torch.float64)

    def prefix_values(
        self, nodes: Sequence[Node], compute: dict[int, Compute]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(prompt_values [B], step_values [B, S], num_steps [B])`` of the nodes (the estimators' layout)."""
        self._ensure(nodes, compute)
        width = max((node.num_steps for node in nodes), default=0)
        step_values = torch.zeros(len(nodes), width, dtype=torch.float64)
        prompt_values = torch.zeros(len(nodes), dtype=torch.float64)
        for i, node in enumerate(nodes):
            prompt_values[i] = self._values[(node.problem, ())]
            for h in range(node.num_steps):
                step_values[i, h] = self._values[(node.problem, node.steps[: h + 1])]
        num_steps = torch.tensor([node.num_steps for node in nodes], dtype=torch.long)
        return prompt_values, step_values, num_steps
