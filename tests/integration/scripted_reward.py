"""The scripted task's outcome (verl_prm.labeling.closed_form_task) as a file verl's
``reward.custom_reward_function.path`` can load (tests/integration/test_rollout_sampler.py)."""

from verl_prm.labeling.closed_form_task import scripted_step_score

__all__ = ["scripted_step_score"]
