"""One generation engine for causal LMs on the CPU (and any torch device): token ids in, token ids out.

What it adds over calling ``model.generate`` per batch:

- **Precision.** The model computes in the dtype :func:`verl_prm.precision.resolve_dtype` picks
  (bfloat16 where the CPU has native bf16 matrix instructions); logits are upcast to float32 before sampling.
- **A preallocated key/value cache** (:mod:`verl_prm.generation.kv_cache`): allocated once per batch at its
  final length and written in place, where the default dynamic cache grows by concatenation at every token,
  and attending only to the tokens written (transformers' ``StaticCache`` attends over its whole length).
- **Grouped-query attention without copies on the CPU** (:mod:`verl_prm.generation.attention`). For one query
  token, PyTorch's CPU SDPA kernel is the slowest part of a decode step (SmolLM2-135M, 32 rows: a step 152 ms
  with SDPA, 105 ms with transformers' eager attention, which still copies every key/value head per query
  head); compiling the decode step did not pay (51 s to compile, no faster step).
- **Same-input projections as one product** (:mod:`verl_prm.generation.fused_projections`): a Llama-style layer's
  q/k/v and gate/up projections, whose thin decode-step products run far below the CPU's peak one by one.
- **Prompts of different lengths in one batch.** Distinct prompts are prefilled together in groups of similar
  length (padding at most a quarter of a group's tokens), then placed right-aligned in the batch's cache; decode
  steps run the whole batch with each row's own positions and a padding mask. Rows that finish leave the batch
  (the cache is compacted) so the others do not pay for them.
- **Continuous batching** (:meth:`GenerationEngine.serve`; :class:`verl_prm.generation.ContinuousBatcher` for
  asyncio callers): requests that arrive while a batch decodes join it before the next step, and each output
  is handed back as its request ends.
- **Shared prefixes computed once.** Identical prompts in a batch are prefilled once; a prompt that begins with a
  sequence the engine ran before copies those keys and values from :class:`PrefixCache` (tree branches from their
  root, ``n_mc`` continuations of one prefix, a rollout's step prefixes, search nodes from their parent).
- **Per-request sampling settings** (temperature, top-k, top-p, seed, a stop rule) in one batch
  (:mod:`verl_prm.generation.sampling`).
- **Freed memory handed back** (:func:`release_freed_memory`) when a ``generate`` call or a ``serve`` session ends,
  after each admission to a serving batch and when new weights clear the prefix cache: a server decodes on
  worker threads, and the C heap keeps what a thread freed for that thread's next allocation.

``generate(requests)`` returns one :class:`GenerationOutput` per :class:`GenerationRequest`, in order (requests
beyond ``max_batch_size`` run in the batches after). Counters
of computed and reused prefill tokens accumulate in ``engine.stats``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from transformers import AutoModelForCausalLM

from verl_prm.checkpoints import from_pretrained_kwargs, resolve_checkpoint
from verl_prm.generation.attention import register_attention
from verl_prm.generation.fused_projections import fuse_projections
from verl_prm.generation.kv_cache import preallocated_cache
from verl_prm.generation.prefix_cache import PrefixCache
from verl_prm.generation.sampling import sample_next_tokens, sampled_log_probs
from verl_prm.precision import resolve_dtype

__all__ = ["EngineStats", "GenerationEngine", "GenerationOutput", "GenerationRequest", "release_freed_memory"]


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl and macOS have none
    except (AttributeError, OSError):
        return None


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where there is none.

    torch frees CPU tensors with ``free``, and glibc keeps freed memory in the arena of the thread that allocated
    it for that arena's later allocations. The engine decodes on worker threads (``ContinuousBatcher`` starts one
    per wave), each wave's peak (a batch's caches, a held-out batch of 128 prompts) stays resident after it, and a
    rollout server beside a training actor grows until the node's memory monitor stops the run."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@dataclass
class GenerationRequest:
    """One sequence to generate.

    Args:
        prompt_ids: the tokens to continue (special tokens included as the caller rendered them).
        max_tokens: cap on generated tokens (>= 1).
        temperature: 0 is greedy; top_k <= 0 and top_p = 1 are off.
        seed: seeds this request's own random stream (the same tokens whichever batch it shares); ``None`` draws
            from torch's global generator.
        logprobs: also return each sampled token's log-probability under the raw logits.
        stop: called with the generated ids after each token; ``True`` ends the request there (stop reason
            ``"stop"``), e.g. at the end of a reasoning step.
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    logprobs: bool = False
    stop: Optional[Callable[[list[int]], bool]] = None


