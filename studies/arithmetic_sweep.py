"""The difficulty sweep of the arithmetic recipe: how often the SFT policy succeeds, per task setting.

Outcome-only GRPO learns only from groups whose samples disagree: a group of G samples that all fail (or all
succeed) has zero advantage everywhere. PAV's process term still has a signal there (a step that slips loses
value). So the recipe's RL task should be one where the base policy succeeds rarely enough that many groups
carry no outcome signal. This sweep measures it: for each setting (number of operations, modulus) it runs the
recipe's ``data`` and ``sft`` stages once per modulus (SFT on the task's range of operation counts; the same code
and settings as a full run, so a full run in that directory skips them) and samples the SFT policy on new
problems with each number of operations:

- ``success``: mean outcome (temperature 1);
- ``zero_signal_groups``: share of groups of ``group_size`` samples of one prompt whose outcomes are all equal,
  ``(1 - s)^G + s^G`` in expectation at a per-prompt success s;
- ``step_accuracy``: P(operation step h is right | steps before it are right), pooled over steps: the p of the
  exact prover (``verl_prm.apps.arithmetic.prover``) for this policy.

(The measurements are :mod:`.measure`'s, which the recipe's ``prover`` stage also takes.)

    python -m studies.arithmetic_sweep --work-dir runs/arithmetic_sweep --moduli 7,11 --ops 3,4,5,6 \
        --step-slip-rate 0.15
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence


__all__ = ["modulus_scale", "plot_sweep", "run_sweep"]


def modulus_scale(base, modulus: int):
    """``base`` (a recipe ``Scale``) with its task modulo ``modulus`` (operands 1..modulus-1)."""
    return replace(base, task=replace(base.task, modulus=modulus, max_operand=modulus - 1))


def run_sweep(base, work_dir: Path, moduli: Sequence[int], num_ops: Sequence[int], *, problems: int = 256,
              group_size: int = 8, progress: bool = True, log=print) -> list[dict]:
    """For every modulus, the recipe's SFT policy (``data`` and ``sft`` stages of ``base`` with that modulus:
    SFT on the task's range of operation counts) measured on ``problems`` new problems with each count of
    ``num_ops``; writes ``sweep.json``, ``sweep.md`` (headed by the machine it ran on) and ``sweep.png``."""
    import torch

    from verl_prm.apps.arithmetic.measure import measure_policy
    from verl_prm.apps.arithmetic.machine import machine_line
    from verl_prm.apps.arithmetic.pipeline import environment, run, stages_of
    from verl_prm.apps.arithmetic.task import generate_problems

    rows = []
    machine = machine_line(environment())
    for modulus in moduli:
        scale = modulus_scale(base, modulus)
        directory = work_dir / f"mod{modulus}"
        run(scale, directory, ["data", "sft"], progress=progress, log=log)
        stages = stages_of(scale, directory)
        sft_prompts = [json.loads(line)["prompt"] for line in open(stages["data"].path / "sft.jsonl")]
        sft_seconds = json.loads(stages["sft"].marker.read_text())["seconds"]
        for n in num_ops:
            measured_path = directory / f"sweep_ops{n}.json"
            if measured_path.exists():
                row = json.loads(measured_path.read_text())
            else:
                task = replace(scale.task, min_ops=n, max_ops=n)
                probe = generate_problems(problems, task, seed=1000 + n, exclude=sft_prompts)
                threads = torch.get_num_threads()
                torch.set_num_threads(scale.threads)
                try:
                    measured = measure_policy(stages["sft"].path, probe, group_size=group_size,
                                              max_new_tokens=replace(scale, rl_num_ops=n).max_new_tokens, seed=4242)
                finally:
                    torch.set_num_threads(threads)
                row = {"num_ops": n, "modulus": modulus, "step_slip_rate": scale.task.step_slip_rate,
                       "sft_ops": [scale.task.min_ops, scale.task.max_ops], "sft_seconds": sft_seconds,
                       "problems": problems, "directory": str(directory),
                       "machine": machine, **measured}
                measured_path.write_text(json.dumps(row, indent=2))
            log(f"[sweep] {n} ops mod {modulus}: success {row['success']:.3f}, zero-signal groups "
                f"{row['zero_signal_groups']:.3f}, step accuracy {row['step_accuracy']:.3f}")
            rows.append(row)
    (work_dir / "sweep.json").write_text(json.dumps(rows, indent=2))
    # a row measured earlier (its sweep_ops*.json kept) may come from another machine: each is named
    machines = list(dict.fromkeys(r.get("machine", "unknown (not recorded)") for r in rows))
    several = len(machines) > 1
    lines = [f"Machine: {machines[0] if machines else machine}." if not several else
             "Machines: " + " | ".join(f"({i + 1}) {m}" for i, m in enumerate(machines)) + ".", "",
             f"| operations | modulus | SFT success (T=1) | groups of {group_size} with no outcome signal | "
             "all-fail groups | step accuracy p | response tokens |" + (" machine |" if several else ""),
             "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if several else "")]
    for r in rows:
        where = f" ({machines.index(r.get('machine', 'unknown (not recorded)')) + 1}) |" if several else ""
        lines.append(f"| {r['num_ops']} | {r['modulus']} | {r['success']:.3f} | {r['zero_signal_groups']:.3f} | "
                     f"{r['all_fail_groups']:.3f} | {r['step_accuracy']:.3f} | {r['response_tokens']:.1f} |{where}")
    (work_dir / "sweep.md").write_text("\n".join(lines) + "\n")
    plot_sweep(rows, work_dir / "sweep.png")
    log("\n".join(lines))
    return rows


def plot_sweep(rows: Sequence[dict], path: Path) -> None:
    """SFT success and the share of groups without an outcome signal against the number of operations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.0, 4.0))
    for modulus, slip in sorted({(r["modulus"], r["step_slip_rate"]) for r in rows}):
        mine = sorted((r for r in rows if (r["modulus"], r["step_slip_rate"]) == (modulus, slip)),
                      key=lambda r: r["num_ops"])
        x = [r["num_ops"] for r in mine]
        name = f"mod {modulus}, q = {slip:g}"
        line, = axis.plot(x, [r["success"] for r in mine], marker="o", label=f"SFT success, {name}")
        axis.plot(x, [r["zero_signal_groups"] for r in mine], marker="s", linestyle="--", color=line.get_color(),
                  label=f"groups with no outcome signal, {name}")
    axis.set_xticks(sorted({r["num_ops"] for r in rows}))
    axis.set_xlabel("operations per problem")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.set_title(f"difficulty sweep: the SFT policy, groups of {rows[0]['group_size'] if rows else 8}", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    from verl_prm.cli_types import finite_float
    from verl_prm.apps.arithmetic.pipeline import SCALES

    parser = argparse.ArgumentParser(prog="python -m studies.arithmetic_sweep",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="the scale whose other settings apply")
    parser.add_argument("--moduli", default="7,11", help="comma-separated primes (one SFT policy each)")
    parser.add_argument("--ops", default="3,4,5,6", help="operation counts to measure each policy on")
    parser.add_argument("--step-slip-rate", type=finite_float(0.0, 1.0), default=None,
                        help="the SFT solutions' per-step slip rate q (default: the scale's)")
    parser.add_argument("--problems", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    base = SCALES[args.scale]
    if args.step_slip_rate is not None:
        base = replace(base, task=replace(base.task, slip_rate=0.0, step_slip_rate=args.step_slip_rate))
    run_sweep(base, Path(args.work_dir), [int(x) for x in args.moduli.split(",")],
              [int(x) for x in args.ops.split(",")], problems=args.problems, group_size=args.group_size,
              progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
