"""The `verl-prm` dispatcher: every command resolves to a callable, unknown commands fail with usage."""

from __future__ import annotations

import importlib

import pytest

from verl_prm.apps import cli


@pytest.mark.parametrize("words", list(cli.COMMANDS))
def test_every_command_resolves_to_a_main_function(words):
    module_name, function_name = cli.COMMANDS[words][0].split(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


def test_unknown_command_prints_usage_and_fails(capsys):
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for words in cli.COMMANDS:
        assert " ".join(words) in out


def test_bench_steps_prints_the_machine_load_with_every_figure(capsys, monkeypatch):
    import os

    import torch

    from verl_prm.apps.bench import steps

    monkeypatch.setattr(os, "getloadavg", lambda: (1.25, 0.5, 0.25))
    # --threads: keep this test process's torch thread count as it is
    assert steps.main(["--responses", "4", "--length", "32", "--repeats", "1", "--vocab-size", "300",
                       "--threads", str(torch.get_num_threads())]) == 0
    lines = capsys.readouterr().out.splitlines()
    load = f"load average 1.25 / 0.50 / 0.25 (1 / 5 / 15 min) on {os.cpu_count()} CPUs"
    assert f"before the runs: {load}" in lines and f"after the runs: {load}" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert lines[header].split()[-3:] == ["load", "1", "min"]
    rows = lines[header + 1: lines.index(f"after the runs: {load}")]
    assert len(rows) == 7 and all(row.split()[-1] == "1.25" for row in rows)


# ---------------------------------------------------------------------------------------------- float flags

FLOAT_FLAGS = [
    (("label",), "--temperature"), (("label",), "--top-p"), (("label",), "--gpu-memory-utilization"),
    (("label",), "--success-threshold"),
    (("train",), "--eval-fraction"), (("train",), "--lr"), (("train",), "--min-lr-ratio"),
    (("train",), "--weight-decay"), (("train",), "--grad-clip"),
    (("search",), "--alpha"), (("search",), "--threshold"), (("search",), "--temperature"), (("search",), "--top-p"),
    (("demo", "search"), "--policy-gamma"), (("demo", "search"), "--prover-gamma"),
    (("eval", "processbench"), "--threshold"), (("eval", "processbench"), "--tune-fraction"),
    (("demo",), "--gamma"), (("demo",), "--alpha"),
    (("bench", "gpu"), "--budget-s"), (("bench", "gpu"), "--tests-timeout-s"), (("bench", "gpu"), "--peak-tflops"),
    (("bench", "loop"), "--timeout"),
]


@pytest.mark.parametrize("words, flag", FLOAT_FLAGS, ids=[f"{' '.join(w)} {f}" for w, f in FLOAT_FLAGS])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
def test_float_flags_reject_nan_and_inf_naming_the_flag(words, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*words, f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"verl-prm {' '.join(words)}: error: argument {flag}: must be " in err
    assert f"a finite number), got {value!r}" in err or f"a finite number, got {value!r}" in err


@pytest.mark.parametrize("words, argv, message", [
    (("search",), ["--alpha", "-0.5"], "argument --alpha: must be >= 0 (a finite number), got '-0.5'"),
    (("search",), ["--top-p", "0"], "argument --top-p: must be in (0, 1] (a finite number), got '0'"),
    (("train",), ["--lr", "0"], "argument --lr: must be > 0 (a finite number), got '0'"),
    (("train",), ["--eval-fraction", "1"], "argument --eval-fraction: must be in [0, 1) (a finite number), got '1'"),
    (("label",), ["--temperature", "-1"], "argument --temperature: must be >= 0 (a finite number), got '-1'"),
    (("eval", "processbench"), ["--tune-fraction", "1.0"],
     "argument --tune-fraction: must be in (0, 1) (a finite number), got '1.0'"),
    (("eval", "processbench"), ["--thresholds", "0:nan:5"],
     "argument --thresholds: must be START:STOP:COUNT (finite numbers, COUNT >= 1), got '0:nan:5'"),
    (("demo",), ["--gammas", "1,nan,3"], "argument --gammas: 'nan' in '1,nan,3': must be > 0 (a finite number)"),
    (("demo",), ["--gammas", "1,,3"], "argument --gammas: must be comma-separated numbers, got '1,,3'"),
])
def test_float_flags_check_their_range(words, argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main([*words, *argv])
    assert message in capsys.readouterr().err


def test_no_command_parses_a_plain_float():
    """Every float flag goes through verl_prm.cli_types (`type=float` accepts 'nan' and 'inf')."""
    import re
    from pathlib import Path

    import verl_prm

    offenders = [f"{path}:{n}" for path in Path(verl_prm.__file__).parent.rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"add_argument\(.*type=float\b", line)]
    assert offenders == []


def test_finite_float_accepts_finite_numbers_in_range():
    from verl_prm.cli_types import finite_float, finite_floats

    assert finite_float(0.0, 1.0)("1") == 1.0 and finite_float()("-1e-5") == -1e-5
    assert finite_floats(0.0, low_open=True)("1, 3,10") == (1.0, 3.0, 10.0)


# ---------------------------------------------------------------------------------------------- error output


@pytest.fixture
def fake_commands(tmp_path, monkeypatch):
    """Commands that raise: expected errors (bad input) and unexpected ones (bugs)."""
    (tmp_path / "fake_verl_prm_commands.py").write_text(
        "from verl_prm.config.hook import ConfigError\n"
        "def bad_value(argv): raise ValueError('row 3 of data.jsonl: q=5 is not a probability')\n"
        "def bad_config(argv): raise ConfigError('verl_prm.critic.path is required')\n"
        "def missing_file(argv): open('/no/such/file.jsonl')\n"
        "def bug(argv): return {}['missing']\n"
        "import errno, os\n"
        "def read_only(argv): raise OSError(errno.EROFS, os.strerror(errno.EROFS), '/data/pav/checkpoint-0000002')\n"
        "def disk_full(argv): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/data/pav/metrics.jsonl')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = dict(cli.COMMANDS)
    for name in ("bad_value", "bad_config", "missing_file", "bug", "read_only", "disk_full"):
        commands[("fake", name)] = (f"fake_verl_prm_commands:{name}", "raises")
    monkeypatch.setattr(cli, "COMMANDS", commands)
    monkeypatch.setenv(cli.LOG_DIR_ENV, str(tmp_path / "logs"))
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    return tmp_path / "logs"


@pytest.mark.parametrize("name, line, error_type", [
    ("bad_value", "verl-prm fake bad_value: error: row 3 of data.jsonl: q=5 is not a probability", "ValueError"),
    ("bad_config", "verl-prm fake bad_config: error: verl_prm.critic.path is required", "ConfigError"),
    ("missing_file", "verl-prm fake missing_file: error: [Errno 2] No such file or directory: '/no/such/file.jsonl'",
     "FileNotFoundError"),
    ("read_only", "verl-prm fake read_only: error: Read-only file system (/data/pav/checkpoint-0000002): the file "
     "system is read-only: choose a writable --output-dir", "OSError"),
    ("disk_full", "verl-prm fake disk_full: error: No space left on device (/data/pav/metrics.jsonl): the disk is "
     "full: free space or choose another --output-dir, then rerun (it resumes)", "OSError"),
])
def test_expected_errors_print_one_line_and_the_log_path(fake_commands, name, line, error_type, capsys):
    assert cli.main(["fake", name, "--x"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == line and len(err) == 2
    log = next(fake_commands.glob(f"fake-{name}-*.log"))
    assert err[1] == f"verl-prm fake {name}: traceback in {log} (--debug or VERL_PRM_DEBUG=1 prints it here)"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and f"{error_type}:" in text


def test_debug_flag_or_variable_shows_the_traceback(fake_commands, monkeypatch):
    with pytest.raises(ValueError, match="q=5 is not a probability"):
        cli.main(["--debug", "fake", "bad_value"])
    with pytest.raises(ValueError, match="q=5 is not a probability"):
        cli.main(["fake", "bad_value", "--debug"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="q=5 is not a probability"):
        cli.main(["fake", "bad_value"])
    assert not fake_commands.exists()  # no log: the traceback went to the terminal


def test_unexpected_errors_keep_their_traceback(fake_commands):
    with pytest.raises(KeyError, match="missing"):
        cli.main(["fake", "bug"])


def test_real_command_error_is_one_line_without_traceback(tmp_path):
    """`verl-prm eval processbench` on a missing input, as a user runs it: one line and the log path."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "verl_prm.apps.cli", "eval", "processbench", "--input", str(tmp_path / "no.jsonl"),
               "--scores-field", "scores"]
    env = dict(os.environ, VERL_PRM_LOG_DIR=str(tmp_path / "logs"))
    env.pop("VERL_PRM_DEBUG", None)
    quiet = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 1
    lines = quiet.stderr.splitlines()
    assert lines[0] == f"verl-prm eval processbench: error: [Errno 2] No such file or directory: '{tmp_path / 'no.jsonl'}'"
    assert len(lines) == 2 and "Traceback" not in quiet.stderr
    loud = subprocess.run(command + ["--debug"], capture_output=True, text=True, env=env, timeout=120)
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr
    assert "FileNotFoundError" in loud.stderr


# ---------------------------------------------------------------------------------------------- start-up cost

_IMPORTS_AFTER = """
import runpy, sys
sys.argv = ["verl-prm"] + sys.argv[1:]
try:
    runpy.run_module("verl_prm.apps.cli", run_name="__main__")
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_imports_no_torch(argv):
    """`verl-prm --help` and `verl-prm train --help` answer without importing torch (seconds of start-up)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *argv], capture_output=True, text=True, timeout=120)
    assert "usage: verl-prm" in result.stdout
    assert result.stderr.splitlines()[-1] == "torch imported: False"


# Every command's --help, in one process: the dispatcher's commands one after another, and after each the heavy
# packages it loaded. Prints one JSON line: {"COMMAND": {"help": TEXT, "loaded": [...]}}.
_EVERY_HELP = """
import contextlib, io, json, os, sys
os.environ["COLUMNS"] = "100"
from verl_prm.apps.cli import COMMANDS, main
HEAVY = ("torch", "verl", "ray", "omegaconf")
report = {}
for words in COMMANDS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*words, "--help"])
        except SystemExit:
            pass
    report[" ".join(words)] = {"help": out.getvalue(), "loaded": [m for m in HEAVY if m in sys.modules]}
print(json.dumps(report))
"""

# The usage of the commands whose imports moved behind their argument parsing, as each printed it before the
# move (`verl-prm WORDS --help`, whitespace collapsed): the move changed no option, choice or requirement. (Since:
# `search` offers the checkpoint formats as choices and requires --input, --policy and --q-critic, which it always
# needed; its flags come from verl_prm.search.config.SearchConfig.)
HELP_USAGE = {
    ('demo',): (
        '[-h] [--quick] [--out OUT] [--learned-critic] [--seeds SEEDS] [--iterations ITERATIONS] [--gamma '
        'GAMMA] [--alpha ALPHA] [--gammas GAMMAS] [--sweep-seeds SWEEP_SEEDS] [--sweep-iterations '
        'SWEEP_ITERATIONS] [--planted PLANTED] [--no-std-norm] [--loss-agg-mode LOSS_AGG_MODE] '
        '[--warm-iterations WARM_ITERATIONS] [--workers WORKERS]'
    ),
    ('demo', 'search'): (
        '[-h] --output-dir OUTPUT_DIR [--methods METHODS] [--n N] [--bon-n BON_N] [--samples-per-beam '
        'SAMPLES_PER_BEAM] [--alpha ALPHA] [--best-of-k BEST_OF_K] [--max-steps MAX_STEPS] [--rank '
        '{orm,min,max,mean,sum,product,last}] [--rank-scores {values,progress}] [--rank-critic {q,prover}] '
        '[--threshold THRESHOLD] [--accept-on {value,progress}] [--max-backtracks MAX_BACKTRACKS] [--seed '
        'SEED] [--limit LIMIT] [--problems PROBLEMS] [--policy-gamma POLICY_GAMMA] [--prover-gamma '
        'PROVER_GAMMA] [--q-rollouts Q_ROLLOUTS] [--step-tokens STEP_TOKENS]'
    ),
    ('bench', 'advantages'): (
        '[-h] [--batch BATCH] [--length LENGTH] [--steps STEPS] [--group GROUP] [--repeats REPEATS] [--device'
        ' DEVICE] [--threads THREADS] [--default-allocator]'
    ),
    ('bench', 'steps'): (
        '[-h] [--responses RESPONSES] [--length LENGTH] [--vocab-size VOCAB_SIZE] [--tokenizer TOKENIZER] '
        '[--repeats REPEATS] [--threads THREADS] [--seed SEED]'
    ),
    ('bench', 'critic'): (
        '[-h] [--sequences SEQUENCES] [--min-tokens MIN_TOKENS] [--max-tokens MAX_TOKENS] [--steps STEPS] '
        '[--hidden HIDDEN] [--layers LAYERS] [--heads HEADS] [--vocab VOCAB] [--max-tokens-per-batch '
        'MAX_TOKENS_PER_BATCH] [--padded-batch-size PADDED_BATCH_SIZE] [--device DEVICE] [--dtype DTYPE] '
        '[--attn-implementation ATTN_IMPLEMENTATION] [--repeats REPEATS] [--threads THREADS] [--seed SEED] '
        '[--check]'
    ),
    ('label',): (
        '[-h] --input INPUT --output-dir OUTPUT_DIR --policy POLICY [--prover PROVER] [--backend {hf,vllm}] '
        '[--n-cov N_COV] [--n-mc N_MC] [--prefix-rule {every,fixed,first_pit}] [--prefixes-per-response '
        'PREFIXES_PER_RESPONSE] [--success-labels {every,outcome}] [--delimiter DELIMITER] [--step-regex '
        'STEP_REGEX] [--max-steps MAX_STEPS] [--code-rule {line,block,indent}] [--code-depth CODE_DEPTH] '
        '[--no-prompt-value] [--seed SEED] [--max-new-tokens MAX_NEW_TOKENS] [--temperature TEMPERATURE] '
        '[--top-p TOP_P] [--batch-size BATCH_SIZE] [--device DEVICE] [--dtype DTYPE] [--num-engines '
        'NUM_ENGINES] [--tensor-parallel-size TENSOR_PARALLEL_SIZE] [--gpu-memory-utilization '
        'GPU_MEMORY_UTILIZATION] [--max-model-len MAX_MODEL_LEN] [--shard-size SHARD_SIZE] [--reward-fn '
        'REWARD_FN] [--success-threshold SUCCESS_THRESHOLD] [--prompt-field PROMPT_FIELD] [--answer-field '
        'ANSWER_FIELD] [--data-source-field DATA_SOURCE_FIELD] [--data-source DATA_SOURCE] [--answer-regex '
        'ANSWER_REGEX] [--limit LIMIT] [--no-progress]'
    ),
    ('search',): (
        '[-h] --output-dir OUTPUT_DIR [--methods METHODS] [--n N] [--bon-n BON_N] [--samples-per-beam '
        'SAMPLES_PER_BEAM] [--alpha ALPHA] [--best-of-k BEST_OF_K] [--max-steps MAX_STEPS] [--rank '
        '{orm,min,max,mean,sum,product,last}] [--rank-scores {values,progress}] [--rank-critic {q,prover}] '
        '[--threshold THRESHOLD] [--accept-on {value,progress}] [--max-backtracks MAX_BACKTRACKS] [--seed '
        'SEED] [--limit LIMIT] --input INPUT [--prompt-field PROMPT_FIELD] [--answer-field ANSWER_FIELD] '
        '[--answer-regex ANSWER_REGEX] [--data-source-field DATA_SOURCE_FIELD] [--data-source DATA_SOURCE] '
        '[--reward-fn REWARD_FN] --policy POLICY --q-critic Q_CRITIC [--q-critic-format '
        '{value_head,qwen_prm,pure_prm,math_shepherd,rlhflow,value_head_lm,token_logprob}] [--prover PROVER] [--prover-format '
        '{value_head,qwen_prm,pure_prm,math_shepherd,rlhflow,value_head_lm,token_logprob}] [--backend {hf,vllm}] [--device DEVICE] '
        '[--delimiter DELIMITER] [--step-regex STEP_REGEX] [--max-step-tokens MAX_STEP_TOKENS] '
        '[--max-response-tokens MAX_RESPONSE_TOKENS] [--temperature TEMPERATURE] [--top-p TOP_P] '
        '[--batch-size BATCH_SIZE]'
    ),
    ('eval', 'processbench'): (
        '[-h] --input INPUT [--format {auto,processbench,prm800k}] [--critic CRITIC] [--critic-format '
        'CRITIC_FORMAT] [--scores-field SCORES_FIELD] [--score {values,progress}] [--best-of-k BEST_OF_K] '
        '[--threshold THRESHOLD] [--thresholds THRESHOLDS] [--tune-fraction TUNE_FRACTION] [--prompt-format '
        'PROMPT_FORMAT] [--separator SEPARATOR] [--device DEVICE] [--seed SEED] [--output OUTPUT]'
    ),
    ('recipe', 'arithmetic'): (
        '[-h] [--scale {cpu,gpu,micro,tiny}] [--scale-file SCALE_FILE] --work-dir WORK_DIR [--stages STAGES] '
        '[--rl-steps RL_STEPS] [--rl-arms RL_ARMS] [--rl-seeds RL_SEEDS] [--rl-parallel RL_PARALLEL] '
        '[--label-problems LABEL_PROBLEMS] [--n-mc N_MC] [--pav-steps PAV_STEPS] [--threads THREADS] '
        '[--in-process] [--no-progress]'
    ),
}


def test_every_help_imports_no_torch_and_is_unchanged():
    """`verl-prm COMMAND --help` of every command loads no torch, verl, ray or omegaconf (seconds of start-up)."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _EVERY_HELP], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert list(report) == [" ".join(words) for words in cli.COMMANDS]
    for command, entry in report.items():
        assert entry["help"].startswith(f"usage: verl-prm {command} "), command
        assert entry["loaded"] == [], f"verl-prm {command} --help imported {entry['loaded']}"
    for words, usage in HELP_USAGE.items():
        command = " ".join(words)
        text = report[command]["help"]
        assert " ".join(text.split("\n\n")[0].split()) == f"usage: verl-prm {command} {usage}"
    # help texts built from the library's constants, now imported from torch-free modules
    assert "--planted PLANTED     planted sequence, e.g. '3 8 5 11'" in report["demo"]["help"]
    assert "--code-rule {line,block,indent}" in report["label"]["help"]
    assert "--rank {orm,min,max,mean,sum,product,last}" in report["search"]["help"]


def test_label_input_errors_are_one_line(tmp_path, capsys):
    """A missing --reward-fn function and --code-depth without --code-rule: one line each, before any model loads."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1?", "reward_model": {"ground_truth": "2"}, '
                                            '"data_source": "toy"}\n')
    (tmp_path / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 1.0\n")
    common = ["label", "--input", str(tmp_path / "prompts.jsonl"), "--output-dir", str(tmp_path / "labels"),
              "--policy", str(tmp_path / "no_model")]
    assert cli.main(common + ["--reward-fn", f"{tmp_path / 'reward.py'}:nope"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (f"verl-prm label: error: --reward-fn: {tmp_path / 'reward.py'} "
                                                        "has no function named 'nope'")
    assert cli.main(common + ["--reward-fn", "pkg://no_such_module_here:score"]) == 1
    assert capsys.readouterr().err.splitlines()[0].startswith(
        "verl-prm label: error: --reward-fn: cannot import module 'no_such_module_here'")
    assert cli.main(common + ["--reward-fn", f"{tmp_path / 'reward.py'}:score", "--step-regex", "x*"]) == 1
    assert "regex='x*' matches the empty string" in capsys.readouterr().err.splitlines()[0]
    assert cli.main(common + ["--code-depth", "1"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "verl-prm label: error: code_depth (--code-depth 1) applies to a code rule only (the statement depth of "
        "code steps): add --code-rule block (or line, indent), or drop --code-depth")


def test_train_tokenizer_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "shard-00000.parquet").write_bytes(b"")  # never read: the tokenizer is checked first
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    assert cli.main(["train", "--labels", str(tmp_path / "labels"), "--init-config", str(tmp_path / "config.json"),
                     "--tokenizer", str(tmp_path / "tokenizer.json"), "--output-dir", str(tmp_path / "run"),
                     "--no-progress"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == (
        f"verl-prm train: error: --tokenizer '{tmp_path / 'tokenizer.json'}' is a file, not a tokenizer directory: "
        "pass the directory that holds tokenizer_config.json and tokenizer.json (e.g. the model's directory)")


def test_model_output_paths_that_are_files_are_one_line_with_the_fix(tmp_path, capsys, monkeypatch):
    """`verl-prm model from-gguf --output-dir FILE` and `smollm2 --cache-dir FILE` printed only "[Errno 17] File
    exists" (or told to delete a directory) and the log path: the line names the file and the fix, before the
    GGUF file is read or the wheel downloaded."""
    import subprocess

    def no_download(*args, **kwargs):
        raise AssertionError(f"downloaded before checking the cache directory: {args}")

    monkeypatch.setenv("VERL_PRM_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(subprocess, "run", no_download)
    a_file = tmp_path / "a_file"
    a_file.write_text("notes")
    assert cli.main(["model", "from-gguf", str(tmp_path / "never_read.gguf"), "--output-dir", str(a_file)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == (
        f"verl-prm model: error: {a_file} is a file, not a directory: the output directory (--output-dir) must be a "
        "directory (an empty one, or a path that does not exist yet); choose another path or remove the file")
    assert cli.main(["model", "smollm2", "--cache-dir", str(a_file)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(
        f"verl-prm model: error: {a_file} is a file, not a directory (it would hold {a_file / 'SmolLM2-135M-Instruct'}"
        "): the cache directory (--cache-dir, $VERL_PRM_CACHE) must be a directory")
