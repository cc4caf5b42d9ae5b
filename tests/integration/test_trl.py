"""PAV-GRPO in TRL (``verl_prm.integrations.trl``) with real TRL, a tiny random Qwen2 policy of the arithmetic
recipe and a tiny random value-head critic, on CPU.

- alpha = 0: exactly TRL's own advantages on the same batch, for every ``scale_rewards`` and multi-objective
  aggregation, and the same loss for every TRL loss type;
- alpha > 0: the [B, T] advantages equal ``verl_prm.advantages`` called directly on independently computed steps
  and critic scores;
- a 3-step run (two weighted reward functions, ``num_iterations=2``, KL, ``dr_grpo``) trains and logs ``pav/*``;
- bad knobs and settings without one policy-written response per sample fail at construction, naming why.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl", reason="the trl extra is not installed: pip install 'verl-prm[trl]'")

from datasets import Dataset  # noqa: E402  (TRL's dependency)
from transformers import Qwen2Config, Qwen2ForTokenClassification  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from verl_prm import advantages as adv  # noqa: E402
from verl_prm.critic import ProverCritic  # noqa: E402
from verl_prm.integrations.trl import PavGRPOTrainer  # noqa: E402
from verl_prm.apps.arithmetic.model import ModelConfig, build_model, build_tokenizer, render  # noqa: E402
from verl_prm.apps.arithmetic.task import TaskConfig, extract_answer, generate_problems  # noqa: E402
from verl_prm.responses import truncated_responses  # noqa: E402
from verl_prm.steps import split_steps  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=128)
STEP_RULE = {"delimiter": None, "max_tokens": 4}  # fixed-size steps: several steps per random completion


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def critic(tokenizer, tmp_path_factory):
    """A random one-layer value-head critic (format value_head) that reads the policy's tokenizer."""
    directory = tmp_path_factory.mktemp("critic")
    torch.manual_seed(1)
    model = Qwen2ForTokenClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256))
    with torch.no_grad():  # a wider head: values spread over (0, 1) instead of ~0.5 everywhere
        model.score.weight.mul_(20.0)
    model.save_pretrained(directory)
    return ProverCritic.from_pretrained(str(directory), tokenizer=tokenizer, device="cpu")


@pytest.fixture(scope="module")
def dataset(tokenizer):
    problems = generate_problems(8, TaskConfig(min_ops=2, max_ops=3, modulus=7, max_operand=6), seed=0)
    return Dataset.from_dict({"prompt": [render(tokenizer, p.prompt_text) for p in problems],
                              "answer": [p.answer for p in problems]})


def correct(prompts, completions, answer, **kwargs):
    return [1.0 if extract_answer(c) == a else 0.0 for c, a in zip(completions, answer)]


def digits(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / 10 for c in completions]


def grpo_config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=20, max_steps=3, logging_steps=1, report_to="none",
                    learning_rate=1e-3, save_strategy="no", seed=0, temperature=1.0)
    settings.update(overrides)
    return GRPOConfig(**settings)


def make_trainer(tmp_path, tokenizer, critic, dataset, pav, steps=STEP_RULE, reward_funcs=(correct, digits),
                 model=None, **overrides) -> PavGRPOTrainer:
    model = model if model is not None else build_model(tokenizer, TINY, seed=0)
    return PavGRPOTrainer(model=model, reward_funcs=list(reward_funcs),
                          args=grpo_config(tmp_path, **overrides), train_dataset=dataset, processing_class=tokenizer,
                          critic=critic, steps=steps, pav=pav)


def trl_batch(trainer, dataset) -> dict:
    """TRL's own output for one generation batch (2 prompts x 4 completions), as GRPOTrainer computes it."""
    trainer.model.train()
    inputs = [dict(dataset[i]) for i in (0, 1) for _ in range(4)]
    torch.manual_seed(0)
    return GRPOTrainer._generate_and_score_completions(trainer, inputs)


# ----------------------------------------------------------------------------------------------------------
# alpha = 0: TRL's own advantages and loss
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_rewards, aggregation", [("group", "sum_then_normalize"),
                                                        ("batch", "sum_then_normalize"),
                                                        ("none", "sum_then_normalize"),
                                                        ("group", "normalize_then_sum")])
