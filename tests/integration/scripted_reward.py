"""The scripted task's outcome (verl_prm.labeling.scripted) as a file verl's ``reward.custom_reward_function.path``
can load (tests/integration/test_rollout_critic.py)."""

from verl_prm.labeling.scripted import scripted_step_score

__all__ = ["scripted_step_score"]
