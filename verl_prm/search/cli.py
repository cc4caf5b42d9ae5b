"""`verl-prm search`: best-of-N, beam search on Q (+ alpha * A) and greedy step search over a data set, swept
over N, with per-problem results, a summary table and a plot of accuracy against generated tokens.

    verl-prm search --input gsm8k.parquet --policy PATH --q-critic PATH [--prover PATH] \\
        --output-dir runs/search_gsm8k

The same sweep on the demo's planted task with exact critics is ``verl-prm demo search`` (it builds its parser
with :func:`add_sweep_arguments` and runs :func:`run_sweep` and :func:`write_results`).

Methods (``--methods``, comma-separated):
    best_of_n  N' = N * M full samples (``--bon-n`` to set them), re-ranked by ``--rank`` (``orm``: the final
               value as an outcome verifier; or min/max/mean/sum/product/last of the step values or progress,
               ``--rank-scores``) of the Q critic (or of the prover: ``--rank-critic prover``)
    beam_q     beam search, width N, M = ``--samples-per-beam`` steps per beam, ranked by Q alone
    beam_pav   the same, ranked by Q + alpha * A (A from ``--prover``, or from the Q critic with ``--best-of-k``)
    greedy     greedy step search with 1 + R = N samples per prefix (R = N - 1 retries), accepting on the
               prover's (or the Q critic's) value or progress against ``--threshold``

Outputs in ``--output-dir``: ``results.jsonl`` (one line per method, N and problem), ``summary.csv`` and
``summary.md`` (accuracy and mean compute per method and N), ``accuracy_vs_compute.png``.

Every flag is a field of :class:`verl_prm.search.config.SearchConfig` (its default, doc, bounds and choices are the
flag's), and the settings are checked there, before any model loads.
"""

from __future__ import annotations

import argparse
import codecs
import csv
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from verl_prm.checkpoints import resolve_checkpoint
from verl_prm.cli_types import add_dataclass_arguments, flag_of
from verl_prm.labeling.inputs import read_prompts, render_prompt
from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function
from verl_prm.search.config import COMMA_SEPARATED, SEARCH_METHODS, SearchConfig, SweepConfig

if TYPE_CHECKING:
    from verl_prm.search import SearchResult

__all__ = ["SearchSetup", "add_sweep_arguments", "build_parser", "main", "run_sweep", "plot_accuracy_vs_compute",
           "search_config", "summarize", "sweep_config", "write_results"]

METHOD_LABELS = {
    "best_of_n": "best-of-N (ORM)",
    "beam_q": "beam search on Q",
    "beam_pav": "beam search on Q + alpha*A (PAV)",
    "greedy": "greedy step search",
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in SEARCH_METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {', '.join(SEARCH_METHODS)}")
    return methods


# The argparse type of each comma-separated field (SweepConfig's tuples; the config checks the values again).
_COMMA_TYPES = {"methods": _methods, "n": _ints, "bon_n": _ints}


def _add_flags(parser: Any, cls: type, names: Sequence[str], defaults: dict[str, Any] | None = None) -> None:
    """The flags of fields ``names`` of settings dataclass ``cls``, in that order: a comma-separated list for
    the tuple fields (``--n 1,2,4``), ``add_dataclass_arguments``'s flag for the others. ``defaults`` overrides
    a field's default on this parser."""
    every = [f.name for f in dataclasses.fields(cls)]
    for field in dataclasses.fields(cls):
        if field.name not in names:
            continue
        if field.name not in COMMA_SEPARATED:
            add_dataclass_arguments(parser, cls, skip=tuple(n for n in every if n != field.name))
            continue
        default = (defaults or {}).get(field.name, field.default)
        help_text = field.metadata["doc"] + (f" (default: {','.join(map(str, default))})" if default else "")
        parser.add_argument(flag_of(field), dest=field.name, type=_COMMA_TYPES[field.name], default=default,
                            help=help_text.replace("%", "%%"))


def add_sweep_arguments(p: argparse.ArgumentParser, default_n: Sequence[int]) -> None:
    """The sweep's arguments (methods, N, search settings, output), the same for every task: one flag per field of
    :class:`SweepConfig` (``default_n``: this command's default N)."""
    _add_flags(p, SweepConfig, [f.name for f in dataclasses.fields(SweepConfig)], {"n": tuple(default_n)})


def build_parser() -> argparse.ArgumentParser:
    """The parser of `verl-prm search`: one flag per field of :class:`SearchConfig`."""
    p = argparse.ArgumentParser(prog="verl-prm search", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p, default_n=SearchConfig.__dataclass_fields__["n"].default)
    sweep = {f.name for f in dataclasses.fields(SweepConfig)}
    _add_flags(p.add_argument_group("data set and models"), SearchConfig,
               [f.name for f in dataclasses.fields(SearchConfig) if f.name not in sweep])
    return p


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The settings of a parsed `verl-prm search` command line (the delimiter's escapes such as \\n decoded)."""
    return SearchConfig(**{**vars(args), "delimiter": codecs.decode(args.delimiter, "unicode_escape")})


def sweep_config(settings: Any) -> SweepConfig:
    """``settings`` as a :class:`SweepConfig` (checked): itself, or the sweep fields of a parsed command line
    (``verl-prm demo search`` parses its own flags next to the sweep's)."""
    if isinstance(settings, SweepConfig):
        return settings
    return SweepConfig(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(SweepConfig)})


class SearchSetup:
    """What a sweep needs: problems, sampler, critic factories, the verifier and a text renderer."""

    def __init__(self, problems, sampler, q_critic: Callable[[], Any], prover: Callable[[], Any] | None,
                 reward: Callable, text: Callable) -> None:
        self.problems, self.sampler = problems, sampler
        self.q_critic, self.prover = q_critic, prover
        self.reward, self.text = reward, text


def _text_setup(config: SearchConfig) -> SearchSetup:
    # the models (torch, transformers): not at `verl-prm search --help`
    from verl_prm.search.generation import HFStepSampler, VLLMStepSampler, text_critic_factory

    for flag, path in (("--policy", config.policy), ("--q-critic", config.q_critic), ("--prover", config.prover)):
        if path is not None:  # no such directory, no weights, pickle-only, offline hub id: before any model loads
            resolve_checkpoint(path, flag)
    items = read_prompts(config.input, prompt_field=config.prompt_field, answer_field=config.answer_field,
                         data_source_field=config.data_source_field, data_source=config.data_source,
                         answer_regex=config.answer_regex, limit=config.limit)
    delimiter = config.delimiter
    common = dict(max_step_tokens=config.max_step_tokens, max_response_tokens=config.max_response_tokens,
                  temperature=config.temperature, top_p=config.top_p)
    if config.backend == "hf":
        sampler = HFStepSampler.from_pretrained(config.policy, [], device=config.device, delimiter=delimiter,
                                                regex=config.step_regex, batch_size=config.batch_size, **common)
        prompts = [render_prompt(item.prompt, sampler.tokenizer) for item in items]
        sampler.prompts = prompts
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.policy, trust_remote_code=False)
        prompts = [render_prompt(item.prompt, tokenizer) for item in items]
        sampler = VLLMStepSampler(config.policy, prompts, delimiter=delimiter, **common)
    scorer = OutcomeScorer(load_reward_function(config.reward_fn))

    def reward(node) -> float:
        item = items[node.problem]
        return float(scorer.success(scorer.score(item.data_source, "".join(node.steps), item.ground_truth, item.extra_info)))

    critic = text_critic_factory(prompts, config.device)
    return SearchSetup(
        list(range(len(items))),
        sampler,
        critic(config.q_critic, config.q_critic_format),
        critic(config.prover, config.prover_format) if config.prover else None,
        reward,
        lambda node: "".join(node.steps),
    )


