"""The policy's EOS ids and pad token (verl_prm.special_tokens) and the generators that use them.

The EOS rule's reference is vLLM's stop set (vllm/sampling_params.py, ``SamplingParams.update_from_generation_config``:
the tokenizer's EOS plus the generation config's ``eos_token_id`` ids); the generators' reference is the model's
own greedy ``generate`` output, cut at the first EOS."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from verl_prm.labeling.hf_generator import HFGenerator
from verl_prm.search import Node
from verl_prm.search.generation import HFStepSampler
from verl_prm.special_tokens import ensure_pad_token, generation_config_of, policy_eos_token_ids, token_ids

TEXTS = ["Natalia sold clips to 48 of her friends in April", "How many", "A robe takes 2 bolts of blue fiber"]


def _without_pad(tokenizer):
    out = copy.deepcopy(tokenizer)
    out.pad_token = None
    assert out.pad_token_id is None
    return out


@pytest.fixture(scope="module")
def tiny_lm(bpe_small):
    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=bpe_small.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_token_ids_reads_an_int_a_list_or_none():
    assert token_ids(None) == [] and token_ids(5) == [5] and token_ids([7, 5, 7]) == [7, 5]
    for bad in (-1, "2", 1.0, True, [3, None]):
        with pytest.raises(ValueError, match="non-negative int"):
            token_ids(bad)


def test_policy_eos_ids_are_the_tokenizer_s_and_the_generation_config_s(bpe_small):
    eos = bpe_small.eos_token_id
    other = eos + 5
    messages: list[str] = []
    assert policy_eos_token_ids(bpe_small, None, log=messages.append) == [eos]
    assert policy_eos_token_ids(bpe_small, GenerationConfig(eos_token_id=eos), log=messages.append) == [eos]
    # a list holding the tokenizer's EOS (Qwen2.5 instruct): all of them, tokenizer's first, no complaint
    both = GenerationConfig(eos_token_id=[other, eos])
    assert policy_eos_token_ids(bpe_small, both, log=messages.append) == [eos, other]
    assert messages == []
    # disagreement (transformers' GGUF tokenizer of SmolLM2): both ids end a response, and the line names both
    assert policy_eos_token_ids(bpe_small, GenerationConfig(eos_token_id=other), source="policy X",
                                log=messages.append) == [eos, other]
    (line,) = messages
    mine, theirs = bpe_small.convert_ids_to_tokens(eos), bpe_small.convert_ids_to_tokens(other)
    assert line.startswith("policy X:") and f"{mine!r} (id {eos})" in line and f"{theirs!r} (id {other})" in line
    assert f"tokenizer.eos_token = {theirs!r}" in line
    # a tokenizer without EOS: the generation config's; neither: an error naming the source and the fix
    no_eos = copy.deepcopy(bpe_small)
    no_eos.eos_token = None
    assert policy_eos_token_ids(no_eos, GenerationConfig(eos_token_id=[other]), log=messages.append) == [other]
    with pytest.raises(ValueError, match="policy Y: neither the tokenizer nor the generation config names an EOS"):
        policy_eos_token_ids(no_eos, GenerationConfig(), source="policy Y")
    with pytest.raises(ValueError, match=rf"EOS ids \[{len(bpe_small) + 3}\].*outside the tokenizer's vocabulary"):
        policy_eos_token_ids(bpe_small, GenerationConfig(eos_token_id=len(bpe_small) + 3))


def test_ensure_pad_token_takes_the_generation_config_s_pad_else_the_eos(bpe_small):
    messages: list[str] = []
    assert ensure_pad_token(bpe_small, None, log=messages.append) == bpe_small.pad_token_id and messages == []

    tokenizer = _without_pad(bpe_small)
    with pytest.raises(ValueError, match="padding token"):  # what a new user meets
        tokenizer(["a", "a b c"], padding=True)
    assert ensure_pad_token(tokenizer, GenerationConfig(pad_token_id=7), source="policy Z", log=messages.append) == 7
    assert tokenizer.pad_token_id == 7
    assert messages[-1].startswith("policy Z: the tokenizer has no pad token") and "(id 7)" in messages[-1]
    assert "pad_token_id" in messages[-1]

    tokenizer = _without_pad(bpe_small)
    assert ensure_pad_token(tokenizer, GenerationConfig(), log=messages.append) == bpe_small.eos_token_id
    assert "its EOS" in messages[-1]
    encoded = tokenizer(["a", "a b c"], padding=True)
    short = encoded["attention_mask"][0]
    assert sum(short) < len(short) and bpe_small.eos_token_id in encoded["input_ids"][0]


def test_generation_config_of_a_directory(tmp_path, tiny_lm):
    tiny_lm.save_pretrained(tmp_path / "with")
    assert generation_config_of(tmp_path / "with").eos_token_id == tiny_lm.config.eos_token_id
    tiny_lm.config.save_pretrained(tmp_path / "config_only")  # no generation_config.json: from the model config
    assert generation_config_of(tmp_path / "config_only").eos_token_id == tiny_lm.config.eos_token_id
    assert generation_config_of(tmp_path / "empty") is None


def test_generators_without_a_pad_token_equal_those_with_one(bpe_small, tiny_lm, caplog):
    """A tokenizer without pad (most Llama-family ones) used to stop the first batch with transformers' 'Asking
    to pad'; it now pads with its EOS, says so, and gives what the same tokenizer with pad = EOS gives."""
    with_pad = copy.deepcopy(bpe_small)
    with_pad.pad_token = with_pad.eos_token
    reference = HFGenerator(tiny_lm, with_pad, max_new_tokens=6, temperature=0.0).generate(TEXTS, 1, [0, 1, 2])
    caplog.set_level("WARNING", logger="verl_prm.special_tokens")
    no_pad = _without_pad(bpe_small)
    generator = HFGenerator(tiny_lm, no_pad, max_new_tokens=6, temperature=0.0)
    assert generator.generate(TEXTS, 1, [0, 1, 2]) == reference
    assert any("HFGenerator: the tokenizer has no pad token" in r.message for r in caplog.records)

    prompts = [t + "\n" for t in TEXTS]
    nodes = [Node(0), Node(1), Node(2, ("x y\n\n",), num_tokens=3)]
    expected = HFStepSampler(tiny_lm, with_pad, prompts, max_step_tokens=5,
                             temperature=0.0).sample_steps(nodes, 1, [1, 2, 3])
    sampler = HFStepSampler(tiny_lm, _without_pad(bpe_small), prompts, max_step_tokens=5, temperature=0.0)
    assert sampler.sample_steps(nodes, 1, [1, 2, 3]) == expected


