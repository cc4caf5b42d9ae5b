"""Training a PAV (process advantage verifier) on soft step labels, with accelerate.

One code path for CPU, one GPU and several GPUs (``accelerate launch`` -> DDP): the model and optimizer go
through ``accelerate.Accelerator``; every process draws the same global batch (a pure function of the step,
see :func:`~verl_prm.training.data.sample_batch_indices`) and trains on its slice of it.

Output directory::

    checkpoint-0000200/   model.safetensors + config.json + tokenizer files (loads with
                          ProverCritic.from_pretrained(path, format="value_head")) + training_state.pt
                          (optimizer, scheduler, step, config); the final one also calibration.json (the
                          map fitted on the held-out labels, --calibration; ProverCritic applies it)
    metrics.jsonl         one line per logged training step and per evaluation
    .verl-prm.lock        held by the one process training here (verl_prm.locking; released when it exits)
    eval_metrics.json     the final held-out evaluation (raw values, and calibrated: eval/calibrated_*)
    reliability.png       mean held-out label against mean value per bin, raw and calibrated

A checkpoint is written to a temporary directory and renamed when complete. A rerun with the same arguments
resumes from the newest intact checkpoint (a damaged newer one is skipped with a warning): the weights, Adam
moments and schedule are restored and the batches of the remaining steps (and their dropout masks) are the ones
the uninterrupted run draws, so no example is lost or trained on twice. A resume refuses changed settings and
changed inputs (label shards, --init, --tokenizer, --init-config: digests stored in the checkpoint). With
``--no-resume`` the checkpoints and logs of an earlier run move to ``earlier-run-<time>/``, so the checkpoints at
the top level are always this run's. A non-finite loss or gradient norm stops the run before the step changes
the weights, so no checkpoint ever holds NaN weights.

The phases: :mod:`~verl_prm.training.data` (the labels as examples), :mod:`~verl_prm.training.resume` (the output
directory: checkpoints, resume, the log), :mod:`~verl_prm.training.model`, :mod:`~verl_prm.training.optimisation`
(Adam steps or the Newton head fit), :mod:`~verl_prm.training.evaluation` (held-out metrics, the calibration).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from verl_prm.locking import DirectoryLock
from verl_prm.precision import mixed_precision_for
from verl_prm.special_tokens import ensure_pad_token, generation_config_of
from verl_prm.training.config import TrainConfig
from verl_prm.training.data import class_balanced_weights, read_examples
from verl_prm.training.evaluation import check_calibration_labels, evaluate_held_out, finish_run
from verl_prm.training.model import tokenizer_and_model
from verl_prm.training.optimisation import fit_head, make_optimizer, optimizer_step
from verl_prm.training.resume import input_digests, resume_point, save_checkpoint, set_aside_earlier_run, trim_log
from verl_prm.training.run import TrainingRun, log_record
from verl_prm.training.token_logprob import fit_token_logprob_critic

__all__ = ["train"]


def train(config: TrainConfig, *, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) a PAV; returns a summary with the final held-out metrics and checkpoint path.

    ``on_step(step, record)`` is called after every optimizer step (tests use it to simulate a crash).
    The output directory is locked against a second writer (:mod:`verl_prm.locking`) by the main process
    (``RANK`` 0 or unset under ``accelerate launch``/``torchrun``). ``config.format == "token_logprob"`` fits that
    critic instead (:func:`~verl_prm.training.token_logprob.fit_token_logprob_critic`; one process, no lock: its
    checkpoint directory is renamed into place whole).
    """
    if config.format == "token_logprob":
        return fit_token_logprob_critic(config)
    if os.environ.get("RANK", "0") != "0":
        return _train(config, on_step)
    with DirectoryLock(config.output_dir, "verl-prm train"):
        return _train(config, on_step)


