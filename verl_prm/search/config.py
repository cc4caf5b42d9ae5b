"""``SearchConfig``: the settings of `verl-prm search`, each declared once with its default, doc and bounds.

``SweepConfig`` holds the sweep's settings (methods, budgets N, search knobs, output), which ``verl-prm demo
search`` shares; ``SearchConfig`` adds the data set, the models and the generation. The command lines build their
flags from these fields (``verl_prm.search.cli``), and the same classes work from Python, e.g.
``SearchConfig(output_dir="runs/x", input="gsm8k.parquet", policy=..., q_critic=..., n=(1, 2, 4))``; a bad value
is a ``ValueError`` naming the field and its flag (``"top_p (--top-p) must be in (0, 1] ..."``), raised before any
model loads. Imports no torch, so that ``verl-prm search --help`` starts fast.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal, Optional, get_args

from verl_prm.checks import check_number, empty_match_problem
from verl_prm.choices import Aggregation, CheckpointFormat, GeneratorBackend
from verl_prm.cli_types import flag_of
from verl_prm.settings import check_bounds, check_choices, check_integer, setting

__all__ = ["SEARCH_METHODS", "SearchConfig", "SearchMethod", "SweepConfig", "flag_key"]

# The search methods of a sweep (what each does: the module docstring of verl_prm.search.cli).
SearchMethod = Literal["best_of_n", "beam_q", "beam_pav", "greedy"]
SEARCH_METHODS = get_args(SearchMethod)
# Best-of-N's ranking: the final value ("orm", the critic as an outcome verifier) or an aggregation of step scores.
BestOfNRank = Literal["orm", Aggregation]
RankScores = Literal["values", "progress"]
RankCritic = Literal["q", "prover"]
AcceptOn = Literal["value", "progress"]

# The fields whose flag takes comma-separated values (``--n 1,2,4``); every other flag is built by
# verl_prm.cli_types.add_dataclass_arguments.
COMMA_SEPARATED = ("methods", "n", "bon_n")


@dataclass(frozen=True)
class SweepConfig:
    """The sweep: which methods run at which budgets, with which search settings, and where results go."""

    output_dir: str = setting(doc="results.jsonl, summary.csv, summary.md and accuracy_vs_compute.png go here.")
    methods: tuple[SearchMethod, ...] = setting(("best_of_n", "beam_q", "beam_pav"), "Search methods to run, "
                                                f"comma-separated, from {', '.join(SEARCH_METHODS)}.")
    n: tuple[int, ...] = setting((1, 2, 4), "Beam widths N to sweep, comma-separated (greedy: 1 + R = N samples per "
                                 "prefix).")
    bon_n: Optional[tuple[int, ...]] = setting(None, "Best-of-N sample counts, comma-separated (default: N * "
                                               "samples-per-beam for every N).")
    samples_per_beam: int = setting(3, "M: next steps sampled per beam.", low=1)
    alpha: float = setting(0.5, "Weight of the prover's progress in Q + alpha*A (beam_pav).", low=0.0)
    best_of_k: int = setting(1, "K of the Best-of-K prover (A from BoK values).", low=1)
    max_steps: int = setting(32, "Steps after which a response is truncated.", low=1)
    rank: BestOfNRank = setting("orm", "Best-of-N ranking: orm (final value) or an aggregation of the step scores.")
    rank_scores: RankScores = setting("values", "Best-of-N: aggregate the step values or their progress.")
    rank_critic: RankCritic = setting("q", "Best-of-N: the critic whose scores rank the samples, q (the Q critic) "
                                      "or prover.")
    threshold: Optional[float] = setting(None, "Greedy: accept a step iff its score >= threshold (default 0 for "
                                         "progress, 0.5 for value).")
    accept_on: AcceptOn = setting("progress", "Greedy acceptance score.")
    max_backtracks: int = setting(2, "Greedy: backtracks per problem.", low=0)
    seed: int = setting(0, "Seed of the sampling.", low=0)
    limit: Optional[int] = setting(None, "Use the first LIMIT problems.", low=1)

    def __post_init__(self) -> None:
        check_choices(self, flag_key)
        check_bounds(self, flag_key)
        _check_methods(self.methods)
        object.__setattr__(self, "methods", tuple(self.methods))  # the command line gives a list
        for name in ("n", "bon_n"):
            values = getattr(self, name)
            if values is not None:
                object.__setattr__(self, name, _positive_integers(name, values))
        if self.threshold is not None:
            object.__setattr__(self, "threshold", check_number(flag_key("threshold"), self.threshold))

    @property
    def best_of_n_sizes(self) -> tuple[int, ...]:
        """The sample counts of best-of-N: ``bon_n``, else N * M for every beam width N."""
        return self.bon_n or tuple(n * self.samples_per_beam for n in self.n)

    @property
    def greedy_threshold(self) -> float:
        """Greedy's acceptance threshold: ``threshold``, else 0 for progress (the step helps) and 0.5 for value."""
        if self.threshold is not None:
            return self.threshold
        return 0.0 if self.accept_on == "progress" else 0.5


