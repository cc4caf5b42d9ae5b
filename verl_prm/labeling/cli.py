"""`verl-prm label`: Monte-Carlo step labels, and `verl-prm label convert`: public step-labelled data.

    verl-prm label --input train.parquet --policy PATH [--prover PATH] --output-dir labels/ [options]
    verl-prm label convert {math_shepherd,prm800k} --input rows.jsonl --output-dir labels/
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import functools
import json
import sys
from typing import Sequence

from verl_prm.checkpoints import resolve_checkpoint
from verl_prm.choices import GENERATOR_BACKENDS
from verl_prm.cli_types import add_dataclass_arguments, finite_float
from verl_prm.labeling.converters import convert_math_shepherd, convert_prm800k, read_jsonl
from verl_prm.labeling.generators import RayGeneratorPool, VLLMGenerator
from verl_prm.labeling.inputs import read_prompts, render_prompt
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
from verl_prm.labeling.runner import run_labeling
from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function
from verl_prm.labeling.store import ShardStore
from verl_prm.locking import DirectoryLock

__all__ = ["main", "build_generator"]


def _unescape(text: str) -> str:
    """Shell-friendly delimiters: the two characters backslash-n become a newline."""
    return codecs.decode(text, "unicode_escape")


def build_generator(backend: str, path: str, **settings):
    """One engine of ``backend`` ("hf" or "vllm") for the model at ``path`` (module-level: Ray pickles it)."""
    common = {k: settings[k] for k in ("max_new_tokens", "temperature", "top_p")}
    if backend == "hf":
        from verl_prm.labeling.hf_generator import HFGenerator  # torch: not at `verl-prm label --help`

        return HFGenerator.from_pretrained(path, device=settings.get("device"), dtype=settings.get("dtype", "auto"),
                                           batch_size=settings.get("batch_size", 32), **common)
    if backend == "vllm":
        return VLLMGenerator(path, tensor_parallel_size=settings.get("tensor_parallel_size", 1),
                             gpu_memory_utilization=settings.get("gpu_memory_utilization", 0.85),
                             dtype=settings.get("dtype", "auto"), max_model_len=settings.get("max_model_len"), **common)
    raise ValueError(f"unknown backend {backend!r}: use hf or vllm")


def _make_engine(args, path: str, memory_share: float):
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                    tensor_parallel_size=args.tensor_parallel_size,
                    gpu_memory_utilization=args.gpu_memory_utilization * memory_share,
                    max_model_len=args.max_model_len)
    if args.num_engines > 1:
        import torch

        gpus = float(args.tensor_parallel_size) * memory_share if torch.cuda.is_available() else 0.0
        factory = functools.partial(build_generator, args.backend, path, **settings)
        return RayGeneratorPool(factory, args.num_engines, num_gpus_per_worker=gpus)
    return build_generator(args.backend, path, **settings)


def label_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm label", description="Monte-Carlo step labels from a prover "
                                "(see verl_prm.labeling.format for the output columns).")
    p.add_argument("--input", required=True, help="prompts: verl parquet rows or jsonl")
    p.add_argument("--output-dir", required=True, help="label shards go here; rerun the same command to resume")
    p.add_argument("--policy", required=True, help="base policy (seed rollouts): local HF model directory")
    p.add_argument("--prover", default=None, help="prover for the continuations (default: the policy; then "
                   "the stored counts give Best-of-K values: verl-prm train --best-of-k K)")
    p.add_argument("--backend", choices=GENERATOR_BACKENDS, default="hf")
    # What is labelled and how: one flag per LabelSettings field (source is the prover's path).
    add_dataclass_arguments(p, LabelSettings, skip=("source",))
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=finite_float(0.0), default=1.0, help="0: greedy")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--batch-size", type=int, default=32, help="hf back end: sequences per generate call")
    p.add_argument("--device", default=None, help="hf back end: cpu, cuda, cuda:1 (default: cuda if present)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    p.add_argument("--num-engines", type=int, default=1, help="engines through Ray, one per GPU (or CPU slot)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs per engine")
    p.add_argument("--gpu-memory-utilization", type=finite_float(0.0, 1.0, low_open=True), default=0.85,
                   help="vllm: GPU memory share (split between policy and prover when they differ)")
    p.add_argument("--max-model-len", type=int, default=None, help="vllm: context length cap")
    p.add_argument("--shard-size", type=int, default=64, help="prompts per output shard")
    p.add_argument("--reward-fn", default=None, help="path.py:function or pkg://module:function with verl's "
                   "compute_score signature, or its batch signature (data_sources=, solution_strs=, ...: one call "
                   "per round, e.g. pkg://verl_prm.code.verl_score:compute_score_batch runs sandboxes in parallel); "
                   "default: verl.utils.reward_score.default_compute_score by data_source")
    p.add_argument("--success-threshold", type=finite_float(), default=0.5, help="success iff score > this")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--answer-field", default="reward_model.ground_truth")
    p.add_argument("--data-source-field", default="data_source")
    p.add_argument("--data-source", default=None, help="one data_source for every row (jsonl without one)")
    p.add_argument("--answer-regex", default=None, help="ground truth = first group of this regex on the answer "
                   "(default: verl's extraction for known data sources: GSM8K '#### <number>', MATH last \\boxed{}; "
                   "'(?s)(.*)' keeps the whole answer)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--no-progress", action="store_true")
    return p


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm label convert",
                                description="convert public step-labelled rows into label shards")
    p.add_argument("format", choices=("math_shepherd", "prm800k"))
    p.add_argument("--input", required=True, help="jsonl rows of the data set")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--prompt-format", default="{question}\\n", help="prompt text from the question")
    p.add_argument("--alternatives", action="store_true", help="prm800k: a row per rated, not chosen completion")
    p.add_argument("--shard-size", type=int, default=10000, help="rows per shard")
    return p


def convert_main(argv: Sequence[str]) -> int:
    args = _convert_parser().parse_args(list(argv))
    with DirectoryLock(args.output_dir, "verl-prm label convert"):
        return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    prompt_format = _unescape(args.prompt_format)
    rows_in = read_jsonl(args.input)
    try:
        if args.format == "math_shepherd":
            rows = convert_math_shepherd(rows_in, prompt_format=prompt_format)
        else:
            rows = convert_prm800k(rows_in, prompt_format=prompt_format, alternatives=args.alternatives)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if message.startswith(str(args.input)) else f"{args.input}: {message}") from None
    store = ShardStore(args.output_dir)
    if store.shard_paths():
        raise SystemExit(f"{args.output_dir} already holds shards: convert into an empty directory")
    store.check_config({"convert": args.format, "input": args.input, "prompt_format": prompt_format,
                        "alternatives": args.alternatives})
    for begin in range(0, len(rows), args.shard_size):
        store.write_shard(rows[begin : begin + args.shard_size])
    steps = sum(len(r["q"]) for r in rows)
    print(json.dumps({"rows": len(rows), "steps": steps, "output_dir": args.output_dir}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":
        return convert_main(argv[1:])
    args = label_parser().parse_args(argv)
    # checked before anything is written (a --code-depth without --code-rule, ...)
    settings = LabelSettings(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(LabelSettings)
                                   if f.name != "source"}, "delimiter": _unescape(args.delimiter),
                                "source": args.prover or args.policy})
    # one writer per output directory: a second run would label the same prompts into duplicate shards
    with DirectoryLock(args.output_dir, "verl-prm label"):
        return _label(args, settings)


def _label(args: argparse.Namespace, settings: LabelSettings) -> int:
    from transformers import AutoTokenizer

    delimiter, prover_path = settings.delimiter, settings.source
    settings.step_spans("a")  # a bad step rule (e.g. a regex that matches the empty string) fails before any load
    # Inputs and the scorer are checked before anything is written to the output directory.
    notes: list[str] = []
    items = read_prompts(args.input, prompt_field=args.prompt_field, answer_field=args.answer_field,
                         data_source_field=args.data_source_field, data_source=args.data_source,
                         answer_regex=args.answer_regex, limit=args.limit, notes=notes)
    try:
        reward_function = load_reward_function(args.reward_fn)
    except (AttributeError, ImportError) as error:  # no such function or module: bad input, one line
        raise ValueError(str(error)) from None
    scorer = OutcomeScorer(reward_function, args.success_threshold)
    for flag, path in (("--policy", args.policy), ("--prover", args.prover)):
        if path is not None:  # no such directory, no weights, pickle-only, offline hub id: before any model loads
            resolve_checkpoint(path, flag)
    for note in notes:
        print(f"verl-prm label: {note}", file=sys.stderr)
    store = ShardStore(args.output_dir)
    record = vars(args).copy()
    record.update(delimiter=delimiter, prover=prover_path)
    replaced = store.check_config(record, ignore=("output_dir", "shard_size", "batch_size", "num_engines", "limit",
                                                  "device", "no_progress", "gpu_memory_utilization", "max_model_len"))
    if replaced:
        print(f"verl-prm label: {replaced}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(args.policy, trust_remote_code=False)
    separate = prover_path != args.policy
    policy = _make_engine(args, args.policy, 0.5 if separate else 1.0)
    prover = _make_engine(args, prover_path, 0.5) if separate else policy
    labeler = MonteCarloLabeler(policy, prover, scorer, settings)
    summary = run_labeling(items, functools.partial(render_prompt, tokenizer=tokenizer), labeler, store,
                           shard_size=args.shard_size, progress=not args.no_progress)
    print(json.dumps({k: v for k, v in summary.items() if k != "shards_written"} | {"output_dir": args.output_dir,
                                                                                     "shards": len(summary["shards_written"])}))
    return 0
