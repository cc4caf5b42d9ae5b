"""Pure helpers of packed critic scoring: marker insertion, context-length checks, micro-batch planning, and the
packed / padded input tensors. No model here: the scorer (``scorer.py``) glues these to a forward pass.

Conventions: a critic input is one list of token ids per sample; ``read_positions[i]`` lists, for sample ``i``,
the positions whose outputs are the values ``[v_0, v_1, ..., v_H]`` (prompt first, then one per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from verl_prm.choices import Truncation

__all__ = [
    "CriticInput",
    "MicroBatch",
    "insert_markers",
    "check_step_positions",
    "fit_context",
    "plan_micro_batches",
    "BatchTensors",
    "packed_tensors",
    "padded_tensors",
    "varlen_boundaries",
    "padding_share",
]



@dataclass(frozen=True)
class CriticInput:
    """One sample as the critic reads it.

    Attributes:
        input_ids: the critic's token ids, markers included, length L.
        read_positions: H + 1 increasing positions in [0, L): the prompt's read position, then one per step.
        prompt_tokens_dropped: tokens removed from the left of the prompt by ``truncation="left_prompt"``.
    """

    input_ids: list[int]
    read_positions: list[int]
    prompt_tokens_dropped: int = 0


def check_step_positions(sample: int, length: int, prompt_end: int, step_ends: Sequence[int]) -> None:
    """Validate ``prompt_end`` and ``step_ends`` of one sequence of ``length`` tokens.

    Required: ``0 <= prompt_end < step_ends[0] < step_ends[1] < ... < length`` (a step holds at least one token,
    and the prompt holds at least one token so that v_0 has a position to be read at).
    """
    if not 0 <= prompt_end < length:
        raise ValueError(
            f"sample {sample}: prompt_end={prompt_end} is outside the sequence of {length} tokens; the prompt "
            "must hold at least one token (v_0 is read at its last token)"
        )
    previous = prompt_end
    for h, end in enumerate(step_ends):
        if not previous < end < length:
            raise ValueError(
                f"sample {sample}: step_ends[{h}]={end} must lie in ({previous}, {length}): step ends are "
                "positions of each step's last token, strictly increasing, after the prompt"
            )
        previous = end


def insert_markers(
    input_ids: Sequence[int], prompt_end: int, step_ends: Sequence[int], marker_id: int | None,
    prompt_marker: bool = False,
) -> tuple[list[int], list[int]]:
    """Insert ``marker_id`` after each step's last token, and after the prompt's last token only when
    ``prompt_marker`` (a format whose authors put a marker there; otherwise v_0 is read at the prompt's last
    token and no step's context holds a marker the authors' input lacks).

    Without a marker (``marker_id is None``) the ids are returned unchanged and the read positions are
    ``[prompt_end, *step_ends]``. With a marker, the k-th inserted marker (0-based) lands at
    ``original_position + 1 + k`` and the values are read at the markers. Tokens after the last step's end (if
    any) are kept after the last marker.

    Returns:
        (ids, read_positions): ids of length ``len(input_ids) + H (+ 1 with a prompt marker)`` with a marker,
        and H + 1 positions.
    """
    ids = list(input_ids)
    ends = [prompt_end, *step_ends]
    if marker_id is None:
        return ids, ends
    out: list[int] = []
    read_positions: list[int] = []
    start = 0
    if not prompt_marker:
        out.extend(ids[: prompt_end + 1])
        read_positions.append(prompt_end)
        start = prompt_end + 1
        ends = list(step_ends)
    for end in ends:
        out.extend(ids[start : end + 1])
        read_positions.append(len(out))
        out.append(marker_id)
        start = end + 1
    out.extend(ids[start:])
    return out, read_positions


def fit_context(
    sample: int,
    ids: list[int],
    read_positions: list[int],
    prompt_last: int,
    max_length: int | None,
    truncation: Truncation,
) -> CriticInput:
    """Make one critic input fit ``max_length`` tokens, or raise an error that names the sample.

    ``truncation="left_prompt"`` drops ``d = len(ids) - max_length`` tokens from the left of the prompt; it may
    drop every prompt token except the prompt's last one (v_0 is read there, or at the marker right after it),
    so it requires ``d <= prompt_last``, the position of the prompt's last token (markers are inserted after it, so
    it is the ``prompt_end`` of the unmarked sequence). All read
    positions shift left by ``d``. When the response (with its markers) alone does not fit, it is an error in
    both modes: the critic would not see the whole response.
    """
    length = len(ids)
    if max_length is None or length <= max_length:
        return CriticInput(ids, read_positions, 0)
    excess = length - max_length
    if truncation == "left_prompt" and excess <= prompt_last:
        return CriticInput(ids[excess:], [p - excess for p in read_positions], excess)
    response_part = length - prompt_last
    if excess > prompt_last:
        hint = (
            f"the response (with the prompt's last token and the markers) alone needs {response_part} tokens; "
            "raise max_length or score a shorter response"
        )
    else:
        hint = (
            f"raise max_length, shorten the prompt, or pass truncation='left_prompt' (drops {excess} prompt tokens "
            "from the left)"
        )
    raise ValueError(
        f"sample {sample}: the critic input has {length} tokens, more than the critic's context of {max_length} "
        f"tokens; {hint}"
    )


@dataclass(frozen=True)
class MicroBatch:
    """Indices (into the list of inputs) scored together, and the padded shape when run padded."""

    indices: list[int]
    max_length: int
    total_tokens: int


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens_per_batch: int,
    mode: Literal["varlen", "padded"],
    max_padding_share: float = 0.1,
) -> list[MicroBatch]:
    """Group sequences into micro-batches by a token budget, longest first.

    Sequences are sorted by length (descending; ties by index, so the plan is deterministic) and taken greedily.
    The cost of a micro-batch is ``sum(lengths)`` for ``varlen`` (one packed row, no padding) and
    ``count * max(lengths)`` for ``padded`` (right padding to the longest). A batch is closed when adding the
    next sequence would exceed ``max_tokens_per_batch`` or, for ``padded``, would make the batch's padded share
    ``1 - sum / (count * max)`` exceed ``max_padding_share`` (so the whole plan stays within it). A sequence
    longer than the budget runs alone.
    """
    if max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[MicroBatch] = []
    current: list[int] = []
    current_max = 0
    current_sum = 0
    for i in order:
        n = lengths[i]
        if current:
            if mode == "varlen":
                close = current_sum + n > max_tokens_per_batch
            else:
                width = max(current_max, n)
                slots = width * (len(current) + 1)
                close = slots > max_tokens_per_batch or 1 - (current_sum + n) / slots > max_padding_share
            if close:
                batches.append(MicroBatch(current, current_max, current_sum))
                current, current_max, current_sum = [], 0, 0
        current.append(i)
        current_max = max(current_max, n)
        current_sum += n
    if current:
        batches.append(MicroBatch(current, current_max, current_sum))
    return batches


@dataclass(frozen=True)
class BatchTensors:
    """The tensors of one micro-batch's forward pass (host tensors until :meth:`to`).

    Attributes:
        input_ids: [1, N] (one packed row) or [b, L] (right-padded rows).
        position_ids: same shape; restarting at 0 for every sequence of a packed row.
        flat_read: [R] indices into the flattened outputs, the read positions of the sequences in order.
        attention_mask: [b, L] of padded rows that hold padding; None otherwise (plain causal attention).
        cu_seq_lens: [n + 1] int32 boundaries of the n sequences of a packed row, for flash-attention varlen;
            None when not precomputed.
        max_length: the longest sequence of a packed row (a Python int: no device read), with ``cu_seq_lens``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    flat_read: torch.Tensor
    attention_mask: torch.Tensor | None = None
    cu_seq_lens: torch.Tensor | None = None
    max_length: int | None = None

    def _map(self, fn) -> "BatchTensors":
        def apply(tensor):
            return None if tensor is None else fn(tensor)

        return BatchTensors(apply(self.input_ids), apply(self.position_ids), apply(self.flat_read),
                            apply(self.attention_mask), apply(self.cu_seq_lens), self.max_length)

    def pin_memory(self) -> "BatchTensors":
        """Page-locked host copies, so that ``to(cuda, non_blocking=True)`` is an asynchronous copy."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "BatchTensors":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def model_kwargs(self) -> dict:
        """Keywords of the backbone's forward. With ``cu_seq_lens``, transformers' flash-attention path takes
        the boundaries as given (``cu_seq_lens_q/k``, ``max_length_q/k``) instead of deriving them from
        ``position_ids`` in every layer (a nonzero and a max on the device, read back per layer)."""
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.attention_mask is not None:
            kwargs["attention_mask"] = self.attention_mask
        if self.cu_seq_lens is not None:
            kwargs.update(cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                          max_length_q=self.max_length, max_length_k=self.max_length)
        return kwargs


def varlen_boundaries(lengths: Sequence[int]) -> tuple[torch.Tensor, int]:
    """Boundaries of sequences packed into one row: ``cu[0] = 0``, ``cu[i + 1] = cu[i] + lengths[i]`` (int32,
    flash-attention's ``cu_seqlens``), and ``max(lengths)``."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"varlen_boundaries: every packed sequence needs at least one token, got lengths {list(lengths)}")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu, int(max(lengths))


def packed_tensors(
    sequences: Sequence[Sequence[int]], read_positions: Sequence[Sequence[int]], *, boundaries: bool = False
) -> BatchTensors:
    """One packed row for varlen attention (host tensors).

    input_ids [1, N] with N = sum of lengths, position_ids [1, N] restarting at 0 for every sequence (this is how
    transformers detects packed sequences: flash-attention varlen, or a block-diagonal mask otherwise), and
    flat_read [R] = offset of each sequence + its read positions, concatenated in the given order. With
    ``boundaries``: also ``cu_seq_lens`` and ``max_length`` (``varlen_boundaries``) for flash attention.
    """
    lengths = [len(s) for s in sequences]
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    flat_read = torch.tensor([o + p for o, rp in zip(offsets, read_positions) for p in rp], dtype=torch.long)
    cu, longest = varlen_boundaries(lengths) if boundaries else (None, None)
    return BatchTensors(ids[None], positions[None], flat_read, None, cu, longest)


def padded_tensors(
    sequences: Sequence[Sequence[int]], read_positions: Sequence[Sequence[int]], pad_id: int
) -> BatchTensors:
    """Right-padded rows (causal models: right padding leaves the real tokens' outputs unchanged; host tensors).

    input_ids [b, L], attention_mask [b, L] (None when no row is padded: then attention takes the plain causal
    path), position_ids [b, L] (0..L-1), and flat_read [R] indices into the flattened [b * L] outputs, in the
    given order.
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    positions = torch.arange(width, dtype=torch.long).expand(len(sequences), width).contiguous()
    flat_read = torch.tensor([row * width + p for row, rp in enumerate(read_positions) for p in rp], dtype=torch.long)
    full = all(len(s) == width for s in sequences)
    return BatchTensors(ids, positions, flat_read, None if full else mask)


def padding_share(batches: Sequence[MicroBatch], mode: Literal["varlen", "padded"]) -> float:
    """Share of computed token slots that are padding: ``1 - real / computed``; 0 for ``varlen``."""
    real = sum(b.total_tokens for b in batches)
    if mode == "varlen" or real == 0:
        return 0.0
    computed = sum(b.max_length * len(b.indices) for b in batches)
    return 1.0 - real / computed
