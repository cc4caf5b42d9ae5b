"""``verl-prm bench generate``: the CPU generation engine against plain float32 transformers ``generate``, side by
side in one run on the same requests.

Three measurements, each alternating the arms ``--repeats`` times (the best of each arm is reported, so a
moment of load on a shared machine does not decide a ratio):

1. **Throughput**: ``--sequences`` sampled sequences (temperature 1) of ``--prompt-tokens``-token prompts (word
   problems with few-shot examples, cut to that length), ``--new-tokens`` each, no EOS (every arm generates the
   same number of tokens). Arms: plain ``model.generate`` in float32 (what the labeler, the ``hf`` rollout and
   the search ran before the engine), the engine in float32 (its cache and batching alone) and the engine in the
   precision ``auto`` picks on this CPU (bfloat16 where it has native bf16 instructions).
2. **A tree group**: ``--trees`` prompts, 2 roots each, then 3 branches per root continuing from a point of the
   root's response, as tree-shaped groups sample them. Prefill tokens computed and seconds, engine with its prefix
   cache against the engine without it and against plain ``generate`` (which prefills each branch's prompt and
   shared response prefix again). Then the same trees with roots that end at different lengths (as they do at
   EOS; a branch ends where its root ended), two ways: in waves (every root, then every branch: each prompt's branches wait for the longest root of
   all) and with continuous batching (``ContinuousBatcher``, as the ``hf`` rollout serves tree groups: a root's
   branches join the running batch as soon as it ends).
3. **Labelled steps per CPU-hour**: ``verl-prm label``'s Monte-Carlo labeler on ``--label-problems`` word
   problems (``--n-cov`` rollouts, ``--n-mc`` continuations of every step prefix), with the former generator
   (plain float32 ``generate`` per batch) and with ``HFGenerator`` on the engine.

The model is SmolLM2-135M-Instruct (``verl-prm model smollm2``) unless ``--model`` names another local checkpoint.
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

# torch, transformers and everything that imports them load in the functions: `--help` stays fast
from verl_prm.apps.word_problems.task import STEP_DELIMITER, TaskConfig, generate_problems, prompt_messages
from verl_prm.choices import PRECISIONS

__all__ = ["PlainGenerateGenerator", "main"]

NO_EOS = (-1,)  # a token id never sampled: every sequence runs to its max_tokens, as generate with eos_token_id=None


class PlainGenerateGenerator:
    """The labeler's generator before the engine: left-padded ``model.generate`` per batch of ``batch_size``
    sequences, in the model's dtype (float32 on CPU), the dynamic cache, each batch seeded once (the baseline)."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0, batch_size: int = 32):
        from verl_prm.special_tokens import ensure_pad_token, policy_eos_token_ids

        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_new_tokens, self.temperature, self.batch_size = max_new_tokens, temperature, batch_size
        generation = getattr(model, "generation_config", None)
        self.eos_token_ids = set(policy_eos_token_ids(tokenizer, generation, source="bench"))
        self.pad_token_id = ensure_pad_token(tokenizer, generation, source="bench")

    def generate(self, texts: Sequence[str], n: int, seeds: Sequence[int]) -> list:
        import torch

        from verl_prm.labeling.generators import Completion, derive_seed, trim_at_eos

        flat = [(i, text) for i, text in enumerate(texts) for _ in range(n)]
        results: list[list[Completion]] = [[] for _ in texts]
        self.tokenizer.padding_side = "left"
        for begin in range(0, len(flat), self.batch_size):
            chunk = flat[begin: begin + self.batch_size]
            encoded = self.tokenizer([t for _, t in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            torch.manual_seed(derive_seed(*(seeds[i] for i, _ in chunk), begin))
            with torch.inference_mode():
                output = self.model.generate(**encoded, max_new_tokens=self.max_new_tokens, do_sample=True,
                                             temperature=self.temperature, top_p=1.0, top_k=0,
                                             pad_token_id=self.pad_token_id, eos_token_id=sorted(self.eos_token_ids))
            for (i, _), ids in zip(chunk, output[:, encoded["input_ids"].shape[1]:].tolist()):
                kept, finished = trim_at_eos(ids, self.eos_token_ids, self.pad_token_id)
                results[i].append(Completion(self.tokenizer.decode(kept, skip_special_tokens=True), finished,
                                             len(kept) + finished))
        return results


def _prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    from verl_prm.labeling.inputs import render_prompt

    problems = generate_problems(count + 2, TaskConfig(), seed=seed)
    shots = problems[:2]
    prompts = []
    for problem in problems[2:]:
        text = render_prompt(prompt_messages(problem, shots), tokenizer)  # as `verl-prm label` renders it
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(ids[-length:])  # the end of the chat: the question and the generation prompt
    return prompts


def _best(times: list[float]) -> float:
    return min(times)


def _plain_generate(model, prompts: list[list[int]], new_tokens: int, pad: int, seed: int) -> float:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, top_k=0, eos_token_id=None, pad_token_id=pad)
    return time.perf_counter() - start


def _engine_generate(engine, prompts: list[list[int]], new_tokens: int, seed: int) -> float:
    from verl_prm.generation import GenerationRequest

    start = time.perf_counter()
    engine.generate([GenerationRequest(p, max_tokens=new_tokens, seed=seed + i) for i, p in enumerate(prompts)])
    return time.perf_counter() - start


def throughput(path: str, args) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.generation import GenerationEngine
    from verl_prm.precision import resolve_dtype

    tokenizer = AutoTokenizer.from_pretrained(path)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fast = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(args.precision, "cpu")).eval()
    prompts = _prompts(tokenizer, args.sequences, args.prompt_tokens)
    engines = {"engine float32": GenerationEngine(fp32, eos_token_ids=NO_EOS, max_batch_size=args.sequences,
                                                  prefix_cache_tokens=0),
               f"engine {fast.dtype}".replace("torch.", ""):
                   GenerationEngine(fast, eos_token_ids=NO_EOS, max_batch_size=args.sequences, prefix_cache_tokens=0)}
    times: dict[str, list[float]] = {"plain generate float32": [], **{name: [] for name in engines}}
    _engine_generate(engines["engine float32"], prompts[:2], 2, 0)  # warm-up (allocations, kernels)
    for repeat in range(args.repeats):
        times["plain generate float32"].append(_plain_generate(fp32, prompts, args.new_tokens,
                                                               tokenizer.pad_token_id or 0, repeat))
        for name, engine in engines.items():
            times[name].append(_engine_generate(engine, prompts, args.new_tokens, 1000 * repeat))
    tokens = args.sequences * args.new_tokens
    rates = {name: tokens / _best(t) for name, t in times.items()}
    base = rates["plain generate float32"]
    print(f"\n1. throughput: {args.sequences} sequences, {args.prompt_tokens}-token prompts, {args.new_tokens} new "
          f"tokens each (best of {args.repeats})")
    print("| arm | tokens/s | x plain generate |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / base:.2f} |")
    return rates


