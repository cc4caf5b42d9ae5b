"""A tiny random-weight causal LM and a byte-level BPE tokenizer trained on local text, for the tests and CPU
smoke runs of ``verl-prm label`` and ``verl-prm train`` without downloads (its samples are noise; the outcome is
~always 0). A test fixture, not in the wheel; from a checkout::

    python tests/tiny_model.py --texts data/gsm8k_test.jsonl --output tiny_lm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

__all__ = ["write_tiny_causal_lm", "main"]


def write_tiny_causal_lm(texts: Sequence[str], output: str | Path, *, vocab_size: int = 512, hidden_size: int = 64,
                         num_layers: int = 2, seed: int = 0) -> Path:
    """Train a BPE tokenizer on ``texts`` and save it with a random Qwen2ForCausalLM (safetensors) to ``output``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_prm.bpe import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(texts, vocab_size=vocab_size)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    output = Path(output)
    Qwen2ForCausalLM(config).save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", required=True, help="jsonl file: every string field is tokenizer training text")
    parser.add_argument("--output", required=True)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--limit", type=int, default=1000, help="rows of --texts to read")
    args = parser.parse_args(argv)
    texts = []
    with open(args.texts) as f:
        for line, _ in zip(f, range(args.limit)):
            texts.extend(v for v in json.loads(line).values() if isinstance(v, str))
    path = write_tiny_causal_lm(texts, args.output, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                                num_layers=args.num_layers)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
