"""Why the learned PAV's values have the wrong size: its values against the exact prover's, on held-out labels.

The recipe's learned PAV (the ``pav`` stage) ranks prefixes well but, before calibration, its process term was a
fraction of the exact prover's (docs/arithmetic.md). PAV-GRPO adds ``alpha * (BoK(v_h) - BoK(v_{h-1}))`` to the
advantage, so the size of the values matters, not only their order. This module measures, on the label rows of
the prompts that ``verl-prm train`` held out (the same ``split_by_prompt``), each candidate source of the
squash:

* **label noise**: the Monte-Carlo labels (``n_mc`` continuations) against the exact prover's values of the same
  prefixes (``arithmetic_critic.exact_label_rows``): the error a perfect fit of the labels would keep;
* **the fit**: the PAV's raw values against the exact values, on held-out and on training rows (a squash on the
  training rows too is the head's fit, not generalisation): MSE, the least-squares slope of the values on the
  exact ones (1 = the right size), the mean drop at the first step where the exact value falls to 0;
* **the calibration**: the same for the values with the checkpoint's ``calibration.json`` applied;
* **Best-of-K after the fit**: the process term ``A_h = BoK(v_h) - BoK(v_{h-1})`` of each source, its mean |A| on
  right steps (the exact value stays > 0) and on slipped steps (the exact value falls to 0), and its per-step
  correlation with the exact prover's ``A_h``;
* a constant (the training labels' mean): the baseline that an MSE is compared with.

With ``--head-fits`` (:func:`head_fits`), value heads fitted to convergence on the critic's own backbone
features (its value head's input at every read position, the backbone frozen, as ``--freeze-backbone`` trains
it): a logistic read-out of the Monte-Carlo labels (is the trained head short of its optimum?), of the exact
values (is it the labels' noise?), and of the Monte-Carlo labels with the truth of each prefix (every result so
far right) appended as one more feature, some of it flipped at random (the size a head reaches when the
backbone's check has a given quality). A head that predicts E[v | features] has a slope equal to the share of the
exact values' variance that the features explain, so a small slope of a converged head is the features' limit.

    python -m studies.arithmetic_value_size --work-dir runs/arith/mod7 [--head-fits]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["backbone_features", "fitted_head_predictor", "head_fits", "measure", "size_statistics", "size_table"]

# the share of the appended prefix truth flipped at random in head_fits (0: a perfect check)
TRUTH_FLIPS = (0.0, 0.02, 0.05, 0.1)


def _best_of_k(values: np.ndarray, k: int) -> np.ndarray:
    """The Best-of-K prover's values 1 - (1 - v)^K, by the estimators' own ``verl_prm.advantages.best_of_k``."""
    import torch

    from verl_prm.advantages import best_of_k

    return best_of_k(torch.from_numpy(np.clip(values, 0.0, 1.0)), k).numpy()


def size_statistics(values: Sequence[np.ndarray], exact: Sequence[np.ndarray], *, best_of_k: int) -> dict:
    """How ``values`` compare in size with ``exact``, row by row.

    Each row is ``[v_0, v_1, ..., v_H]``: the prompt's value, then the value after each step (the same length in
    both). Returns ``mse`` (against the exact values), ``slope``/``intercept`` (least squares of the values on the
    exact ones over all positions), ``drop_at_first_pit`` (mean ``v_{h-1} - v_h`` at the first h whose exact value
    is 0 after a positive one), and of the process term ``A_h = BoK(v_h) - BoK(v_{h-1})``: ``abs_adv_right``
    (mean |A| where the exact value stays > 0), ``abs_adv_slipped`` (mean |A| at the first pits),
    ``process_corr`` (Pearson correlation of A with the exact A over all steps) and ``process_slope`` (least
    squares slope of A on the exact A: the share of the exact process term that the values carry).
    """
    if len(values) != len(exact):
        raise ValueError(f"size_statistics: {len(values)} rows of values but {len(exact)} of exact values")
    flat_v, flat_e, adv_v, adv_e, right, slipped, drops = [], [], [], [], [], [], []
    for row, (v, e) in enumerate(zip(values, exact)):
        v, e = np.asarray(v, dtype=np.float64), np.asarray(e, dtype=np.float64)
        if v.shape != e.shape or v.ndim != 1 or len(v) < 2:
            raise ValueError(f"size_statistics: row {row} has values of shape {v.shape} and exact {e.shape}; both "
                             "must be [v_0, ..., v_H] with H >= 1")
        if not (np.isfinite(v).all() and np.isfinite(e).all()):
            raise ValueError(f"size_statistics: row {row} has a non-finite value")
        flat_v.append(v)
        flat_e.append(e)
        a_v = np.diff(_best_of_k(v, best_of_k))
        a_e = np.diff(_best_of_k(e, best_of_k))
        adv_v.append(a_v)
        adv_e.append(a_e)
        stays = e[1:] > 0
        right.append(np.abs(a_v[stays]))
        pits = np.flatnonzero((e[1:] == 0) & (e[:-1] > 0))
        if len(pits):
            h = int(pits[0])
            slipped.append(abs(a_v[h]))
            drops.append(v[h] - v[h + 1])
    fv, fe = np.concatenate(flat_v), np.concatenate(flat_e)
    av, ae = np.concatenate(adv_v), np.concatenate(adv_e)
    slope, intercept = np.polyfit(fe, fv, 1) if np.ptp(fe) > 0 else (float("nan"), float("nan"))
    process_slope = float(np.polyfit(ae, av, 1)[0]) if np.ptp(ae) > 0 else float("nan")
    corr = float(np.corrcoef(av, ae)[0, 1]) if np.ptp(av) > 0 and np.ptp(ae) > 0 else float("nan")
    right_all = np.concatenate(right) if right else np.array([])
    return {
        "positions": int(len(fv)),
        "mse": float(np.mean((fv - fe) ** 2)),
        "slope": float(slope),
        "intercept": float(intercept),
        "drop_at_first_pit": float(np.mean(drops)) if drops else float("nan"),
        "abs_adv_right": float(right_all.mean()) if len(right_all) else float("nan"),
        "abs_adv_slipped": float(np.mean(slipped)) if slipped else float("nan"),
        "first_pits": len(slipped),
        "process_corr": corr,
        "process_slope": process_slope,
    }


def _rows(frame) -> list[np.ndarray]:
    """``[prompt_value, q_1, ..., q_H]`` of each label row."""
    return [np.asarray([float(r["prompt_value"]), *map(float, r["q"])]) for r in frame.to_dict("records")]


def _critic_rows(critic, frame) -> list[np.ndarray]:
    """The critic's ``[v_0, v_1, ..., v_H]`` of each label row (its prefixes as ``verl-prm train`` encodes them)."""
    from verl_prm.steps import encode_with_step_ends

    input_ids, prompt_ends, step_ends = [], [], []
    for row in frame.to_dict("records"):
        spans = [(int(a), int(b)) for a, b in zip(row["step_starts"], row["step_ends"])]
        encoded = encode_with_step_ends(critic.tokenizer, row["prompt"], row["response"], spans)
        input_ids.append(list(encoded.input_ids))
        prompt_ends.append(int(encoded.prompt_end))
        step_ends.append([int(e) for e in encoded.step_ends])
    scores = critic.score_sequences(input_ids, prompt_ends, step_ends)
    out = []
    for b, ends in enumerate(step_ends):
        out.append(np.asarray([float(scores.prompt_values[b]), *scores.step_values[b, :len(ends)].tolist()]))
    return out


