"""How good can the learned PAV get? Variants of the recipe's critic, each measured the same way.

The recipe's learned PAV (the ``pav`` stage) is a value head trained by ``verl-prm train`` on Monte-Carlo labels
of ``verl-prm label``: on the CPU and GPU scales only the head, on the policy first taught to check each written
result (``Scale.critic_init``); the PAV paper fine-tunes the whole policy instead (``mc`` below). This study trains
variants on the same labelled rollouts and measures
each on base-policy samples of the held-out test problems: the step AUROC of its raw value against the truth of
the prefix (every line right so far, ``task.prefix_is_correct``), and the mean value drop at the first wrong step.

Variants (``--variants``, comma-separated):

- ``mc``: the PAV paper's critic: the value head on the SFT policy, the whole model fine-tuned on the
  Monte-Carlo labels (``FINETUNE_LR``);
- ``mc_long``: the same labels, ``--long-steps`` optimisation steps (default 4x the recipe's);
- ``exact``: the same rollouts and step ends, labelled with the exact prover's values instead of Monte-Carlo
  estimates (``prover.ArithmeticProver`` with the SFT policy's per-step accuracy): the labels' noise removed,
  an upper bound for more Monte-Carlo continuations;
- ``exact_long``: exact labels and the long schedule;
- ``exact_sft``: exact labels of many more texts for free: the 20,000 supervised solutions of the ``data`` stage
  (their slips have the policy's distribution; values by the exact prover), the recipe's schedule;
- ``mc_init``, ``exact_sft_init``: ``mc`` (retrained) and ``exact_sft`` with the value head on the SFT policy after
  ``critic_init`` (trained once into ``critic_study/critic_init/``: the policy taught to recompute each written
  result at its last token, so that the check's missing half is a feature where the value head reads).

- ``mc_check``: ``mc`` on ``critic_init`` with its second target (``check_weight=1``: is every result so far right,
  learnt from the SFT solutions' known slips): how good the PAV gets when the backbone has been taught the check
  itself and is then fine-tuned whole. The backbone is the recipe's (``pav/backbone/``) when its scale has a
  ``critic_init`` with the check, else trained once into ``critic_study/critic_check/``.
- ``check_frozen``: the recipe's PAV on the CPU scale (its ``pav`` stage, not retrained; the scale must have a
  ``critic_init``): the same labels and backbone as ``mc_check``, but only the value head is trained (``verl-prm
  train --freeze-backbone``): a linear read-out of the taught check, which the Monte-Carlo labels then scale into
  the prover's values instead of overwriting.
- ``check_head``: no value training: the ``critic_check`` init's own check head (is every result so far right)
  read as the value head (``check_head_checkpoint``). It estimates the correctness of a prefix, not the prover's
  value; the upper bound of what ``check_frozen`` can read out.

Every other variant puts the value head on the SFT policy and fine-tunes the whole model, as the PAV paper does.

Where the signal is (``policy_signal``, measured on the same samples): whether a step is right is a comparison of
the written result with the result the operation gives. The SFT policy computes that result (its next-token
distribution at ``=`` puts most mass on it), so the policy's own log-probability of each written result, as a
running minimum over the steps so far, is a zero-training check of the prefix. A linear probe of the policy's
last hidden state at the first step's end (where the value head reads) measures whether the comparison is
already a feature there; a value head fine-tuned from the policy has to learn it otherwise, and a comparison
(written digit == computed digit) gives the gradient no first-order signal to start from.

    python -m studies.arithmetic_critic --work-dir runs/arith/mod7 --variants mc,mc_long,exact
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

__all__ = ["VARIANTS", "exact_label_rows", "policy_signal", "running_min", "run_study"]

VARIANTS = ("mc", "mc_long", "exact", "exact_long", "exact_sft", "mc_init", "exact_sft_init", "mc_check",
            "check_frozen", "check_head")
# the learning rate of the variants that fine-tune the whole model (the recipe's PAV before it froze the backbone)
FINETUNE_LR = 2e-4


def exact_label_rows(frame, step_accuracy: float) -> list[dict]:
    """Label rows (``verl_prm.labeling.format``) with ``q`` and the prompt value replaced by the exact prover's
    values of the same prefixes; ``n_success = n_mc = 0`` marks values that are not Monte-Carlo counts, and
    ``first_pit`` is the first step whose value is 0 after a positive one."""
    from verl_prm.apps.arithmetic.prover import ArithmeticProver

    prover = ArithmeticProver(step_accuracy=step_accuracy)
    rows = []
    for i, row in enumerate(frame.to_dict("records")):
        starts, ends = [int(x) for x in row["step_starts"]], [int(x) for x in row["step_ends"]]
        response = str(row["response"])
        steps = [response[(0 if h == 0 else ends[h - 1]):end] for h, end in enumerate(ends)]
        values = prover.values(str(row["prompt"]), steps, i, complete=bool(row["finished"]))
        first_pit = next((h for h in range(len(steps)) if values[h + 1] == 0.0 and values[h] > 0.0), -1)
        rows.append({**row, "step_starts": starts, "step_ends": ends, "q": [float(v) for v in values[1:]],
                     "n_success": [0] * len(steps), "n_mc": [0] * len(steps), "first_pit": first_pit,
                     "prompt_value": float(values[0]), "prompt_n_success": 0, "prompt_n_mc": 0,
                     "strategy": "exact", "source": f"exact prover (step_accuracy={step_accuracy:.6f})"})
    return rows


def running_min(step_scores: Sequence[float]) -> list[float]:
    """Prefix score of every step: ``m_h = min_{k <= h} s_k`` (a prefix is as right as its least likely step)."""
    out, low = [], math.inf
    for score in step_scores:
        low = min(low, float(score))
        out.append(low)
    return out


def policy_signal(model, tokenizer, prompt_texts: Sequence[str], problems, *, samples: int, max_new_tokens: int,
                  seed: int) -> dict:
    """How much of the prefix check the SFT policy already holds, on base-policy samples of ``problems`` (the
    samples of ``evaluate.critic_step_auroc`` with the same seed):

    - ``policy_logprob_step_auroc``: AUROC of ``running_min`` of the policy's mean log-probability of each
      operation step's written result tokens against the truth of the prefix (operation lines, each sample up to
      its first line without a result; the answer line repeats the last result);
    - ``probe_first_step_auroc``: a logistic-regression probe of the policy's last hidden state at the first
      step's last token (the value head's input), fit on the first half of the samples, AUROC on the second half,
      against whether the first step is right;
    - ``policy_logprob_first_step_auroc``: the policy's log-probability of the first result on the same half.
    """
    import re

    import numpy as np
    import torch

    from verl_prm.apps.arithmetic.rollout import sample
    from verl_prm.apps.arithmetic.task import prefix_correctness
    from verl_prm.training.metrics import auroc

    rollouts = sample(model, tokenizer, prompt_texts, samples, max_new_tokens=max_new_tokens, seed=seed)
    scores, labels, first = [], [], []  # first: (hidden state, log-prob, right) of each sample's first step
    for text, index in zip(rollouts.texts, rollouts.prompt_index):
        prompt = prompt_texts[index]
        encoded = tokenizer(prompt + text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.array(encoded["offset_mapping"])
        ids = torch.tensor([encoded["input_ids"]])
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        truth = prefix_correctness(problems[index], text)
        # the lines of task.prefix_correctness (non-empty ones), each scored up to the first without a result
        lines = [m for m in re.finditer(r"[^\n]+", text) if m.group().strip()]
        step_scores = []
        for h, line in enumerate(lines[: len(problems[index].ops)]):
            match = re.search(r"=(\d+)", line.group())
            if match is None:
                break
            lo, hi = len(prompt) + line.start() + match.start(1), len(prompt) + line.start() + match.end(1)
            tokens = [t for t in range(1, len(offsets)) if offsets[t][0] < hi and offsets[t][1] > lo]
            step_scores.append(float(np.mean([float(logp[t - 1, ids[0, t]]) for t in tokens])))
            if h == 0:
                first.append((out.hidden_states[-1][0, tokens[-1]].float().numpy(), step_scores[0], truth[0]))
        scores += running_min(step_scores)
        labels += truth[: len(step_scores)]
    result = {"policy_logprob_step_auroc": auroc(np.array(scores), np.array(labels)),
              "policy_logprob_steps": len(scores)}
    half = len(first) // 2
    x = torch.tensor(np.stack([f[0] for f in first]))
    y = torch.tensor([float(f[2]) for f in first])
    mean, std = x[:half].mean(0), x[:half].std(0) + 1e-5
    x = (x - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(500):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x[:half] @ w + b, y[:half]) + 1e-3 * (w ** 2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        probe = (x[half:] @ w + b).numpy()
    result["probe_first_step_auroc"] = auroc(probe, y[half:].numpy())
    result["policy_logprob_first_step_auroc"] = auroc(np.array([f[1] for f in first[half:]]), y[half:].numpy())
    result["first_steps"] = len(first)
    return result


def sft_label_rows(data_dir: Path, tokenizer, step_accuracy: float) -> list[dict]:
    """Label rows of the supervised solutions (``sft.jsonl``): the rendered prompt, the solution, its steps
    (``task.STEP_REGEX``: a step ends after each result, the rest is the answer step) and exact values."""
    import re

    import pandas as pd

    from verl_prm.apps.arithmetic.model import render
    from verl_prm.apps.arithmetic.task import DATA_SOURCE, STEP_REGEX

    rows = []
    for i, line in enumerate(open(data_dir / "sft.jsonl")):
        record = json.loads(line)
        response = record["response"]
        ends = [m.end() for m in re.finditer(STEP_REGEX, response)] + [len(response)]
        rows.append({"prompt_index": i, "rollout_index": 0, "data_source": DATA_SOURCE,
                     "prompt": render(tokenizer, record["prompt"]), "ground_truth": "", "response": response,
                     "step_starts": [0] + ends[:-1], "step_ends": ends, "q": [0.0] * len(ends),
                     "n_success": [0] * len(ends), "n_mc": [0] * len(ends), "first_pit": -1, "prompt_value": 0.0,
                     "prompt_n_success": 0, "prompt_n_mc": 0, "outcome": float(record["slip_step"] < 0),
                     "score": float(record["slip_step"] < 0), "finished": True, "strategy": "sft", "source": "sft.jsonl"})
    return exact_label_rows(pd.DataFrame(rows), step_accuracy)


def _train(labels: Path, policy: Path, output: Path, scale, steps: int, progress: bool) -> Path:
    """A value head on ``policy``, the whole model fine-tuned on ``labels`` at ``FINETUNE_LR`` (once: a finished
    training in ``output`` is kept); its checkpoint."""
    from verl_prm.apps.arithmetic.pipeline import train_pav
    from verl_prm.training.resume import latest_checkpoint

    if not (output / "eval_metrics.json").exists():
        train_pav(labels, policy, output, steps=steps, batch_size=scale.pav_batch_size, lr=FINETUNE_LR,
                  warmup_steps=scale.pav_warmup, max_length=scale.model.max_position_embeddings, log_every=50,
                  cpu=True, progress=progress)
    return latest_checkpoint(output)


def check_head_checkpoint(init: Path, output: Path) -> Path:
    """A value-head checkpoint (``ProverCritic`` format ``value_head``) whose head is the check head of the
    ``critic_init`` model at ``init`` (``critic_init_heads.safetensors``, trained with ``check_weight > 0``): its
    value is sigmoid(check logit), the estimated probability that every result so far is right."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from verl_prm.training.model import value_head_from_init, value_head_of

    heads_path = init / "critic_init_heads.safetensors"
    if not heads_path.exists():
        raise FileNotFoundError(f"{heads_path}: no heads saved with this critic_init model; retrain it (delete {init})")
    heads = load_file(str(heads_path))
    model = value_head_from_init(str(init))
    value_head = value_head_of(model)
    if value_head.weight.shape != heads["heads.1.weight"].shape:
        raise ValueError(f"{init}: check head {tuple(heads['heads.1.weight'].shape)} does not fit the value head "
                         f"{tuple(value_head.weight.shape)}")
    with torch.no_grad():
        value_head.weight.copy_(heads["heads.1.weight"])
        value_head.bias.copy_(heads["heads.1.bias"])
    model.save_pretrained(str(output), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(init), trust_remote_code=False).save_pretrained(str(output))
    return output


