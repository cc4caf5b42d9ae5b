"""`verl-prm bench gpu`: the GPU check, one command for a GPU machine (8 minutes at most).

It runs, in order, and prints one Markdown report:

1. **The CUDA variants of the tests**: ``python -m pytest tests -k cuda`` from the source checkout (the tests
   that skip without a GPU carry "cuda" in their id: a ``device`` parameter or the test's name).
2. **The fused estimator kernel**: the per-token lookup of ``verl_prm.advantages.process_advantage`` compiled by
   ``torch.compile`` (a Triton kernel on CUDA) against the eager one, and, when verl imports, the registered
   ``pav_grpo`` (fused and ``compile=never``) against verl's ``grpo_vectorized`` on the same batch.
3. **The critic forward pass** of a random Qwen2 value-head critic of ~0.5B or ~1.5B parameters built from a
   config (Qwen2.5-0.5B / -1.5B shapes; no download): seconds, tokens/s, achieved TFLOP/s, the share of the
   GPU's bf16 peak and peak memory, for padded batches with SDPA, packed rows with SDPA, and packed rows with
   flash-attention varlen (when ``flash-attn`` is installed); a packed row that differs from the padded
   values by more than the dtype's tolerance fails the section.
4. **The scorer end to end**: a random critic saved as a checkpoint (safetensors + a tokenizer trained here),
   then ``ProverCritic.from_pretrained`` (load seconds, peak memory) and ``score_texts``.
5. **A 7B-shape critic** (Qwen2.5-7B's shape) forward in bf16: peak memory and tokens/s.
6. **PAV training steps**: ``verl-prm train --mixed-precision bf16`` on a tiny labelled set (scripted
   Monte-Carlo labels) in a subprocess: steps per second, and the checkpoint it writes.

It needs only torch with CUDA, Triton, transformers and verl-prm's pure-Python dependencies (docs/gpu.md lists
the wheels): no verl, Ray, Hydra, omegaconf, vLLM or flash-attn (verl, when it imports, adds the
``grpo_vectorized`` comparison). Without a CUDA device it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import math
import os
import random
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

from verl_prm.cli_types import finite_float

__all__ = [
    "BF16_PEAK_TFLOPS",
    "CRITIC_SIZES",
    "CUDA_TEST_SELECTION",
    "Section",
    "bf16_peak_tflops",
    "critic_config",
    "format_report",
    "main",
    "markdown_table",
    "no_cuda_message",
    "parse_args",
    "pytest_counts",
]

# Shapes of Qwen2.5-0.5B and Qwen2.5-1.5B (their config.json files): a critic of the size a PAV of a 0.5B-1.5B
# policy has. Random weights: the forward pass costs the same.
CRITIC_SIZES: dict[str, dict[str, int]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
}
QWEN2_VOCAB = 151936  # Qwen2.5-0.5B/-1.5B; 7B's config has 152064
PARTS = ("tests", "estimators", "critic", "scorer", "7b", "train")
# Largest |packed - padded| value (values in [0, 1]) a correct packed forward stays within, per dtype: bf16
# keeps 8 bits of mantissa, and the two layouts sum attention in different orders.
VALUE_TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, TFLOP/s. Matched against
# torch.cuda.get_device_name() in this order; a GPU not listed needs --peak-tflops for the share of peak.
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH200\b.*\bNVL\b", 835.0),
    (r"\bH100\b", 989.0),
    (r"\bH200\b", 989.0),
    (r"\bGH200\b", 989.0),
    (r"\bA100\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)

# The pytest -k expression that selects the GPU variants of the tests.
CUDA_TEST_SELECTION = "cuda"
# Packages a bare GPU image lacks; a test module that imports one cannot be collected there (not a failure).
OPTIONAL_STACK = ("verl", "ray", "hydra", "omegaconf", "vllm", "flash_attn", "trl")
_COLLECTION_ERROR = re.compile(r"^ERROR (\S+)(?: - (.*))?$", re.M)
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")


def collection_errors(output: str) -> tuple[list[str], list[str]]:
    """pytest's ``ERROR path - reason`` summary lines split into (modules that need a package of
    ``OPTIONAL_STACK`` missing here, every other error)."""
    optional, other = [], []
    for path, reason in _COLLECTION_ERROR.findall(output):
        missing = _MISSING_MODULE.search(reason or "")
        if missing and missing.group(1).split(".")[0] in OPTIONAL_STACK:
            optional.append(f"{path} (needs {missing.group(1).split('.')[0]})")
        else:
            other.append(f"{path} - {reason}")
    return optional, other


def bf16_peak_tflops(device_name: str) -> float | None:
    """The data-sheet dense bf16 peak of a GPU from its ``torch.cuda.get_device_name()``; None if not listed."""
    for pattern, peak in BF16_PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


def critic_config(size: str, *, attn_implementation: str = "sdpa", max_position_embeddings: int = 32768):
    """A ``Qwen2Config`` for a value-head critic (``num_labels=1``) of the named size (see ``CRITIC_SIZES``)."""
    if size not in CRITIC_SIZES:
        raise ValueError(f"unknown critic size {size!r}; choose from {', '.join(CRITIC_SIZES)}")
    from transformers import Qwen2Config

    shape = {"vocab_size": QWEN2_VOCAB, **CRITIC_SIZES[size]}
    config = Qwen2Config(num_labels=1, max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                         **shape)
    config._attn_implementation = attn_implementation
    return config


def no_cuda_message() -> str:
    """What the command prints (and why it stops) on a machine without a usable CUDA device."""
    import torch

    built = torch.version.cuda
    reason = (f"this torch {torch.__version__} is a CPU-only build" if built is None
              else f"torch {torch.__version__} (CUDA {built}) finds no device")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if built is not None and hidden is not None and hidden.strip() in ("", "-1"):
        reason += f"; CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"
    return (f"verl-prm bench gpu: no CUDA device is present ({reason}). This check needs an NVIDIA GPU: run it on "
            "a GPU machine with a CUDA build of torch (e.g. `pip install torch -e \".[test]\"` there).")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verl-prm bench gpu", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts to run: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--sizes", default="0.5b,1.5b",
                        help=f"critic sizes to measure, comma-separated, from {', '.join(CRITIC_SIZES)}")
    parser.add_argument("--budget-s", type=finite_float(0.0, low_open=True), default=480.0,
                        help="wall-clock budget of the whole check; a part that would start after it is skipped")
    parser.add_argument("--tests-timeout-s", type=finite_float(0.0, low_open=True), default=240.0, help="limit of the pytest run")
    parser.add_argument("--peak-tflops", type=finite_float(0.0, low_open=True), default=None,
                        help="the GPU's dense bf16 peak (default: from a table of data-sheet values by GPU name)")
    parser.add_argument("--batch", type=int, default=2048, help="estimators: responses per batch")
    parser.add_argument("--length", type=int, default=2048, help="estimators: tokens per response")
    parser.add_argument("--repeats", type=int, default=15, help="estimators: timed rounds (median)")
    parser.add_argument("--sequences", type=int, default=64, help="critic: sequences per batch")
    parser.add_argument("--min-tokens", type=int, default=256, help="critic: shortest sequence")
    parser.add_argument("--max-tokens", type=int, default=4096, help="critic: longest sequence (log-uniform)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=16384, help="critic: token budget per pass")
    parser.add_argument("--critic-repeats", type=int, default=3, help="critic: timed rounds (best)")
    parser.add_argument("--train-steps", type=int, default=20, help="train: optimizer steps of verl-prm train")
    parser.add_argument("--output", default=None, help="also write the report to this Markdown file")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--only: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in CRITIC_SIZES]
    if bad or ("critic" in parts and not sizes):
        parser.error(f"--sizes: unknown size(s) {bad}; choose from {', '.join(CRITIC_SIZES)}")
    for name in ("budget_s", "tests_timeout_s") + (("peak_tflops",) if args.peak_tflops is not None else ()):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    for name in ("batch", "length", "repeats", "sequences", "min_tokens", "max_tokens", "max_tokens_per_batch",
                 "critic_repeats", "train_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_tokens > args.max_tokens:
        parser.error(f"--min-tokens ({args.min_tokens}) must not exceed --max-tokens ({args.max_tokens})")
    args.parts, args.size_list = parts, sizes
    return args


# ------------------------------------------------------------------------------------------------ the report
@dataclass
class Section:
    """One part of the report: a title, a status, an optional table and notes."""

    title: str
    status: str  # "ok", "failed", "skipped"
    seconds: float = 0.0
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; every row must have as many cells as the header."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"table row {list(row)} has {len(row)} cells, the header {len(header)}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def format_report(environment: Sequence[str], sections: Sequence[Section], total_seconds: float,
                  budget_seconds: float) -> str:
    """The whole report as Markdown: environment lines, then each section, then the verdict line."""
    out = ["# verl-prm bench gpu", ""] + [f"- {line}" for line in environment] + [""]
    for section in sections:
        out.append(f"## {section.title} ({section.status}, {section.seconds:.1f} s)")
        out.append("")
        if section.rows:
            out += [markdown_table(section.header, section.rows), ""]
        out += [f"{note}" for note in section.notes]
        if section.notes:
            out.append("")
    failed = [s.title for s in sections if s.status == "failed"]
    within = "within" if total_seconds <= budget_seconds else "OVER"
    verdict = "FAILED: " + ", ".join(failed) if failed else "all parts that ran passed"
    out.append(f"{verdict}; {total_seconds:.0f} s in all ({within} the {budget_seconds:.0f} s budget)")
    return "\n".join(out) + "\n"


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)")


def pytest_counts(summary: str) -> dict[str, int]:
    """Counts from pytest's last summary line, e.g. ``== 3 passed, 1 skipped, 40 deselected in 9.1s ==``."""
    lines = [line for line in summary.strip().splitlines() if _COUNT.search(line)]
    if not lines:
        return {}
    counts: dict[str, int] = {}
    for number, kind in _COUNT.findall(lines[-1]):
        kind = {"error": "errors", "warning": "warnings"}.get(kind, kind)
        counts[kind] = counts.get(kind, 0) + int(number)
    return counts