def run_sweep(settings: SweepConfig | argparse.Namespace, setup: SearchSetup,
              log: Callable[[str], None] = print) -> list[dict]:
    """Run every method at every N of ``settings`` (a :class:`SweepConfig`, or a parsed command line with its
    fields: :func:`sweep_config`); return one record per (method, N, problem). Critic caches are fresh per
    (method, N) run, so each run pays for its own critic calls."""
    # the search methods (torch): not at `verl-prm search --help`
    from verl_prm.search import (BeamConfig, BestOfNConfig, CachedCritic, GreedyConfig, beam_search, best_of_n,
                                 greedy_step_search)

    sweep = sweep_config(settings)
    beam_widths = sweep.n
    bon_ns = sweep.best_of_n_sizes
    threshold = sweep.greedy_threshold
    records: list[dict] = []
    plan: list[tuple[str, int]] = []
    for method in sweep.methods:
        plan += [(method, n) for n in (bon_ns if method == "best_of_n" else beam_widths)]
    try:
        from tqdm.auto import tqdm

        iterator = tqdm(plan, desc="search", unit="run")
    except ImportError:  # pragma: no cover - tqdm is a dependency
        iterator = plan
    for method, n in iterator:
        started = time.perf_counter()
        q_critic = CachedCritic(setup.q_critic(), "q_critic")
        prover = CachedCritic(setup.prover(), "prover") if setup.prover is not None else None
        if method == "best_of_n":
            ranker = prover if sweep.rank_critic == "prover" and prover is not None else q_critic
            results = best_of_n(setup.problems, setup.sampler, ranker,
                                BestOfNConfig(n=n, rank=sweep.rank, scores=sweep.rank_scores, seed=sweep.seed))
        elif method in ("beam_q", "beam_pav"):
            config = BeamConfig(beam_width=n, samples_per_beam=sweep.samples_per_beam,
                                alpha=0.0 if method == "beam_q" else sweep.alpha, best_of_k=sweep.best_of_k,
                                max_steps=sweep.max_steps, seed=sweep.seed)
            results = beam_search(setup.problems, setup.sampler, q_critic, prover, config)
        else:
            config = GreedyConfig(threshold=threshold, accept_on=sweep.accept_on, max_retries=n - 1,
                                  max_backtracks=sweep.max_backtracks, max_steps=sweep.max_steps,
                                  best_of_k=sweep.best_of_k, seed=sweep.seed)
            results = greedy_step_search(setup.problems, setup.sampler, prover if prover is not None else q_critic, config)
        seconds = time.perf_counter() - started
        # steps merged because they end in one critic token (TextCritic; 0 for critics that read no tokens)
        merged: dict[int, int] = {}
        for cached in (q_critic, prover):
            for problem, count in getattr(getattr(cached, "critic", None), "merged_steps", {}).items():
                merged[problem] = merged.get(problem, 0) + count
        for result in results:
            records.append(_record(method, n, result, setup, merged.get(result.problem, 0)))
        accuracy = sum(r["reward"] for r in records[-len(results):]) / max(len(results), 1)
        note = ""
        if merged:
            note = (f"; {sum(merged.values())} critic step values in {len(merged)} problem(s) were read at a token "
                    "shared with the previous step (merged steps; see critic_merged_steps in results.jsonl)")
        log(f"{method:>10} N={n:<4} accuracy={accuracy:.3f} ({seconds:.1f} s){note}")
    return records


