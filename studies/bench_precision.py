"""``python -m studies.bench_precision``: one forward and backward of the arithmetic recipe's policy in fp32,
under bf16 autocast and with bf16 parameters (what verl's FSDP engine does by default), side by side on CPU.

The policy is the recipe's Qwen2 (``verl_prm.apps.arithmetic.model.ModelConfig``, random weights: the time does
not depend on them) on a ``--batch`` x ``--tokens`` batch of token ids, ``--threads`` torch threads; each variant
runs once to warm up, then the best of ``--repeats``. Prints the seconds and each variant's ratio to fp32. A CPU
without native bf16 (AVX2, AVX-512 without its bf16 extension) emulates it: this is why the CPU loop's settings
set FSDP's mixed precision to fp32 (docs/cpu_loop.md).
"""

from __future__ import annotations

import argparse
import contextlib
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.bench_precision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="sequences per batch (the recipe's 16 x 8)")
    parser.add_argument("--tokens", type=int, default=116, help="tokens per sequence (the recipe's prompt + response)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the recipe runs on 1)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per variant (the best is printed)")
    args = parser.parse_args(argv)
    if min(args.batch, args.tokens, args.threads, args.repeats) < 1:
        parser.error("--batch, --tokens, --threads and --repeats must be >= 1")

    import torch

    from verl_prm.apps.arithmetic.model import ModelConfig, build_model, build_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, ModelConfig())
    model.config._attn_implementation = "sdpa"  # the CPU loop's attention
    input_ids = torch.randint(3, len(tokenizer), (args.batch, args.tokens))

    def seconds(module, autocast) -> float:
        best = float("inf")
        for attempt in range(args.repeats + 1):
            module.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with autocast():
                loss = module(input_ids=input_ids).logits.float().logsumexp(-1).mean()
            loss.backward()
            if attempt > 0:  # the first pass warms up
                best = min(best, time.perf_counter() - start)
        return best

    results = {
        "fp32": seconds(model, contextlib.nullcontext),
        "bf16 autocast (fp32 parameters)": seconds(model, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "bf16 parameters": seconds(model.to(torch.bfloat16), contextlib.nullcontext),
    }
    print(f"forward + backward, {args.batch} x {args.tokens} tokens, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters, {args.threads} thread(s), CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| precision | seconds | ratio to fp32 |\n|---|---:|---:|")
    for name, value in results.items():
        print(f"| {name} | {value:.2f} | {value / results['fp32']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
