"""A policy's special tokens: the ids that end its responses, and the id that pads its batches.

A checkpoint names its EOS twice: the tokenizer's ``eos_token`` and the generation config's ``eos_token_id`` (an
int or a list: Qwen2.5 instruct models list ``<|im_end|>`` and ``<|endoftext|>``, Llama 3 instruct models three
ids). They can disagree: transformers' GGUF loader gives SmolLM2-135M-Instruct's tokenizer ``<|im_start|>`` (id 1)
while its generation config says ``<|im_end|>`` (id 2); a fine-tuned chat model may have its tokenizer's EOS
changed to the chat turn's end and its generation config left at the base model's. Taking either alone for the
policy's would call the responses that end at the other truncated.

The rule here, used by every generator, truncation check and step split of the package: the policy's EOS ids are
the **union** of the two, the tokenizer's first. It is the stop set vLLM samples with
(``SamplingParams.update_from_generation_config`` adds the generation config's ids to the tokenizer's EOS) and the
one TRL's ``GRPOTrainer`` builds (``eos_token_ids``), so what verl's vLLM rollouts and TRL stop at is what is
called finished. A disagreement is logged, naming both ids and the fix.

Many tokenizers (most Llama-family ones) have no pad token, and transformers refuses ``padding=True`` without one:
``ensure_pad_token`` sets it to the generation config's ``pad_token_id`` when there is one, else to the policy's
EOS, and logs the choice. Padded positions are masked (attention mask, response mask), so which id pads does not
change any result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

__all__ = ["ensure_pad_token", "generation_config_of", "policy_eos_token_ids", "token_ids"]

logger = logging.getLogger(__name__)


def _log(message: str, log: Callable[[str], None] | None) -> None:
    (log or logger.warning)(message)


def token_ids(value) -> list[int]:
    """An ``eos_token_id``-like value (None, an int, or a list/tuple of ints) as a list of ints, in order."""
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"a token id must be a non-negative int, got {item!r} (in {value!r})")
        if item not in out:
            out.append(item)
    return out


def _name(tokenizer, token_id: int) -> str:
    return f"{tokenizer.convert_ids_to_tokens(int(token_id))!r} (id {token_id})"


def policy_eos_token_ids(tokenizer, generation_config=None, *, source: str = "the policy",
                         log: Callable[[str], None] | None = None) -> list[int]:
    """The ids that end the policy's responses: the tokenizer's EOS, then the generation config's ``eos_token_id``
    (an int or a list) not already in it. The tokenizer's EOS comes first (it is the one to pad with).

    ``generation_config``: the model's (``model.generation_config``, ``generation_config_of(path)``), or None.
    When the tokenizer's EOS is not among the generation config's ids, both are kept and a line naming them and
    the fix is logged (``log``, default ``logging.warning``). Neither naming an EOS, or an id outside the
    tokenizer's vocabulary, is an error naming ``source``.
    """
    tokenizer_eos = token_ids(getattr(tokenizer, "eos_token_id", None))
    generation_eos = token_ids(getattr(generation_config, "eos_token_id", None))
    ids = tokenizer_eos + [i for i in generation_eos if i not in tokenizer_eos]
    if not ids:
        raise ValueError(f"{source}: neither the tokenizer nor the generation config names an EOS token, so the end "
                         "of a response is unknown: set the tokenizer's eos_token (tokenizer.eos_token = ...; "
                         "save_pretrained) or eos_token_id in generation_config.json")
    size = len(tokenizer)
    outside = [i for i in ids if i >= size]
    if outside:
        raise ValueError(f"{source}: EOS ids {outside} (tokenizer {tokenizer_eos}, generation config "
                         f"{generation_eos}) are outside the tokenizer's vocabulary of {size}: the tokenizer is not "
                         "the model's")
    if tokenizer_eos and generation_eos and not set(tokenizer_eos) & set(generation_eos):
        names = ", ".join(_name(tokenizer, i) for i in generation_eos)
        _log(f"{source}: the tokenizer's EOS {_name(tokenizer, tokenizer_eos[0])} is not among the generation "
                  f"config's eos_token_id ({names}); responses ending at any of them count as finished (vLLM stops "
                  "at all of them). If the tokenizer's is not an end of response, fix the tokenizer: "
                  f"tokenizer.eos_token = {tokenizer.convert_ids_to_tokens(generation_eos[0])!r}; "
                  "tokenizer.save_pretrained(<the model directory>)", log)
    return ids


def ensure_pad_token(tokenizer, generation_config=None, *, source: str = "the policy",
                     log: Callable[[str], None] | None = None) -> int:
    """The tokenizer's pad id; a tokenizer without one gets one (it is modified, so ``padding=True`` works).

    The pad is the generation config's ``pad_token_id`` when it names one in the vocabulary, else the policy's
    first EOS (``policy_eos_token_ids``). The choice is logged (``log``, default ``logging.warning``).
    """
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    pad = getattr(generation_config, "pad_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is not None and 0 <= int(pad) < len(tokenizer):
        reason = "the generation config's pad_token_id"
    else:
        pad = policy_eos_token_ids(tokenizer, generation_config, source=source, log=log)[0]
        reason = "its EOS"
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad))
    _log(f"{source}: the tokenizer has no pad token; batches are padded with {_name(tokenizer, int(pad))}, "
              f"{reason} (padded positions are masked)", log)
    return int(pad)


def generation_config_of(path: str | Path):
    """The generation config of a checkpoint (its ``generation_config.json``, else one made from its model
    config, as transformers does when loading the model); None when the directory has neither."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        pass
    try:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, trust_remote_code=False))
    except (OSError, ValueError):
        return None
