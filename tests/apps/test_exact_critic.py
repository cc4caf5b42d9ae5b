"""Exact prover critics (verl_prm.critic.exact) and the arithmetic task's exact prover: the closed form against an
enumeration of the scripted prover's continuations, the critic entry points against the prover on the texts,
the search's prefix critic, the verl worker with format "exact", and the startup checks of the config."""

from __future__ import annotations

import math
import random

import pytest
import torch

from verl_prm.critic.exact import (
    ExactCritic,
    ExactPrefixCritic,
    ProverOptionError,
    build_exact_prover,
    step_texts_at_char_ends,
)
from verl_prm.apps.arithmetic.prover import EXACT_PROVER, ArithmeticProver, parse_problem
from verl_prm.apps.arithmetic.task import (
    STEP_REGEX,
    Problem,
    TaskConfig,
    apply_op,
    compute_score,
    generate_problems,
    solution_lines,
)
from verl_prm.steps import step_char_spans


def regex_steps(text: str) -> list[str]:
    """The response's steps under the task's rule (one per operation result, the answer line last)."""
    return [text[s:e] for s, e in step_char_spans(text, None, regex=STEP_REGEX)]


# ---------------------------------------------------------------------------------------------- reference


def enumerated_success(problem: Problem, written_lines: list[str], written_values: list[int], p: float) -> float:
    """P(final answer right) of the scripted prover continuing after ``written_lines`` (the first lines of a
    solution, whose results are ``written_values``), by enumerating every continuation it can write: per
    remaining operation, the result computed from its last value (probability p) or each wrong result (a value
    other than the problem's true value there; probability (1 - p) / (number of such values)); then
    ``answer <last value>``. Each complete text is judged by the task's verifier."""
    m, n = problem.modulus, len(problem.ops)
    done = len(written_values)
    total = 0.0

    def walk(depth: int, x: int, lines: list[str], prob: float) -> None:
        nonlocal total
        if depth == n:
            text = "\n".join(lines + [f"answer {x}"])
            total += prob * compute_score("arithmetic_mod", text, problem.answer)
            return
        op, c = problem.ops[depth]
        computed = apply_op(x, op, c, m)
        carried = "".join(f" {o}{k}" for o, k in problem.ops[depth + 1:])
        wrong = [v for v in range(m) if v != problem.values[depth]]
        options = [(computed, p)] + [(v, (1 - p) / len(wrong)) for v in wrong]
        for value, weight in options:
            if weight > 0:
                walk(depth + 1, value, lines + [f"{x}{op}{c}={value}{carried}"], prob * weight)

    walk(done, written_values[-1] if written_values else problem.start, list(written_lines), 1.0)
    return total


def small_problems() -> list[Problem]:
    problems = []
    for modulus in (5, 7):
        config = TaskConfig(min_ops=1, max_ops=3, modulus=modulus, max_operand=modulus - 1, slip_rate=0.0)
        problems += generate_problems(6, config, seed=modulus)
    assert {len(p.ops) for p in problems} == {1, 2, 3}
    return problems


def solutions_with_slips(problem: Problem):
    """(lines, values written) of the correct solution and of every slip (each step, each wrong value)."""
    yield solution_lines(problem), list(problem.values)
    for h in range(len(problem.ops)):
        for wrong in range(problem.modulus):
            if wrong == problem.values[h]:
                continue
            lines = solution_lines(problem, h, wrong)
            values, x = [], problem.start
            for k, (op, c) in enumerate(problem.ops):
                x = wrong if k == h else apply_op(x, op, c, problem.modulus)
                values.append(x)
            yield lines, values


@pytest.mark.parametrize("p", [0.3, 0.8, 1.0])
def test_arithmetic_prover_equals_the_enumerated_scripted_prover(p):
    """v_h after each step of correct and slipped solutions == the probability-weighted share of the prover's
    continuations whose final answer is right; the whole response's value is its verifier outcome."""
    prover = ArithmeticProver(p)
    checked = 0
    for problem in small_problems():
        for lines, values in solutions_with_slips(problem):
            text = "\n".join(lines)
            steps = regex_steps(text)
            n = len(problem.ops)
            assert len(steps) == n + 1  # one step per operation result, then the answer line
            got = prover.values(problem.prompt_text + "\n", steps, sample=0)
            expected = [enumerated_success(problem, [], [], p)]
            for h in range(n):
                # the prefix after step h holds lines 0..h-1 and line h up to its result; the carried operations
                # of line h are what the prover writes first, so it continues after the whole of line h
                expected.append(enumerated_success(problem, lines[: h + 1], values[: h + 1], p))
            expected.append(compute_score("arithmetic_mod", text, problem.answer))
            assert len(got) == len(expected)
            for h, (a, b) in enumerate(zip(got, expected)):
                assert abs(a - b) <= 1e-12, (problem.prompt_text, text, h, got, expected)
            checked += 1
    assert checked > 100


