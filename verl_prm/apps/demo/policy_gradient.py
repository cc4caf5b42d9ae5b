"""Policy-gradient RL on the planted sub-sequence task through the product's own path.

Every iteration: sample a batch from the policy; build a verl ``DataProto`` with the outcome reward at the last
valid token, the response mask and one ``uid`` for the whole batch (the task has a single prompt, so the batch is
one GRPO group), and the batch's step tensors (``StepInputs``; every token a step: ``step_ids[i, t] = t``;
``step_values`` = the prover's value after each token; ``prompt_values`` = its value of the empty prefix);
compute advantages as the verl trainer hook does (:func:`compute_advantages`: verl's
``compute_advantage_for_multi_trajectories`` inside ``estimator_step_inputs``, so verl looks the registered
estimator up and the estimator reads the step tensors from the context); take the loss from verl's own
policy-loss function
(``get_policy_loss_fn("vanilla")`` with a real ``ActorConfig``); one Adam step. On-policy with one update per
batch, so ``old_log_prob = log_prob.detach()``, the PPO ratio is 1 and the loss is the policy gradient
``-mean(adv * log pi)`` (aggregated by verl's ``loss_agg_mode``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from verl_prm.apps.demo.env import PlantedTask
from verl_prm.apps.demo.policy import MadePolicy, sequence_log_probs, supervised_warm_start
from verl_prm.config import read_pav_config
from verl_prm.integrations.verl.advantage import StepInputs, estimator_step_inputs

__all__ = [
    "RLConfig",
    "RunResult",
    "ValueFn",
    "actor_config",
    "algorithm_config",
    "build_batch",
    "compute_advantages",
    "exact_values",
    "import_verl",
    "iterations_to",
    "parsed_algorithm_config",
    "make_base_policy",
    "pass_at_n",
    "rl_step",
    "train_rl",
]

# tokens [B, T] -> (step_values [B, T] prover value after each token, prompt_values [B])
ValueFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def import_verl() -> None:
    """Import verl so that its "verl.plugins" entry point registers the PAV estimators; fail loudly otherwise."""
    import verl  # noqa: F401  (the import loads the plugin)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    if "pav_grpo" not in ADV_ESTIMATOR_REGISTRY:
        raise RuntimeError(
            "verl did not register the estimator 'pav_grpo': the verl-prm plugin is not installed as a "
            "'verl.plugins' entry point (pip install -e . in the verl-prm checkout)"
        )


@dataclass
class RLConfig:
    """One RL run. ``alpha = 0`` is outcome-only RL."""

    alpha: float = 1.0
    gamma: float = 10.0  # prover strength (ignored when a value function is passed in)
    iterations: int = 400
    batch_size: int = 64
    lr: float = 1e-3
    estimator: str = "pav_grpo"
    # verl's defaults: GRPO's division by the group std (True) and token-mean loss aggregation. False:
    # out_i = R_i - mean R (Dr. GRPO; with one group per batch this is the paper's REINFORCE with a batch-mean
    # baseline, identical to pav_reinforce).
    norm_adv_by_std: bool = True
    loss_agg_mode: str = "token-mean"
    # iterations whose policy is kept (for Pass@N after 100 iterations)
    snapshots: tuple[int, ...] = (100,)
    # validate the step tensors on the first iteration only (the check reads them on the host)
    check_first: bool = True


@dataclass
class RunResult:
    accuracy: np.ndarray  # [iterations] success rate of each on-policy batch (before its update)
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    final_state: dict[str, torch.Tensor] | None = None
    mean_abs_process: np.ndarray | None = None  # [iterations] mean |A^mu| over the valid steps of each batch


def algorithm_config(cfg: RLConfig, check_inputs: bool = True) -> DictConfig:
    """verl's ``algorithm`` config section for the run (what verl passes to every estimator)."""
    return OmegaConf.create(
        {
            "adv_estimator": cfg.estimator,
            "norm_adv_by_std_in_grpo": cfg.norm_adv_by_std,
            "pav": {"alpha": float(cfg.alpha), "best_of_k": 1, "check_inputs": check_inputs},
        }
    )


def parsed_algorithm_config(config: DictConfig) -> dict:
    """``config`` with its ``pav`` section parsed once into a ``PavConfig`` (which ``read_pav_config`` accepts
    as is). Same estimator inputs; it skips the OmegaConf merge that ``read_pav_config`` does on every call
    (~4 ms, a third of a toy iteration on one core)."""
    return {
        "adv_estimator": config.adv_estimator,
        "norm_adv_by_std_in_grpo": config.norm_adv_by_std_in_grpo,
        "pav": read_pav_config(config),
    }


