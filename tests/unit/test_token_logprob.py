"""Critic format token_logprob (issue 57 item 3): the step statistics, prefix minima and result claims against
loops; the chunked token log-probs against one forward pass per token; ProverCritic.score_sequences / score_texts
(packed, padded, several micro-batches, features, calibration) against a computation from the formulas; the head
files' round trip and refusals; the fit recovering a planted dependence through `verl-prm train --format
token_logprob`, its output directory rules."""

from __future__ import annotations

import json
import math
import re
import shutil
import stat

import numpy as np
import pandas as pd
import pytest
import torch

from verl_prm.checkpoints import CheckpointError
from verl_prm.critic.token_logprob import (cumulative_min, feature_names, prefix_min, result_claims, result_span,
                                           step_features, step_logprob_stats, step_token_ranges, token_logprobs)
from verl_prm.critic.token_logprob_head import HEAD_JSON, HEAD_SAFETENSORS, TokenLogprobHead, read_head, write_head

REGEX = r"(?m)= *(-?\d+)\.?$|answer is (\d+)"
PROMPTS = ["Q: 3 + 4?\n", "Q: Tom has 5 apples and buys 2 more. How many?\n", "Q: 5 * 2?\n"]
RESPONSES = ["3 + 4 = 7.\nThe answer is 7.", "5 + 2 = 7.\nHe has 7.\nThe answer is 7.",
             "5 * 2 = 11.\nok\nThe answer is 11."]


# ------------------------------------------------------------------------------------------------ pure functions


def test_step_statistics_prefix_min_and_features_against_loops():
    rng = np.random.default_rng(0)
    logprobs = -rng.exponential(size=40)
    ends = [3, 9, 9, 10, 25, 39]  # a step sharing its end token with the previous one reads that token alone
    ranges = step_token_ranges(ends)
    previous, want_ranges = -1, []
    for end in ends:
        want_ranges.append((end, end + 1) if end == previous else (previous + 1, end + 1))
        previous = end
    assert ranges == want_ranges
    claims = [[np.array([1, 2])], [], [np.array([9])], [], [np.array([12]), np.array([20, 21, 22])], [np.array([39])]]
    stats = step_logprob_stats(logprobs, ranges, claims)
    plain = step_logprob_stats(logprobs, ranges)
    for h, (lo, hi) in enumerate(ranges):
        tokens = [logprobs[t] for t in range(lo, hi)]
        assert stats[h, 0] == min(tokens) and math.isclose(stats[h, 1], sum(tokens) / len(tokens), rel_tol=1e-12)
        sums = [sum(logprobs[t] for t in claim) for claim in claims[h]]
        assert math.isclose(stats[h, 2], min(sums) if sums else min(tokens), rel_tol=1e-12)
    assert np.array_equal(plain, stats[:, :2])
    cummin = prefix_min(stats)
    for h in range(len(ends)):
        for k in range(3):
            assert cummin[h, k] == min(stats[j, k] for j in range(h + 1))
    assert np.array_equal(step_features(stats), np.concatenate([cummin, stats], 1))
    assert feature_names(True) == ("prefix_min_min_logprob", "prefix_min_mean_logprob", "prefix_min_result_logprob",
                                   "min_logprob", "mean_logprob", "result_logprob")
    rollout = np.array([0, 0, 1, 1, 1, 2])
    grouped = cumulative_min(stats, rollout)
    for i in range(len(rollout)):
        assert np.array_equal(grouped[i], stats[[j for j in range(i + 1) if rollout[j] == rollout[i]]].min(0))
    with pytest.raises(ValueError, match="non-decreasing"):
        step_token_ranges([4, 2])
    with pytest.raises(ValueError, match="inside the 40 response tokens"):
        step_logprob_stats(logprobs, [(0, 41)])


