"""The word-problem policy: a pretrained chat model, optionally fine-tuned (SFT) on reference solutions, and its
pass@1 measured by sampling.

SFT reuses the arithmetic recipe's loop (``verl_prm.apps.arithmetic.model.train_sft``: cross-entropy on the
response tokens and the EOS, AdamW, warm-up and cosine decay) on the chat the policy later reads
(:func:`.task.prompt_messages` through the model's own chat template) followed by the reference solution and the
policy's EOS.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from verl_prm.apps.word_problems.task import Problem, parse_answer, prompt_messages

__all__ = ["encode_examples", "fine_tune", "pass_at_1"]


def encode_examples(tokenizer, problems: Sequence[Problem], shots: Sequence[Problem] = ()) -> list[tuple[list[int], int]]:
    """(ids of the rendered chat + reference solution + EOS, number of prompt ids) per problem."""
    from verl_prm.labeling.inputs import render_prompt

    out = []
    for problem in problems:
        prompt = tokenizer(render_prompt(prompt_messages(problem, shots), tokenizer), add_special_tokens=False)
        response = tokenizer(problem.solution(), add_special_tokens=False)["input_ids"]
        out.append((prompt["input_ids"] + response + [tokenizer.eos_token_id], len(prompt["input_ids"])))
    return out


def fine_tune(base: str | Path, problems: Sequence[Problem], output: Path, config, *, shots: Sequence[Problem] = (),
              progress: bool = True, log=None) -> dict:
    """``base`` fine-tuned on the reference solutions of ``problems`` (``config``: an arithmetic ``SFTConfig``) in
    the chat the policy later reads (with the few-shot ``shots``), saved to ``output`` with its tokenizer and generation config (safetensors). Returns the losses' summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.apps.arithmetic.model import train_sft
    from verl_prm.checkpoints import from_pretrained_kwargs, resolve_checkpoint, save_model
    from verl_prm.special_tokens import ensure_pad_token

    path = resolve_checkpoint(str(base), "policy")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **from_pretrained_kwargs())
    pad = ensure_pad_token(tokenizer, model.generation_config, source=f"word-problem SFT of {base}")
    examples = encode_examples(tokenizer, problems, shots)
    losses = train_sft(model, examples, config, pad, progress=progress, log=log)
    output.mkdir(parents=True, exist_ok=True)
    save_model(model, tokenizer, output)
    head = losses[: max(1, len(losses) // 10)]
    tail = losses[-max(1, len(losses) // 10):]
    return {"examples": len(examples), "first_loss": sum(head) / len(head), "final_loss": sum(tail) / len(tail)}


def pass_at_1(generator, problems: Sequence[Problem], shots: Sequence[Problem] = (), *, seed: int = 0) -> dict:
    """One sample per problem from ``generator`` (a ``verl_prm.labeling.generators`` engine) on the chat of
    :func:`.task.prompt_messages`: the share whose parsed answer equals the problem's, its standard error over
    problems, the share that ended at EOS, the generated tokens and the seconds."""
    from verl_prm.labeling.generators import derive_seed
    from verl_prm.labeling.inputs import render_prompt

    texts = [render_prompt(prompt_messages(p, shots), generator.tokenizer) for p in problems]
    started = time.perf_counter()
    samples = generator.generate(texts, 1, [derive_seed(seed, i, "pass@1") for i in range(len(texts))])
    seconds = time.perf_counter() - started
    correct = [parse_answer(s[0].text) == p.answer for s, p in zip(samples, problems)]
    n = len(correct)
    share = sum(correct) / n if n else float("nan")
    return {"problems": n, "pass_at_1": share, "stderr": (share * (1 - share) / max(n - 1, 1)) ** 0.5,
            "finished": sum(s[0].finished for s in samples) / max(n, 1),
            "generated_tokens": sum(s[0].num_tokens for s in samples), "seconds": round(seconds, 1),
            "examples": [s[0].text for s in samples[:3]]}
