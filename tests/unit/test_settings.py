"""Each setting is declared once (verl_prm.settings.setting, verl_prm.choices): the generated pav.yaml, the
command lines' flags and the docs of choices are read from the dataclasses; the estimator weights are bounded so
that every estimator stays finite."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import torch

from verl_prm.choices import PREFIX_RULES
from verl_prm.config import MAX_PROCESS_WEIGHT, PavConfig, read_pav_config
from verl_prm.config.hook import CriticSection, PlacementSection, StepsSection
from verl_prm.config.pav_yaml import PAV_YAML, render
from verl_prm.estimators import ESTIMATORS
from verl_prm.labeling.monte_carlo import LabelSettings
from verl_prm.settings import setting_type
from verl_prm.training.cli import train_parser
from verl_prm.training.config import TrainConfig

SETTINGS_CLASSES = (PavConfig, CriticSection, StepsSection, PlacementSection, TrainConfig, LabelSettings)


def test_committed_pav_yaml_is_the_generated_one():
    """pav.yaml is generated from PavConfig and HookConfig; any edit of either needs
    `python -m verl_prm.config.pav_yaml --write` (test_run_config checks that Hydra composes it into their
    defaults)."""
    assert PAV_YAML.read_text(encoding="utf-8") == render(), (
        "verl_prm/config/verl_prm/pav.yaml differs from the dataclasses: run python -m verl_prm.config.pav_yaml --write")


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda cls: cls.__name__)
def test_every_setting_has_a_doc_naming_each_of_its_choices(cls):
    """The drift this replaces: a comment listing 4 of the 6 critic formats. A choice list lives in a Literal; the
    field's doc (pav.yaml's comment, the flag's help) must name every choice of it."""
    for field in dataclasses.fields(cls):
        doc = field.metadata.get("doc", "")
        assert doc, f"{cls.__name__}.{field.name} has no doc"
        kind = setting_type(cls, field.name)[0]
        if typing.get_origin(kind) is typing.Literal:
            missing = [c for c in typing.get_args(kind) if not re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", doc)]
            assert not missing, f"{cls.__name__}.{field.name}'s doc does not name {missing}"


def test_every_train_setting_has_exactly_one_flag_with_its_default():
    parser = train_parser()
    by_dest: dict[str, list] = {}
    for action in parser._actions:
        if action.dest != "help":
            by_dest.setdefault(action.dest, []).append(action)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(by_dest) == sorted(names) and all(len(actions) == 1 for actions in by_dest.values())
    args = parser.parse_args(["--labels", "l", "--output-dir", "o", "--init", "m"])
    assert TrainConfig(**vars(args)) == TrainConfig(labels=["l"], output_dir="o", init="m")
    flipped = parser.parse_args(["--labels", "l", "--output-dir", "o", "--init", "m", "--no-prompt-value",
                                 "--no-resume", "--cpu", "--head-fit", "newton", "--freeze-backbone"])
    assert (flipped.use_prompt_value, flipped.resume, flipped.cpu, flipped.head_fit) == (False, False, True, "newton")


@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "argument --lr: must be > 0 (a finite number), got 'nan'"),
    (["--eval-fraction", "1"], "argument --eval-fraction: must be in [0, 1) (a finite number), got '1'"),
    (["--calibration", "sigmoid"], "argument --calibration: invalid choice: 'sigmoid'"),
])
def test_train_flags_check_the_settings_bounds_and_choices(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--labels", "l", "--output-dir", "o", "--init", "m", *argv])
    assert message in capsys.readouterr().err


def test_prefix_rules_are_one_vocabulary():
    assert PREFIX_RULES == ("every", "fixed", "first_pit")
    assert typing.get_args(setting_type(CriticSection, "prefix_rule")[0]) == PREFIX_RULES


# ------------------------------------------------------------------------------ bounded estimator weights


def _extreme_batch(groups: int = 2, per_group: int = 4, tokens: int = 2048, tokens_per_step: int = 1) -> dict:
    """Rewards of +-1e3 and prover values alternating 0/1 at every step: |progress| = 1 at each of 2048 steps,
    the largest process term a critic can give (and, with normalize, its std is large, so no division blows
    it up less than this)."""
    size = groups * per_group
    steps = tokens // tokens_per_step
    step_values = (torch.arange(steps) % 2).float().repeat(size, 1)
    step_values[::2] = 1 - step_values[::2]
    rewards = torch.zeros(size, tokens)
    rewards[:, -1] = torch.tensor([1e3 if i % 2 else -1e3 for i in range(size)])
    return dict(token_level_rewards=rewards, response_mask=torch.ones(size, tokens),
                index=[str(i // per_group) for i in range(size)],
                step_ids=(torch.arange(tokens) // tokens_per_step).repeat(size, 1), step_values=step_values,
                prompt_values=torch.zeros(size), num_steps=torch.full((size,), steps),
                # read by the tree estimators only
                leaf_counts=torch.ones(size, steps, dtype=torch.long), response_values=torch.zeros(size),
                response_leaf_counts=torch.ones(size, dtype=torch.long))


OPTION_SETS = [{}, {"normalize": True}, {"prime_reward_mask": "response"}, {"min_form_baseline": "step"},
               {"aggregation": "sum", "aggregate_weight": MAX_PROCESS_WEIGHT},
               {"aggregation": "sum", "aggregate_weight": -MAX_PROCESS_WEIGHT}]


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_every_estimator_is_finite_at_the_largest_weight(name, options):
    """Issue: alpha 1e22 gave pav_prime NaN advantages, 1e38 pav_pure. At the bound every estimator is finite for
    rewards in [-1e3, 1e3] and the largest process terms (also with 1 token per step, the most steps)."""
    for tokens_per_step in (1, 64):
        batch = _extreme_batch(tokens_per_step=tokens_per_step)
        config = {"adv_estimator": name, "pav": {"alpha": MAX_PROCESS_WEIGHT, **options}}
        advantages, returns = ESTIMATORS[name](**batch, config=config)
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all(), (name, options, tokens_per_step)
        assert advantages.abs().max() > 0


@pytest.mark.parametrize("key, value", [("alpha", MAX_PROCESS_WEIGHT * 1.000001), ("alpha", 1e22), ("alpha", 1e39),
                                        ("aggregate_weight", -MAX_PROCESS_WEIGHT * 1.000001),
                                        ("aggregate_weight", 1e38)])
def test_a_weight_above_the_bound_is_refused_naming_the_key_and_the_bound(key, value):
    low = "0" if key == "alpha" else "-1e+06"
    message = f"algorithm.pav.{key} must be in [{low}, 1e+06] (a finite number), got {float(value)!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_pav_config({"pav": {key: value}})
    with pytest.raises(ValueError, match=re.escape(message)):
        ESTIMATORS["pav_grpo"](**_extreme_batch(tokens=8), config={"adv_estimator": "pav_grpo", "pav": {key: value}})
    assert read_pav_config({"pav": {key: MAX_PROCESS_WEIGHT}}) == PavConfig(**{key: MAX_PROCESS_WEIGHT})


def test_every_sandbox_setting_is_a_reward_kwarg():
    """The code reward's kwargs are SandboxConfig's fields (no second list of them to drift)."""
    from verl_prm.code.sandbox_config import SandboxConfig
    from verl_prm.code.verl_score import sandbox_config

    values = {f.name: getattr(SandboxConfig(), f.name) for f in dataclasses.fields(SandboxConfig)}
    assert sandbox_config(**values) == SandboxConfig()
    assert sandbox_config(max_files=64, site_packages=True).max_files == 64
    with pytest.raises(TypeError, match=r"unknown reward_kwargs \['timeout'\]; known: \['timeout_s', "):
        sandbox_config(timeout=3)


def test_every_label_setting_has_exactly_one_flag_with_its_default():
    from verl_prm.labeling.cli import label_parser
    from verl_prm.labeling.monte_carlo import LabelSettings

    parser = label_parser()
    dests = [action.dest for action in parser._actions]
    names = [f.name for f in dataclasses.fields(LabelSettings) if f.name != "source"]  # source: the prover's path
    assert all(dests.count(name) == 1 for name in names) and "source" not in dests
    args = parser.parse_args(["--input", "x", "--output-dir", "o", "--policy", "p"])
    assert {name: getattr(args, name) for name in names} == {name: getattr(LabelSettings(), name) for name in names}
    args = parser.parse_args(["--input", "x", "--output-dir", "o", "--policy", "p", "--no-prompt-value",
                              "--prefix-rule", "fixed", "--code-rule", "block", "--code-depth", "1"])
    assert (args.prompt_value, args.prefix_rule, args.code_rule, args.code_depth) == (False, "fixed", "block", 1)


def _int_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if setting_type(cls, f.name)[0] is int]


def test_every_integer_knob_refuses_a_float_by_one_rule():
    """verl_prm.critic.mc_token_budget=1e3 (a float in YAML) was taken as 1000 while 2.5 was refused: every int
    field of every verl_prm section, of algorithm.pav and of the label and train settings takes an integer
    only; a whole float is refused with the integer to write, a bool too."""
    from verl_prm.config.hook import ConfigError, HookConfig, read_hook_config

    checked = 0
    for section in dataclasses.fields(HookConfig):
        section_cls = setting_type(HookConfig, section.name)[0]
        if not dataclasses.is_dataclass(section_cls):
            continue
        for name in _int_fields(section_cls):
            with pytest.raises(ConfigError, match=rf"^verl_prm\.{section.name}\.{name} must be an integer.*, got "
                                                   r"the float 1000\.0: write it as an integer \(1000\)$"):
                read_hook_config({section.name: {name: 1e3}})
            with pytest.raises(ConfigError, match=rf"verl_prm\.{section.name}\.{name} must be an integer.*got True"):
                read_hook_config({section.name: {name: True}})
            checked += 1
    assert checked >= 12 and "mc_token_budget" in _int_fields(setting_type(HookConfig, "critic")[0])
    assert read_hook_config({"critic": {"mc_token_budget": 1000}}).critic.mc_token_budget == 1000
    required = {TrainConfig: dict(labels=["l"], output_dir="o", init="m")}
    for cls in (PavConfig, LabelSettings, TrainConfig):
        for name in _int_fields(cls):
            value = getattr(cls(**required.get(cls, {})), name)
            whole = float(value if value is not None else 3)
            # (TrainConfig.keep_checkpoints has its own message: "got 2.0: the newest checkpoint ...")
            with pytest.raises(ValueError, match=rf"{name}.* must be an integer.*got (the float )?{whole!r}"):
                cls(**required.get(cls, {}), **{name: whole})
            checked += 1
    assert checked >= 25
