"""The CPU benchmarks (`verl-prm bench advantages|steps`) run and print their tables."""

from __future__ import annotations

import re


def test_bench_advantages_runs_and_reports(capsys):
    from verl_prm.apps.bench.advantages import main

    # --default-allocator: the bench's mallopt would otherwise stay in force for the rest of this test process
    assert main(["--batch", "64", "--length", "96", "--steps", "4", "--repeats", "2", "--threads", "1",
                 "--default-allocator"]) == 0
    report = capsys.readouterr().out
    assert "allocator: default" in report
    for label in ("grpo_vectorized (verl)", "pav_grpo", "pav_grpo, int32 ids (hook)", "pav_rloo",
                  "pav_grpo, compile=never"):
        assert re.search(rf"^{re.escape(label)} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +\d+$", report, re.M), (
            label, report)
    for label in ("pav_grpo", "pav_grpo, int32 ids (hook)"):
        assert re.search(rf"^{re.escape(label)} / grpo_vectorized = [\d.]+ \(target <= 1.5\).*(meets|MISSES) the target",
                         report, re.M), report
    assert re.search(r"pav_grpo / grpo_vectorized in this thread's CPU time: [\d.]+ ", report)


def test_bench_steps_runs_and_reports(capsys):
    from verl_prm.apps.bench.steps import main

    assert main(["--responses", "4", "--length", "64", "--repeats", "1", "--vocab-size", "400"]) == 0
    report = capsys.readouterr().out
    assert re.search(r'split_steps delimiter="\\n\\n" +[\d.]+ +\d+ +[\d.]+', report), report


def test_bench_generate_runs_every_measurement_and_reports_ratios(tmp_path, bpe_small, capsys):
    """`verl-prm bench generate` on a tiny model: the three tables, each arm's ratio to its baseline, a tree group
    whose branches reuse their roots' prefixes, and labelled steps from both generators."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_prm.apps.bench import generate

    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=bpe_small.eos_token_id, pad_token_id=bpe_small.pad_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    bpe_small.save_pretrained(tmp_path)
    assert generate.main(["--model", str(tmp_path), "--sequences", "3", "--prompt-tokens", "20", "--new-tokens", "6",
                          "--trees", "2", "--label-problems", "1", "--n-cov", "1", "--n-mc", "1",
                          "--label-tokens", "8", "--repeats", "1", "--precision", "float32"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| plain generate float32 \| \d+ \| 1\.00 \|", out)
    assert re.search(r"\| engine float32 \| \d+ \| \d+\.\d\d \|", out)
    reuse = re.search(r"\| engine, prefix reuse \| (\d+) \| (\d+) \|", out)
    none = re.search(r"\| engine, no prefix reuse \| (\d+) \| (\d+) \|", out)
    plain = re.search(r"\| plain generate float32 \| (\d+) \| 0 \|", out)
    assert int(reuse[1]) < int(none[1]) <= int(plain[1]) and int(reuse[2]) > 0
    assert int(reuse[1]) + int(reuse[2]) == int(none[1]) + int(none[2]) == int(plain[1])  # every prompt token once
    assert re.search(r"\| HFGenerator on the engine \(after\) \| \d+ \| \d+ \| \d+ \| \d+\.\d\d \|", out)
    # the same trees in waves and with continuous batching: the same tokens generated (tests/unit/test_generation.py
    # checks that branches join the running batch)
    waves = re.search(r"\| waves \(every root, then every branch\) \| (\d+) \| (\d+) \|", out)
    continuous = re.search(r"\| continuous batching \(branches join as their root ends\) \| (\d+) \| (\d+) \|", out)
    assert int(continuous[1]) > 0 and int(waves[1]) > 0 and continuous[2] == waves[2], out
