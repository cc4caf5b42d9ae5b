"""Online refresh of a learned PAV's value head from the Monte-Carlo values sampled during RL.

Every ``every`` training steps the trainer hook samples the batch's step values from the run's rollout replicas
(``verl_prm.critic.sampled``) besides scoring the steps with the learned PAV. The samples are labels of the
current policy's values (the prover is the policy, as in ``verl-prm label``):

    prompt of response b:      y_{b,0} = V(x_b), its group's success rate,    t_{b,0} = the group's size
                               (on the group's first response only: V(x_b) is one label, not one per response);
    step h < H_b - 1, sampled: y_{b,h+1} = s_{b,h} / n,                       t_{b,h+1} = n continuations;
    the last step H_b:         y_{b,H_b} = R_b, the response's own outcome,   t_{b,H_b} = 1;
    any other step (held by the budget or the prefix rule, or inferred 0 after a first pit): no label, t = 0.

The PAV's value head ``v = sigmoid(w . f + c)`` on its frozen features f (what the head reads, the backbone's
last hidden state at the read position) is then refitted to the labels of the last ``window`` refreshes: the
weighted logistic regression

    (w, c) = argmin - sum t [ y log v + (1 - y) log(1 - v) ] / sum t

(``verl_prm.training.head_fit.fit_logistic_head``, Newton's method to the optimum), whose weights t make it the
maximum-likelihood fit of the sampled successes (t trials, t y successes per label). The backbone is not
trained: for a PAV made by ``verl-prm train --freeze-backbone --head-fit newton`` this is the same fit on newer
labels. Before the refit the PAV's values are compared with the fresh labels, which it has not seen
(:func:`refresh_metrics`).

:class:`RefreshStore` keeps what a resumed run needs in one directory: per refresh the labels in the label
format ``verl-prm train`` reads (``labels/step_XXXXXX.parquet``), and the rows and the head it fitted
(``state/step_XXXXXX.safetensors``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_prm.critic.sampled import SampledValues
from verl_prm.labeling.format import rows_to_table
from verl_prm.locking import DirectoryLock
from verl_prm.resume import (check_same_settings, jsonable, read_settings, temporary_target, write_atomically,
                             write_settings)
from verl_prm.training.head_fit import fit_logistic_head
from verl_prm.training.metrics import value_metrics

__all__ = ["PROMPT_INDEX_STRIDE", "RefreshRows", "RefreshStore", "labelled_rows", "refit_value_head",
           "refresh_label_rows", "refresh_metrics", "refresh_targets"]

# prompt_index of a refresh label row: step x PROMPT_INDEX_STRIDE + the prompt's group in the batch, unique in the
# store's label directory (verl_prm.labeling.format identifies a rollout by (prompt_index, rollout_index))
PROMPT_INDEX_STRIDE = 1_000_000

# the names of the store's files: its state files and label shards (step_{t:06d}, more digits past 999999) and
# its settings; a write goes through verl_prm.resume.write_atomically, whose temporary files they name
_STATE_FILE = re.compile(r"step_(\d{6,})\.safetensors")
_LABEL_FILE = re.compile(r"step_\d{6,}\.parquet")
_SETTINGS_FILE = "settings.json"


@dataclass
class RefreshRows:
    """The labelled positions of one refresh: the head's inputs ``features`` [N, d] fp32, ``targets`` [N] in
    [0, 1], ``trials`` [N] > 0 (module docstring), and the step that sampled them."""

    step: int
    features: torch.Tensor
    targets: torch.Tensor
    trials: torch.Tensor


def _group_sizes(groups: Sequence, real: Sequence[bool]) -> tuple[list[int], list[int]]:
    """Per row: its group's number among the real rows' groups (in order of appearance; -1 for a padding row) and
    the group's size (real rows only)."""
    number: dict = {}
    sizes: dict = {}
    for group, keep in zip(groups, real):
        if keep:
            number.setdefault(group, len(number))
            sizes[group] = sizes.get(group, 0) + 1
    return ([number[g] if keep else -1 for g, keep in zip(groups, real)],
            [sizes[g] if keep else 0 for g, keep in zip(groups, real)])


