"""The learned critic's starting point: the SFT policy taught to recompute each written result where it is written.

Why. Whether a step is right is a comparison: the written result against the result of the operation. The SFT
policy computes that result (at ``=``, as its next-token prediction), but nothing in its features at the
written result's last token, where a value head reads a step's value, compares the two (a linear probe there
finds nothing: ``policy_signal`` in ``studies/arithmetic_critic.py``). A value head fine-tuned from the policy has
to build the comparison, and a comparison (written == computed) gives gradient descent no first-order signal to start from:
measured, 500-1,500 steps of value training on exact labels leave the critic ranking steps by position only.

What. The policy's backbone learns, at the last token of each written result, to predict the result the
operation gives (``task.apply_op`` of the written operand and operation: the check's missing half), with a linear
head over the residues, the loss taken only on results that slipped: there, copying the written digit (which the
token itself shows) is never right, so the backbone must compute. With ``check_weight > 0`` a second, logistic
head at the same tokens learns the check itself: is every result so far right. Data: the supervised solutions of
the recipe's ``data`` stage (their slips are the ones the policy learnt to make, and the data stage knows them).
The checkpoint is a causal LM in Hugging Face format (safetensors) with its tokenizer, plus both heads
(``critic_init_heads.safetensors``); the recipe's ``pav`` stage (``Scale.critic_init``) then trains only a value
head on it (``verl-prm train --freeze-backbone``) to the prover's Monte-Carlo labels.

Measured on the CPU scale (docs/arithmetic.md, 3,000 steps, ``check_weight=1``): the recomputed result's held-out
accuracy on slipped steps stays near chance for ~500 steps, then jumps (0.98 at 1,000, 1.00 from 1,500); the check's
held-out AUROC on SFT solutions rises 0.73 -> 0.999. The jump comes late and suddenly, so the schedule is long
and fixed.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence
from verl_prm.apps.arithmetic.task import apply_op
from verl_prm.apps.arithmetic.model import lr_factor, render

if TYPE_CHECKING:
    import torch

__all__ = ["CriticInitConfig", "ResultTargets", "critic_init_from_sft", "result_targets", "train_critic_init"]

# one operation line: written operand, operation, operand, "=", written result
_OPERATION = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)")


@dataclass(frozen=True)
class CriticInitConfig:
    steps: int = 3000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    # share of the solutions held out to measure the recomputed result's accuracy (by solution)
    eval_fraction: float = 0.05
    eval_every: int = 250
    seed: int = 0
    # weight of a second target at the same tokens: is every result so far right (a logistic head over the
    # backbone, all results; 0 = only the recomputation). It teaches the comparison and its running "all so far"
    # from the solutions' known slips, not from the prover's rollouts.
    check_weight: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "grad_clip", "eval_fraction", "check_weight"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CriticInitConfig.{name} must be finite and >= 0, got {value!r}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"CriticInitConfig.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.steps < 1 or self.batch_size < 1 or self.warmup_steps < 0 or self.eval_every < 1:
            raise ValueError("CriticInitConfig needs steps, batch_size, eval_every >= 1 and warmup_steps >= 0; got "
                             f"{self.steps}, {self.batch_size}, {self.eval_every}, {self.warmup_steps}")


@dataclass(frozen=True)
class ResultTargets:
    """One solution: token ids, and per operation line the token index of the written result's last token, the
    result the operation gives, whether the written result slipped (differs from it) and whether every result up
    to this one is right (none slipped, and each line's operand is the previous result)."""

    input_ids: list[int]
    positions: list[int]
    targets: list[int]
    slipped: list[bool]
    prefix_right: list[bool]


def result_targets(tokenizer, prompt_text: str, response: str, modulus: int) -> ResultTargets:
    """The recomputation targets of one rendered prompt + response (``prompt_text`` already rendered).

    Raises ``ValueError`` naming the line when an operation line's result does not end on a token boundary that
    the tokenizer maps (every written result must have a last token)."""
    encoded = tokenizer(prompt_text + response, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in encoded["offset_mapping"]]
    positions, targets, slipped, prefix_right = [], [], [], []
    previous = None
    for match in _OPERATION.finditer(response):
        end = len(prompt_text) + match.end(4)
        token = next((t for t, e in enumerate(ends) if e >= end), None)
        if token is None or ends[token] != end:
            raise ValueError(f"result {match.group(0)!r} of response {response!r} does not end on a token boundary")
        target = apply_op(int(match.group(1)), match.group(2), int(match.group(3)), modulus)
        positions.append(token)
        targets.append(target)
        slipped.append(int(match.group(4)) != target)
        copied = previous is None or int(match.group(1)) == previous
        prefix_right.append(copied and not slipped[-1] and (not prefix_right or prefix_right[-1]))
        previous = int(match.group(4))
    return ResultTargets(list(encoded["input_ids"]), positions, targets, slipped, prefix_right)


def _batch(examples: Sequence[ResultTargets], pad_token_id: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    import torch

    length = max(len(e.input_ids) for e in examples)
    steps = max(1, max(len(e.positions) for e in examples))
    out = {"input_ids": torch.full((len(examples), length), pad_token_id, dtype=torch.long),
           "attention_mask": torch.zeros((len(examples), length), dtype=torch.long),
           "positions": torch.zeros((len(examples), steps), dtype=torch.long),
           "targets": torch.zeros((len(examples), steps), dtype=torch.long),
           "slipped": torch.zeros((len(examples), steps), dtype=torch.bool),
           "prefix_right": torch.zeros((len(examples), steps)), "mask": torch.zeros((len(examples), steps))}
    for b, e in enumerate(examples):
        out["input_ids"][b, : len(e.input_ids)] = torch.tensor(e.input_ids)
        out["attention_mask"][b, : len(e.input_ids)] = 1
        n = len(e.positions)
        out["positions"][b, :n] = torch.tensor(e.positions, dtype=torch.long)
        out["targets"][b, :n] = torch.tensor(e.targets, dtype=torch.long)
        out["slipped"][b, :n] = torch.tensor(e.slipped, dtype=torch.bool)
        out["prefix_right"][b, :n] = torch.tensor(e.prefix_right, dtype=torch.float32)
        out["mask"][b, :n] = 1.0
    return {key: value.to(device) for key, value in out.items()}


def _result_logits(backbone, heads, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S, modulus + 1]: the recomputed result's logits and the prefix check's logit at each result."""
    import torch

    hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    index = batch["positions"][..., None].expand(-1, -1, hidden.shape[-1])
    at_results = torch.gather(hidden, 1, index)
    return torch.cat([head(at_results) for head in heads], dim=-1)


def _split_examples(examples: list, config: CriticInitConfig) -> tuple[list, list]:
    """(training, held-out) examples: ``config.eval_fraction`` held out after a seeded shuffle. The recomputation
    learns from slipped results only; the check also needs the solutions without a slip."""
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    held = max(1, int(round(config.eval_fraction * len(order))))
    use = (lambda e: True) if config.check_weight > 0 else (lambda e: any(e.slipped))
    eval_set = [examples[i] for i in order[:held] if use(examples[i])]
    train_set = [examples[i] for i in order[held:] if use(examples[i])]
    return train_set, eval_set


def _evaluate(backbone, head, eval_set: list, pad_token_id: int, modulus: int, device: str) -> dict:
    """Held-out accuracy of the recomputed result on slipped steps and the AUROC of the check."""
    import numpy as np
    import torch

    from verl_prm.training.metrics import auroc

    backbone.eval()
    right = total = 0
    checks, truth = [], []
    with torch.no_grad():
        for k in range(0, len(eval_set), 64):
            batch = _batch(eval_set[k:k + 64], pad_token_id, device)
            logits = _result_logits(backbone, head, batch)
            predicted = logits[..., :modulus].argmax(-1)
            right += int(((predicted == batch["targets"]) & batch["slipped"]).sum())
            total += int(batch["slipped"].sum())
            keep = batch["mask"].bool()
            checks += logits[..., modulus][keep].tolist()
            truth += batch["prefix_right"][keep].tolist()
    backbone.train()
    return {"eval/slipped_accuracy": right / total, "eval/check_auroc": auroc(np.array(checks), np.array(truth))}


def _save(output_dir: Path, model, tokenizer, head, curve: list[dict]) -> None:
    """The backbone as a causal LM with its tokenizer, the heads (result over the residues, then the check, for
    studies that read them directly) and the curve."""
    from verl_prm.checkpoints import save_model, save_tensors

    output_dir.mkdir(parents=True, exist_ok=True)
    save_model(model.to("cpu"), tokenizer, output_dir)
    save_tensors({f"heads.{k}": v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
                 output_dir / "critic_init_heads.safetensors")
    (output_dir / "critic_init_metrics.json").write_text(json.dumps(curve, indent=2))


_STATE = "critic_init_state.pt"


def _resume_settings(policy: str | Path, examples: Sequence[ResultTargets], config: CriticInitConfig) -> dict:
    """What a resumed training must share with the interrupted one: the settings, the examples (sha256) and the
    starting weights (``checkpoints.weights_digest``)."""
    import hashlib

    from verl_prm.checkpoints import weights_digest

    examples_digest = hashlib.sha256(json.dumps([asdict(e) for e in examples]).encode()).hexdigest()
    return {**asdict(config), "examples": examples_digest, "policy_weights": weights_digest(policy)}


def train_critic_init(policy: str | Path, output_dir: str | Path, prompts: Sequence[str], responses: Sequence[str],
                      modulus: int, config: CriticInitConfig, *, device: str = "cpu", progress: bool = True,
                      log: Callable[[dict], None] | None = None) -> dict:
    """Train the backbone of the causal LM at ``policy`` to recompute every slipped result at its last token (see
    the module docstring) and save it as a causal LM with its tokenizer under ``output_dir``. ``prompts`` are
    raw problem texts (rendered with the policy's chat template here). Returns the final held-out accuracy of
    the recomputed result on slipped steps (``eval/slipped_accuracy``), the curve and the training seconds.

    Resumable: at every evaluation the training state (weights, heads, optimizer, sampler, curve) is saved to
    ``output_dir/critic_init_state.pt``; a rerun with the same settings, examples and starting weights continues
    from it (the result equals an uninterrupted run's), any other is an error naming the file. The state file is
    removed once the checkpoint is saved."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(prompts) != len(responses):
        raise ValueError(f"train_critic_init: {len(prompts)} prompts but {len(responses)} responses")
    tokenizer = AutoTokenizer.from_pretrained(str(policy), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(policy), trust_remote_code=False)
    examples = [result_targets(tokenizer, render(tokenizer, p), r, modulus) for p, r in zip(prompts, responses)]
    train_set, eval_set = _split_examples(examples, config)
    if not any(any(e.slipped) for e in train_set) or not any(any(e.slipped) for e in eval_set):
        raise ValueError("train_critic_init: no solution with a slipped result to learn from (the data stage's "
                         "slip_rate / step_slip_rate must be > 0)")
    settings = _resume_settings(policy, examples, config)
    torch.manual_seed(config.seed)
    model.to(device)
    backbone = model.get_decoder()
    # the result head first: the check head's draw comes after it, so check_weight=0 trains what it always did
    head = torch.nn.ModuleList([torch.nn.Linear(model.config.hidden_size, modulus),
                                torch.nn.Linear(model.config.hidden_size, 1)]).to(device)
    parameters = list(backbone.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=0.0)
    rng = random.Random(config.seed + 1)

    output_dir = Path(output_dir)
    state_path = output_dir / _STATE
    curve, start, seconds_before = [], 0, 0.0
    if state_path.exists():
        from verl_prm.resume import check_same_settings

        state = torch.load(state_path, map_location=device, weights_only=True)
        check_same_settings(state["settings"], settings, source=state_path, what="a critic_init training state",
                            fix="delete it to start over")
        model.load_state_dict(state["model"])
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        curve, start, seconds_before = state["curve"], state["step"], state["seconds"]
    started = time.perf_counter()
    backbone.train()
    bar = tqdm(range(start, config.steps), desc="critic init", unit="step", disable=not progress,
               initial=start, total=config.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = config.lr * lr_factor(step, config.warmup_steps, config.steps, 0.0)
        batch = _batch(rng.sample(train_set, min(config.batch_size, len(train_set))), tokenizer.pad_token_id, device)
        logits = _result_logits(backbone, head, batch)
        mask = batch["slipped"].float()
        per_step = F.cross_entropy(logits[..., :modulus].flatten(0, 1), batch["targets"].flatten(), reduction="none")
        loss = (per_step * mask.flatten()).sum() / mask.sum().clamp_min(1.0)
        if config.check_weight > 0:
            check = F.binary_cross_entropy_with_logits(logits[..., modulus], batch["prefix_right"], reduction="none")
            loss = loss + config.check_weight * (check * batch["mask"]).sum() / batch["mask"].sum().clamp_min(1.0)
        optimizer.zero_grad()
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
        optimizer.step()
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            record = {"step": step + 1, "loss": loss.item(),
                      **_evaluate(backbone, head, eval_set, tokenizer.pad_token_id, modulus, device)}
            curve.append(record)
            bar.set_postfix(accuracy=f"{record['eval/slipped_accuracy']:.3f}")
            output_dir.mkdir(parents=True, exist_ok=True)
            version, internal, gauss = rng.getstate()
            state = {"settings": settings, "step": step + 1, "curve": curve,
                     "seconds": seconds_before + time.perf_counter() - started, "model": model.state_dict(),
                     "head": head.state_dict(), "optimizer": optimizer.state_dict(),
                     "rng": [version, list(internal), gauss]}
            torch.save(state, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").replace(state_path)
            if log is not None:
                log(record)
    _save(output_dir, model, tokenizer, head, curve)
    state_path.unlink(missing_ok=True)
    return {"eval/slipped_accuracy": curve[-1]["eval/slipped_accuracy"], "eval/check_auroc": curve[-1]["eval/check_auroc"],
            "curve": curve, "seconds": round(seconds_before + time.perf_counter() - started, 1),
            "train_solutions": len(train_set), "eval_solutions": len(eval_set)}


def critic_init_from_sft(output_dir: Path, policy: Path, data_dir: Path, modulus: int, config: CriticInitConfig, *,
                         device: str = "cpu", progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """``train_critic_init`` on the SFT solutions of the recipe's data stage (``data_dir/sft.jsonl``), once:
    ``critic_init_summary.json`` (the result, its seconds and config) marks it complete and is returned on a rerun;
    one trained with another config is an error naming both."""
    summary_path = Path(output_dir) / "critic_init_summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if summary.get("config") != asdict(config):
            raise ValueError(f"{output_dir} was trained with other critic_init settings ({summary.get('config')} vs "
                             f"{asdict(config)}); delete it or use the same settings")
        return summary
    rows = [json.loads(line) for line in (Path(data_dir) / "sft.jsonl").read_text().splitlines()]
    result = train_critic_init(policy, output_dir, [r["prompt"] for r in rows], [r["response"] for r in rows], modulus,
                               config, device=device, progress=progress,
                               log=lambda record: log(f"critic_init {json.dumps(record)}"))
    result["config"] = asdict(config)
    summary_path.write_text(json.dumps(result, indent=2))
    return result
