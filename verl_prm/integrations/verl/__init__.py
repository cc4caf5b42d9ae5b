"""The verl glue: the one place that knows verl's internals.

- ``plugin``: the ``verl.plugins`` entry point (``import verl`` loads it in every process); ``import_hooks``: the
  registration-on-import machinery it uses;
- ``advantage``: the step tensors -> the registered estimator (``verl_prm.estimators``), inside verl's own
  advantage phase;
- ``hook_trainer``: the trainer hook ``pav_sync`` (verl's ``PPOTrainerSync`` plus the step values), which only
  orchestrates its parts: ``step_batch`` (the batch it reads), ``value_sources`` (critic workers, the rollout
  sampler, the exact reference), ``head_refresh`` (``verl_prm.refresh``), ``batch_metrics`` (``pav/*``),
  ``critic_group`` (the critic's worker group);
- ``reward_manager``: the reward manager ``pav``; ``critic_worker``: the critic's Ray worker group;
- ``run_config``, ``startup``: the startup validation of a run config, as a Hydra callback;
- ``platform``: verl's CPU platform and the ``hf`` rollout; ``trl_fix``: verl with TRL >= 1.x installed;
- ``patches``: ``verl-prm patches check|apply`` (the upstreamable diffs in ``patches/``).

Nothing here is imported by ``import verl_prm``; each module imports verl itself.
"""
