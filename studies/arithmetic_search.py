"""Test-time search with every critic a recipe work directory has, before (or without) the RL stage.

The ``evaluate`` stage runs this search after RL, beside the final policies; this module runs the same sweep
(:func:`~verl_prm.apps.arithmetic.pipeline.search_with_critics`, the same problems and seed) as soon as the critics
exist: the ``pav`` stage's PAV (raw values, and calibrated when its checkpoint has a ``calibration.json``), the
``pav_refined`` stage's (raw values) when it is complete, and the exact prover.

    python -m studies.arithmetic_search --work-dir runs/arith/mod7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

__all__ = ["critics_of", "main", "run_search"]


def _outputs(work: Path, stage: str) -> dict | None:
    marker = work / stage / "DONE.json"
    return json.loads(marker.read_text())["outputs"] if marker.exists() else None


def critics_of(work: Path, device: str = "cpu") -> dict:
    """``{name: ProverCritic}`` of the work directory's complete critic stages, named as the evaluate stage names
    them: ``learned``, ``learned_calibrated``, ``learned_refined``."""
    from verl_prm.critic import ProverCritic

    pav = _outputs(work, "pav")
    if pav is None:
        raise FileNotFoundError(f"{work / 'pav' / 'DONE.json'} does not exist: run the recipe's pav stage first")
    critics = {"learned": ProverCritic.from_pretrained(pav["checkpoint"], format="value_head", device=device,
                                                       calibration="none")}
    calibrated = ProverCritic.from_pretrained(pav["checkpoint"], format="value_head", device=device)
    if calibrated.calibration is not None:
        critics["learned_calibrated"] = calibrated
    refined = _outputs(work, "pav_refined")
    if refined is not None:
        critics["learned_refined"] = ProverCritic.from_pretrained(refined["checkpoint"], format="value_head",
                                                                  device=device, calibration="none")
    return critics


def run_search(work: str | Path, scale, log=print) -> dict:
    """The search sweep of every critic of ``work`` (see the module docstring) with the SFT policy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.apps.arithmetic.pipeline import search_with_critics

    work = Path(work)
    prover = _outputs(work, "prover")
    if prover is None:
        raise FileNotFoundError(f"{work / 'prover' / 'DONE.json'} does not exist: run the recipe's prover stage first")
    policy = work / "policy"
    tokenizer = AutoTokenizer.from_pretrained(str(policy), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(policy), trust_remote_code=False).to(scale.device).eval()
    critics = critics_of(work, scale.device)
    log(f"[search_study] {', '.join(critics)} and the exact prover on {scale.search_problems} test problems")
    started = time.perf_counter()
    search = search_with_critics(scale, model, tokenizer, critics, prover["step_accuracy"])
    return {"search": search, "critics": {name: critic.describe() for name, critic in critics.items()},
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.arithmetic_search", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", required=True, help="the recipe's work directory (its prover and pav stages)")
    parser.add_argument("--output", default=None, help="JSON file (default WORK_DIR/search_study.json)")
    args = parser.parse_args(argv)
    import torch

    from verl_prm.apps.arithmetic import evaluate as ev
    from verl_prm.apps.arithmetic.pipeline import SCALES, scale_from_json

    work = Path(args.work_dir)
    scale_file = work / "scale.json"
    scale = scale_from_json(json.loads(scale_file.read_text())) if scale_file.exists() else SCALES["cpu"]
    torch.set_num_threads(scale.threads)
    results = run_search(work, scale)
    output = Path(args.output) if args.output else work / "search_study.json"
    output.write_text(json.dumps(results, indent=2))
    print("\n".join(ev.search_table(results["search"])))
    print(f"written: {output} ({results['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
