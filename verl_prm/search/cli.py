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
"""

from __future__ import annotations

import argparse
import codecs
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from verl_prm.checkpoints import resolve_checkpoint
from verl_prm.choices import AGGREGATIONS
from verl_prm.cli_types import finite_float

if TYPE_CHECKING:
    from verl_prm.search import SearchResult

__all__ = ["SearchSetup", "add_sweep_arguments", "main", "run_sweep", "plot_accuracy_vs_compute", "summarize",
           "write_results"]

METHODS = ("best_of_n", "beam_q", "beam_pav", "greedy")
METHOD_LABELS = {
    "best_of_n": "best-of-N (ORM)",
    "beam_q": "beam search on Q",
    "beam_pav": "beam search on Q + alpha*A (PAV)",
    "greedy": "greedy step search",
}


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return methods


def add_sweep_arguments(p: argparse.ArgumentParser, default_n: Sequence[int]) -> None:
    """The sweep's arguments (methods, N, search settings, output), the same for every task."""
    p.add_argument("--output-dir", required=True)
    p.add_argument("--methods", type=_methods, default=list(METHODS[:3]),
                   help=f"comma-separated, from {', '.join(METHODS)} (default: best_of_n,beam_q,beam_pav)")
    p.add_argument("--n", type=_ints, default=list(default_n),
                   help=f"beam widths N to sweep (default {','.join(map(str, default_n))})")
    p.add_argument("--bon-n", type=_ints, default=None, help="best-of-N sample counts (default: N * samples-per-beam)")
    p.add_argument("--samples-per-beam", type=int, default=3, help="M: next steps sampled per beam")
    p.add_argument("--alpha", type=finite_float(0.0), default=0.5, help="weight of the prover's progress in Q + alpha*A")
    p.add_argument("--best-of-k", type=int, default=1, help="K of the Best-of-K prover (A from BoK values)")
    p.add_argument("--max-steps", type=int, default=32, help="steps after which a response is truncated")
    p.add_argument("--rank", choices=("orm", *AGGREGATIONS), default="orm",
                   help="best-of-N ranking: orm (final value) or an aggregation of the step scores")
    p.add_argument("--rank-scores", choices=("values", "progress"), default="values",
                   help="best-of-N: aggregate the step values or their progress")
    p.add_argument("--rank-critic", choices=("q", "prover"), default="q",
                   help="best-of-N: the critic whose scores rank the samples (default: the Q critic)")
    p.add_argument("--threshold", type=finite_float(), default=None,
                   help="greedy: accept a step iff its score >= threshold (default 0 for progress, 0.5 for value)")
    p.add_argument("--accept-on", choices=("value", "progress"), default="progress", help="greedy acceptance score")
    p.add_argument("--max-backtracks", type=int, default=2, help="greedy: backtracks per problem")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use the first LIMIT problems")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm search", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p, default_n=(1, 2, 4))
    text = p.add_argument_group("data set and models")
    text.add_argument("--input", help="problems: verl parquet rows or jsonl")
    text.add_argument("--prompt-field", default="prompt")
    text.add_argument("--answer-field", default="reward_model.ground_truth")
    text.add_argument("--answer-regex", default=None, help="extract the ground truth by this regex's first group")
    text.add_argument("--data-source-field", default="data_source")
    text.add_argument("--data-source", default=None, help="override the data source of every row")
    text.add_argument("--reward-fn", default=None, help="path.py:function or pkg://module:function (default: verl's default_compute_score)")
    text.add_argument("--policy", help="base policy: local HF model directory (or a vLLM model path)")
    text.add_argument("--q-critic", help="value critic of the base policy (HF directory)")
    text.add_argument("--q-critic-format", default="value_head")
    text.add_argument("--prover", default=None, help="prover critic (PAV); default: the Q critic with --best-of-k")
    text.add_argument("--prover-format", default="value_head")
    text.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    text.add_argument("--device", default=None)
    text.add_argument("--delimiter", default="\\n\\n", help="step delimiter (escapes like \\n are decoded)")
    text.add_argument("--step-regex", default=None, help="steps end at matches of this regex (hf back end)")
    text.add_argument("--max-step-tokens", type=int, default=256)
    text.add_argument("--max-response-tokens", type=int, default=1024)
    text.add_argument("--temperature", type=finite_float(0.0), default=1.0, help="0: greedy")
    text.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=1.0)
    text.add_argument("--batch-size", type=int, default=32, help="hf back end: sequences per generate call")
    return p


class SearchSetup:
    """What a sweep needs: problems, sampler, critic factories, the verifier and a text renderer."""

    def __init__(self, problems, sampler, q_critic: Callable[[], Any], prover: Callable[[], Any] | None,
                 reward: Callable, text: Callable) -> None:
        self.problems, self.sampler = problems, sampler
        self.q_critic, self.prover = q_critic, prover
        self.reward, self.text = reward, text


