"""Step-wise generation from language models, and language-model critics of prefixes.

Samplers (the ``StepSampler`` protocol of :mod:`verl_prm.search`):

- :class:`HFStepSampler`: Hugging Face transformers (CPU or GPU), batched, left padded. A step ends at the
  first delimiter match that follows non-whitespace text (the segmentation rule of ``verl_prm.steps``: a
  leading run of delimiters joins the step it starts), checked on the decoded text of each row by a
  per-row ``StoppingCriteria``, so a token that merges the delimiter with neighbours (".\\n\\n", "\\n\\nThe")
  stops generation too; the text after the delimiter in that token is dropped from the step (its tokens are
  still counted as generated).
- :class:`VLLMStepSampler`: vLLM (GPU, optional, imported on construction), ``stop=[delimiter]`` with
  ``include_stop_str_in_output=True``; a whitespace-only step is continued (the same joining rule).

A node's text is ``prompts[problem] + "".join(steps)``: the prefix is re-tokenised from text for every call
(as vLLM does with text prompts), and a step's text always ends with its delimiter unless it is the last
step. Generated tokens are counted per step, EOS included.

:class:`TextCritic` wraps a ``verl_prm.critic.ProverCritic``: the node's steps give exact character spans
(no re-splitting), and one ``ProverCritic.score_step_spans`` call maps them to critic tokens and scores all
nodes of a round; critic tokens are the lengths of the critic inputs. Consecutive steps that end in the same
critic token (a step inside the token that ends the one before it) are merged: both get the value read there,
counted per problem.
"""

from __future__ import annotations

import itertools
import re
import warnings
from typing import Any, Callable, Sequence

from verl_prm.checkpoints import from_pretrained_kwargs, resolve_checkpoint
from verl_prm.critic import ProverCritic
from verl_prm.generation import GenerationEngine, GenerationRequest
from verl_prm.precision import resolve_dtype
from verl_prm.search import Node, StepSample
from verl_prm.special_tokens import ensure_pad_token, policy_eos_token_ids
from verl_prm.steps import step_char_spans

__all__ = [
    "HFStepSampler",
    "TextCritic",
    "VLLMStepSampler",
    "delimiter_regex",
    "first_step_end",
    "split_response",
    "text_critic_factory",
]


def delimiter_regex(delimiter: str | None = "\n\n", regex: str | None = None) -> re.Pattern:
    """The step-ending pattern: ``regex`` as given, or the plain ``delimiter`` with each "\\n" also matching
    "\\r\\n" (the convention of ``verl_prm.steps``)."""
    if regex is not None:
        return re.compile(regex)
    if not delimiter:
        raise ValueError("the step delimiter must be a non-empty string (or pass a regex)")
    return re.compile("".join(r"\r?\n" if c == "\n" else re.escape(c) for c in delimiter))


def first_step_end(text: str, pattern: re.Pattern) -> int | None:
    """End (exclusive) of the first step of ``text``: the end of the first delimiter match preceded by
    non-whitespace text; ``None`` while no step is complete."""
    for match in pattern.finditer(text):
        if text[: match.start()].strip():
            return match.end()
    return None


def split_response(text: str, delimiter: str | None = "\n\n", regex: str | None = None) -> tuple[str, ...]:
    """Steps of a full response (``verl_prm.steps.step_char_spans``), as texts that tile the response."""
    return tuple(text[start:end] for start, end in step_char_spans(text, delimiter, regex=regex))


class _StepStop:
    """Per-request stop rule: a request stops once its generated text holds a complete step."""

    def __init__(self, tokenizer, pattern: re.Pattern) -> None:
        self.tokenizer = tokenizer
        self.pattern = pattern

    def __call__(self, generated_ids: list[int]) -> bool:
        return first_step_end(self.tokenizer.decode(generated_ids, skip_special_tokens=True), self.pattern) is not None


