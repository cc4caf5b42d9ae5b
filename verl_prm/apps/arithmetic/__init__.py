"""The arithmetic recipe: multi-step modular arithmetic, a tiny Qwen2 trained from scratch, SFT -> Monte-Carlo
labels -> PAV -> GRPO vs PAV-GRPO -> evaluation (``python -m verl_prm.apps.arithmetic --help``).

Modules: ``task`` (generator, verifier, verl score function and rows), ``model`` (tokenizer, model, SFT),
``rollout`` (sampling in verl's layout), ``rl`` (the CPU RL loop), ``evaluate`` (table and plots),
``pipeline`` (the resumable stages).
"""
