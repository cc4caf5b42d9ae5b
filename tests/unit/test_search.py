"""Test-time search (verl_prm.search): the algorithms on a scripted task with a hand-traced run, the compute counters, and step-wise generation with tiny random
Qwen2 models (stopping at delimiters, batching), plus the `verl-prm search` recipe end to end."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from search_support import RecordingCritic
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from verl_prm.search import (
    BestOfNConfig,
    CachedCritic,
    GreedyConfig,
    Node,
    StepSample,
    beam_scores,
    greedy_step_search,
    response_scores,
    step_accepted,
    top_per_group,
)
from verl_prm.search.generation import HFStepSampler, first_step_end, delimiter_regex



# ------------------------------------------------------------------------------------------------ helpers
# ------------------------------------------------------------------------------------------------ pure rules
def test_top_per_group_equals_reference_loop():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (60,), generator=generator).double()  # many ties
    groups = torch.randint(0, 7, (60,), generator=generator)
    for k in (1, 2, 5, 100):
        expected = []
        for g in range(7):
            members = [i for i in range(60) if int(groups[i]) == g]
            members.sort(key=lambda i: (-float(scores[i]), i))
            expected += members[:k]
        assert top_per_group(scores, groups, k).tolist() == expected


def test_beam_scores_and_acceptance_by_hand():
    q = torch.tensor([0.2, 0.5])
    after, before = torch.tensor([0.5, 0.1]), torch.tensor([0.25, 0.3])
    # K = 1: Q + alpha * (v - v_parent)
    assert torch.allclose(beam_scores(q, after, before, 0.5), torch.tensor([0.2 + 0.5 * 0.25, 0.5 + 0.5 * -0.2]))
    # K = 2: BoK(v) = 1 - (1 - v)^2: 0.75, 0.4375 / 0.19, 0.51
    assert torch.allclose(beam_scores(q, after, before, 1.0, 2), torch.tensor([0.2 + 0.75 - 0.4375, 0.5 + 0.19 - 0.51]))
    assert torch.equal(beam_scores(q, None, None, 0.0), q)
    with pytest.raises(ValueError, match="prover values"):
        beam_scores(q, None, None, 0.5)
    accepted, scores = step_accepted(after, before, 0.0, "progress")
    assert accepted.tolist() == [True, False] and torch.allclose(scores, torch.tensor([0.25, -0.2]))
    accepted, _ = step_accepted(after, before, 0.5, "value")
    assert accepted.tolist() == [True, False]


def test_response_scores_orm_and_aggregates():
    prompt = torch.tensor([0.5, 0.4, 0.3])
    values = torch.tensor([[0.6, 0.2, 0.9], [0.8, 0.0, 0.0], [0.0, 0.0, 0.0]])
    steps = torch.tensor([3, 1, 0])
    assert torch.allclose(response_scores(prompt, values, steps, "orm"), torch.tensor([0.9, 0.8, 0.3]))
    assert torch.allclose(response_scores(prompt, values, steps, "min"), torch.tensor([0.2, 0.8, 0.0]))
    assert torch.allclose(response_scores(prompt, values, steps, "sum", "progress"), torch.tensor([0.4, 0.4, 0.0]))
    with pytest.raises(ValueError, match="rank"):
        BestOfNConfig(rank="median")


# ------------------------------------------------------------------------------------------------ toy task
class ScriptedSampler:
    """Step contents "d{depth}.{i}" (i counts samples per prefix); a response is finished at depth H."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.drawn: Counter = Counter()

    def sample_steps(self, nodes, n, seeds):
        out = []
        for node in nodes:
            group = []
            for _ in range(n):
                i = self.drawn[node.key]
                self.drawn[node.key] += 1
                group.append(StepSample(f"d{node.num_steps}.{i}|", 1, finished=node.num_steps + 1 == self.depth))
            out.append(group)
        return out


class ConstantCritic:
    def __init__(self, value: float) -> None:
        self.value = value

    def score_nodes(self, nodes):
        return [[self.value] * (n.num_steps + 1) for n in nodes], [n.num_steps + 1 for n in nodes]