def _text_setup(args) -> SearchSetup:
    from verl_prm.critic import ProverCritic
    from verl_prm.labeling.inputs import read_prompts, render_prompt
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function
    from verl_prm.search.generation import HFStepSampler, TextCritic, VLLMStepSampler

    missing = [name for name in ("input", "policy", "q_critic") if getattr(args, name) is None]
    if missing:
        raise SystemExit(f"verl-prm search needs {', '.join('--' + m.replace('_', '-') for m in missing)}")
    for flag, path in (("--policy", args.policy), ("--q-critic", args.q_critic), ("--prover", args.prover)):
        if path is not None:  # no such directory, no weights, pickle-only, offline hub id: before any model loads
            resolve_checkpoint(path, flag)
    items = read_prompts(args.input, prompt_field=args.prompt_field, answer_field=args.answer_field,
                         data_source_field=args.data_source_field, data_source=args.data_source,
                         answer_regex=args.answer_regex, limit=args.limit)
    delimiter = codecs.decode(args.delimiter, "unicode_escape")
    common = dict(max_step_tokens=args.max_step_tokens, max_response_tokens=args.max_response_tokens,
                  temperature=args.temperature, top_p=args.top_p)
    if args.backend == "hf":
        sampler = HFStepSampler.from_pretrained(args.policy, [], device=args.device, delimiter=delimiter,
                                                regex=args.step_regex, batch_size=args.batch_size, **common)
        prompts = [render_prompt(item.prompt, sampler.tokenizer) for item in items]
        sampler.prompts = prompts
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.policy, trust_remote_code=False)
        prompts = [render_prompt(item.prompt, tokenizer) for item in items]
        sampler = VLLMStepSampler(args.policy, prompts, delimiter=delimiter, **common)
    scorer = OutcomeScorer(load_reward_function(args.reward_fn))

    def reward(node) -> float:
        item = items[node.problem]
        return float(scorer.success(scorer.score(item.data_source, "".join(node.steps), item.ground_truth, item.extra_info)))

    loaded: dict[str, Any] = {}

    def critic(path: str, format: str):
        def build():
            if path not in loaded:
                loaded[path] = ProverCritic.from_pretrained(path, format=format, device=args.device)
            return TextCritic(loaded[path], prompts)
        return build

    return SearchSetup(
        list(range(len(items))),
        sampler,
        critic(args.q_critic, args.q_critic_format),
        critic(args.prover, args.prover_format) if args.prover else None,
        reward,
        lambda node: "".join(node.steps),
    )


def run_sweep(args, setup: SearchSetup, log: Callable[[str], None] = print) -> list[dict]:
    """Run every method at every N; return one record per (method, N, problem). Critic caches are fresh per
    (method, N) run, so each run pays for its own critic calls."""
    from verl_prm.search import (BeamConfig, BestOfNConfig, CachedCritic, GreedyConfig, beam_search, best_of_n,
                                 greedy_step_search)

    beam_widths = args.n
    bon_ns = args.bon_n or [n * args.samples_per_beam for n in beam_widths]
    threshold = args.threshold if args.threshold is not None else (0.0 if args.accept_on == "progress" else 0.5)
    records: list[dict] = []
    plan: list[tuple[str, int]] = []
    for method in args.methods:
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
            ranker = prover if args.rank_critic == "prover" and prover is not None else q_critic
            results = best_of_n(setup.problems, setup.sampler, ranker,
                                BestOfNConfig(n=n, rank=args.rank, scores=args.rank_scores, seed=args.seed))
        elif method in ("beam_q", "beam_pav"):
            config = BeamConfig(beam_width=n, samples_per_beam=args.samples_per_beam,
                                alpha=0.0 if method == "beam_q" else args.alpha, best_of_k=args.best_of_k,
                                max_steps=args.max_steps, seed=args.seed)
            results = beam_search(setup.problems, setup.sampler, q_critic, prover, config)
        else:
            config = GreedyConfig(threshold=threshold, accept_on=args.accept_on, max_retries=n - 1,
                                  max_backtracks=args.max_backtracks, max_steps=args.max_steps,
                                  best_of_k=args.best_of_k, seed=args.seed)
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
    for method in METHODS:
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
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if "beam_pav" in args.methods and args.prover is None and args.best_of_k == 1:
        print("verl-prm search: beam_pav without --prover uses the Q critic as the prover; with --best-of-k 1 its "
              "progress only re-weights Q (set --best-of-k 4, the paper's choice, or pass --prover)", file=sys.stderr)
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    setup = _text_setup(args)
    records = run_sweep(args, setup)
    title = f"{Path(args.input).name}, {len(setup.problems)} problems, alpha={args.alpha:g}, M={args.samples_per_beam}"
    write_results(output, records, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