def actor_config(cfg: RLConfig):
    """A real verl ``ActorConfig`` for ``compute_policy_loss_vanilla`` (it reads the clip ratios, ``clip_ratio_c``
    and ``global_batch_info``; the rest are verl's defaults)."""
    from verl.workers.config.actor import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=cfg.batch_size,
        ppo_mini_batch_size=cfg.batch_size,
        ppo_micro_batch_size_per_gpu=cfg.batch_size,
        loss_agg_mode=cfg.loss_agg_mode,
    )


def exact_values(task: PlantedTask, gamma: float) -> ValueFn:
    """The exact prover values of ``mu_gamma`` (dynamic programming) as a ``ValueFn``."""
    table = task.value_table(gamma)
    return lambda tokens: task.step_values(tokens, table)


def build_batch(task: PlantedTask, tokens: torch.Tensor, values: ValueFn):
    """The verl ``DataProto`` of a sampled batch and its step tensors (docs/concepts.md), every token one step.

    Args:
        tokens: [B, T] sampled sequences (EOS-padded).

    Returns:
        ``(data, inputs)``: ``data`` a DataProto with batch keys ``responses``, ``token_level_rewards`` (outcome
        at the last valid token), ``response_mask`` and non-tensor ``uid`` (one group: the task has one prompt);
        ``inputs`` the ``StepInputs`` (``step_ids`` t for valid tokens, -1 after EOS; ``step_values``;
        ``prompt_values``; ``num_steps``; ``truncated`` all False, as T tokens end the episode: V(T, k) is
        terminal).
    """
    from verl.protocol import DataProto

    mask = task.response_mask(tokens)
    num_steps = mask.sum(dim=1)
    rewards = task.rewards(tokens)
    token_level_rewards = torch.zeros(tokens.shape, dtype=torch.float32)
    token_level_rewards.scatter_(1, (num_steps - 1)[:, None], rewards[:, None])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    step_ids = torch.where(mask.bool(), positions, torch.full_like(positions, -1))
    step_values, prompt_values = values(tokens)
    data = DataProto.from_dict(
        tensors={"responses": tokens, "token_level_rewards": token_level_rewards, "response_mask": mask},
        non_tensors={"uid": np.full(tokens.shape[0], "planted", dtype=object)},
    )
    inputs = StepInputs(step_ids, step_values.float(), prompt_values.float(), num_steps,
                        torch.zeros(tokens.shape[0], dtype=torch.bool))
    return data, inputs


def compute_advantages(data, inputs: StepInputs, algo_config: DictConfig | dict):
    """``advantages`` and ``returns`` written into ``data`` as in the trainer hook's advantage phase.

    The hook runs verl's ``PPOTrainer._compute_advantage`` inside ``estimator_step_inputs``; that method reads and
    writes TransferQueue around verl's ``compute_advantage_for_multi_trajectories``, which is called here inside
    the same context, with the keys verl's agent loop writes (``{uid}_{session}_{index}``, one session a
    response). No Ray, no TransferQueue; the KL-in-reward penalty and the rollout correction are off.
    """
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    rows = len(data)
    keys = [f"{uid}_{row}_0" for row, uid in enumerate(data.non_tensor_batch["uid"])]
    with estimator_step_inputs(inputs):
        return compute_advantage_for_multi_trajectories(
            data, batch_keys=keys, adv_estimator=algo_config["adv_estimator"], num_repeat=rows,
            norm_adv_by_std_in_grpo=algo_config["norm_adv_by_std_in_grpo"], config=algo_config,
        )