@dataclass
class GenerationOutput:
    """Generated ids (the EOS included when the request ended at one), why it ended and the prompt's prefill."""

    token_ids: list[int]
    stop_reason: str  # "eos", "stop" or "length"
    log_probs: Optional[list[float]] = None
    prefill_tokens: int = 0   # prompt tokens computed for this request (0 when another request computed them)
    reused_tokens: int = 0    # prompt tokens whose keys and values were copied from the prefix cache

    @property
    def finished(self) -> bool:
        """Ended at EOS or at its stop rule (not at ``max_tokens``)."""
        return self.stop_reason != "length"


@dataclass
class EngineStats:
    """Running totals since the engine was built (or ``reset``)."""

    prompt_tokens: int = 0        # prompt tokens asked for, over all requests
    prefill_tokens: int = 0       # of them, computed by a forward pass
    reused_tokens: int = 0        # copied from the prefix cache
    shared_tokens: int = 0        # identical prompts within a batch, computed once for all
    generated_tokens: int = 0
    seconds: float = 0.0
    batches: int = 0

    @property
    def saved_prefill_tokens(self) -> int:
        return self.reused_tokens + self.shared_tokens

    def as_dict(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "prefill_tokens": self.prefill_tokens,
                "reused_tokens": self.reused_tokens, "shared_tokens": self.shared_tokens,
                "saved_prefill_tokens": self.saved_prefill_tokens, "generated_tokens": self.generated_tokens,
                "seconds": self.seconds, "batches": self.batches}


def _check_request(where: str, request: GenerationRequest, vocabulary: int) -> None:
    if len(request.prompt_ids) == 0:
        raise ValueError(f"{where}: empty prompt_ids (the model needs at least one token to continue)")
    if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {request.max_tokens!r}")
    if not math.isfinite(request.temperature) or request.temperature < 0:
        raise ValueError(f"{where}: temperature must be finite and >= 0, got {request.temperature!r}")
    if not math.isfinite(request.top_p) or not 0 < request.top_p <= 1:
        raise ValueError(f"{where}: top_p must be in (0, 1], got {request.top_p!r}")
    if isinstance(request.top_k, bool) or not isinstance(request.top_k, int):
        raise ValueError(f"{where}: top_k must be an integer (<= 0: off), got {request.top_k!r}")
    bad = [t for t in request.prompt_ids if not 0 <= int(t) < vocabulary]
    if bad:
        raise ValueError(f"{where}: token ids outside the model's vocabulary of {vocabulary}: {bad[:5]}")


