"""Prover critic: every format scores all steps in one packed pass exactly as one forward pass per prefix does
(token formats), or as one pass of the plain model per sample on the format's input (text formats; that the
input is the authors' one is tests/unit/test_prm_formats.py).

Tiny Qwen2 models with random weights are built from configs, saved with ``save_pretrained`` (safetensors) and
loaded back through ``ProverCritic.from_pretrained`` (trust_remote_code=False). The reference is independent of
the scorer: the plain transformers model run on each prefix separately, markers inserted by a loop here.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from verl_prm.critic import ProverCritic
from verl_prm.critic.packing import padding_share, plan_micro_batches

TOL = 1e-4
FORMATS = ("value_head", "qwen_prm", "qwen_prm_public", "math_shepherd", "value_head_lm")
MARKERS = {"qwen_prm": "<extra_0>", "qwen_prm_public": "<extra_0>", "math_shepherd": "ки"}
# The two-class token classifier is scored token-level by `pure_prm` (marker: the "\n" token after each step);
# the public Qwen layout by the text format `qwen_prm`.
FORMAT_NAMES = {"qwen_prm": "pure_prm", "qwen_prm_public": "qwen_prm"}
TEXT_KINDS = ("qwen_prm_public", "math_shepherd", "value_head_lm")


def format_options(kind: str, tokenizer) -> dict:
    """The byte-level test tokenizer has no SentencePiece pieces: math_shepherd takes its tokens by id."""
    if kind != "math_shepherd":
        return {}
    ids = tokenizer.convert_tokens_to_ids
    return {"tag": ids("ки"), "positive_token": ids("+"), "negative_token": ids("-")}


def load_critic(kind: str, path, **kwargs) -> ProverCritic:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return ProverCritic.from_pretrained(str(path), format=format_name(kind), **format_options(kind, tokenizer),
                                        **kwargs)


def _config(vocab_size: int, **extra) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **extra,
    )


def _copy_tokenizer(tokenizer, directory: Path, marker: str | None) -> PreTrainedTokenizerFast:
    """A fresh copy (the session fixture must stay unchanged), with the format's marker as a special token."""
    tokenizer.save_pretrained(directory)
    copy = PreTrainedTokenizerFast.from_pretrained(directory)
    if marker is not None:
        copy.add_special_tokens({"additional_special_tokens": [marker]})
        copy.save_pretrained(directory)
    return copy


def _add_tensors(directory: Path, extra: dict[str, torch.Tensor]) -> None:
    """Append head tensors to model.safetensors, the layout of public PRM checkpoints with custom heads."""
    file = directory / "model.safetensors"
    tensors = load_file(file)
    tensors.update({k: v.contiguous() for k, v in extra.items()})
    save_file(tensors, file, metadata={"format": "pt"})


CALIBRATION_TEXT = (
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four.\nShe sells the remainder at the farmers' market daily for $2 per fresh duck egg."
)


