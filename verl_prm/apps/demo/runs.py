"""One RL run of the demo (`execute_run`, deterministic in its seed) and the process pool that runs many."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_prm.apps.demo.env import PlantedTask
from verl_prm.apps.demo.report import PASS_AT_N_SAMPLES
from verl_prm.apps.demo.settings import DemoSettings
from verl_prm.apps.demo.policy import MadePolicy
from verl_prm.apps.demo.critic import CriticConfig, ToyCritic, critic_values, train_toy_critic


@dataclass
class RunSpec:
    """One RL run: ``method`` is "outcome" (alpha = 0) or "pav"; ``values`` is "exact" or "learned"."""

    method: str
    gamma: float
    seed: int
    iterations: int
    values: str = "exact"
    pass_at: int | None = None
    critic_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)


_BASE_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def base_policy(settings: DemoSettings, task: PlantedTask, seed: int):
    """The warm-started policy of ``seed`` (cached per process: every run of a seed starts from it)."""
    from verl_prm.apps.demo.policy_gradient import make_base_policy

    key = (task.planted, settings.warm_iterations, seed)
    if key not in _BASE_CACHE:
        _BASE_CACHE[key] = make_base_policy(task, seed, warm_iterations=settings.warm_iterations).state_dict()
    policy = MadePolicy(task.length, task.vocab)
    policy.load_state_dict(_BASE_CACHE[key])
    return policy


def _success_count(task: PlantedTask, policy, seed: int, num: int = PASS_AT_N_SAMPLES) -> int:
    samples = policy.sample(num, torch.Generator().manual_seed(777_000 + seed), task.eos)
    return int(task.rewards(samples).sum())


def execute_run(settings: DemoSettings, spec: RunSpec, progress=None) -> dict[str, Any]:
    """Run one RL run (deterministic in ``spec.seed``; single-threaded). Returns its curves and counts."""
    from verl_prm.apps.demo.policy_gradient import RLConfig, train_rl

    task = PlantedTask(planted=settings.planted)
    base = base_policy(settings, task, spec.seed)
    values = None
    if spec.method == "pav" and spec.values == "learned":
        critic = ToyCritic(task.length, task.vocab)
        critic.load_state_dict(spec.critic_state)
        values = critic_values(critic, task)
    cfg = RLConfig(
        alpha=0.0 if spec.method == "outcome" else settings.alpha,
        gamma=spec.gamma,
        iterations=spec.iterations,
        norm_adv_by_std=settings.norm_adv_by_std,
        loss_agg_mode=settings.loss_agg_mode,
        snapshots=(spec.pass_at,) if spec.pass_at is not None else (),
    )
    result = train_rl(task, base, cfg, spec.seed, values=values, progress=progress)
    out: dict[str, Any] = {"accuracy": result.accuracy.tolist()}
    if spec.pass_at is not None:
        policy = MadePolicy(task.length, task.vocab)
        policy.load_state_dict(result.snapshots[spec.pass_at])
        out["pass_successes"] = _success_count(task, policy, spec.seed)
        out["base_successes"] = _success_count(task, base, spec.seed)
    return out


def train_critic_job(settings: DemoSettings, gamma: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    task = PlantedTask(planted=settings.planted)
    base = base_policy(settings, task, settings.critic_seed)
    critic, quality = train_toy_critic(task, base, gamma, CriticConfig(), seed=settings.critic_seed)
    return critic.state_dict(), quality


def _worker_init() -> None:
    torch.set_num_threads(1)
    from verl_prm.apps.demo.policy_gradient import import_verl

    import_verl()


def run_all(settings: DemoSettings, jobs: list[tuple], description: str, units: list[int]) -> list[Any]:
    """Run ``jobs`` ((function, *args) tuples) in ``settings.workers`` processes, or here when 1.

    ``units``: progress units per job (RL iterations). A broken pool (e.g. no permission to start processes)
    falls back to running here, with a warning.
    """
    from tqdm.auto import tqdm

    results: list[Any] = [None] * len(jobs)
    with tqdm(total=sum(units), desc=description, unit="it", leave=True, dynamic_ncols=True) as bar:
        if settings.workers > 1 and len(jobs) > 1:
            try:
                context = multiprocessing.get_context("spawn")
                with concurrent.futures.ProcessPoolExecutor(
                    max_workers=min(settings.workers, len(jobs)), mp_context=context, initializer=_worker_init
                ) as pool:
                    futures = {pool.submit(job[0], *job[1:]): i for i, job in enumerate(jobs)}
                    for future in concurrent.futures.as_completed(futures):
                        i = futures[future]
                        results[i] = future.result()
                        bar.update(units[i])
                return results
            except (concurrent.futures.process.BrokenProcessPool, OSError, PermissionError) as error:
                warnings.warn(f"worker processes failed ({error}); running in this process instead")
                bar.reset()
        for i, job in enumerate(jobs):
            if job[0] is execute_run:
                results[i] = execute_run(*job[1:], progress=bar.update)
            else:
                results[i] = job[0](*job[1:])
                bar.update(units[i])
    return results
