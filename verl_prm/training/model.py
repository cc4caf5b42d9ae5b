"""The model a training run trains: a one-logit token-classification model (from a checkpoint, ``--init`` or
``--init-config``), its value head, and the tokenizer as the checkpoint will load it.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

from verl_prm.checkpoints import check_tokenizer_files, resolve_checkpoint
from verl_prm.training.config import TrainConfig

__all__ = ["build_model", "value_head_of", "value_head_from_init"]


def build_model(config: TrainConfig, tokenizer, checkpoint: Path | None = None):
    """A token-classification model with one logit per token.

    ``checkpoint`` (resume) or ``config.init``: ``AutoModelForTokenClassification.from_pretrained`` (a causal
    LM checkpoint initialises the backbone, the one-logit head is new). ``config.init_config``: a config.json
    (file or directory) for a new model with random weights (seeded by ``config.seed``).
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch.manual_seed(config.seed)
    if checkpoint is not None or config.init is not None:
        path = str(checkpoint or config.init)
        if checkpoint is None:
            model = value_head_from_init(path)
        else:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, trust_remote_code=False)
    else:
        source = Path(config.init_config)
        if source.is_dir():
            model_config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        else:
            values = json.loads(source.read_text())
            model_config = AutoConfig.for_model(values.pop("model_type"), **values)
        model_config.num_labels = 1
        if getattr(model_config, "vocab_size", None) is not None and model_config.vocab_size < len(tokenizer):
            raise ValueError(f"init_config vocab_size={model_config.vocab_size} < tokenizer size {len(tokenizer)}")
        model = AutoModelForTokenClassification.from_config(model_config)
    if model.config.num_labels != 1:
        raise ValueError(f"the critic needs one logit per token; the model has num_labels={model.config.num_labels}")
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def value_head_of(model) -> torch.nn.Module:
    """The one-logit head of a token-classification model (``score`` in most architectures, ``classifier`` in
    BERT-like ones): what ``--freeze-backbone`` trains."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(f"--freeze-backbone: {type(model).__name__} has no `score` or `classifier` head to train alone; "
                     "train the whole model (drop --freeze-backbone)")


def value_head_from_init(path: str):
    """A one-logit token-classification model on the weights at ``path`` (``--init``, usually a causal LM).

    The new head (``score.*``/``classifier.*``) missing from a causal LM checkpoint, and its LM head left
    unused, are the intent here, so transformers' load report is silenced for exactly those keys; any other
    missing, unexpected or mismatched key is still reported (a warning naming the keys).
    """
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, trust_remote_code=False,
                                                                      output_loading_info=True)
    finally:
        hf_logging.set_verbosity(previous)
    head_prefixes = ("score.", "classifier.")
    surprises = {
        "missing": [k for k in info.get("missing_keys", ()) if not str(k).startswith(head_prefixes)],
        "unexpected": [k for k in info.get("unexpected_keys", ()) if not str(k).startswith("lm_head.")],
        "mismatched": [k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys", ())],
    }
    surprises = {kind: sorted(map(str, keys)) for kind, keys in surprises.items() if keys}
    if surprises:
        warnings.warn(f"verl-prm train: initialising the critic from {path}: keys other than the new value head "
                      f"did not load as expected: {surprises}", stacklevel=2)
    return model


def _tokenizer_as_checkpoint_loads_it(tokenizer, model_config, output_dir: Path, note: Callable[[str], None]):
    """The tokenizer that ``AutoTokenizer.from_pretrained(checkpoint)`` will return.

    transformers chooses a checkpoint's tokenizer class from its config's ``model_type`` (a byte-level BPE saved
    next to a qwen2 config loads as ``Qwen2Tokenizer``, whose pre-tokenizer splits text differently). Training
    with the reloaded tokenizer makes training, resuming and scoring with ProverCritic tokenise alike.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".tokenizer-") as directory:
        model_config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        reloaded = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    if type(reloaded) is not type(tokenizer):
        note(f"verl-prm train: the checkpoint will load the tokenizer as {type(reloaded).__name__} (not "
             f"{type(tokenizer).__name__}); training uses that class so that scoring tokenises the same way")
    return reloaded


def tokenizer_and_model(config: TrainConfig, checkpoint: Path | None, output_dir: Path,
                         note: Callable[[str], None]):
    """The tokenizer and the model to train, after the checks that need no model (paths, tokenizer files) and
    the one that needs both (every token id has an embedding)."""
    from transformers import AutoTokenizer

    if checkpoint is None and config.init is not None:
        # no such directory, a file, no weights, pickle-only weights: an error naming --init before any load
        resolve_checkpoint(config.init, "--init")
    if checkpoint is not None:
        tokenizer_path, flag = str(checkpoint), "checkpoint"
    elif config.tokenizer is not None:
        tokenizer_path, flag = config.tokenizer, "--tokenizer"
    else:
        tokenizer_path, flag = config.init, "--init (no --tokenizer given)"
    check_tokenizer_files(tokenizer_path, flag)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    model = build_model(config, tokenizer, checkpoint)
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ValueError(f"the tokenizer of {flag} {tokenizer_path} has {len(tokenizer)} tokens but the model has "
                         f"{embeddings} embeddings: token ids >= {embeddings} have none. Use the model's own "
                         "tokenizer (--tokenizer), or a model whose vocab_size covers it")
    if checkpoint is None:
        tokenizer = _tokenizer_as_checkpoint_loads_it(tokenizer, model.config, output_dir, note)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if config.freeze_backbone:
        head = value_head_of(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for parameter in head.parameters():
            parameter.requires_grad_(True)
    return tokenizer, model