@dataclass(frozen=True, kw_only=True)
class SearchConfig(SweepConfig):
    """Settings of `verl-prm search` (its flags are these fields; `verl-prm search --help` lists them)."""

    input: str = setting(doc="Problems: verl parquet rows or jsonl.")
    prompt_field: str = setting("prompt", "Column (dotted for nested fields) of the prompt.")
    answer_field: str = setting("reward_model.ground_truth", "Column (dotted for nested fields) of the answer.")
    answer_regex: Optional[str] = setting(None, "Extract the ground truth by this regex's first group.")
    data_source_field: str = setting("data_source", "Column of the data source (which verifier scores a row).")
    data_source: Optional[str] = setting(None, "Override the data source of every row.")
    reward_fn: Optional[str] = setting(None, "path.py:function or pkg://module:function (default: verl's "
                                       "default_compute_score).")
    policy: str = setting(doc="Base policy: local HF model directory (or a vLLM model path).")
    q_critic: str = setting(doc="Value critic of the base policy (HF directory).")
    q_critic_format: CheckpointFormat = setting("value_head", "Checkpoint format of --q-critic "
                                                "(verl_prm.critic.ProverCritic).")
    prover: Optional[str] = setting(None, "Prover critic (PAV); default: the Q critic with --best-of-k.")
    prover_format: CheckpointFormat = setting("value_head", "Checkpoint format of --prover.")
    backend: GeneratorBackend = setting("hf", "Generation back end: hf (transformers, CPU or GPU) or vllm (GPU).")
    device: Optional[str] = setting(None, "cpu, cuda, cuda:1 (default: cuda if present).")
    delimiter: str = setting("\n\n", "Step delimiter (the escapes \\n, \\t, ... are decoded by the command line).")
    step_regex: Optional[str] = setting(None, "Steps end at matches of this regex (hf back end).")
    max_step_tokens: int = setting(256, "Tokens per step at most.", low=1)
    max_response_tokens: int = setting(1024, "Tokens per response at most.", low=1)
    temperature: float = setting(1.0, "Sampling temperature (0: greedy).", low=0.0)
    top_p: float = setting(1.0, "Nucleus sampling's probability mass.", low=0.0, high=1.0, low_open=True)
    batch_size: int = setting(32, "hf back end: sequences per generate call.", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.delimiter and self.step_regex is None:
            raise ValueError(f"{flag_key('delimiter')} must not be empty: steps end at it (or pass --step-regex)")
        if self.step_regex is not None:
            if self.backend != "hf":
                raise ValueError(f"{flag_key('step_regex')} applies to the hf back end; the {self.backend} back end "
                                 "ends steps at --delimiter only: drop --step-regex, or pass --backend hf")
            try:
                problem = empty_match_problem(re.compile(self.step_regex))
            except re.error as error:
                raise ValueError(f"{flag_key('step_regex')} is not a regex: {error}") from None
            if problem is not None:
                raise ValueError(f"{flag_key('step_regex')} {self.step_regex!r} {problem}")


def flag_key(name: str) -> str:
    """How an error names setting ``name``: ``"samples_per_beam (--samples-per-beam)"``."""
    return f"{name} ({flag_of(_FIELDS[name])})"


_FIELDS = {f.name: f for f in dataclasses.fields(SearchConfig)}


def _check_methods(methods: tuple) -> None:
    if isinstance(methods, str) or not methods:
        raise ValueError(f"{flag_key('methods')} must name one or more of {', '.join(SEARCH_METHODS)}, got {methods!r}")
    unknown = [m for m in methods if m not in SEARCH_METHODS]
    if unknown:
        raise ValueError(f"{flag_key('methods')}: unknown method(s) {unknown}; choose from {', '.join(SEARCH_METHODS)}")
    _check_unique("methods", methods)


def _positive_integers(name: str, values: tuple) -> tuple[int, ...]:
    """``values`` as a tuple of integers >= 1, each once (a repeated one would run twice and merge in the
    summary); else ``ValueError`` naming the field and its flag."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__") or not len(values):
        raise ValueError(f"{flag_key(name)} must be one or more integers >= 1, got {values!r}")
    numbers = tuple(check_integer(f"{flag_key(name)}[{i}]", v, 1) for i, v in enumerate(values))
    _check_unique(name, numbers)
    return numbers


def _check_unique(name: str, values: tuple) -> None:
    repeated = sorted({v for v in values if values.count(v) > 1}, key=values.index)
    if repeated:
        raise ValueError(f"{flag_key(name)} lists {', '.join(map(str, repeated))} more than once: each run would be "
                         "repeated and merged in the summary; name each once")
