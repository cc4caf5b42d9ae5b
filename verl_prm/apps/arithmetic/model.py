"""The arithmetic recipe's policy: a character-level tokenizer, a tiny Qwen2 causal LM from scratch, and SFT.

Tokenizer: byte-level BPE with no merges (vocabulary = the 256 bytes + ``<|endoftext|>`` + ``<|pad|>``), so
every character is one token (digits are never merged: arithmetic stays position-wise) and the byte-level
fast paths of ``verl_prm.steps`` apply. Its chat template writes each message's content followed by "\\n",
the text every stage of the recipe (SFT, labels, RL, search, verl's RLHFDataset) renders a prompt to.

SFT: next-token cross-entropy on the response tokens and the EOS (prompt tokens are not trained), AdamW with
linear warm-up and cosine decay, random batches of right-padded sequences. The model is saved in Hugging Face
format (safetensors) with its tokenizer and a generation config naming EOS and pad.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHAT_TEMPLATE",
    "ModelConfig",
    "SFTConfig",
    "build_model",
    "build_tokenizer",
    "encode_sft",
    "render",
    "save_policy",
    "train_sft",
]

# content + "\n" per message: the same text as verl_prm.labeling.inputs.render_prompt's fallback for one message.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


@dataclass(frozen=True)
class ModelConfig:
    """Qwen2 architecture knobs (defaults: the CPU scale, ~0.9 M parameters)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # The first curriculum_steps steps draw only the shortest problems (the task's min_ops operations): a model
    # from scratch learns the format and the arithmetic there (longer problems from the start kept it on the
    # loss plateau of a model that cannot copy yet: see docs/arithmetic.md), then all lengths.
    curriculum_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"SFTConfig.{name} must be finite and >= 0, got {value!r}")
        if not 0 <= self.curriculum_steps <= self.steps:
            raise ValueError(f"SFTConfig.curriculum_steps must be in [0, steps={self.steps}], got {self.curriculum_steps}")
        if self.steps < 1 or self.batch_size < 1 or self.warmup_steps < 0:
            raise ValueError(f"SFTConfig needs steps >= 1, batch_size >= 1, warmup_steps >= 0; got {self.steps}, "
                             f"{self.batch_size}, {self.warmup_steps}")


def build_tokenizer():
    """The character-level (byte-level BPE without merges) tokenizer with the recipe's chat template."""
    from verl_prm.bpe import train_byte_level_bpe

    # 256 byte tokens + 2 special tokens: the trainer's vocabulary is full before any merge.
    tokenizer = train_byte_level_bpe(["0123456789+-*=() mod answer\n"], vocab_size=258)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def render(tokenizer, prompt_text: str) -> str:
    """The text the policy reads for a user message (the chat template, as verl and ``verl-prm label`` apply it)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}], tokenize=False,
                                         add_generation_prompt=True)


def build_model(tokenizer, config: ModelConfig, seed: int = 0):
    """A Qwen2ForCausalLM with random weights (seeded)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(config),
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen)


def encode_sft(tokenizer, prompts: Sequence[str], responses: Sequence[str]) -> list[tuple[list[int], int]]:
    """(ids of rendered prompt + response + EOS, number of prompt tokens) per example."""
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        prompt_ids = tokenizer(render(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        out.append((prompt_ids + response_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return out


def sft_batch(examples: Sequence[tuple[list[int], int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` [B, L] and ``labels`` [B, L] (-100 on prompt and padding)."""
    import torch

    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_sft(model, examples: Sequence[tuple[list[int], int]], config: SFTConfig, pad_token_id: int,
              *, progress: bool = True, log: Callable[[dict], None] | None = None,
              device: torch.device | str = "cpu", short: Sequence[int] | None = None) -> list[float]:
    """Train ``model`` (already on ``device``) in place; returns the loss of every step. ``short``: indices of the
    examples the first ``config.curriculum_steps`` steps draw from (required when curriculum_steps > 0)."""
    if config.curriculum_steps and not short:
        raise ValueError("train_sft: SFTConfig.curriculum_steps > 0 needs the indices of the short examples (short=)")
    import torch
    from tqdm.auto import tqdm

    rng = random.Random(f"sft-{config.seed}")
    torch.manual_seed(config.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.warmup_steps, config.steps, config.min_lr_ratio))
    losses = []
    bar = tqdm(range(config.steps), desc="SFT", unit="step", disable=not progress)
    for step in bar:
        if step < config.curriculum_steps:
            chosen = [examples[short[rng.randrange(len(short))]] for _ in range(config.batch_size)]
        else:
            chosen = [examples[rng.randrange(len(examples))] for _ in range(config.batch_size)]
        batch = sft_batch(chosen, pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if log is not None and ((step + 1) % 25 == 0 or step + 1 == config.steps):
            log({"step": step + 1, "loss": sum(losses[-25:]) / len(losses[-25:]), "lr": scheduler.get_last_lr()[0]})
    model.eval()
    return losses


def save_policy(model, tokenizer, path: str | Path) -> Path:
    """Hugging Face format: safetensors weights, config, generation config (EOS, pad) and the tokenizer."""
    from transformers import GenerationConfig

    from verl_prm.checkpoints import save_model

    path = Path(path)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.eos_token_id)
    return save_model(model, tokenizer, path)