def refresh_targets(values: SampledValues, groups: Sequence, real_rows: Sequence[bool] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [B, S + 1], trials [B, S + 1]) of a batch's sampled values (module docstring): position 0 is the
    prompt, position h + 1 the value after step h. ``groups``: each row's prompt group; the group's prompt value
    is labelled at its first real row only (every row of the group reads the same prompt, so the PAV's value there
    is one value, and the group's successes are one label). Rows with ``real_rows`` False (padding) get no
    label."""
    batch, width = values.step_values.shape
    real = [True] * batch if real_rows is None else [bool(r) for r in real_rows]
    if len(groups) != batch or len(real) != batch:
        raise ValueError(f"refresh_targets: {batch} rows of values, {len(groups)} groups, {len(real)} real_rows")
    _, sizes = _group_sizes(groups, real)
    targets = torch.zeros(batch, width + 1, dtype=torch.float64)
    trials = torch.zeros(batch, width + 1, dtype=torch.float64)
    prompt_labelled = set()
    for b in range(batch):
        if not real[b]:
            continue
        steps = int(values.num_steps[b])
        if groups[b] not in prompt_labelled:
            prompt_labelled.add(groups[b])
            targets[b, 0], trials[b, 0] = float(values.prompt_values[b]), sizes[b]
        for h in range(steps - 1):
            count = values.counts.get((b, h))
            if count is not None:
                targets[b, h + 1], trials[b, h + 1] = count.successes / count.continuations, count.continuations
        if steps:
            targets[b, steps], trials[b, steps] = float(values.step_values[b, steps - 1]), 1.0
    return targets, trials


def refresh_metrics(critic_values: torch.Tensor, targets: torch.Tensor, trials: torch.Tensor) -> dict[str, float]:
    """The PAV's values ``critic_values`` [B, S + 1] (prompt first, as it scored the batch before the refit)
    against the fresh labels, over the labelled positions (trials > 0):

    - ``pav/refresh/labels``: labelled positions;
    - ``pav/refresh/mse``: mean (v - y)^2; ``pav/refresh/mse_constant``: the same for the labels' mean;
    - ``pav/refresh/auroc``: AUROC of v for y >= 0.5 (``verl_prm.training.metrics``), left out when the labels
      have one class only.
    """
    labelled = trials > 0
    if critic_values.shape != targets.shape:
        raise ValueError(f"refresh_metrics: values {tuple(critic_values.shape)} but targets {tuple(targets.shape)}")
    count = int(labelled.sum())
    if not count:
        return {"pav/refresh/labels": 0.0}
    metrics = value_metrics(critic_values[labelled].double().numpy(), targets[labelled].double().numpy())
    out = {"pav/refresh/labels": float(count), "pav/refresh/mse": metrics["mse"],
           "pav/refresh/mse_constant": metrics["mse_constant"]}
    if math.isfinite(metrics["auroc"]):
        out["pav/refresh/auroc"] = metrics["auroc"]
    return out


def refit_value_head(window: Sequence[RefreshRows], max_iterations: int = 100):
    """``fit_logistic_head`` on the rows of ``window`` (the last refreshes), each label weighted by its trials:
    returns the ``HeadFit`` (``logit = features @ weight + bias``)."""
    if not window or not any(len(rows.targets) for rows in window):
        raise ValueError("refit_value_head: no labelled position in the refresh window")
    features = torch.cat([rows.features for rows in window]).double()
    targets = torch.cat([rows.targets for rows in window]).double()
    trials = torch.cat([rows.trials for rows in window]).double()
    return fit_logistic_head(features, targets, trials, max_iterations=max_iterations)


def refresh_label_rows(values: SampledValues, groups: Sequence, successes: Sequence[bool], step: int, *,
                       prompts: Sequence[str],
                       responses: Sequence[str], step_char_ends: torch.Tensor, outcome_scores: Sequence[float],
                       finished: Sequence[bool], data_sources: Sequence, ground_truths: Sequence, strategy: str,
                       source: str, real_rows: Sequence[bool] | None = None) -> list[dict]:
    """The batch's sampled values as label rows (``verl_prm.labeling.format``), one per real response.

    ``prompts``/``responses``: the texts (the prompt as the policy read it; the response as the step split decoded
    it, whose steps end at ``step_char_ends`` [B, S] characters); ``successes``: the responses' outcomes. ``q`` is n_success / n_mc for a sampled step, the
    outcome for the last step (n_mc = 0: exact), 0 at and after a first pit (n_mc = 0: inferred) and NaN for a step
    held by the budget or the prefix rule (not labelled); the prompt value is the group's success rate, its
    counts the group's successes and size, repeated on each row of the group as the label format has it (one
    prompt value: ``verl-prm train`` counts it once). ``prompt_index`` = step x ``PROMPT_INDEX_STRIDE`` + the
    group's number.
    """
    batch = values.step_values.shape[0]
    real = [True] * batch if real_rows is None else [bool(r) for r in real_rows]
    numbers, sizes = _group_sizes(groups, real)
    if max(numbers, default=-1) >= PROMPT_INDEX_STRIDE:
        raise ValueError(f"refresh_label_rows: {max(numbers) + 1} prompt groups in one batch, more than "
                         f"{PROMPT_INDEX_STRIDE} (the prompt_index stride)")
    group_successes: dict = {}
    for b in range(batch):
        if real[b]:
            group_successes[groups[b]] = group_successes.get(groups[b], 0) + int(bool(successes[b]))
    rows, within = [], {}
    for b in range(batch):
        if not real[b]:
            continue
        steps = int(values.num_steps[b])
        ends = [int(e) for e in step_char_ends[b, :steps].tolist()]
        starts = [0] + ends[:-1] if ends else []  # a response of no step (only EOS) has no span
        pit = values.first_pits[b]
        q, n_success, n_mc = [], [], []
        for h in range(steps):
            count = values.counts.get((b, h))
            if count is not None:
                q.append(count.successes / count.continuations)
                n_success.append(count.successes)
                n_mc.append(count.continuations)
            elif h == steps - 1 or (pit >= 0 and h >= pit):
                q.append(float(values.step_values[b, h]))  # the outcome, or 0 inferred after the pit
                n_success.append(0)
                n_mc.append(0)
            else:
                q.append(math.nan)
                n_success.append(0)
                n_mc.append(0)
        outcome = 1.0 if successes[b] else 0.0
        truth = ground_truths[b]
        rollout = within.get(groups[b], 0)
        within[groups[b]] = rollout + 1
        rows.append({
            "prompt_index": step * PROMPT_INDEX_STRIDE + numbers[b], "rollout_index": rollout,
            "data_source": str(data_sources[b]), "prompt": prompts[b],
            "ground_truth": truth if isinstance(truth, str) else json.dumps(truth),
            "response": responses[b], "step_starts": starts, "step_ends": ends, "q": q, "n_success": n_success,
            "n_mc": n_mc, "first_pit": int(pit), "prompt_value": group_successes[groups[b]] / sizes[b],
            "prompt_n_success": group_successes[groups[b]], "prompt_n_mc": sizes[b], "outcome": outcome,
            "score": float(outcome_scores[b]), "finished": bool(finished[b]), "strategy": strategy,
            "source": source,
        })
    return rows


class RefreshStore:
    """The refresh directory of a run: locked while the run writes it; ``settings.json`` (what the refresh was
    started with; a resume with other settings is an error naming them); per refresh step t the label shard
    ``labels/step_{t:06d}.parquet`` and ``state/step_{t:06d}.safetensors`` (the rows the head was fitted on and
    the head itself). A resumed run reads the states of the steps it has done; later ones (of a run that died
    after its last checkpoint) are ignored and overwritten when those steps run again.

    Only the store's own files count: any other file in ``state/`` (a copy ``step_000003_copy.safetensors``, a
    ``step_latest.safetensors``, a ``.tmpAb12cd``) is refused, naming it, when the store is opened and whenever it
    lists its steps, since counting it could hold a refresh twice in the refit's window. Every file of the store
    is written by :func:`verl_prm.resume.write_atomically`, so a writer killed at any moment (``kill -9``
    included) leaves at most its temporary file, named by that one rule (``.step_000003.safetensors.tmp<pid>``);
    opening the store (under its lock: no writer is alive) removes such leftovers of the store's files from the
    directory, ``labels/`` and ``state/``."""

    _FIX = "set verl_prm.refresh.directory to a new directory"

    def __init__(self, directory: str | os.PathLike, settings: dict) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lock = DirectoryLock(self.directory, "verl-prm refresh of the PAV").acquire()
        try:
            (self.directory / "labels").mkdir(exist_ok=True)
            (self.directory / "state").mkdir(exist_ok=True)
            path = self.directory / "settings.json"
            settings = jsonable(settings)
            stored = read_settings(path, fix=self._FIX)
            if stored is None:
                write_settings(path, settings)
            else:
                check_same_settings(stored, settings, source=self.directory, what="the refresh of a run",
                                    fix=self._FIX)
            self._remove_leftovers()
            self._state_files()
        except BaseException:
            self.lock.release()
            raise

    def close(self) -> None:
        self.lock.release()

    def _state_path(self, step: int) -> Path:
        return self.directory / "state" / f"step_{step:06d}.safetensors"

    def _remove_leftovers(self) -> None:
        """Remove what writers killed before their rename left: the temporary files of the store's own writes
        (:func:`verl_prm.resume.temporary_path` of a state file, a label shard or the settings) in ``state/``,
        ``labels/`` and the directory. Called under the lock, so no writer of them is alive."""
        own = {self.directory: lambda name: name == _SETTINGS_FILE,
               self.directory / "labels": _LABEL_FILE.fullmatch, self.directory / "state": _STATE_FILE.fullmatch}
        for folder, is_own in own.items():
            for path in folder.iterdir():
                target = temporary_target(path.name)
                if target is not None and is_own(target) and path.is_file():
                    path.unlink()

    def write(self, rows: RefreshRows, label_rows: Sequence[dict], weight: torch.Tensor, bias: float) -> None:
        """Write one refresh (the label shard first, validated by the label format; then the state), each
        atomically by :func:`verl_prm.resume.write_atomically` (the library writers' own temporary files, such as
        safetensors' ``.tmpXXXXXX``, would not be recognisable as the store's)."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        from safetensors.torch import save

        table = rows_to_table(label_rows)
        shard = pa.BufferOutputStream()
        pq.write_table(table, shard)
        write_atomically(self.directory / "labels" / f"step_{rows.step:06d}.parquet", shard.getvalue().to_pybytes())
        state = save({"features": rows.features.float().contiguous(), "targets": rows.targets.double().contiguous(),
                      "trials": rows.trials.double().contiguous(), "weight": weight.double().reshape(-1).contiguous(),
                      "bias": torch.tensor([float(bias)], dtype=torch.float64)}, metadata={"step": str(rows.step)})
        write_atomically(self._state_path(rows.step), state)

    def _state_files(self) -> dict[int, Path]:
        """step -> state file of every refresh stored; any file in ``state/`` that is not the store's own is a
        ValueError naming it (class docstring)."""
        found, strays = {}, []
        for path in sorted((self.directory / "state").iterdir()):
            match = _STATE_FILE.fullmatch(path.name)
            target = temporary_target(path.name)
            if match and path.is_file() and path.name == self._state_path(int(match.group(1))).name:
                found[int(match.group(1))] = path
            elif not (target is not None and _STATE_FILE.fullmatch(target) and path.is_file()):
                strays.append(path.name)  # (the store's own temporary files are not states: skipped)
        if strays:
            raise ValueError(f"{self.directory / 'state'} holds files that are not the refresh store's own "
                             f"({', '.join(strays)}; its states are named step_XXXXXX.safetensors): move them out of "
                             "the directory, then resume")
        return found

    def steps(self, up_to: int) -> list[int]:
        """The refresh steps stored, <= ``up_to``, in order."""
        return sorted(step for step in self._state_files() if step <= up_to)

    def read(self, step: int) -> tuple[RefreshRows, torch.Tensor, float]:
        """(rows, head weight [d], head bias) of the refresh at ``step``; a damaged state names its file."""
        from safetensors.torch import load_file

        path = self._state_path(step)
        try:
            tensors = load_file(str(path))
            rows = RefreshRows(step, tensors["features"], tensors["targets"], tensors["trials"])
            weight, bias = tensors["weight"], float(tensors["bias"][0])
        except Exception as error:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{path} is not a readable refresh state ({error}): delete it and the steps after it, "
                             "or resume from an earlier checkpoint") from error
        n = rows.features.shape[0]
        if rows.targets.shape != (n,) or rows.trials.shape != (n,) or weight.shape != (rows.features.shape[1],) \
                or not all(bool(torch.isfinite(t).all()) for t in (rows.features, rows.targets, rows.trials, weight)) \
                or not math.isfinite(bias):
            raise ValueError(f"{path}: the refresh state has inconsistent or non-finite tensors")
        return rows, weight, bias

    def window(self, up_to: int, size: int) -> list[RefreshRows]:
        """The rows of the last ``size`` refreshes at steps <= ``up_to`` (none for ``size`` 0)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"RefreshStore.window: size must be an int >= 0 (the number of refreshes), got {size!r}")
        steps = self.steps(up_to)
        return [self.read(step)[0] for step in steps[max(len(steps) - size, 0):]] if size else []


def labelled_rows(step: int, features: torch.Tensor, targets: torch.Tensor, trials: torch.Tensor) -> RefreshRows:
    """The labelled positions (trials > 0) of a batch: ``features`` [B, S + 1, d], ``targets``/``trials`` [B, S + 1]."""
    if features.shape[:2] != targets.shape or trials.shape != targets.shape:
        raise ValueError(f"labelled_rows: features {tuple(features.shape)}, targets {tuple(targets.shape)}, trials "
                         f"{tuple(trials.shape)}")
    labelled = trials > 0
    return RefreshRows(step, features[labelled].float(), targets[labelled].double(), trials[labelled].double())