def test_alpha_zero_gives_trls_own_advantages(tmp_path, tokenizer, critic, dataset, scale_rewards, aggregation):
    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, {"alpha": 0.0}, scale_rewards=scale_rewards,
                           multi_objective_aggregation=aggregation, reward_weights=[1.0, 0.5])
    output = trl_batch(trainer, dataset)
    ours, metrics = trainer.pav_advantages(output)
    assert ours.shape == output["completion_ids"].shape
    assert torch.equal(ours, output["advantages"][:, None] * output["completion_mask"])
    assert metrics["pav/steps_per_response"] > 1


@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("bnpo", "token"), ("dr_grpo", "token"),
                                              ("dapo", "token"), ("cispo", "token"), ("sapo", "token"),
                                              ("luspo", "sequence"), ("vespo", "token"), ("grpo", "sequence")])
def test_alpha_zero_gives_trls_loss_for_every_loss_type(tmp_path, tokenizer, critic, dataset, loss_type, level):
    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, {"alpha": 0.0}, loss_type=loss_type,
                           importance_sampling_level=level)
    output = trl_batch(trainer, dataset)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the loss reads it
    theirs = trainer.compute_loss(trainer.model, output)
    ours = trainer.compute_loss(trainer.model, {**output, "advantages": trainer.pav_advantages(output)[0]})
    assert torch.isfinite(theirs)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# alpha > 0: the plugin's advantage math on the plugin's steps and critic scores
# ----------------------------------------------------------------------------------------------------------


def test_alpha_positive_equals_the_advantage_math(tmp_path, tokenizer, critic, dataset):
    pav = {"alpha": 2.0, "best_of_k": 2, "clip": 0.3, "normalize": True}
    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, pav)
    output = trl_batch(trainer, dataset)
    ours, metrics = trainer.pav_advantages(output)

    completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
    split = split_steps(completion_ids, completion_mask, tokenizer, None, max_tokens=4)
    scores = critic.score_policy_batch(output["prompt_ids"], completion_ids,
                                       torch.cat([output["prompt_mask"], completion_mask], dim=1), split)
    process = adv.process_scores(scores.step_values, scores.prompt_values, split.num_steps, best_of_k_k=2, clip=0.3,
                                 normalize=True)
    expected = adv.process_advantage(output["advantages"], process, split.step_ids, completion_mask, 2.0)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours, output["advantages"][:, None] * completion_mask)  # the process term is there
    real = process[adv.valid_steps(split.num_steps, process.shape[1])]
    assert math.isclose(metrics["pav/process_term/mean"], real.mean().item(), rel_tol=1e-5)
    assert metrics["pav/steps_per_response"] == split.num_steps.float().mean().item()


def _value_head_critic(vocabulary, directory, **load):
    """A random value-head critic saved with ``vocabulary`` (a tokenizer); ``load``: from_pretrained options."""
    torch.manual_seed(2)
    tokenizer = vocabulary
    model = Qwen2ForTokenClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=512))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return ProverCritic.from_pretrained(str(directory), device="cpu", **load)


def test_a_critic_with_another_tokenizer_reads_the_realigned_text(tmp_path, tokenizer, dataset, bpe_small):
    other = _value_head_critic(bpe_small, tmp_path / "other")
    trainer = make_trainer(tmp_path, tokenizer, other, dataset, {"alpha": 1.0})
    assert trainer._critic_policy_tokenizer is tokenizer  # re-tokenised: the critic cannot read policy ids
    output = trl_batch(trainer, dataset)
    ours, _ = trainer.pav_advantages(output)
    mask = output["completion_mask"]
    split = split_steps(output["completion_ids"], mask, tokenizer, None, max_tokens=4)
    scores = other.score_policy_batch(output["prompt_ids"], output["completion_ids"],
                                      torch.cat([output["prompt_mask"], mask], dim=1), split,
                                      policy_tokenizer=tokenizer)
    process = adv.process_scores(scores.step_values, scores.prompt_values, split.num_steps)
    torch.testing.assert_close(ours, adv.process_advantage(output["advantages"], process, split.step_ids, mask, 1.0))


def test_an_identical_tokenizer_loaded_from_disk_reads_the_policy_ids(tmp_path, tokenizer, dataset):
    # the critic's tokenizer is a copy of the policy's; a padded call stores padding settings in the policy
    # tokenizer's backend, which must not turn the fast path (the critic reads the policy's ids) into
    # re-tokenisation
    from transformers import PreTrainedTokenizerFast

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    copy = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tokenizer")
    critic = _value_head_critic(tokenizer, tmp_path / "copy", tokenizer=copy)
    tokenizer(["1+2", "3"], padding=True, padding_side="left")
    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, {"alpha": 1.0})
    assert trainer._critic_policy_tokenizer is None


