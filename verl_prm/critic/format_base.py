"""The interface every critic checkpoint format implements (:class:`CriticFormat`); the formats themselves are in
:mod:`verl_prm.critic.formats` (the public PRMs and ``value_head``) and :mod:`verl_prm.critic.token_logprob_format`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from verl_prm.critic.packing import BatchTensors, insert_markers
from verl_prm.critic.text_input import TextInput

__all__ = ["CriticFormat", "no_options"]


class CriticFormat:
    """Base adapter. Subclasses set ``name`` and implement ``load`` and ``logits_to_values``; text formats set
    ``text_input = True`` and implement ``build_text_input``. A format whose values are not a head at the read
    positions (``token_logprob``: statistics of the LM's token log-probs between them) overrides
    :meth:`read_values` instead.

    Attributes:
        backbone: module called as ``backbone(input_ids=, attention_mask=, position_ids=, use_cache=False)``
            returning ``.last_hidden_state`` [b, L, H].
        head: fp32 module mapping hidden states [n, H] to logits [n, C], applied only at read positions.
        marker_id: token inserted after every step by ``build_token_input`` (None: read at the last tokens).
        prompt_marker: whether a marker also follows the prompt (only a format whose authors put one there).
        model: the loaded transformers model (kept for its config and for ``.to``).
    """

    name: ClassVar[str] = ""
    text_input: ClassVar[bool] = False
    prompt_marker: ClassVar[bool] = False

    def __init__(self, model: nn.Module, backbone: nn.Module, head: nn.Module, marker_id: int | None = None):
        self.model = model
        self.backbone = backbone
        self.head = head
        self.marker_id = marker_id

    @classmethod
    def load(cls, path: str, tokenizer, *, dtype: torch.dtype, attn_implementation: str, device: torch.device,
             allow_pickle: bool = False, **options: Any) -> "CriticFormat":
        """Load the checkpoint directory ``path`` (safetensors only unless ``allow_pickle``)."""
        raise NotImplementedError

    def build_token_input(self, ids: Sequence[int], prompt_end: int, step_ends: Sequence[int]
                          ) -> tuple[list[int], list[int], int]:
        """(critic ids, H + 1 read positions, position of the prompt's last token) from token ids."""
        marked, reads = insert_markers(ids, prompt_end, step_ends, self.marker_id, prompt_marker=self.prompt_marker)
        return marked, reads, prompt_end

    def build_text_input(self, tokenizer, prompt: str, steps: Sequence[str]) -> TextInput:
        """Text formats: the authors' input for ``prompt`` and our ``steps`` (texts with their delimiters). The
        step texts are the policy's: they never become special tokens, separators or turns of the input."""
        raise NotImplementedError

    def prompt_from_ids(self, tokenizer, prompt: str) -> str:
        """Text formats, token-id path: the prompt text the format builds its input from, given the text decoded
        from the prompt ids (``decode_segments``). Default: that text."""
        return prompt

    def logits_to_values(self, logits: torch.Tensor) -> torch.Tensor:
        """Values [n] from head logits [n, C] (fp32)."""
        raise NotImplementedError

    def read_values(self, hidden: torch.Tensor, tensors: BatchTensors, counts: Sequence[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One micro-batch's values from the backbone's last hidden states ``hidden`` ([b, L, H], of ``tensors``'
        forward pass): ``(values [R], finite [R] bool, read [R, d])`` over the R = ``sum(counts)`` read positions
        of ``tensors.flat_read`` (``counts``: the read positions of each sequence, in order; ``read``: what the
        head read there, fp32). Default: the head at the read positions, then :meth:`logits_to_values`."""
        gathered = hidden.reshape(-1, hidden.shape[-1]).index_select(0, tensors.flat_read).float()
        logits = self.head(gathered)
        values = self.logits_to_values(logits)
        finite = torch.isfinite(gathered).all(-1) & torch.isfinite(logits).all(-1) & torch.isfinite(values)
        return values, finite, gathered

    def to(self, device: torch.device) -> "CriticFormat":
        self.model.to(device)
        self.backbone.to(device)
        self.head.to(device)
        return self

    @property
    def config(self):
        return self.model.config

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={type(self.model).__name__}, marker_id={self.marker_id})"


def no_options(name: str, options: dict[str, Any]) -> None:
    """A format that takes no options refuses any it is given."""
    if options:
        raise TypeError(f"format {name!r} takes no options {sorted(options)}")
