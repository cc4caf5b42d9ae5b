"""The verl glue: the one place that knows verl's internals.

- ``plugin``: the ``verl.plugins`` entry point (``import verl`` loads it in every process); ``import_hooks``: the
  registration-on-import machinery it uses;
- ``advantage``: a ``DataProto`` -> the registered estimator (``verl_prm.estimators``), with the step tensors;
- ``hook_trainer``: the trainer hook ``pav_sync`` (verl's ``PPOTrainerSync`` plus the critic's step values);
- ``reward_manager``: the reward manager ``pav``; ``critic_worker``: the critic's Ray worker group;
- ``run_config``, ``startup``: the startup validation of a run config, as a Hydra callback;
- ``platform``: verl's CPU platform and the ``hf`` rollout; ``trl_fix``: verl with TRL >= 1.x installed;
- ``patches``: ``verl-prm patches check|apply`` (the upstreamable diffs in ``patches/``).

Nothing here is imported by ``import verl_prm``; each module imports verl itself.
"""
