"""The embedded demo: the PAV paper's planted sub-sequence experiment (its Sec. 3.3 and App. B), on CPU.

- ``env``: the task, the prover mu_gamma, exact V^mu / Q^mu by dynamic programming, Monte-Carlo estimates;
- ``policy``: the MADE-like autoregressive MLP policy and its supervised warm start;
- ``rl``: policy-gradient RL through the product's path (``DataProto`` -> ``compute_advantage_with_steps`` ->
  verl's policy loss);
- ``critic``: a learned prover critic from Monte-Carlo labels (``verl-prm demo --learned-critic``);
- ``demo``: the ``verl-prm demo`` command (its settings and experiments), with ``runs`` (one RL run, the process
  pool), ``report`` (analysis, printed tables) and ``plots`` (the PNGs).
"""
