"""The embedded demo: the PAV paper's planted sub-sequence experiment (its Sec. 3.3 and App. B), on CPU.

- ``env``: the task, the prover mu_gamma, exact V^mu / Q^mu by dynamic programming, Monte-Carlo estimates;
- ``policy``: the MADE-like autoregressive MLP policy and its supervised warm start;
- ``policy_gradient``: the demo's policy-gradient loop through the product's path (``DataProto`` and
  ``StepInputs`` -> verl's ``compute_advantage_for_multi_trajectories`` inside ``estimator_step_inputs``, as in
  the trainer hook -> verl's policy loss);
- ``critic``: a learned prover critic from Monte-Carlo labels (``verl-prm demo --learned-critic``);
- ``demo``: the ``verl-prm demo`` command (its experiments), with ``settings`` (``DemoSettings``), ``runs`` (one RL
  run, the process pool), ``report`` (analysis, printed tables) and ``plots`` (the PNGs);
- ``search``: ``verl-prm demo search``, the library's search methods on the planted task with exact critics.
"""
