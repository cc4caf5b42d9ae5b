"""The PAV paper's test-time claim on SmolLM2: PAV beam search against best-of-N by an outcome verifier (ORM) and
majority vote at equal generated tokens, on the word-problem recipe's test problems (docs/real_model.md, "Test-time
search").

    python -m studies.word_problems_search --work-dir runs/wp --test-problems 512 --problems 200 \\
        --pav runs/wp_final/tlp --orm runs/wp_final/orm --out runs/wp_search \\
        --export docs/real_model/search.json

``--pav`` and ``--orm`` are ``verl-prm train`` checkpoints (value_head or token_logprob format, read from the
checkpoint) fitted on the recipe's training label problems; the ORM on the same rollouts with every step labelled
by the rollout's outcome (``verl_prm.apps.word_problems.search.outcome_labels``). Every method draws on the first
``--problems`` test problems of the work directory's data stage (``--test-problems`` is the count the data stage
was run with), through the recipe's own sampler and search code (``compare_at_budgets``): best-of-N and majority
vote read the first N of one draw of ``max(N)`` samples per problem, beam search generates its own. A method's
budget is its mean generated tokens per problem; accuracy's standard error is over problems.

Besides the rows (each with every problem's outcome), the study reports the tokens each method needs to reach
majority vote's accuracy at N = 8 (linear interpolation between the two budgets around it on the method's
accuracy-by-tokens curve; "not reached" when its largest budget stays below), each beam width against majority
vote and best-of-N by the ORM at the nearest budget on the same problems (the difference, a bootstrap interval
over problems, McNemar's exact p), and plots accuracy against tokens. Rows are saved as they finish
(``rows.partial.json``, with the settings): rerunning the same command resumes; other settings are an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from verl_prm.cli_types import finite_float

REFERENCE = ("majority_vote", 8)


def tokens_to_reach(rows: Sequence[dict], method: str, target: float) -> Optional[float]:
    """The generated tokens per problem at which ``method``'s accuracy first reaches ``target``: its rows in order
    of tokens, linear between the last budget below the target and the first at or above it; that first budget
    itself when it is the smallest; None when no budget reaches it."""
    points = sorted((r["tokens_per_problem"], r["accuracy"]) for r in rows if r["method"] == method)
    for i, (tokens, accuracy) in enumerate(points):
        if accuracy >= target:
            if i == 0:
                return float(tokens)
            (t0, a0), (t1, a1) = points[i - 1], (tokens, accuracy)
            return float(t0 + (target - a0) / (a1 - a0) * (t1 - t0))
    return None


def paired_at_equal_tokens(rows: Sequence[dict]) -> list[dict]:
    """Each PAV beam search row against majority vote and best-of-N by the ORM at the N whose tokens per problem
    are nearest to the beam's, on the same problems (``paired_difference``: the accuracy difference, its bootstrap
    interval over problems and McNemar's exact p)."""
    from verl_prm.apps.word_problems.search import paired_difference

    out = []
    for beam in sorted((r for r in rows if r["method"] == "beam_pav"), key=lambda r: r["n"]):
        for method in ("majority_vote", "best_of_n_orm"):
            candidates = [r for r in rows if r["method"] == method]
            if not candidates:
                continue
            other = min(candidates, key=lambda r: abs(r["tokens_per_problem"] - beam["tokens_per_problem"]))
            out.append({"beam_width": beam["n"], "beam_tokens": beam["tokens_per_problem"], "against": method,
                        "n": other["n"], "tokens": other["tokens_per_problem"],
                        **paired_difference(beam["correct"], other["correct"])})
    return out


def summary(rows: Sequence[dict]) -> dict:
    """Majority vote's accuracy at N = 8, the tokens each method needs to reach it, and the paired comparisons of
    beam search with the other methods at equal tokens."""
    reference = [r for r in rows if (r["method"], r["n"]) == REFERENCE]
    if not reference:
        raise ValueError(f"no {REFERENCE[0]} row at N = {REFERENCE[1]}: run with 8 among --best-of-n")
    target = reference[0]["accuracy"]
    methods = sorted({r["method"] for r in rows})
    return {"target": {"method": REFERENCE[0], "n": REFERENCE[1], "accuracy": target,
                       "tokens_per_problem": reference[0]["tokens_per_problem"]},
            "tokens_to_reach_target": {m: tokens_to_reach(rows, m, target) for m in methods},
            "paired": paired_at_equal_tokens(rows)}


def report(rows: Sequence[dict], facts: dict) -> str:
    from verl_prm.apps.word_problems.search import markdown_table

    lines = [markdown_table(rows), "",
             f"Tokens per problem to reach {facts['target']['method']} N={facts['target']['n']}'s accuracy "
             f"({facts['target']['accuracy']:.3f}, {facts['target']['tokens_per_problem']:.0f} tokens):", "",
             "| method | tokens per problem |", "|---|---|"]
    for method, tokens in facts["tokens_to_reach_target"].items():
        lines.append(f"| {method} | {'not reached' if tokens is None else f'{tokens:.0f}'} |")
    if facts["paired"]:
        lines += ["", "PAV beam search against the other methods at the nearest budget, on the same problems "
                  "(difference in accuracy, 95% bootstrap interval over problems, McNemar's exact p):", "",
                  "| beam width (tokens) | against, N (tokens) | difference | 95% interval | solved by beam only / "
                  "other only | McNemar p |", "|---|---|---|---|---|---|"]
        for c in facts["paired"]:
            lines.append(f"| {c['beam_width']} ({c['beam_tokens']:.0f}) | {c['against']}, {c['n']} ({c['tokens']:.0f}) "
                         f"| {c['difference']:+.3f} | [{c['interval'][0]:+.3f}, {c['interval'][1]:+.3f}] | "
                         f"{c['only_first']} / {c['only_second']} | {c['mcnemar_p']:.3g} |")
    return "\n".join(lines)