class HFStepSampler:
    """Step-wise sampling with a Hugging Face causal LM.

    Args:
        model: a ``PreTrainedModel`` with a LM head; tokenizer: its tokenizer.
        prompts: the rendered prompt text of each problem (``problem`` indexes it).
        delimiter / regex: the step delimiter (default "\\n\\n") or a regex.
        max_step_tokens: cap on the tokens of one step (a step cut there is a step; the response goes on).
        max_response_tokens: cap on the tokens of a response (the step that reaches it ends the response,
            ``truncated``).
        temperature, top_p: sampling (temperature 0 = greedy).
        batch_size: sequences decoded together by the engine (``verl_prm.generation.GenerationEngine``: a
            static cache, each node's prefix copied from its parent's sequence where the engine ran it before).
    """

    def __init__(
        self,
        model,
        tokenizer,
        prompts: Sequence[str],
        *,
        delimiter: str | None = "\n\n",
        regex: str | None = None,
        max_step_tokens: int = 256,
        max_response_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 32,
    ) -> None:
        if max_step_tokens < 1 or max_response_tokens < 1:
            raise ValueError("max_step_tokens and max_response_tokens must be >= 1")
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.delimiter, self.regex = delimiter, regex
        self.pattern = delimiter_regex(delimiter, regex)
        self.max_step_tokens = int(max_step_tokens)
        self.max_response_tokens = int(max_response_tokens)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.batch_size = int(batch_size)
        generation = getattr(model, "generation_config", None)
        self.eos_token_ids = set(policy_eos_token_ids(tokenizer, generation, source="HFStepSampler"))
        self.pad_token_id = ensure_pad_token(tokenizer, generation, source="HFStepSampler")
        self.engine = GenerationEngine(model, eos_token_ids=sorted(self.eos_token_ids), max_batch_size=self.batch_size)
        self.model = self.engine.model
        self._stop = _StepStop(tokenizer, self.pattern)

    @classmethod
    def from_pretrained(cls, path: str, prompts: Sequence[str], *, device: str | None = None,
                        precision: str = "auto", **kwargs) -> "HFStepSampler":
        """Load the policy in ``precision`` (``verl_prm.generation.resolve_dtype``: bfloat16 where the device
        has native bf16 instructions)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(precision, device)
        path = resolve_checkpoint(path, "policy")  # no such directory / no weights / pickle-only: named errors
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **from_pretrained_kwargs()).to(device)
        return cls(model, tokenizer, prompts, **kwargs)

    def text(self, node: Node) -> str:
        return self.prompts[node.problem] + "".join(node.steps)

    def _generate(self, texts: Sequence[str], seeds: Sequence[int], max_new: Sequence[int], stop_at_step: bool):
        """Generated ids per text (trimmed at the first EOS) and whether an EOS ended them."""
        encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        greedy = self.temperature <= 0
        requests = [
            GenerationRequest(ids, max_tokens=int(budget), temperature=max(self.temperature, 0.0), top_p=self.top_p,
                              seed=None if greedy else int(seed), stop=self._stop if stop_at_step else None)
            for ids, seed, budget in zip(encoded, seeds, max_new)
        ]
        out: list[tuple[list[int], bool]] = []
        for output in self.engine.generate(requests):
            ids = output.token_ids
            if output.stop_reason == "eos":
                out.append((ids[:-1], True))
            else:
                out.append((ids, False))
        return out

    def _cut(self, ids: list[int], eos: bool) -> tuple[str, int, bool]:
        """Step text, generated tokens, and whether the response ended, for one row of step generation.

        A complete step ends at its delimiter; the tokens generated up to the one completing it are counted.
        Without a complete step the row ended at EOS (counted) or at the token cap. A row that stopped at its
        step has pad/EOS fill after it, which is why the step end is searched first."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        end = first_step_end(text, self.pattern)
        if end is not None:
            # The shortest prefix of tokens whose text holds the step (the stopping token).
            used = len(ids)
            for count in range(1, len(ids) + 1):
                if first_step_end(self.tokenizer.decode(ids[:count], skip_special_tokens=True), self.pattern) is not None:
                    used = count
                    break
            return text[:end], used, False
        return text, len(ids) + int(eos), eos

    def sample_steps(self, nodes: Sequence[Node], n: int, seeds: Sequence[int]) -> list[list[StepSample]]:
        if len(seeds) != len(nodes):
            raise ValueError(f"sample_steps: {len(nodes)} nodes but {len(seeds)} seeds")
        flat = [(i, j) for i in range(len(nodes)) for j in range(n)]
        texts = [self.text(nodes[i]) for i, _ in flat]
        budgets = [min(self.max_step_tokens, self.max_response_tokens - nodes[i].num_tokens) for i, _ in flat]
        if any(b < 1 for b in budgets):
            raise ValueError("sample_steps: a node has no token budget left (it should have been truncated)")
        rows = self._generate(texts, [seeds[i] + j for i, j in flat], budgets, stop_at_step=True)
        results: list[list[StepSample]] = [[] for _ in nodes]
        for (i, _), (ids, eos), budget in zip(flat, rows, budgets):
            text, used, finished = self._cut(ids, eos)
            truncated = not finished and nodes[i].num_tokens + used >= self.max_response_tokens
            content = text if text.strip() else None  # EOS right away: no new step
            if content is None and not finished:
                # Whitespace only up to the token cap: keep it as a step (its tokens were written).
                content = text or None
            results[i].append(StepSample(content, used, finished=finished, truncated=truncated))
        return results

    def sample_responses(self, problems: Sequence[int], n: int, seeds: Sequence[int]) -> list[list[Node]]:
        flat = [(g, j) for g in range(len(problems)) for j in range(n)]
        rows = self._generate(
            [self.prompts[problems[g]] for g, _ in flat],
            [seeds[g] + j for g, j in flat],
            [self.max_response_tokens] * len(flat),
            stop_at_step=False,
        )
        out: list[list[Node]] = [[] for _ in problems]
        for (g, _), (ids, eos) in zip(flat, rows):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            steps = split_response(text, self.delimiter, self.regex)
            out[g].append(Node(problems[g], steps, finished=True, truncated=not eos, num_tokens=len(ids) + int(eos)))
        return out