def _critic_init(output: Path, policy: Path, data_dir: Path, scale, config, progress: bool, log) -> Path:
    """The ``critic_init`` model of the study (trained once, ``critic_init.critic_init_from_sft``)."""
    from verl_prm.apps.arithmetic.critic_init import critic_init_from_sft

    trained = not (output / "critic_init_summary.json").exists()
    result = critic_init_from_sft(output, policy, data_dir, scale.task.modulus, config, device=scale.device,
                                  progress=progress, log=lambda line: None)
    if trained:
        log(f"[critic study] critic_init: recomputed-result accuracy on held-out slipped steps "
            f"{result['eval/slipped_accuracy']:.3f} ({config.steps} steps, {result['seconds']} s)")
    return output


def run_study(scale, work_dir: Path, variants: Sequence[str], *, long_steps: int | None = None,
              init_config=None, progress: bool = True, log=print) -> list[dict]:
    """Train and measure every variant; writes ``critic_study/study.json`` and ``study.md`` under ``work_dir``
    (a finished recipe run's directory: policy, prover, labels and pav stages)."""
    import torch

    from verl_prm.locking import DirectoryLock
    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig
    from verl_prm.apps.arithmetic.pipeline import stages_of

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown critic variants {unknown}; choose from {VARIANTS}")
    stages = stages_of(scale, work_dir)
    for name in ("sft", "prover", "label", "pav"):
        if not stages[name].done():
            raise FileNotFoundError(f"{stages[name].path}: the recipe's {name} stage is not complete; run the recipe "
                                    f"up to it first (--stages data,sft,prover,label,pav)")
    out_dir = work_dir / "critic_study"
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(scale.threads)
    try:
        with DirectoryLock(out_dir, "arithmetic critic study"):
            study = _Study(scale, stages, out_dir, long_steps or 4 * scale.pav_steps,
                           init_config or CriticInitConfig(), progress, log)
            study.write_labels(variants)
            signal = study.policy_signal()
            rows = [study.variant_row(variant) for variant in variants]
    finally:
        torch.set_num_threads(threads)
    (out_dir / "study.json").write_text(json.dumps(rows, indent=2))
    table = study_table(rows, signal)
    (out_dir / "study.md").write_text(table + "\n")
    log(table)
    return rows