def plot(rows: Sequence[dict], facts: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for method in sorted({r["method"] for r in rows}):
        points = sorted((r["tokens_per_problem"], r["accuracy"], r["stderr"], r["n"]) for r in rows
                        if r["method"] == method)
        tokens, accuracy, stderr, ns = zip(*points)
        axes.errorbar(tokens, accuracy, yerr=stderr, marker="o", capsize=3, label=method)
        for t, a, n in zip(tokens, accuracy, ns):
            axes.annotate(str(n), (t, a), textcoords="offset points", xytext=(3, 3), fontsize=7)
    axes.axhline(facts["target"]["accuracy"], color="grey", linestyle=":", linewidth=1,
                 label=f"majority vote, N={facts['target']['n']}")
    axes.set_xscale("log")
    axes.set_xlabel("generated tokens per problem")
    axes.set_ylabel("accuracy (+- s.e. over problems)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.word_problems_search", description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, required=True, help="the word-problem recipe's work dir (data, policy)")
    p.add_argument("--test-problems", type=int, required=True, help="the data stage's --test-problems")
    p.add_argument("--problems", type=int, default=200, help="the first test problems searched")
    p.add_argument("--pav", type=Path, required=True)
    p.add_argument("--orm", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--best-of-n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--beam-widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--samples-per-beam", type=int, default=2)
    p.add_argument("--alpha", type=finite_float(0.0), default=0.5)
    p.add_argument("--best-of-k", type=int, default=4)
    p.add_argument("--pav-rank", default="min")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--export", type=Path, default=None, help="also write the rows and the summary here (JSON)")
    return p


def run(config, work_dir: Path, pav: Path, orm: Path, out: Path, *, threads: int = 1,
        export: Optional[Path] = None, log=print) -> dict:
    """The study on the recipe ``config``'s work directory (its data and SFT stages complete, made with ``config``'s
    settings), searching its first ``config.search_problems`` test problems with the search settings of ``config``
    on ``threads`` torch threads (not a setting of the results); returns what results.json holds."""
    import torch

    from studies.word_problems_pav import resolve_critic
    from verl_prm.apps.word_problems.pipeline import (MAX_STEPS, read_partial_rows, search_critic, search_sampler,
                                                      split_problems, stages_of)
    from verl_prm.apps.word_problems.search import compare_at_budgets
    from verl_prm.critic.token_logprob_head import native_format
    from verl_prm.locking import DirectoryLock
    from verl_prm.resume import write_settings

    if REFERENCE[1] not in config.best_of_n:
        raise ValueError(f"best_of_n {config.best_of_n}: the study compares with majority vote at N = "
                         f"{REFERENCE[1]}, so it needs {REFERENCE[1]} among them")
    stages = stages_of(config, Path(work_dir))
    for name in ("data", "sft") if config.sft is not None else ("data",):
        if not stages[name].done():  # done() compares the recorded settings: other data is an error there
            raise FileNotFoundError(f"{stages[name].path}: the recipe's {name} stage is not complete; run `verl-prm "
                                    f"recipe word-problems --work-dir {work_dir} --test-problems "
                                    f"{config.test_problems} --stages data,sft` first")
    pav, orm = resolve_critic(Path(pav)), resolve_critic(Path(orm))
    # the search stage's settings with these critics in place of the recipe's own, and the policy they search with
    settings = {**stages["search"].settings, "pav": str(pav), "orm": str(orm), "policy": stages["sft"].settings}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with DirectoryLock(out, "word-problem search study"):
            partial = out / "rows.partial.json"
            finished = read_partial_rows(partial, settings)
            splits = split_problems(config)
            problems = splits["test"][: config.search_problems]
            sampler = search_sampler(config, Path(work_dir), problems, splits["shots"])
            critics = {name: search_critic(str(path), sampler, name, format=native_format(path))
                       for name, path in (("pav", pav), ("orm", orm))}
            rows = compare_at_budgets(
                problems, sampler, critics["pav"], critics["orm"], best_of_n=config.best_of_n,
                beam_widths=config.beam_widths, samples_per_beam=config.samples_per_beam, alpha=config.alpha,
                best_of_k=config.best_of_k, pav_rank=config.pav_rank, max_steps=MAX_STEPS, finished=finished,
                on_row=lambda so_far: write_settings(partial, {"settings": settings, "rows": so_far}), log=log)
            facts = summary(rows)
            result = {"settings": settings, "rows": rows, **facts}
            (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
            (out / "results.md").write_text(report(rows, facts) + "\n")
            plot(rows, facts, out / "search.png")
            if export is not None:
                Path(export).parent.mkdir(parents=True, exist_ok=True)
                Path(export).write_text(json.dumps(result, indent=2) + "\n")
            partial.unlink(missing_ok=True)
    finally:
        torch.set_num_threads(previous)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from verl_prm.apps.word_problems.pipeline import SCALES

    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    config = replace(SCALES["cpu"], test_problems=args.test_problems, search_problems=args.problems,
                     best_of_n=tuple(args.best_of_n), beam_widths=tuple(args.beam_widths),
                     samples_per_beam=args.samples_per_beam, alpha=args.alpha, best_of_k=args.best_of_k,
                     pav_rank=args.pav_rank)  # the config checks every bound
    result = run(config, args.work_dir, args.pav, args.orm, args.out, threads=args.threads, export=args.export,
                 log=lambda message: print(message, flush=True))
    print(report(result["rows"], result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