def test_greedy_never_accepting_follows_the_hand_trace():
    """H = 3, R = 1 (2 samples per prefix), B = 2, nothing accepted. Trace: root draws 2, falls back to A;
    A draws 2, backtracks; root (spent) falls back to A' (A is abandoned); A' draws 2, backtracks; root falls
    back to A again (both abandoned, A first); A has spent its samples and no backtrack is left, so it falls
    back to its best child D2, which draws 2 and falls back to a finished depth-3 response: 8 samples,
    2 backtracks, 5 fallbacks."""
    sampler = ScriptedSampler(depth=3)
    config = GreedyConfig(threshold=2.0, accept_on="value", max_retries=1, max_backtracks=2, max_steps=3)
    (result,) = greedy_step_search([0], sampler, CachedCritic(ConstantCritic(0.5)), config)
    assert result.compute.step_samples == 8 <= config.max_step_samples == 12
    assert result.info == dict(accepted=0, rejected=8, backtracks=2, fallbacks=5, max_samples_at_a_prefix=2)
    assert result.node.steps == ("d0.0|", "d1.0|", "d2.0|")
    assert result.node.num_steps == 3 and result.node.finished and not result.node.truncated
    assert max(sampler.drawn.values()) == 2
    # accepting everything: one sample per step
    sampler = ScriptedSampler(depth=3)
    (result,) = greedy_step_search([0], sampler, CachedCritic(ConstantCritic(0.5)), GreedyConfig(threshold=0.0))
    assert result.compute.step_samples == 3 and result.info["accepted"] == 3 and result.info["backtracks"] == 0
    # a response longer than max_steps is truncated
    (result,) = greedy_step_search([0], ScriptedSampler(depth=9), CachedCritic(ConstantCritic(0.5)),
                                   GreedyConfig(threshold=0.0, max_steps=4))
    assert result.node.num_steps == 4 and result.node.truncated


# ------------------------------------------------------------------------------------------------ generation
def _qwen2_config(vocab: int, **extra) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, **extra)


