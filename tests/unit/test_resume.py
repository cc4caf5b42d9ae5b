"""verl_prm.resume: the one "resume only with the same settings" check of the label store, the trainer, the refresh
store and the recipe's stages (each caller's own test checks its message; here the helper's contract)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from verl_prm.resume import (check_same_settings, jsonable, read_settings, settings_differences, temporary_path,
                             temporary_target, write_atomically, write_settings)


def test_settings_differences_name_each_changed_leaf():
    recorded = {"rl": {"steps": 40, "lr": 2e-4}, "arms": ["grpo", "pav_exact"], "seed": 0}
    current = {"rl": {"steps": 60, "lr": 2e-4}, "arms": ["grpo", "pav_learned"], "seed": 0, "new": 1}
    assert settings_differences(recorded, current) == [
        "arms[1]: 'pav_exact' -> 'pav_learned'", "new: None -> 1", "rl.steps: 40 -> 60"]
    # lists of another length are one leaf; ignored keys are top-level only
    assert settings_differences({"a": [1], "b": {"c": 1}, "c": 1}, {"a": [1, 2], "b": {"c": 2}, "c": 2},
                                ignore=("c",)) == ["a: [1] -> [1, 2]", "b.c: 1 -> 2"]
    assert settings_differences({"a": 1}, {"a": 1}) == []


def test_check_same_settings_names_the_source_every_difference_and_the_fix(tmp_path):
    check_same_settings({"a": 1, "b": 2}, {"a": 1, "b": 3}, source=tmp_path, what="labels", fix="x", ignore=("b",))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} holds labels made with other settings (a: 1 -> 2; "
                                                   "b: 2 -> 3): resume with the same settings, or use a new dir")):
        check_same_settings({"a": 1, "b": 2}, {"a": 2, "b": 3}, source=tmp_path, what="labels", fix="use a new dir")


@dataclass
class _Settings:
    steps: int
    arms: tuple


def test_jsonable_is_what_reads_back():
    value = {"settings": _Settings(3, ("a", "b")), "path": Path("/some/where"), "kind": _Settings}
    assert jsonable(value) == {"settings": {"steps": 3, "arms": ["a", "b"]}, "path": "/some/where",
                               "kind": str(_Settings)}


def test_write_is_atomic_and_read_names_a_damaged_file(tmp_path):
    path = tmp_path / "settings.json"
    assert read_settings(path, fix="start over") is None
    write_settings(path, {"b": 1, "a": [1, 2]})
    assert read_settings(path, fix="start over") == {"a": [1, 2], "b": 1}
    assert sorted(os.listdir(tmp_path)) == ["settings.json"]  # the temporary file was renamed
    marker = tmp_path / "DONE.json"
    marker.write_text(json.dumps({"settings": {"a": 1}, "outputs": {}}))
    assert read_settings(marker, fix="start over", field="settings") == {"a": 1}
    for content, problem in [("", "is empty"), ("  \n", "is empty"), ('{"a": [1,', "cannot be read as JSON"),
                             ("[1]", "does not hold a JSON object of settings (it is list)"),
                             ("null", "does not hold a JSON object of settings (it is NoneType)")]:
        path.write_text(content)
        with pytest.raises(ValueError, match=re.escape(f"{path} {problem}") + ".*restore it, or start over$"):
            read_settings(path, fix="start over")
    marker.write_text(json.dumps({"outputs": {}}))
    with pytest.raises(ValueError, match=re.escape(f"{marker} does not hold a JSON object of settings (its field "
                                                   "'settings' is NoneType)")):
        read_settings(marker, fix="start over", field="settings")
    directory = tmp_path / "dir.json"
    directory.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{directory} cannot be read as JSON (IsADirectoryError")):
        read_settings(directory, fix="start over")


def test_an_atomic_write_has_one_temporary_name_recognised_by_name_and_removed_when_the_write_fails(tmp_path):
    target = tmp_path / "step_000003.safetensors"
    temporary = temporary_path(target)
    assert temporary.parent == tmp_path and temporary.name == f".step_000003.safetensors.tmp{os.getpid()}"
    assert temporary_target(temporary.name) == "step_000003.safetensors"
    for foreign in (".tmpAb12cd", "step_000003.safetensors", ".step_000003.safetensors.tmp",
                    ".step_000003.safetensors.tmp12x", "step_000003.safetensors.tmp12", "..tmp12"):
        assert temporary_target(foreign) is None, foreign
    write_atomically(target, b"state")
    assert target.read_bytes() == b"state" and sorted(os.listdir(tmp_path)) == [target.name]
    blocked = tmp_path / "blocked"
    (blocked / "inside").mkdir(parents=True)  # a non-empty directory: the rename onto it fails
    with pytest.raises(OSError):
        write_atomically(blocked, b"state")
    assert sorted(os.listdir(tmp_path)) == ["blocked", target.name]  # no temporary file left behind
