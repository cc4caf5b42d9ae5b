"""Tree-shaped groups in verl's loop (``verl_prm.critic.source=tree``): verl's agent loop ``pav_tree``.

What a tree is, how its branch points are chosen and what its node values are is the library's
(``verl_prm.trees``); this module only translates:

- the trainer hook names the agent loop ``pav_tree`` in every training batch it submits (``agent_name``;
  validation batches keep the rollout's default agent loop, so held-out accuracy is measured on independent
  samples);
- verl's agent-loop worker runs the ``actor_rollout_ref.rollout.n`` sessions of a prompt concurrently in one
  process (``AgentLoopWorker._run_prompt``); the first session of a prompt (its ``uid``) starts
  ``verl_prm.trees.sample_tree`` through the worker's LLM server client, the others wait for the same tree, and
  session i returns leaf i as its ``AgentLoopOutput``. Every leaf is then a complete response of verl's batch:
  verl scores it with the run's reward, and it enters the policy update with its own per-token advantages;
- a branch is generated from the token ids prompt + the parent's response tokens up to a step boundary (no
  re-tokenisation), with the rollout's sampling settings and ``max_tokens`` = ``response_length`` minus the prefix;
  every request of a tree carries one sticky request id, so verl's load balancer sends it to one replica, whose
  prefix cache (vLLM, SGLang) holds the shared prefix (under ``rollout.full_determinism`` the ids are distinct,
  as verl passes them to the engine);
- step boundaries are the hook's own split (``verl_prm.steps``) of the response tokens, so the tree branches
  exactly where the advantage phase later finds the steps;
- each leaf's ``extra_fields`` record its parent leaf (-1 for a root), the response tokens it shares with it and
  the tokens generated for it; the first leaf of a tree also records the prompt tokens the rollout engine did not
  prefill again for the tree's requests, where the engine reports it (``prefill_tokens_saved``: the ``hf``
  rollout's prefix reuse) (``pav_tree_*``: the hook's cost metrics).

The startup checks of a run with tree-shaped groups are ``run_config.check_tree_run`` (each error names the key).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from verl_prm.config.hook import TREE_AGENT_LOOP_NAME, read_hook_config
from verl_prm.trees import Leaf, sample_tree

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

__all__ = ["TREE_AGENT_LOOP_NAME", "TREE_EXTRA_FIELDS", "PavTreeAgentLoop"]

# the leaf's extra_fields the hook reads back (parent leaf or -1, shared tokens, generated tokens)
TREE_EXTRA_FIELDS = ("pav_tree_parent", "pav_tree_fork_tokens", "pav_tree_generated_tokens",
                     "pav_tree_prefill_tokens_saved")


@dataclass
class _SharedTree:
    """One prompt's tree, shared by its sessions: the sampling task and how many sessions have yet to take a leaf."""

    task: asyncio.Future
    waiting: int


# uid -> the tree its sessions share (one agent-loop worker process runs every session of a prompt)
_TREES: dict[str, _SharedTree] = {}


