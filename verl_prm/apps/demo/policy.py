"""The demo's policy: a MADE-like autoregressive MLP (Germain et al. 2015) over fixed-length token sequences.

Input: the one-hot sequence [B, T * V] (V = vocab). Three masked hidden layers (128 units, ReLU); output logits
[B, T, V]. Masks follow MADE: input unit of position p has degree p (1-based), hidden unit degrees cycle over
1..T-1, a hidden unit of degree m sees units of degree <= m, and the logits of position d see hidden units of
degree < d. So logits[:, d] depend only on tokens before d: one forward pass scores a whole sequence, and
sampling takes T passes. Position 1 sees nothing (its logits are the output bias, a learned first-token
distribution): there is no prompt in this task.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MadePolicy", "sequence_log_probs", "supervised_warm_start"]


class MaskedLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, mask: torch.Tensor) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("mask", mask.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class MadePolicy(nn.Module):
    """Autoregressive MLP policy over ``length`` tokens from ``1..vocab``."""

    def __init__(self, length: int = 10, vocab: int = 14, hidden: int = 128, layers: int = 3) -> None:
        super().__init__()
        if length < 2:
            raise ValueError("MadePolicy needs length >= 2")
        self.length, self.vocab = length, vocab
        in_degrees = torch.arange(1, length + 1).repeat_interleave(vocab)  # [T*V]
        hidden_degrees = torch.arange(hidden) % (length - 1) + 1  # 1..T-1
        blocks: list[nn.Module] = []
        previous = in_degrees
        for _ in range(layers):
            mask = hidden_degrees[:, None] >= previous[None, :]
            blocks += [MaskedLinear(previous.numel(), hidden, mask), nn.ReLU()]
            previous = hidden_degrees
        self.body = nn.Sequential(*blocks)
        out_degrees = torch.arange(1, length + 1).repeat_interleave(vocab)
        self.head = MaskedLinear(hidden, length * vocab, out_degrees[:, None] > previous[None, :])

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] tokens in 1..vocab (0 = not yet sampled, an all-zero one-hot) -> [B, T, V] logits."""
        onehot = F.one_hot(tokens, self.vocab + 1)[..., 1:].float().flatten(1)
        return self.head(self.body(onehot)).view(tokens.shape[0], self.length, self.vocab)

    @torch.no_grad()
    def sample(self, num: int, generator: torch.Generator, eos: int | None = None) -> torch.Tensor:
        """Sample [num, T] sequences; positions after the first EOS (token ``vocab``) are set to EOS.

        Same distribution as ``logits``, computed leaner: the masked weights once per call, and at position t
        only the t-th block of output logits.
        """
        eos = self.vocab if eos is None else eos
        layers = [(m.weight * m.mask, m.bias) for m in self.body if isinstance(m, MaskedLinear)]
        head_weight = (self.head.weight * self.head.mask).view(self.length, self.vocab, -1)
        head_bias = self.head.bias.view(self.length, self.vocab)
        onehot = torch.zeros(num, self.length * self.vocab)
        tokens = torch.zeros(num, self.length, dtype=torch.long)
        done = torch.zeros(num, dtype=torch.bool)
        rows = torch.arange(num)
        for t in range(self.length):
            hidden = onehot
            for weight, bias in layers:
                hidden = torch.relu(F.linear(hidden, weight, bias))
            probs = torch.softmax(F.linear(hidden, head_weight[t], head_bias[t]), dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1) + 1
            token = torch.where(done, torch.full_like(token, eos), token)
            tokens[:, t] = token
            onehot[rows, t * self.vocab + token - 1] = 1.0
            done = done | (token == eos)
        return tokens


def sequence_log_probs(policy: MadePolicy, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token log pi(y_t | y_<t): [B, T] (computed for every position; mask with the response mask)."""
    log_probs = torch.log_softmax(policy.logits(tokens), dim=-1)
    return log_probs.gather(-1, (tokens - 1)[..., None]).squeeze(-1)


def supervised_warm_start(
    policy: MadePolicy,
    data: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    iterations: int = 50,
    batch_size: int = 64,
    lr: float = 1e-3,
    generator: torch.Generator,
) -> list[float]:
    """Next-token prediction on ``data`` [N, T] (valid tokens per ``response_mask``), Adam, shuffled batches.

    The paper's warm start: 3,200 samples of mu_5, 50 iterations of batch 64 (one epoch). Loss: mean NLL over
    the valid tokens of the batch. Returns the loss of each iteration.
    """
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    if data.shape[0] < batch_size:
        raise ValueError(f"warm start needs at least batch_size={batch_size} samples, got {data.shape[0]}")
    order = torch.randperm(data.shape[0], generator=generator)
    cursor = 0
    losses = []
    for _ in range(iterations):
        if cursor + batch_size > data.shape[0]:  # next epoch: reshuffle
            order = torch.randperm(data.shape[0], generator=generator)
            cursor = 0
        index = order[cursor : cursor + batch_size]
        cursor += batch_size
        mask = response_mask[index].float()
        nll = -(sequence_log_probs(policy, data[index]) * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        nll.backward()
        optimizer.step()
        losses.append(float(nll.detach()))
    return losses
