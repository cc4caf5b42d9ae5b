"""The word-problem recipe: generated word problems of 2-4 steps, a pretrained chat model as the policy (by default
SmolLM2-135M-Instruct), Monte-Carlo labels, a PAV and test-time search (``verl-prm recipe word-problems``)."""