class VLLMStepSampler:
    """Step-wise sampling with vLLM (GPU; optional dependency, imported here).

    Steps stop at the plain ``delimiter`` (vLLM stop strings; a regex delimiter needs the HF back end) with the
    delimiter kept in the output; a step that is whitespace only (a leading delimiter) is continued, up to
    ``max_continuations`` times, so steps follow the joining rule of ``verl_prm.steps``.
    """

    def __init__(
        self,
        model: str,
        prompts: Sequence[str],
        *,
        delimiter: str = "\n\n",
        max_step_tokens: int = 256,
        max_response_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_continuations: int = 4,
        llm: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as error:
            raise ImportError(
                "the vLLM back end needs the optional package vllm (GPU only): `pip install vllm`; on CPU use "
                "--backend hf"
            ) from error
        if not delimiter:
            raise ValueError("VLLMStepSampler needs a plain-string delimiter (regex delimiters: use --backend hf)")
        self._vllm = vllm
        self.prompts = list(prompts)
        self.delimiter = delimiter
        self.max_step_tokens, self.max_response_tokens = int(max_step_tokens), int(max_response_tokens)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.max_continuations = int(max_continuations)
        self.llm = llm if llm is not None else vllm.LLM(model=model, trust_remote_code=False, enable_prefix_caching=True, **engine_kwargs)

    def text(self, node: Node) -> str:
        return self.prompts[node.problem] + "".join(node.steps)

    def _params(self, n: int, seed: int, max_tokens: int, stop: bool):
        extra = dict(stop=[self.delimiter], include_stop_str_in_output=True) if stop else {}
        return self._vllm.SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens,
                                         seed=int(seed), skip_special_tokens=True, **extra)

    def sample_steps(self, nodes: Sequence[Node], n: int, seeds: Sequence[int]) -> list[list[StepSample]]:
        budgets = [min(self.max_step_tokens, self.max_response_tokens - node.num_tokens) for node in nodes]
        outputs = self.llm.generate(
            [{"prompt": self.text(node)} for node in nodes],
            sampling_params=[self._params(n, seed, budget, True) for seed, budget in zip(seeds, budgets)],
            use_tqdm=False,
        )
        # (node index, text so far, tokens so far, finish_reason, stop_reason) per sample
        pending = [[i, out.text, len(out.token_ids), out.finish_reason, out.stop_reason]
                   for i, request in enumerate(outputs) for out in request.outputs]
        for round_index in range(self.max_continuations):
            redo = [s for s in pending if s[3] == "stop" and s[4] == self.delimiter and not s[1].strip()
                    and s[2] < budgets[s[0]]]
            if not redo:
                break
            more = self.llm.generate(
                [{"prompt": self.text(nodes[s[0]]) + s[1]} for s in redo],
                sampling_params=[self._params(1, seeds[s[0]] + 7919 * (round_index + 1), budgets[s[0]] - s[2], True)
                                 for s in redo],
                use_tqdm=False,
            )
            for s, request in zip(redo, more):
                out = request.outputs[0]
                s[1] += out.text
                s[2] += len(out.token_ids)
                s[3], s[4] = out.finish_reason, out.stop_reason
        results: list[list[StepSample]] = [[] for _ in nodes]
        for i, text, used, finish, stop_reason in pending:
            finished = finish == "stop" and stop_reason is None  # an EOS (not the delimiter) ended it
            truncated = not finished and nodes[i].num_tokens + used >= self.max_response_tokens
            results[i].append(StepSample(text if text.strip() else (None if finished else text or None), used,
                                         finished=finished, truncated=truncated))
        return results

    def sample_responses(self, problems: Sequence[int], n: int, seeds: Sequence[int]) -> list[list[Node]]:
        outputs = self.llm.generate(
            [{"prompt": self.prompts[p]} for p in problems],
            sampling_params=[self._params(n, seed, self.max_response_tokens, False) for seed in seeds],
            use_tqdm=False,
        )
        return [
            [Node(p, split_response(out.text, self.delimiter), finished=True, truncated=out.finish_reason != "stop",
                  num_tokens=len(out.token_ids)) for out in request.outputs]
            for p, request in zip(problems, outputs)
        ]


