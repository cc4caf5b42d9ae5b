"""The math of process advantages (docs: concepts.md, "Progress and the effective reward"): small pure functions over torch tensors.

Reference: Setlur et al. 2024, "Rewarding Progress: Scaling Automated Process Verifiers for LLM Reasoning"
(the PAV paper), Eq. 5: the effective reward of step h is Q^pi(s_h, a_h) + alpha * A^mu(s_h, a_h), where the
process advantage (progress) A^mu is the change in the prover's value made by step h.

Shape convention, used by every function here:

    B: responses in the batch, T: padded response length, S: padded number of steps.
    step_ids       [B, T] int64   step (0-based) of each response token, -1 for tokens in no step
    step_values    [B, S] float   v_1..v_H of each response (prover values after each step); h >= H ignored
    prompt_values  [B]    float   v_0 (prover value of the prompt)
    num_steps      [B]    int64   H of each response (0 allowed)

Every function is vectorised over the batch (no Python loop over samples, steps or groups), does no
host-device synchronisation and no hidden transfer (``group_ids`` of host labels makes the one explicit upload,
asynchronous), and runs on CPU and CUDA tensors alike. Nothing here imports verl: `verl_prm.estimators`
registers these functions in verl's estimator registry.

Checks. The functions check what costs no host read: shapes, Python arguments (``alpha`` and the temperature
finite and in range, option names). They never read tensor values, so NaN or inf in a tensor argument
propagates to the result unchecked. The estimators are the checked door: with ``algorithm.pav.check_inputs``
(the default) :func:`check_step_inputs` validates every input tensor, ``token_level_rewards`` included, in one
host read per batch.

Modules: :mod:`~verl_prm.advantages.progress` (progress, process scores, the token advantages of Eq. 5),
:mod:`~verl_prm.advantages.outcome` (prompt groups, verl's outcome advantages),
:mod:`~verl_prm.advantages.contract` (the tensor contract and its checks), :mod:`~verl_prm.advantages.fused` (the
per-token lookup, eager or fused by ``torch.compile``) and :mod:`~verl_prm.advantages.credit` (PURE's and PRIME's
credit assignment). Their public names are importable from here.
"""

from verl_prm.advantages.contract import (
    bad_input_rows, bad_step_id_rows, check_step_inputs, check_step_shapes, valid_steps,
)
from verl_prm.advantages.credit import (
    MIN_SOFTMIN_TEMPERATURE, check_softmin_temperature, leave_one_out_process_advantage,
    leave_one_out_response_rewards, leave_one_out_step_mean, leave_one_out_step_rewards, leave_one_out_token_baseline,
    masked_whiten, min_form_advantage, min_form_step_rewards, pure_whiten, response_end_positions, rewards_to_go,
    softmin_weights, step_end_positions, step_end_rewards,
)
from verl_prm.advantages.fused import FUSED_MIN_TOKENS
from verl_prm.advantages.outcome import (
    batch_baseline_outcome, group_ids, group_normalized_outcome, leave_one_out_outcome, zero_signal_groups,
)
from verl_prm.advantages.progress import (
    MIN_NORMALIZE_STD, aggregate_step_scores, best_of_k, process_advantage, process_advantage_and_bad_rows,
    process_scores, step_progress, step_scores_per_token,
)

__all__ = [
    "FUSED_MIN_TOKENS",
    "MIN_NORMALIZE_STD",
    "MIN_SOFTMIN_TEMPERATURE",
    "aggregate_step_scores",
    "bad_input_rows",
    "bad_step_id_rows",
    "batch_baseline_outcome",
    "best_of_k",
    "check_softmin_temperature",
    "check_step_inputs",
    "check_step_shapes",
    "group_ids",
    "group_normalized_outcome",
    "leave_one_out_outcome",
    "leave_one_out_process_advantage",
    "leave_one_out_response_rewards",
    "leave_one_out_step_mean",
    "leave_one_out_step_rewards",
    "leave_one_out_token_baseline",
    "masked_whiten",
    "min_form_advantage",
    "min_form_step_rewards",
    "process_advantage",
    "process_advantage_and_bad_rows",
    "process_scores",
    "pure_whiten",
    "response_end_positions",
    "rewards_to_go",
    "softmin_weights",
    "step_end_positions",
    "step_end_rewards",
    "step_progress",
    "step_scores_per_token",
    "valid_steps",
    "zero_signal_groups",
]
