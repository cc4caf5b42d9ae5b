"""The optimisation of a training run: AdamW with a warmup-cosine schedule and one optimizer step on this
process's slice of the global batch (``--head-fit adam``), or the value head set to the optimum of the training
loss on frozen features (``--head-fit newton``).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from verl_prm.training.config import TrainConfig
from verl_prm.training.data import collate, sample_batch_indices
from verl_prm.training.head_fit import fit_logistic_head
from verl_prm.training.losses import gather_step_logits, soft_label_bce, warmup_cosine_factor
from verl_prm.training.model import value_head_of
from verl_prm.training.run import TrainingRun

__all__ = ["NonFiniteLossError"]


class NonFiniteLossError(ValueError):
    """The training loss or gradient norm became NaN or infinite; the run stopped before that step."""


def make_optimizer(config: TrainConfig, model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: warmup_cosine_factor(t, config.warmup_steps, config.max_steps, config.min_lr_ratio)
    )
    return optimizer, scheduler


def optimizer_step(run: TrainingRun, step: int, last_checkpoint: Path | None) -> dict:
    """One optimizer step (step -> step + 1) on this process's slice of the global batch; its log record.

    Raises NonFiniteLossError before the weights change if the loss or the gradient norm is NaN or infinite.
    """
    config, accelerator, model = run.config, run.accelerator, run.model
    world, rank = accelerator.num_processes, accelerator.process_index
    # Dropout and any other randomness of a step is seeded by (seed, step, rank): a resumed run repeats
    # the uninterrupted run's step exactly without carrying RNG state through the checkpoint.
    torch.manual_seed((config.seed * 1_000_003 + step) * 4099 + rank)
    indices = sample_batch_indices(run.weights, config.batch_size * world * config.grad_accum, step, config.seed)
    losses = []
    for micro in range(config.grad_accum):
        begin = (micro * world + rank) * config.batch_size
        batch = collate([run.train_examples[i] for i in indices[begin : begin + config.batch_size]], run.pad_token_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        sync = accelerator.no_sync(model) if micro < config.grad_accum - 1 else contextlib.nullcontext()
        with sync:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = soft_label_bce(gather_step_logits(logits, batch["positions"]), batch["targets"], batch["step_mask"])
            accelerator.backward(loss / config.grad_accum)
        losses.append(loss.detach().float().item())
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.grad_clip) if config.grad_clip else None
    completed = step + 1
    bad = [f"loss {value}" for value in losses if not math.isfinite(value)]
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        bad.append(f"gradient norm {float(grad_norm)}")
    if bad:
        kept = (f"the last good checkpoint, {last_checkpoint}, is kept" if last_checkpoint is not None
                else "no checkpoint was written")
        raise NonFiniteLossError(
            f"step {completed}: {bad[0]} is not finite; training stopped before this step changed the weights and "
            f"{kept}. Check the --init weights for NaN/inf, or lower --lr (or use --mixed-precision no)")
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    record = {"step": completed, "loss": float(np.mean(losses)), "lr": run.scheduler.get_last_lr()[0]}
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    return record


@torch.no_grad()
def head_inputs(run: TrainingRun) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The value head's input at every labelled training step, with its target and its weight (the rollout's
    sampling weight, so that the full-batch loss is the expectation of the sampled batches' loss): [N, d], [N],
    [N]."""
    model = run.accelerator.unwrap_model(run.model)
    head = value_head_of(model)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    was_training = model.training
    model.eval()
    features, targets, weights = [], [], []
    size = run.config.eval_batch_size
    try:
        for begin in tqdm(range(0, len(run.train_examples), size), desc="head features", unit="batch",
                          disable=not (run.config.progress and run.accelerator.is_main_process)):
            examples = run.train_examples[begin: begin + size]
            batch = {k: v.to(run.accelerator.device) for k, v in collate(examples, run.pad_token_id).items()}
            captured.clear()
            # the class's forward, not the instance's: accelerate wraps the latter in bf16 autocast under mixed
            # precision, and the head is fitted to the float32 model's features (what the critic scores with)
            type(model).forward(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            if len(captured) != 1:
                raise RuntimeError(f"--head-fit newton: the value head of {type(model).__name__} was called "
                                   f"{len(captured)} times in one forward pass; fit it with --head-fit adam")
            hidden = captured[0]
            index = batch["positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            at_steps = torch.gather(hidden, 1, index)[batch["step_mask"]]
            features.append(at_steps.to("cpu", torch.float64))
            targets.append(batch["targets"][batch["step_mask"]].to("cpu", torch.float64))
            counts = batch["step_mask"].sum(1).cpu()
            weights.append(torch.repeat_interleave(torch.as_tensor(run.weights[begin: begin + size]), counts))
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(features), torch.cat(targets), torch.cat(weights).to(torch.float64)


def fit_head(run: TrainingRun) -> dict:
    """``--head-fit newton``: the value head set to the optimum of the training loss on the frozen features
    (:func:`~verl_prm.training.head_fit.fit_logistic_head`); its log record."""
    features, targets, weights = head_inputs(run)
    head = value_head_of(run.accelerator.unwrap_model(run.model))
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(f"--head-fit newton fits a linear one-logit head; {type(head).__name__} is not one: use "
                         "--head-fit adam")
    run.accelerator.print(f"verl-prm train: --head-fit newton on {features.shape[0]} labelled steps x "
                          f"{features.shape[1]} features ({features.numel() * 8 / 2**20:.0f} MiB)")
    fit = fit_logistic_head(features, targets, weights, max_iterations=run.config.max_steps,
                            fit_bias=head.bias is not None, l2=run.config.head_l2)
    with torch.no_grad():
        head.weight.copy_(fit.weight.to(head.weight.dtype).view_as(head.weight))
        if head.bias is not None:
            head.bias.fill_(fit.bias)
    if not fit.converged:
        run.accelerator.print(f"verl-prm train: --head-fit newton stopped after {fit.iterations} iterations "
                              f"(--max-steps) with gradient {fit.gradient_norm:.2e} (not yet at the optimum: "
                              "raise --max-steps; labels that features separate exactly have no finite optimum)")
    return {"step": run.config.max_steps, "loss": fit.loss, "head_fit": "newton", "head_fit_iterations": fit.iterations,
            "head_fit_gradient_norm": fit.gradient_norm, "head_fit_converged": fit.converged,
            "head_fit_labels": int(features.shape[0])}