def _versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "triton", "transformers", "flash-attn", "verl", "verl-prm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


# ------------------------------------------------------------------------------------------------ the parts
def run_cuda_tests(timeout_s: float) -> Section:
    """``python -m pytest tests -k cuda`` in the source checkout, in a subprocess with a time limit."""
    import verl_prm

    root = Path(verl_prm.__file__).resolve().parents[1]
    tests = root / "tests"
    if not tests.is_dir():
        return Section("CUDA tests", "skipped", notes=[
            f"no tests/ next to the package ({root}): installed from a wheel? Run the check from a source checkout."])
    command = [sys.executable, "-m", "pytest", "tests", "-k", CUDA_TEST_SELECTION, "-q", "-rfEs", "-p", "no:cacheprovider",
               "--continue-on-collection-errors"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        output = error.stdout or ""  # bytes even with text=True (subprocess documents this)
        tail = (output.decode(errors="replace") if isinstance(output, bytes) else output)[-2000:]
        return Section("CUDA tests", "failed", time.perf_counter() - start, notes=[
            f"`{' '.join(command[2:])}` did not finish within {timeout_s:.0f} s", "```", tail, "```"])
    seconds = time.perf_counter() - start
    counts = pytest_counts(done.stdout)
    ran = counts.get("passed", 0) + counts.get("failed", 0)
    optional, other = collection_errors(done.stdout)
    errors = counts.get("errors", 0) - len(optional)
    # exit status 1 with only optional-stack collection errors and no failure is a pass on a bare image
    ok = done.returncode in (0, 1) and counts.get("failed", 0) == 0 and errors == 0 and not other
    status = "ok" if ok else "failed"
    header = ["passed", "failed", "errors", "not collected (optional stack missing)", "skipped", "deselected"]
    notes = [f"`python -m pytest tests -k {CUDA_TEST_SELECTION}` (exit status {done.returncode})"]
    if optional:
        notes.append("not collected here (the package is not installed): " + ", ".join(optional))
    if ran == 0:
        notes.append("no CUDA test ran: check the selection and the skip reasons below")
        status = "failed"
    if not ok or ran == 0:
        notes += ["```", done.stdout[-3000:] + done.stderr[-1000:], "```"]
    row = [str(counts.get("passed", 0)), str(counts.get("failed", 0)), str(errors), str(len(optional)),
           str(counts.get("skipped", 0)), str(counts.get("deselected", 0))]
    return Section("CUDA tests", status, seconds, header, [row], notes)


def bench_estimators(args, device: str = "cuda") -> Section:
    """The fused per-token lookup against eager, and pav_grpo against verl's grpo_vectorized (``device``: the
    tests run it on CPU at a small size)."""
    import torch

    from verl_prm.advantages import process_advantage
    from verl_prm.apps.bench.advantages import interleaved_medians, make_batch

    start = time.perf_counter()
    data = make_batch(args.batch, args.length, 32, 8, device)
    scores = data["step_values"] - data["prompt_values"][:, None]
    outcome = torch.randn(args.batch, device=device)

    def lookup(mode: str) -> Callable[[], torch.Tensor]:
        return lambda: process_advantage(outcome, scores, data["step_ids"], data["response_mask"], 1.0, compile=mode)

    notes = []
    with torch.no_grad():
        compile_start = time.perf_counter()
        fused_out = lookup("always")()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        notes.append(f"first fused call (torch.compile: Triton on CUDA; once per process): {time.perf_counter() - compile_start:.1f} s")
        eager_out = lookup("never")()
        notes.append(f"max |fused - eager| = {float((fused_out - eager_out).abs().max()):.1e} (must be 0)")
        cases = {"lookup, fused kernel": lookup("always"), "lookup, eager": lookup("never")}
        try:
            import verl  # noqa: F401  (loads the plugin, which registers pav_grpo)
            from omegaconf import OmegaConf
            from verl.trainer.ppo.core_algos import get_adv_estimator_fn
        except Exception as error:  # a bare GPU box without verl (or ray): the kernel comparison still runs
            notes.append(f"verl does not import ({type(error).__name__}: {error}); grpo_vectorized not measured")
        else:
            def estimator(name: str, **pav) -> Callable[[], object]:
                fn = get_adv_estimator_fn(name)
                config = OmegaConf.create({"adv_estimator": name, "norm_adv_by_std_in_grpo": True,
                                           "pav": {"alpha": 1.0, "check_inputs": False, **pav}})
                kwargs = data if name.startswith("pav") else {
                    k: data[k] for k in ("token_level_rewards", "response_mask", "index")}
                return lambda: fn(**kwargs, config=config)

            cases["grpo_vectorized (verl)"] = estimator("grpo_vectorized")
            cases["pav_grpo (fused)"] = estimator("pav_grpo", compile="always")
            cases["pav_grpo (compile=never)"] = estimator("pav_grpo", compile="never")
        medians, _, _ = interleaved_medians(cases, args.repeats, device)
    reference = medians.get("grpo_vectorized (verl)")
    header = ["case", "ms", "x grpo_vectorized", "x eager lookup"]
    rows = [[name, f"{seconds * 1e3:.3f}", f"{seconds / reference:.2f}" if reference else "n/a",
             f"{seconds / medians['lookup, eager']:.2f}"] for name, seconds in medians.items()]
    notes.insert(0, f"B={args.batch} T={args.length} 32 steps, groups of 8, median of {args.repeats} interleaved rounds")
    status = "ok" if float((fused_out - eager_out).abs().max()) == 0.0 else "failed"
    return Section(f"Estimators on {device}", status, time.perf_counter() - start, header, rows, notes)


def _random_value_head(config, device: str, dtype):
    """A random Qwen2 value-head model (``num_labels=1``) built directly on ``device`` and its critic adapter."""
    import copy

    import torch
    from transformers import Qwen2ForTokenClassification

    from verl_prm.critic.formats import ValueHeadFormat

    with torch.device(device):
        model = Qwen2ForTokenClassification._from_config(config, dtype=dtype).eval()
    return model, ValueHeadFormat(model, model.base_model, copy.deepcopy(model.score).float().eval())


def critic_modes(cuda: bool, flash_attn: bool, packed: bool = True) -> list[tuple[str, str]]:
    """(batching, attention) rows of the critic part: padded SDPA first (the reference of the value check),
    packed rows with SDPA (a block-diagonal mask), packed rows with flash-attention varlen (CUDA, installed)."""
    modes = [("padded", "sdpa")]
    if packed:
        modes.append(("varlen", "sdpa"))
        if cuda and flash_attn:
            modes.append(("varlen", "flash_attention_2"))
    return modes


def _peak_memory_gib(cuda: bool) -> str:
    import torch

    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if cuda else "n/a (CPU)"


def bench_critic(args, size: str, peak: float | None, seed: int = 0, *, device: str = "cuda", dtype=None,
                 config=None, packed: bool = True) -> Section:
    """Forward pass of a random critic of ``size``: padded + SDPA, packed + SDPA, packed + flash-attention
    varlen (CUDA, when installed). ``packed=False``: the padded row only (the 7B part: memory and tokens/s).

    The section fails when a packed row's values differ from the padded ones by more than the dtype's
    ``VALUE_TOLERANCE`` or any value is not finite. ``device``, ``dtype`` and ``config`` (default: cuda, bf16,
    ``critic_config(size)``) let the tests run the same code on CPU with a tiny config.
    """
    import torch

    from verl_prm.apps.bench.critic import make_batch
    from verl_prm.critic import ProverCritic
    from verl_prm.critic.flops import forward_flops, non_embedding_parameters
    from verl_prm.critic.packing import padding_share

    start = time.perf_counter()
    torch.manual_seed(seed)
    config = config if config is not None else critic_config(size)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, adapter = _random_value_head(config, device, dtype if dtype is not None else torch.bfloat16)
    config = model.config
    batch_args = SimpleNamespace(sequences=args.sequences, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                 steps=8, vocab=config.vocab_size)
    input_ids, prompt_ends, step_ends = make_batch(batch_args, random.Random(seed))
    parameters = non_embedding_parameters(model.base_model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    lengths = [len(ids) for ids in input_ids]
    flops = forward_flops(parameters, lengths, config.num_hidden_layers, config.num_attention_heads * head_dim)
    has_flash = cuda and importlib.util.find_spec("flash_attn") is not None
    modes = critic_modes(cuda, has_flash, packed)
    model_dtype = next(model.parameters()).dtype
    tolerance = VALUE_TOLERANCE[str(model_dtype).removeprefix("torch.")]
    header = ["batching", "attention", "seconds", "tokens/s", "TFLOP/s", "share of bf16 peak", "padded share",
              "max abs diff to padded", "peak memory GiB"]
    rows, notes, values, problems = [], [], {}, []
    for packing, attention in modes:
        if attention != config._attn_implementation:
            model.set_attn_implementation(attention)
        critic = ProverCritic(adapter, None, device=torch.device(device), packing=packing,
                              max_tokens_per_batch=args.max_tokens_per_batch)
        inputs = critic.build_inputs(input_ids, prompt_ends, step_ends)
        plan = critic.plan(inputs)
        critic.forward_values(inputs, plan)  # warm-up: kernels, allocator
        best = math.inf
        for _ in range(args.critic_repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            values[attention, packing] = critic.forward_values(inputs, plan)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        tflops = flops / best / 1e12
        current = values[attention, packing]
        diff = max(float((a - b).abs().max()) for a, b in zip(current, values["sdpa", "padded"]))
        if not all(bool(torch.isfinite(v).all()) for v in current):
            problems.append(f"{packing}/{attention}: values not finite")
        elif not diff <= tolerance:
            problems.append(f"{packing}/{attention}: max |value - padded value| = {diff:.1e} exceeds the "
                            f"{model_dtype} tolerance {tolerance:.0e}")
        rows.append([packing, attention, f"{best:.3f}", f"{sum(lengths) / best:,.0f}", f"{tflops:.1f}",
                     f"{tflops / peak:.1%}" if peak else "n/a", f"{padding_share(plan, critic.packing):.1%}",
                     f"{diff:.1e}", _peak_memory_gib(cuda)])
    if cuda and packed and not has_flash:
        notes.append("flash-attn is not installed: the flash-attention varlen row is not measured "
                     "(`pip install flash-attn --no-build-isolation`, needs nvcc)")
    notes += [f"FAILED: {problem}" for problem in problems]
    notes.insert(0, f"random Qwen2 value head, {size} shape: {parameters / 1e9:.2f}B non-embedding parameters, "
                    f"{model_dtype}; {len(lengths)} sequences of {args.min_tokens}-{args.max_tokens} tokens "
                    f"({sum(lengths):,} in all, log-uniform), 8 steps each; budget {args.max_tokens_per_batch} "
                    f"tokens per pass; best of {args.critic_repeats}; FLOPs = 2 x parameters x tokens + causal "
                    "attention (verl_prm.critic.flops)")
    del model, adapter
    if cuda:
        torch.cuda.empty_cache()
    return Section(f"Critic forward, {size}", "failed" if problems else "ok", time.perf_counter() - start, header,
                   rows, notes)


def _tiny_tokenizer(seed: int = 0):
    """A byte-level BPE tokenizer trained here on the scripted task's texts (no hub download)."""
    from verl_prm.bpe import train_byte_level_bpe
    from verl_prm.labeling.closed_form_task import ScriptedStepTask

    task = ScriptedStepTask(num_steps=4)
    texts = [task.prompt(i) for i in range(200)] + ["step 1: ok\n\nstep 2: ok\n\nanswer: 4"] * 20
    return train_byte_level_bpe(texts, vocab_size=400)


def bench_scorer(args, size: str, *, device: str = "cuda", dtype=None, config=None, workdir: str | None = None) -> Section:
    """A random critic of ``size`` saved as a checkpoint, loaded with ``ProverCritic.from_pretrained`` (load
    seconds, peak memory) and scoring texts; fails unless every value is finite and in [0, 1]."""
    import tempfile

    import torch

    from verl_prm.critic import ProverCritic

    start = time.perf_counter()
    cuda = device.startswith("cuda")
    dtype = dtype if dtype is not None else torch.bfloat16
    tokenizer = _tiny_tokenizer()
    config = config if config is not None else critic_config(size)
    config.pad_token_id = tokenizer.pad_token_id
    model, _ = _random_value_head(config, "cpu", dtype)
    with tempfile.TemporaryDirectory(dir=workdir) as checkpoint:
        model.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        del model
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        critic = ProverCritic.from_pretrained(checkpoint, device=device, dtype=dtype)
        if cuda:
            torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        load_peak = _peak_memory_gib(cuda)
        prompts = [f"Question {i}: add the numbers." for i in range(args.sequences)]
        responses = ["step 1: ok\n\nstep 2: ok\n\nanswer: 4"] * args.sequences
        t0 = time.perf_counter()
        scores = critic.score_texts(prompts, responses, delimiter="\n\n")
        if cuda:
            torch.cuda.synchronize()
        score_s = time.perf_counter() - t0
        attention = critic.adapter.model.config._attn_implementation
        del critic
    values = torch.cat([scores.prompt_values.flatten(), scores.step_values.flatten()])
    ok = (bool(torch.isfinite(values).all()) and bool(((values >= 0) & (values <= 1)).all())
          and scores.num_steps.tolist() == [3] * len(prompts))
    header = ["load seconds", "peak memory after load GiB", "score seconds", "texts", "attention", "peak memory GiB"]
    rows = [[f"{load_s:.2f}", load_peak, f"{score_s:.3f}", str(len(prompts)), attention, _peak_memory_gib(cuda)]]
    notes = [f"random Qwen2 value head, {size} shape, {dtype}, saved with save_pretrained (safetensors) and loaded "
             f"with ProverCritic.from_pretrained(device={device!r})"]
    if not ok:
        notes.append(f"FAILED: values not all finite and in [0, 1], or not 3 steps per response: "
                     f"{values.tolist()[:8]}, num_steps {scores.num_steps.tolist()[:8]}")
    if cuda:
        torch.cuda.empty_cache()
    return Section(f"Scorer from_pretrained, {size}", "ok" if ok else "failed", time.perf_counter() - start,
                   header, rows, notes)


def write_tiny_labels(root: Path, prompts: int = 32, n_cov: int = 4, n_mc: int = 8) -> Path:
    """Scripted Monte-Carlo labels (``verl_prm.labeling.closed_form_task``) as a label shard under ``root/labels``."""
    from verl_prm.labeling.inputs import PromptItem
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.scoring import OutcomeScorer
    from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask, scripted_step_score
    from verl_prm.labeling.store import ShardStore

    task = ScriptedStepTask(num_steps=4)
    items = [PromptItem(i, task.prompt(i), str(task.num_steps), "scripted") for i in range(prompts)]
    labeler = MonteCarloLabeler(ScriptedStepGenerator(0.75), ScriptedStepGenerator(0.7),
                                OutcomeScorer(scripted_step_score), LabelSettings(n_cov=n_cov, n_mc=n_mc, seed=0))
    ShardStore(root / "labels").write_shard(labeler.label(items, [item.prompt for item in items]))
    return root / "labels"


def bench_training(args, size: str, *, cpu: bool = False, workdir: str | None = None,
                   timeout_s: float = 240.0) -> Section:
    """``verl-prm train`` (bf16 mixed precision on GPU; ``cpu``: ``--cpu --mixed-precision no``) of a random
    critic of ``size`` (``"tiny"``: a 2-layer test shape) on scripted labels, in a subprocess: steps/s."""
    import json
    import tempfile

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir) as root_name:
        root = Path(root_name)
        labels = write_tiny_labels(root)
        tokenizer = _tiny_tokenizer()
        tokenizer.save_pretrained(root / "tokenizer")
        shape = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2) if size == "tiny" else
                 {k: v for k, v in CRITIC_SIZES[size].items() if k != "vocab_size"})
        (root / "config.json").write_text(json.dumps(dict(model_type="qwen2", vocab_size=len(tokenizer),
                                                          max_position_embeddings=512, **shape)))
        command = [sys.executable, "-m", "verl_prm.training.cli", "--labels", str(labels),
                   "--output-dir", str(root / "pav"), "--init-config", str(root / "config.json"),
                   "--tokenizer", str(root / "tokenizer"), "--max-steps", str(args.train_steps),
                   "--batch-size", "8", "--warmup-steps", "2", "--max-length", "256", "--no-progress", "--calibration", "none",
                   "--log-every", str(max(1, args.train_steps)),
                   *(["--cpu", "--mixed-precision", "no"] if cpu else ["--mixed-precision", "bf16"])]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Section(f"PAV training, {size}", "failed", time.perf_counter() - start,
                           notes=[f"`verl-prm train` did not finish within {timeout_s:.0f} s"])
        seconds = time.perf_counter() - t0
        checkpoints = sorted(p.name for p in (root / "pav").glob("checkpoint-*") if p.is_dir())
    ok = done.returncode == 0 and bool(checkpoints)
    notes = [f"`verl-prm train {' '.join(command[4:])}` (in a temporary directory), exit status "
             f"{done.returncode}; seconds include start-up and the final evaluation"]
    if not ok:
        notes += ["FAILED: no checkpoint written" if done.returncode == 0 else "FAILED", "```",
                  (done.stdout[-1500:] + done.stderr[-2500:]).strip(), "```"]
    header = ["steps", "seconds", "steps/s", "mixed precision", "checkpoint"]
    rows = [[str(args.train_steps), f"{seconds:.1f}", f"{args.train_steps / seconds:.2f}",
             "no (CPU)" if cpu else "bf16", checkpoints[-1] if checkpoints else "none"]]
    return Section(f"PAV training, {size}", "ok" if ok else "failed", time.perf_counter() - start, header, rows,
                   notes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(no_cuda_message(), file=sys.stderr)
        return 2
    started = time.perf_counter()
    deadline = started + args.budget_s
    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    peak = args.peak_tflops or bf16_peak_tflops(name)
    versions = _versions()
    environment = [
        f"GPU: {name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB); bf16 peak "
        + (f"{peak:.0f} TFLOP/s ({'--peak-tflops' if args.peak_tflops else 'data sheet, dense'})" if peak
           else "unknown (pass --peak-tflops for the share of peak)"),
        "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; CUDA {torch.version.cuda}",
    ]
    sections: list[Section] = []

    def remaining() -> float:
        return deadline - time.perf_counter()

    def attempt(title: str, needs_s: float, run: Callable[[], Section]) -> None:
        if remaining() < needs_s:
            sections.append(Section(title, "skipped", notes=[
                f"not started: {remaining():.0f} s of the {args.budget_s:.0f} s budget left (needs ~{needs_s:.0f} s)"]))
            return
        t0 = time.perf_counter()
        try:
            sections.append(run())
        except Exception as error:  # report the part as failed and go on with the others
            where = "".join(traceback.format_exception(error, limit=-4)).rstrip()
            sections.append(Section(title, "failed", time.perf_counter() - t0,
                                    notes=[f"{type(error).__name__}: {error}", "```", where, "```"]))
        print(f"[bench gpu] {title}: {sections[-1].status} ({sections[-1].seconds:.0f} s)", file=sys.stderr, flush=True)

    if "tests" in args.parts:
        reserve = 60.0 * (("estimators" in args.parts) + len(args.size_list) * ("critic" in args.parts)
                          + sum(part in args.parts for part in ("scorer", "7b", "train")))
        attempt("CUDA tests", 30.0, lambda: run_cuda_tests(max(30.0, min(args.tests_timeout_s, remaining() - reserve))))
    if "estimators" in args.parts:
        attempt("Estimators on cuda", 40.0, lambda: bench_estimators(args))
    if "critic" in args.parts:
        for size in args.size_list:
            attempt(f"Critic forward, {size}", 40.0, lambda size=size: bench_critic(args, size, peak))
    if "scorer" in args.parts:
        size = args.size_list[0] if args.size_list else "0.5b"
        attempt(f"Scorer from_pretrained, {size}", 30.0, lambda: bench_scorer(args, size))
    if "7b" in args.parts:
        attempt("Critic forward, 7b", 60.0, lambda: bench_critic(args, "7b", peak, packed=False))
    if "train" in args.parts:
        attempt("PAV training, 0.5b", 60.0, lambda: bench_training(args, "0.5b", timeout_s=max(30.0, remaining())))
    report = format_report(environment, sections, time.perf_counter() - started, args.budget_s)
    print(report)
    if args.output:
        Path(args.output).write_text(report)
    return 1 if any(s.status == "failed" for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