def test_prefix_values_of_other_text_and_unfinished_prefixes():
    problem = Problem(5, (("+", 3), ("*", 4), ("-", 2)), 7)
    prover = ArithmeticProver(0.5)
    prompt = problem.prompt_text + "\n"
    assert prover.values(prompt, ["hello"], 0) == [0.125, 0.0]
    assert prover.values(prompt, [], 0) == [0.125]
    steps = regex_steps("\n".join(solution_lines(problem)))
    # unfinished: the prefix that wrote every result (and the answer line) is worth 1, not yet the outcome
    assert prover.values(prompt, steps[:3], 0, complete=False) == [0.125, 0.25, 0.5, 1.0]
    # finished after the last result without an answer line: the response is wrong
    assert prover.values(prompt, steps[:3], 0, complete=True) == [0.125, 0.25, 0.5, 0.0]
    # a prefix cut inside a number of the reference ("=1" of "=12") is no prefix of it
    twelve = Problem(5, (("+", 7), ("*", 1)), 13)
    assert prover.values(twelve.prompt_text, ["5+7=1"], 0, complete=False) == [0.25, 0.0]
    assert prover.values(twelve.prompt_text, ["5+7=12"], 0, complete=False) == [0.25, 0.5]


def test_problem_is_read_from_the_rendered_prompt():
    from verl_prm.apps.arithmetic.model import build_tokenizer, render

    problem = Problem(5, (("+", 3), ("*", 4), ("-", 2)), 7)
    rendered = render(build_tokenizer(), problem.prompt_text)
    assert parse_problem(rendered, 0) == problem
    # the last problem of the text counts (e.g. after a few-shot example)
    assert parse_problem("1 +1 mod 5\n" + rendered, 0) == problem
    with pytest.raises(ValueError, match=r"sample 4: no arithmetic problem .* in the prompt text 'what is 2\+2\?'"):
        parse_problem("what is 2+2?", 4)
    with pytest.raises(ValueError, match=r"sample 2: the problem '3 \*4 mod 8' .* no bijection"):
        parse_problem("3 *4 mod 8", 2)
    with pytest.raises(ValueError, match=r"sample 1: the problem '3 \*14 mod 7'"):
        parse_problem("3 *14 mod 7", 1)


@pytest.mark.parametrize(
    ("options", "option", "message"),
    [
        ({"step_accuracy": 1.5}, "step_accuracy", "step_accuracy must be a finite number in (0, 1], got 1.5"),
        ({"step_accuracy": math.nan}, "step_accuracy", "step_accuracy must be a finite number in (0, 1], got nan"),
        ({"step_accuracy": 0.0}, "step_accuracy", "step_accuracy must be a finite number in (0, 1], got 0.0"),
        ({"step_accuracy": True}, "step_accuracy", "step_accuracy must be a number in (0, 1], got True"),
        ({"step_accuracy": "0.8"}, "step_accuracy", "step_accuracy must be a number in (0, 1], got '0.8'"),
        ({}, "step_accuracy", "the arithmetic_mod exact prover needs step_accuracy"),
        ({"step_accuracy": 0.8, "temperature": 1.0}, "temperature",
         "unknown option 'temperature' of the arithmetic_mod exact prover; known: ['step_accuracy']"),
    ],
)
def test_prover_options_are_checked(options, option, message):
    with pytest.raises(ProverOptionError) as error:
        build_exact_prover(EXACT_PROVER, options)
    assert error.value.option == option
    assert message in str(error.value)