def rl_step(
    policy: MadePolicy,
    optimizer: torch.optim.Optimizer,
    data,
    inputs: StepInputs,
    algo_config: DictConfig | dict,
    actor_cfg,
) -> torch.Tensor:
    """Advantages through the plugin, loss through verl, one optimizer step. Returns the advantages [B, T]."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    data = compute_advantages(data, inputs, algo_config)
    tokens = data.batch["responses"]
    mask = data.batch["response_mask"]
    log_prob = sequence_log_probs(policy, tokens)
    loss_fn = get_policy_loss_fn(actor_cfg.policy_loss.loss_mode)
    loss, _ = loss_fn(
        old_log_prob=log_prob.detach(),
        log_prob=log_prob,
        advantages=data.batch["advantages"],
        response_mask=mask,
        loss_agg_mode=actor_cfg.loss_agg_mode,
        config=actor_cfg,
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return data.batch["advantages"]


def make_base_policy(
    task: PlantedTask,
    seed: int,
    *,
    warm_gamma: float = 5.0,
    warm_samples: int = 3200,
    warm_iterations: int = 50,
    batch_size: int = 64,
    lr: float = 1e-3,
) -> MadePolicy:
    """The RL starting point: a fresh MADE policy (seeded) warm-started on ``warm_samples`` samples of mu_5."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    policy = MadePolicy(task.length, task.vocab)
    data = task.sample_prover(warm_gamma, warm_samples, generator)
    supervised_warm_start(
        policy,
        data,
        task.response_mask(data),
        iterations=warm_iterations,
        batch_size=batch_size,
        lr=lr,
        generator=generator,
    )
    return policy


def train_rl(
    task: PlantedTask,
    base: MadePolicy,
    cfg: RLConfig,
    seed: int,
    values: ValueFn | None = None,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Policy-gradient RL from a copy of ``base``; ``values`` defaults to the exact values of mu_{cfg.gamma}.

    Deterministic for a given seed (its own generator; set ``torch.set_num_threads(1)`` for bitwise repeats).
    """
    import_verl()
    values = values if values is not None else exact_values(task, cfg.gamma)
    policy = copy.deepcopy(base)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    generator = torch.Generator().manual_seed(10_000 + seed)
    # The first batch goes through verl's DictConfig with the input checks on; later ones through the same config
    # pre-parsed, checks off (the check reads the step tensors on the host every call).
    checked, unchecked = algorithm_config(cfg, True), parsed_algorithm_config(algorithm_config(cfg, False))
    actor_cfg = actor_config(cfg)
    accuracy = np.zeros(cfg.iterations)
    mean_abs_process = np.zeros(cfg.iterations)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for it in range(cfg.iterations):
        if it in cfg.snapshots:
            snapshots[it] = copy.deepcopy(policy.state_dict())
        tokens = policy.sample(cfg.batch_size, generator, task.eos)
        data, inputs = build_batch(task, tokens, values)
        rewards = data.batch["token_level_rewards"].sum(dim=1)
        accuracy[it] = float(rewards.mean())
        progress_terms = torch.diff(torch.cat([inputs.prompt_values[:, None], inputs.step_values], dim=1), dim=1)
        mask = data.batch["response_mask"].float()
        mean_abs_process[it] = float((progress_terms.abs() * mask).sum() / mask.sum())
        config = checked if (it == 0 and cfg.check_first) else unchecked
        rl_step(policy, optimizer, data, inputs, config, actor_cfg)
        if progress is not None:
            progress(1)
    if cfg.iterations in cfg.snapshots:
        snapshots[cfg.iterations] = copy.deepcopy(policy.state_dict())
    return RunResult(
        accuracy=accuracy,
        snapshots=snapshots,
        final_state=copy.deepcopy(policy.state_dict()),
        mean_abs_process=mean_abs_process,
    )


def iterations_to(accuracy: np.ndarray, threshold: float = 0.9, window: int = 10) -> int | None:
    """First iteration count n at which the mean batch accuracy of iterations n-window..n-1 is >= threshold.

    A trailing mean over ``window`` batches (640 samples at batch 64) so that one lucky batch does not count.
    Returns None when it never does.
    """
    if accuracy.shape[0] < window:
        return None
    trailing = np.convolve(accuracy, np.ones(window) / window, mode="valid")  # trailing[j] = mean(acc[j:j+w])
    hits = np.nonzero(trailing >= threshold - 1e-12)[0]
    return int(hits[0] + window) if hits.size else None


def pass_at_n(num_samples: int, num_correct: int, ns: list[int]) -> np.ndarray:
    """Unbiased Pass@N from ``num_correct`` successes among ``num_samples`` (Chen et al. 2021):
    ``1 - C(n - c, N) / C(n, N)``, computed as a running product for stability."""
    out = []
    for n_draw in ns:
        if n_draw > num_samples:
            raise ValueError(f"Pass@{n_draw} needs at least {n_draw} samples, got {num_samples}")
        if num_samples - num_correct < n_draw:
            out.append(1.0)
            continue
        fail = np.prod(1.0 - n_draw / np.arange(num_samples - num_correct + 1, num_samples + 1))
        out.append(1.0 - float(fail))
    return np.array(out)