class TextCritic:
    """A ``ProverCritic`` as a prefix critic of text nodes (``PrefixCritic`` protocol).

    Steps whose last characters fall in the same critic token are merged (`merge_shared_step_ends`): both get
    the value read there. This is counted, per problem, in ``merged_steps`` (steps that got the value of the
    step before them, summed over scored sequences) and warned about once per critic.

    Args:
        critic: a ``verl_prm.critic.ProverCritic`` (load it with ``best_of_k=1``: the search applies Best-of-K).
        prompts: the prompt text of each problem, as the critic reads it.
    """

    def __init__(self, critic, prompts: Sequence[str]) -> None:
        if getattr(critic, "best_of_k", 1) != 1:
            raise ValueError("TextCritic: load the critic with best_of_k=1; the search applies Best-of-K itself")
        self.critic = critic
        self.prompts = list(prompts)
        self.merged_steps: dict[int, int] = {}
        self._warned = False

    def score_nodes(self, nodes: Sequence[Node]) -> tuple[list[list[float]], list[int]]:
        spans = []
        for node in nodes:
            ends = list(itertools.accumulate(len(step) for step in node.steps))
            spans.append(list(zip([0] + ends[:-1], ends)))
        scored = self.critic.score_step_spans([self.prompts[node.problem] for node in nodes],
                                              ["".join(node.steps) for node in nodes], spans,
                                              samples=[node.problem for node in nodes])
        for node, merged in zip(nodes, scored.merged_steps):
            if not merged:
                continue
            self.merged_steps[node.problem] = self.merged_steps.get(node.problem, 0) + len(merged)
            if not self._warned:
                self._warned = True
                first = merged[0]
                warnings.warn(
                    f"problem {node.problem}: step {first} ({node.steps[first]!r}) ends in the critic token that "
                    f"also ends step {first - 1} ({node.steps[first - 1][-20:]!r}); such steps are merged (both "
                    "get the value read there) and counted per problem in the records' critic_merged_steps. Use a "
                    "delimiter that the critic's tokenizer keeps apart from the next step's text to avoid it",
                    stacklevel=2,
                )
        scores = scored.scores
        values = [[float(scores.prompt_values[i])] + scores.step_values[i, : int(scores.num_steps[i])].tolist()
                  for i in range(len(nodes))]
        return values, scored.sequence_tokens


def text_critic_factory(prompts: Sequence[str], device: str | None) -> Callable[[str, str], Callable[[], TextCritic]]:
    """``factory(path, format)``: a builder of a :class:`TextCritic` over the ``ProverCritic`` at ``path`` (in
    checkpoint ``format``, on ``device``), loaded at its first build; every builder of the same path shares it."""
    loaded: dict[str, ProverCritic] = {}

    def factory(path: str, format: str) -> Callable[[], TextCritic]:
        def build() -> TextCritic:
            if path not in loaded:
                loaded[path] = ProverCritic.from_pretrained(path, format=format, device=device)
            return TextCritic(loaded[path], prompts)

        return build

    return factory