def test_result_claims_are_the_tokens_sharing_a_character_with_the_first_group_that_took_part():
    pattern = re.compile(REGEX)
    tokens = ["3", " +", " 4", " =", " 7", ".\n", "The", " answer", " is", " 7", ".", "\n", "ok", "\n"]
    text = "".join(tokens)
    char_ends = np.cumsum([len(t) for t in tokens])
    starts = char_ends - [len(t) for t in tokens]
    ranges = [(0, 6), (6, 12), (12, 14)]
    claims = result_claims(text, char_ends, ranges, pattern)
    for (lo, hi), mine in zip(ranges, claims):
        step = text[starts[lo]:char_ends[hi - 1]]
        want = []
        for match in pattern.finditer(step):  # the reference: first participating group, token character sets
            group = next(g for g in (1, 2) if match.group(g) is not None)
            chars = set(range(starts[lo] + match.start(group), starts[lo] + match.end(group)))
            want.append([t for t in range(len(tokens)) if chars & set(range(starts[t], char_ends[t]))])
        assert [c.tolist() for c in mine] == want
    assert [[c.tolist() for c in step] for step in claims] == [[[4]], [[9]], []]
    assert result_span(re.match(r"(a)?(b)", "b")) == (0, 1) and result_span(re.match(r"(x*)y", "y")) is None


# ------------------------------------------------------------------------------------------------ a tiny policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from tiny_model import write_tiny_causal_lm

    texts = [p + r for p, r in zip(PROMPTS, RESPONSES)] * 3
    return write_tiny_causal_lm(texts, tmp_path_factory.mktemp("token_logprob") / "policy", vocab_size=300,
                                hidden_size=32, num_layers=1)


HEAD_WEIGHT = np.array([0.7, -0.2, 0.4, 0.3, -0.5, 0.1])


def planted_head(regex: str | None = REGEX) -> TokenLogprobHead:
    width = len(feature_names(regex is not None))
    return TokenLogprobHead(feature_names(regex is not None), regex, HEAD_WEIGHT[:width],
                            np.linspace(-4.0, -2.0, width), np.linspace(0.5, 1.5, width), 0.25, -0.4)


