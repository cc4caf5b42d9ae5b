"""``python -m studies.bench_validation``: verl's validation metrics with its bootstrap loop and with the
CPU platform's vectorised ``bootstrap_metric`` (``patches/0007``), side by side in one process.

``process_validation_metrics`` on a synthetic validation batch shaped like the arithmetic recipe's (``--prompts``
prompts x ``--samples`` samples, the ``pav`` reward manager's keys: ``acc``, ``pav_num_steps``,
``pav_response_tokens``, ``pav_truncated`` and the text ``pav_step_spans``), once with verl 0.9.1's own
``bootstrap_metric`` and once with ``verl_prm.integrations.verl.platform.fixes.vectorised_bootstrap_metric``.
Prints both times, their ratio and whether the two metric dictionaries are equal.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.bench_validation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256, help="validation prompts")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (verl's val_kwargs.n)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.samples < 1:
        parser.error("--prompts and --samples must be >= 1")

    import numpy as np
    import verl.trainer.ppo.metric_utils as metric_utils

    from verl_prm.integrations.verl.platform.fixes import vectorised_bootstrap_metric

    # verl's own function, also where the plugin's CPU fix already replaced it in this process
    loop = getattr(metric_utils.bootstrap_metric, "loop_bootstrap_metric", metric_utils.bootstrap_metric)
    rng = np.random.default_rng(0)
    n = args.prompts * args.samples
    sources = ["arithmetic_mod"] * n
    uids = [f"prompt-{i // args.samples}" for i in range(n)]
    infos = {"acc": rng.integers(0, 2, n).astype(float).tolist(), "pav_num_steps": rng.integers(1, 8, n).tolist(),
             "pav_response_tokens": rng.integers(50, 100, n).tolist(),
             "pav_truncated": rng.integers(0, 2, n).astype(float).tolist(), "pav_step_spans": ["[]"] * n}
    seconds, metrics = {}, {}
    original = metric_utils.bootstrap_metric
    try:
        for name, function in (("verl's loop", loop), ("vectorised", vectorised_bootstrap_metric(loop))):
            metric_utils.bootstrap_metric = function
            start = time.perf_counter()
            metrics[name] = metric_utils.process_validation_metrics(sources, uids, infos)
            seconds[name] = time.perf_counter() - start
    finally:
        metric_utils.bootstrap_metric = original
    print(f"process_validation_metrics, {args.prompts} prompts x {args.samples} samples, 4 numeric keys")
    print("| bootstrap_metric | seconds |\n|---|---:|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.2f} |")
    print(f"ratio (loop / vectorised): {seconds[next(iter(seconds))] / seconds['vectorised']:.1f}; "
          f"metrics equal: {metrics[next(iter(metrics))] == metrics['vectorised']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