def _biased_policy(tokenizer, logits: dict[str, float]) -> Qwen2ForCausalLM:
    """A random tiny Qwen2 whose next-token distribution is ~softmax(logits) over a few tokens at every
    position: dimension 0 of every embedding is large, so the final norm's output is ~constant there, and
    the LM head reads only that dimension."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_qwen2_config(len(tokenizer))).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0 / math.sqrt(32)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = -30.0
        for text, logit in logits.items():
            ids = tokenizer.encode(text, add_special_tokens=False) if text != "<eos>" else [tokenizer.eos_token_id]
            assert len(ids) == 1, text
            model.lm_head.weight[ids[0], 0] = logit
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


LOGITS = {"x": 1.0, " y": 0.5, "he": 0.3, "\n": 0.6, "<eos>": -1.5}


def _reference_step(model, tokenizer, text: str, seed: int, budget: int, pattern) -> tuple[str | None, int, bool]:
    """One row generated without stopping (the same seeded request, so the same tokens), then cut by a reference
    loop."""
    from verl_prm.generation import GenerationEngine, GenerationRequest

    engine = GenerationEngine(model, eos_token_ids=[tokenizer.eos_token_id], prefix_cache_tokens=0)
    (output,) = engine.generate([GenerationRequest(tokenizer(text, add_special_tokens=False)["input_ids"],
                                                   max_tokens=budget, temperature=1.0, top_p=1.0, seed=seed)])
    ids = output.token_ids
    for count in range(1, len(ids) + 1):
        if ids[count - 1] == tokenizer.eos_token_id:
            rest = tokenizer.decode(ids[: count - 1])
            return (rest if rest.strip() else None), count, True
        decoded = tokenizer.decode(ids[:count])
        end = first_step_end(decoded, pattern)
        if end is not None:
            return decoded[:end], count, False
    return tokenizer.decode(ids), len(ids), False


@pytest.mark.parametrize("delimiter", ["\n\n", "h"])
def test_hf_steps_stop_at_the_delimiter_exactly_as_a_reference_cut(bpe_large, delimiter):
    """Each step equals the reference: the continuation sampled with the same seed, cut after the first
    delimiter that follows non-whitespace text; its token count is the tokens up to the one completing the
    delimiter (with "h" the delimiter ends inside the token "he": its "e" is dropped but counted)."""
    model = _biased_policy(bpe_large, LOGITS)
    prompts = ["Question one?\n", "Another, longer question with more words?\n"]
    sampler = HFStepSampler(model, bpe_large, prompts, delimiter=delimiter, max_step_tokens=24,
                            max_response_tokens=60, batch_size=1)
    nodes = [Node(0), Node(1), Node(0, ("x y" + delimiter,), num_tokens=3)]
    seeds = [11, 22, 33]
    out = sampler.sample_steps(nodes, 1, seeds)
    pattern = delimiter_regex(delimiter)
    seen_cut = False
    for node, seed, (sample,) in zip(nodes, seeds, out):
        content, count, finished = _reference_step(model, bpe_large, sampler.text(node), seed, 24, pattern)
        assert (sample.content, sample.num_tokens, sample.finished) == (content, count, finished)
        if sample.content is not None and not sample.finished and count < 24:
            assert first_step_end(sample.content, pattern) == len(sample.content)
            seen_cut = True
    assert seen_cut
    # many samples: every unfinished step holds exactly one delimiter-ended step
    many = sampler.sample_steps([Node(0), Node(1)], 6, [5, 6])
    for group in many:
        for sample in group:
            assert 1 <= sample.num_tokens <= 24
            if sample.content is not None and not sample.finished and sample.num_tokens < 24:
                assert first_step_end(sample.content, pattern) == len(sample.content)


def test_hf_batching_with_left_padding_equals_one_by_one(bpe_large):
    """Greedy decoding of a random model: batched (left padded, rows sorted by budget) == one row at a time."""
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(_qwen2_config(len(bpe_large))).eval()
    prompts = ["Short?\n", "A much longer prompt, with many more tokens than the first one.\n", "Mid length prompt\n"]
    nodes = [Node(0), Node(1), Node(2, ("step one\n\n",), num_tokens=20), Node(1, ("a\n\n",), num_tokens=2)]
    results = []
    for batch_size in (4, 1):
        sampler = HFStepSampler(model, bpe_large, prompts, max_step_tokens=12, max_response_tokens=26,
                                temperature=0.0, batch_size=batch_size)
        results.append(sampler.sample_steps(nodes, 2, [1, 2, 3, 4]))
    assert results[0] == results[1]
    # the node with 20 of 26 tokens used gets a 6-token budget and is truncated there
    assert all(s.num_tokens == 6 and s.truncated for s in results[0][2])
    full = HFStepSampler(model, bpe_large, prompts, max_response_tokens=16, temperature=0.0).sample_responses([0, 2], 2, [1, 2])
    for group in full:
        for node in group:
            assert node.finished and node.num_tokens <= 16 and node.num_steps >= 1


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def text_models(tmp_path_factory, bpe_large):
    root = tmp_path_factory.mktemp("search_models")
    policy = _biased_policy(bpe_large, LOGITS)
    policy.save_pretrained(root / "policy")
    bpe_large.save_pretrained(root / "policy")
    for name, seed in (("q", 0), ("prover", 1)):
        torch.manual_seed(seed)
        critic = Qwen2ForTokenClassification(_qwen2_config(len(bpe_large), num_labels=1)).eval()
        critic.save_pretrained(root / name)
        bpe_large.save_pretrained(root / name)
    return root


def search_inputs(tmp_path, repo_data):
    """A reward file (even count of 'x': a policy-independent outcome) and three real GSM8K problems."""
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str.count('x') % 2 == 0)\n")
    data = tmp_path / "problems.jsonl"
    with open(repo_data / "gsm8k_test.jsonl") as f, open(data, "w") as g:
        for line, _ in zip(f, range(3)):
            g.write(line)
    return reward, data


def test_search_cli_text_runs_every_method_with_tiny_models(tmp_path, text_models, repo_data):
    from verl_prm.search.cli import main

    reward, data = search_inputs(tmp_path, repo_data)
    out = tmp_path / "text"
    args = ["--input", str(data), "--prompt-field", "question", "--answer-field", "answer",
            "--answer-regex", "#### (.*)", "--data-source", "openai/gsm8k", "--reward-fn", f"{reward}:score",
            "--policy", str(text_models / "policy"), "--q-critic", str(text_models / "q"),
            "--prover", str(text_models / "prover"), "--device", "cpu", "--n", "1,2", "--samples-per-beam", "2",
            "--max-step-tokens", "8", "--max-response-tokens", "24", "--max-steps", "4",
            "--methods", "best_of_n,beam_q,beam_pav,greedy", "--output-dir", str(out)]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 * 2 * 3
    for r in records:
        assert r["generated_tokens"] >= r["response_tokens"] >= 1
        assert r["critic_tokens"] > 0 and r["reward"] in (0.0, 1.0)
        assert r["response"].count("x") % 2 == (0 if r["reward"] else 1)
    assert (out / "accuracy_vs_compute.png").exists()


def test_cache_scores_only_the_longest_of_nested_prefixes():
    inner = RecordingCritic(ConstantCritic(0.25))
    critic = CachedCritic(inner)
    compute: dict = {}
    nodes = [Node(0), Node(0, ("a",)), Node(0, ("a", "b")), Node(1, ("c",)), Node(0, ("a", "b"))]
    assert critic.values(nodes, compute).tolist() == [0.25] * 5
    assert [key for key, _, _ in inner.scored] == [(0, ("a", "b")), (1, ("c",))]
    assert compute[0].critic_sequences == 1 and compute[0].critic_tokens == 3 and compute[1].critic_tokens == 2
    critic.values([Node(0, ("a",)), Node(0, ("a", "x"))], compute)  # only the new branch is scored
    assert [key for key, _, _ in inner.scored][2:] == [(0, ("a", "x"))] and inner.calls == 2


# ------------------------------------------------------------------------------------------------ steps sharing a critic token
def test_merge_shared_step_ends_by_hand():
    from verl_prm.steps import merge_shared_step_ends

    assert merge_shared_step_ends([5, 7, 7, 9, 9, 9, 12]) == ([5, 7, 9, 12], [0, 1, 1, 2, 2, 2, 3])
    assert merge_shared_step_ends([3, 4]) == ([3, 4], [0, 1])
    assert merge_shared_step_ends([]) == ([], [])
    with pytest.raises(ValueError, match=r"step_ends\[2\]=6 is before step_ends\[1\]=7: step ends must not decrease"):
        merge_shared_step_ends([5, 7, 6])


class PositionCritic:
    """A critic whose value at a read position is position / 1000, checking its inputs as ProverCritic does
    (ProverCritic's own ``score_step_spans`` over this ``score_sequences``)."""

    from verl_prm.critic import ProverCritic

    score_step_spans = ProverCritic.score_step_spans

    def __init__(self, tokenizer) -> None:
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.adapter = SimpleNamespace(text_input=False)
        self.calls: list[list[list[int]]] = []

    def score_sequences(self, input_ids, prompt_ends, step_ends):
        from verl_prm.critic import CriticScores
        from verl_prm.critic.packing import check_step_positions

        for i, (ids, prompt_end, ends) in enumerate(zip(input_ids, prompt_ends, step_ends)):
            check_step_positions(i, len(ids), prompt_end, ends)
        self.calls.append([list(e) for e in step_ends])
        width = max(len(e) for e in step_ends)
        values = torch.zeros(len(step_ends), width)
        for i, ends in enumerate(step_ends):
            values[i, : len(ends)] = torch.tensor(ends, dtype=torch.float32) / 1000
        return CriticScores(prompt_values=torch.tensor(prompt_ends, dtype=torch.float32) / 1000,
                            step_values=values, num_steps=torch.tensor([len(e) for e in step_ends]))


def test_text_critic_merges_steps_that_end_in_one_critic_token(bpe_large):
    """Issue 16: with the delimiter " ", the steps "x " and "y" both end in the critic token " y". The critic reads
    that token once, both steps get its value, and the merge is counted and warned about (it used to abort the
    search with `step_ends[1]=k must lie in (k, k+1)`)."""
    from verl_prm.search.generation import TextCritic

    assert bpe_large.convert_ids_to_tokens(bpe_large.encode("x y he", add_special_tokens=False)) == ["x", "Ġy", "Ġhe"]
    inner = PositionCritic(bpe_large)
    critic = TextCritic(inner, ["Question?\n", "Other?\n"])
    prompt_tokens = len(bpe_large.encode("Question?\n", add_special_tokens=False))
    x, y = prompt_tokens, prompt_tokens + 1  # positions of "x" and " y"
    nodes = [Node(0, ("x ", "y")), Node(1, ("x ", "y ", "he "))]
    with pytest.warns(UserWarning, match=r"problem 0: step 1 \('y'\) ends in the critic token that also ends step 0"):
        values, tokens = critic.score_nodes(nodes)
    # "x " ends at " y" (which holds its space), and so does "y": one read at " y" for both
    assert inner.calls[0][0] == [y]
    assert values[0] == pytest.approx([(x - 1) / 1000, y / 1000, y / 1000])
    assert critic.merged_steps == {0: 1}
    # "x ", "y ", "he " end in " y", " he" and " ": one read per step, nothing merged
    other = len(bpe_large.encode("Other?\n", add_special_tokens=False))
    assert inner.calls[0][1] == [other + 1, other + 2, other + 3]
    assert values[1] == pytest.approx([(other - 1) / 1000] + [(other + k) / 1000 for k in (1, 2, 3)])
    assert tokens == [prompt_tokens + 2, other + 4]
    # CachedCritic accepts the merged values (H + 1 per node)
    cached = CachedCritic(TextCritic(inner, ["Question?\n", "Other?\n"]))
    with pytest.warns(UserWarning, match="merged"):
        assert cached.values(nodes, {}).tolist() == pytest.approx([y / 1000, (other + 3) / 1000])


def test_search_cli_text_with_space_delimiter_merges_shared_critic_tokens(tmp_path, text_models, repo_data, capsys):
    """Issue 16 end to end: `--delimiter ' '` makes best-of-N responses whose last step ("y", "x") lies inside the
    critic token that ends the step before it (" y"); the sweep finishes, and the merges are counted per problem
    and reported."""
    from verl_prm.search.cli import main

    reward, data = search_inputs(tmp_path, repo_data)
    out = tmp_path / "space"
    args = ["--input", str(data), "--prompt-field", "question", "--answer-field", "answer",
            "--answer-regex", "#### (.*)", "--data-source", "openai/gsm8k", "--reward-fn", f"{reward}:score",
            "--policy", str(text_models / "policy"), "--q-critic", str(text_models / "q"), "--device", "cpu",
            "--n", "1", "--bon-n", "8", "--max-response-tokens", "24", "--methods", "best_of_n",
            "--delimiter", " ", "--output-dir", str(out)]
    with pytest.warns(UserWarning, match="ends in the critic token that also ends step"):
        assert main(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 3
    merged = sum(r["critic_merged_steps"] for r in records)
    assert merged > 0
    assert f"{merged} critic step values in" in capsys.readouterr().out


def test_search_plot_labels_several_ticks_on_a_log_axis_under_a_decade_and_a_half():
    """Issue 19: tokens from 22 to 450 used to get one labelled tick ("100"); 1-2-5 ticks label 20..500."""
    import matplotlib.pyplot as plt

    from verl_prm.search.cli import accuracy_vs_compute_figure

    rows = [dict(method=m, n=n, accuracy=0.01 * n, generated_tokens=t)
            for m, points in (("best_of_n", ((3, 22.6), (48, 358.0))), ("beam_pav", ((1, 28.2), (16, 452.4))))
            for n, t in points]
    figure = accuracy_vs_compute_figure(rows, "t")
    try:
        figure.canvas.draw()
        axis = figure.axes[0]
        low, high = axis.get_xlim()
        labelled = [(tick.get_position()[0], tick.get_text()) for tick in axis.xaxis.get_majorticklabels()
                    if tick.get_text() and low <= tick.get_position()[0] <= high]
        assert [text for _, text in labelled] == ["20", "50", "100", "200", "500"]
    finally:
        plt.close(figure)


# ------------------------------------------------------------------------------------------------ settings (SearchConfig)
SEARCH_MODELS = ["--input", "problems.jsonl", "--policy", "no/such/policy", "--q-critic", "no/such/critic"]


def test_every_search_flag_is_a_field_of_search_config():
    """`verl-prm search` builds one flag per SearchConfig field and nothing else; the defaults a bare command line
    parses to are the config's own, and those the command had before its flags were derived."""
    import dataclasses

    from verl_prm.cli_types import flag_of
    from verl_prm.search.cli import build_parser, search_config
    from verl_prm.search.config import SearchConfig

    fields = {f.name: f for f in dataclasses.fields(SearchConfig)}
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert sorted(a.dest for a in actions) == sorted(fields)
    assert all(a.option_strings == [flag_of(fields[a.dest])] for a in actions)
    assert all(a.help and a.help.startswith(fields[a.dest].metadata["doc"][:20]) for a in actions)

    config = search_config(build_parser().parse_args([*SEARCH_MODELS, "--output-dir", "out"]))
    assert config == SearchConfig(output_dir="out", input="problems.jsonl", policy="no/such/policy",
                                  q_critic="no/such/critic")
    # the hand-written flags' defaults before the config (verl_prm/search/cli.py at f00dd2a)
    assert (config.methods, config.n, config.bon_n, config.samples_per_beam, config.alpha, config.best_of_k,
            config.max_steps, config.rank, config.rank_scores, config.rank_critic, config.threshold,
            config.accept_on, config.max_backtracks, config.seed, config.limit) == (
        ("best_of_n", "beam_q", "beam_pav"), (1, 2, 4), None, 3, 0.5, 1, 32, "orm", "values", "q", None,
        "progress", 2, 0, None)
    assert (config.prompt_field, config.answer_field, config.data_source_field, config.q_critic_format,
            config.prover_format, config.backend, config.delimiter, config.max_step_tokens,
            config.max_response_tokens, config.temperature, config.top_p, config.batch_size) == (
        "prompt", "reward_model.ground_truth", "data_source", "value_head", "value_head", "hf", "\n\n", 256, 1024,
        1.0, 1.0, 32)
    parsed = search_config(build_parser().parse_args([*SEARCH_MODELS, "--output-dir", "out", "--n", "1,8",
                                                      "--methods", "greedy,beam_q", "--delimiter", "\\nStep"]))
    assert (parsed.n, parsed.methods, parsed.delimiter) == ((1, 8), ("greedy", "beam_q"), "\nStep")


def test_search_q_critic_format_offers_the_checkpoint_formats(capsys):
    """`--q-critic-format` and `--prover-format` list the formats ProverCritic loads (verl_prm.critic.formats'
    registry) and refuse any other, e.g. "exact", which reads no checkpoint."""
    from verl_prm.critic.formats import FORMATS
    from verl_prm.search.cli import build_parser

    parser = build_parser()
    choices = {a.dest: a.choices for a in parser._actions}
    assert sorted(choices["q_critic_format"]) == sorted(FORMATS) == sorted(choices["prover_format"])
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*SEARCH_MODELS, "--output-dir", "out", "--q-critic-format", "exact"])
    assert exit_info.value.code == 2
    assert "argument --q-critic-format: invalid choice: 'exact'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--samples-per-beam", "0"], "samples_per_beam (--samples-per-beam) must be an integer >= 1, got 0"),
    (["--max-response-tokens", "0"], "max_response_tokens (--max-response-tokens) must be an integer >= 1, got 0"),
    (["--limit", "0"], "limit (--limit) must be an integer >= 1, got 0"),
    (["--seed", "-1"], "seed (--seed) must be an integer >= 0, got -1"),
    (["--n", "2,4,2"], "n (--n) lists 2 more than once"),
    (["--methods", "beam_q,beam_q"], "methods (--methods) lists beam_q more than once"),
    (["--backend", "vllm", "--step-regex", "Step"], "step_regex (--step-regex) applies to the hf back end"),
    (["--step-regex", "x*"], "step_regex (--step-regex) 'x*' matches the empty string"),
    (["--step-regex", "("], "step_regex (--step-regex) is not a regex"),
    (["--delimiter", ""], "delimiter (--delimiter) must not be empty"),
])
def test_search_refuses_bad_settings_naming_field_and_flag_before_any_model_loads(tmp_path, monkeypatch, argv,
                                                                                    message):
    from verl_prm.search import cli

    def load(config):
        raise AssertionError("models loaded before the settings were checked")

    monkeypatch.setattr(cli, "_text_setup", load)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as error:
        cli.main([*SEARCH_MODELS, "--output-dir", str(out), *argv])
    assert message in str(error.value)
    assert not out.exists()


