"""`verl-prm bench advantages`: every estimator against verl's grpo and grpo_vectorized, in one process.

Prints the median time of each and its ratio to verl's ``grpo_vectorized`` and ``grpo``. Target (issue 2):
``pav_grpo`` <= 2x ``grpo_vectorized`` and faster than verl's ``grpo``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def make_batch(batch: int, length: int, steps: int, group: int, device: str, seed: int = 0) -> dict:
    """A realistic batch: responses of random length, ``steps`` steps each, outcome at the last token."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    positions = torch.arange(length)[None, :]
    response_mask = (positions < lengths[:, None]).float()
    # step h covers an equal share of the response; the last token (EOS) is in no step
    step_ids = (positions * steps // lengths[:, None].clamp_min(1)).clamp(max=steps - 1)
    step_ids = torch.where(positions < lengths[:, None] - 1, step_ids, torch.full_like(step_ids, -1))
    outcome = torch.randint(0, 2, (batch,), generator=generator).float()
    token_level_rewards = torch.zeros(batch, length)
    token_level_rewards[torch.arange(batch), lengths - 1] = outcome
    tensors = dict(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        step_ids=step_ids,
        step_values=torch.rand(batch, steps, generator=generator),
        prompt_values=torch.rand(batch, generator=generator),
        num_steps=torch.full((batch,), steps, dtype=torch.long),
    )
    tensors = {k: v.to(device) for k, v in tensors.items()}
    tensors["index"] = np.array([f"prompt-{i // group}" for i in range(batch)], dtype=object)
    return tensors


def interleaved_medians(cases: dict, repeats: int, device: str) -> dict[str, float]:
    """Median seconds of each case, timed round-robin so that load changes on the machine hit all cases alike."""
    times: dict[str, list[float]] = {label: [] for label in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(repeats):
        for label, fn in cases.items():
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-prm bench advantages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import verl  # noqa: F401  (registers the plugin)
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    data = make_batch(args.batch, args.length, args.steps, args.group, args.device)
    verl_kwargs = {k: data[k] for k in ("token_level_rewards", "response_mask", "index")}

    def config(name: str, check: bool = False, **pav):
        return OmegaConf.create({"adv_estimator": name, "norm_adv_by_std_in_grpo": True,
                                 "pav": {"alpha": 1.0, "best_of_k": 4, "check_inputs": check, **pav}})

    def verl_call(name):
        fn = get_adv_estimator_fn(name)
        return lambda: fn(**verl_kwargs, config=config(name))

    def ours(name, **options):
        fn = get_adv_estimator_fn(name)
        cfg = config(name, **options)
        return lambda: fn(**data, config=cfg)

    cases = [
        ("grpo (verl, loop)", verl_call("grpo")),
        ("grpo_vectorized (verl)", verl_call("grpo_vectorized")),
        ("rloo_vectorized (verl)", verl_call("rloo_vectorized")),
        ("pav_grpo", ours("pav_grpo")),
        ("pav_rloo", ours("pav_rloo")),
        ("pav_reinforce", ours("pav_reinforce")),
        ("prm_aggregate (min)", ours("prm_aggregate")),
        ("pav_grpo + clip + normalize", ours("pav_grpo", clip=0.5, normalize=True)),
        ("pav_grpo, check_inputs on", ours("pav_grpo", check=True)),
    ]
    print(f"B={args.batch} T={args.length} steps={args.steps} group={args.group} device={args.device} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} (median, cases interleaved)")
    with torch.no_grad():
        timings = interleaved_medians(dict(cases), args.repeats, args.device)
    reference = timings["grpo_vectorized (verl)"]
    loop = timings["grpo (verl, loop)"]
    print(f"{'estimator':<30} {'ms':>9} {'x grpo_vectorized':>18} {'x grpo (loop)':>14}")
    for label, seconds in timings.items():
        print(f"{label:<30} {seconds * 1e3:>9.2f} {seconds / reference:>18.2f} {seconds / loop:>14.3f}")
    ratio = timings["pav_grpo"] / reference
    verdict = "meets" if ratio <= 2.0 and timings["pav_grpo"] < loop else "MISSES"
    print(f"pav_grpo / grpo_vectorized = {ratio:.2f} (target <= 2), pav_grpo / grpo = "
          f"{timings['pav_grpo'] / loop:.3f} (target < 1): {verdict} the target")
    return 0
