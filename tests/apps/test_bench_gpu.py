"""`verl-prm bench gpu`: what can be checked without a GPU (the no-device exit, argument parsing, the critic
sizes, the peak table, the report) and the benchmark code itself run on CPU at a tiny size."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from verl_prm.apps.bench import gpu
from verl_prm.apps.bench.gpu import (
    Section,
    bf16_peak_tflops,
    critic_config,
    format_report,
    markdown_table,
    parse_args,
    pytest_counts,
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a CUDA device")
def test_command_without_a_device_exits_2_with_a_clear_message():
    done = subprocess.run([sys.executable, "-m", "verl_prm.apps.cli", "bench", "gpu"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.startswith("verl-prm bench gpu: no CUDA device is present (")
    assert "This check needs an NVIDIA GPU" in done.stderr


def test_main_without_a_device_says_why(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.main([]) == 2
    err = capsys.readouterr().err
    assert f"torch {torch.__version__} (CUDA 12.8) finds no device; CUDA_VISIBLE_DEVICES='' hides every GPU" in err


def test_command_is_registered():
    from verl_prm.apps.cli import COMMANDS, usage

    assert COMMANDS[("bench", "gpu")][0] == "verl_prm.apps.bench.gpu:main"
    assert "bench gpu" in usage()


def test_parse_args_defaults_and_errors(capsys):
    args = parse_args([])
    assert args.parts == ["tests", "estimators", "critic", "scorer", "7b", "train"] and args.size_list == ["0.5b", "1.5b"]
    assert args.budget_s == 480.0  # the 8 minutes
    assert parse_args(["--only", "critic", "--sizes", "1.5B"]).size_list == ["1.5b"]
    for argv, message in [
        (["--sizes", "3b"], "--sizes: unknown size(s) ['3b']; choose from 0.5b, 1.5b, 7b"),
        (["--only", "tests,speed"], "--only: unknown part(s) ['speed']"),
        (["--budget-s", "nan"], "argument --budget-s: must be > 0 (a finite number), got 'nan'"),
        (["--peak-tflops", "inf"], "argument --peak-tflops: must be > 0 (a finite number), got 'inf'"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--min-tokens", "500", "--max-tokens", "100"], "--min-tokens (500) must not exceed --max-tokens (100)"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize("size, total_without_head, non_embedding", [
    ("0.5b", 494_032_768, 357_898_112),     # Qwen2.5-0.5B's parameter count
    ("1.5b", 1_543_714_304, 1_310_340_608),  # Qwen2.5-1.5B's
    # Qwen2.5-7B's model card: 7.61B parameters, 6.53B non-embedding; without its untied lm_head (152064 x 3584)
    ("7b", 7_615_616_512 - 152064 * 3584, 6_525_621_760),
])
def test_critic_sizes_have_the_qwen2_5_parameter_counts(size, total_without_head, non_embedding):
    from transformers import Qwen2ForTokenClassification

    from verl_prm.critic.flops import non_embedding_parameters

    config = critic_config(size)
    assert config.num_labels == 1 and config._attn_implementation == "sdpa"
    with torch.device("meta"):  # shapes only: no memory
        model = Qwen2ForTokenClassification(config)
    head = config.hidden_size + 1  # the value head: Linear(hidden, 1) with bias
    assert sum(p.numel() for p in model.parameters()) - head == total_without_head
    assert non_embedding_parameters(model.base_model) == non_embedding


def test_critic_config_rejects_an_unknown_size():
    with pytest.raises(ValueError, match=r"unknown critic size '3b'; choose from 0.5b, 1.5b, 7b"):
        critic_config("3b")


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0),
    ("NVIDIA A10G", None), ("Tesla T4", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_bf16_peak_by_device_name(name, peak):
    assert bf16_peak_tflops(name) == peak


def test_pytest_counts():
    out = "....s\n= 12 passed, 3 skipped, 812 deselected, 1 warning in 41.20s =\n"
    assert pytest_counts(out) == {"passed": 12, "skipped": 3, "deselected": 812, "warnings": 1}
    assert pytest_counts("== 1 failed, 2 passed, 1 error in 3.0s ==") == {"failed": 1, "passed": 2, "errors": 1}
    assert pytest_counts("no summary") == {}


def test_report_format():
    sections = [
        Section("CUDA tests", "ok", 12.34, ["passed", "failed"], [["3", "0"]], ["`python -m pytest tests -k cuda`"]),
        Section("Critic forward, 1.5b", "skipped", notes=["not started: 10 s of the 480 s budget left"]),
    ]
    assert format_report(["GPU: X"], sections, 100.4, 480) == (
        "# verl-prm bench gpu\n\n- GPU: X\n\n"
        "## CUDA tests (ok, 12.3 s)\n\n| passed | failed |\n|---|---|\n| 3 | 0 |\n\n"
        "`python -m pytest tests -k cuda`\n\n"
        "## Critic forward, 1.5b (skipped, 0.0 s)\n\nnot started: 10 s of the 480 s budget left\n\n"
        "all parts that ran passed; 100 s in all (within the 480 s budget)\n"
    )
    failed = format_report([], [Section("Estimators on cuda", "failed")], 500, 480)
    assert failed.endswith("FAILED: Estimators on cuda; 500 s in all (OVER the 480 s budget)\n")
    with pytest.raises(ValueError, match=r"table row \['1'\] has 1 cells, the header 2"):
        markdown_table(["a", "b"], [["1"]])


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: SimpleNamespace(major=9, minor=0, total_memory=80 * 2**30))


def test_main_runs_the_parts_within_the_budget_and_reports_failures(monkeypatch, capsys, tmp_path):
    """The orchestration, with the GPU parts replaced: a failing part is reported and sets the exit status; a
    part that would start after the budget is skipped, not run."""
    _fake_gpu(monkeypatch)
    calls = []

    def fake_critic(args, size, peak, seed=0):
        calls.append((size, peak))
        if size == "0.5b":
            raise RuntimeError("CUDA out of memory")
        return Section(f"Critic forward, {size}", "ok", 1.0, ["x"], [["1"]])

    monkeypatch.setattr(gpu, "bench_critic", fake_critic)
    report_file = tmp_path / "report.md"
    assert gpu.main(["--only", "critic", "--output", str(report_file)]) == 1
    out = capsys.readouterr().out
    assert calls == [("0.5b", 989.0), ("1.5b", 989.0)]
    assert "## Critic forward, 0.5b (failed" in out and "RuntimeError: CUDA out of memory" in out
    assert "GPU: NVIDIA H100 80GB HBM3 (sm_90, 80.0 GiB); bf16 peak 989 TFLOP/s (data sheet, dense)" in out
    assert "FAILED: Critic forward, 0.5b;" in out
    assert report_file.read_text() == out.rstrip("\n") + "\n"

    calls.clear()
    assert gpu.main(["--only", "critic", "--sizes", "1.5b", "--budget-s", "5"]) == 0  # 5 s < the 40 s a part needs
    out = capsys.readouterr().out
    assert calls == []
    assert "## Critic forward, 1.5b (skipped, 0.0 s)" in out and "not started:" in out


def test_critic_benchmark_code_runs_on_cpu_at_a_tiny_size():
    """The critic part, on CPU with a tiny config: the padded/SDPA row (no flash-attention on CPU)."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    args = parse_args(["--sequences", "6", "--min-tokens", "16", "--max-tokens", "64", "--critic-repeats", "2"])
    section = gpu.bench_critic(args, "tiny", 100.0, device="cpu", dtype=torch.float32, config=config)
    assert section.status == "ok"
    assert [row[:2] for row in section.rows] == [["padded", "sdpa"], ["varlen", "sdpa"]]
    row = dict(zip(section.header, section.rows[0]))
    assert row["max abs diff to padded"] == "0.0e+00"
    assert float(dict(zip(section.header, section.rows[1]))["max abs diff to padded"]) <= 1e-4
    assert float(row["share of bf16 peak"].rstrip("%")) == pytest.approx(float(row["TFLOP/s"]), abs=0.06)
    assert "6 sequences of 16-64 tokens" in section.notes[0]