def test_provers_are_named_by_module_and_class():
    class Constant:
        @classmethod
        def from_options(cls, options):
            return cls()

        def values(self, prompt_text, step_texts, sample, complete=True):
            return [0.5] * (len(step_texts) + 1)

    assert isinstance(build_exact_prover(Constant, {}), Constant)
    assert build_exact_prover(EXACT_PROVER, {"step_accuracy": 0.5}).step_accuracy == 0.5
    with pytest.raises(ValueError, match="the exact prover 'verl_prm.apps.arithmetic.prover:NoSuchProver' cannot be imported"):
        build_exact_prover("verl_prm.apps.arithmetic.prover:NoSuchProver", {})
    with pytest.raises(ValueError, match="an exact prover is named 'module:Class'"):
        build_exact_prover("verl_prm.apps.arithmetic.prover.ArithmeticProver", {})
    with pytest.raises(ValueError, match="has no from_options"):
        build_exact_prover(object, {})


def test_prover_values_are_checked_by_the_critic():
    class Bad:
        def __init__(self, values):
            self.returned = values

        def values(self, prompt_text, step_texts, sample, complete=True):
            return self.returned

    with pytest.raises(ValueError, match=r"sample 3: the exact prover returned 1 values for 1 steps"):
        ExactCritic(Bad([0.5])).score_steps(["a", "b", "c", "d"], [[], [], [], ["x"]])
    with pytest.raises(ValueError, match=r"sample 0: the exact prover's value at step 0 is nan, not a probability"):
        ExactCritic(Bad([0.5, math.nan])).score_steps(["a"], [["x"]])


# ---------------------------------------------------------------------------------------------- critic