def _record(method: str, n: int, result: SearchResult, setup: SearchSetup, critic_merged_steps: int = 0) -> dict:
    node = result.node
    return dict(method=method, n=n, problem=result.problem, reward=float(setup.reward(node)), score=result.score,
                num_steps=node.num_steps, truncated=node.truncated, response_tokens=node.num_tokens,
                response=setup.text(node), **result.compute.as_dict(), critic_merged_steps=critic_merged_steps,
                info=result.info)


def summarize(records: Sequence[dict]) -> list[dict]:
    """Accuracy and mean compute per (method, n), in first-seen order."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["method"], record["n"]), []).append(record)
    rows = []
    for (method, n), group in groups.items():
        count = len(group)
        rows.append(dict(
            method=method, n=n, problems=count,
            accuracy=sum(r["reward"] for r in group) / count,
            generated_tokens=sum(r["generated_tokens"] for r in group) / count,
            critic_tokens=sum(r["critic_tokens"] for r in group) / count,
            step_samples=sum(r["step_samples"] for r in group) / count,
        ))
    return rows


def _markdown(rows: Sequence[dict]) -> str:
    lines = ["| method | N | accuracy | generated tokens / problem | critic tokens / problem | sampled steps / problem |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['n']} | {r['accuracy']:.3f} | {r['generated_tokens']:.1f} | "
                     f"{r['critic_tokens']:.1f} | {r['step_samples']:.1f} |")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_compute(rows: Sequence[dict], path: str | Path, title: str = "") -> None:
    """Accuracy against mean generated tokens per problem (log scale), one line per method, N annotated."""
    import matplotlib.pyplot as plt

    figure = accuracy_vs_compute_figure(rows, title)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def accuracy_vs_compute_figure(rows: Sequence[dict], title: str = ""):
    """The figure of `plot_accuracy_vs_compute` (matplotlib, Agg backend; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.4))
    for method in SEARCH_METHODS:
        points = sorted((r["generated_tokens"], r["accuracy"], r["n"]) for r in rows if r["method"] == method)
        if not points:
            continue
        xs, ys, ns = zip(*points)
        axis.plot(xs, ys, marker="o", label=METHOD_LABELS[method])
        for x, y, n in points:
            axis.annotate(f"{n}", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    axis.set_xscale("log")
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    # Decade ticks alone label one or two points of a sweep that spans about a decade (22 to 450 tokens: only
    # "100"); 1-2-5 ticks label every factor of about 2 while the range is under three decades.
    xs = [r["generated_tokens"] for r in rows if r["generated_tokens"] > 0]
    decades = math.log10(max(xs) / min(xs)) if xs else 0.0
    axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades < 3 else (1.0,)))
    axis.xaxis.set_major_formatter(ScalarFormatter())
    axis.xaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel("generated tokens per problem (log scale)")
    axis.set_ylabel("accuracy")
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def write_results(output: Path, records: Sequence[dict], title: str) -> str:
    """``results.jsonl``, ``summary.csv``, ``summary.md`` and ``accuracy_vs_compute.png`` in ``output``; prints
    and returns the summary table."""
    with open(output / "results.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    rows = summarize(records)
    with open(output / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = _markdown(rows)
    (output / "summary.md").write_text(table)
    plot_accuracy_vs_compute(rows, output / "accuracy_vs_compute.png", title)
    print(table)
    print(f"wrote {output / 'results.jsonl'}, {output / 'summary.csv'}, {output / 'accuracy_vs_compute.png'}")
    return table


def main(argv: list[str] | None = None) -> int:
    # every setting is checked here, before any model loads
    config = search_config(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    if "beam_pav" in config.methods and config.prover is None and config.best_of_k == 1:
        print("verl-prm search: beam_pav without --prover uses the Q critic as the prover; with --best-of-k 1 its "
              "progress only re-weights Q (set --best-of-k 4, the paper's choice, or pass --prover)", file=sys.stderr)
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    setup = _text_setup(config)
    records = run_sweep(config, setup)
    title = (f"{Path(config.input).name}, {len(setup.problems)} problems, alpha={config.alpha:g}, "
             f"M={config.samples_per_beam}")
    write_results(output, records, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