def _spread_direction(features: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    """A random direction w with w . mean(features) = 0 and std(features @ w) = scale: a head along it gives
    values spread over (0, 1) instead of the near-constant output of a random head on a tiny random model."""
    mean = features.mean(0)
    w = torch.linalg.svd(features - mean, full_matrices=False).Vh[0]  # the direction of largest spread
    w = w - (w @ mean) / (mean @ mean) * mean
    return w * (scale / (features @ w).std())


def _shrink_marker_embedding(model, marker: int) -> None:
    """A marker's hidden state in a tiny random model is dominated by its own embedding, so all markers look
    alike; a small embedding lets attention over the context dominate, as in a trained PRM."""
    with torch.no_grad():
        model.get_input_embeddings().weight[marker] *= 0.02


def build_checkpoint(kind: str, tokenizer, directory: Path, seed: int = 0) -> Path:
    """Save a tiny random critic of format ``kind`` (see FORMATS) with its tokenizer in ``directory``."""
    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tok = _copy_tokenizer(tokenizer, directory, MARKERS.get(kind))
    vocab = len(tok)
    ids = tok.encode(CALIBRATION_TEXT, add_special_tokens=False)
    if kind in MARKERS:  # values are read at markers: calibrate on hidden states of a text with markers
        marker = tok.convert_tokens_to_ids(MARKERS[kind])
        ids = [t for i in range(0, len(ids), 5) for t in ids[i : i + 5] + [marker]]
    x = torch.tensor([ids])
    read = x[0] == marker if kind in MARKERS else torch.ones(len(ids), dtype=torch.bool)
    if kind in ("value_head", "qwen_prm"):
        model = Qwen2ForTokenClassification(_config(vocab, num_labels=1 if kind == "value_head" else 2)).eval()
        if kind in MARKERS:
            _shrink_marker_embedding(model, marker)
        with torch.no_grad():
            w = _spread_direction(model.model(x).last_hidden_state[0][read])
            model.score.weight.copy_(torch.stack([w] if kind == "value_head" else [-w / 2, w / 2]))
            model.score.bias.zero_()
        model.save_pretrained(directory)
    elif kind == "math_shepherd":
        model = Qwen2ForCausalLM(_config(vocab)).eval()
        _shrink_marker_embedding(model, marker)
        with torch.no_grad():
            w = _spread_direction(model.model(x).last_hidden_state[0][read])
            model.lm_head.weight[tok.convert_tokens_to_ids("+")] = w / 2
            model.lm_head.weight[tok.convert_tokens_to_ids("-")] = -w / 2
        model.save_pretrained(directory)
    elif kind in ("value_head_lm", "qwen_prm_public"):
        model = Qwen2ForCausalLM(_config(vocab)).eval()
        if kind in MARKERS:
            _shrink_marker_embedding(model, marker)
        model.save_pretrained(directory)
        with torch.no_grad():
            hidden_states = model.model(x).last_hidden_state[0][read]
        size = model.config.hidden_size
        if kind == "value_head_lm":  # Skywork layout: v_head.summary = Linear(H, 1)
            extra = {"v_head.summary.weight": _spread_direction(hidden_states)[None], "v_head.summary.bias": torch.zeros(1)}
        else:  # Qwen2.5-Math-PRM layout: score = Sequential(Linear(H, H), ReLU, Linear(H, 2)), custom architecture
            w0, b0 = torch.randn(size, size) / size**0.5, torch.randn(size) * 0.1
            w = _spread_direction(torch.relu(hidden_states @ w0.T + b0))
            extra = {"score.0.weight": w0, "score.0.bias": b0, "score.2.weight": torch.stack([-w / 2, w / 2]),
                     "score.2.bias": torch.zeros(2)}
            config = json.loads((directory / "config.json").read_text())
            config["architectures"] = ["Qwen2ForProcessRewardModel"]
            (directory / "config.json").write_text(json.dumps(config))
        _add_tensors(directory, extra)
    else:
        raise ValueError(kind)
    return directory


def format_name(kind: str) -> str:
    return FORMAT_NAMES.get(kind, kind)


class PrefixReference:
    """Values by one forward pass of the plain transformers model per prefix (the naive public-script way)."""

    def __init__(self, kind: str, path: Path):
        self.kind = kind
        tok = PreTrainedTokenizerFast.from_pretrained(path)
        self.marker = tok.convert_tokens_to_ids(MARKERS[kind]) if kind in MARKERS else None
        if kind == "qwen_prm":  # PURE's layout: the "\n" token after each step, none after the prompt
            self.marker = tok.convert_tokens_to_ids("Ċ")
            self.separators = {i for i in range(len(tok)) if tok.decode([i]).endswith("\n\n")}
        if kind in ("value_head", "qwen_prm"):
            self.model = AutoModelForTokenClassification.from_pretrained(path).eval()
        elif kind == "math_shepherd":
            self.model = AutoModelForCausalLM.from_pretrained(path).eval()
            self.candidates = [tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")]
        else:
            self.model = AutoModel.from_pretrained(path).eval()
            self.head = load_file(path / "model.safetensors")

    @torch.inference_mode()
    def values_at(self, ids: list[int], positions: list[int]) -> list[float]:
        x = torch.tensor([ids])
        if self.kind == "value_head":
            return torch.sigmoid(self.model(x).logits[0, positions, 0]).tolist()
        if self.kind == "qwen_prm":
            return torch.softmax(self.model(x).logits[0, positions], -1)[:, 1].tolist()
        if self.kind == "math_shepherd":
            return torch.softmax(self.model(x).logits[0, positions][:, self.candidates], -1)[:, 0].tolist()
        h = self.model(x).last_hidden_state[0, positions]
        if self.kind == "value_head_lm":
            return torch.sigmoid(h @ self.head["v_head.summary.weight"][0] + self.head["v_head.summary.bias"][0]).tolist()
        z = torch.relu(h @ self.head["score.0.weight"].T + self.head["score.0.bias"])
        return torch.softmax(z @ self.head["score.2.weight"].T + self.head["score.2.bias"], -1)[:, 1].tolist()

    def value_at_last(self, ids: list[int]) -> float:
        return self.values_at(ids, [len(ids) - 1])[0]

    def prefix(self, ids: list[int], ends: list[int]) -> list[int]:
        """ids up to ends[-1] with a marker after every end (marker formats), written independently of
        verl_prm.critic.packing."""
        if self.marker is None or len(ends) == 1:
            return ids[: ends[-1] + 1]
        out, start = ids[: ends[0] + 1], ends[0] + 1
        for end in ends[1:]:
            step = ids[start : end + 1]
            if self.kind == "qwen_prm" and step[-1] in self.separators:
                step = step[:-1]
            out += step + [self.marker]
            start = end + 1
        return out

    def score(self, ids: list[int], prompt_end: int, step_ends: list[int]) -> list[float]:
        ends = [prompt_end, *step_ends]
        return [self.value_at_last(self.prefix(ids, ends[: h + 1])) for h in range(len(ends))]



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, bpe_small) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("critics")
    return {kind: build_checkpoint(kind, bpe_small, root / kind, seed=i) for i, kind in enumerate(FORMATS)}


@pytest.fixture(scope="module")
def samples(repo_data) -> list[tuple[str, str]]:
    """GSM8K question/answer pairs; answers are split into steps at "\\n"."""
    rows = [json.loads(line) for line in (repo_data / "gsm8k_test.jsonl").read_text().splitlines()[:40]]
    rng = random.Random(0)
    picked = rng.sample(rows, 6)
    return [(r["question"], r["answer"]) for r in picked]


def _sequences(tokenizer, samples, rng: random.Random, steps: int = 4):
    """Critic-side ids with random step ends (the tensor entry point takes arbitrary valid positions)."""
    input_ids, prompt_ends, step_ends = [], [], []
    for question, answer in samples:
        p = tokenizer.encode(question, add_special_tokens=False)
        r = tokenizer.encode(answer, add_special_tokens=False)
        cut = rng.randint(len(r) // 2, len(r))  # varied lengths
        r = r[:cut]
        h = rng.randint(0, min(steps, len(r)))
        ends = sorted(rng.sample(range(len(r)), h))
        input_ids.append(p + r)
        prompt_ends.append(len(p) - 1)
        step_ends.append([len(p) + e for e in ends])
    return input_ids, prompt_ends, step_ends


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("packing", ["varlen", "padded"])
def test_packed_equals_per_prefix(kind, packing, checkpoints, samples):
    path = checkpoints[kind]
    critic = load_critic(kind, path, packing=packing, max_tokens_per_batch=400)
    assert critic.packing == packing
    ids, prompt_ends, step_ends = _sequences(critic.tokenizer, samples, random.Random(1))
    scores = critic.score_sequences(ids, prompt_ends, step_ends)
    reference = PrefixReference(kind, path)
    all_values = []
    for b in range(len(ids)):
        if kind in TEXT_KINDS:  # one pass of the plain model on the format's input of this sample alone
            (alone,) = critic.build_inputs([ids[b]], [prompt_ends[b]], [step_ends[b]])
            expected = reference.values_at(alone.input_ids, alone.read_positions)
        else:
            expected = reference.score(ids[b], prompt_ends[b], step_ends[b])
        h = len(step_ends[b])
        assert int(scores.num_steps[b]) == h
        got = [float(scores.prompt_values[b])] + scores.step_values[b, :h].tolist()
        assert got == pytest.approx(expected, abs=TOL), f"{kind} sample {b}"
        assert torch.all(scores.step_values[b, h:] == 0)
        all_values += expected
    # the random heads spread values over (0, 1): a misread position would not go unnoticed
    assert torch.tensor(all_values).std() > 0.02


@pytest.mark.parametrize("kind", ["value_head", "math_shepherd"])
def test_order_preserved_under_shuffled_lengths(kind, checkpoints, samples):
    critic = load_critic(kind, checkpoints[kind], max_tokens_per_batch=300)
    rng = random.Random(2)
    ids, prompt_ends, step_ends = _sequences(critic.tokenizer, samples * 2, rng)
    base = critic.score_sequences(ids, prompt_ends, step_ends)
    assert len(critic.plan(critic.build_inputs(ids, prompt_ends, step_ends))) > 2  # several micro-batches
    order = list(range(len(ids)))
    rng.shuffle(order)
    shuffled = critic.score_sequences([ids[i] for i in order], [prompt_ends[i] for i in order],
                                      [step_ends[i] for i in order])
    torch.testing.assert_close(shuffled.prompt_values, base.prompt_values[order], atol=TOL, rtol=0)
    torch.testing.assert_close(shuffled.step_values, base.step_values[order], atol=TOL, rtol=0)
    torch.testing.assert_close(shuffled.num_steps, base.num_steps[order])
    # each sample alone gives the same values as in the batch
    alone = critic.score_sequences(ids[3:4], prompt_ends[3:4], step_ends[3:4])
    h = int(alone.num_steps[0])
    torch.testing.assert_close(alone.step_values[0, :h], base.step_values[3, :h], atol=TOL, rtol=0)


def test_best_of_k_applied_only_when_asked(checkpoints, samples):
    path = str(checkpoints["value_head"])
    raw_critic = ProverCritic.from_pretrained(path)
    bo4_critic = ProverCritic.from_pretrained(path, best_of_k=4)
    ids, prompt_ends, step_ends = _sequences(raw_critic.tokenizer, samples, random.Random(3))
    raw = raw_critic.score_sequences(ids, prompt_ends, step_ends)
    bo4 = bo4_critic.score_sequences(ids, prompt_ends, step_ends)
    torch.testing.assert_close(bo4.prompt_values, 1 - (1 - raw.prompt_values) ** 4)
    valid = torch.arange(raw.step_values.shape[1])[None] < raw.num_steps[:, None]
    torch.testing.assert_close(bo4.step_values, torch.where(valid, 1 - (1 - raw.step_values) ** 4, 0.0))
    with pytest.raises(ValueError, match="k must be an integer"):
        ProverCritic.from_pretrained(path, best_of_k=0)


def test_too_long_names_the_sample_and_left_prompt_truncation(checkpoints, samples):
    path = checkpoints["qwen_prm"]
    ids, prompt_ends, step_ends = _sequences(
        PreTrainedTokenizerFast.from_pretrained(path), samples, random.Random(4)
    )
    unlimited = ProverCritic.from_pretrained(str(path), format="pure_prm")
    lengths = [len(x.input_ids) for x in unlimited.build_inputs(ids, prompt_ends, step_ends)]
    # a marker after every step, the tokens after the last step end not read (PURE's input ends there)
    assert lengths == [e[-1] + 1 + len(e) if e else p + 1 for p, e in zip(prompt_ends, step_ends)]
    longest = max(range(len(ids)), key=lambda i: lengths[i])
    limit = sorted(lengths)[-2]  # only the longest sample does not fit
    assert lengths[longest] > limit
    strict = ProverCritic.from_pretrained(str(path), format="pure_prm", max_length=limit)
    with pytest.raises(ValueError, match=rf"sample {longest}: the critic input has {lengths[longest]} tokens"):
        strict.score_sequences(ids, prompt_ends, step_ends)

    truncating = ProverCritic.from_pretrained(str(path), format="pure_prm", max_length=limit, truncation="left_prompt")
    scores = truncating.score_sequences(ids, prompt_ends, step_ends)
    drop = lengths[longest] - limit
    assert drop <= prompt_ends[longest]
    reference = PrefixReference("qwen_prm", path)
    expected = reference.score(ids[longest][drop:], prompt_ends[longest] - drop,
                               [e - drop for e in step_ends[longest]])
    h = len(step_ends[longest])
    got = [float(scores.prompt_values[longest])] + scores.step_values[longest, :h].tolist()
    assert got == pytest.approx(expected, abs=TOL)

    # the response alone is too long: still an error, also with left_prompt
    response_only = ProverCritic.from_pretrained(str(path), format="pure_prm", max_length=lengths[longest] - prompt_ends[longest] - 1,
                                                 truncation="left_prompt")
    with pytest.raises(ValueError, match=rf"sample {longest}: .*alone needs"):
        response_only.score_sequences(ids, prompt_ends, step_ends)


def test_nan_from_the_model_names_the_sample(tmp_path, bpe_small, samples):
    path = build_checkpoint("value_head", bpe_small, tmp_path / "nan")
    critic = ProverCritic.from_pretrained(str(path))
    ids, prompt_ends, step_ends = _sequences(critic.tokenizer, samples, random.Random(5))
    used = {t for x in ids for t in x} | {critic.pad_id}
    poison = next(t for t in range(len(critic.tokenizer)) if t not in used)  # in no sample, and not padding
    with torch.no_grad():
        critic.adapter.backbone.embed_tokens.weight[poison] = float("nan")
    # the poisoned token appears only in sample 2's response, before its last step end
    ids[2] = list(ids[2])
    ids[2][step_ends[2][-1] if step_ends[2] else prompt_ends[2]] = poison
    with pytest.raises(FloatingPointError, match="sample 2: the critic produced NaN/inf"):
        critic.score_sequences(ids, prompt_ends, step_ends)


def test_bad_positions_name_the_sample(checkpoints):
    critic = ProverCritic.from_pretrained(str(checkpoints["value_head"]))
    with pytest.raises(ValueError, match=r"sample 1: step_ends\[1\]=3"):
        critic.score_sequences([[5, 6, 7, 8], [5, 6, 7, 8]], [0, 0], [[2], [3, 3]])
    with pytest.raises(ValueError, match="unknown critic format"):
        ProverCritic.from_pretrained(str(checkpoints["value_head"]), format="nope")
    with pytest.raises(ValueError, match="num_labels=1"):
        ProverCritic.from_pretrained(str(checkpoints["qwen_prm"]), format="value_head")


# ---------------------------------------------------------------------------------------------- policy tokens


def _policy_batch(tokenizer, samples):
    """verl layout: prompts left-padded [B, P], responses right-padded with EOS [B, T], attention_mask [B, P+T]."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_rows = [tokenizer.encode(q, add_special_tokens=False) for q, _ in samples]
    response_rows = [tokenizer.encode(a, add_special_tokens=False) + [eos] for _, a in samples]
    width_p = max(map(len, prompt_rows))
    width_r = max(map(len, response_rows)) + 3
    prompts = torch.tensor([[pad] * (width_p - len(r)) + r for r in prompt_rows])
    responses = torch.tensor([r + [pad] * (width_r - len(r)) for r in response_rows])
    mask = torch.cat(
        [
            torch.tensor([[0] * (width_p - len(r)) + [1] * len(r) for r in prompt_rows]),
            torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in response_rows]),
        ],
        dim=1,
    )
    return prompts, responses, mask


@pytest.mark.parametrize("kind", ["value_head", "qwen_prm"])
def test_policy_tokens_with_another_tokenizer_equal_scoring_the_text(kind, checkpoints, samples, bpe_large, bpe_small):
    from verl_prm.steps import split_steps

    critic = load_critic(kind, checkpoints[kind])
    texts = [(q, a) for q, a in samples]
    expected = critic.score_texts([q for q, _ in texts], [a for _, a in texts], delimiter="\n")
    assert int(expected.num_steps.min()) >= 2
    for policy_tokenizer in (bpe_large, bpe_small):  # another tokenizer; the critic's own (fast path for value_head)
        prompts, responses, mask = _policy_batch(policy_tokenizer, texts)
        split = split_steps(responses, mask[:, prompts.shape[1]:], policy_tokenizer, "\n")
        got = critic.score_policy_batch(prompts, responses, mask, split, policy_tokenizer,
                                        prompt_texts=[q for q, _ in texts])
        torch.testing.assert_close(got.num_steps, expected.num_steps)
        torch.testing.assert_close(got.prompt_values, expected.prompt_values, atol=TOL, rtol=0)
        width = expected.step_values.shape[1]
        torch.testing.assert_close(got.step_values[:, :width], expected.step_values, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------------- Ray worker


@pytest.mark.ray
def test_worker_group_matches_in_process_critic(ray_local, checkpoints, samples, bpe_large, tmp_path):
    import numpy as np
    from verl import DataProto
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker, compute_step_values
    from verl_prm.steps import split_steps

    policy_dir = tmp_path / "policy_tokenizer"
    bpe_large.save_pretrained(policy_dir)
    texts = samples[:5]  # 5 rows on 2 workers: padded to 6 and unpadded again
    prompts, responses, mask = _policy_batch(bpe_large, texts)
    split = split_steps(responses, mask[:, prompts.shape[1]:], bpe_large, "\n")
    data = DataProto.from_dict(
        tensors={
            "prompts": prompts, "responses": responses, "attention_mask": mask, "step_ends": split.step_ends,
            "num_steps": split.num_steps, "step_ids": split.step_ids, "merged_steps": split.merged_steps,
            "step_char_ends": split.step_char_ends,
        },
        non_tensors={"critic_prompts": np.array([q for q, _ in texts], dtype=object)},
    )
    path = str(checkpoints["qwen_prm"])
    kwargs = {"format": "pure_prm", "max_tokens_per_batch": 512}
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    worker_cls = RayClassWithInitArgs(cls=ray_local.remote(ProverCriticWorker), model_path=path, critic_kwargs=kwargs,
                                      policy_tokenizer_path=str(policy_dir))
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_cls, device_name="cpu")
    info = group.init_model()
    assert [i["rank"] for i in info] == [0, 1] and all(i["device"] == "cpu" for i in info)

    out = compute_step_values(group, data)
    critic = ProverCritic.from_pretrained(path, **kwargs)
    expected = critic.score_policy_batch(prompts, responses, mask, split, bpe_large, prompt_texts=[q for q, _ in texts])
    assert len(out) == 5
    assert out.batch["step_values"].shape == split.step_ends.shape
    torch.testing.assert_close(out.batch["num_steps"], expected.num_steps)
    torch.testing.assert_close(out.batch["prompt_values"], expected.prompt_values, atol=TOL, rtol=0)
    torch.testing.assert_close(out.batch["step_values"], expected.step_values, atol=TOL, rtol=0)

    # an error inside a worker names the sample of the whole batch: sample 3 is the first row of rank 1's shard
    long_prompts = np.array([q if b != 3 else q * 40 for b, (q, _) in enumerate(texts)], dtype=object)
    data.non_tensor_batch["critic_prompts"] = long_prompts
    with pytest.raises(Exception, match=r"sample 3: the critic input has \d+ tokens, more than the critic's context"):
        compute_step_values(group, data)


def test_micro_batch_plan_respects_budget_and_padding_bound():
    rng = random.Random(7)
    lengths = [int(64 * 16 ** rng.random()) for _ in range(200)]
    for mode in ("varlen", "padded"):
        plan = plan_micro_batches(lengths, 4096, mode, max_padding_share=0.1)
        assert sorted(i for b in plan for i in b.indices) == list(range(len(lengths)))  # each sample once
        for b in plan:
            assert b.total_tokens == sum(lengths[i] for i in b.indices)
            cost = b.total_tokens if mode == "varlen" else b.max_length * len(b.indices)
            assert cost <= 4096 or len(b.indices) == 1
            if mode == "padded":
                assert 1 - b.total_tokens / (b.max_length * len(b.indices)) <= 0.1 + 1e-12
        assert padding_share(plan, mode) <= 0.1
    alone = plan_micro_batches([5000, 10, 10], 4096, "varlen")
    assert [b.indices for b in alone] == [[0], [1, 2]]  # longer than the budget: runs alone


# ---------------------------------------------------------------------------------------------- loading safely


def _variant(checkpoints, tmp_path, kind: str = "value_head") -> Path:
    """A private copy of a checkpoint of the module fixture, to damage."""
    import shutil

    target = tmp_path / f"{kind}_copy"
    shutil.copytree(checkpoints[kind], target)
    return target


def _drop_tensors(directory: Path, prefixes: tuple[str, ...]) -> None:
    tensors = load_file(directory / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
    assert len(kept) < len(tensors)
    save_file(kept, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["value_head", "qwen_prm"])
def test_checkpoint_without_its_head_weights_is_an_error(kind, checkpoints, tmp_path):
    from verl_prm.checkpoints import CheckpointError

    path = _variant(checkpoints, tmp_path, kind)
    _drop_tensors(path, ("score.",))
    with pytest.raises(CheckpointError) as error:
        ProverCritic.from_pretrained(str(path), format=kind, device="cpu")
    message = str(error.value)
    assert f"critic checkpoint {str(path)!r} lacks weights the model needs: score.bias, score.weight" in message
    assert "random values that change on every load" in message


@pytest.mark.parametrize("kind", ["value_head", "qwen_prm"])
def test_head_check_reads_the_safetensors_not_the_load_report(kind, checkpoints, tmp_path, monkeypatch):
    """Even if transformers reported nothing missing, the head's keys are checked against the file's headers."""
    from verl_prm.checkpoints import CheckpointError, safetensors_keys
    from verl_prm.critic import formats, loading

    def silent_load(auto_class, path, dtype, attn_implementation, allow_pickle, device, quiet=False):
        return auto_class.from_pretrained(path, **loading._common_kwargs(dtype, attn_implementation, allow_pickle,
                                                                         device))

    monkeypatch.setattr(formats, "load_complete", silent_load)
    path = _variant(checkpoints, tmp_path, kind)
    assert {"score.weight", "score.bias"} <= safetensors_keys(path)
    ProverCritic.from_pretrained(str(path), format=kind, device="cpu")
    _drop_tensors(path, ("score.bias",))
    assert "score.bias" not in safetensors_keys(path) and "score.weight" in safetensors_keys(path)
    with pytest.raises(CheckpointError, match=r"lacks weights the model needs: score\.bias\. Loading it"):
        ProverCritic.from_pretrained(str(path), format=kind, device="cpu")


def test_checkpoint_missing_a_backbone_weight_is_an_error(checkpoints, tmp_path):
    from verl_prm.checkpoints import CheckpointError

    path = _variant(checkpoints, tmp_path)
    _drop_tensors(path, ("model.norm.",))
    with pytest.raises(CheckpointError, match=r"lacks weights the model needs: model\.norm\.weight"):
        ProverCritic.from_pretrained(str(path), device="cpu")


def test_pickle_only_checkpoint_needs_the_opt_in(checkpoints, samples, tmp_path, monkeypatch):
    from verl_prm.checkpoints import CheckpointError

    path = _variant(checkpoints, tmp_path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    monkeypatch.delenv("VERL_PRM_ALLOW_PICKLE", raising=False)
    with pytest.raises(CheckpointError) as error:
        ProverCritic.from_pretrained(str(path), device="cpu")
    assert f"critic checkpoint {str(path)!r} has only pickle weights (pytorch_model.bin)" in str(error.value)
    assert "allow_pickle=True" in str(error.value) and "VERL_PRM_ALLOW_PICKLE=1" in str(error.value)
    prompts, responses = [p for p, _ in samples[:3]], [r for _, r in samples[:3]]
    reference = ProverCritic.from_pretrained(str(checkpoints["value_head"]), device="cpu").score_texts(prompts, responses)
    opted_in = ProverCritic.from_pretrained(str(path), device="cpu", allow_pickle=True).score_texts(prompts, responses)
    assert torch.equal(opted_in.step_values, reference.step_values)
    monkeypatch.setenv("VERL_PRM_ALLOW_PICKLE", "1")
    by_env = ProverCritic.from_pretrained(str(path), device="cpu").score_texts(prompts, responses)
    assert torch.equal(by_env.prompt_values, reference.prompt_values)


def _no_transformers_call(monkeypatch):
    """Any transformers load from here on fails the test: the checks must answer before transformers is asked."""
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("transformers was asked to load the checkpoint")

    for name in ("AutoTokenizer", "AutoModelForTokenClassification", "AutoConfig"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", forbidden)


def test_bad_paths_are_named_before_transformers_is_asked(checkpoints, tmp_path, monkeypatch):
    from verl_prm.checkpoints import CheckpointError

    _no_transformers_call(monkeypatch)
    for missing in (str(tmp_path / "no_such_critic"), "relative/critic/dir", "critic_dir"):
        with pytest.raises(FileNotFoundError, match=rf"^critic checkpoint {missing!r}: no such directory$"):
            ProverCritic.from_pretrained(missing, device="cpu")
    weights = checkpoints["value_head"] / "model.safetensors"
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        ProverCritic.from_pretrained(str(weights), device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((checkpoints["value_head"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"has no model weights \(no model\.safetensors"):
        ProverCritic.from_pretrained(str(empty), device="cpu")
    (empty / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        ProverCritic.from_pretrained(str(empty), device="cpu")


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_hub_id_offline_fails_at_once_or_loads_from_the_cache(variable, checkpoints, samples, tmp_path,
                                                              monkeypatch):
    """Offline, an `org/model` id is looked up in the local hub cache only: absent, an error before transformers
    (and so before any network retry) is reached; present, the cached snapshot loads."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    with monkeypatch.context() as guarded:
        _no_transformers_call(guarded)
        with pytest.raises(FileNotFoundError) as error:
            ProverCritic.from_pretrained("some-org/some-critic", device="cpu")
    assert f"critic checkpoint 'some-org/some-critic': no such directory, and {variable} is set (offline)" in str(
        error.value)
    assert "not in the local hub cache" in str(error.value)
    revision = "0" * 40
    repo = cache / "models--some-org--some-critic"
    shutil.copytree(checkpoints["value_head"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    prompts, responses = [p for p, _ in samples[:2]], [r for _, r in samples[:2]]
    cached = ProverCritic.from_pretrained("some-org/some-critic", device="cpu").score_texts(prompts, responses)
    local = ProverCritic.from_pretrained(str(checkpoints["value_head"]), device="cpu").score_texts(prompts, responses)
    assert torch.equal(cached.step_values, local.step_values)


# ---------------------------------------------------------------- loading onto the device, packed-row boundaries,
# host preparation ahead of the forward


@pytest.mark.parametrize("kind", ["value_head", "qwen_prm_public"])
def test_loaded_parameters_are_on_the_device_and_equal_the_saved_ones(kind, checkpoints):
    """Every parameter of the backbone and the head is on the requested device and equals its tensor in
    model.safetensors (the file ``save_pretrained`` wrote), bit for bit in fp32."""
    path = checkpoints[kind]
    saved = load_file(path / "model.safetensors")
    critic = load_critic(kind, path, device="cpu", dtype="float32")
    model_prefix = critic.adapter.model.base_model_prefix
    head_prefix = "score"
    compared = 0
    for module, prefix in ((critic.adapter.backbone, model_prefix), (critic.adapter.head, head_prefix)):
        for name, param in module.named_parameters():
            key = f"{prefix}.{name}"
            if kind == "qwen_prm_public" and module is critic.adapter.backbone:
                key = name if name in saved else f"{model_prefix}.{name}"
            assert param.device == torch.device("cpu"), key
            assert torch.equal(param.detach(), saved[key]), key
            compared += 1
    assert compared == len([k for k in saved if not k.startswith("lm_head.")])


def test_an_accelerator_is_the_load_target(checkpoints, monkeypatch):
    """On an accelerator transformers gets ``device_map={"": device}`` (tensors go from the mapped file to the
    device); on CPU no device_map. Checked on the keywords transformers receives (no CUDA here)."""
    from transformers import AutoModelForTokenClassification as auto_class

    seen = []

    class Stop(Exception):
        pass

    def spy(path, **kwargs):
        seen.append(kwargs.get("device_map"))
        if kwargs.get("device_map") is not None:
            raise Stop
        return original(path, **kwargs)

    original = auto_class.from_pretrained
    monkeypatch.setattr(auto_class, "from_pretrained", spy)
    ProverCritic.from_pretrained(str(checkpoints["value_head"]), device="cpu")
    with pytest.raises(Stop):
        ProverCritic.from_pretrained(str(checkpoints["value_head"]), device="cuda:1", dtype="float32",
                                     attn_implementation="sdpa")
    assert seen == [None, {"": torch.device("cuda", 1)}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_puts_weights_on_the_gpu_without_a_host_copy(tmp_path):
    """A 490 MiB fp32 critic loaded onto CUDA in a fresh process: the parameters are on the GPU and equal the
    saved ones, and the anonymous (non-file) host memory grows by less than a quarter of the weights."""
    import subprocess
    import sys

    path = _rss_checkpoint(tmp_path)
    code = _RSS_SCRIPT + "report(load('cuda:0', 'float32'))\n"
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["devices"] == ["cuda:0"] and numbers["equal"]
    assert numbers["anon_growth_mib"] < numbers["weights_mib"] / 4, numbers


_RSS_SCRIPT = r'''
import json, sys
import torch
from safetensors.torch import load_file

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields

path = sys.argv[1]

from transformers import AutoModelForTokenClassification, AutoTokenizer  # imports are not the load
from verl_prm.critic import ProverCritic

def load(device, dtype):
    if device != "cpu":
        torch.zeros(1, device=device)  # the CUDA context's host memory is not the load's
    before = status()
    critic = ProverCritic.from_pretrained(path, device=device, dtype=dtype, attn_implementation="sdpa")
    loaded = status()
    total = sum(float(p.detach().float().sum()) for p in critic.adapter.backbone.parameters())
    read = status()
    saved = load_file(path + "/model.safetensors")
    prefix = critic.adapter.model.base_model_prefix
    equal = all(torch.equal(p.detach().cpu().to(saved[prefix + "." + n].dtype), saved[prefix + "." + n])
                for n, p in critic.adapter.backbone.named_parameters()) if dtype == "float32" else None
    weights = sum(t.numel() * t.element_size() for t in saved.values()) / 2**20
    return {"weights_mib": round(weights, 1), "hwm_growth_mib": round(loaded["VmHWM"] - before["VmHWM"], 1),
            "hwm_growth_after_reading_mib": round(read["VmHWM"] - before["VmHWM"], 1),
            "anon_growth_mib": round(loaded["RssAnon"] - before["RssAnon"], 1),
            "file_growth_mib": round(loaded["RssFile"] - before["RssFile"], 1), "checksum": total,
            "devices": sorted({str(p.device) for p in critic.adapter.backbone.parameters()}), "equal": equal}

def report(numbers):
    print(json.dumps(numbers))
'''


def _rss_checkpoint(directory: Path) -> Path:
    """A random 12-layer Qwen2 value-head critic, hidden 768, vocabulary 32,000 (490 MiB of fp32 safetensors),
    and a tokenizer."""
    from verl_prm.bpe import train_byte_level_bpe

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=False, num_labels=1)
    Qwen2ForTokenClassification(config).save_pretrained(directory)
    train_byte_level_bpe(["a small text for the tokenizer"] * 4, vocab_size=300).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_cpu_load_peak_rss(tmp_path):
    """Peak RSS (VmHWM) of a fresh process loading a 490 MiB critic on CPU. fp32 (the file's dtype): the
    parameters map the file, so the anonymous memory grows by less than a tenth of the weights; bf16: the cast
    makes one host copy (half the file). Printed for docs/gpu.md (``-s``)."""
    import subprocess
    import sys

    path = _rss_checkpoint(tmp_path)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        code = _RSS_SCRIPT + f"report(load('cpu', {dtype!r}))\n"
        result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[dtype] = json.loads(result.stdout.strip().splitlines()[-1])
        print(dtype, rows[dtype])
    fp32, bf16 = rows["float32"], rows["bfloat16"]
    assert fp32["devices"] == ["cpu"] and fp32["equal"]
    assert fp32["anon_growth_mib"] < fp32["weights_mib"] / 10, fp32
    assert bf16["anon_growth_mib"] > bf16["weights_mib"] / 2 * 0.9, bf16


def test_packed_row_boundaries_equal_what_transformers_derives():
    """``cu_seq_lens``/``max_length`` built once per micro-batch equal transformers' own derivation from the
    same position_ids (``prepare_fa_kwargs_from_position_ids``, which its flash-attention path otherwise runs
    in every layer); the max length is a Python int (no device read)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from verl_prm.critic.packing import packed_tensors

    rng = random.Random(3)
    for count in (1, 2, 7):
        lengths = [rng.randint(1, 40) for _ in range(count)]
        seqs = [[rng.randrange(100) for _ in range(n)] for n in lengths]
        reads = [[n - 1] for n in lengths]
        tensors = packed_tensors(seqs, reads, boundaries=True)
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(tensors.position_ids)
        assert tensors.cu_seq_lens.dtype == cu_q.dtype == torch.int32
        assert torch.equal(tensors.cu_seq_lens, cu_q) and torch.equal(tensors.cu_seq_lens, cu_k)
        assert type(tensors.max_length) is int and tensors.max_length == int(max_q) == int(max_k)
        kwargs = tensors.model_kwargs()
        assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] is tensors.cu_seq_lens
        assert kwargs["max_length_q"] == kwargs["max_length_k"] == max(lengths)
        plain = packed_tensors(seqs, reads).model_kwargs()  # sdpa/eager: no boundary keywords, as before
        assert set(plain) == {"input_ids", "position_ids", "use_cache"}


def _segment_attention(calls):
    """A varlen attention registered with transformers for the test: attention within each
    ``cu_seq_lens_q`` segment (causal SDPA per sequence). It refuses to run without the precomputed keywords,
    so the values are right only when every layer received correct boundaries."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if cu is None or not isinstance(longest, int) or kwargs.get("cu_seq_lens_k") is not cu:
            raise AssertionError(f"no precomputed boundaries: {sorted(kwargs)}")
        calls.append((cu.clone(), longest, kwargs.get("position_ids")))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = torch.empty_like(query)
        bounds = cu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def test_flash_attention_varlen_gets_the_boundaries_once_per_micro_batch(checkpoints, samples, monkeypatch):
    """With a flash-attention-style implementation (name with "flash-attn": varlen) every layer receives the
    micro-batch's precomputed boundaries, equal to transformers' derivation from its position_ids, and the
    values equal the padded SDPA critic's (fp32)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
    from transformers.modeling_utils import AttentionInterface

    calls = []
    name = "test-segment-flash-attn"
    monkeypatch.setitem(AttentionInterface._global_mapping, name, _segment_attention(calls))
    path = checkpoints["value_head"]
    # set after loading: transformers' load-time check would look for a flash-attn package or hub kernel by name
    varlen = ProverCritic.from_pretrained(str(path), device="cpu", attn_implementation="sdpa", packing="varlen",
                                          max_tokens_per_batch=300)
    varlen.adapter.config._attn_implementation = name
    padded = ProverCritic.from_pretrained(str(path), device="cpu", attn_implementation="sdpa", packing="padded",
                                          max_tokens_per_batch=300)
    ids, prompt_ends, step_ends = _sequences(varlen.tokenizer, samples * 2, random.Random(4))
    inputs = varlen.build_inputs(ids, prompt_ends, step_ends)
    plan = varlen.plan(inputs)
    assert len(plan) > 2
    got = varlen.forward_values(inputs, plan)
    layers = varlen.adapter.config.num_hidden_layers
    assert len(calls) == layers * len(plan)
    for k, batch in enumerate(plan):
        position_ids = varlen.prepare_batch(inputs, batch, "varlen").position_ids
        (expected_cu, _), (expected_max, _) = prepare_fa_kwargs_from_position_ids(position_ids)
        for cu, longest, _ in calls[k * layers : (k + 1) * layers]:
            assert torch.equal(cu, expected_cu) and longest == int(expected_max)
    reference = padded.forward_values(inputs)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_prefetch_is_bit_equal_to_the_sequential_path_and_runs_ahead(checkpoints, samples):
    """Micro-batch k + 1's host tensors are prepared in the background thread while micro-batch k's forward
    runs (forward k waits for it: without the overlap, the wait times out); the values are bit-equal to
    preparing each micro-batch right before its forward (``prefetch=False``)."""
    import threading

    for packing in ("varlen", "padded"):
        critic = load_critic("value_head", checkpoints["value_head"], packing=packing, max_tokens_per_batch=300)
        assert critic.prefetch is False  # the default on CPU (the thread would compete with the forward)
        critic.prefetch = True
        ids, prompt_ends, step_ends = _sequences(critic.tokenizer, samples * 3, random.Random(5))
        inputs = critic.build_inputs(ids, prompt_ends, step_ends)
        plan = critic.plan(inputs)
        assert len(plan) > 3
        events = []
        prepared = [threading.Event() for _ in plan]
        overlapped = []
        prepare, backbone = critic.prepare_batch, critic.adapter.backbone.forward

        def logged_prepare(inputs_, batch, mode):
            k = plan.index(batch)
            events.append(("prepare", k, threading.current_thread().name))
            try:
                return prepare(inputs_, batch, mode)
            finally:
                prepared[k].set()

        def logged_forward(*args, **kwargs):
            k = sum(e[0] == "forward" for e in events)
            events.append(("forward", k, threading.current_thread().name))
            if critic.prefetch and k + 1 < len(plan):  # forward k cannot end before k + 1 is prepared
                overlapped.append(prepared[k + 1].wait(timeout=10))
            return backbone(*args, **kwargs)

        critic.prepare_batch = logged_prepare
        critic.adapter.backbone.forward = logged_forward
        try:
            ahead = critic.forward_values(inputs, plan)
            threads = {thread for kind, _, thread in events if kind == "prepare"}
            events.clear()
            critic.prefetch = False
            sequential = critic.forward_values(inputs, plan)
            sequential_order = [(kind, k) for kind, k, _ in events]
        finally:
            del critic.adapter.backbone.forward
        assert all(torch.equal(a, b) for a, b in zip(ahead, sequential)), packing
        # prefetch: micro-batch k + 1 was prepared in the background thread while forward k was running
        assert overlapped == [True] * (len(plan) - 1), (packing, overlapped)
        assert threads == {t for t in threads if t.startswith("critic-prepare")} and threads, threads
        assert sequential_order == [e for k in range(len(plan)) for e in (("prepare", k), ("forward", k))]


@pytest.mark.slow
def test_host_preparation_share_of_a_1024_response_batch(checkpoints, repo_data):
    """Host-side preparation against the forward for 1,024 GSM8K responses (steps at "\\n") on the tiny test
    critic, CPU, padded rows: seconds of text -> critic inputs (``build_inputs``), of the per-micro-batch host
    tensors (``prepare_batch``; also for the packed rows of a GPU critic) and of the forwards (``prefetch=False``, each timed alone), and the whole
    ``forward_values`` with and without prefetch, whose values are bit-equal. Printed for docs/gpu.md (``-s``)."""
    import time

    from verl_prm.steps import encode_with_step_ends, step_char_spans

    rows = [json.loads(line) for line in (repo_data / "gsm8k_test.jsonl").read_text().splitlines()[:1024]]
    assert len(rows) == 1024
    # padded rows (the CPU default: a packed row under SDPA would build a dense mask over all 16,384 tokens)
    critic = load_critic("value_head", checkpoints["value_head"], packing="padded", max_tokens_per_batch=16384,
                         truncation="left_prompt")
    t0 = time.perf_counter()
    ids, prompt_ends, step_ends = [], [], []
    for row in rows:
        encoded = encode_with_step_ends(critic.tokenizer, row["question"], row["answer"],
                                        step_char_spans(row["answer"], "\n"))
        ids.append(list(encoded.input_ids))
        prompt_ends.append(int(encoded.prompt_end))
        step_ends.append([int(e) for e in encoded.step_ends])
    t1 = time.perf_counter()
    inputs = critic.build_inputs(ids, prompt_ends, step_ends)
    plan = critic.plan(inputs)
    t2 = time.perf_counter()
    a = time.perf_counter()
    packed_plan = critic.plan(inputs, "varlen")
    for batch in packed_plan:  # the packed rows a GPU critic runs (flash-attention varlen), host side only
        critic.prepare_batch(inputs, batch, "varlen")
    packed_prepare = time.perf_counter() - a
    prepare = forward = 0.0
    with torch.inference_mode():
        for batch in plan:
            a = time.perf_counter()
            tensors = critic.prepare_batch(inputs, batch, "padded")
            b = time.perf_counter()
            critic.adapter.backbone(**tensors.model_kwargs())
            forward += time.perf_counter() - b
            prepare += b - a
    timings = {}
    values = {}
    for prefetch in (False, True, False, True):
        critic.prefetch = prefetch
        a = time.perf_counter()
        values[prefetch] = critic.forward_values(inputs, plan)
        timings[prefetch] = min(timings.get(prefetch, math.inf), time.perf_counter() - a)
    tokens = sum(len(x.input_ids) for x in inputs)
    print(f"\n{len(inputs)} responses, {tokens} tokens, {len(plan)} micro-batches: tokenise {t1 - t0:.3f} s, "
          f"build_inputs+plan {t2 - t1:.3f} s, prepare_batch {prepare:.3f} s, forwards {forward:.3f} s "
          f"(preparation share of prepare+forward {prepare / (prepare + forward):.1%}); forward_values "
          f"sequential {timings[False]:.3f} s, prefetch {timings[True]:.3f} s; packed rows: {len(packed_plan)} "
          f"micro-batches, prepare_batch {packed_prepare:.3f} s")
    assert all(torch.equal(a, b) for a, b in zip(values[True], values[False]))
    assert len(plan) > 10 and prepare > 0 and forward > 0


def test_features_are_the_backbone_states_the_head_reads_and_a_new_head_gives_its_values(checkpoints, samples):
    """``with_features``: what the value head reads, equal to the plain transformers backbone's last hidden state at
    the prompt's and each step's last token; ``set_value_head`` then gives sigmoid(w . h + b) there."""
    path = checkpoints["value_head"]
    critic = load_critic("value_head", path, packing="padded", max_tokens_per_batch=400)
    ids, prompt_ends, step_ends = _sequences(critic.tokenizer, samples, random.Random(2))
    scores = critic.score_sequences(ids, prompt_ends, step_ends, with_features=True)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    width = scores.step_values.shape[1]
    assert scores.features.shape == (len(ids), width + 1, model.config.hidden_size)
    weight = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    critic.set_value_head(weight, 0.25)
    after = critic.score_sequences(ids, prompt_ends, step_ends)
    for b in range(len(ids)):
        positions = [prompt_ends[b]] + step_ends[b]
        with torch.inference_mode():
            hidden = model.base_model(torch.tensor([ids[b]])).last_hidden_state[0, positions]
        assert torch.allclose(scores.features[b, : len(positions)], hidden, atol=1e-5)
        assert not scores.features[b, len(positions):].any()
        expected = torch.sigmoid(hidden @ weight + 0.25)
        got = torch.cat([after.prompt_values[b : b + 1], after.step_values[b, : len(step_ends[b])]])
        assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match="the head reads 32 features, the new weight has 5"):
        critic.set_value_head(torch.zeros(5), 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        critic.set_value_head(torch.full((model.config.hidden_size,), float("nan")), 0.0)
    other = load_critic("qwen_prm", checkpoints["qwen_prm"])
    with pytest.raises(ValueError, match="set_value_head needs a critic of format 'value_head'"):
        other.set_value_head(weight, 0.0)


def _word_level_critic(directory: Path) -> Path:
    """A value-head critic whose config says qwen2 and whose saved tokenizer is word-level (trained here on
    whitespace-split words): the probe of a tokenizer that transformers' model-type mapping would replace."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    texts = ["Sam has 3 apples .", "He buys 4 more apples : 3 + 4 = 7 .", "The answer is 7 ."]
    words.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="[EOS]")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    Qwen2ForTokenClassification(_config(len(tokenizer), num_labels=1)).eval().save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2"
    return directory


def test_a_critic_tokenizes_as_its_saved_tokenizer_not_as_its_model_type_says(tmp_path, caplog):
    """transformers 5 maps model_type qwen2 to Qwen2Tokenizer and rebuilds the saved word-level tokenizer as a
    byte-level BPE ("Sam has 3 apples ." became 2 tokens, a word-only prompt none). The critic tokenizes as the
    saved tokenizer.json does (the reference: the tokenizers library reading that file), and says so."""
    from tokenizers import Tokenizer

    directory = _word_level_critic(tmp_path / "word_level")
    saved = Tokenizer.from_file(str(directory / "tokenizer.json"))
    with caplog.at_level("WARNING"):
        critic = ProverCritic.from_pretrained(str(directory), device="cpu")
    assert "whose normalizer, pre_tokenizer, model, decoder differ from the saved tokenizer.json" in caplog.text
    for text in ("Sam has 3 apples .", "He buys 4 more apples : 3 + 4 = 7 .", "The answer is 7 .", "Sam has"):
        assert critic.tokenizer(text, add_special_tokens=False)["input_ids"] == saved.encode(text).ids
    assert (critic.tokenizer.eos_token, critic.tokenizer.pad_token) == ("[EOS]", "[PAD]")
    scores = critic.score_texts(["Sam has"], ["He buys 4 more apples\n\nThe answer is 7 ."], delimiter="\n\n")
    assert scores.num_steps.tolist() == [2] and torch.isfinite(scores.step_values[0, :2]).all()
    # a checkpoint whose tokenizer loads as saved (here: the Qwen2Tokenizer transformers made, saved) keeps the
    # class transformers picks, with no warning
    from transformers import AutoTokenizer

    caplog.clear()
    consistent = tmp_path / "consistent"
    reloaded = AutoTokenizer.from_pretrained(directory)
    reloaded.save_pretrained(consistent)
    for name in ("config.json", "model.safetensors"):
        (consistent / name).write_bytes((directory / name).read_bytes())
    with caplog.at_level("WARNING"):
        again = ProverCritic.from_pretrained(str(consistent), device="cpu")
    assert "differ from the saved tokenizer.json" not in caplog.text and type(again.tokenizer) is type(reloaded)


def test_score_texts_gives_steps_that_end_in_one_critic_token_the_value_read_there(checkpoints):
    """With the delimiter " ", the steps "x " and "the" of "x the" both end in the critic token " the" (the space of
    the first is inside it): score_texts reads that token once and both steps get its value, with a warning, where
    it used to raise `step_ends[1]=k must lie in (k, k + 1)` (a sampled response can hold such steps)."""
    critic = load_critic("value_head", checkpoints["value_head"])
    tokenizer = critic.tokenizer
    word = next(w for w in ("the", "he", "in", "an", "is", "of", "to", "and")
                if tokenizer.convert_ids_to_tokens(tokenizer.encode("x " + w, add_special_tokens=False)) == ["x", "Ġ" + w])
    with pytest.warns(UserWarning, match=rf"score_texts: sample 0: step 1 \('{word}'\) ends in the critic token that "
                                         r"also ends step 0; both get the value read there"):
        merged = critic.score_texts(["Question?\n", "Question?\n"], ["x " + word, "x"], delimiter=" ")
    one_step = critic.score_texts(["Question?\n", "Question?\n"], ["x " + word, "x"], delimiter="\n")
    assert merged.num_steps.tolist() == [2, 1] and one_step.num_steps.tolist() == [1, 1]
    assert merged.step_values[0, 0] == merged.step_values[0, 1]
    torch.testing.assert_close(merged.step_values[:, :1], one_step.step_values[:, :1])  # read at " the" and "x"
    torch.testing.assert_close(merged.prompt_values, one_step.prompt_values)