def backbone_features(critic, frame) -> list[np.ndarray]:
    """The input of the critic's value head at each read position of each label row: ``[H + 1, hidden]`` (the
    prompt's position, then each step's), as the head sees it in ``score_sequences``."""
    captured = []
    hook = critic.adapter.head.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    features = []
    try:
        for index in range(len(frame)):
            captured.clear()
            values = _critic_rows(critic, frame.iloc[index:index + 1])[0]
            row = np.concatenate([c.double().cpu().numpy() for c in captured])
            if row.shape[0] != len(values):
                raise RuntimeError(f"backbone_features: row {index} has {len(values)} values but the head read "
                                   f"{row.shape[0]} positions")
            features.append(row)
    finally:
        hook.remove()
    return features


def fitted_head_predictor(features: Sequence[np.ndarray], targets: Sequence[np.ndarray]):
    """A linear value head ``sigmoid(w . x + b)`` fitted to convergence on the finite targets of every row, by the
    fit ``verl-prm train --head-fit newton`` uses (:func:`verl_prm.training.head_fit.fit_logistic_head`, unweighted).
    Returns a function from a list of ``[n, d]`` feature arrays to the list of predicted values."""
    import torch

    from verl_prm.training.head_fit import fit_logistic_head

    x = torch.from_numpy(np.concatenate(features)).double()
    y = torch.from_numpy(np.concatenate(targets)).double()
    keep = torch.isfinite(y)
    if not keep.any():
        raise ValueError("fitted_head_predictor: no finite target")
    fit = fit_logistic_head(x[keep], y[keep])

    def predict(rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [torch.sigmoid(torch.from_numpy(np.asarray(r, dtype=np.float64)) @ fit.weight + fit.bias).numpy()
                for r in rows]

    return predict


def head_fits(work_dir: str | Path, *, best_of_k: int, checkpoint: str | None = None, log=print) -> dict:
    """``size_statistics`` (held out) of value heads fitted to convergence on the critic's frozen backbone
    features (see the module docstring): on the Monte-Carlo labels, on the exact values, and on the labels with
    the prefix truth appended (``TRUTH_FLIPS`` of it flipped, seeded), each beside the step AUROC of that truth."""
    from studies.arithmetic_critic import exact_label_rows
    from verl_prm.critic import ProverCritic
    from verl_prm.training.metrics import auroc

    train_frame, held_frame, step_accuracy, checkpoint = _label_split(work_dir, checkpoint)
    import pandas as pd

    critic = ProverCritic.from_pretrained(checkpoint, device="cpu", dtype="float32", calibration="none")
    features = {"train": backbone_features(critic, train_frame), "held_out": backbone_features(critic, held_frame)}
    labels = {"train": _rows(train_frame), "held_out": _rows(held_frame)}
    exact = {split: _rows(pd.DataFrame(exact_label_rows(frame, step_accuracy)))
             for split, frame in (("train", train_frame), ("held_out", held_frame))}
    log(f"[value_size] head fits on {len(features['train'])} training rows' features of {checkpoint}")
    results: dict = {"checkpoint": checkpoint, "step_accuracy": step_accuracy, "best_of_k": best_of_k, "fits": {}}
    for name, targets in (("converged_mc_labels", labels), ("converged_exact_values", exact)):
        predict = fitted_head_predictor(features["train"], targets["train"])
        results["fits"][name] = size_statistics(predict(features["held_out"]), exact["held_out"], best_of_k=best_of_k)
    rng = np.random.default_rng(0)
    for flip in TRUTH_FLIPS:
        appended = {}
        for split in ("train", "held_out"):
            truth = [(e > 0).astype(np.float64) for e in exact[split]]
            noisy = [np.where(rng.random(len(t)) < flip, 1.0 - t, t) for t in truth]
            appended[split] = [np.concatenate([x, n[:, None]], axis=1) for x, n in zip(features[split], noisy)]
            if split == "held_out":
                check_auroc = auroc(np.concatenate([n[1:] for n in noisy]), np.concatenate([t[1:] for t in truth]))
        predict = fitted_head_predictor(appended["train"], labels["train"])
        stats = size_statistics(predict(appended["held_out"]), exact["held_out"], best_of_k=best_of_k)
        results["fits"][f"mc_labels_with_truth_flipped_{flip:g}"] = {**stats, "truth_auroc": float(check_auroc)}
    return results


def _label_split(work_dir: str | Path, checkpoint: str | None):
    """The recipe's label rows split as ``verl-prm train`` split them (training, held out), the exact prover's p
    and the critic checkpoint (default: the pav stage's)."""
    from verl_prm.labeling.format import read_labels
    from verl_prm.training.data import split_by_prompt

    work = Path(work_dir)
    pav = json.loads((work / "pav" / "DONE.json").read_text())["outputs"]
    prover = json.loads((work / "prover" / "DONE.json").read_text())["outputs"]
    training = pav["training"]
    frame = read_labels([str(p) for p in training["labels"]])
    train_frame, held_frame = split_by_prompt(frame, training["eval_fraction"], training["seed"])
    return train_frame, held_frame, float(prover["step_accuracy"]), checkpoint or pav["checkpoint"]


def measure(work_dir: str | Path, *, best_of_k: int, train_rows: int = 2000, checkpoint: str | None = None,
            log=print) -> dict:
    """Every source's ``size_statistics`` on the recipe's held-out label rows (and on up to ``train_rows``
    training rows for the fit): the MC labels, the PAV raw and calibrated, a constant. ``checkpoint``: another
    critic trained on the same labels and split (default: the ``pav`` stage's)."""
    from studies.arithmetic_critic import exact_label_rows
    from verl_prm.critic import ProverCritic

    train_frame, held_frame, step_accuracy, checkpoint = _label_split(work_dir, checkpoint)
    import pandas as pd

    train_frame = train_frame.sample(n=min(train_rows, len(train_frame)), random_state=0).reset_index(drop=True)
    log(f"[value_size] {len(held_frame)} held-out rows, {len(train_frame)} training rows; exact prover p = "
        f"{step_accuracy:.4f}; critic {checkpoint}")
    results: dict = {"checkpoint": checkpoint, "step_accuracy": step_accuracy, "best_of_k": best_of_k,
                     "held_out_rows": len(held_frame), "train_rows": len(train_frame), "sources": {}}
    constant = float(np.mean([v for row in _rows(train_frame) for v in row]))
    # each critic loaded once: its raw values, and with the checkpoint's calibration.json when it has one
    critics = {"pav_raw": ProverCritic.from_pretrained(checkpoint, device="cpu", dtype="float32", calibration="none")}
    calibrated = ProverCritic.from_pretrained(checkpoint, device="cpu", dtype="float32")
    if calibrated.calibration is not None:
        critics["pav_calibrated"] = calibrated
        results["calibration"] = calibrated.describe()
    for split, part in (("held_out", held_frame), ("train", train_frame)):
        exact = _rows(pd.DataFrame(exact_label_rows(part, step_accuracy)))
        sources = {"mc_labels": _rows(part), "constant": [np.full(len(e), constant) for e in exact]}
        sources.update({name: _critic_rows(critic, part) for name, critic in critics.items()})
        results["sources"][split] = {"exact": size_statistics(exact, exact, best_of_k=best_of_k)}
        for name, rows in sources.items():
            results["sources"][split][name] = size_statistics(rows, exact, best_of_k=best_of_k)
    return results


def size_table(results: dict) -> str:
    """The measurements as a markdown table (one row per source and split)."""
    keys = ("mse", "slope", "drop_at_first_pit", "abs_adv_right", "abs_adv_slipped", "process_corr", "process_slope")
    lines = [f"Against the exact prover (p = {results['step_accuracy']:.3f}), Best-of-{results['best_of_k']} process "
             f"term; {results['held_out_rows']} held-out label rows, {results['train_rows']} training rows; "
             f"calibrated = {results.get('calibration', 'n/a')}.", "",
             "| split | source | " + " | ".join(keys) + " |", "|---|---|" + "---:|" * len(keys)]
    for split, sources in results["sources"].items():
        for name, stats in sources.items():
            lines.append(f"| {split} | {name} | " + " | ".join(f"{stats[k]:.3f}" for k in keys) + " |")
    for name, stats in results.get("head_fits", {}).get("fits", {}).items():
        truth = f" (truth AUROC {stats['truth_auroc']:.3f})" if "truth_auroc" in stats else ""
        lines.append(f"| held_out | head fit: {name}{truth} | " + " | ".join(f"{stats[k]:.3f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.arithmetic_value_size", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", required=True, help="the recipe's work directory (its pav and prover stages)")
    parser.add_argument("--best-of-k", type=int, default=None, help="K of the process term (default: the scale's)")
    parser.add_argument("--train-rows", type=int, default=2000, help="training rows measured for the fit")
    parser.add_argument("--checkpoint", default=None, help="another critic on the same labels (default: the pav stage's)")
    parser.add_argument("--output", default=None, help="JSON file (default WORK_DIR/value_size.json)")
    parser.add_argument("--head-fits", action="store_true", help="also value heads fitted to convergence on the "
                        "critic's frozen backbone features (head_fits)")
    args = parser.parse_args(argv)
    from verl_prm.apps.arithmetic.pipeline import SCALES, scale_from_json

    work = Path(args.work_dir)
    scale_file = work / "scale.json"
    scale = scale_from_json(json.loads(scale_file.read_text())) if scale_file.exists() else SCALES["cpu"]
    k = args.best_of_k if args.best_of_k is not None else scale.rl.best_of_k
    if k < 1 or args.train_rows < 1:
        parser.error("--best-of-k and --train-rows must be >= 1")
    results = measure(work, best_of_k=k, train_rows=args.train_rows, checkpoint=args.checkpoint)
    if args.head_fits:
        results["head_fits"] = head_fits(work, best_of_k=k, checkpoint=args.checkpoint)
    output = Path(args.output) if args.output else work / "value_size.json"
    output.write_text(json.dumps(results, indent=2))
    print(size_table(results))
    print(f"written: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
