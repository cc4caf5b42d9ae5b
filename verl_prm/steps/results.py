"""Result types and constants of `verl_prm.steps` (shape conventions: the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEFAULT_DELIMITER = "\n\n"
_NO_STEP = -1
# sentinel larger than any character or token position, for padded sorted sequences
_FAR = 2**62


@dataclass
class StepSplit:
    """Steps of a batch of responses (see the module docstring for the semantics).

    Attributes:
        step_ids: int64 [B, T], step (0-based) of each token, -1 for tokens in no step (padding, special).
        num_steps: int64 [B], number of steps H of each response.
        step_ends: int64 [B, S], position in the response tensor of each step's last token, -1 for h >= H;
            S = max H in the batch (0 when no response has a step).
        merged_steps: int64 [B], steps past ``max_steps`` merged into the last step (0 without max_steps).
        collapsed_steps: int64 [B], text steps merged into the previous step because both end in the same
            token (see "Tokens" in the module docstring); 0 for almost every real response.
        texts: the text of each response (valid non-special tokens, decoded), as the steps were found in.
        step_char_ends: int64 [B, S], end (exclusive) in ``texts[b]`` of each step's text, -1 for h >= H.
            Step h spans ``texts[b][step_char_ends[b, h-1]:step_char_ends[b, h]]`` (0 for h = 0). With
            ``max_tokens`` it is the character end of the step's last token.
    """

    step_ids: torch.Tensor
    num_steps: torch.Tensor
    step_ends: torch.Tensor
    merged_steps: torch.Tensor
    collapsed_steps: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    texts: list[str] = field(default_factory=list)
    step_char_ends: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))

    def step_texts(self, b: int) -> list[str]:
        """The text of each step of response ``b`` (a convenience for logging and tests)."""
        ends = self.step_char_ends[b, : int(self.num_steps[b])].tolist()
        starts = [0] + ends[:-1]
        return [self.texts[b][s:e] for s, e in zip(starts, ends)]


@dataclass
class EncodedSteps:
    """One critic input: ``input_ids`` = prompt tokens followed by response tokens.

    Attributes:
        input_ids: the critic token ids of prompt + response.
        prompt_end: index in ``input_ids`` of the prompt's last token (the critic reads v_0 there).
        step_ends: index in ``input_ids`` of the token holding each step's last character (v_h is read there).
    """

    input_ids: list[int]
    prompt_end: int
    step_ends: list[int]


@dataclass
class DecodedResponses:
    """Texts of a batch of responses with the character end of every token.

    Attributes:
        texts: decoded text of each response (valid non-special tokens only).
        char_ends: int64 [B, T], number of characters of ``texts[b]`` whose last byte is in valid tokens
            ``<= t``; non-decreasing along t, 0 before the first valid token, ``len(texts[b])`` after the last.
        valid: bool [B, T], mask != 0 and not a special token.
    """

    texts: list[str]
    char_ends: torch.Tensor
    valid: torch.Tensor
