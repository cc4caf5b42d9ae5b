"""The names the plugin registers in verl, defined once (the config group, the plugin and the registrations read
them)."""

from __future__ import annotations

__all__ = ["HOOK_TRAINER_NAME", "REWARD_MANAGER_NAME", "TREE_AGENT_LOOP_NAME"]

# verl's ``trainer.v1.trainer_mode`` that selects the hook (verl_prm.integrations.verl.hook_trainer.PavSyncTrainer).
HOOK_TRAINER_NAME = "pav_sync"
# verl's ``reward.reward_manager.name`` of the step-aware reward manager (verl_prm.integrations.verl.reward_manager).
REWARD_MANAGER_NAME = "pav"
# The verl agent loop that samples a training group as a tree (verl_prm.integrations.verl.tree_rollout).
TREE_AGENT_LOOP_NAME = "pav_tree"