class _Study:
    """The study of one recipe run: its stages, the study's directory and the pieces every variant shares (the
    SFT policy, its tokenizer and the held-out test problems, loaded once)."""

    def __init__(self, scale, stages: dict, out_dir: Path, long_steps: int, init_config, progress: bool, log) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl_prm.apps.arithmetic.model import render
        from verl_prm.apps.arithmetic.pipeline import split_problems

        self.scale, self.stages, self.out_dir = scale, stages, out_dir
        self.long_steps, self.init_config, self.progress, self.log = long_steps, init_config, progress, log
        self.policy, self.labels = stages["sft"].path, stages["label"].path
        self.step_accuracy = float(stages["prover"].outputs()["step_accuracy"])
        self.exact_labels, self.sft_labels = out_dir / "exact_labels", out_dir / "exact_sft_labels"
        # the backbone taught the check: the recipe's (pav/backbone) when its scale trains one, else the study's
        self.recipe_checks = scale.critic_init is not None and scale.critic_init.check_weight > 0
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.policy), trust_remote_code=False)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.policy), trust_remote_code=False).eval()
        self.test = split_problems(scale)[3]
        self.test_texts = [render(self.tokenizer, p.prompt_text) for p in self.test]

    def write_labels(self, variants: Sequence[str]) -> None:
        """The exact labels the requested variants train on (once)."""
        from verl_prm.labeling.format import read_labels
        from verl_prm.labeling.store import ShardStore

        if any(v in ("exact", "exact_long") for v in variants) and not any(self.exact_labels.glob("shard-*.parquet")):
            ShardStore(self.exact_labels).write_shard(exact_label_rows(read_labels(self.labels), self.step_accuracy))
        if any(v.startswith("exact_sft") for v in variants) and not any(self.sft_labels.glob("shard-*.parquet")):
            ShardStore(self.sft_labels).write_shard(sft_label_rows(self.stages["data"].path, self.tokenizer,
                                                                   self.step_accuracy))

    def policy_signal(self) -> dict:
        """``policy_signal`` on the test problems (measured once, ``policy_signal.json``)."""
        signal_path = self.out_dir / "policy_signal.json"
        if not signal_path.exists():
            signal = policy_signal(self.model, self.tokenizer, self.test_texts, self.test, samples=1,
                                   max_new_tokens=self.scale.max_new_tokens, seed=12346)
            signal_path.write_text(json.dumps(signal, indent=2))
        return json.loads(signal_path.read_text())

    def check_init(self) -> Path:
        if self.recipe_checks:
            return self.stages["pav"].path / "backbone"
        return _critic_init(self.out_dir / "critic_check", self.policy, self.stages["data"].path, self.scale,
                            replace(self.init_config, check_weight=1.0), self.progress, self.log)

    def trained(self, variant: str) -> tuple[Path, int, Path]:
        """The variant's critic: (its checkpoint, its training steps, the directory of its eval_metrics.json)."""
        scale = self.scale
        if variant == "check_frozen":
            if not self.recipe_checks:
                raise ValueError("check_frozen is the recipe's PAV of a scale with a critic_init (check_weight "
                                 "> 0); this scale's PAV fine-tunes the policy (variant mc)")
            return Path(self.stages["pav"].outputs()["checkpoint"]), scale.pav_steps, self.stages["pav"].path
        train_dir = self.out_dir / variant
        if variant == "check_head":
            return check_head_checkpoint(self.check_init(), train_dir), 0, train_dir
        steps = self.long_steps if variant.endswith("_long") else scale.pav_steps
        source = (self.sft_labels if variant.startswith("exact_sft") else
                  self.exact_labels if variant.startswith("exact") else self.labels)
        if variant == "mc_check":
            init = self.check_init()
        elif variant.endswith("_init"):
            init = _critic_init(self.out_dir / "critic_init", self.policy, self.stages["data"].path, scale,
                                self.init_config, self.progress, self.log)
        else:
            init = self.policy
        return _train(source, init, train_dir, scale, steps, self.progress), steps, train_dir

    def variant_row(self, variant: str) -> dict:
        """The variant trained (once) and measured: its row of the study (``VARIANT.json``)."""
        from verl_prm.critic import ProverCritic
        from verl_prm.apps.arithmetic.evaluate import critic_step_auroc

        result_path = self.out_dir / f"{variant}.json"
        if result_path.exists():
            return json.loads(result_path.read_text())
        started = time.perf_counter()
        checkpoint, steps, train_dir = self.trained(variant)
        seconds = time.perf_counter() - started
        if variant == "check_frozen":  # trained by the recipe's pav stage, critic_init included
            seconds = json.loads(self.stages["pav"].marker.read_text())["seconds"] + float(
                json.loads((self.check_init() / "critic_init_summary.json").read_text())["seconds"])
        critic = ProverCritic.from_pretrained(str(checkpoint), format="value_head", device="cpu")
        measured = critic_step_auroc(critic, self.tokenizer, self.model, self.test_texts, self.test, samples=1,
                                     max_new_tokens=self.scale.max_new_tokens, seed=12346)
        metrics_path = train_dir / "eval_metrics.json"
        held_out = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        row = {"variant": variant, "labels": variant_labels(variant), "init": variant_init(variant),
               "train_steps": steps, "train_seconds": round(seconds, 1), "checkpoint": str(checkpoint),
               "label_auroc": held_out.get("eval/auroc", math.nan), "label_mse": held_out.get("eval/mse", math.nan),
               **measured}
        result_path.write_text(json.dumps(row, indent=2))
        self.log(f"[critic study] {variant}: step AUROC {row['step_auroc']:.3f}, label AUROC "
                 f"{row['label_auroc']:.3f} ({steps} steps)")
        return row


