"""Monte-Carlo step values: which step prefixes to continue, the continuation requests, the success rates.

For a prompt x and a response y = a_1..a_H (steps by :mod:`verl_prm.steps`), the value after step h is estimated
from ``n_mc`` continuations c_1..c_{n_mc} of the prefix x + y[:end_h], sampled from a prover mu:

    v_h = #{j <= n_mc : R(y[:end_h] + c_j) succeeds} / n_mc,

an unbiased estimate of Q^mu(s_h, a_h), the probability that mu completes the prefix correctly, with standard error
sqrt(v_h (1 - v_h) / n_mc) (the PAV paper, Setlur et al. 2024, defines Q and V as expected outcomes of the prover's
completions and labels steps with such Monte-Carlo success rates). Step h = -1 is the empty prefix: v_{-1}
estimates the prompt value V^mu(x). The value after the **last** step of a response that ended there is its own
outcome and needs no sampling (``ResponseSteps.last_known``).

Which prefixes are continued (``verl_prm.choices.PREFIX_RULES``, one vocabulary for the labeler and the sampled
step values):

* ``every``: every step whose value is not known (cost n_mc (H - 1) continuations per response that ended);
* ``fixed``: ``prefixes_per_response`` of those steps, evenly spaced (``fixed_prefix_steps``);
* ``first_pit``: in a **failed** response, bisection for the first pit, the first step after which the value
  "falls to 0", meaning zero successes out of n_mc continuations. The search assumes a value stays 0 after a pit
  (a wrong step is not repaired), so it costs about log2(H) prefixes (``first_pit_search_step``); with n_mc
  samples a step of true value Q reads as 0 with probability (1 - Q)^n_mc, so the pit found is the first step
  whose value is below about 1 / n_mc. Successful responses get every prefix (``success_labels="every"``) or
  only their outcome (``success_labels="outcome"``).

The sampling is injected (``sample(requests) -> [PrefixCounts]``, one call per round: one round for
``every``/``fixed``, one per bisection round for ``first_pit``): the labeler generates with a prover model and
scores with a reward function, the verl glue generates through the run's rollout replicas, the tests use a
scripted policy. This module imports nothing heavy (no torch): ``verl-prm label --help`` loads it.

Token budget: a prefix is admitted only if its worst case, n_mc times its continuation limit
(``PrefixRequest.reserved_tokens``), fits in what is left (the first prefix that does not fit ends the round's
admission), and the tokens actually generated are charged after each round, so the generated total never exceeds
the budget. The prefixes of a round are admitted by step index first (all first steps, then all second steps, ...),
so what the budget refuses are the late steps.

Free samples (``shared_prefix_outcomes``): the responses of a prompt's group are i.i.d. samples of the policy, so
a response y' of the group whose tokens begin with a prefix P = y[:end_h] of another response y and go on past it
was, given that it begins with P, completed from P by the policy: its outcome is one more sample of Q(P) when the
prover is the policy that wrote the group. The response y itself is not counted: whether P is asked for depends on
y (its steps, its outcome under ``first_pit``), so its outcome is not a sample of Q(P).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from verl_prm.choices import PREFIX_RULES, SUCCESS_LABELS

__all__ = [
    "PrefixCounts",
    "PrefixEstimates",
    "PrefixRequest",
    "ResponseSteps",
    "estimate_prefixes",
    "first_pit_search_step",
    "fixed_prefix_steps",
    "requested_steps",
    "prefix_match_sums",
    "shared_prefix_outcomes",
]

@dataclass(frozen=True)
class ResponseSteps:
    """One response as the estimator sees it.

    ``success``: its own 0/1 outcome; ``last_known``: the value after its last step is that outcome (it ended
    there: by EOS, or at the length limit for a source that scores truncated responses), so that step is never
    continued; ``sample``: False for a row whose prefixes are not to be continued (a padding row);
    ``continuation_limits[h]``: the most tokens a continuation after step h may have (None: the generator's own
    limit; needed by a token budget).
    """

    num_steps: int
    success: bool
    last_known: bool = True
    sample: bool = True
    continuation_limits: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.continuation_limits is not None and len(self.continuation_limits) != self.num_steps:
            raise ValueError(f"{len(self.continuation_limits)} continuation limits for {self.num_steps} steps")

    @property
    def candidates(self) -> int:
        """Steps whose value is not known without sampling: 0..candidates - 1."""
        return max(self.num_steps - 1, 0) if self.last_known else self.num_steps


@dataclass(frozen=True)
class PrefixRequest:
    """Continue response ``row`` after step ``step`` (-1: the prompt alone) ``n_mc`` times, each continuation of
    at most ``max_tokens`` tokens (None: the generator's own limit)."""

    row: int
    step: int
    n_mc: int
    max_tokens: int | None = None

    @property
    def reserved_tokens(self) -> int:
        """The most tokens this request can generate: n_mc * max_tokens."""
        if self.max_tokens is None:
            raise ValueError("a token budget needs each response's continuation_limits")
        return self.n_mc * self.max_tokens


@dataclass(frozen=True)
class PrefixCounts:
    """What continuing one prefix gave: successes among its continuations and the tokens they have."""

    successes: int
    continuations: int
    tokens: int

    @property
    def success_rate(self) -> float:
        """v = successes / continuations (module docstring)."""
        return self.successes / self.continuations


@dataclass
class PrefixEstimates:
    """Counts of every continued prefix, keyed (row, step); the end of each first-pit search (row -> the pit:
    the first zero step, or ``num_steps`` when the last step's value is unknown and no zero was found); cost."""

    counts: dict[tuple[int, int], PrefixCounts] = field(default_factory=dict)
    pits: dict[int, int] = field(default_factory=dict)
    prefixes_skipped: int = 0
    continuations: int = 0
    tokens: int = 0
    rounds: int = 0


def first_pit_search_step(lo: int, hi: int, mid_is_zero: bool) -> tuple[int, int]:
    """One step of the binary search for the first zero of a monotone 0/1 sequence on [lo, hi).

    Invariant: every step < lo has value > 0, step hi has value 0 (or hi = H is the "no pit" sentinel).
    ``mid = (lo + hi) // 2`` was measured; returns the new (lo, hi). The search ends when lo == hi = the pit.
    """
    mid = (lo + hi) // 2
    return (lo, mid) if mid_is_zero else (mid + 1, hi)


def fixed_prefix_steps(candidates: int, count: int) -> list[int]:
    """``count`` of the steps 0..C - 1 (C = ``candidates``), evenly spaced, h_j = floor((j + 1) C / (count + 1)) for
    j < count; all of them when C <= count. Consecutive h_j differ by at least one when C > count: distinct."""
    if candidates <= count:
        return list(range(max(candidates, 0)))
    return [((j + 1) * candidates) // (count + 1) for j in range(count)]


def requested_steps(response: ResponseSteps, prefix_rule: str, prefixes_per_response: int,
                    success_labels: str) -> tuple[list[int], tuple[int, int] | None]:
    """The steps continued in the first round and the first-pit search interval [lo, hi) (None: no search).

    ``every``: 0..C - 1; ``fixed``: ``fixed_prefix_steps(C, prefixes_per_response)``; ``first_pit``: a failed
    response searches [0, C) (step C is its known zero, or C = H the "no pit" sentinel), a successful one gets
    0..C - 1 under ``success_labels="every"`` and nothing under ``"outcome"``.
    """
    if not response.sample or response.num_steps == 0:
        return [], None
    every = list(range(response.candidates))
    if prefix_rule == "every":
        return every, None
    if prefix_rule == "fixed":
        return fixed_prefix_steps(response.candidates, prefixes_per_response), None
    if response.success:
        return (every if success_labels == "every" else []), None
    return [], (0, response.candidates)


def _check_arguments(prefix_rule: str, n_mc: int, prefixes_per_response: int, success_labels: str,
                     token_budget: int | None) -> None:
    if prefix_rule not in PREFIX_RULES:
        raise ValueError(f"prefix_rule must be one of {PREFIX_RULES}, got {prefix_rule!r}")
    if isinstance(n_mc, bool) or not isinstance(n_mc, int) or n_mc < 1:
        raise ValueError(f"n_mc (continuations per step prefix) must be an integer >= 1, got {n_mc!r}")
    if prefix_rule == "fixed" and prefixes_per_response < 1:
        raise ValueError(f"prefixes_per_response must be >= 1, got {prefixes_per_response}")
    if success_labels not in SUCCESS_LABELS:
        raise ValueError(f"success_labels must be one of {SUCCESS_LABELS}, got {success_labels!r}")
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token_budget must be >= 1 or None, got {token_budget}")


def _admit(requests: list[PrefixRequest], remaining: int | None) -> tuple[list[PrefixRequest], list[PrefixRequest]]:
    """Split ``requests`` (in priority order) at the first one whose reserved tokens no longer fit ``remaining``:
    it and all after it are refused, so a refused prefix never has a lower priority than an admitted one."""
    if remaining is None:
        return requests, []
    for position, request in enumerate(requests):
        if request.reserved_tokens > remaining:
            return requests[:position], requests[position:]
        remaining -= request.reserved_tokens
    return requests, []


def _checked_counts(requests: list[PrefixRequest], counts: list[PrefixCounts]) -> None:
    if len(counts) != len(requests):
        raise RuntimeError(f"the sampler returned {len(counts)} results for {len(requests)} prefixes")
    for request, count in zip(requests, counts):
        if count.continuations != request.n_mc or not 0 <= count.successes <= request.n_mc:
            raise RuntimeError(
                f"the sampler returned {count.successes} successes of {count.continuations} continuations for "
                f"response {request.row} step {request.step}, but n_mc={request.n_mc} were asked for"
            )
        if count.tokens < 0:
            raise RuntimeError(f"the sampler reported {count.tokens} tokens for response {request.row} step "
                               f"{request.step}; a token count is >= 0")
        if request.max_tokens is not None and count.tokens > request.reserved_tokens:
            raise RuntimeError(
                f"the sampler generated {count.tokens} tokens for response {request.row} step {request.step}, "
                f"over its limit n_mc * max_tokens = {request.reserved_tokens}"
            )


def estimate_prefixes(
    responses: Sequence[ResponseSteps],
    sample: Callable[[list[PrefixRequest]], list[PrefixCounts]],
    *,
    prefix_rule: str,
    n_mc: int,
    prefixes_per_response: int = 4,
    success_labels: str = "outcome",
    prompt_rows: Sequence[int] = (),
    token_budget: int | None = None,
) -> PrefixEstimates:
    """Continue the prefixes of ``responses`` that ``prefix_rule`` asks for (module docstring), in rounds.

    The first round holds the prompts of ``prompt_rows`` (step -1, e.g. one row per prompt), the steps of
    ``requested_steps`` ordered by (step, row), and the first bisection midpoints; each later round the next
    midpoints. ``token_budget`` (None: unbounded) bounds the tokens generated over all rounds; a search whose
    midpoint it refuses ends with its known zero (the interval's upper end) as the pit.
    """
    _check_arguments(prefix_rule, n_mc, prefixes_per_response, success_labels, token_budget)
    result = PrefixEstimates()

    def request(row: int, step: int) -> PrefixRequest:
        limits = responses[row].continuation_limits
        return PrefixRequest(row, step, n_mc, None if limits is None or step < 0 else int(limits[step]))

    steps, searches = [], {}
    for row, response in enumerate(responses):
        wanted, search = requested_steps(response, prefix_rule, prefixes_per_response, success_labels)
        steps.extend(request(row, step) for step in wanted)
        if search is not None:
            searches[row] = search
    pending = [request(row, -1) for row in prompt_rows] + sorted(steps, key=lambda r: (r.step, r.row))
    while True:
        pending.extend(request(row, sum(span) // 2) for row, span in sorted(searches.items()) if span[0] < span[1])
        if not pending:
            break
        admitted, refused = _admit(pending, None if token_budget is None else token_budget - result.tokens)
        result.prefixes_skipped += len(refused)
        for skipped in refused:  # the budget ends this search: the known zero stays at its upper end
            if skipped.row in searches and skipped.step >= 0:
                searches[skipped.row] = (searches[skipped.row][1],) * 2
        if admitted:
            counts = sample(admitted)
            _checked_counts(admitted, counts)
            result.rounds += 1
            for asked, count in zip(admitted, counts):
                result.counts[(asked.row, asked.step)] = count
                result.continuations += count.continuations
                result.tokens += count.tokens
                if asked.row in searches and asked.step >= 0:  # a searched row's only requests: midpoints
                    searches[asked.row] = first_pit_search_step(*searches[asked.row], count.successes == 0)
        pending = []
    result.pits = {row: span[0] for row, span in searches.items()}
    return result


def shared_prefix_outcomes(
    prefixes: Sequence[tuple[Hashable, Sequence[Hashable]]],
    owners: Sequence[int | None],
    groups: Sequence[Hashable],
    responses: Sequence[Sequence[Hashable] | None],
    successes: Sequence[bool],
) -> list[tuple[int, int]]:
    """(successes, samples) of each prefix from the responses that continue it (module docstring, free samples).

    ``prefixes[j] = (group, tokens)``; response i (``responses[i]``: its tokens, None for a row that is no sample,
    e.g. padding) is a sample of prefix j iff ``groups[i]`` is its group, i is not ``owners[j]`` (the response the
    prefix was taken from; None: none is left out), and

        len(responses[i]) > len(tokens_j)  and  responses[i][:len(tokens_j)] == tokens_j,

    and then ``successes[i]`` counts. Tokens are any hashable items (token ids; the steps of a scripted task).
    The matching is :func:`prefix_match_sums`'s (each prefix a query row of its own that counts for nothing).
    """
    if not len(groups) == len(responses) == len(successes):
        raise ValueError(f"{len(groups)} groups, {len(responses)} responses and {len(successes)} successes")
    if len(owners) != len(prefixes):
        raise ValueError(f"{len(owners)} owners for {len(prefixes)} prefixes")
    rows = len(responses)
    sequences = [() if tokens is None else tokens for tokens in responses] + [tokens for _, tokens in prefixes]
    sums = prefix_match_sums(
        list(groups) + [group for group, _ in prefixes], sequences,
        [float(bool(success)) for success in successes] + [0.0] * len(prefixes),
        [(rows + j, len(tokens)) for j, (_, tokens) in enumerate(prefixes)], longer_only=True,
        counted=[tokens is not None for tokens in responses] + [False] * len(prefixes), exclude=owners)
    return [(int(total), count) for total, count in sums]


def prefix_match_sums(
    groups: Sequence[Hashable],
    sequences: Sequence[Sequence[Hashable]],
    values: Sequence[float],
    queries: Sequence[tuple[int, int]],
    *,
    longer_only: bool,
    counted: Sequence[bool] | None = None,
    exclude: Sequence[int | None] | None = None,
) -> list[tuple[float, int]]:
    """For each query (q, e): (sum of ``values[c]``, count) over the rows c that share the first e tokens of row q.

    Row c counts for query (q, e) iff ``counted[c]`` (default all), ``groups[c] == groups[q]``, c is not
    ``exclude[j]`` (the query's owner, None: none), ``sequences[c][:e] == sequences[q][:e]`` and
    ``len(sequences[c]) > e`` (``longer_only``: the rows that go on past the prefix) or ``>= e``. Query row q
    itself counts like any other row. Requires ``0 <= e <= len(sequences[q])``.

    Exact, without comparing every pair of rows token by token: per group the rows are sorted lexicographically
    (rows sharing a prefix are then contiguous), the common-prefix length of neighbours is read from one
    vectorised comparison, and that of any two rows is the minimum over the neighbours between them
    (``_common_prefix_lengths``). Cost per group of n rows of T tokens: a sort, O(n T) comparisons, O(n^2) minima.
    """
    import numpy as np  # here: this module is imported by command lines' --help, which load nothing heavy

    if not len(groups) == len(sequences) == len(values):
        raise ValueError(f"{len(groups)} groups, {len(sequences)} sequences and {len(values)} values")
    counted = [True] * len(sequences) if counted is None else [bool(x) for x in counted]
    exclude = [None] * len(queries) if exclude is None else list(exclude)
    if len(exclude) != len(queries) or len(counted) != len(sequences):
        raise ValueError(f"{len(exclude)} excluded rows for {len(queries)} queries, {len(counted)} counted flags "
                         f"for {len(sequences)} sequences")
    members: dict[Hashable, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    asked: dict[Hashable, list[int]] = {}
    for j, (q, e) in enumerate(queries):
        if not 0 <= e <= len(sequences[q]):
            raise ValueError(f"query ({q}, {e}): the prefix length must be in [0, {len(sequences[q])}] (row {q}'s "
                             "length)")
        asked.setdefault(groups[q], []).append(j)
    sums: list[tuple[float, int]] = [(0.0, 0)] * len(queries)
    for group, js in asked.items():
        rows = members[group]
        local = {row: i for i, row in enumerate(rows)}
        common = _common_prefix_lengths([sequences[row] for row in rows])
        lengths = np.array([len(sequences[row]) for row in rows], dtype=np.int64)
        weights = np.array([float(values[row]) if counted[row] else 0.0 for row in rows])
        usable = np.array([counted[row] for row in rows], dtype=bool)
        cuts = np.array([queries[j][1] for j in js], dtype=np.int64)
        match = (common[[local[queries[j][0]] for j in js]] >= cuts[:, None]) & usable[None, :]
        if longer_only:
            match &= lengths[None, :] > cuts[:, None]
        for k, j in enumerate(js):
            if exclude[j] is not None and exclude[j] in local:
                match[k, local[exclude[j]]] = False
        totals, counts = match @ weights, match.sum(axis=1)
        for k, j in enumerate(js):
            sums[j] = (float(totals[k]), int(counts[k]))
    return sums


def _common_prefix_lengths(sequences: Sequence[Sequence[Hashable]]):
    """[n, n] int64 numpy array: the length of the longest common prefix of each two sequences (the diagonal: each
    one's length). Tokens are mapped to integers (any hashable items; lists of ints are used as they are)."""
    import numpy as np

    rows = [_as_int_list(sequence) for sequence in sequences]
    if any(row is None for row in rows):  # not all integer tokens: one integer per distinct token
        ids: dict[Hashable, int] = {}
        rows = [[ids.setdefault(token, len(ids)) for token in sequence] for sequence in sequences]
    n = len(rows)
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    width = int(lengths.max(initial=0))
    order = sorted(range(n), key=rows.__getitem__)  # lexicographic: rows sharing a prefix are contiguous
    matrix = np.zeros((n, width), dtype=np.int64)
    for position, row in enumerate(order):
        matrix[position, : lengths[row]] = rows[row]
    ordered = lengths[order]
    differs = matrix[1:] != matrix[:-1]
    neighbours = np.where(differs.any(axis=1), differs.argmax(axis=1), width)
    neighbours = np.minimum(neighbours, np.minimum(ordered[1:], ordered[:-1]))
    common = np.empty((n, n), dtype=np.int64)
    common[np.arange(n), np.arange(n)] = ordered
    for i in range(n - 1):  # rows i < j sorted: the common prefix is the least over the neighbours between them
        common[i, i + 1:] = np.minimum.accumulate(neighbours[i:])
        common[i + 1:, i] = common[i, i + 1:]
    back = np.empty(n, dtype=np.int64)
    back[order] = np.arange(n)
    return common[back][:, back]


def _as_int_list(sequence: Sequence[Hashable]) -> list[int] | None:
    """The sequence as a list of Python ints when its tokens are integers, else None."""
    import numpy as np

    if len(sequence) == 0:
        return []
    try:
        array = np.asarray(sequence)
    except (TypeError, ValueError):
        return None
    # numpy makes ints of ints and bools together (True == 1, as in Python); anything else is mapped
    return array.tolist() if array.dtype.kind in "iu" and array.ndim == 1 else None
