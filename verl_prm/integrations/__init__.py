"""Glue for RL frameworks.

- ``verl_prm.integrations.verl``: the verl glue (plugin, estimator registration, trainer hook, reward manager,
  critic worker, startup check, CPU platform);
- ``verl_prm.integrations.trl``: PAV-GRPO for TRL's ``GRPOTrainer`` (``pip install 'verl-prm[trl]'``); it imports
  no verl.

Each module imports its framework when it is imported itself, never from here, so ``import verl_prm`` needs
none of them.
"""