class GenerationEngine:
    """Batched sampling from a causal LM with a static cache and prefix reuse (module docstring).

    Args:
        model: a transformers causal LM, already in the dtype to compute in (see ``from_pretrained``).
        eos_token_ids: tokens that end a request (kept in its output).
        max_batch_size: sequences decoded together; longer request lists run in consecutive batches.
        prefix_cache_tokens: tokens of past sequences kept for prefix reuse (0: off).
    """

    def __init__(self, model, *, eos_token_ids: Sequence[int], max_batch_size: int = 32,
                 prefix_cache_tokens: int = 32768) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"GenerationEngine: max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if not eos_token_ids:
            raise ValueError("GenerationEngine: no EOS token ids (generation could never finish early)")
        self.model = model.eval()
        if next(model.parameters()).device.type == "cpu":
            model.set_attn_implementation(register_attention())  # faster than CPU SDPA (module docstring)
            fuse_projections(model)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch_size = max_batch_size
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.stats = EngineStats()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocabulary = int(model.get_output_embeddings().weight.shape[0])

    @classmethod
    def from_pretrained(cls, path: str, *, precision: str = "auto", device: str | None = None, **kwargs):
        """Load a causal LM (safetensors, ``trust_remote_code=False``) in the precision ``resolve_dtype`` picks."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(precision, device)
        path = resolve_checkpoint(path, "policy")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **from_pretrained_kwargs()).to(device)
        return cls(model, **kwargs)

    def weights_changed(self) -> None:
        """Forget cached prefixes: they were computed with the old weights (and restack projections whose weights
        were replaced rather than written in place)."""
        self.prefix_cache.clear()
        if self.device.type == "cpu":
            fuse_projections(self.model)
        release_freed_memory()  # the cleared prefixes (up to prefix_cache_tokens of keys and values)

    # ------------------------------------------------------------------ public
    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        for index, request in enumerate(requests):
            _check_request(f"generation request {index}", request, self.vocabulary)
        outputs: list[GenerationOutput] = []
        for begin in range(0, len(requests), self.max_batch_size):
            start = time.perf_counter()
            outputs.extend(self._generate_batch(list(requests[begin: begin + self.max_batch_size])))
            self.stats.seconds += time.perf_counter() - start
            self.stats.batches += 1
        release_freed_memory()
        return outputs

    # ------------------------------------------------------------------ prefill
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                 last_only: bool = True) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                         use_cache=True, logits_to_keep=1 if last_only else 0)
        return out.logits[:, -1].float()

    def _prefill_alone(self, prompt: tuple[int, ...], entry, reused: int) -> tuple:
        """One prompt whose first ``reused`` tokens come from the prefix cache ``entry``."""
        cache = preallocated_cache(self.model.config, 1, len(prompt), dtype=self.dtype, device=self.device)
        for layer, keys, values in zip(cache.layers, entry.keys, entry.values):
            layer.write(0, 0, keys[:, :reused], values[:, :reused])
            layer.set_length(reused)
        rest = torch.tensor([prompt[reused:]], dtype=torch.long, device=self.device)
        positions = torch.arange(reused, len(prompt), device=self.device)[None]
        logits = self._forward(rest, positions, None, cache)[0]
        return [layer.keys[0].clone() for layer in cache.layers], [layer.values[0].clone() for layer in cache.layers], logits

    def _prefill_together(self, prompts: list[tuple[int, ...]]) -> list[tuple]:
        """Prompts without a cached prefix, in one left-padded forward pass."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = True
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = preallocated_cache(self.model.config, len(prompts), width, dtype=self.dtype, device=self.device)
        logits = self._forward(ids, positions, mask, cache)
        return [([layer.keys[row, :, width - len(p):].clone() for layer in cache.layers],
                 [layer.values[row, :, width - len(p):].clone() for layer in cache.layers], logits[row])
                for row, p in enumerate(prompts)]

    def _prefill(self, prompts: set[tuple[int, ...]]) -> dict[tuple[int, ...], tuple]:
        """Keys and values ``[kv_heads, len(prompt), head_dim]`` per layer, the last position's logits and the
        tokens copied from the prefix cache, for each distinct prompt. Prompts that extend a cached sequence copy
        it and compute the rest alone; the others are computed together, in groups of similar length (padding
        at most a quarter of a group's tokens)."""
        out: dict[tuple[int, ...], tuple] = {}
        fresh = []
        for prompt in sorted(prompts, key=len):  # shorter first: a longer prompt may extend one just cached
            entry, reused = self.prefix_cache.longest_prefix(prompt, limit=len(prompt) - 1)
            if reused:
                out[prompt] = (*self._prefill_alone(prompt, entry, reused), reused)
                self.prefix_cache.add(prompt, out[prompt][0], out[prompt][1])
            else:
                fresh.append(prompt)
        group: list[tuple[int, ...]] = []
        for prompt in fresh + [None]:
            if group and (prompt is None or len(group) == self.max_batch_size
                          or len(prompt) * (len(group) + 1) > 1.25 * (sum(map(len, group)) + len(prompt))):
                for done, result in zip(group, self._prefill_together(group)):
                    out[done] = (*result, 0)
                    self.prefix_cache.add(done, result[0], result[1])
                group = []
            if prompt is not None:
                group.append(prompt)
        return out

    # ------------------------------------------------------------------ decoding
    def _rows(self, requests: Sequence[GenerationRequest], delivers: Optional[Sequence[Callable]] = None
              ) -> list["_Row"]:
        return [_Row(r, tuple(int(t) for t in r.prompt_ids),
                     GenerationOutput(token_ids=[], stop_reason="length", log_probs=[] if r.logprobs else None),
                     torch.Generator(device=self.device).manual_seed(int(r.seed)) if r.seed is not None else None,
                     deliver)
                for r, deliver in zip(requests, delivers or [None] * len(requests))]

    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        batch = _Batch(self)
        rows = self._rows(requests)
        batch.admit(rows)
        while batch.rows:
            batch.step()
        return [row.output for row in rows]

    def serve(self, take: Callable[[int, bool], list[tuple[GenerationRequest, Callable[[GenerationOutput], None]]]]
              ) -> None:
        """Continuous batching: decode while requests keep coming, new ones joining the running batch.

        Before every decode step, ``take(room, idle)`` hands over up to ``room`` new ``(request, deliver)`` pairs
        (``idle``: no row is decoding); they are prefilled (reusing cached prefixes, e.g. a tree branch's root
        that finished a step ago) and join the batch, whose cache is rebuilt around them. ``deliver(output)`` is
        called as soon as a request ends, so its caller can send the requests that follow from it while the
        others still decode. Returns when ``take`` hands over nothing while idle. The caller validates requests
        (:meth:`check_request`): one that fails here fails the whole call.
        """
        batch = _Batch(self)
        with torch.inference_mode():
            while True:
                new = take(self.max_batch_size - len(batch.rows), not batch.rows)
                if new:
                    start = time.perf_counter()
                    batch.admit(self._rows([request for request, _ in new], [deliver for _, deliver in new]))
                    release_freed_memory()  # the batch's former cache, rebuilt around the new rows
                    self.stats.batches += 1
                    self.stats.seconds += time.perf_counter() - start
                elif not batch.rows:
                    release_freed_memory()  # this thread's arena keeps the session's peak otherwise
                    return
                start = time.perf_counter()
                finished = batch.step()
                self.stats.seconds += time.perf_counter() - start
                for row in finished:
                    row.deliver(row.output)

    def check_request(self, request: GenerationRequest, where: str = "generation request") -> None:
        """Refuse a request the engine cannot run, naming it (``where``)."""
        _check_request(where, request, self.vocabulary)

    def _remember(self, prompt: tuple[int, ...], generated: list[int], cache, row: int,
                  begin: int, column: int) -> None:
        """Keep a finished row's keys and values (prompt + all generated tokens but the last, whose keys were
        never computed) for later requests that share its prefix."""
        if self.prefix_cache.capacity_tokens == 0:
            return
        tokens = prompt + tuple(generated[:-1])
        end = begin + len(tokens)
        assert end == column, (end, column)
        keys = [layer.keys[row, :, begin:end].clone() for layer in cache.layers]  # views up to ``column``
        values = [layer.values[row, :, begin:end].clone() for layer in cache.layers]
        self.prefix_cache.add(tokens, keys, values)


