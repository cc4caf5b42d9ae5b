"""The settings of ``verl-prm demo`` (``DemoSettings``), shared by the command, its runs and its report."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_PLANTED", "DemoSettings", "QUICK"]

# Default planted sequence: 4 tokens, no self-overlap (all KMP fallbacks are 0, so "matched length" is simply the
# longest matched prefix; overlapping sequences work too, the automaton handles them), no EOS. Why 4: the
# warm-started policy then succeeds on ~0.05% of its samples, so exploration is the bottleneck (the regime of
# the paper's experiment), yet outcome-only RL finds a first success within a few hundred iterations in most
# seeds, so the demo can measure a ratio instead of a bound. With 5 tokens the warm-started policy had 0
# successes in 4,096 samples and outcome-only RL never moved in 400 iterations (3 seeds; README). The paper
# shows its y* only in a figure.
DEFAULT_PLANTED = (3, 8, 5, 11)


@dataclass
class DemoSettings:
    planted: tuple[int, ...] = DEFAULT_PLANTED
    seeds: int = 5
    iterations: int = 600  # comparison budget B
    gamma: float = 10.0  # the comparison's prover
    alpha: float = 1.0
    sweep_gammas: tuple[float, ...] = (1.0, 3.0, 5.0, 10.0, 15.0, 30.0, 100.0)
    sweep_seeds: int = 3
    sweep_iterations: int = 300
    # the sweep's plot shows accuracy here: early enough to separate the provers (most runs are done by 300)
    sweep_accuracy_at: int = 100
    pass_at_iteration: int = 100
    norm_adv_by_std: bool = True
    loss_agg_mode: str = "token-mean"
    warm_iterations: int = 50
    learned_critic: bool = False
    critic_seed: int = 0
    workers: int = 2
    out: str = "demo_out"
    quick: bool = False


# ``--quick``: a smaller version of the same experiments
QUICK = dict(seeds=2, iterations=300, sweep_gammas=(1.0, 10.0, 100.0), sweep_seeds=1, sweep_iterations=150)
