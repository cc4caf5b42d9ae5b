"""A learned prover critic for the toy task: Monte-Carlo labels from mu_gamma and soft-label cross-entropy.

The toy version of the PAV pipeline (PAV paper Sec. 4 / App. D; docs: labels.md):

1. prefixes: every prefix (lengths 0..H) of sequences sampled from the base policy (the states RL starts in)
   and from the prover mu_gamma (the states a policy that improves towards y* reaches);
2. labels: ``n_mc`` completions of each prefix by mu_gamma; label q = success fraction (a soft label);
3. critic: an MLP on the one-hot prefix and its length, trained with soft-label cross-entropy
   ``-(w (q log sigma(z) + (1 - q) log(1 - sigma(z))))``, class-balanced as in the paper: the prefixes with
   q < 0.5 and those with q >= 0.5 carry equal total weight;
4. RL reads ``sigmoid(critic(prefix))`` as the step values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from verl_prm.apps.demo.env import PlantedTask
from verl_prm.training.losses import soft_label_bce
from verl_prm.apps.demo.policy import MadePolicy

__all__ = [
    "CriticConfig",
    "ToyCritic",
    "balanced_weights",
    "critic_values",
    "label_prefixes",
    "train_critic",
    "train_toy_critic",
]


@dataclass
class CriticConfig:
    policy_sequences: int = 1024  # base-policy samples whose prefixes are labelled
    prover_sequences: int = 1024  # mu_gamma samples whose prefixes are labelled
    n_mc: int = 20  # rollouts per prefix (the paper's n_mc)
    steps: int = 1500
    batch_size: int = 256
    lr: float = 1e-3
    hidden: int = 128
    class_balanced: bool = True


class ToyCritic(nn.Module):
    """MLP critic: features of a prefix (one-hot tokens [T * V], zeros past its end, plus one-hot length
    [T + 1]) -> logit of the prover's success probability."""

    def __init__(self, length: int = 10, vocab: int = 14, hidden: int = 128) -> None:
        super().__init__()
        self.length, self.vocab = length, vocab
        self.net = nn.Sequential(
            nn.Linear(length * vocab + length + 1, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[N, T] tokens, [N] prefix lengths -> [N, T * V + T + 1] features."""
        keep = torch.arange(self.length)[None, :] < lengths[:, None]
        onehot = F.one_hot(torch.where(keep, tokens, torch.zeros_like(tokens)), self.vocab + 1)[..., 1:]
        return torch.cat([onehot.flatten(1).float(), F.one_hot(lengths, self.length + 1).float()], dim=1)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [N]."""
        return self.net(self.features(tokens, lengths)).squeeze(-1)


def balanced_weights(labels: torch.Tensor) -> torch.Tensor:
    """Weights giving the prefixes with q < 0.5 and those with q >= 0.5 equal total weight (each class sums to
    N / 2); a class that is absent leaves the other at weight 1."""
    high = labels >= 0.5
    n_high, n_low = high.sum(), (~high).sum()
    if n_high == 0 or n_low == 0:
        return torch.ones_like(labels)
    n = labels.numel()
    return torch.where(high, n / (2 * n_high), n / (2 * n_low)).to(labels.dtype)


def label_prefixes(
    task: PlantedTask, sequences: torch.Tensor, gamma: float, n_mc: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every prefix (lengths 0..H) of ``sequences`` [M, T], labelled by ``n_mc`` mu_gamma completions.

    Returns:
        ``(tokens [P, T], lengths [P], labels [P])`` with labels the success fractions.
    """
    num_valid = task.response_mask(sequences).sum(dim=1)
    lengths = torch.arange(task.length + 1)[None, :].expand(sequences.shape[0], -1)
    keep = lengths <= num_valid[:, None]
    rows = torch.arange(sequences.shape[0])[:, None].expand_as(lengths)[keep]
    prefix_lengths = lengths[keep]
    tokens = sequences[rows]
    completions = task.complete_prefixes(
        tokens.repeat_interleave(n_mc, dim=0), prefix_lengths.repeat_interleave(n_mc), gamma, generator
    )
    labels = task.rewards(completions).view(-1, n_mc).mean(dim=1)
    return tokens, prefix_lengths, labels


def train_critic(
    critic: ToyCritic,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    labels: torch.Tensor,
    cfg: CriticConfig,
    generator: torch.Generator,
) -> list[float]:
    """Adam on the (class-balanced) soft-label cross-entropy over random minibatches. Returns the losses."""
    weights = balanced_weights(labels) if cfg.class_balanced else torch.ones_like(labels)
    features = critic.features(tokens, lengths)
    optimizer = torch.optim.Adam(critic.parameters(), lr=cfg.lr)
    losses = []
    for _ in range(cfg.steps):
        index = torch.randint(0, labels.shape[0], (cfg.batch_size,), generator=generator)
        loss = soft_label_bce(critic.net(features[index]).squeeze(-1), labels[index], weights[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def train_toy_critic(
    task: PlantedTask, base: MadePolicy, gamma: float, cfg: CriticConfig, seed: int
) -> tuple[ToyCritic, dict[str, float]]:
    """Label prefixes of base-policy and prover samples with mu_gamma rollouts and fit a critic.

    Returns the critic and its quality: mean absolute error against the exact V^mu on held-out prefixes (of
    fresh base-policy and prover samples) and the mean absolute error of the progress A = v_h - v_{h-1}.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    def sequences() -> torch.Tensor:
        policy_samples = base.sample(cfg.policy_sequences, generator, task.eos)
        prover_samples = task.sample_prover(gamma, cfg.prover_sequences, generator)
        return torch.cat([policy_samples, prover_samples])

    tokens, lengths, labels = label_prefixes(task, sequences(), gamma, cfg.n_mc, generator)
    critic = ToyCritic(task.length, task.vocab, cfg.hidden)
    losses = train_critic(critic, tokens, lengths, labels, cfg, generator)
    # held-out quality against the exact values
    held_out = sequences()
    values = critic_values(critic, task)
    with torch.no_grad():
        learned, learned_prompt = values(held_out)
    exact, exact_prompt = task.step_values(held_out, task.value_table(gamma))
    mask = task.response_mask(held_out).bool()
    learned_progress = torch.diff(torch.cat([learned_prompt[:, None], learned], dim=1), dim=1)
    exact_progress = torch.diff(torch.cat([exact_prompt[:, None], exact], dim=1), dim=1)
    quality = {
        "labelled_prefixes": float(labels.numel()),
        "final_loss": sum(losses[-50:]) / min(50, len(losses)),
        "value_mae": float((learned - exact).abs()[mask].mean()),
        "progress_mae": float((learned_progress - exact_progress).abs()[mask].mean()),
        "mean_abs_exact_progress": float(exact_progress.abs()[mask].mean()),
        "prompt_value": float(learned_prompt[0]),
        "exact_prompt_value": float(exact_prompt[0]),
    }
    return critic, quality


def critic_values(critic: ToyCritic, task: PlantedTask):
    """The critic as a ``ValueFn``: tokens [B, T] -> (step_values [B, T] = sigmoid(critic(y_1..y_{t+1})),
    prompt_values [B] = sigmoid(critic(empty prefix)))."""

    @torch.no_grad()
    def values(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length = tokens.shape
        lengths = torch.arange(1, length + 1).repeat(batch)
        step = torch.sigmoid(critic(tokens.repeat_interleave(length, dim=0), lengths)).view(batch, length)
        prompt = torch.sigmoid(critic(tokens[:1], torch.zeros(1, dtype=torch.long))).expand(batch).clone()
        return step, prompt

    return values