@pytest.fixture(scope="module")
def checkpoint(policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("token_logprob_ckpt") / "critic"
    shutil.copytree(policy, path)
    write_head(path, planted_head())
    return path


def per_token_logprobs(policy, ids: list[int], first: int) -> list[float]:
    """l_t for t >= first: the causal LM on the tokens before t alone, one forward pass per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(torch.log_softmax(model(input_ids=torch.tensor([ids[:t]])).logits[0, -1], -1)[ids[t]])
                for t in range(first, len(ids))]


def reference_values(policy, prompt: str, response: str, regex: str | None) -> tuple[list[float], list[list[float]]]:
    """v_0..v_H of one text sample from the formulas: the per-token l_t, each step's tokens (after the previous
    step's last token up to its own), its result tokens from the tokenizer's character offsets, prefix minima,
    sigmoid of the standardised head; and the features."""
    from verl_prm.critic.loading import load_critic_tokenizer  # the tokenizer as saved (tokenizer.json)
    from verl_prm.steps import step_char_spans

    tokenizer = load_critic_tokenizer(policy)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    encoded = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
    logprobs = per_token_logprobs(policy, prompt_ids + encoded["input_ids"], len(prompt_ids))
    offsets = encoded["offset_mapping"]
    head, rows, previous = planted_head(regex), [], -1
    for start, end in step_char_spans(response, "\n"):
        last = next(t for t, (a, b) in enumerate(offsets) if a <= end - 1 < b)
        mine = logprobs[previous + 1:last + 1]
        row = [min(mine), sum(mine) / len(mine)]
        if regex is not None:
            sums = []
            for match in re.finditer(regex, response[start:end]):
                group = next(g for g in range(1, match.re.groups + 1) if match.group(g) is not None)
                chars = set(range(start + match.start(group), start + match.end(group)))
                sums.append(sum(logprobs[t] for t, (a, b) in enumerate(offsets) if chars & set(range(a, b))))
            row.append(min(sums) if sums else min(mine))
        rows.append(row)
        previous = last
    features = [[min(r[k] for r in rows[:h + 1]) for k in range(len(rows[0]))] + rows[h] for h in range(len(rows))]
    values = [1 / (1 + math.exp(-head.prompt_logit))]
    for f in features:
        logit = sum(w * (x - m) / s for w, x, m, s in zip(head.weight, f, head.mean, head.std)) + head.bias
        values.append(1 / (1 + math.exp(-logit)))
    return values, features


@pytest.fixture(scope="module")
def references(policy):
    return [reference_values(policy, p, r, REGEX) for p, r in zip(PROMPTS, RESPONSES)]


def test_chunked_token_logprobs_equal_one_forward_pass_per_token(policy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    ids = list(range(3, 40))
    want = per_token_logprobs(policy, ids, 1)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        for chunk in (1, 5, 1000):
            got = token_logprobs(hidden[:-1], torch.tensor(ids[1:]), model.lm_head, chunk)
            assert got.dtype == torch.float32 and np.allclose(got.numpy(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("packing, budget", [("padded", 16384), ("varlen", 16384), ("padded", 40)])
def test_score_texts_equals_the_formulas(checkpoint, references, packing, budget):
    from verl_prm.critic import ProverCritic

    critic = ProverCritic.from_pretrained(str(checkpoint), format="token_logprob", device="cpu", packing=packing,
                                          max_tokens_per_batch=budget)
    scores = critic.score_texts(PROMPTS, RESPONSES, delimiter="\n")
    for b, (values, _) in enumerate(references):
        assert int(scores.num_steps[b]) == len(values) - 1
        got = [float(scores.prompt_values[b])] + scores.step_values[b, : len(values) - 1].tolist()
        assert np.allclose(got, values, atol=1e-5, rtol=0)


def test_score_sequences_with_features_and_calibration(checkpoint, references, tmp_path):
    from verl_prm.checkpoints import weights_digest
    from verl_prm.critic import ProverCritic
    from verl_prm.steps import encode_with_step_ends, step_char_spans
    from verl_prm.training.calibration import fit_calibration, write_calibration

    critic = ProverCritic.from_pretrained(str(checkpoint), format="token_logprob", device="cpu")
    encoded = [encode_with_step_ends(critic.tokenizer, p, r, step_char_spans(r, "\n"))
               for p, r in zip(PROMPTS, RESPONSES)]
    scores = critic.score_sequences([e.input_ids for e in encoded], [e.prompt_end for e in encoded],
                                    [e.step_ends for e in encoded], num_step_slots=5, with_features=True)
    assert scores.step_values.shape == (3, 5) and scores.features.shape == (3, 6, 6)
    for b, (values, features) in enumerate(references):
        assert np.allclose(scores.step_values[b, : len(values) - 1].numpy(), values[1:], atol=1e-5, rtol=0)
        assert np.allclose(scores.features[b, 1: len(values)].numpy(), features, atol=1e-4, rtol=0)
        assert not scores.features[b, 0].any()  # v_0 reads no feature
    # a calibration fitted for these weights (the head's safetensors included) maps every value
    calibrated_dir = tmp_path / "calibrated"
    shutil.copytree(checkpoint, calibrated_dir)
    raw = np.tile(np.concatenate([np.asarray(v) for v, _ in references]), 3)  # >= 32 labels to fit on
    calibration = fit_calibration("platt", raw, (raw > 0.3).astype(float) * 0.8 + 0.1, np.ones(raw.size),
                                  weights_digest(calibrated_dir))
    write_calibration(calibration, calibrated_dir)
    mapped = ProverCritic.from_pretrained(str(calibrated_dir), format="token_logprob", device="cpu")
    got = mapped.score_texts(PROMPTS, RESPONSES, delimiter="\n")
    for b, (values, _) in enumerate(references):
        want = calibration(np.asarray(values))
        assert np.allclose([float(got.prompt_values[b]), *got.step_values[b, : len(values) - 1].tolist()], want,
                           atol=1e-5, rtol=0)
    # the head is part of the weights the calibration was fitted for
    write_head(calibrated_dir, planted_head(None))
    with pytest.raises(ValueError, match="other weights"):
        ProverCritic.from_pretrained(str(calibrated_dir), format="token_logprob", device="cpu")


# ------------------------------------------------------------------------------------------------ the head files


def test_head_round_trip_and_clear_refusals(checkpoint, policy, tmp_path):
    from verl_prm.critic import ProverCritic

    head = read_head(checkpoint)
    want = planted_head()
    assert head.features == want.features and head.result_regex == REGEX
    for name in ("weight", "mean", "std"):
        assert np.array_equal(getattr(head, name), getattr(want, name))
    assert (head.bias, head.prompt_logit) == (want.bias, want.prompt_logit)

    def damaged(edit) -> str:
        path = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        for name in (HEAD_JSON, HEAD_SAFETENSORS):
            shutil.copy(checkpoint / name, path / name)
        edit(path)
        return str(path)

    with pytest.raises(CheckpointError, match=f"{HEAD_JSON} is missing.*verl-prm train --format token_logprob"):
        read_head(damaged(lambda p: (p / HEAD_JSON).unlink()))
    with pytest.raises(CheckpointError, match=f"{HEAD_SAFETENSORS} is missing"):
        read_head(damaged(lambda p: (p / HEAD_SAFETENSORS).unlink()))

    def edit_json(**changes):
        def edit(path):
            data = json.loads((path / HEAD_JSON).read_text())
            (path / HEAD_JSON).write_text(json.dumps({**data, **changes}))
        return edit

    with pytest.raises(CheckpointError, match="belong together"):
        read_head(damaged(edit_json(result_regex=None, features=list(feature_names(False)))))
    with pytest.raises(CheckpointError, match="version 2"):
        read_head(damaged(edit_json(version=2)))
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        read_head(damaged(lambda p: (p / HEAD_JSON).write_text("{")))
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        read_head(damaged(lambda p: (p / HEAD_SAFETENSORS).write_bytes(b"\x00" * 5)))
    with pytest.raises(ValueError, match="std must be > 0"):
        write_head(tmp_path, TokenLogprobHead(feature_names(False), None, np.ones(4), np.zeros(4), np.zeros(4), 0, 0))
    with pytest.raises(ValueError, match="4 finite numbers"):
        write_head(tmp_path, TokenLogprobHead(feature_names(False), None, [1, 2, np.nan, 4], np.zeros(4), np.ones(4),
                                              0, 0))
    with pytest.raises(ValueError, match="no capture group"):
        write_head(tmp_path, planted_head("= 7"))
    with pytest.raises(TypeError, match="takes no options"):
        ProverCritic.from_pretrained(str(checkpoint), format="token_logprob", device="cpu", result_regex="(x)")
    with pytest.raises(CheckpointError, match="format 'token_logprob' needs"):
        ProverCritic.from_pretrained(str(policy), format="token_logprob", device="cpu")


# ------------------------------------------------------------------------------------------------ the fit


def label_rows(rows: list[tuple[str, str]], q_of, prompt_value: float = 0.6) -> list[dict]:
    """Label rows (steps at newlines) with exact labels (n_mc 0) q_of(row, step)."""
    from verl_prm.steps import step_char_spans

    out = []
    for i, (prompt, response) in enumerate(rows):
        spans = step_char_spans(response, "\n")
        q = [q_of(i, h) for h in range(len(spans))]
        out.append({"prompt_index": i, "rollout_index": 0, "data_source": "tiny", "prompt": prompt,
                    "ground_truth": "0", "response": response, "step_starts": [a for a, _ in spans],
                    "step_ends": [b for _, b in spans], "q": q, "n_success": [0] * len(q), "n_mc": [0] * len(q),
                    "first_pit": -1, "prompt_value": prompt_value, "prompt_n_success": 0, "prompt_n_mc": 0,
                    "outcome": 0.0, "score": 0.0, "finished": True, "strategy": "every", "source": "test"})
    return out


def write_shard(rows: list[dict], path) -> str:
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import rows_to_table

    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows_to_table(rows), path / "part-0.parquet")
    return str(path)


def test_fit_recovers_a_planted_dependence_and_writes_a_loadable_checkpoint(policy, tmp_path, capsys):
    from verl_prm.critic import ProverCritic
    from verl_prm.critic.loading import load_critic_tokenizer
    from verl_prm.critic.token_logprob_format import TokenLogprobFormat
    from verl_prm.training.cli import main
    from verl_prm.training.token_logprob import encode_rollouts, extract_step_features

    rng = np.random.default_rng(1)
    words = ["3 + 4 = 7.", "He has 7.", "The answer is 7.", "5 * 2 = 11.", "ok", "Tom buys 2 apples.", "= 5"]
    rows = [(PROMPTS[i % 3], "\n".join(rng.choice(words, size=int(rng.integers(1, 4))))) for i in range(24)]
    # the planted truth: q a logistic function of the prefix's weakest token log-prob
    tokenizer = load_critic_tokenizer(policy)
    adapter = TokenLogprobFormat.load_lm(str(policy), tokenizer, dtype=torch.float32, attn_implementation="sdpa",
                                         device=torch.device("cpu"))
    critic = ProverCritic(adapter, tokenizer, device=torch.device("cpu"))
    probe = encode_rollouts(pd.DataFrame(label_rows(rows, lambda i, h: 0.5)), tokenizer, max_length=None,
                            best_of_k=1, use_prompt_value=True, note=print)
    features = extract_step_features(critic, probe)
    centre = float(np.median(np.concatenate(features)[:, 0]))
    planted = [1 / (1 + np.exp(-1.5 * (f[:, 0] - centre))) for f in features]
    train = write_shard(label_rows(rows[:16], lambda i, h: float(planted[i][h])), tmp_path / "train")
    held = write_shard(label_rows(rows[16:], lambda i, h: float(planted[16 + i][h])), tmp_path / "held")
    output = tmp_path / "critic"
    argv = ["--labels", train, "--eval-labels", held, "--init", str(policy), "--output-dir", str(output), "--format",
            "token_logprob", "--no-progress", "--calibration", "none", "--no-balance"]
    assert main(argv) == 0
    head = read_head(output)
    assert head.result_regex is None and head.fit["converged"] and head.fit["labelled_steps"] == sum(
        len(f) for f in features[:16])
    assert math.isclose(1 / (1 + math.exp(-head.prompt_logit)), 0.6, rel_tol=1e-9)  # the prompt values' mean
    for i, f in enumerate(features):  # held-out rollouts too: the planted function itself was recovered
        assert np.allclose(head.values(f), planted[i], atol=1e-4, rtol=0)
    metrics = json.loads((output / "eval_metrics.json").read_text())
    assert metrics["eval/mse"] < 1e-6 and metrics["eval/num_steps"] == sum(len(f) for f in features[16:]) + 8
    scored = ProverCritic.from_pretrained(str(output), format="token_logprob", device="cpu")
    scores = scored.score_texts([p for p, _ in rows], [r for _, r in rows], delimiter="\n")
    for i, f in enumerate(features):
        assert np.allclose(scores.step_values[i, : len(f)].numpy(), planted[i], atol=1e-4, rtol=0)
    mask = 0o777 & ~_umask()
    assert stat.S_IMODE((output / HEAD_SAFETENSORS).stat().st_mode) == mask & 0o666
    assert stat.S_IMODE(output.stat().st_mode) == mask
    # a second fit into the same directory: refused, unless --overwrite; a directory of other files: refused
    with pytest.raises(FileExistsError, match="--overwrite"):
        main(argv)
    assert head.fit["calibration_slope"] == pytest.approx(1.0, abs=1e-3)  # the planted values' own size
    assert "warning" not in capsys.readouterr().out
    assert main([*argv, "--overwrite", "--head-l2", "1.0"]) == 0
    assert read_head(output).fit["l2"] == 1.0 and not list(tmp_path.glob(".critic.*"))
    assert read_head(output).fit["calibration_slope"] > 1.0  # a ridge shrinks the values
    assert main([*argv, "--overwrite", "--head-l2", "1000"]) == 0  # so much that they are too flat for Eq. 5
    assert read_head(output).fit["calibration_slope"] > 2.0
    assert "warning: on the training steps the labels rise" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        main([*argv[:7], str(tmp_path / "other"), *argv[8:], "--overwrite"])


def _umask() -> int:
    from verl_prm.checkpoints import current_umask

    return current_umask()


def test_fit_with_a_result_regex_and_class_balance(policy, tmp_path):
    from verl_prm.training.config import TrainConfig
    from verl_prm.training.trainer import train

    rows = [(f"{PROMPTS[i % 3]}#{i}\n", RESPONSES[i % 3]) for i in range(30)]
    train_dir = write_shard(label_rows(rows, lambda i, h: [1.0, 0.75, 0.0][(i + h) % 3]), tmp_path / "labels")
    summary = train(TrainConfig(labels=[train_dir], output_dir=str(tmp_path / "critic"), init=str(policy),
                                format="token_logprob", result_regex=REGEX, head_l2=0.5, eval_fraction=0.5,
                                calibration="platt", progress=False))
    head = read_head(tmp_path / "critic")
    assert head.result_regex == REGEX and head.features == feature_names(True) and head.fit["l2"] == 0.5
    assert head.fit["weights"] == "class-balanced" and (tmp_path / "critic" / "calibration.json").is_file()
    assert summary["calibration"] == str(tmp_path / "critic" / "calibration.json")
    assert 0 < summary["eval_rollouts"] < 30 and "eval/auroc" in summary["metrics"]


def test_train_config_refuses_the_value_head_options_with_token_logprob():
    from verl_prm.training.config import TrainConfig

    base = dict(labels=["l"], output_dir="o", init="m", format="token_logprob")
    for changes, message in ((dict(init=None, init_config="c", tokenizer="t"), "pass --init"),
                             (dict(head_fit="newton", freeze_backbone=True), "--format value_head"),
                             (dict(weight_decay=0.1), "--weight-decay 0"),
                             (dict(result_regex="(unclosed"), "no regular expression"),
                             (dict(result_regex="= 7"), "no capture group"),
                             (dict(head_l2=float("inf")), "head_l2"),
                             (dict(format="value_head", result_regex="(x)"), "setting of --format token_logprob"),
                             (dict(format="value_head", overwrite=True), "setting of --format token_logprob")):
        with pytest.raises(ValueError, match=re.escape(message)):
            TrainConfig(**{**base, **changes})


def test_a_verl_batch_scores_as_its_texts(checkpoint, references):
    """The verl path (left-padded prompts, right-padded responses, the policy's step split, the critic worker's
    call): the critic reads the policy's ids as they are."""
    from verl_prm.critic import ProverCritic
    from verl_prm.steps import split_steps

    critic = ProverCritic.from_pretrained(str(checkpoint), format="token_logprob", device="cpu")
    tokenizer = critic.tokenizer
    prompt_rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    response_rows = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    width_p, width_r, pad = max(map(len, prompt_rows)), max(map(len, response_rows)), 0
    prompts = torch.tensor([[pad] * (width_p - len(r)) + r for r in prompt_rows])
    responses = torch.tensor([r + [pad] * (width_r - len(r)) for r in response_rows])
    response_mask = torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in response_rows])
    mask = torch.cat([torch.tensor([[0] * (width_p - len(r)) + [1] * len(r) for r in prompt_rows]), response_mask], 1)
    split = split_steps(responses, response_mask, tokenizer, "\n")
    scores = critic.score_policy_batch(prompts, responses, mask, split, tokenizer)
    for b, (values, _) in enumerate(references):
        got = [float(scores.prompt_values[b])] + scores.step_values[b, : len(values) - 1].tolist()
        assert np.allclose(got, values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("section, message", [
    ({"placement": {"shard": "fsdp"}}, "supports verl_prm.critic.format ('value_head',), got 'token_logprob'"),
    ({"refresh": {"every": 2}}, "refits the value head of a learned PAV"),
])
def test_the_verl_run_checks_refuse_what_token_logprob_cannot_do(section, message):
    from verl_prm.config.hook import ConfigError, read_hook_config
    from verl_prm.integrations.verl.run_config import check_source_settings

    critic = {"critic": {"path": "c", "format": "token_logprob"}}
    check_source_settings(read_hook_config(critic))  # the format itself is a checkpoint source's
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_source_settings(read_hook_config({**critic, **section}))


def test_a_rollout_beyond_the_lm_context_is_named_by_its_label_row(policy, tmp_path):
    from verl_prm.training.config import TrainConfig
    from verl_prm.training.trainer import train

    rows = [(PROMPTS[0], RESPONSES[0]), (PROMPTS[1], "7 + 7 = 14.\n" * 600 + "The answer is 14.")]
    labels = write_shard(label_rows(rows, lambda i, h: 0.5), tmp_path / "labels")
    config = TrainConfig(labels=[labels], output_dir=str(tmp_path / "critic"), init=str(policy), max_length=100_000,
                         format="token_logprob", eval_fraction=0.0, calibration="none", progress=False)
    with pytest.raises(ValueError, match=r"label shard .*part-0.parquet row 1 \(prompt_index=1, rollout_index=0\): "
                                         r"the critic input has \d+ tokens, more than the critic's context of 2048"):
        train(config)
    assert not (tmp_path / "critic").exists()
