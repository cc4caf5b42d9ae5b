"""The planted sub-sequence task of the PAV paper (Setlur et al. 2024, Sec. 3.3 and App. B) and its prover.

A response is a sequence of ``length`` tokens from ``1..vocab`` (token ``vocab`` is end-of-sequence, EOS). The
EOS token is the last valid token of a response (it is an action the policy takes, so the loss sees it); every
position after it is padding (filled with EOS, masked out). The reward is 1 iff the planted sequence ``y*``
occurs in the valid part of the response (``y*`` never contains EOS).

The prover ``mu_gamma``: at a state whose matched length is k (the longest suffix of the prefix that is a
prefix of ``y*``, i.e. the state of the Knuth-Morris-Pratt automaton of ``y*``), the next token ``y*_{k+1}``
has weight gamma and every other token (EOS included) weight 1. Its values are exact by dynamic programming over
(position, automaton state)::

    V(T, k) = [k = L]                   (L = len(y*); state L = "y* seen", absorbing)
    V(t, L) = 1,  V(t, DEAD) = 0        (DEAD = EOS before success, absorbing)
    V(t, k) = sum_a mu(a | k) V(t + 1, delta(k, a))     for k < L

where ``delta`` is the automaton's transition. The KMP fallback matters only when ``y*`` overlaps itself
(e.g. ``1 2 1 3``: after ``1 2 1 2`` the matched length is 2, not 0); it is handled in general. For a prefix
``y_1..y_t`` in state ``k_t``, ``V^mu(prefix) = V(t, k_t)`` and the step value of token t is
``Q^mu(s_t, y_t) = V(t, k_t)`` after it (deterministic transitions), so ``A^mu = V(t, k_t) - V(t-1, k_{t-1})``.

Tensor conventions: ``tokens`` [B, T] int64 with values in 1..vocab; ``states`` [B, T + 1] int64 (state before
token 0 up to the state after token T - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from verl_prm.apps.demo.settings import DEFAULT_PLANTED

__all__ = ["PlantedTask", "kmp_transitions"]


def kmp_transitions(planted: tuple[int, ...], vocab: int) -> torch.Tensor:
    """Transition table of the matching automaton of ``planted`` with EOS and success handling.

    States: 0..L-1 matched length, L = ``planted`` seen (absorbing), L + 1 = DEAD (EOS before success, absorbing).
    Token ``vocab`` (EOS) moves every unfinished state to DEAD.

    Returns:
        [L + 2, vocab + 1] int64; column a is token a (column 0 unused, maps to the state itself).
    """
    length = len(planted)
    if length == 0:
        raise ValueError("the planted sequence must have at least one token")
    if any(not 1 <= a < vocab for a in planted):
        raise ValueError(f"planted tokens must lie in 1..{vocab - 1} (token {vocab} is EOS), got {planted}")
    # failure function of KMP
    fail = [0] * length
    k = 0
    for i in range(1, length):
        while k > 0 and planted[i] != planted[k]:
            k = fail[k - 1]
        if planted[i] == planted[k]:
            k += 1
        fail[i] = k
    success, dead = length, length + 1
    table = torch.empty(length + 2, vocab + 1, dtype=torch.long)
    for state in range(length):
        table[state, 0] = state
        for a in range(1, vocab + 1):
            if a == vocab:
                table[state, a] = dead
                continue
            k = state
            while k > 0 and planted[k] != a:
                k = fail[k - 1]
            table[state, a] = k + 1 if planted[k] == a else 0
    table[success] = success
    table[dead] = dead
    return table


def _sample_tokens(cdf: torch.Tensor, state: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token (1-based) per row from the per-state distributions: inverse CDF of one uniform per row
    (cheaper than ``torch.multinomial`` over hundreds of thousands of rows)."""
    uniform = torch.rand(state.shape[0], generator=generator, dtype=cdf.dtype)
    return (uniform[:, None] >= cdf[state]).sum(dim=1).clamp_max(cdf.shape[1] - 1) + 1