def _train(config: TrainConfig, on_step: Callable[[int, dict], None] | None) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from tqdm.auto import tqdm

    device = "cpu" if config.cpu or not torch.cuda.is_available() else "cuda"
    # accelerate keeps one AcceleratorState per process and refuses a second Accelerator with another mixed
    # precision; train() may run several times in one process (a study training critic variants, the tests) with
    # different settings, so each run starts from a fresh one (the distributed state, PartialState, is kept).
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision=mixed_precision_for(config.mixed_precision, device), cpu=config.cpu)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    inputs = input_digests(config)
    if not config.resume and accelerator.is_main_process:
        set_aside_earlier_run(output_dir, accelerator.print)
    accelerator.wait_for_everyone()
    checkpoint, state = resume_point(config, output_dir, inputs, accelerator.print) if config.resume else (None, None)
    tokenizer, model = tokenizer_and_model(config, checkpoint, output_dir, accelerator.print)
    generation = generation_config_of(config.init) if checkpoint is None and config.init is not None else None
    pad_token_id = ensure_pad_token(tokenizer, generation, log=accelerator.print,
                                    source=f"verl-prm train: tokenizer {checkpoint or config.tokenizer or config.init}")
    train_examples, eval_examples = read_examples(config, tokenizer, accelerator.print)
    check_calibration_labels(config, eval_examples)
    weights = class_balanced_weights(train_examples) if config.balance else np.full(len(train_examples), 1.0 / len(train_examples))
    optimizer, scheduler = make_optimizer(config, model)
    # The scheduler is not prepared: accelerate would step it once per process; ours counts optimizer steps.
    model, optimizer = accelerator.prepare(model, optimizer)
    start_step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = int(state["step"])
    run = TrainingRun(config, accelerator, output_dir, model, tokenizer, pad_token_id, optimizer, scheduler, train_examples,
               eval_examples, weights, inputs)
    if accelerator.is_main_process:
        kept = trim_log(run.log_path, start_step, accelerator.print)
        run.logged_evals = {int(r["step"]) for r in kept if any(k.startswith("eval/") for k in r)}
        accelerator.print(
            f"verl-prm train: {len(train_examples)} train rollouts ({sum(len(e.targets) for e in train_examples)} "
            f"labels), {len(eval_examples)} held-out rollouts; steps {start_step} -> {config.max_steps}"
            + (f", resumed from {checkpoint}" if checkpoint is not None else "")
        )

    metrics: dict = {}
    last_checkpoint = checkpoint
    bar = tqdm(total=config.max_steps, initial=start_step, desc="training PAV", unit="step",
               disable=not (config.progress and accelerator.is_main_process) or config.head_fit == "newton")
    if config.head_fit == "newton" and start_step < config.max_steps:
        # one fit to the optimum; its checkpoint is the run's only one (a rerun finds it and skips the fit)
        record = fit_head(run)
        log_record(run, record)
        metrics = evaluate_held_out(run, config.max_steps)
        record.update(metrics)
        last_checkpoint = save_checkpoint(run, config.max_steps)
        if on_step is not None:
            on_step(config.max_steps, record)
    adam_steps = range(start_step, config.max_steps) if config.head_fit == "adam" else range(0)
    for step in adam_steps:
        record = optimizer_step(run, step, last_checkpoint)
        completed = step + 1
        if completed % config.log_every == 0 or completed == config.max_steps:
            log_record(run, record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if (config.eval_every and completed % config.eval_every == 0) or completed == config.max_steps:
            metrics = evaluate_held_out(run, completed)
            record.update(metrics)
        if (config.save_every and completed % config.save_every == 0) or completed == config.max_steps:
            last_checkpoint = save_checkpoint(run, completed)
        if on_step is not None:
            on_step(completed, record)
    bar.close()
    if start_step >= config.max_steps:
        metrics = evaluate_held_out(run, config.max_steps)
    calibration_path = finish_run(run, last_checkpoint, metrics) if accelerator.is_main_process else None
    accelerator.wait_for_everyone()
    return {"checkpoint": str(last_checkpoint) if last_checkpoint else None, "metrics": metrics,
            "calibration": str(calibration_path) if calibration_path else None,
            "train_rollouts": len(train_examples), "eval_rollouts": len(eval_examples), "start_step": start_step}
