"""The per-token lookup of :func:`~verl_prm.advantages.progress.process_advantage`: eager PyTorch, or one fused
kernel that also computes the contract's flags in the pass that reads the step ids: on a CPU with AVX-512 the C
kernel of :mod:`~verl_prm.advantages.native` (a vector permute or gather per 16 tokens), elsewhere (and for the CPU
dtypes the C kernel does not take) the expression below compiled by ``torch.compile``. Shapes as in :mod:`verl_prm.advantages`.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from verl_prm.advantages import native
from verl_prm.advantages.contract import bad_input_rows, bad_small_input_rows

# compile="auto" fuses the per-token lookup for batches of at least this many tokens; below it an eager call
# costs about a millisecond, and the one-time build (about a second for the C kernel, 3-11 s for torch.compile
# on CPU) would not pay off.
FUSED_MIN_TOKENS = 1 << 20


def masked_lookup(table: torch.Tensor, step_ids: torch.Tensor, response_mask: torch.Tensor, checked, compile: str
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(table[i, step_ids[i, t] + 1] * response_mask[i, t] [B, T], bad_rows [B] or None)``, run as ``compile``
    says (``process_advantage``'s argument: the fused kernel always, never, or from ``FUSED_MIN_TOKENS`` tokens).
    ``checked``: the small tensors of ``bad_input_rows`` (step values, prompt values, step counts, outcomes), or
    None for no flags."""
    if step_ids.numel() and (compile == "always" or (compile == "auto" and step_ids.numel() >= FUSED_MIN_TOKENS)):
        return _fused_masked_lookup(table, step_ids, response_mask, checked, fall_back=compile == "auto")
    return _eager_masked_lookup(table, step_ids, response_mask, checked)