def variant_labels(variant: str) -> str:
    """What the variant's value head is trained on (the study table's "labels" column)."""
    if variant.startswith("exact_sft"):
        return "exact, SFT solutions"
    if variant.startswith("exact"):
        return "exact"
    return "none (SFT solutions' slips, in critic_init)" if variant == "check_head" else "monte_carlo"


def variant_init(variant: str) -> str:
    """The model under the variant's value head (the study table's "value head on" column)."""
    return {"mc_check": "critic_init, check_weight 1", "check_frozen": "critic_init, check_weight 1, frozen",
            "check_head": "critic_init's check head"}.get(variant, "critic_init" if variant.endswith("_init") else "policy")


def study_table(rows: Sequence[dict], signal: dict) -> str:
    """``study.md``: a row per variant, then the policy's own signal."""
    lines = ["| variant | labels | value head on | training steps | step AUROC vs true prefix correctness | "
             "held-out label AUROC | mean value drop at the first wrong step | training time (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['labels']} | {r.get('init', 'policy')} | {r['train_steps']} | "
                     f"{r['step_auroc']:.3f} | {r['label_auroc']:.3f} | {r['mean_value_drop_at_first_wrong_step']:.3f} | "
                     f"{r['train_seconds']} |")
    lines += ["", f"Where the signal is (the same samples, no training): the SFT policy's own log-probability of each "
              f"written result, running minimum over the steps: step AUROC {signal['policy_logprob_step_auroc']:.3f}; "
              f"first step only: {signal['policy_logprob_first_step_auroc']:.3f}; a linear probe of its last hidden "
              f"state at the first step's end (the value head's input): {signal['probe_first_step_auroc']:.3f}."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig
    from verl_prm.apps.arithmetic.pipeline import SCALES

    parser = argparse.ArgumentParser(prog="python -m studies.arithmetic_critic",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True, help="a recipe run's directory (stages up to pav complete)")
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--long-steps", type=int, default=None)
    parser.add_argument("--init-steps", type=int, default=3000, help="critic_init optimisation steps (the *_init variants)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    run_study(SCALES[args.scale], Path(args.work_dir), [v.strip() for v in args.variants.split(",")],
              long_steps=args.long_steps, progress=not args.no_progress,
              init_config=CriticInitConfig(steps=args.init_steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