def test_generators_stop_at_the_generation_config_s_eos_when_the_tokenizer_names_another(bpe_small, tiny_lm):
    """The tokenizer's EOS is not what the model's generation config ends responses with: a response ending at the
    generation config's id is finished (not truncated), cut where the model's own greedy output first has it."""
    model = copy.deepcopy(tiny_lm)
    with torch.inference_mode():
        encoded = bpe_small(TEXTS[0], return_tensors="pt", add_special_tokens=False)
        raw = model.generate(**encoded, max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=bpe_small.pad_token_id)[0, encoded["input_ids"].shape[1]:].tolist()
    stop = raw[3]
    assert stop != bpe_small.eos_token_id and bpe_small.eos_token_id not in raw[:4]
    model.generation_config.eos_token_id = [stop]
    messages: list[str] = []
    eos_ids = policy_eos_token_ids(bpe_small, model.generation_config, log=messages.append)
    assert eos_ids == [bpe_small.eos_token_id, stop]
    assert len(messages) == 1
    (completion,), *_ = HFGenerator(model, bpe_small, max_new_tokens=10, temperature=0.0).generate(TEXTS, 1, [0, 1, 2])
    cut = raw.index(stop)
    assert completion.finished and completion.num_tokens == cut + 1
    assert completion.text == bpe_small.decode(raw[:cut], skip_special_tokens=True)
    (node,) = HFStepSampler(model, bpe_small, [TEXTS[0]], delimiter="\n\n\n\n", max_response_tokens=10,
                            temperature=0.0).sample_responses([0], 1, [0])[0]
    assert not node.truncated and node.num_tokens == cut + 1