def lookup(table: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """``out[i, t] = table[i, clamp(step_ids[i, t], -1, S - 1) + 1]`` for a table of S + 1 columns whose column
    0 stands for "no step" (-1).

    The clamp keeps an out-of-range id (possible when ``pav.check_inputs`` is off) inside its own row: without
    it the flat index would read a neighbouring response's value. It costs one in-place pass over the int32 copy
    (within the run-to-run noise of ``verl-prm bench advantages --threads 1``)."""
    batch, columns = table.shape
    # One flat index_select over int32 indices: it reads the [B, T] step ids once and allocates no int64
    # [B, T] temporary (memory traffic dominates this function; on CPU a fresh 32 MB buffer also costs page
    # faults on every call).
    index_dtype = torch.int32 if batch * columns < 2**31 else torch.int64
    row_starts = torch.arange(batch, device=step_ids.device, dtype=index_dtype)[:, None] * columns + 1
    # clamped before the conversion (an int64 id past the int32 range would wrap); the result is a new tensor,
    # so add_ cannot change the caller's ids
    flat_index = step_ids.clamp(-1, columns - 2).to(index_dtype).add_(row_starts)
    return table.reshape(-1).index_select(0, flat_index.reshape(-1)).view(step_ids.shape)


def _masked_lookup(table: torch.Tensor, step_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``out[i, t] = table[i, step_ids[i, t] + 1] * response_mask[i, t]``, ids clamped as in ``lookup`` (free inside
    the fused kernel; on CUDA an out-of-range gather would be a device-side assert that ends the process)."""
    columns = table.shape[1]
    return torch.gather(table, 1, (step_ids.long() + 1).clamp(0, columns - 1)) * response_mask.to(table.dtype)


def _checked_masked_lookup(table, step_ids, response_mask, step_values, prompt_values, num_steps,
                           outcome_rewards) -> tuple[torch.Tensor, torch.Tensor]:
    """``_masked_lookup`` and ``bad_input_rows``, written as expressions over the same inputs so that
    ``torch.compile`` makes the lookup and the step-id check one pass that reads ``step_ids`` and the mask once
    and writes ``out``, with the checks of the small tensors fused in. The step-id check is
    ``max_t max(step_ids[i, t] - (num_steps[i] - 1), -1 - step_ids[i, t]) > 0``: a max reduction vectorises (an
    ``any`` over booleans measured 40% slower)."""
    out = _masked_lookup(table, step_ids, response_mask)
    overshoot = torch.maximum(step_ids - (num_steps[:, None] - 1), -1 - step_ids).amax(dim=1)
    return out, (overshoot > 0) | bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards)


def _eager_masked_lookup(table, step_ids, response_mask, checked):
    advantages = lookup(table, step_ids).mul_(response_mask)
    return advantages, (bad_input_rows(step_ids, *checked) if checked is not None else None)


_compiled_lookups: dict[bool, Callable] = {}
_compile_failed: str | None = None
_compile_lock = threading.Lock()
_log = logging.getLogger(__name__)

_FALLBACK_WARNING = ("verl-prm: %s of the per-token advantage lookup failed (%s); using eager PyTorch, which is "
                     "about 2-4x slower on large CPU batches. Set algorithm.pav.compile=never to skip the attempt.")


def _fused_masked_lookup(table, step_ids, response_mask, checked, *, fall_back: bool):
    """The fused lookup: the C kernel for the CPU inputs it takes, else the compiled ``_checked_masked_lookup``
    (``_masked_lookup`` without ``checked``); with ``fall_back``, a failed build warns once and runs eager."""
    global _compile_failed
    if fall_back and _compile_failed is not None:
        return _eager_masked_lookup(table, step_ids, response_mask, checked)
    if native.native_lookup_supported(table, step_ids, response_mask):
        try:
            # without AVX-512 the kernel's plain loop measured slower than torch.compile's: use that instead
            if native.vectorised():
                return _native_masked_lookup(table, step_ids, response_mask, checked)
        except native.NativeLookupError as error:
            if not fall_back:
                raise
            _compile_failed = str(error).splitlines()[0][:300]
            _log.warning(_FALLBACK_WARNING, "the C kernel build", _compile_failed)
            return _eager_masked_lookup(table, step_ids, response_mask, checked)
    with _compile_lock:
        if (checked is not None) not in _compiled_lookups:
            # dynamic=True: one kernel for every batch size and response length (no recompiles as they change).
            # No bounds assert on the gather: its index is clamped in the kernel, and the assert (a branch per
            # element) measured ~30% of the kernel's time on CPU.
            _compiled_lookups[checked is not None] = torch.compile(
                _checked_masked_lookup if checked is not None else _masked_lookup, dynamic=True,
                options={"assert_indirect_indexing": False})
    try:
        if checked is None:
            return _compiled_lookups[False](table, step_ids, response_mask), None
        step_values, prompt_values, num_steps, outcome_rewards = checked
        return _compiled_lookups[True](table, step_ids, response_mask, step_values, prompt_values,
                                       num_steps.to(step_ids.device), outcome_rewards)
    except torch._dynamo.exc.TorchDynamoException as error:  # compilation failed (no C++ compiler, no Triton)
        if not fall_back:
            raise
        eager = _eager_masked_lookup(table, step_ids, response_mask, checked)  # bad inputs raise their own error
        _compile_failed = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        _log.warning(_FALLBACK_WARNING, "torch.compile", _compile_failed)
        return eager


def _native_masked_lookup(table, step_ids, response_mask, checked):
    """``native.native_lookup`` with the flags of ``bad_input_rows`` (the small tensors' checks in the kernel when
    they are float32 CPU tensors, else here)."""
    if step_ids.dim() != 2 or step_ids.shape != response_mask.shape or table.shape[0] != step_ids.shape[0]:
        # the eager path's own error for mismatched inputs (the kernel reads raw pointers)
        return _eager_masked_lookup(table, step_ids, response_mask, checked)
    if checked is None:
        out, _ = native.native_lookup(table, step_ids, response_mask, torch.zeros(step_ids.shape[0]), None)
        return out, None
    step_values, prompt_values, num_steps, outcome_rewards = checked
    small = (step_values, prompt_values, outcome_rewards)
    in_kernel = all(x.device.type == "cpu" and x.dtype == torch.float32 for x in small) \
        and step_values.shape == (table.shape[0], table.shape[1] - 1)
    out, bad = native.native_lookup(table, step_ids, response_mask, num_steps, small if in_kernel else None)
    if not in_kernel:
        bad = bad | bad_small_input_rows(step_values, prompt_values, num_steps, outcome_rewards).to(bad.device)
    return out, bad