def test_drop_truncated_and_unscorable_completions_get_no_process_term(tmp_path, tokenizer, critic, dataset):
    def sometimes_none(prompts, completions, **kwargs):
        return [None if i == 2 else 1.0 for i in range(len(completions))]

    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, {"alpha": 2.0, "drop_truncated": True},
                           reward_funcs=(sometimes_none,))
    output = trl_batch(trainer, dataset)
    # completions 0, 2 and 5 end with EOS (finished); the others hit max_completion_length (truncated)
    lengths = output["completion_mask"].sum(dim=1)
    for i in (0, 2, 5):
        output["completion_ids"][i, lengths[i] - 1] = tokenizer.eos_token_id
    truncated = truncated_responses(output["completion_ids"], lengths, trainer.eos_token_ids)
    assert truncated.tolist() == [i not in (0, 2, 5) for i in range(8)]
    ours, metrics = trainer.pav_advantages(output)
    outcome_only = output["advantages"][:, None] * output["completion_mask"]
    for i in range(8):
        if i in (0, 5):  # finished and scored: the process term is there
            assert not torch.equal(ours[i], outcome_only[i])
        else:  # truncated, or unscorable (row 2: every reward function returned None; TRL's advantage is 0)
            assert torch.equal(ours[i], outcome_only[i])
    assert float(output["advantages"][2]) == 0.0 and torch.all(ours[2] == 0)
    assert metrics["pav/truncated_share"] == 5 / 8


class TwoProcesses:
    """An accelerator stand-in for process ``index`` of two: ``gather`` stacks this process's tensor with the
    other process's tensor of the same call (recorded by a first pass as the other process)."""

    def __init__(self, index: int, other_calls: list | None = None):
        self.process_index, self.num_processes, self.device = index, 2, torch.device("cpu")
        self.other_calls, self.calls = list(other_calls or []), []

    def pad_across_processes(self, tensor, dim, pad_index):
        other = self.other_calls[0] if self.other_calls else tensor  # what the following gather() receives
        width = max(tensor.shape[1], other.shape[1])
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=pad_index)

    def gather(self, tensor):
        self.calls.append(tensor)
        other = self.other_calls.pop(0) if self.other_calls else tensor
        if tensor.dim() == 2:
            other = torch.nn.functional.pad(other, (0, tensor.shape[1] - other.shape[1]))
        parts = [tensor, other] if self.process_index == 0 else [other, tensor]
        return torch.cat(parts)


def test_several_processes_score_their_rows_and_normalise_over_the_whole_batch(tmp_path, tokenizer, critic, dataset):
    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, {"alpha": 2.0, "normalize": True})
    output = trl_batch(trainer, dataset)
    whole, whole_metrics = trainer.pav_advantages(output)  # one process: the reference
    halves = [{key: value[rows] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 8
               else value for key, value in output.items()} for rows in (slice(0, 4), slice(4, 8))]
    single = trainer.accelerator
    try:
        for me in (0, 1):
            trainer.accelerator = TwoProcesses(1 - me)  # first pass: the other process records its tensors
            trainer.pav_advantages(halves[1 - me])
            recorded = [t for t in trainer.accelerator.calls]
            trainer.accelerator = TwoProcesses(me, recorded)
            local, metrics = trainer.pav_advantages(halves[me])
            rows = slice(4 * me, 4 * me + 4)
            width = min(local.shape[1], whole.shape[1])
            torch.testing.assert_close(local[:, :width], whole[rows, :width])
            assert torch.all(local[:, width:] == 0) and torch.all(whole[rows, width:] == 0)
            assert metrics["pav/process_term/std"] == pytest.approx(whole_metrics["pav/process_term/std"])
    finally:
        trainer.accelerator = single


# ----------------------------------------------------------------------------------------------------------
# a real run
# ----------------------------------------------------------------------------------------------------------


