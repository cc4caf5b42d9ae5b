"""The prover critic: v_0 (prompt) and v_1..v_H (after each step) for every response, in one forward pass per
sequence.

Scoring path: step ends (from text spans, critic-side token positions, or policy tokens + ``StepSplit``) ->
the format's adapter inserts its markers (``packing.insert_markers``) -> context check / left truncation ->
micro-batches by a token budget, longest first -> one forward pass per micro-batch under
``torch.inference_mode()`` (one packed row with restarting ``position_ids`` = varlen attention, its boundaries
given once for flash attention; or right-padded rows with minimal padding), the next micro-batch's host tensors
prepared in a background thread meanwhile -> the format's ``read_values`` (the head applied only at the read
positions; ``token_logprob``: its statistics of the LM's token log-probs between them) -> values back in input
order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch

from verl_prm.advantages import best_of_k as best_of_k_transform
from verl_prm.checkpoints import allow_pickle_default, resolve_checkpoint
from verl_prm.checks import check_number
from verl_prm.critic.formats import FORMATS, CriticFormat
from verl_prm.critic.loading import (default_attn_implementation, load_critic_tokenizer, require_tokenizer_files,
                                     resolve_dtype)
from verl_prm.critic.packing import (
    BatchTensors,
    CriticInput,
    MicroBatch,
    Truncation,
    check_step_positions,
    fit_context,
    packed_tensors,
    padded_tensors,
    plan_micro_batches,
)
from verl_prm.critic.sequences import aligned_sequences, decode_prompts, decode_segments, policy_sequences
from verl_prm.critic.text_input import TextInput, text_flags
from verl_prm.steps import (align_to_critic, encode_with_step_ends, merge_shared_step_ends, same_tokenizer,
                            step_char_spans)
from verl_prm.training.calibration import Calibration, checkpoint_calibration

logger = logging.getLogger(__name__)

__all__ = ["CriticScores", "ProverCritic", "runs_varlen"]



def runs_varlen(attn_implementation: str) -> bool:
    """Whether transformers runs a packed row (restarting ``position_ids``, no attention mask) of this attention
    implementation as varlen attention: the flash-attention family (``flash_attention_2``/``_3``, hub kernels
    named ``*flash-attn*``). Others (sdpa, eager) build a dense block-diagonal mask over the whole row."""
    return attn_implementation.startswith("flash_attention") or "flash-attn" in attn_implementation


Packing = Literal["auto", "varlen", "padded"]


@dataclass
class CriticScores:
    """Critic values of a batch of B responses (fp32, CPU).

    Attributes:
        prompt_values: [B] v_0 per response.
        step_values: [B, S] v_1..v_H per response; entries at h >= num_steps[b] are 0 and must be ignored.
        num_steps: [B] int64, H per response (0 allowed).
        features: [B, S + 1, d] fp32 or None: what the value head read at the prompt (position 0) and after each
            step (positions 1..H; zeros beyond), only when asked for (``with_features=True``); ``token_logprob``:
            each step's log-prob features, zeros at the prompt.
        separator_text: [B] bool or None: the response's step text held the format's separator text (qwen_prm's
            "<extra_0>", math_shepherd's "ки"), removed before scoring (``verl_prm.critic.formats``); False for
            formats that read token ids.
        special_text: [B] bool or None: the response's step text held a special token's text ("<|im_start|>"),
            read as plain text.
    """

    prompt_values: torch.Tensor
    step_values: torch.Tensor
    num_steps: torch.Tensor
    features: torch.Tensor | None = None
    separator_text: torch.Tensor | None = None
    special_text: torch.Tensor | None = None

    def as_dict(self) -> dict[str, torch.Tensor]:
        out = {"prompt_values": self.prompt_values, "step_values": self.step_values, "num_steps": self.num_steps}
        for name in ("features", "separator_text", "special_text"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class SpanScores(NamedTuple):
    """``ProverCritic.score_step_spans``'s result: the scores (one value per step), per sample the steps that
    repeat the value of the step before them (their last characters share its critic token), and each sample's
    critic tokens."""

    scores: CriticScores
    merged_steps: list[list[int]]
    sequence_tokens: list[int]


class ProverCritic:
    """A prover critic (PAV) that scores all steps of a response in one forward pass.

    Build it with :meth:`from_pretrained`. Entry points:

    - :meth:`score_texts` (prompts and responses as text; steps split by ``verl_prm.steps``),
    - :meth:`score_sequences` (critic token ids with the positions of the prompt's and each step's last token),
    - :meth:`score_policy_batch` (verl's ``prompts``/``responses``/``attention_mask`` + a ``StepSplit``; uses
      ``align_to_critic`` when the critic's tokenizer differs from the policy's).

    Every value the entry points return passes through :meth:`_assemble`: first the critic's ``calibration``
    (a monotone map fitted on held-out labels, ``verl_prm.training.calibration``; None = raw values), then, if
    ``best_of_k > 1``, Best-of-K (``verl_prm.advantages.best_of_k``, which says where it is applied: once).
    :meth:`forward_values` gives the raw values.
    """

    def __init__(
        self,
        adapter: CriticFormat,
        tokenizer,
        *,
        device: torch.device,
        best_of_k: int = 1,
        max_tokens_per_batch: int = 16384,
        max_length: int | None = None,
        truncation: Truncation = "error",
        packing: Packing = "auto",
        max_padding_share: float = 0.1,
        progress: bool = False,
        calibration: Calibration | None = None,
        prefetch: bool | None = None,
    ):
        if truncation not in ("error", "left_prompt"):
            raise ValueError(f"truncation must be 'error' or 'left_prompt', got {truncation!r}")
        if packing not in ("auto", "varlen", "padded"):
            raise ValueError(f"packing must be 'auto', 'varlen' or 'padded', got {packing!r}")
        best_of_k_transform(torch.zeros(1), best_of_k)  # validates k
        if best_of_k > 1 and getattr(adapter, "score", None) == "pos_minus_neg":
            raise ValueError("best_of_k > 1 needs values in [0, 1]; score='pos_minus_neg' gives P(pos) - P(neg)")
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.device = device
        self.best_of_k = best_of_k
        self.max_tokens_per_batch = int(max_tokens_per_batch)
        config_length = getattr(adapter.config, "max_position_embeddings", None)
        self.max_length = max_length if max_length is not None else config_length
        self.truncation = truncation
        attn = getattr(adapter.config, "_attn_implementation", None) or "eager"
        if packing == "auto":
            packing = "varlen" if runs_varlen(attn) else "padded"
        self.packing: Literal["varlen", "padded"] = packing
        self.max_padding_share = check_number("max_padding_share", max_padding_share, 0.0, 1.0)
        self.progress = progress
        # default: on for an accelerator, where the device would wait for Python-side packing; off on CPU, where
        # the thread competes with the forward for the same cores (measured slower: docs/gpu.md)
        self.prefetch = device.type != "cpu" if prefetch is None else bool(prefetch)
        if calibration is not None and getattr(adapter, "score", None) == "pos_minus_neg":
            raise ValueError(f"{calibration.describe()} maps values in [0, 1]; score='pos_minus_neg' gives "
                             "P(pos) - P(neg) in [-1, 1]")
        self.calibration = calibration
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        if pad is None and tokenizer is not None:
            pad = tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path: str,
        format: str = "value_head",
        best_of_k: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        max_tokens_per_batch: int = 16384,
        max_length: int | None = None,
        truncation: Truncation = "error",
        packing: Packing = "auto",
        max_padding_share: float = 0.1,
        attn_implementation: str | None = None,
        tokenizer: Any = None,
        progress: bool = False,
        allow_pickle: bool | None = None,
        calibration: str | os.PathLike = "auto",
        **format_options: Any,
    ) -> "ProverCritic":
        """Load a critic checkpoint (Hugging Face format, safetensors, ``trust_remote_code=False``).

        Args:
            path: checkpoint directory (model + tokenizer), or an ``org/model`` hub id. A missing directory, a
                file, a directory without weights and, in offline mode (``HF_HUB_OFFLINE``), a hub id that is not
                in the local cache are errors before anything is loaded (``verl_prm.checkpoints``).
            format: one of ``value_head`` (default), ``qwen_prm``, ``pure_prm``, ``math_shepherd``, ``rlhflow``,
                ``value_head_lm``, ``token_logprob`` (see ``verl_prm.critic.formats`` and docs/critic.md).
            best_of_k: K >= 1; K > 1 returns Best-of-K values ``1 - (1 - v)^K``.
            device: default CUDA when available, else CPU. An accelerator is the load target
                (``device_map={"": device}``): the weights go from the mapped safetensors to the device tensor by
                tensor, never as a whole model in host memory.
            dtype: default bf16 on CUDA, fp32 elsewhere. The head always runs in fp32.
            max_tokens_per_batch: token budget of one micro-batch (packed tokens, or rows x padded length).
            max_length: the critic's context; default ``config.max_position_embeddings``.
            truncation: ``"error"`` (default): a too-long input is an error naming the sample;
                ``"left_prompt"``: drop tokens from the left of the prompt (never the prompt's last token, never
                response tokens).
            packing: ``"auto"`` (varlen when the attention implementation supports it, i.e. flash attention on
                GPU; padded otherwise), ``"varlen"`` (one packed row per micro-batch; correct with any attention
                implementation, but sdpa/eager then build a block-diagonal mask over the whole row), ``"padded"``.
            max_padding_share: padded mode: a micro-batch closes before its padded share would exceed this.
            attn_implementation: default flash_attention_2 on CUDA for bf16/fp16 when flash-attn is installed, else sdpa.
            tokenizer: default the checkpoint's own, tokenizing as its saved ``tokenizer.json``
                (``verl_prm.critic.loading.load_critic_tokenizer``).
            progress: tqdm bar over micro-batches.
            allow_pickle: also load pickle-only weights (``pytorch_model.bin``; unpickling can run code). Default:
                the ``VERL_PRM_ALLOW_PICKLE`` environment variable, else False (safetensors only). Weights the
                model needs but the checkpoint lacks (a value head never saved) are always an error.
            calibration: ``"auto"`` (default): apply ``path/calibration.json`` when the checkpoint directory has
                one (``verl-prm train`` writes it), else none; ``"none"``: raw values; a path: that calibration
                file (or a directory holding one). A file fitted for other weights (digest), a non-monotone or
                non-finite map is an error naming the file (``verl_prm.training.calibration``).
            format_options: per format, e.g. ``separator=`` (qwen_prm), ``tag=``, ``positive_token=``,
                ``negative_token=`` (math_shepherd), ``head_prefix=`` (value_head_lm, qwen_prm, pure_prm),
                ``step_delimiter=`` (the text formats), ``score=`` (pure_prm).
        """
        if format not in FORMATS:
            raise ValueError(f"unknown critic format {format!r}; choose one of {sorted(FORMATS)}")
        allow_pickle = allow_pickle_default() if allow_pickle is None else bool(allow_pickle)
        path = resolve_checkpoint(path, "critic", allow_pickle=allow_pickle)
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = resolve_dtype(dtype, device)
        attn = attn_implementation or default_attn_implementation(device, torch_dtype)
        if tokenizer is None:
            require_tokenizer_files(path)
            tokenizer = load_critic_tokenizer(path)
        adapter = FORMATS[format].load(path, tokenizer, dtype=torch_dtype, attn_implementation=attn, device=device,
                                       allow_pickle=allow_pickle, **format_options)
        adapter.to(device)  # the fp32 heads some formats build on the host; the backbone is already there
        return cls(
            adapter,
            tokenizer,
            device=device,
            best_of_k=best_of_k,
            max_tokens_per_batch=max_tokens_per_batch,
            max_length=max_length,
            truncation=truncation,
            packing=packing,
            max_padding_share=max_padding_share,
            progress=progress,
            calibration=checkpoint_calibration(path, calibration),
        )

    # ------------------------------------------------------------------ entry points
    def score_texts(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        delimiter: str = "\n\n",
        regex: str | None = None,
        max_steps: int | None = None,
    ) -> CriticScores:
        """Score responses given as text.

        Steps are split with ``verl_prm.steps.step_char_spans`` (``delimiter`` or ``regex``). A text format (the
        public PRMs) builds its authors' input from the prompt and the step texts; the others tokenise prompt
        and response separately and concatenate them (``encode_with_step_ends``); v_h is read at the token that
        holds step h's last character (or at the marker after it). Steps that end in the same critic token (a step
        inside the token that ends the one before it) both get the value read there, with a warning.

        Returns:
            CriticScores with prompt_values [B], step_values [B, max H], num_steps [B].
        """
        if len(prompts) != len(responses):
            raise ValueError(f"score_texts: {len(prompts)} prompts but {len(responses)} responses")
        if self.adapter.text_input:
            step_texts = [[response[a:e] for a, e in step_char_spans(response, delimiter, regex=regex,
                                                                     max_steps=max_steps)] for response in responses]
            return self._score_step_texts(list(prompts), step_texts, None, 0)
        spans = [step_char_spans(response, delimiter, regex=regex, max_steps=max_steps) for response in responses]
        scored = self.score_step_spans(prompts, responses, spans)
        for sample, merged in enumerate(scored.merged_steps):
            if merged:
                h, response = merged[0], responses[sample]
                warnings.warn(f"score_texts: sample {sample}: step {h} ({response[spans[sample][h][0]:spans[sample][h][1]]!r}) "
                              f"ends in the critic token that also ends step {h - 1}; both get the value read there. "
                              "Use a delimiter that the critic's tokenizer keeps apart from the next step's text to "
                              "avoid it", stacklevel=2)
        return scored.scores

    def score_step_spans(self, prompts: Sequence[str], responses: Sequence[str],
                         spans: Sequence[Sequence[tuple[int, int]]], samples: Sequence[int] | None = None
                         ) -> "SpanScores":
        """Values of responses whose steps are given as character spans (``(start, end)`` per step, in order),
        read as ``score_texts`` reads them: the prompt and the response tokenised apart and concatenated
        (``encode_with_step_ends``), v_h at the token holding step h's last character. Steps that end in the same
        critic token (``merge_shared_step_ends``) are read once and both get that value: ``merged_steps`` lists,
        per sample, each step that repeats the value of the step before it. ``samples`` names the samples in
        errors (default: their positions). Not for text formats (the public PRMs build their own input)."""
        if self.adapter.text_input:
            raise ValueError("score_step_spans: this critic reads its authors' text format; use score_texts")
        samples = list(range(len(prompts))) if samples is None else list(samples)
        input_ids, prompt_ends, reads, read_of_step = [], [], [], []
        for sample, prompt, response, sample_spans in zip(samples, prompts, responses, spans, strict=True):
            encoded = encode_with_step_ends(self.tokenizer, prompt, response, list(sample_spans), sample=sample)
            sample_reads, sample_read_of_step = merge_shared_step_ends([int(e) for e in encoded.step_ends])
            input_ids.append(list(encoded.input_ids))
            prompt_ends.append(int(encoded.prompt_end))
            reads.append(sample_reads)
            read_of_step.append(sample_read_of_step)
        merged = [[h for h in range(1, len(steps)) if steps[h] == steps[h - 1]] for steps in read_of_step]
        tokens = [len(ids) for ids in input_ids]
        if not input_ids:
            return SpanScores(CriticScores(torch.zeros(0), torch.zeros((0, 0)), torch.zeros(0, dtype=torch.long)),
                              merged, tokens)
        scores = self.score_sequences(input_ids, prompt_ends, reads)
        for sample, expected, h in zip(samples, reads, scores.num_steps.tolist()):
            if h != len(expected):
                raise ValueError(f"sample {sample}: the critic returned {h} step values for {len(expected)} distinct "
                                 "step ends")
        if not any(merged):
            return SpanScores(scores, merged, tokens)
        # steps that share a critic token: each step gets the value read at its token
        width = max(len(s) for s in read_of_step)
        step_values = torch.zeros((len(read_of_step), width), dtype=scores.step_values.dtype)
        for b, steps in enumerate(read_of_step):
            step_values[b, : len(steps)] = scores.step_values[b, steps]
        num_steps = torch.tensor([len(s) for s in read_of_step], dtype=scores.num_steps.dtype)
        return SpanScores(dataclasses.replace(scores, step_values=step_values, num_steps=num_steps), merged, tokens)

    def score_sequences(
        self,
        input_ids: Sequence[Sequence[int]],
        prompt_ends: Sequence[int],
        step_ends: Sequence[Sequence[int]],
        *,
        num_step_slots: int | None = None,
        sample_offset: int = 0,
        with_features: bool = False,
    ) -> CriticScores:
        """Score critic-tokenised sequences (the tensor-level entry point).

        Args:
            input_ids: B lists of critic token ids (prompt followed by response, no padding, no markers).
            prompt_ends: [B] position of each prompt's last token.
            step_ends: B lists of the positions of each step's last token (strictly increasing, after the
                prompt); the adapter inserts its markers after these positions itself.
            num_step_slots: width S of ``step_values`` (default: the largest H); must be >= every H.
            sample_offset: added to sample indices in error messages (a data-parallel shard's first sample).
            with_features: also return what the head read (``CriticScores.features``).

        Returns:
            CriticScores; results are in input order.
        """
        if not len(input_ids) == len(prompt_ends) == len(step_ends):
            raise ValueError(
                f"score_sequences: {len(input_ids)} sequences, {len(prompt_ends)} prompt_ends, {len(step_ends)} step_ends"
            )
        built = self._build(input_ids, prompt_ends, step_ends, sample_offset)
        inputs = self._fit([b[:3] for b in built], sample_offset)
        features = [None] * len(inputs) if with_features else None
        values = self.forward_values(inputs, sample_offset=sample_offset, features=features)
        return self._assemble(values, num_step_slots, features, text_flags(built, sample_offset, self.adapter.name))

    def score_policy_batch(
        self,
        prompts: torch.Tensor,
        responses: torch.Tensor,
        attention_mask: torch.Tensor,
        step_split,
        policy_tokenizer=None,
        *,
        prompt_texts: Sequence[str] | None = None,
        sample_offset: int = 0,
        with_features: bool = False,
    ) -> CriticScores:
        """Score a verl rollout batch.

        Args:
            prompts: [B, P] policy token ids, left-padded (verl layout).
            responses: [B, T] policy token ids, right-padded.
            attention_mask: [B, P + T] 1 for real tokens; its last T columns are the responses' mask.
            step_split: ``verl_prm.steps.StepSplit`` of the responses (``step_ends`` index response positions).
            policy_tokenizer: the policy's tokenizer; ``None`` (or a tokenizer that ``same_tokenizer`` finds
                identical) means the critic reads the policy's ids as they are (no tokenizer call). Otherwise
                the text is re-tokenised with ``align_to_critic``; this needs ``step_split.texts`` and
                ``step_split.step_char_ends`` (``split_steps`` fills them).
            prompt_texts: B prompt texts exactly as the critic reads them (a different tokenizer only; e.g. with
                the critic's chat template applied). Default: the policy prompt ids decoded by the policy
                tokenizer with special tokens kept as text (a logged fallback).

        Returns:
            CriticScores with ``step_values`` [B, S] where S = ``step_split.step_ends.shape[1]``.
        """
        num_slots = int(step_split.step_ends.shape[1])
        prompt_len = prompts.shape[1]
        prompt_mask, response_mask = attention_mask[:, :prompt_len], attention_mask[:, prompt_len:]
        if policy_tokenizer is None or same_tokenizer(policy_tokenizer, self.tokenizer):
            input_ids, prompt_ends, step_ends = policy_sequences(prompts, responses, attention_mask, step_split)
        else:
            if len(step_split.texts) != responses.shape[0] or step_split.step_char_ends.shape[:1] != responses.shape[:1]:
                raise ValueError(
                    "score_policy_batch: the critic's tokenizer differs from the policy's, so the step split must "
                    "carry texts and step_char_ends (use verl_prm.steps.split_steps)"
                )
            if prompt_texts is None:
                prompt_texts = decode_prompts(policy_tokenizer, prompts, prompt_mask)
            if self.adapter.text_input:  # the format rebuilds its authors' input from the texts themselves
                step_texts = []
                for b, text in enumerate(step_split.texts):
                    ends = [int(e) for e in step_split.step_char_ends[b, : int(step_split.num_steps[b])].tolist()]
                    step_texts.append([text[a:e] for a, e in zip([0] + ends[:-1], ends)])
                return self._score_step_texts(list(prompt_texts), step_texts, num_slots, sample_offset,
                                              with_features=with_features)
            aligned = align_to_critic(
                responses, response_mask, policy_tokenizer, self.tokenizer, step_split, prompts=list(prompt_texts)
            )
            input_ids, prompt_ends, step_ends = aligned_sequences(aligned)
        return self.score_sequences(
            input_ids, prompt_ends, step_ends, num_step_slots=num_slots, sample_offset=sample_offset,
            with_features=with_features,
        )

    # ------------------------------------------------------------------ internals (public for the benchmark)
    def build_inputs(
        self,
        input_ids: Sequence[Sequence[int]],
        prompt_ends: Sequence[int],
        step_ends: Sequence[Sequence[int]],
        *,
        sample_offset: int = 0,
    ) -> list[CriticInput]:
        """Validate positions, build the format's input (its markers, or its authors' input rebuilt from the
        decoded prompt and steps for a text format), and fit the critic's context (see ``packing``)."""
        built = self._build(input_ids, prompt_ends, step_ends, sample_offset)
        return self._fit([b[:3] for b in built], sample_offset)

    def _build(self, input_ids, prompt_ends, step_ends, sample_offset: int) -> list[tuple]:
        """Per sample: (ids, read positions, prompt's last token), plus a text format's ``TextInput`` flags."""
        built = []
        for i, (ids, prompt_end, ends) in enumerate(zip(input_ids, prompt_ends, step_ends)):
            sample = sample_offset + i
            ids = [int(t) for t in ids]
            ends = [int(e) for e in ends]
            check_step_positions(sample, len(ids), int(prompt_end), ends)
            if self.adapter.text_input:  # decode the segments; the format rebuilds its authors' input from them
                try:
                    prompt, steps = decode_segments(self.tokenizer, ids, int(prompt_end), ends)
                    prompt = self.adapter.prompt_from_ids(self.tokenizer, prompt)
                except ValueError as error:
                    raise ValueError(f"sample {sample}: {error}") from None
                built.append(self._text_input(sample, prompt, steps))
            else:
                built.append(self.adapter.build_token_input(ids, int(prompt_end), ends))
        return built

    def _text_input(self, sample: int, prompt: str, steps: Sequence[str]) -> TextInput:
        if not prompt:
            raise ValueError(f"sample {sample}: the prompt is empty; the critic reads v_0 at its last token")
        try:
            return self.adapter.build_text_input(self.tokenizer, prompt, steps)
        except ValueError as error:
            raise ValueError(f"sample {sample}: {error}") from None

    def _score_step_texts(self, prompts: Sequence[str], step_texts: Sequence[Sequence[str]],
                          num_step_slots: int | None, sample_offset: int, with_features: bool = False) -> CriticScores:
        """Text formats: prompts and their step texts (with delimiters) -> the authors' inputs -> values."""
        built = [self._text_input(sample_offset + i, p, s) for i, (p, s) in enumerate(zip(prompts, step_texts))]
        inputs = self._fit([b[:3] for b in built], sample_offset)
        features = [None] * len(inputs) if with_features else None
        values = self.forward_values(inputs, sample_offset=sample_offset, features=features)
        return self._assemble(values, num_step_slots, features, text_flags(built, sample_offset, self.adapter.name))

    def _fit(self, built: Sequence[tuple[list[int], list[int], int]], sample_offset: int) -> list[CriticInput]:
        inputs = [fit_context(sample_offset + i, ids, reads, prompt_last, self.max_length, self.truncation)
                  for i, (ids, reads, prompt_last) in enumerate(built)]
        truncated = [sample_offset + i for i, x in enumerate(inputs) if x.prompt_tokens_dropped]
        if truncated:
            logger.warning(
                "truncation='left_prompt': dropped prompt tokens from the left of %d sample(s) to fit max_length=%s "
                "(first: sample %d, %d tokens)", len(truncated), self.max_length, truncated[0],
                inputs[truncated[0] - sample_offset].prompt_tokens_dropped,
            )
        return inputs

    def plan(self, inputs: Sequence[CriticInput], mode: Literal["varlen", "padded"] | None = None) -> list[MicroBatch]:
        return plan_micro_batches(
            [len(x.input_ids) for x in inputs], self.max_tokens_per_batch, mode or self.packing, self.max_padding_share
        )

    def prepare_batch(self, inputs: Sequence[CriticInput], batch: MicroBatch, mode: Literal["varlen", "padded"]
                      ) -> BatchTensors:
        """Host tensors of one micro-batch: a packed row (with its ``cu_seq_lens`` when the attention runs it as
        flash-attention varlen) or right-padded rows; page-locked when the critic runs on CUDA."""
        seqs = [inputs[i].input_ids for i in batch.indices]
        reads = [inputs[i].read_positions for i in batch.indices]
        if mode == "varlen":
            attn = getattr(self.adapter.config, "_attn_implementation", None) or "eager"
            tensors = packed_tensors(seqs, reads, boundaries=runs_varlen(attn))
        else:
            tensors = padded_tensors(seqs, reads, self.pad_id)
        return tensors.pin_memory() if self.device.type == "cuda" else tensors

    @torch.inference_mode()
    def forward_values(
        self,
        inputs: Sequence[CriticInput],
        batches: Sequence[MicroBatch] | None = None,
        mode: Literal["varlen", "padded"] | None = None,
        *,
        sample_offset: int = 0,
        features: list | None = None,
    ) -> list[torch.Tensor]:
        """Values [H_i + 1] per input (fp32, CPU), in input order: one forward pass per micro-batch.

        ``features``: a list of ``len(inputs)`` slots, filled with what the head read for each input ([H_i + 1, d]
        fp32, CPU: the backbone's last hidden state at the read positions).

        ``batches`` defaults to :meth:`plan` (length-sorted, token budget); the benchmark passes naive plans.
        With ``prefetch`` (default on an accelerator, off on CPU), micro-batch k + 1's host tensors are built in a background thread while
        micro-batch k runs, and copied to the device (non-blocking, from page-locked memory on CUDA) before k's
        values are read back: the device does not wait for Python-side packing between micro-batches.
        """
        mode = mode or self.packing
        batches = list(self.plan(inputs, mode) if batches is None else batches)
        results: list[torch.Tensor | None] = [None] * len(inputs)
        if not batches:
            return results  # type: ignore[return-value]
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batches), desc="critic", unit="batch")
        non_blocking = self.device.type == "cuda"
        with contextlib.ExitStack() as stack:
            if self.prefetch:
                pool = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-prepare"))

                def ahead(k: int) -> Callable[[], BatchTensors]:
                    return pool.submit(self.prepare_batch, inputs, batches[k], mode).result
            else:  # prepared when asked for, right before its forward
                def ahead(k: int) -> Callable[[], BatchTensors]:
                    return functools.partial(self.prepare_batch, inputs, batches[k], mode)

            current = ahead(0)().to(self.device, non_blocking=non_blocking)
            pending = ahead(1) if len(batches) > 1 else None
            for k, batch in enumerate(batches):
                hidden = self.adapter.backbone(**current.model_kwargs()).last_hidden_state
                counts = [len(inputs[i].read_positions) for i in batch.indices]
                values, finite, gathered = self.adapter.read_values(hidden, current, counts)
                if pending is not None:  # queued behind micro-batch k's kernels, before its values are read
                    current = pending().to(self.device, non_blocking=non_blocking)
                    pending = ahead(k + 2) if k + 2 < len(batches) else None
                self._collect(inputs, batch, values.cpu(), finite.cpu(), results, sample_offset)
                if features is not None:
                    start = 0
                    for i in batch.indices:
                        count = len(inputs[i].read_positions)
                        features[i] = gathered[start : start + count].cpu()
                        start += count
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    @staticmethod
    def _collect(inputs: Sequence[CriticInput], batch: MicroBatch, values: torch.Tensor, finite: torch.Tensor,
                 results: list, sample_offset: int) -> None:
        """Split a micro-batch's values per input into ``results``; a non-finite value names its sample."""
        start = 0
        for i in batch.indices:
            rp = inputs[i].read_positions
            chunk_finite = finite[start : start + len(rp)]
            if not bool(chunk_finite.all()):
                bad = int((~chunk_finite).nonzero()[0])
                where = "the prompt" if bad == 0 else f"step {bad - 1}"
                raise FloatingPointError(
                    f"sample {sample_offset + i}: the critic produced NaN/inf at {where} (token position "
                    f"{rp[bad]} of {len(inputs[i].input_ids)}); check the checkpoint and the dtype (fp16 "
                    "overflows; use bf16 or fp32)"
                )
            results[i] = values[start : start + len(rp)]
            start += len(rp)

    def describe(self) -> str:
        """What produces this critic's values: its format, calibration and Best-of-K."""
        calibration = self.calibration.describe() if self.calibration is not None else "uncalibrated"
        best = f", Best-of-{self.best_of_k}" if self.best_of_k > 1 else ""
        return f"{type(self.adapter).__name__} critic, {calibration}{best}"

    def __repr__(self) -> str:
        return f"ProverCritic({self.describe()}, device={self.device})"

    def set_value_head(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Replace the value head's parameters (format ``value_head``: ``v = sigmoid(w . h + b)``): ``weight`` [d] or
        [1, d], ``bias`` [] or [1], finite. Values computed afterwards use the new head (e.g. a head refitted to
        fresh labels, ``verl_prm.critic.refresh``)."""
        head = self.adapter.head
        if getattr(self.adapter, "name", None) != "value_head" or not isinstance(head, torch.nn.Linear) \
                or head.out_features != 1 or head.bias is None:
            raise ValueError(f"set_value_head needs a critic of format 'value_head' with a linear one-logit head and a "
                             f"bias, got {type(self.adapter).__name__} with {head}")
        weight = torch.as_tensor(weight, dtype=torch.float32).reshape(1, -1)
        bias = torch.as_tensor(bias, dtype=torch.float32).reshape(1)
        if weight.shape[1] != head.in_features:
            raise ValueError(f"set_value_head: the head reads {head.in_features} features, the new weight has "
                             f"{weight.shape[1]}")
        if not (torch.isfinite(weight).all() and torch.isfinite(bias).all()):
            raise ValueError("set_value_head: the new head has non-finite parameters")
        with torch.no_grad():
            head.weight.copy_(weight.to(head.weight.device, head.weight.dtype))
            head.bias.copy_(bias.to(head.bias.device, head.bias.dtype))

    def _assemble(self, values: Sequence[torch.Tensor], num_step_slots: int | None,
                  features: Sequence[torch.Tensor] | None = None,
                  text_flags: tuple[torch.Tensor, torch.Tensor] | None = None) -> CriticScores:
        if self.calibration is not None and values:  # the one place values are calibrated
            flat = torch.cat(list(values)).numpy()
            calibrated = torch.from_numpy(self.calibration(flat).astype("float32"))
            values = list(torch.split(calibrated, [len(v) for v in values]))
        num_steps = torch.tensor([len(v) - 1 for v in values], dtype=torch.long)
        width = int(num_steps.max()) if len(values) else 0
        if num_step_slots is not None:
            if num_step_slots < width:
                raise ValueError(f"num_step_slots={num_step_slots} is smaller than the largest step count {width}")
            width = num_step_slots
        prompt_values = torch.stack([v[0] for v in values]) if values else torch.zeros(0)
        step_values = torch.zeros(len(values), width, dtype=torch.float32)
        for row, v in enumerate(values):
            step_values[row, : len(v) - 1] = v[1:]
        if self.best_of_k > 1:
            prompt_values = best_of_k_transform(prompt_values, self.best_of_k)
            step_values = best_of_k_transform(step_values, self.best_of_k)  # padding stays 0: 1 - (1 - 0)^K = 0
        read = None
        if features is not None:
            dim = int(features[0].shape[-1]) if features else int(getattr(self.adapter.head, "in_features", 0))
            read = torch.zeros(len(values), width + 1, dim, dtype=torch.float32)
            for row, f in enumerate(features):
                read[row, : len(f)] = f
        flags = text_flags or (torch.zeros(len(values), dtype=torch.bool),) * 2
        return CriticScores(prompt_values.float(), step_values, num_steps, read, *flags)