@pytest.mark.slow
def test_estimator_benchmark_code_runs_on_cpu_at_a_tiny_size():
    """The estimator part on CPU (torch.compile's C++ kernel instead of Triton's): fused equals eager exactly."""
    args = parse_args(["--batch", "64", "--length", "96", "--repeats", "2"])
    section = gpu.bench_estimators(args, device="cpu")
    assert section.status == "ok", section.notes
    assert [row[0] for row in section.rows] == ["lookup, fused kernel", "lookup, eager", "grpo_vectorized (verl)",
                                                "pav_grpo (fused)", "pav_grpo (compile=never)"]
    assert "max |fused - eager| = 0.0e+00 (must be 0)" in section.notes
    assert dict(zip(section.header, section.rows[2]))["x grpo_vectorized"] == "1.00"


BARE_IMAGE_BLOCKER = """
import sys
from importlib.machinery import PathFinder
HIDDEN = ("omegaconf", "verl", "ray", "hydra", "vllm", "flash_attn")
class Hidden:
    # PathFinder without the packages a bare GPU image lacks: find_spec gives None, import fails
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in HIDDEN else PathFinder.find_spec(name, path, target)
    @classmethod
    def find_distributions(cls, context=None, **kw):
        return PathFinder.find_distributions(context, **kw)
    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()
sys.meta_path[:] = [Hidden if f is PathFinder else f for f in sys.meta_path]
"""

BARE_IMAGE_SCRIPT = """
import sys, torch
from transformers import Qwen2Config
for name in ("omegaconf", "verl", "ray", "hydra", "vllm", "flash_attn"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"{name} imported: the blocker does not work")
from verl_prm.apps.bench import gpu
args = gpu.parse_args(["--sequences", "4", "--min-tokens", "16", "--max-tokens", "48", "--critic-repeats", "1",
                       "--train-steps", "2"])
config = Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_labels=1, max_position_embeddings=256)
config._attn_implementation = "sdpa"
sections = [gpu.bench_critic(args, "tiny", None, device="cpu", dtype=torch.float32, config=config),
            gpu.bench_scorer(args, "tiny", device="cpu", dtype=torch.float32, config=config),
            gpu.bench_training(args, "tiny", cpu=True)]
print(gpu.format_report([], sections, 0, 1))
print("LOADED", sorted(m for m in ("omegaconf", "verl", "ray", "hydra") if m in sys.modules))
"""


@pytest.mark.slow
def test_gpu_check_runs_without_verl_ray_hydra_omegaconf(tmp_path):
    """The bare-image claim: the critic, scorer and training parts run at a tiny size on CPU in a process where
    omegaconf, verl, Ray, Hydra, vLLM and flash-attn cannot be imported (the training subprocess inherits it)."""
    import os

    (tmp_path / "sitecustomize.py").write_text(BARE_IMAGE_BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", BARE_IMAGE_SCRIPT], capture_output=True, text=True, timeout=240,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    for title in ("Critic forward, tiny (ok", "Scorer from_pretrained, tiny (ok", "PAV training, tiny (ok"):
        assert f"## {title}" in out, out
    assert "all parts that ran passed" in out and "LOADED []" in out
