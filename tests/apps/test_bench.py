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
    for label in ("grpo_vectorized (verl)", "pav_grpo", "pav_rloo", "pav_grpo, compile=never"):
        assert re.search(rf"^{re.escape(label)} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +\d+$", report, re.M), (
            label, report)
    assert re.search(r"pav_grpo / grpo_vectorized = [\d.]+ \(target <= 2\).*(meets|MISSES) the target", report)
    assert re.search(r"pav_grpo / grpo_vectorized in this thread's CPU time: [\d.]+ ", report)


def test_bench_steps_runs_and_reports(capsys):
    from verl_prm.apps.bench.steps import main

    assert main(["--responses", "4", "--length", "64", "--repeats", "1", "--vocab-size", "400"]) == 0
    report = capsys.readouterr().out
    assert re.search(r'split_steps delimiter="\\n\\n" +[\d.]+ +\d+ +[\d.]+', report), report
