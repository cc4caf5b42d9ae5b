"""Studies and developer benchmarks that produced numbers in the docs: run from a checkout, not installed.

The wheel holds the library and the commands users run (``verl-prm ...``); these scripts sit on top of both and
are run from the repository root, e.g. ``python -m studies.arithmetic_curves --help``:

    arithmetic_critic      the recipe's learned critic: fine-tuned policy vs a value head on a policy taught to check
    arithmetic_value_size  the recipe's learned values against the exact prover's (slope, MSE, head fits)
    arithmetic_search      the evaluate stage's search sweep, from the critics alone
    arithmetic_sweep       the difficulty sweep: the SFT policy's success per task setting
    arithmetic_curves      the RL runs' curves exported, merged across directories and summarised
    bench_labels           what validating label shards on read costs
    bench_validation       verl's validation metrics: its bootstrap loop vs the CPU platform's vectorised one
    bench_precision        fp32 vs bf16 forward and backward of the recipe's policy on CPU
    bench_sandbox          the code sandbox's cost per run (bubblewrap, basic, the sandbox before bubblewrap)
"""
