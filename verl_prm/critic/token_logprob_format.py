"""Critic format ``token_logprob``: a causal LM (the policy when the head was fitted) and a logistic head on the
statistics of its own token log-probs over each step (:mod:`verl_prm.critic.token_logprob`; the head's files:
:mod:`verl_prm.critic.token_logprob_head`).

The critic reads the same ids as ``value_head`` (no markers; prompt and response as the other token formats get
them) in the same packed forward pass of the scorer; instead of a head at the read positions
``[prompt_end, e_1, ..., e_H]``, :meth:`TokenLogprobFormat.read_values` takes the LM's output layer on the last
hidden states of positions ``prompt_end .. e_H - 1`` (the logits predicting each response token up to the last
step's end, chunked: ``token_logprobs``), the steps' tokens from the read positions (step h: ``e_{h-1} + 1 ..
e_h``) and, with a ``result_regex``, the step's text from the response ids (``verl_prm.steps.decode_with_char_ends``:
the text those ids decode to, each token's characters; special tokens hold none), so the token-id path and the
text path read one and the same thing. v_0 is the head's constant.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from verl_prm.checkpoints import CheckpointError
from verl_prm.checks import compile_result_regex
from verl_prm.critic.format_base import CriticFormat, no_options
from verl_prm.critic.loading import base_model, check_vocabulary, load_complete
from verl_prm.critic.packing import BatchTensors
from verl_prm.critic.token_logprob import (feature_names, logit_chunk_tokens, result_claims, statistic_names,
                                           step_features, step_logprob_stats, step_token_ranges, token_logprobs)
from verl_prm.critic.token_logprob_head import TokenLogprobHead, read_head
from verl_prm.steps import decode_with_char_ends

__all__ = ["TokenLogprobFormat"]

# the load-time check of the logits: this many token ids of the vocabulary, from 0
PROBE_TOKENS = 8


class TokenLogprobFormat(CriticFormat):
    """Format ``token_logprob``: ``AutoModelForCausalLM`` (safetensors, no remote code) plus the head files
    ``token_logprob_head.json`` / ``.safetensors``. ``head`` is the LM's output layer (moved with the backbone);
    ``fitted`` the logistic head (None: an adapter that only extracts features, for a fit)."""

    name = "token_logprob"

    def __init__(self, model, backbone, lm_head, *, tokenizer, fitted: TokenLogprobHead | None,
                 result_regex: str | None):
        super().__init__(model, backbone, lm_head)
        self.tokenizer = tokenizer
        self.fitted = fitted
        self.result_regex = result_regex
        self.pattern = None if result_regex is None else compile_result_regex("result_regex", result_regex)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.chunk_tokens = logit_chunk_tokens(lm_head.weight.shape[0])
        self.features = feature_names(result_regex is not None)

    @classmethod
    def load(cls, path, tokenizer, *, dtype, attn_implementation, device, allow_pickle=False, **options):
        """The checkpoint ``path``: its head first (a directory without one fails before the LM loads), then the
        LM; the format takes no options (the regex is the head's)."""
        no_options(cls.name, options)
        fitted = read_head(path)
        return cls.load_lm(path, tokenizer, dtype=dtype, attn_implementation=attn_implementation, device=device,
                           allow_pickle=allow_pickle, fitted=fitted, result_regex=fitted.result_regex)

    @classmethod
    def load_lm(cls, path, tokenizer, *, dtype, attn_implementation, device, allow_pickle=False,
                fitted: TokenLogprobHead | None = None, result_regex: str | None = None) -> "TokenLogprobFormat":
        """The causal LM at ``path`` as this format; without ``fitted``, an adapter for feature extraction."""
        from transformers import AutoModelForCausalLM

        model = load_complete(AutoModelForCausalLM, path, dtype, attn_implementation, allow_pickle, device)
        check_vocabulary(path, tokenizer, model)
        model.eval()
        adapter = cls(model, base_model(model), model.get_output_embeddings(), tokenizer=tokenizer, fitted=fitted,
                      result_regex=result_regex)
        adapter.check_logits(path)
        return adapter

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM's logits of last hidden states [n, H]: its output layer, then ``final_logit_softcapping``
        (``c tanh(z / c)``) where the config has one."""
        logits = self.head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def check_logits(self, path) -> None:
        """The model's own forward must give :meth:`lm_logits` of its backbone's output (an architecture that
        scales or post-processes its logits otherwise is refused at load, not scored wrongly)."""
        device = next(self.model.parameters()).device
        ids = torch.arange(min(PROBE_TOKENS, self.head.weight.shape[0]), device=device)[None]
        full = self.model(input_ids=ids, use_cache=False).logits.float()
        mine = self.lm_logits(self.backbone(input_ids=ids, use_cache=False).last_hidden_state).float()
        if full.shape != mine.shape or not torch.allclose(full, mine, rtol=1e-3, atol=1e-3):
            gap = (full - mine).abs().max().item() if full.shape == mine.shape else f"shapes {full.shape}, {mine.shape}"
            raise CheckpointError(
                f"critic checkpoint {str(path)!r}: format 'token_logprob' reads the logits as the output layer on "
                f"the last hidden state, but {type(self.model).__name__}'s forward gives other logits (max "
                f"difference {gap}); this architecture post-processes its logits in a way the format does not "
                "support")

    def step_features(self, hidden: torch.Tensor, tensors: BatchTensors, counts: Sequence[int]) -> list[np.ndarray]:
        """[H_i, F] features (``feature_names``) of each sequence of a micro-batch (``read_values``' inputs).

        Sequence i's read positions ``r_0 < r_1 < ... < r_H`` (flat indices of ``tensors.flat_read``: the prompt's
        last token, each step's last token): the hidden states at ``r_0 .. r_H - 1`` predict the response tokens
        ``r_0 + 1 .. r_H`` (one chunked pass over every sequence of the batch), step h holds tokens ``r_{h-1} + 1
        .. r_h``."""
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_ids = tensors.input_ids.reshape(-1)
        reads = tensors.flat_read.cpu().numpy()
        bounds = np.cumsum([0, *counts])
        firsts, lasts = reads[bounds[:-1]], reads[bounds[1:] - 1]
        source = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in zip(firsts, lasts)] or [np.zeros(0)])
                                  .astype(np.int64)).to(flat_ids.device)
        logprobs = token_logprobs(flat_hidden.index_select(0, source), flat_ids.index_select(0, source + 1),
                                  self.lm_logits, self.chunk_tokens).double().cpu().numpy()
        host_ids = flat_ids.cpu() if self.pattern is not None else None
        out, start = [], 0
        for k, (first, last) in enumerate(zip(firsts, lasts)):
            mine = logprobs[start:start + last - first]
            start += last - first
            if counts[k] == 1:
                out.append(np.zeros((0, len(self.features))))
                continue
            ranges = step_token_ranges(reads[bounds[k] + 1:bounds[k + 1]] - first - 1)
            claims = None
            if self.pattern is not None:
                decoded = decode_with_char_ends(self.tokenizer, host_ids[first + 1:last + 1][None])
                claims = result_claims(decoded.texts[0], decoded.char_ends[0].numpy(), ranges, self.pattern)
            out.append(step_features(step_logprob_stats(mine, ranges, claims)))
        return out

    def read_values(self, hidden, tensors, counts):
        """``[v_0, v_1, ..., v_H]`` per sequence: v_0 the fitted constant, v_h the fitted head on step h's
        features; ``read``: the features (zeros at the prompt, which reads none)."""
        if self.fitted is None:
            raise RuntimeError("this token_logprob adapter has no fitted head (it extracts features for a fit); "
                               "load a checkpoint with ProverCritic.from_pretrained(path, format='token_logprob')")
        values, read = [], []
        for features in self.step_features(hidden, tensors, counts):
            values.append(np.concatenate([[self.fitted.prompt_value], self.fitted.values(features)]))
            read.append(np.concatenate([np.zeros((1, len(self.features))), features]))
        values = torch.from_numpy(np.concatenate(values)).float()
        read = torch.from_numpy(np.concatenate(read)).float()
        return values, torch.isfinite(read).all(-1) & torch.isfinite(values), read

    def logits_to_values(self, logits):
        raise NotImplementedError("format token_logprob reads its values with read_values")

    def __repr__(self) -> str:
        statistics = list(statistic_names(self.pattern is not None))
        return (f"{type(self).__name__}(model={type(self.model).__name__}, statistics={statistics}, "
                f"result_regex={self.result_regex!r})")
