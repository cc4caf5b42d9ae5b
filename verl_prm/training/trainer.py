"""Training a PAV (process advantage verifier) on soft step labels, with accelerate.

One code path for CPU, one GPU and several GPUs (``accelerate launch`` -> DDP): the model and optimizer go
through ``accelerate.Accelerator``; every process draws the same global batch (a pure function of the step,
see :func:`~verl_prm.training.data.sample_batch_indices`) and trains on its slice of it.

Output directory::

    checkpoint-0000200/   model.safetensors + config.json + tokenizer files (loads with
                          ProverCritic.from_pretrained(path, format="value_head")) + training_state.pt
                          (optimizer, scheduler, step, config)
    metrics.jsonl         one line per logged training step and per evaluation
    .verl-prm.lock        held by the one process training here (verl_prm.locking; released when it exits)
    eval_metrics.json     the final held-out evaluation

A checkpoint is written to a temporary directory and renamed when complete. A rerun with the same arguments
resumes from the newest checkpoint: the weights, Adam moments and schedule are restored and the batches of the
remaining steps (and their dropout masks) are the ones the uninterrupted run draws, so no example is lost or
trained on twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from verl_prm.training.data import (
    EncodedRollout,
    class_balanced_weights,
    collate,
    encode_labels,
    sample_batch_indices,
    split_by_prompt,
)
from verl_prm.training.losses import gather_step_logits, soft_label_bce, warmup_cosine_factor
from verl_prm.training.metrics import value_metrics

__all__ = ["TrainConfig", "train", "evaluate_examples", "latest_checkpoint", "build_model"]

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# Settings that define the data, the batches and the schedule: a resumed run must keep them.
_RESUME_KEYS = ("labels", "eval_labels", "eval_fraction", "batch_size", "grad_accum", "max_steps", "lr", "min_lr_ratio",
                "warmup_steps", "weight_decay", "balance", "best_of_k", "use_prompt_value", "freeze_backbone", "max_length",
                "seed")


@dataclass
class TrainConfig:
    labels: list[str]
    output_dir: str
    init: str | None = None
    init_config: str | None = None
    tokenizer: str | None = None
    eval_labels: list[str] | None = None
    eval_fraction: float = 0.1
    max_length: int | None = 4096
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-5
    min_lr_ratio: float = 0.0
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    balance: bool = True
    best_of_k: int = 1
    use_prompt_value: bool = True
    # train only the value head; the backbone keeps the --init weights
    freeze_backbone: bool = False
    eval_every: int = 0
    eval_batch_size: int = 16
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = True
    seed: int = 0
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    cpu: bool = False
    log_every: int = 10
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.init is None) == (self.init_config is None):
            raise ValueError("give exactly one of init (a checkpoint) and init_config (a config for a new model)")
        if self.init_config is not None and self.tokenizer is None:
            raise ValueError("a model built from init_config needs a tokenizer path (--tokenizer)")
        if self.max_steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("max_steps, batch_size and grad_accum must be >= 1")
        if isinstance(self.keep_checkpoints, bool) or int(self.keep_checkpoints) != self.keep_checkpoints \
                or self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints (--keep-checkpoints) must be an integer >= 1, got "
                             f"{self.keep_checkpoints!r}: the newest checkpoint is the model the run produces and is "
                             "always kept; 1 keeps only it")


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir`` (None if there is none)."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        match = _CHECKPOINT.fullmatch(path.name)
        if match and (path / "training_state.pt").is_file():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def build_model(config: TrainConfig, tokenizer, checkpoint: Path | None = None):
    """A token-classification model with one logit per token.

    ``checkpoint`` (resume) or ``config.init``: ``AutoModelForTokenClassification.from_pretrained`` (a causal
    LM checkpoint initialises the backbone, the one-logit head is new). ``config.init_config``: a config.json
    (file or directory) for a new model with random weights (seeded by ``config.seed``).
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch.manual_seed(config.seed)
    if checkpoint is not None or config.init is not None:
        path = str(checkpoint or config.init)
        if checkpoint is None:
            model = value_head_from_init(path)
        else:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, trust_remote_code=False)
    else:
        source = Path(config.init_config)
        if source.is_dir():
            model_config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        else:
            values = json.loads(source.read_text())
            model_config = AutoConfig.for_model(values.pop("model_type"), **values)
        model_config.num_labels = 1
        if getattr(model_config, "vocab_size", None) is not None and model_config.vocab_size < len(tokenizer):
            raise ValueError(f"init_config vocab_size={model_config.vocab_size} < tokenizer size {len(tokenizer)}")
        model = AutoModelForTokenClassification.from_config(model_config)
    if model.config.num_labels != 1:
        raise ValueError(f"the critic needs one logit per token; the model has num_labels={model.config.num_labels}")
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def value_head_of(model) -> torch.nn.Module:
    """The one-logit head of a token-classification model (``score`` in most architectures, ``classifier`` in
    BERT-like ones): what ``--freeze-backbone`` trains."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(f"--freeze-backbone: {type(model).__name__} has no `score` or `classifier` head to train alone; "
                     "train the whole model (drop --freeze-backbone)")


def value_head_from_init(path: str):
    """A one-logit token-classification model on the weights at ``path`` (``--init``, usually a causal LM).

    The new head (``score.*``/``classifier.*``) missing from a causal LM checkpoint, and its LM head left
    unused, are the intent here, so transformers' load report is silenced for exactly those keys; any other
    missing, unexpected or mismatched key is still reported (a warning naming the keys).
    """
    import warnings

    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, trust_remote_code=False,
                                                                      output_loading_info=True)
    finally:
        hf_logging.set_verbosity(previous)
    head_prefixes = ("score.", "classifier.")
    surprises = {
        "missing": [k for k in info.get("missing_keys", ()) if not str(k).startswith(head_prefixes)],
        "unexpected": [k for k in info.get("unexpected_keys", ()) if not str(k).startswith("lm_head.")],
        "mismatched": [k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys", ())],
    }
    surprises = {kind: sorted(map(str, keys)) for kind, keys in surprises.items() if keys}
    if surprises:
        warnings.warn(f"verl-prm train: initialising the critic from {path}: keys other than the new value head "
                      f"did not load as expected: {surprises}", stacklevel=2)
    return model


@torch.inference_mode()
def evaluate_examples(model, examples: list[EncodedRollout], *, batch_size: int, pad_token_id: int,
                      device) -> tuple[np.ndarray, np.ndarray]:
    """Predicted values sigmoid(logit) and targets at every labelled position: two [num labelled steps] arrays."""
    was_training = model.training
    model.eval()
    predictions, targets = [], []
    for begin in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in collate(examples[begin : begin + batch_size], pad_token_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        values = torch.sigmoid(gather_step_logits(logits.float(), batch["positions"]))
        predictions.append(values[batch["step_mask"]].cpu().numpy())
        targets.append(batch["targets"][batch["step_mask"]].cpu().numpy())
    model.train(was_training)
    if not predictions:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(predictions).astype(np.float64), np.concatenate(targets).astype(np.float64)


def _tokenizer_as_checkpoint_loads_it(tokenizer, model_config, output_dir: Path, note: Callable[[str], None]):
    """The tokenizer that ``AutoTokenizer.from_pretrained(checkpoint)`` will return.

    transformers chooses a checkpoint's tokenizer class from its config's ``model_type`` (a byte-level BPE saved
    next to a qwen2 config loads as ``Qwen2Tokenizer``, whose pre-tokenizer splits text differently). Training
    with the reloaded tokenizer makes training, resuming and scoring with ProverCritic tokenise alike.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".tokenizer-") as directory:
        model_config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        reloaded = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    if type(reloaded) is not type(tokenizer):
        note(f"verl-prm train: the checkpoint will load the tokenizer as {type(reloaded).__name__} (not "
             f"{type(tokenizer).__name__}); training uses that class so that scoring tokenises the same way")
    return reloaded