@pytest.mark.parametrize("settings, message", [
    (dict(top_p=0.0), "top_p (--top-p) must be in (0, 1] (a finite number), got 0.0"),
    (dict(alpha=-0.5), "alpha (--alpha) must be >= 0 (a finite number), got -0.5"),
    (dict(temperature=math.inf), "temperature (--temperature) must be >= 0 (a finite number), got inf"),
    (dict(threshold=math.nan), "threshold (--threshold) must be a finite number, got nan"),
    (dict(samples_per_beam=2.0), "samples_per_beam (--samples-per-beam) must be an integer >= 1, got the float 2.0: "
                                 "write it as an integer (2)"),
    (dict(best_of_k=True), "best_of_k (--best-of-k) must be an integer >= 1, got True"),
    (dict(n=(1, 0)), "n (--n)[1] must be an integer >= 1, got 0"),
    (dict(n=()), "n (--n) must be one or more integers >= 1, got ()"),
    (dict(bon_n="8"), "bon_n (--bon-n) must be one or more integers >= 1, got '8'"),
    (dict(methods=("beam",)), "methods (--methods): unknown method(s) ['beam']"),
    (dict(methods="greedy"), "methods (--methods) must name one or more of"),
    (dict(q_critic_format="exact"), "q_critic_format (--q-critic-format) must be one of ('value_head', "),
    (dict(rank="median"), "rank (--rank) must be one of ('orm', 'min', "),
    (dict(accept_on="values"), "accept_on (--accept-on) must be one of ('value', 'progress'), got 'values'"),
])
def test_search_config_from_python_refuses_bad_values_naming_field_and_flag(settings, message):
    from verl_prm.search.config import SearchConfig

    with pytest.raises(ValueError) as error:
        SearchConfig(output_dir="out", input="problems.jsonl", policy="p", q_critic="q", **settings)
    assert message in str(error.value)


def test_search_config_resolves_the_sweep_defaults():
    """Best-of-N's sample counts default to N * M, greedy's threshold to 0 for progress and 0.5 for value."""
    from verl_prm.search.config import SweepConfig

    sweep = SweepConfig(output_dir="out", n=[1, 4], samples_per_beam=3, methods=["greedy"])
    assert (sweep.n, sweep.methods) == ((1, 4), ("greedy",))
    assert (sweep.best_of_n_sizes, sweep.greedy_threshold) == ((3, 12), 0.0)
    assert SweepConfig(output_dir="out", bon_n=(5,), accept_on="value").best_of_n_sizes == (5,)
    assert SweepConfig(output_dir="out", accept_on="value").greedy_threshold == 0.5
    assert SweepConfig(output_dir="out", threshold=0.25).greedy_threshold == 0.25