@dataclass(frozen=True)
class PlantedTask:
    """The environment: sequence ``length``, tokens ``1..vocab`` (``vocab`` = EOS), planted sequence ``planted``."""

    planted: tuple[int, ...] = DEFAULT_PLANTED
    length: int = 10
    vocab: int = 14

    def __post_init__(self) -> None:
        object.__setattr__(self, "planted", tuple(int(a) for a in self.planted))
        if len(self.planted) > self.length:
            raise ValueError(f"planted sequence {self.planted} is longer than the sequence length {self.length}")
        kmp_transitions(self.planted, self.vocab)  # validates

    @property
    def eos(self) -> int:
        return self.vocab

    @property
    def success_state(self) -> int:
        return len(self.planted)

    @property
    def dead_state(self) -> int:
        return len(self.planted) + 1

    @property
    def num_states(self) -> int:
        return len(self.planted) + 2

    @cached_property
    def transitions(self) -> torch.Tensor:
        """[num_states, vocab + 1] automaton table (``kmp_transitions``)."""
        return kmp_transitions(self.planted, self.vocab)

    # ----------------------------------------------------------------------------------------------- prover
    def prover_probs(self, gamma: float) -> torch.Tensor:
        """mu_gamma(a | k): [num_states, vocab] float64, column j is token j + 1.

        State k < L: weight gamma on ``planted[k]``, 1 elsewhere, normalised. Absorbing states: uniform (their
        value does not depend on the continuation).
        """
        if gamma <= 0:
            raise ValueError(f"prover strength gamma must be > 0, got {gamma}")
        weights = torch.ones(self.num_states, self.vocab, dtype=torch.float64)
        for k, a in enumerate(self.planted):
            weights[k, a - 1] = gamma
        return weights / weights.sum(dim=1, keepdim=True)

    def prover_cdf(self, gamma: float) -> torch.Tensor:
        """Cumulative mu_gamma(a | k) over tokens: [num_states, vocab] float64 (for inverse-CDF sampling)."""
        cdf = torch.cumsum(self.prover_probs(gamma), dim=1)
        cdf[:, -1] = 1.0
        return cdf

    def value_table(self, gamma: float) -> torch.Tensor:
        """Exact V^{mu_gamma}(t, k): [length + 1, num_states] float64 (t = tokens generated so far)."""
        probs = self.prover_probs(gamma)
        next_states = self.transitions[:, 1:]  # [K, vocab]
        values = torch.zeros(self.length + 1, self.num_states, dtype=torch.float64)
        values[:, self.success_state] = 1.0
        for t in range(self.length - 1, -1, -1):
            values[t] = (probs * values[t + 1][next_states]).sum(dim=1)
            values[t, self.success_state] = 1.0
            values[t, self.dead_state] = 0.0
        return values

    # --------------------------------------------------------------------------------------------- sequences
    def states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Automaton states of each prefix: [B, T] tokens -> [B, T + 1] (state before any token first)."""
        table = self.transitions.to(tokens.device)
        states = torch.zeros(tokens.shape[0], tokens.shape[1] + 1, dtype=torch.long, device=tokens.device)
        for t in range(tokens.shape[1]):  # a loop over the 10 positions, not over samples
            states[:, t + 1] = table[states[:, t], tokens[:, t]]
        return states

    def response_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] 1 for valid tokens: every token up to and including the first EOS."""
        is_eos = (tokens == self.eos).long()
        eos_before = torch.cumsum(is_eos, dim=1) - is_eos
        return (eos_before == 0).long()

    def rewards(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B] float 0/1: 1 iff ``planted`` occurs before the first EOS."""
        return (self.states(tokens)[:, -1] == self.success_state).float()

    def step_values(self, tokens: torch.Tensor, value_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact prover values of every prefix.

        Returns:
            ``(step_values [B, T], prompt_values [B])``: step_values[i, t] = Q^mu after token t (= V^mu of the
            prefix y_1..y_{t+1}); its entries after the first EOS repeat the terminal value (ignored by the
            estimators, which read ``num_steps``). prompt_values = V^mu(empty prefix).
        """
        states = self.states(tokens)
        table = value_table.to(tokens.device)
        positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
        step_values = table[positions[None, :].expand_as(tokens), states[:, 1:]]
        prompt_values = table[0, 0].expand(tokens.shape[0]).clone()
        return step_values.float(), prompt_values.float()

    def pad_after_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens with every position after the first EOS set to EOS (the canonical padded form)."""
        return torch.where(self.response_mask(tokens).bool(), tokens, torch.full_like(tokens, self.eos))

    # ------------------------------------------------------------------------------------------- sampling
    def sample_prover(
        self, gamma: float, num: int, generator: torch.Generator, prefix: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Complete ``prefix`` ([num, t] tokens, or none) with mu_gamma to full sequences [num, length].

        Sequences are padded with EOS after their first EOS.
        """
        cdf = self.prover_cdf(gamma)
        table = self.transitions
        if prefix is None:
            prefix = torch.zeros(num, 0, dtype=torch.long)
        if prefix.shape[0] != num:
            raise ValueError(f"prefix has {prefix.shape[0]} rows, expected num={num}")
        state = self.states(prefix)[:, -1]
        done = (prefix == self.eos).any(dim=1)
        out = [prefix]
        for _ in range(prefix.shape[1], self.length):
            token = _sample_tokens(cdf, state, generator)
            token = torch.where(done, torch.full_like(token, self.eos), token)
            done = done | (token == self.eos)
            state = table[state, token]
            out.append(token[:, None])
        return torch.cat(out, dim=1)

    def complete_prefixes(
        self, tokens: torch.Tensor, lengths: torch.Tensor, gamma: float, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep the first ``lengths[i]`` tokens of each row of ``tokens`` [N, T] and sample the rest with mu_gamma.

        Variable-length prefixes in one vectorised pass (a loop over the T positions). Returns [N, T] sequences,
        EOS-padded after their first EOS.
        """
        cdf = self.prover_cdf(gamma)
        table = self.transitions
        num = tokens.shape[0]
        state = torch.zeros(num, dtype=torch.long)
        done = torch.zeros(num, dtype=torch.bool)
        out = torch.empty_like(tokens)
        for t in range(self.length):
            sampled = _sample_tokens(cdf, state, generator)
            token = torch.where(t < lengths, tokens[:, t], sampled)
            token = torch.where(done, torch.full_like(token, self.eos), token)
            out[:, t] = token
            done = done | (token == self.eos)
            state = table[state, token]
        return out

    def monte_carlo_values(
        self, prefixes: torch.Tensor, gamma: float, num_rollouts: int, generator: torch.Generator
    ) -> torch.Tensor:
        """Monte-Carlo estimate of V^{mu_gamma} of each prefix: success fraction of ``num_rollouts`` completions.

        Args:
            prefixes: [P, t] tokens (all of one length t).

        Returns:
            [P] float, in multiples of 1 / num_rollouts.
        """
        repeated = prefixes.repeat_interleave(num_rollouts, dim=0)
        completions = self.sample_prover(gamma, repeated.shape[0], generator, prefix=repeated)
        return self.rewards(completions).view(prefixes.shape[0], num_rollouts).mean(dim=1)
