"""Wrappers the search tests share (tests/unit/test_search.py, tests/apps/test_demo_search.py): a sampler and a
prefix critic that record what they were asked. On sys.path through pytest's ``pythonpath`` setting."""

from __future__ import annotations


class RecordingSampler:
    """Wraps a sampler; records every sampled step (parent key, tokens) and every call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.steps: list[tuple[tuple, int, int]] = []  # (parent key, problem, tokens)
        self.responses: list[tuple[int, int]] = []  # (problem, tokens)

    def sample_steps(self, nodes, n, seeds):
        out = self.inner.sample_steps(nodes, n, seeds)
        for node, group in zip(nodes, out):
            assert len(group) == n
            for sample in group:
                self.steps.append((node.key, node.problem, sample.num_tokens))
        return out

    def sample_responses(self, problems, n, seeds):
        out = self.inner.sample_responses(problems, n, seeds)
        for problem, group in zip(problems, out):
            for node in group:
                self.responses.append((problem, node.num_tokens))
        return out


class RecordingCritic:
    """Wraps a prefix critic; records every scored node and the number of calls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.scored: list[tuple[tuple, int, int]] = []  # (key, problem, tokens)
        self.calls = 0

    def score_nodes(self, nodes):
        self.calls += 1
        values, tokens = self.inner.score_nodes(nodes)
        for node, t in zip(nodes, tokens):
            self.scored.append((node.key, node.problem, t))
        return values, tokens
