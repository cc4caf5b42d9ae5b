"""The settings of ``verl-prm demo`` (``DemoSettings``), shared by the command, its runs and its report."""

from __future__ import annotations

from dataclasses import dataclass

from verl_prm.apps.demo.env import DEFAULT_PLANTED

__all__ = ["DemoSettings", "QUICK"]


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
