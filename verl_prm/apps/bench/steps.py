"""`verl-prm bench steps`: time step segmentation (`verl_prm.steps.split_steps`) on one CPU thread.

Builds a batch of responses of exactly ``--length`` tokens (default 1,024 x 1,024) from synthetic reasoning
text (sentences, numbers, "\\n\\n" and ".\\n\\n" step breaks, emoji, CJK), tokenized by a byte-level BPE
tokenizer trained here (or ``--tokenizer DIR``, a local Hugging Face tokenizer), and prints, side by side in
one process: the tokenizer's own ``batch_decode`` of the batch (the floor: every method must decode), and
`split_steps` by delimiter, by regex and by fixed-size segments, plus `align_to_critic` to a second
tokenizer (next to the critic tokenizer's own encode of the texts, which it must do) and to the same one.
Target (issue 3): under one second per million tokens on one core.

Timings on a shared machine depend on its load: the table prints the load average (``os.getloadavg``, runnable
processes averaged over 1/5/15 minutes) and the CPU count before and after the runs, and each row the 1-minute
load right after its best run, so every figure carries the load it was taken under. The methods are timed in
interleaved rounds (best of ``--repeats``), so a load change during the benchmark reaches every method alike.
"""

from __future__ import annotations

import argparse
import os
import random
import time

# one core: torch intra-op threads in main; the Rust tokenizers' batch calls here
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

_WORDS = (
    "the of and to a in is that we so then each total number cost more than half twice left after "
    "she he they apples pencils hours minutes dollars per week year answer therefore compute step"
).split()
_EXTRAS = ["😀", "🚀", "你好", "数学", "∑", "≥", "é", "ки", "½"]


def synthetic_response(rng: random.Random, approx_chars: int) -> str:
    """Reasoning-like text: steps of a few sentences separated by "\\n\\n", with numbers and some non-ASCII."""
    parts: list[str] = []
    size = 0
    while size < approx_chars:
        sentences = []
        for _ in range(rng.randint(1, 3)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
            if rng.random() < 0.5:
                words.insert(rng.randint(0, len(words)), f"{rng.randint(1, 999)} * {rng.randint(2, 99)} = "
                             f"{rng.randint(1, 99999)}")
            if rng.random() < 0.15:
                words.insert(rng.randint(0, len(words)), rng.choice(_EXTRAS))
            sentences.append(" ".join(words).capitalize() + ".")
        step = " ".join(sentences)
        parts.append(step)
        size += len(step) + 2
    joined = ""
    for i, part in enumerate(parts):
        joined += part
        if i < len(parts) - 1:
            joined += rng.choice(["\n\n", "\n\n", "\n\n", "\n\n\n", "\r\n\r\n"])
    return joined


def _best_of_interleaved_rounds(methods: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """``{name: (best seconds, 1-minute load right after that best run)}``. Each round times every method once,
    so a change of the machine's load during the benchmark reaches all methods alike (the ratios stay fair)."""
    best: dict[str, tuple[float, float]] = {name: (float("inf"), 0.0) for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
            if seconds < best[name][0]:
                best[name] = (seconds, os.getloadavg()[0])
    return best


def machine_load() -> str:
    """The load average over 1, 5 and 15 minutes and the CPU count, as printed with the table."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-prm bench steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=1024)
    parser.add_argument("--length", type=int, default=1024, help="tokens per response")
    parser.add_argument("--vocab-size", type=int, default=8000, help="of the byte-level BPE trained here")
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory instead of training one")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds (each times every method once); a method's figure is its best round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the target is for one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch  # after parsing: --help and argument errors answer without loading torch

    torch.set_num_threads(args.threads)

    from verl_prm.bpe import train_byte_level_bpe
    from verl_prm.steps import align_to_critic, split_steps

    rng = random.Random(args.seed)
    corpus = [synthetic_response(rng, 3000) for _ in range(300)]
    start = time.perf_counter()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    else:
        tokenizer = train_byte_level_bpe(corpus, vocab_size=args.vocab_size)
    critic_tokenizer = train_byte_level_bpe(corpus, vocab_size=max(300, args.vocab_size // 4))
    print(f"tokenizers ready in {time.perf_counter() - start:.1f} s: policy vocab {len(tokenizer)}, "
          f"critic vocab {len(critic_tokenizer)}")

    # responses of exactly --length tokens: cut long texts (a cut may split a character, as truncation does)
    rows = []
    while len(rows) < args.responses:
        ids = tokenizer.encode(synthetic_response(rng, args.length * 8), add_special_tokens=False)
        if len(ids) >= args.length:
            ids = ids[: args.length]
            if len(rows) % 2 == 0 and tokenizer.eos_token_id is not None:
                ids[-1] = tokenizer.eos_token_id  # half the responses end with EOS, half are truncated
            rows.append(ids)
    response_ids = torch.tensor(rows, dtype=torch.int64)
    response_mask = torch.ones_like(response_ids)
    tokens = response_ids.numel()

    start = time.perf_counter()
    split_steps(response_ids[:1], response_mask[:1], tokenizer)  # builds the id->bytes table once
    critic_ids = torch.tensor([critic_tokenizer.encode("warm up", add_special_tokens=False)])
    split_steps(critic_ids, torch.ones_like(critic_ids), critic_tokenizer)
    print(f"id->bytes tables built and checked in {time.perf_counter() - start:.2f} s (once per tokenizer)")

    split = split_steps(response_ids, response_mask, tokenizer)
    prompts = ["Question: what is the total?"] * args.responses
    methods = {
        "tokenizer.batch_decode (floor)": lambda: tokenizer.batch_decode(rows, skip_special_tokens=True),
        'split_steps delimiter="\\n\\n"': lambda: split_steps(response_ids, response_mask, tokenizer),
        'split_steps regex=r"\\.\\s"': lambda: split_steps(
            response_ids, response_mask, tokenizer, delimiter=None, regex=r"\.\s"
        ),
        "split_steps max_tokens=64": lambda: split_steps(response_ids, response_mask, tokenizer, max_tokens=64),
        "critic tokenizer encode alone": lambda: critic_tokenizer(split.texts, add_special_tokens=False),
        "align_to_critic, other vocab": lambda: align_to_critic(
            response_ids, response_mask, tokenizer, critic_tokenizer, split, prompts=prompts
        ),
        "align_to_critic, same tokenizer": lambda: align_to_critic(
            response_ids, response_mask, tokenizer, tokenizer, split, prompt_ids=[[1, 2, 3]] * args.responses
        ),
    }
    print(f"\n{args.responses} responses x {args.length} tokens = {tokens:,} tokens, "
          f"mean {float(split.num_steps.float().mean()):.1f} steps/response, torch threads {args.threads}, "
          f"best of {args.repeats} interleaved rounds")
    print(f"before the runs: {machine_load()}")
    print(f"{'method':<34} {'seconds':>8} {'responses/s':>12} {'s per M tokens':>15} {'x decode':>9} "
          f"{'load 1 min':>10}")
    best = _best_of_interleaved_rounds(methods, args.repeats)
    floor = best["tokenizer.batch_decode (floor)"][0]
    for name, (seconds, load) in best.items():
        print(f"{name:<34} {seconds:8.3f} {args.responses / seconds:12.0f} {seconds / tokens * 1e6:15.3f} "
              f"{seconds / floor:9.2f} {load:10.2f}")
    print(f"after the runs: {machine_load()}")
    print("\ntarget: split_steps under 1 s per million tokens on one core")
    return 0