def test_three_step_run_trains_and_logs_pav_metrics(tmp_path, tokenizer, critic, dataset):
    policy = tmp_path / "policy"  # a path: with beta > 0 TRL loads the reference model from it
    build_model(tokenizer, TINY, seed=0).save_pretrained(policy)
    trainer = make_trainer(tmp_path, tokenizer, critic, dataset, {"alpha": 3.0, "best_of_k": 4}, model=str(policy),
                           reward_weights=[1.0, 0.5], num_iterations=2, beta=0.04, loss_type="dr_grpo",
                           scale_rewards="batch", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    seen = []
    compute_loss = trainer._compute_loss

    def recording(model, inputs):
        seen.append(tuple(inputs["advantages"].shape))
        return compute_loss(model, inputs)

    trainer._compute_loss = recording
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert math.isfinite(entry["loss"]) and entry["grad_norm"] > 0
    # num_iterations=2 with 2 accumulation steps: a generation batch serves 2 optimizer steps, so TRL's reward
    # metrics and ours are logged at steps 1 and 3
    generated = [entry for entry in logs if "reward" in entry]
    assert [entry["step"] for entry in generated] == [1, 3]
    for entry in generated:
        for key in ("pav/steps_per_response", "pav/process_term/mean", "pav/process_term/std", "pav/v0_mean",
                    "pav/truncated_share", "pav/critic_seconds"):
            assert math.isfinite(entry[key]), key
    assert all(len(shape) == 2 for shape in seen) and len(seen) == 6  # [B, T] advantages reached the loss
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


# ----------------------------------------------------------------------------------------------------------
# construction errors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pav, steps, message", [
    ({"alpha": -1.0}, None, r"algorithm.pav.alpha must be in \[0, 1e\+06\]"),
    ({"alpha": 1e39}, None, r"algorithm.pav.alpha must be in \[0, 1e\+06\] \(a finite number\), got 1e\+39"),
    ({"best_of_k": 0}, None, "algorithm.pav.best_of_k must be an integer >= 1"),
    ({"clip": 0}, None, "algorithm.pav.clip must be > 0"),
    ({"normalize": "yes"}, None, "algorithm.pav.normalize must be true or false"),
    ({"drop_truncated": 1}, None, "algorithm.pav.drop_truncated must be true or false"),
    ({"alfa": 1.0}, None, r"unknown algorithm.pav keys \['alfa'\]"),
    ({"aggregation": "max"}, None, "algorithm.pav.aggregation belongs to another verl estimator"),
    ({"min_form_temperature": 0.2}, None, "algorithm.pav.min_form_temperature belongs to another verl estimator"),
    (None, {"regex": "("}, r"verl_prm.steps.regex '\(' is not a valid regex"),
    (None, {"max_tokens": 0}, "verl_prm.steps.max_tokens must be an integer >= 1"),
    (None, {"delimitr": "\n"}, "verl_prm.steps.delimitr"),
])
def test_bad_knobs_fail_at_construction_naming_the_key(critic, pav, steps, message):
    # the model does not exist: the knobs are checked before anything is loaded
    with pytest.raises(ValueError, match=message):
        PavGRPOTrainer(model="no/such-model", reward_funcs=[correct], critic=critic, steps=steps, pav=pav)


@pytest.mark.parametrize("setting", ["tools", "environment_factory", "rollout_func"])
def test_settings_without_one_response_per_sample_are_refused(critic, setting):
    def tool(x: int) -> int:
        """A tool.

        Args:
            x: a number.
        """
        return x

    value = {"tools": [tool], "environment_factory": object, "rollout_func": lambda *a, **k: None}[setting]
    with pytest.raises(ValueError, match=f"PavGRPOTrainer does not support {setting}=: .*single response per sample"):
        PavGRPOTrainer(model="no/such-model", reward_funcs=[correct], critic=critic, **{setting: value})


def test_best_of_k_twice_is_refused(tmp_path, tokenizer):
    critic = ProverCritic.__new__(ProverCritic)
    critic.best_of_k = 4
    with pytest.raises(ValueError, match="already applies Best-of-4 and pav.best_of_k=4"):
        PavGRPOTrainer(model="no/such-model", reward_funcs=[correct], critic=critic, pav={"best_of_k": 4})


def test_import_needs_no_verl_and_says_how_to_install_trl():
    code = ("import sys, verl_prm.integrations.trl; "
            "print(sorted(m for m in sys.modules if m == 'verl' or m.startswith('verl.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    code = "import sys; sys.modules['trl'] = None; import verl_prm.integrations.trl"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "verl_prm.integrations.trl needs TRL, which is not installed: pip install 'verl-prm[trl]'" in result.stderr