def read_log(path: Path, note: Callable[[str], None] = print) -> list[dict]:
    """The records of ``metrics.jsonl``. A torn last line (the process died while appending it) is skipped
    with a note; a line elsewhere that is not a JSON object is an error naming the file and the line."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not an object")
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if all(not rest.strip() for rest in lines[number:]):
                note(f"verl-prm train: {path} line {number} is torn (cut off while it was written: {error}); "
                     "dropping it")
                break
            raise ValueError(f"{path} line {number} is not a JSON record ({error}) and is not the last line; fix "
                             "or delete that line to resume") from None
        records.append(record)
    return records


def _trim_log(path: Path, step: int, note: Callable[[str], None] = print) -> list[dict]:
    """Drop log lines of steps after ``step`` (written after the checkpoint a resumed run starts from) and a
    torn last line; returns the records kept."""
    if not path.exists():
        return []
    kept = [record for record in read_log(path, note) if record.get("step", 0) <= step]
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(temp, path)
    return kept


def auroc_note(targets: np.ndarray) -> str | None:
    """Why the held-out AUROC is undefined (NaN), or None if it is defined: it needs steps of both classes."""
    positives = int(np.sum(targets >= 0.5))
    negatives = int(targets.size - positives)
    if targets.size == 0:
        return "AUROC is NaN: no held-out labelled steps"
    if positives == 0 or negatives == 0:
        side = "below" if positives == 0 else "at or above"
        return (f"AUROC is NaN: all {targets.size} held-out step labels are {side} 0.5 (one class); it needs both "
                "classes. Hold out more prompts (--eval-fraction) or pass --eval-labels with mixed outcomes")
    return None


def train(config: TrainConfig, *, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) a PAV; returns a summary with the final held-out metrics and checkpoint path.

    ``on_step(step, record)`` is called after every optimizer step (tests use it to simulate a crash).
    The output directory is locked against a second writer (:mod:`verl_prm.locking`) by the main process
    (``RANK`` 0 or unset under ``accelerate launch``/``torchrun``).
    """
    from verl_prm.locking import DirectoryLock

    if os.environ.get("RANK", "0") != "0":
        return _train(config, on_step)
    with DirectoryLock(config.output_dir, "verl-prm train"):
        return _train(config, on_step)


