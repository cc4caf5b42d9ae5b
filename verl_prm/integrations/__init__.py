"""Glue for RL frameworks other than verl.

- ``verl_prm.integrations.trl``: PAV-GRPO for TRL's ``GRPOTrainer`` (``pip install 'verl-prm[trl]'``).

Each module imports its framework when it is imported itself, never from here, so ``import verl_prm`` needs
none of them. No integration imports verl.
"""