def arithmetic_samples(seed: int = 0):
    """(problem, response text) pairs: correct, slipped, truncated and other text, over small problems."""
    rng = random.Random(seed)
    out = []
    for problem in small_problems()[:6]:
        correct = "\n".join(solution_lines(problem))
        h = rng.randrange(len(problem.ops))
        wrong = next(v for v in range(problem.modulus) if v != problem.values[h])
        out += [(problem, correct), (problem, "\n".join(solution_lines(problem, h, wrong))),
                (problem, correct[: len(correct) // 2]), (problem, "no idea")]
    return out


def policy_batch(tokenizer, prompt_texts, responses, eos=True):
    """verl's layout: left-padded prompts, right-padded responses (+ EOS), the attention mask."""
    from verl_prm.apps.arithmetic.model import render

    prompt_ids = [tokenizer(render(tokenizer, q), add_special_tokens=False)["input_ids"] for q in prompt_texts]
    response_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
                    for r in responses]
    width_p, width_r = max(map(len, prompt_ids)), max(map(len, response_ids))
    pad = tokenizer.pad_token_id
    prompts = torch.full((len(prompt_ids), width_p), pad)
    out = torch.full((len(prompt_ids), width_r), pad)
    mask = torch.zeros(len(prompt_ids), width_p + width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        prompts[i, width_p - len(p):] = torch.tensor(p)
        out[i, : len(r)] = torch.tensor(r)
        mask[i, width_p - len(p): width_p + len(r)] = 1
    return prompts, out, mask


@pytest.fixture(scope="module")
def arithmetic_tokenizer():
    from verl_prm.apps.arithmetic.model import build_tokenizer

    return build_tokenizer()


def expected_scores(prover, prompt_texts, responses, split):
    """The prover called on each response's step texts, in the CriticScores layout."""
    rows = [prover.values(q, split.step_texts(b), b) for b, q in enumerate(prompt_texts)]
    width = split.step_ends.shape[1]
    step_values = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        step_values[b, : len(row) - 1] = torch.tensor(row[1:])
    return torch.tensor([row[0] for row in rows]), step_values


def test_exact_critic_policy_batch_equals_the_prover_on_the_texts(arithmetic_tokenizer):
    from verl_prm.apps.arithmetic.model import render
    from verl_prm.steps import split_steps

    tokenizer = arithmetic_tokenizer
    samples = arithmetic_samples()
    prompts, responses, mask = policy_batch(tokenizer, [p.prompt_text for p, _ in samples], [r for _, r in samples])
    split = split_steps(responses, mask[:, prompts.shape[1]:], tokenizer, None, regex=STEP_REGEX)
    critic = ExactCritic.from_options(EXACT_PROVER, step_accuracy=0.7)
    assert (critic.device.type, critic.best_of_k, critic.packing, critic.tokenizer) == ("cpu", 1, "none", None)
    prover = ArithmeticProver(0.7)
    rendered = [render(tokenizer, p.prompt_text) for p, _ in samples]
    prompt_values, step_values = expected_scores(prover, rendered, [r for _, r in samples], split)

    scores = critic.score_policy_batch(prompts, responses, mask, split, tokenizer)
    assert torch.equal(scores.num_steps, split.num_steps)
    assert torch.equal(scores.prompt_values, prompt_values) and torch.equal(scores.step_values, step_values)
    # the values are the task's truth: the correct responses end at 1, the others at 0
    last = scores.step_values[torch.arange(len(samples)), split.num_steps - 1]
    assert last.tolist() == [float(i % 4 == 0) for i in range(len(samples))]
    assert scores.prompt_values.tolist() == pytest.approx([0.7 ** len(p.ops) for p, _ in samples])

    # a split without texts: decoded with the policy tokenizer, steps end after their last token's characters
    bare = split_steps(responses, mask[:, prompts.shape[1]:], tokenizer, None, regex=STEP_REGEX)
    bare.texts, bare.step_char_ends = [], torch.zeros(0, 0, dtype=torch.long)
    again = critic.score_policy_batch(prompts, responses, mask, bare, tokenizer)
    assert torch.equal(again.step_values, step_values) and torch.equal(again.prompt_values, prompt_values)
    # given prompt texts are read as they are
    given = critic.score_policy_batch(prompts, responses, mask, split, None, prompt_texts=rendered)
    assert torch.equal(given.step_values, step_values)
    with pytest.raises(ValueError, match="ExactCritic.score_policy_batch reads text: pass policy_tokenizer"):
        critic.score_policy_batch(prompts, responses, mask, split, None)
    # an unreadable prompt names the sample of the whole batch
    with pytest.raises(ValueError, match="sample 13: no arithmetic problem"):
        critic.score_policy_batch(prompts, responses, mask, split, None, prompt_texts=rendered[:3] + ["?"] + rendered[4:],
                                  sample_offset=10)


def test_exact_critic_score_texts_splits_like_the_step_rule():
    critic = ExactCritic.from_options(EXACT_PROVER, step_accuracy=0.5)
    samples = arithmetic_samples()
    scores = critic.score_texts([p.prompt_text for p, _ in samples], [r for _, r in samples], regex=STEP_REGEX,
                                delimiter=None)
    prover = ArithmeticProver(0.5)
    for b, (problem, text) in enumerate(samples):
        steps = regex_steps(text)
        row = prover.values(problem.prompt_text, steps, b)
        assert int(scores.num_steps[b]) == len(steps)
        assert float(scores.prompt_values[b]) == row[0]
        assert scores.step_values[b, : len(steps)].tolist() == row[1:]


def test_step_texts_at_char_ends():
    assert step_texts_at_char_ends("ab=1 c=2\nanswer 2", [4, 8, 17], 0) == ["ab=1", " c=2", "\nanswer 2"]
    assert step_texts_at_char_ends("x=1 y=2 end", [3, 7, 11], 0) == ["x=1", " y=2", " end"]
    assert step_texts_at_char_ends("x=1 y=2 end  ", [3, 7, 11], 0) == ["x=1", " y=2", " end  "]
    assert step_texts_at_char_ends("abc", [], 0) == []
    with pytest.raises(ValueError, match=r"sample 5: step 1 ends at character 2, outside \[3, 3\]"):
        step_texts_at_char_ends("abc", [3, 2], 5)


def test_exact_prefix_critic_in_the_search():
    from verl_prm.search import BestOfNConfig, CachedCritic, best_of_n
    from verl_prm.search.nodes import Compute, Node

    problems = small_problems()[:3]
    prompts = [p.prompt_text for p in problems]
    critic = CachedCritic(ExactPrefixCritic(ExactCritic.from_options(EXACT_PROVER, step_accuracy=0.6), prompts))
    prover = ArithmeticProver(0.6)

    class FixedResponses:
        """Best-of-N's sampler: a slipped, a correct and a truncated response per problem."""

        def sample_responses(self, ids, n, seeds):
            out = []
            for i in ids:
                p = problems[i]
                h = len(p.ops) - 1
                wrong = (p.values[h] + 1) % p.modulus
                texts = ["\n".join(solution_lines(p, h, wrong)), "\n".join(solution_lines(p)),
                         "\n".join(solution_lines(p))[:6]]
                out.append([Node(i, tuple(regex_steps(t)), finished=True, num_tokens=len(t)) for t in texts][:n])
            return out

    results = best_of_n([0, 1, 2], FixedResponses(), critic, BestOfNConfig(n=3, rank="orm"))
    for r in results:
        assert "".join(r.node.steps) == "\n".join(solution_lines(problems[r.problem]))
        assert r.score == 1.0 and r.compute.critic_tokens == 0
    # the cached prefix values are the prover's, unfinished prefixes included
    node = Node(0, tuple(regex_steps("\n".join(solution_lines(problems[0]))))[:-1])
    prompt_values, step_values, num_steps = critic.prefix_values([node], {0: Compute()})
    expected = prover.values(prompts[0], list(node.steps), 0, complete=False)
    assert [float(prompt_values[0])] + step_values[0, : int(num_steps[0])].tolist() == expected
    with pytest.raises(ValueError, match="problem 7: no prompt text"):
        ExactPrefixCritic(prover, prompts).score_nodes([Node(7, ("x",))])


# ---------------------------------------------------------------------------------------------- worker


def test_worker_with_format_exact_equals_the_prover(worker_env, arithmetic_tokenizer, tmp_path):
    """ProverCriticWorker(format exact) on a verl DataProto, as the hook sends it, == the prover on the texts."""
    from verl import DataProto

    from verl_prm.config.hook import HookConfig, read_hook_config
    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker
    from verl_prm.apps.arithmetic.model import render
    from verl_prm.steps import split_steps
    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    tokenizer = arithmetic_tokenizer
    tokenizer.save_pretrained(tmp_path)
    hook = read_hook_config({"critic": {"source": "exact", "options": {"prover": "verl_prm.apps.arithmetic.prover:ArithmeticProver",
                                                                        "step_accuracy": 0.9}}})
    kwargs = critic_worker_kwargs(hook)
    assert kwargs == {"prover": EXACT_PROVER, "step_accuracy": 0.9}
    samples = arithmetic_samples(seed=1)
    prompts, responses, mask = policy_batch(tokenizer, [p.prompt_text for p, _ in samples], [r for _, r in samples])
    response_mask = mask[:, prompts.shape[1]:]
    split = split_steps(responses, response_mask, tokenizer, None, regex=STEP_REGEX)
    data = DataProto.from_dict(tensors={
        "prompts": prompts, "responses": responses, "attention_mask": mask, "step_ends": split.step_ends,
        "num_steps": split.num_steps, "step_ids": split.step_ids, "merged_steps": split.merged_steps,
        "step_char_ends": split.step_char_ends, "step_text_mask": response_mask,
    })

    worker = ProverCriticWorker(None, kwargs, policy_tokenizer_path=str(tmp_path))
    info = worker.init_model()
    assert info["device"] == "cpu" and info["packing"] == "none"
    out = worker.compute_step_values(data)
    rendered = [render(tokenizer, p.prompt_text) for p, _ in samples]
    prompt_values, step_values = expected_scores(ArithmeticProver(0.9), rendered, [r for _, r in samples], split)
    assert torch.equal(out.batch["num_steps"], split.num_steps)
    assert torch.equal(out.batch["prompt_values"], prompt_values)
    assert torch.equal(out.batch["step_values"], step_values)

    # the exact critic reads text: without the policy tokenizer the worker refuses to start
    with pytest.raises(ValueError, match="an exact prover reads the response text, so it needs policy_tokenizer_path"):
        ProverCriticWorker(None, kwargs).init_model()
    assert HookConfig().critic.source != "exact"


def test_hook_values_with_format_exact(worker_env, arithmetic_tokenizer, tmp_path):
    """The hook's critic worker values (jagged TransferQueue fields in, ``read_step_batch``, ``StepValues`` out)
    with an exact critic worker == split_steps + the prover on the texts."""
    from types import SimpleNamespace

    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from verl_prm.config.hook import read_hook_config
    from verl_prm.integrations.verl.sources import critic_worker_kwargs
    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker
    from verl_prm.integrations.verl.step_batch import read_step_batch
    from verl_prm.integrations.verl.value_sources import CriticWorkerValues
    from verl_prm.apps.arithmetic.model import render
    from verl_prm.steps import split_steps

    tokenizer = arithmetic_tokenizer
    tokenizer.save_pretrained(tmp_path)
    hook = read_hook_config({
        "critic": {"source": "exact", "options": {"prover": "verl_prm.apps.arithmetic.prover:ArithmeticProver", "step_accuracy": 0.75}},
        "steps": {"delimiter": None, "regex": STEP_REGEX},
    })
    worker = ProverCriticWorker(None, critic_worker_kwargs(hook), policy_tokenizer_path=str(tmp_path))
    worker.init_model()
    group = SimpleNamespace(world_size=1, compute_step_values=worker.compute_step_values)

    samples = arithmetic_samples(seed=2)
    prompt_rows = [tokenizer(render(tokenizer, p.prompt_text), add_special_tokens=False)["input_ids"]
                   for p, _ in samples]
    response_rows = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                     for _, r in samples]
    data = list_of_dict_to_tensordict([
        {"prompts": torch.tensor(p), "responses": torch.tensor(r), "response_mask": torch.ones(len(r), dtype=torch.long),
         "rm_scores": torch.zeros(len(r)), "uid": f"u{i}"} for i, (p, r) in enumerate(zip(prompt_rows, response_rows))])
    keys = [f"u{i}_0_0" for i in range(len(samples))]
    batch = read_step_batch(data, keys, [{}] * len(keys), 1, tokenizer, hook.steps, [tokenizer.eos_token_id])
    values = CriticWorkerValues(group).values(batch)

    _, responses, mask = policy_batch(tokenizer, [p.prompt_text for p, _ in samples], [r for _, r in samples])
    split = split_steps(responses, mask[:, -responses.shape[1]:], tokenizer, None, regex=STEP_REGEX)
    rendered = [render(tokenizer, p.prompt_text) for p, _ in samples]
    prompt_values, step_values = expected_scores(ArithmeticProver(0.75), rendered, [r for _, r in samples], split)
    assert torch.equal(batch.split.num_steps, split.num_steps)
    assert torch.equal(values.prompt_values, prompt_values)
    assert torch.equal(values.step_values, step_values)
    assert not batch.truncated.any()


# ---------------------------------------------------------------------------------------------- config


EXACT_OVERRIDES = ["verl_prm.critic.source=exact", "+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver",
                   "+verl_prm.critic.options.step_accuracy=0.8"]


def compose_verl(overrides):
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=["hydra.searchpath=[pkg://verl_prm.config]", "+verl_prm=pav",
                                                 *overrides])


def test_exact_overrides_compose_with_verl_and_pass_the_startup_check():
    """(verl's own config validation of a whole launcher with these overrides: tests/integration/test_launchers.py)"""
    from verl_prm.integrations.verl.run_config import validate_run_config
    from verl_prm.integrations.verl.sources import critic_worker_kwargs

    config = compose_verl(EXACT_OVERRIDES)
    hook, _ = validate_run_config(config)
    assert hook.critic.source == "exact" and hook.critic.path is None
    assert hook.critic.options == {"prover": "verl_prm.apps.arithmetic.prover:ArithmeticProver", "step_accuracy": 0.8}
    assert critic_worker_kwargs(hook) == {"prover": EXACT_PROVER, "step_accuracy": 0.8}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:NoSuchProver",
          "+verl_prm.critic.options.step_accuracy=0.8"],
         "verl_prm.critic.options.prover: the exact prover 'verl_prm.apps.arithmetic.prover:NoSuchProver' cannot be "
         "imported"),
        (["+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver", "+verl_prm.critic.options.step_accuracy=1.5"],
         "verl_prm.critic.options.step_accuracy: step_accuracy must be a finite number in (0, 1], got 1.5"),
        (["+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver", "+verl_prm.critic.options.step_accuracy=nan"],
         "verl_prm.critic.options.step_accuracy"),
        (["+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver"],
         "verl_prm.critic.options.step_accuracy: the arithmetic_mod exact prover needs step_accuracy"),
        (["+verl_prm.critic.options.prover=verl_prm.apps.arithmetic.prover:ArithmeticProver", "+verl_prm.critic.options.step_accuracy=0.8",
          "+verl_prm.critic.options.seed=3"],
         "verl_prm.critic.options.seed: unknown option 'seed' of the arithmetic_mod exact prover; known: ['step_accuracy']"),
        (["+verl_prm.critic.options.step_accuracy=0.8"],
         "verl_prm.critic.source=exact needs verl_prm.critic.options.prover"),
        (EXACT_OVERRIDES[1:] + ["verl_prm.critic.path=/some/critic"],
         "verl_prm.critic.path='/some/critic' is unused with verl_prm.critic.source=exact"),
    ],
)
def test_exact_startup_errors(overrides, message):
    from verl_prm.config.hook import ConfigError
    from verl_prm.integrations.verl.run_config import validate_run_config

    config = compose_verl(["verl_prm.critic.source=exact"] + overrides)
    with pytest.raises(ConfigError) as error:
        validate_run_config(config)
    assert message in str(error.value)

