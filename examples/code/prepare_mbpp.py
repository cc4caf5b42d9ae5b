"""MBPP as verl parquet rows for code RL with verl-prm (Hugging Face hub when online, or jsonl files).

    python examples/code/prepare_mbpp.py --local_save_dir ~/data/mbpp [--config full|sanitized]
    python examples/code/prepare_mbpp.py --local_save_dir ~/data/mbpp --train_jsonl a.jsonl --test_jsonl b.jsonl

Rows: see verl_prm.code.data (ground truth = the task as JSON: MBPP's asserts and setup code).
"""

import sys

from verl_prm.code.data import main_mbpp

if __name__ == "__main__":
    sys.exit(main_mbpp())