@dataclass
class _Row:
    """A request decoding in a :class:`_Batch`: its prompt, its output so far, its random stream and the call
    that receives its output (``GenerationEngine.serve``)."""

    request: GenerationRequest
    prompt: tuple[int, ...]
    output: GenerationOutput
    generator: Optional[torch.Generator]
    deliver: Optional[Callable[[GenerationOutput], None]]


class _Batch:
    """The rows decoding together: one preallocated cache with every row's tokens right-aligned at ``column``
    (the next position to write), the padding mask, each row's next position id and sampling settings, and the
    logits of each row's next token."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.rows: list[_Row] = []
        self.column = 0

    def admit(self, rows: list[_Row]) -> None:
        """Prefill ``rows`` and add them to the batch. The cache is rebuilt with the rows decoding so far moved
        right so that every row's last token sits at the same column, and room for every row's remaining tokens
        (a row's last token's keys are never computed)."""
        engine = self.engine
        prefilled = engine._prefill({row.prompt for row in rows})
        seen: set[tuple[int, ...]] = set()
        for row in rows:
            engine.stats.prompt_tokens += len(row.prompt)
            if row.prompt in seen:
                engine.stats.shared_tokens += len(row.prompt)
                continue
            seen.add(row.prompt)
            row.output.reused_tokens = prefilled[row.prompt][3]
            row.output.prefill_tokens = len(row.prompt) - row.output.reused_tokens
            engine.stats.reused_tokens += row.output.reused_tokens
            engine.stats.prefill_tokens += row.output.prefill_tokens

        old = len(self.rows)
        width = max(self.column, max(len(row.prompt) for row in rows))
        room = max([r.request.max_tokens - len(r.output.token_ids) for r in self.rows]
                   + [row.request.max_tokens for row in rows])
        cache = preallocated_cache(engine.model.config, old + len(rows), width + room, dtype=engine.dtype,
                                   device=engine.device)
        mask = torch.zeros((old + len(rows), width + room), dtype=torch.bool, device=engine.device)
        if old:
            shift = width - self.column
            for layer, before in zip(cache.layers, self.cache.layers):
                layer.write(slice(0, old), shift, before.keys, before.values)
            mask[:old, shift:width] = self.mask[:, : self.column]
        for index, row in enumerate(rows, start=old):
            keys, values = prefilled[row.prompt][0], prefilled[row.prompt][1]
            begin = width - len(row.prompt)
            for layer, k, v in zip(cache.layers, keys, values):
                layer.write(index, begin, k, v)
            mask[index, begin:width] = True
        for layer in cache.layers:
            layer.set_length(width)
        logits = torch.stack([prefilled[row.prompt][2] for row in rows])
        device = engine.device
        positions = torch.tensor([len(row.prompt) for row in rows], device=device)
        temperature = torch.tensor([float(row.request.temperature) for row in rows], device=device)
        top_k = torch.tensor([int(row.request.top_k) for row in rows], device=device)
        top_p = torch.tensor([float(row.request.top_p) for row in rows], device=device)
        if old:
            logits = torch.cat([self.logits, logits])
            positions = torch.cat([self.positions, positions])
            temperature = torch.cat([self.temperature, temperature])
            top_k, top_p = torch.cat([self.top_k, top_k]), torch.cat([self.top_p, top_p])
        self.cache, self.mask, self.column, self.logits = cache, mask, width, logits
        self.positions, self.temperature, self.top_k, self.top_p = positions, temperature, top_k, top_p
        self.rows.extend(rows)

    def step(self) -> list[_Row]:
        """Sample every row's next token; rows that end leave the batch (returned), the others run one forward
        step."""
        engine = self.engine
        tokens = sample_next_tokens(self.logits, self.temperature, self.top_k, self.top_p,
                                    [row.generator for row in self.rows])
        wants_logprobs = any(row.output.log_probs is not None for row in self.rows)
        token_log_probs = sampled_log_probs(self.logits, tokens).tolist() if wants_logprobs else None
        keep: list[int] = []
        finished: list[_Row] = []
        for index, (row, token) in enumerate(zip(self.rows, tokens.tolist())):
            output, request = row.output, row.request
            output.token_ids.append(token)
            if output.log_probs is not None:
                output.log_probs.append(token_log_probs[index])
            if token in engine.eos_token_ids:
                output.stop_reason = "eos"
            elif request.stop is not None and request.stop(output.token_ids):
                output.stop_reason = "stop"
            elif len(output.token_ids) >= request.max_tokens:
                output.stop_reason = "length"
            else:
                keep.append(index)
                continue
            begin = self.column - len(row.prompt) - (len(output.token_ids) - 1)
            engine._remember(row.prompt, output.token_ids, self.cache, index, begin, self.column)
            finished.append(row)
        engine.stats.generated_tokens += len(self.rows)
        if not keep:
            self.rows, self.column = [], 0
            self.cache = self.mask = self.logits = None
            return finished
        if len(keep) < len(self.rows):  # finished rows leave the batch
            index = torch.tensor(keep, device=engine.device)
            for layer in self.cache.layers:
                layer.select_rows(index)
            self.mask, self.positions, tokens = self.mask[index], self.positions[index], tokens[index]
            self.temperature, self.top_k, self.top_p = self.temperature[index], self.top_k[index], self.top_p[index]
            self.rows = [self.rows[i] for i in keep]
        self.mask[:, self.column] = True
        self.logits = engine._forward(tokens[:, None], self.positions[:, None], self.mask[:, : self.column + 1],
                                      self.cache, last_only=False)
        self.positions = self.positions + 1
        self.column += 1
        return finished
