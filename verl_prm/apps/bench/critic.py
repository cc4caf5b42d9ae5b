"""``verl-prm bench critic``: packed scoring vs one pass per prefix vs padded batching, side by side in one run.

A random Qwen2-style value-head critic (saved and loaded back through ``ProverCritic.from_pretrained``) scores a
length-skewed batch (lengths log-uniform in [min, max] tokens, about K steps each) three ways:

- **packed** (ours): one forward pass per sequence for all of its steps; micro-batches by a token budget,
  longest first (varlen packing on GPU with flash attention, minimal padding elsewhere);
- **per-prefix** (public PRM scripts): one forward pass per step prefix (H + 1 per sequence), read at its last
  token; batched with the same length-sorted token-budget micro-batches, so only the K/2 factor differs;
- **padded** (naive batching): fixed-size batches in input order, padded to the longest in each batch.

All three must give the same values (the table prints the largest difference). Ratios are wall-time ratios
measured in the same run; tokens/s counts the real tokens of the batch (the work that has to be done).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TARGET_PREFIX_FACTOR = 0.5  # packed >= 0.5 * K times faster than per-prefix
TARGET_PADDED = 1.3  # packed >= 1.3x faster than padded batching
TARGET_PADDING_SHARE = 0.10  # <= 10% padded tokens


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-prm bench critic", description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=32, help="responses in the batch")
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8, help="steps per response (K)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-tokens-per-batch", type=int, default=8192, help="token budget of a packed micro-batch")
    p.add_argument("--padded-batch-size", type=int, default=8, help="rows per batch of the naive padded baseline")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attn-implementation", default=None, help="default: flash_attention_2 on cuda if installed, else sdpa")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds; each round times every method once (interleaved), the best time per method is reported")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: stable timings on a shared machine; 0 keeps torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit with 1 when a target is missed")
    return p


def _tiny_tokenizer():
    """A byte-level BPE for the checkpoint directory; the benchmark feeds random ids, not text."""
    from verl_prm.bpe import train_byte_level_bpe

    return train_byte_level_bpe(["a prover critic scores every step in one pass"], vocab_size=260)


def build_random_critic(directory: str, args) -> None:
    """Save a random Qwen2ForTokenClassification (num_labels=1, the native value_head format) in ``directory``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=max(2048, args.max_tokens * 2),
        num_labels=1,
        tie_word_embeddings=False,
    )
    Qwen2ForTokenClassification(config).save_pretrained(directory)
    _tiny_tokenizer().save_pretrained(directory)