def _train(config: TrainConfig, on_step: Callable[[int, dict], None] | None) -> dict:
    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from verl_prm.labeling.format import label_files, read_labels

    accelerator = Accelerator(mixed_precision=config.mixed_precision, cpu=config.cpu)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = latest_checkpoint(output_dir) if config.resume else None
    state = None
    if checkpoint is not None:
        state = torch.load(checkpoint / "training_state.pt", map_location="cpu", weights_only=False)
        stored = state["config"]
        differing = [k for k in _RESUME_KEYS if stored.get(k) != asdict(config).get(k)]
        if differing:
            details = ", ".join(f"{k}: {stored.get(k)!r} -> {asdict(config).get(k)!r}" for k in differing)
            raise ValueError(f"cannot resume from {checkpoint}: settings differ ({details}); use the same settings "
                             "or a new --output-dir")
    if checkpoint is None and config.init is not None:
        from verl_prm.checkpoints import resolve_checkpoint

        # no such directory, a file, no weights, pickle-only weights: an error naming --init before any load
        resolve_checkpoint(config.init, "--init")
    tokenizer_path = str(checkpoint) if checkpoint is not None else (config.tokenizer or config.init)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    model = build_model(config, tokenizer, checkpoint)
    if checkpoint is None:
        tokenizer = _tokenizer_as_checkpoint_loads_it(tokenizer, model.config, output_dir, accelerator.print)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError(f"tokenizer {tokenizer_path} has neither a pad nor an EOS token to pad batches with")

    frame = read_labels(config.labels)
    if config.eval_labels:
        shared = {str(p.resolve()) for p in label_files(config.labels)} & {str(p.resolve()) for p in
                                                                          label_files(config.eval_labels)}
        if shared:
            raise ValueError(f"--eval-labels and --labels share shards ({sorted(shared)[:3]}): held-out metrics "
                             "would be measured on training data")
        train_frame, eval_frame = frame, read_labels(config.eval_labels)
    else:
        train_frame, eval_frame = split_by_prompt(frame, config.eval_fraction, config.seed)
    encode = dict(max_length=config.max_length, best_of_k=config.best_of_k, use_prompt_value=config.use_prompt_value)
    train_examples, train_stats = encode_labels(train_frame, tokenizer, **encode)
    eval_examples, eval_stats = encode_labels(eval_frame, tokenizer, **encode) if len(eval_frame) else ([], None)
    if not train_examples:
        raise ValueError(f"no labelled steps to train on in {config.labels}")
    for note in train_stats.notes:
        accelerator.print(f"verl-prm train: {note}")
    weights = class_balanced_weights(train_examples) if config.balance else np.full(len(train_examples), 1.0 / len(train_examples))

    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if config.freeze_backbone:
        head = value_head_of(model)
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for parameter in head.parameters():
            parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: warmup_cosine_factor(t, config.warmup_steps, config.max_steps, config.min_lr_ratio)
    )
    # The scheduler is not prepared: accelerate would step it once per process; ours counts optimizer steps.
    model, optimizer = accelerator.prepare(model, optimizer)
    start_step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = int(state["step"])
    log_path = output_dir / "metrics.jsonl"
    logged_evals: set[int] = set()
    if accelerator.is_main_process:
        kept = _trim_log(log_path, start_step, accelerator.print)
        logged_evals = {int(r["step"]) for r in kept if any(k.startswith("eval/") for k in r)}
        accelerator.print(
            f"verl-prm train: {len(train_examples)} train rollouts ({sum(len(e.targets) for e in train_examples)} "
            f"labels), {len(eval_examples)} held-out rollouts; steps {start_step} -> {config.max_steps}"
            + (f", resumed from {checkpoint}" if checkpoint is not None else "")
        )

    def log(record: dict) -> None:
        if accelerator.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def run_eval(step: int) -> dict:
        metrics: dict = {}
        if accelerator.is_main_process and eval_examples:
            predictions, targets = evaluate_examples(accelerator.unwrap_model(model), eval_examples,
                                                     batch_size=config.eval_batch_size, pad_token_id=pad_token_id,
                                                     device=accelerator.device)
            metrics = {f"eval/{k}": v for k, v in value_metrics(predictions, targets).items()}
            why = auroc_note(targets)
            if why is not None:
                metrics["eval/auroc_note"] = why
                accelerator.print(f"verl-prm train: step {step}: {why}")
            if step not in logged_evals:  # a rerun of a finished run evaluates again but logs no second line
                log({"step": step, **metrics})
                logged_evals.add(step)
        accelerator.wait_for_everyone()
        return metrics

    def save(step: int) -> Path:
        final = output_dir / f"checkpoint-{step:07d}"
        if accelerator.is_main_process:
            temp = output_dir / f".checkpoint-{step:07d}.tmp"
            shutil.rmtree(temp, ignore_errors=True)
            accelerator.unwrap_model(model).save_pretrained(temp, safe_serialization=True)
            tokenizer.save_pretrained(temp)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                        "config": asdict(config)}, temp / "training_state.pt")
            if final.exists():
                shutil.rmtree(final)
            os.replace(temp, final)
            # Rotation never removes the checkpoint just written (keep_checkpoints >= 1 is checked at startup;
            # excluding `final` keeps it safe even if that check is bypassed).
            checkpoints = sorted(p for p in output_dir.glob("checkpoint-*") if _CHECKPOINT.fullmatch(p.name)
                                 and p != final)
            for old in checkpoints[: max(0, len(checkpoints) + 1 - config.keep_checkpoints)]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return final

    world, rank = accelerator.num_processes, accelerator.process_index
    per_step = config.batch_size * world * config.grad_accum
    metrics: dict = {}
    last_checkpoint = checkpoint
    bar = tqdm(total=config.max_steps, initial=start_step, desc="training PAV", unit="step",
               disable=not (config.progress and accelerator.is_main_process))
    for step in range(start_step, config.max_steps):
        # Dropout and any other randomness of a step is seeded by (seed, step, rank): a resumed run repeats
        # the uninterrupted run's step exactly without carrying RNG state through the checkpoint.
        torch.manual_seed((config.seed * 1_000_003 + step) * 4099 + rank)
        indices = sample_batch_indices(weights, per_step, step, config.seed)
        losses = []
        for micro in range(config.grad_accum):
            begin = (micro * world + rank) * config.batch_size
            batch = collate([train_examples[i] for i in indices[begin : begin + config.batch_size]], pad_token_id)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            sync = accelerator.no_sync(model) if micro < config.grad_accum - 1 else contextlib.nullcontext()
            with sync:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = soft_label_bce(gather_step_logits(logits, batch["positions"]), batch["targets"], batch["step_mask"])
                accelerator.backward(loss / config.grad_accum)
            losses.append(loss.detach().float().item())
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.grad_clip) if config.grad_clip else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        completed = step + 1
        record = {"step": completed, "loss": float(np.mean(losses)), "lr": scheduler.get_last_lr()[0]}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if completed % max(config.log_every, 1) == 0 or completed == config.max_steps:
            log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if (config.eval_every and completed % config.eval_every == 0) or completed == config.max_steps:
            metrics = run_eval(completed)
            record.update(metrics)
        if (config.save_every and completed % config.save_every == 0) or completed == config.max_steps:
            last_checkpoint = save(completed)
        if on_step is not None:
            on_step(completed, record)
    bar.close()
    if start_step >= config.max_steps:
        metrics = run_eval(config.max_steps)
    if accelerator.is_main_process:
        (output_dir / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
    return {"checkpoint": str(last_checkpoint) if last_checkpoint else None, "metrics": metrics,
            "train_rollouts": len(train_examples), "eval_rollouts": len(eval_examples), "start_step": start_step}