def tree_group(path: str, args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.generation import GenerationEngine, GenerationRequest
    from verl_prm.precision import resolve_dtype

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(args.precision, "cpu")).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(tokenizer, args.trees, args.prompt_tokens, seed=7)
    roots = [GenerationRequest(p, max_tokens=args.new_tokens, seed=i * 2 + r)
             for i, p in enumerate(prompts) for r in range(2)]
    print(f"\n2. tree groups: {args.trees} prompts x 2 roots of {args.new_tokens} tokens, then 3 branches per root "
          f"of {args.new_tokens // 2} tokens from its response (best of {args.repeats})")
    print("| arm | prefill tokens computed | saved | seconds |\n|---|---:|---:|---:|")
    results = {}
    for name, cache_tokens in (("engine, prefix reuse", 1 << 16), ("engine, no prefix reuse", 0)):
        best = None
        for repeat in range(args.repeats):
            engine = GenerationEngine(model, eos_token_ids=NO_EOS, max_batch_size=64, prefix_cache_tokens=cache_tokens)
            start = time.perf_counter()
            root_out = engine.generate(roots)
            branches = [GenerationRequest(list(r.prompt_ids) + o.token_ids[:cut], max_tokens=args.new_tokens // 2,
                                          seed=100 + j)
                        for j, (r, o) in enumerate((r, o) for r, o in zip(roots, root_out) for _ in range(3))
                        for cut in [1 + (j * 7919) % (args.new_tokens - 1)]]
            engine.generate(branches)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
        stats = engine.stats
        results[name] = (stats.prefill_tokens, stats.saved_prefill_tokens, best)
        print(f"| {name} | {stats.prefill_tokens} | {stats.saved_prefill_tokens} | {best:.1f} |")
    # plain generate: every root and branch prompt prefilled in full
    plain = []
    for repeat in range(args.repeats):
        seconds = _plain_generate(fp32, [list(r.prompt_ids) for r in roots], args.new_tokens, 0, repeat)
        seconds += _plain_generate(fp32, [list(b.prompt_ids) for b in branches], args.new_tokens // 2, 0, repeat)
        plain.append(seconds)
    computed = sum(len(r.prompt_ids) for r in roots) + sum(len(b.prompt_ids) for b in branches)
    print(f"| plain generate float32 | {computed} | 0 | {_best(plain):.1f} |")
    tree_waves_or_continuous(model, prompts, args)


def tree_waves_or_continuous(model, prompts: list[list[int]], args) -> None:
    """Trees whose roots end at different lengths: every root then every branch (waves) against branches that
    join the running batch as their root ends (continuous batching); seconds and decode steps of each."""
    import asyncio

    from verl_prm.generation import ContinuousBatcher, GenerationEngine, GenerationRequest

    short = max(1, args.new_tokens // 4)
    roots = [GenerationRequest(p, max_tokens=short + (7 * j) % (args.new_tokens - short + 1), seed=j)
             for j, p in enumerate(p for p in prompts for _ in range(2))]

    def branches(j: int, output) -> list:
        """3 branches from points of root j's response, each ending where its root ended (as at EOS)."""
        length = len(output.token_ids)
        cuts = [1 + (j * 3 + b) * 7919 % max(1, length - 1) for b in range(3)]
        return [GenerationRequest(list(roots[j].prompt_ids) + output.token_ids[:cut],
                                  max_tokens=max(1, length - cut), seed=100 + 3 * j + b)
                for b, cut in enumerate(cuts)]

    def waves(engine) -> None:
        outputs = engine.generate(roots)
        engine.generate([b for j, output in enumerate(outputs) for b in branches(j, output)])

    def continuous(engine) -> None:
        batcher = ContinuousBatcher(engine, gather_seconds=0)

        async def tree(j: int) -> None:
            output = await batcher.generate(roots[j])
            await asyncio.gather(*(batcher.generate(b) for b in branches(j, output)))

        async def every_tree() -> None:
            await asyncio.gather(*(tree(j) for j in range(len(roots))))

        asyncio.run(every_tree())

    lengths = sorted({r.max_tokens for r in roots})
    print(f"\n2b. the same trees, roots of {lengths[0]}-{lengths[-1]} tokens (as if ended at EOS), each branch "
          f"ending where its root ended, prefix reuse on (best of {args.repeats})")
    print("| arm | decode steps | generated tokens | seconds |\n|---|---:|---:|---:|")
    times: dict[str, list[float]] = {"waves (every root, then every branch)": [],
                                     "continuous batching (branches join as their root ends)": []}
    steps = {}
    for repeat in range(args.repeats):
        for name, run in zip(times, (waves, continuous)):
            engine = GenerationEngine(model, eos_token_ids=NO_EOS, max_batch_size=64)
            counted = _count_decode_steps(engine)
            start = time.perf_counter()
            run(engine)
            times[name].append(time.perf_counter() - start)
            steps[name] = (counted[0], engine.stats.generated_tokens)
    for name, seconds in times.items():
        print(f"| {name} | {steps[name][0]} | {steps[name][1]} | {_best(seconds):.1f} |")


def _count_decode_steps(engine) -> list[int]:
    """A counter of the engine's decode steps (its ``_forward`` calls for every row's next token, not prefills)."""
    counter = [0]
    forward = engine._forward

    def counted(*args, last_only: bool = True):
        counter[0] += int(not last_only)
        return forward(*args, last_only=last_only)

    engine._forward = counted
    return counter


def labelled_steps(path: str, args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.labeling.hf_generator import HFGenerator

    from verl_prm.apps.word_problems.pipeline import MAX_STEPS, SCORE_FUNCTION
    from verl_prm.apps.word_problems.score import DATA_SOURCE
    from verl_prm.labeling.inputs import PromptItem, render_prompt
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function

    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = generate_problems(args.label_problems + 2, TaskConfig(), seed=11)
    shots, problems = problems[:2], problems[2:]
    items = [PromptItem(i, prompt_messages(p, shots), str(p.answer), DATA_SOURCE) for i, p in enumerate(problems)]
    texts = [render_prompt(item.prompt, tokenizer) for item in items]
    settings = LabelSettings(n_cov=args.n_cov, n_mc=args.n_mc, prefix_rule="every", delimiter=STEP_DELIMITER,
                             max_steps=MAX_STEPS, seed=0)
    scorer = OutcomeScorer(load_reward_function(SCORE_FUNCTION))
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    arms = {"plain generate float32 (before)": PlainGenerateGenerator(fp32, tokenizer, max_new_tokens=args.label_tokens),
            "HFGenerator on the engine (after)": HFGenerator.from_pretrained(path, device="cpu", dtype=args.precision,
                                                                             max_new_tokens=args.label_tokens)}
    print(f"\n3. Monte-Carlo labels: {len(items)} word problems, n_cov={args.n_cov}, n_mc={args.n_mc}, every step "
          f"prefix, <= {args.label_tokens} tokens a response")
    print(f"| generator | labelled steps | seconds | labelled steps per hour ({torch.get_num_threads()} threads) | x before |"
          "\n|---|---:|---:|---:|---:|")
    base = None
    for name, generator in arms.items():
        start = time.perf_counter()
        rows = MonteCarloLabeler(generator, generator, scorer, settings).label(items, texts)
        seconds = time.perf_counter() - start
        steps = sum(len(row["q"]) for row in rows)
        per_hour = steps / seconds * 3600
        base = base or per_hour
        print(f"| {name} | {steps} | {seconds:.0f} | {per_hour:.0f} | {per_hour / base:.2f} |")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-prm bench generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local causal LM (default: SmolLM2-135M-Instruct, converted once)")
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--sequences", type=positive_int, default=32)
    parser.add_argument("--prompt-tokens", type=positive_int, default=100)
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--trees", type=positive_int, default=4)
    parser.add_argument("--label-problems", type=int, default=2, help="0 skips the labelling measurement")
    parser.add_argument("--n-cov", type=positive_int, default=2)
    parser.add_argument("--n-mc", type=positive_int, default=2)
    parser.add_argument("--label-tokens", type=positive_int, default=96)
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # before torch: `--help` stays fast
    import torch

    from verl_prm.precision import cpu_bf16_flags, native_bf16_instructions, resolve_dtype

    if args.label_problems < 0:
        _parser().error(f"argument --label-problems: must be >= 0, got {args.label_problems}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from verl_prm.models.gguf import cached_checkpoint

        args.model = str(cached_checkpoint())
    flags = ", ".join(cpu_bf16_flags()) or "none"
    print(f"CPU: native bf16 instructions: {flags} (bf16 native: {native_bf16_instructions()}); precision "
          f"{args.precision} -> {resolve_dtype(args.precision, 'cpu')}; torch threads {torch.get_num_threads()}; "
          f"model {args.model}")
    throughput(args.model, args)
    tree_group(args.model, args)
    if args.label_problems:
        labelled_steps(args.model, args)
    return 0
