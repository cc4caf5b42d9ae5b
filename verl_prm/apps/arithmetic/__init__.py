"""The arithmetic recipe: multi-step modular arithmetic, a tiny Qwen2 trained from scratch, SFT -> Monte-Carlo
labels -> PAV -> GRPO vs PAV-GRPO -> evaluation (``python -m verl_prm.apps.arithmetic --help``).

Modules: ``task`` (generator, verifier, verl rows; ``score``: the verl score function's file), ``model``
(tokenizer, model, SFT), ``rollout`` (sampling in verl's layout), ``batch`` (rollout batches as the trainer hook
sees them), ``measure`` (the SFT policy's success and per-step accuracy), ``prover`` (the exact prover),
``critic_init`` (the backbone taught to check), ``verl_rl`` (the RL settings, arms and ``main_ppo`` runs),
``evaluate`` (table and plots), ``pipeline`` (the resumable stages). The studies that measured the recipe's
docs numbers (difficulty sweep, critic variants, value size, curves) are ``studies/arithmetic_*.py`` in a checkout.
"""
