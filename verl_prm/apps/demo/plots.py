"""The demo's three plots (accuracy vs iterations, accuracy vs gamma, Pass@N) from its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from verl_prm.apps.demo.report import ACCURACY_WINDOW, PASS_AT_N_NS


def curve_label(name: str, learned_critic: bool) -> str:
    """Legend name of a method: with ``--learned-critic`` the "PAV" runs use the learned critic's values, and the
    label says so (the report's keys stay "PAV" and "PAV (exact values)")."""
    return "PAV (learned critic)" if learned_critic and name == "PAV" else name


def _seeds(count: int) -> str:
    return f"{count} seed" if count == 1 else f"{count} seeds"


def _legend_below(ax, handles=None, labels=None) -> None:
    """The legend under the axes, so that it never covers a curve or a point."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)


def write_plots(out: Path, report: dict[str, Any]) -> list[str]:
    """Write the demo's three PNGs into ``out``; returns their file names."""
    import matplotlib.pyplot as plt

    files = []
    for name, fig in demo_figures(report).items():
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(name)
    return files


def demo_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The demo's three figures by file name (matplotlib, Agg backend; the caller closes them).

    Lines are means over seeds; the shaded band around a line is the range (min to max) over the same seeds,
    and the legend says so. Legends sit under the axes, clear of every curve and point.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {}
    learned = bool(report["settings"].get("learned_critic"))
    colors = {"outcome-only": "tab:gray", "PAV": "tab:blue", "PAV (exact values)": "tab:green"}
    markers = {"base policy (iteration 0)": "s", "outcome-only": "o", "PAV": "D", "PAV (exact values)": "^"}
    # 1. accuracy vs iterations
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    for name, curves in report["curves"].items():
        smooth = np.array([np.convolve(c, np.ones(ACCURACY_WINDOW) / ACCURACY_WINDOW, mode="valid") for c in curves])
        x = np.arange(ACCURACY_WINDOW, ACCURACY_WINDOW + smooth.shape[1])
        label = curve_label(name, learned)
        ax.plot(x, smooth.mean(0), label=f"{label}: mean of {_seeds(len(curves))}", color=colors.get(name))
        if len(curves) > 1:
            ax.fill_between(x, smooth.min(0), smooth.max(0), alpha=0.2, color=colors.get(name),
                            label=f"{label}: min to max over seeds")
    ax.axhline(0.9, ls=":", color="k", lw=0.8)
    ax.set_xlabel("RL iteration (batch 64)")
    ax.set_ylabel(f"accuracy (mean of last {ACCURACY_WINDOW} batches)")
    ax.set_title(f"planted sub-sequence: outcome-only vs PAV (gamma={report['settings']['gamma']:g})")
    ax.set_ylim(-0.02, 1.02)
    _legend_below(ax)
    fig.tight_layout()
    figures["accuracy_vs_iterations.png"] = fig
    # 2. accuracy vs gamma
    sweep = report["sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    gammas = [row["gamma"] for row in sweep["rows"]]
    mean = [row["accuracy_mean"] for row in sweep["rows"]]
    low = [row["accuracy_min"] for row in sweep["rows"]]
    high = [row["accuracy_max"] for row in sweep["rows"]]
    sweep_seeds = len(sweep["rows"][0]["accuracy"]) if sweep["rows"] else 0
    label = curve_label("PAV", learned)
    ax.plot(gammas, mean, "o-", color="tab:blue", label=f"{label}: mean of {_seeds(sweep_seeds)}")
    if sweep_seeds > 1:
        ax.fill_between(gammas, low, high, alpha=0.2, color="tab:blue", label=f"{label}: min to max over seeds")
    ax.axhline(sweep["outcome_accuracy"], ls="--", color="tab:gray",
               label=f"outcome-only: mean of {_seeds(len(sweep['outcome_iterations_to_90']))}")
    ax.set_xscale("log")
    ax.set_xlabel("prover strength gamma (mu_gamma)")
    ax.set_ylabel(f"accuracy after {sweep['accuracy_at']} iterations")
    ax.set_ylim(-0.02, 1.02)
    ax2 = ax.twinx()
    ax2.plot(gammas, [row["mean_abs_progress_base"] for row in sweep["rows"]], "s:", color="tab:orange",
             label="mean |A^mu| on base-policy samples (right axis)")
    ax2.set_ylabel("mean |A^mu| (base policy)", color="tab:orange")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    _legend_below(ax, lines[0] + lines2[0], lines[1] + lines2[1])
    ax.set_title("prover sweep")
    fig.tight_layout()
    figures["accuracy_vs_gamma.png"] = fig
    # 3. Pass@N
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for name, values in report["pass_at_n"]["curves"].items():
        # hollow markers of distinct shapes keep curves that coincide (e.g. two converged PAV runs) visible
        ax.plot(PASS_AT_N_NS, values, "-", marker=markers.get(name, "o"), mfc="none", label=curve_label(name, learned),
                color=colors.get(name, "k"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N")
    ax.set_ylabel("Pass@N")
    ax.set_ylim(-0.02, 1.02)
    seeds = len(report["pass_at_n"]["base_successes"])
    ax.set_title(f"Pass@N after {report['pass_at_n']['iteration']} RL iterations (mean of {_seeds(seeds)})")
    _legend_below(ax)
    fig.tight_layout()
    figures["pass_at_n.png"] = fig
    return figures
