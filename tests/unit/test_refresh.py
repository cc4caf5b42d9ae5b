"""The online refresh of a learned PAV (verl_prm.critic.refresh): labels from sampled values, the head's refit as
the maximum-likelihood fit of the sampled successes, the label rows in the label format, the resumable store."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from verl_prm.config.hook import ConfigError, read_hook_config
from verl_prm.integrations.verl.run_config import check_source_settings
from verl_prm.critic.refresh import (
    PROMPT_INDEX_STRIDE,
    RefreshRows,
    RefreshStore,
    labelled_rows,
    refit_value_head,
    refresh_label_rows,
    refresh_metrics,
    refresh_targets,
)
from verl_prm.critic.sampled import sampled_step_values
from verl_prm.monte_carlo import PrefixCounts, ResponseSteps


def _batch(rule: str = "every", budget: int | None = None, steps: list[int] | None = None):
    """Five responses in two prompt groups (+ one padding row), sampled by a sampler whose successes are fixed per
    (row, step): a Monte-Carlo run with known counts."""
    steps = steps or [3, 4, 1, 2, 3, 2]
    success = [True, False, False, True, False, False]
    groups = ["a", "a", "a", "b", "b", "pad"]
    real = [True, True, True, True, True, False]
    responses = [ResponseSteps(num_steps=h, success=s, sample=r, continuation_limits=[10] * h)
                 for h, s, r in zip(steps, success, real)]

    def sample(requests):
        return [PrefixCounts(successes=(r.row + 2 * r.step) % (r.n_mc + 1), continuations=r.n_mc, tokens=r.n_mc * 3)
                for r in requests]

    values = sampled_step_values(responses, groups, sample, prefix_rule=rule, n_mc=3, token_budget=budget, width=4)
    return values, groups, success, real, steps


def test_targets_are_the_samples_the_group_rate_and_the_outcome_with_their_trials():
    values, groups, success, real, steps = _batch()
    targets, trials = refresh_targets(values, groups, real)
    assert targets.shape == trials.shape == (6, 5)
    for b in range(6):  # the module docstring's table, as a loop
        if not real[b]:
            assert not trials[b].any()
            continue
        group = [i for i in range(6) if real[i] and groups[i] == groups[b]]
        if b == group[0]:  # the group's prompt value: one label, on its first response (of trials = its size)
            assert targets[b, 0] == pytest.approx(sum(success[i] for i in group) / len(group))
            assert trials[b, 0] == len(group)
        else:
            assert trials[b, 0] == 0
        for h in range(steps[b] - 1):
            s = (b + 2 * h) % 4
            assert (targets[b, h + 1].item(), trials[b, h + 1].item()) == (pytest.approx(s / 3), 3.0)
        assert (targets[b, steps[b]].item(), trials[b, steps[b]].item()) == (float(success[b]), 1.0)
        assert not trials[b, steps[b] + 1:].any()


def test_held_and_inferred_steps_carry_no_label():
    values, groups, _, real, _ = _batch(rule="first_pit")
    _, trials = refresh_targets(values, groups, real)
    for b in range(6):
        for h in range(int(values.num_steps[b]) - 1):
            assert (trials[b, h + 1] > 0) == ((b, h) in values.counts), (b, h)
    values, groups, _, real, _ = _batch(budget=20)  # the budget refuses most prefixes: they hold a value
    _, trials = refresh_targets(values, groups, real)
    assert int((trials[:, 1:] == 3).sum()) == len(values.counts) and values.prefixes_skipped > 0


def test_the_refit_is_the_maximum_likelihood_fit_of_the_sampled_successes():
    """A label y = s/t with t trials weighs in the loss as s successes and t - s failures (the binomial
    likelihood): the refit equals the fit on the expanded Bernoulli rows."""
    from verl_prm.training.head_fit import fit_logistic_head

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(40, 3, generator=generator)
    trials = torch.randint(1, 6, (40,), generator=generator).double()
    successes = torch.floor(torch.rand(40, generator=generator, dtype=torch.float64) * (trials + 1))
    rows = [RefreshRows(1, features[:25], successes[:25] / trials[:25], trials[:25]),
            RefreshRows(2, features[25:], successes[25:] / trials[25:], trials[25:])]
    fit = refit_value_head(rows)
    expanded_x, expanded_y = [], []
    for x, s, t in zip(features, successes, trials):
        expanded_x += [x] * int(t)
        expanded_y += [1.0] * int(s) + [0.0] * int(t - s)
    direct = fit_logistic_head(torch.stack(expanded_x), torch.tensor(expanded_y))
    assert fit.converged and direct.converged
    assert torch.allclose(fit.weight, direct.weight, atol=1e-6) and fit.bias == pytest.approx(direct.bias, abs=1e-6)
    with pytest.raises(ValueError, match="no labelled position"):
        refit_value_head([RefreshRows(3, torch.zeros(0, 3), torch.zeros(0), torch.zeros(0))])


def test_metrics_compare_the_values_with_the_labels_where_labelled():
    values, groups, _, real, _ = _batch()
    targets, trials = refresh_targets(values, groups, real)
    critic = torch.rand(targets.shape, generator=torch.Generator().manual_seed(1))
    metrics = refresh_metrics(critic, targets.float(), trials)
    pairs = [(critic[b, j].item(), targets[b, j].item()) for b in range(6) for j in range(5) if trials[b, j] > 0]
    assert metrics["pav/refresh/labels"] == len(pairs)
    assert metrics["pav/refresh/mse"] == pytest.approx(np.mean([(v - y) ** 2 for v, y in pairs]), rel=1e-6)
    mean = np.mean([y for _, y in pairs])
    assert metrics["pav/refresh/mse_constant"] == pytest.approx(np.mean([(mean - y) ** 2 for _, y in pairs]), rel=1e-6)
    assert 0.0 <= metrics["pav/refresh/auroc"] <= 1.0
    one_class = refresh_metrics(critic, torch.zeros_like(targets, dtype=torch.float32), trials)
    assert "pav/refresh/auroc" not in one_class and one_class["pav/refresh/mse"] > 0
    assert refresh_metrics(critic, targets.float(), torch.zeros_like(trials)) == {"pav/refresh/labels": 0.0}


def _label_rows(values, groups, success, real, step=7):
    prompts = [f"prompt {g}" for g in groups]
    ends = torch.full((6, 4), -1)
    texts = []
    for b in range(6):
        h = int(values.num_steps[b])
        texts.append("".join(f"s{i};" for i in range(h)))
        ends[b, :h] = torch.arange(1, h + 1) * 3
    return refresh_label_rows(values, groups, success, step, prompts=prompts, responses=texts, step_char_ends=ends,
                              outcome_scores=[float(s) for s in success], finished=[True] * 6,
                              data_sources=["scripted"] * 6, ground_truths=[{"answer": 3}] * 6, strategy="every",
                              source="test", real_rows=real)


def test_label_rows_pass_the_label_format_and_carry_the_counts():
    from verl_prm.labeling.format import rows_to_table

    values, groups, success, real, steps = _batch(rule="first_pit")
    rows = _label_rows(values, groups, success, real)
    assert len(rows) == 5  # the padding row is no label
    table = rows_to_table(rows).to_pylist()
    for row, b in zip(table, range(5)):
        assert row["prompt_index"] == 7 * PROMPT_INDEX_STRIDE + ["a", "b"].index(groups[b])
        assert row["ground_truth"] == json.dumps({"answer": 3})
        for h in range(steps[b]):
            if (b, h) in values.counts:
                count = values.counts[(b, h)]
                assert (row["n_success"][h], row["n_mc"][h]) == (count.successes, count.continuations)
            elif h == steps[b] - 1:
                assert (row["q"][h], row["n_mc"][h]) == (float(success[b]), 0)
            elif 0 <= values.first_pits[b] <= h:
                assert (row["q"][h], row["n_mc"][h]) == (0.0, 0)
            else:
                assert math.isnan(row["q"][h])
        group = [i for i in range(6) if real[i] and groups[i] == groups[b]]
        assert (row["prompt_n_success"], row["prompt_n_mc"]) == (sum(success[i] for i in group), len(group))
    assert sorted((r["prompt_index"], r["rollout_index"]) for r in table) == sorted(
        {(r["prompt_index"], r["rollout_index"]) for r in table})


def test_a_response_without_steps_is_a_label_row_without_steps():
    """A response the policy ended at once (only EOS: no text, no step) still counts in its group's rate; its row
    has empty step lists (a CI run of main_ppo met one at refresh and the row had one start for no end)."""
    from verl_prm.labeling.format import rows_to_table

    values, groups, success, real, _ = _batch(steps=[3, 0, 1, 2, 3, 2])
    table = rows_to_table(_label_rows(values, groups, success, real)).to_pylist()
    empty = table[1]
    assert (empty["step_starts"], empty["step_ends"], empty["q"], empty["n_mc"]) == ([], [], [], [])
    assert (empty["prompt_n_success"], empty["prompt_n_mc"], empty["first_pit"]) == (1, 3, -1)


def _store_rows(step: int, n: int = 6, d: int = 3) -> RefreshRows:
    generator = torch.Generator().manual_seed(step)
    return RefreshRows(step, torch.randn(n, d, generator=generator), torch.rand(n, generator=generator).double(),
                       torch.ones(n, dtype=torch.float64))


def test_store_round_trip_window_and_labels_that_verl_prm_train_reads(tmp_path):
    from verl_prm.labeling.format import read_labels

    values, groups, success, real, _ = _batch()
    store = RefreshStore(tmp_path / "refresh", {"every": 2})
    for step in (2, 4, 6):
        store.write(_store_rows(step), _label_rows(values, groups, success, real, step=step),
                    torch.full((3,), float(step)), -float(step))
    assert store.steps(5) == [2, 4]
    assert [rows.step for rows in store.window(6, 2)] == [4, 6]
    rows, weight, bias = store.read(4)
    assert torch.equal(rows.features, _store_rows(4).features) and torch.equal(weight, torch.full((3,), 4.0).double())
    assert bias == -4.0
    labels = read_labels(tmp_path / "refresh" / "labels")
    assert len(labels) == 15 and labels["prompt_index"].nunique() == 6
    store.close()


def test_store_refuses_other_settings_a_second_writer_and_a_damaged_state(tmp_path):
    from verl_prm.locking import DirectoryLockedError

    store = RefreshStore(tmp_path / "refresh", {"every": 2, "window": 4})
    code = ("from verl_prm.critic.refresh import RefreshStore\n"
            f"RefreshStore({str(tmp_path / 'refresh')!r}, {{'every': 2, 'window': 4}})")
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert second.returncode != 0 and DirectoryLockedError.__name__ in second.stderr, second.stderr[-2000:]
    store.close()
    with pytest.raises(ValueError, match=r"other settings \(window: 4 -> 8\)"):
        RefreshStore(tmp_path / "refresh", {"every": 2, "window": 8})
    store = RefreshStore(tmp_path / "refresh", {"every": 2, "window": 4})
    (tmp_path / "refresh" / "state" / "step_000002.safetensors").write_bytes(b"not a state")
    with pytest.raises(ValueError, match="step_000002.safetensors is not a readable refresh state"):
        store.read(2)
    store.close()


def test_store_refuses_files_that_are_not_its_own_and_window_size_zero_is_empty(tmp_path):
    """A copy of a state (or any other file in state/) would put its refresh twice into the refit's window: the
    store refuses it by name, when opened and when listing its steps; a killed writer's temporary file is its
    own. ``window(up_to, 0)`` holds no refresh (``[-0:]`` would have been all of them)."""
    from verl_prm.resume import temporary_path

    values, groups, success, real, _ = _batch()
    store = RefreshStore(tmp_path / "refresh", {"every": 1})
    for step in (1, 2, 3):
        store.write(_store_rows(step), _label_rows(values, groups, success, real, step=step), torch.zeros(3), 0.0)
    store.close()
    state = tmp_path / "refresh" / "state"
    temporary_path(state / "step_000004.safetensors").write_bytes(b"half written")  # a write killed before its rename
    store = RefreshStore(tmp_path / "refresh", {"every": 1})
    assert store.steps(10) == [1, 2, 3]
    assert [rows.step for rows in store.window(3, 2)] == [2, 3]
    assert [rows.step for rows in store.window(3, 5)] == [1, 2, 3]
    assert store.window(3, 0) == []
    for size in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"size must be an int >= 0 .*got {size!r}"):
            store.window(3, size)
    for stray in ("step_000003_copy.safetensors", "step_latest.safetensors", "step_0000003.safetensors"):
        shutil.copy(state / "step_000003.safetensors", state / stray)
        with pytest.raises(ValueError, match=f"not the refresh store's own \\({stray}; .*move them out"):
            store.steps(10)
        store.close()
        with pytest.raises(ValueError, match=f"not the refresh store's own \\({stray}; "):
            RefreshStore(tmp_path / "refresh", {"every": 1})
        (state / stray).unlink()
        store = RefreshStore(tmp_path / "refresh", {"every": 1})  # the refusal released the lock
    store.close()


def _killed_writer(directory, features: int) -> subprocess.Popen:
    """A process that opens the store at ``directory`` and writes refresh step 1 with ``features`` rows of 256
    features (4 KiB each: the state file's size)."""
    code = ("import sys, torch\n"
            "from verl_prm.critic.refresh import RefreshRows, RefreshStore\n"
            f"store = RefreshStore({str(directory)!r}, {{'every': 1}})\n"
            "n = int(sys.argv[1])\n"
            "rows = RefreshRows(1, torch.ones(n, 256), torch.full((n,), 0.5, dtype=torch.float64), "
            "torch.ones(n, dtype=torch.float64))\n"
            "store.write(rows, [], torch.zeros(256), 0.0)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(features)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_writer_killed_in_the_middle_of_a_write_leaves_nothing_that_blocks_the_resume(tmp_path):
    """``kill -9`` of the writer as soon as its state write has created a file in ``state/`` (the write of 100 MB
    is then under way): the resumed store removes what the write left and writes that step again. Were the state
    written by a library's own atomic write (safetensors' ``state/.tmpXXXXXX``), the resume would refuse the
    leftover as a foreign file."""
    directory = tmp_path / "refresh"
    state = directory / "state"
    for features in (25_000, 100_000, 400_000):  # 100 MB; larger if the write was done before the kill landed
        writer = _killed_writer(directory, features)
        deadline = time.monotonic() + 300
        while not (state.is_dir() and any(state.iterdir())):
            if writer.poll() is not None:
                pytest.fail(f"the writer ended before its state write (exit {writer.returncode}): "
                            f"{writer.stderr.read()[-2000:]}")
            assert time.monotonic() < deadline, "the writer created no file in state/ within 300 s"
            time.sleep(0.0002)
        os.kill(writer.pid, signal.SIGKILL)
        writer.communicate()
        left = sorted(path.name for path in state.iterdir())
        if "step_000001.safetensors" not in left:
            break  # killed in the middle of the write
        shutil.rmtree(directory)
    else:
        pytest.fail("every write was complete before the kill landed")
    assert writer.returncode == -signal.SIGKILL and left, left
    store = RefreshStore(directory, {"every": 1})  # the resume
    assert store.steps(10) == [] and not list(state.iterdir()), sorted(state.iterdir())
    store.write(_store_rows(1), [], torch.zeros(3), 0.0)
    assert store.steps(10) == [1] and store.read(1)[1].tolist() == [0.0, 0.0, 0.0]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((state / "step_000001.safetensors").stat().st_mode) == 0o666 & ~umask  # the user's umask
    store.close()


def test_the_store_removes_its_own_leftovers_and_refuses_a_users_files_by_name(tmp_path):
    """Leftovers made exactly as the store's writes make them (``verl_prm.resume.temporary_path`` of a state
    file, a label shard and the settings; another writer's pid) are removed when the store is opened. A file a user
    put in ``state/`` is refused by name, one named like a library's temporary file (``.tmpAb12cd``) included; a
    user's file elsewhere in the store is left alone."""
    from verl_prm.resume import temporary_path

    directory = tmp_path / "refresh"
    store = RefreshStore(directory, {"every": 1})
    store.write(_store_rows(1), [], torch.zeros(3), 0.0)
    store.close()

    def of_a_dead_writer(path):
        made = temporary_path(path)
        return made.with_name(made.name.removesuffix(str(os.getpid())) + "4194305")  # above any pid_max

    leftovers = [of_a_dead_writer(directory / "state" / "step_000002.safetensors"),
                 of_a_dead_writer(directory / "labels" / "step_000002.parquet"),
                 of_a_dead_writer(directory / "settings.json")]
    for path in leftovers:
        path.write_bytes(b"half written")
    users = [directory / "labels" / ".notes.parquet.tmp12", directory / ".tmpAb12cd"]
    for path in users:
        path.write_bytes(b"mine")
    store = RefreshStore(directory, {"every": 1})
    assert not [path for path in leftovers if path.exists()] and all(path.exists() for path in users)
    assert store.steps(10) == [1]
    store.write(_store_rows(2), [], torch.zeros(3), 0.0)
    assert store.steps(10) == [1, 2]
    store.close()
    for foreign in (".tmpAb12cd", ".step_000002.safetensors.tmp", ".step_000002.safetensors.tmp12x",
                    ".notes.safetensors.tmp12", ".step_000002.parquet.tmp12"):
        (directory / "state" / foreign).write_bytes(b"mine")
        with pytest.raises(ValueError, match=f"not the refresh store's own \\({re.escape(foreign)}; "):
            RefreshStore(directory, {"every": 1})
        assert (directory / "state" / foreign).exists()  # refused, not removed
        (directory / "state" / foreign).unlink()
    RefreshStore(directory, {"every": 1}).close()  # each refusal released the lock


@pytest.mark.parametrize("content, problem", [
    ("", "is empty"), ('{"every": ', "cannot be read as JSON"), ("[2]", r"its field|it is list"),
    ('"every"', "it is str"), (b"\xff\xfe", "cannot be read as JSON")])
def test_store_names_a_damaged_settings_file(tmp_path, content, problem):
    directory = tmp_path / "refresh"
    RefreshStore(directory, {"every": 2}).close()
    settings = directory / "settings.json"
    assert json.loads(settings.read_text()) == {"every": 2}
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".settings")]  # no temporary file left
    if isinstance(content, bytes):
        settings.write_bytes(content)
    else:
        settings.write_text(content)
    with pytest.raises(ValueError, match=f"{settings} .*{problem}.*restore it, or set verl_prm.refresh.directory"):
        RefreshStore(directory, {"every": 2})
    settings.write_text('{"every": 2}')
    RefreshStore(directory, {"every": 2}).close()  # the refusal released the lock