class PavTreeAgentLoop(AgentLoopBase):
    """verl's agent loop ``pav_tree``: session i of a prompt returns leaf i of the prompt's tree (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook = read_hook_config(self.config.get("verl_prm"))
        self.shape = self.hook.tree.shape()
        self.n = int(self.rollout_config.n)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        uid, session = str(kwargs["uid"]), int(kwargs["session_id"])
        if not 0 <= session < self.n:
            raise RuntimeError(
                f"prompt {uid}: session {session} of a tree of actor_rollout_ref.rollout.n={self.n} leaves (a "
                "per-sample __rollout_n__ in the data cannot change a tree's size): remove __rollout_n__"
            )
        shared = _TREES.get(uid)
        if shared is None:
            task = asyncio.ensure_future(self._sample(uid, list(kwargs["raw_prompt"]), sampling_params))
            shared = _TREES[uid] = _SharedTree(task, self.n)
        try:
            prompt_ids, leaves, global_steps, seconds, saved = await asyncio.shield(shared.task)
        finally:
            shared.waiting -= 1
            if shared.waiting == 0:
                _TREES.pop(uid, None)
        return await self._output(prompt_ids, leaves[session], global_steps, seconds, saved if session == 0 else 0)

    async def _sample(self, uid: str, messages: list, sampling_params: dict[str, Any]):
        """The prompt's token ids, its n leaves, the (min, max) weight versions that generated them, the seconds
        it took and the prompt tokens the rollout engine reused instead of prefilling."""
        multi_modal = await self.process_multi_modal_info(messages)
        if any(multi_modal.get(key) for key in ("images", "videos", "audios")):
            raise NotImplementedError(f"prompt {uid}: tree-shaped groups (verl_prm.critic.source=tree) take text "
                                      "prompts only; use another verl_prm.critic.source for multimodal data")
        prompt_ids = await self.ct_build_initial_tokens(messages)
        start = self.loop.time()
        params = dict(sampling_params)
        if self.shape.branch_rule == "confidence":
            params["logprobs"] = True  # the rule reads the rollout's log-probs of the token after a boundary
        deterministic = bool(getattr(self.rollout_config, "full_determinism", False))
        calls, versions, saved = [0], [], [0]

        async def generate(ids: list[int], max_tokens: int):
            calls[0] += 1
            request_id = f"pav-tree-{uid}-{calls[0]}" if deterministic else f"pav-tree-{uid}"
            output = await self.server_manager.generate(request_id=request_id, prompt_ids=list(ids),
                                                        sampling_params={**params, "max_tokens": int(max_tokens)})
            if output.routed_experts is not None:
                raise NotImplementedError("tree-shaped groups do not carry routed experts (router replay): turn "
                                          "router replay off or use another verl_prm.critic.source")
            versions.append(output.extra_fields.get("global_steps"))
            saved[0] += int(output.extra_fields.get("prefill_tokens_saved", 0))
            return list(output.token_ids), (list(output.log_probs) if output.log_probs else None)

        leaves = await sample_tree(generate, prompt_ids, self.n, self.shape, self._step_ends, self.response_length)
        known = [v for v in versions if v is not None]
        return (prompt_ids, leaves, (min(known), max(known)) if known else (None, None), self.loop.time() - start,
                saved[0])

    def _step_ends(self, response_ids: list[int]) -> list[int]:
        """Exclusive ends of the response's steps under the hook's step rule (``verl_prm.steps``)."""
        ids = torch.tensor([list(response_ids)], dtype=torch.long)
        split = self.hook.steps.split(ids, torch.ones_like(ids), self.tokenizer)
        return [int(end) + 1 for end in split.step_ends[0, : int(split.num_steps[0])].tolist()]

    async def _output(self, prompt_ids: list[int], leaf: Leaf, global_steps, seconds: float,
                      prefill_saved: int) -> AgentLoopOutput:
        """The leaf as ``SingleTurnAgentLoop`` returns a response (the assistant tokens merged as there); its
        ``generate_sequences`` time is the whole tree's."""
        keep_log_probs = bool(self.rollout_config.calculate_log_probs) and leaf.log_probs is not None
        log_probs = leaf.log_probs if keep_log_probs else None
        merged, response_mask, response_logprobs = await self.ct_merge_assistant_token(
            prompt_ids, leaf.response_ids, [], [] if log_probs else None, assistant_logprobs=log_probs)
        response_ids = merged.token_ids[-len(response_mask):] if response_mask else []
        prompt_ids = merged.token_ids[: len(merged.token_ids) - len(response_mask)]
        minimum, maximum = global_steps
        extra = {"turn_scores": [], "tool_rewards": [], "min_global_steps": minimum, "max_global_steps": maximum,
                 "pav_tree_parent": -1 if leaf.parent is None else int(leaf.parent),
                 "pav_tree_fork_tokens": int(leaf.fork_tokens),
                 "pav_tree_generated_tokens": len(leaf.response_ids) - int(leaf.fork_tokens),
                 "pav_tree_prefill_tokens_saved": int(prefill_saved)}
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length] if response_logprobs else None,
            multi_modal_data={},
            mm_processor_kwargs=self._get_mm_processor_kwargs(None),
            mm_processor_output=None,
            num_turns=2,
            metrics={"generate_sequences": float(seconds), "num_preempted": -1},
            extra_fields=extra,
        )