def make_batch(args, rng: random.Random) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Length-skewed sequences: L = min * (max/min)^u, u ~ U(0, 1) (log-uniform: many short, few long); the
    prompt takes 10-30% of L (at least 8 tokens); the response splits into K steps at jittered even cuts."""
    input_ids, prompt_ends, step_ends = [], [], []
    for _ in range(args.sequences):
        length = int(round(args.min_tokens * (args.max_tokens / args.min_tokens) ** rng.random()))
        prompt = max(8, int(length * rng.uniform(0.1, 0.3)))
        response = length - prompt
        steps = min(args.steps, response)
        cuts = sorted({min(response - 1, max(0, int((h + rng.uniform(0.6, 1.0)) * response / steps) - 1)) for h in range(steps - 1)})
        ends = [c for c in cuts if c < response - 1] + [response - 1]
        input_ids.append([rng.randrange(2, args.vocab) for _ in range(length)])
        prompt_ends.append(prompt - 1)
        step_ends.append([prompt + e for e in ends])
    return input_ids, prompt_ends, step_ends


def _timed_rounds(methods: dict, repeats: int, device: torch.device) -> tuple[dict, dict, dict]:
    """Time every method once per round, rounds interleaved so that a change in the machine's load hits all
    methods alike; returns the best wall time, the CPU time of that run, and the result per method."""
    import torch

    best = {name: math.inf for name in methods}
    cpu = {name: math.inf for name in methods}
    results = {}
    for _ in range(repeats):
        for name, fn in methods.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, used = time.perf_counter() - start, time.process_time() - start_cpu
            if wall < best[name]:
                best[name], cpu[name] = wall, used
    return best, cpu, results


def _per_prefix_inputs(inputs: list) -> tuple[list, list[int]]:
    """Per-prefix scoring: every prefix (prompt, then steps 1..h) its own sequence, read at its last token; with
    the index of the input each prefix comes from."""
    from verl_prm.critic.packing import CriticInput

    prefix_inputs, owner = [], []
    for i, x in enumerate(inputs):
        for p in x.read_positions:
            prefix_inputs.append(CriticInput(x.input_ids[: p + 1], [p]))
            owner.append(i)
    return prefix_inputs, owner


def _padded_plan(lengths: list[int], batch_size: int) -> list:
    """Naive padded batching: fixed-size batches in input order."""
    from verl_prm.critic.packing import MicroBatch

    plan = []
    for start in range(0, len(lengths), batch_size):
        idx = list(range(start, min(start + batch_size, len(lengths))))
        plan.append(MicroBatch(idx, max(lengths[i] for i in idx), sum(lengths[i] for i in idx)))
    return plan


def _print_table(rows: list[tuple], wall: dict, cpu: dict, real_tokens: int) -> None:
    print()
    print("| method | seconds | packed is faster by | CPU seconds | tokens/s | padded share | forward passes "
          "| tokens computed | achieved TFLOP/s | max abs diff to packed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, key, share, passes, computed, work, diff in rows:
        seconds = wall[key]
        print(
            f"| {name} | {seconds:.2f} | {seconds / wall['packed']:.2f}x | {cpu[key]:.2f} | {real_tokens / seconds:,.0f} | "
            f"{share:.1%} | {passes} | {computed:,} | {work / seconds / 1e12:.4f} | {diff:.1e} |"
        )
    print()


def _checks(k: float, t_packed: float, t_prefix: float, t_padded: float, share_packed: float,
            diff: float) -> list[tuple[str, bool, str]]:
    """The targets (text, met, measured value): speed-ups against per-prefix and padded scoring, padding share, values."""
    return [
        (f"packed vs per-prefix >= 0.5*K = {TARGET_PREFIX_FACTOR * k:.2f}x", t_prefix / t_packed >= TARGET_PREFIX_FACTOR * k,
         f"{t_prefix / t_packed:.2f}x"),
        (f"packed vs padded >= {TARGET_PADDED}x", t_padded / t_packed >= TARGET_PADDED, f"{t_padded / t_packed:.2f}x"),
        (f"padded share of packed <= {TARGET_PADDING_SHARE:.0%}", share_packed <= TARGET_PADDING_SHARE, f"{share_packed:.1%}"),
        ("same values (max abs diff <= 1e-3)", diff <= 1e-3, f"{diff:.1e}"),
    ]


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import torch  # after parsing: --help and argument errors answer without loading torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from verl_prm.critic import ProverCritic
    from verl_prm.critic.packing import padding_share
    from verl_prm.critic.flops import forward_flops, non_embedding_parameters

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as directory:
        build_random_critic(directory, args)
        critic = ProverCritic.from_pretrained(
            directory, format="value_head", device=args.device, dtype=args.dtype,
            attn_implementation=args.attn_implementation, max_tokens_per_batch=args.max_tokens_per_batch,
        )
    device = critic.device
    config = critic.adapter.config
    input_ids, prompt_ends, step_ends = make_batch(args, rng)
    inputs = critic.build_inputs(input_ids, prompt_ends, step_ends)
    lengths = [len(x.input_ids) for x in inputs]
    real_tokens = sum(lengths)
    mean_steps = sum(len(e) for e in step_ends) / len(step_ends)

    prefix_inputs, owner = _per_prefix_inputs(inputs)
    naive_plan = _padded_plan(lengths, args.padded_batch_size)
    packed_plan = critic.plan(inputs)
    prefix_plan = critic.plan(prefix_inputs)

    # warm-up (allocator, kernels) on a few short sequences
    shortest = sorted(range(len(inputs)), key=lambda i: lengths[i])[:4]
    critic.forward_values([inputs[i] for i in shortest])

    wall, cpu, results = _timed_rounds(
        {
            "packed": lambda: critic.forward_values(inputs, packed_plan),
            "prefix": lambda: critic.forward_values(prefix_inputs, prefix_plan),
            "padded": lambda: critic.forward_values(inputs, naive_plan, mode="padded"),
        },
        args.repeats,
        device,
    )
    t_packed, t_prefix, t_padded = wall["packed"], wall["prefix"], wall["padded"]
    packed_values, prefix_values, padded_values = results["packed"], results["prefix"], results["padded"]

    # all three compute the same values
    regrouped: list[list[float]] = [[] for _ in inputs]
    for i, v in zip(owner, prefix_values):
        regrouped[i].append(float(v[0]))
    diff_prefix = max(abs(a - b) for i in range(len(inputs)) for a, b in zip(packed_values[i].tolist(), regrouped[i]))
    diff_padded = max(float((a - b).abs().max()) for a, b in zip(packed_values, padded_values))

    prefix_tokens = sum(len(x.input_ids) for x in prefix_inputs)
    parameters = non_embedding_parameters(critic.adapter.backbone)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    flops = forward_flops(parameters, lengths, config.num_hidden_layers, width)
    prefix_flops = forward_flops(parameters, [len(x.input_ids) for x in prefix_inputs], config.num_hidden_layers, width)

    share_packed = padding_share(packed_plan, critic.packing)
    share_prefix = padding_share(prefix_plan, critic.packing)
    share_naive = padding_share(naive_plan, "padded")
    k = mean_steps
    print(
        f"critic: random Qwen2 value head, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{parameters / 1e6:.1f}M non-embedding parameters; device {device}, dtype {next(critic.adapter.backbone.parameters()).dtype}, "
        f"attention {config._attn_implementation}, packing {critic.packing}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"batch: {len(inputs)} sequences, {args.min_tokens}-{args.max_tokens} tokens (log-uniform; "
        f"{real_tokens} tokens in all), K = {k:.2f} steps per sequence; token budget {args.max_tokens_per_batch}, "
        f"naive batch size {args.padded_batch_size}"
    )
    rows = [
        ("packed (ours)", "packed", share_packed, len(packed_plan), real_tokens, flops, 0.0),
        ("per-prefix", "prefix", share_prefix, len(prefix_plan), prefix_tokens, prefix_flops, diff_prefix),
        ("padded (naive)", "padded", share_naive, len(naive_plan), real_tokens, flops, diff_padded),
    ]
    _print_table(rows, wall, cpu, real_tokens)
    checks = _checks(k, t_packed, t_prefix, t_padded, share_packed, max(diff_prefix, diff_padded))
    for text, ok, value in checks:
        print(f"{'PASS' if ok else 'MISS'}  {text}: {value}")
    if device.type == "cpu":
        print(f"(best of {args.repeats} interleaved rounds; CPU timings depend on the other load of the machine)")
    return 0 if (not args.check or all(ok for _, ok, _ in checks)) else 1