def test_labelled_rows_keep_the_positions_with_trials():
    features = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    trials = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([[0.5, 0.0, 1.0], [0.0, 1 / 3, 0.0]], dtype=torch.float64)
    rows = labelled_rows(5, features, targets, trials)
    assert rows.features.tolist() == [[0, 1], [4, 5], [8, 9]] and rows.trials.tolist() == [2, 1, 3]


@pytest.mark.parametrize("section, message", [
    ({"refresh": {"every": 2}, "critic": {"calibration": "CALIBRATION_FILE"}},
     "which verl_prm.refresh refits to the sampled values: set verl_prm.critic.calibration=none"),
    ({"refresh": {"every": -1}}, "verl_prm.refresh.every must be an integer >= 0, got -1"),
    ({"refresh": {"every": 2, "window": 0}}, "verl_prm.refresh.window must be an integer >= 1, got 0"),
    ({"refresh": {"every": 2}, "critic": {"format": "qwen_prm"}},
     "verl_prm.refresh.every=2 refits the value head of a learned PAV (verl_prm.critic.source=checkpoint, format "
     "value_head)"),
    ({"refresh": {"every": 2}, "critic": {"source": "sampled"}},
     "verl_prm.refresh.every=2 refits the value head of a learned PAV"),
    ({"refresh": {"every": 2, "prior_strength": -1.0}},
     "verl_prm.refresh.prior_strength must be >= 0 (a finite number), got -1.0"),
    ({"refresh": {"every": 2}, "placement": {"shard": "fsdp"}}, "set verl_prm.placement.shard=none"),
    ({"refresh": {"every": 2}, "critic": {"n_mc": 0}}, "verl_prm.critic.n_mc must be an integer >= 1"),
    ({"refresh": {"every": 2, "often": 1}}, "Known keys of verl_prm.refresh: every, window, prior_strength, directory"),
])
def test_refresh_section_errors_name_the_key(section, message, tmp_path):
    if section.get("critic", {}).get("calibration") == "CALIBRATION_FILE":
        (tmp_path / "calibration.json").write_text("{}")
        section = {**section, "critic": {"calibration": str(tmp_path / "calibration.json")}}
    with pytest.raises(ConfigError) as error:
        check_source_settings(read_hook_config(section))
    assert message in str(error.value)
    assert read_hook_config({"refresh": {"every": 3}}).refresh.every == 3
