"""verl's ``main_ppo`` with the word-problem recipe's policy (SmolLM2-135M-Instruct after the recipe's SFT) on the
CPU loop: GRPO against ``pav_tree`` and the learned PAV (``verl-prm recipe word-problems`` makes the policy and the
data; docs/real_model.md has the commands and the runs).

    python -m studies.word_problems_rl --work-dir runs/wp --out runs/wp_rl40 --arm grpo --seed 0
    python -m studies.word_problems_rl --work-dir runs/wp --out runs/wp_rl40 --critic CHECKPOINT \\
        --arm grpo pav_tree pav_learned --seed 0 1 2          # 9 runs, one after another

Each run: ``--prompts-per-step`` problems a step (8) from the recipe's label pool after its first ``--skip``
(default: the problems the work dir's label stage labels, the learned PAV's training problems), each with
``--responses-per-prompt`` responses (4) of at most 96 tokens, one step per line (``verl_prm.steps.delimiter='\\n'``),
the recipe's outcome reward, ``--steps`` steps (40); held-out accuracy on the first ``--val-problems`` test problems
(128; temperature 1, one sample) before training and every ``--test-freq`` steps (10), each problem's result in
``RUN_DIR/validation/<step>.jsonl`` (verl's ``trainer.validation_data_dir``). Fewer RL problems than steps x
problems a step is fine: verl's dataloader starts a new epoch, a new permutation of them (``data.seed``), when one
ends (``trainer.total_epochs``: the epochs needed and one more), and a resumed run continues the same
sequence.

Arms: ``grpo``, verl's own GRPO (no verl-prm config group, no hook); ``pav_tree``, each group sampled as a tree (2
roots, one branch point per root, 2 continuations; ``verl_prm.tree``) whose node values ``pav_grpo`` adds;
``pav_learned``, ``pav_grpo`` with the PAV that ``verl-prm train`` learnt (``--critic``: its checkpoint directory;
``--critic-calibration none`` uses its raw values, as the arithmetic recipe's ``pav_learned`` arm).

A run lives in ``OUT/<arm>_seed<seed>``: ``settings.json`` (a later start with other settings is refused),
``metrics.jsonl`` (verl's file logger; an earlier start's records kept as ``metrics-<n>.jsonl``), ``main_ppo.log``,
``starts.jsonl`` (per start: seconds, exit status, peak memory, the machine's load average: whether other work
shared the cores), checkpoints at every evaluation (``trainer.resume_mode=auto``: a stopped run resumes from the
last), and ``DONE.json`` when it trained every step (a finished run is not started again). ``settings.json`` names
the policy by its weights (``policy_sha256``) and the dtype the run computes in (``compute_dtype``). With
``--archive DIR`` a finished run's records, all but checkpoints and data, are copied to ``DIR/<arm>_seed<seed>``,
and a run finished there is skipped: a queue spread over sessions on fresh machines keeps its finished runs in the
repository and reports them all.
``python -m studies.word_problems_rl_report`` makes the tables, the plot and the ``runs.json`` export.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from verl_prm.apps.arithmetic.verl_rl import learned_critic_overrides, read_records, run_curves, start_run
from verl_prm.apps.cpu_loop import LoopSize, main_ppo_args
from verl_prm.apps.word_problems import score
from verl_prm.choices import PRECISIONS
from verl_prm.cli_types import finite_float

__all__ = ["ARMS", "VALIDATION_KEY", "RunSettings", "archive_run", "archived", "check_prompt_lengths",
           "check_settings", "command", "compute_dtype", "default_skip", "main", "policy_digest", "rl_data", "run",
           "run_dir_of", "summary"]

ARMS = ("grpo", "pav_tree", "pav_learned")
# the arms that run the plugin's hook (steps: one a line)
HOOK_ARMS = ("pav_tree", "pav_learned")
# verl pads every prompt to max_prompt_length and every response to max_response_length, and the actor's passes
# compute on the padding: the budget is the recipe's longest prompt (94 tokens in SmolLM2's chat) rounded up
MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH = 96, 96
VALIDATION_KEY = "val-core/word_problems/acc/mean@1"
CALIBRATIONS = ("none", "auto")
LOAD_SAMPLE_SECONDS = 10.0


@dataclass(frozen=True)
class RunSettings:
    """One run's settings (recorded in ``settings.json``; the seeds of an arm differ in ``seed`` alone).
    ``micro_batch``: sequences per forward/backward pass of the actor and of the old log-probs (the update is
    one mini-batch of every response of the step either way; 16 kept a run's memory at the 20-step pilot's)."""

    arm: str
    seed: int = 0
    steps: int = 40
    prompts_per_step: int = 8
    responses_per_prompt: int = 4
    micro_batch: int = 16
    lr: float = 2e-6
    test_freq: int = 10
    val_problems: int = 128
    skip: int = 0
    critic: str | None = None
    calibration: str = "none"
    precision: str = "auto"
    log_probs: bool = False
    threads: int = 1

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        for name, low in (("seed", 0), ("steps", 1), ("prompts_per_step", 1), ("responses_per_prompt", 1),
                          ("micro_batch", 1), ("val_problems", 1), ("skip", 0), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.test_freq, bool) or not isinstance(self.test_freq, int) or not (
                self.test_freq == -1 or self.test_freq >= 1):
            raise ValueError("test_freq must be -1 (no held-out evaluation) or an integer >= 1, "
                             f"got {self.test_freq!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        batch = self.prompts_per_step * self.responses_per_prompt
        if batch % self.micro_batch:
            raise ValueError(f"micro_batch ({self.micro_batch}) must divide the step's {batch} responses "
                             f"({self.prompts_per_step} problems x {self.responses_per_prompt})")
        if (self.arm == "pav_learned") != (self.critic is not None):
            raise ValueError("the pav_learned arm needs --critic (a verl-prm train checkpoint directory)"
                             if self.arm == "pav_learned" else f"arm {self.arm} reads no --critic")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {', '.join(CALIBRATIONS)}, got {self.calibration!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


def _critic_path(settings: RunSettings) -> str | None:
    """The critic as the settings record names it: its absolute path."""
    return None if settings.critic is None else str(Path(settings.critic).resolve())


def run_dir_of(out: str | Path, settings: RunSettings) -> Path:
    return Path(out).resolve() / f"{settings.arm}_seed{settings.seed}"


def default_skip(work_dir: str | Path) -> int:
    """The label-pool problems a learned PAV of ``work_dir`` is trained on: the ``limit`` of the recipe's label
    stage (``labels/labels_config.json``, written when the stage starts), which labels the first ``limit``
    problems of ``data/label.parquet``. Without that stage the caller must say (``--skip``)."""
    work_dir = Path(work_dir).resolve()
    config = work_dir / "labels" / "labels_config.json"
    if not config.exists():
        raise ValueError(f"{config} does not exist (no label stage in {work_dir}): pass --skip, the number of "
                         "label-pool problems any learned PAV of the comparison was trained on (0 for none)")
    record = json.loads(config.read_text())
    if Path(record.get("input", "")).resolve() != work_dir / "data" / "label.parquet" or not isinstance(
            record.get("limit"), int):
        raise ValueError(f"{config} labels {record.get('input')!r} (limit {record.get('limit')!r}), not the first "
                         f"problems of {work_dir / 'data' / 'label.parquet'}: pass --skip")
    return record["limit"]


def check_prompt_lengths(work_dir: Path, frames: Sequence[tuple[str, pd.DataFrame]]) -> int:
    """The longest prompt of the run's data in the policy's chat (``apply_chat_template`` with the generation
    prompt, as verl's dataset counts it); one over ``MAX_PROMPT_LENGTH`` is an error naming its file and row, before
    Ray starts (verl would stop on it at its dataset with ``data.truncation=error``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work_dir / "policy", trust_remote_code=False)
    longest = 0
    for name, frame in frames:
        for row, messages in zip(frame.index, frame["prompt"]):  # the file's own row numbers
            length = len(tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"])
            if length > MAX_PROMPT_LENGTH:
                raise ValueError(f"{work_dir / 'data' / name}, row {row}: the prompt is {length} tokens in the "
                                 f"policy's chat, over the study's {MAX_PROMPT_LENGTH} (MAX_PROMPT_LENGTH): the "
                                 "recipe's problems are longer than the study was sized for")
            longest = max(longest, length)
    return longest


def policy_digest(work_dir: Path) -> str:
    """The recipe's policy (``work_dir/policy``) by its weights (``checkpoints.weights_digest``): a run resumed on
    other weights is refused, and runs archived by earlier sessions (another machine's SFT) say which policy they
    started from."""
    from verl_prm.checkpoints import CheckpointError, weights_digest

    try:
        return weights_digest(work_dir / "policy")
    except CheckpointError as error:
        raise ValueError(f"{error}: run the recipe's sft stage first (verl-prm recipe word-problems --work-dir "
                         f"{work_dir} --stages data,sft)") from None


def compute_dtype(precision: str) -> str:
    """What ``precision`` computes in on this machine (``verl_prm.precision.resolve_dtype``: ``auto`` is bfloat16
    only where the CPU has native bf16 instructions): recorded, so a resume on a machine that resolves it otherwise
    is refused and the report shows each run's."""
    from verl_prm.precision import resolve_dtype

    return str(resolve_dtype(precision)).removeprefix("torch.")


def rl_data(work_dir: Path, settings: RunSettings) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The RL problems (the label pool after its first ``skip``) and the held-out problems (the first
    ``val_problems`` test problems) of the recipe's work dir; too few of either is an error naming the file."""
    pool = pd.read_parquet(work_dir / "data" / "label.parquet")
    test = pd.read_parquet(work_dir / "data" / "test.parquet")
    problems = len(pool) - settings.skip
    if problems < settings.prompts_per_step:
        raise ValueError(f"--skip {settings.skip} leaves {max(problems, 0)} of the {len(pool)} label-pool problems "
                         f"({work_dir / 'data' / 'label.parquet'}), fewer than a step's {settings.prompts_per_step}")
    if len(test) < settings.val_problems:
        raise ValueError(f"--val-problems {settings.val_problems}: {work_dir / 'data' / 'test.parquet'} has "
                         f"{len(test)} problems (the recipe's --test-problems)")
    return pool.iloc[settings.skip:], test.iloc[:settings.val_problems]


def _arm_overrides(settings: RunSettings) -> list[str]:
    if settings.arm == "grpo":  # verl's own GRPO: no verl-prm config group and no trainer hook
        return ["algorithm.adv_estimator=grpo"]
    if settings.arm == "pav_tree":
        critic = ["verl_prm.critic.path=null", "verl_prm.critic.source=tree"]
    else:
        critic = learned_critic_overrides(settings.critic, settings.calibration)
    return ["algorithm.adv_estimator=pav_grpo", *critic, "verl_prm.steps.delimiter='\\n'",
            "verl_prm.steps.max_tokens=null"]


def command(work_dir: str | Path, out: str | Path, settings: RunSettings) -> tuple[list[str], Path, dict]:
    """The run's ``python -m verl.trainer.main_ppo`` command, its directory and its settings record (the settings
    with the absolute paths it reads and the number of RL problems). Checks the record against the directory's
    (:func:`check_settings`), then writes the run's data to ``RUN_DIR/data``. Paths are absolute: the run starts in
    its own directory."""
    work_dir = Path(work_dir).resolve()
    run_dir = run_dir_of(out, settings)
    if settings.critic is not None and not (Path(settings.critic) / "config.json").is_file():
        raise ValueError(f"--critic {settings.critic}: no config.json there; pass a checkpoint directory of "
                         "verl-prm train (the newest checkpoint-* of its output)")
    train_problems, val_problems = rl_data(work_dir, settings)
    longest_prompt = check_prompt_lengths(work_dir, [("label.parquet", train_problems), ("test.parquet", val_problems)])
    problems = len(train_problems)
    size = LoopSize(prompts_per_step=settings.prompts_per_step, responses_per_prompt=settings.responses_per_prompt,
                    max_prompt_length=MAX_PROMPT_LENGTH, max_response_length=MAX_RESPONSE_LENGTH,
                    val_problems=settings.val_problems)
    # drop_last: an epoch is problems // prompts_per_step steps; verl stops at total_training_steps. One epoch
    # more than the steps need: a run resumed from a checkpoint at an epoch's end first iterates that epoch's
    # exhausted dataloader (no batch), which uses up one of fit's epochs
    epochs = math.ceil(settings.steps / (problems // settings.prompts_per_step)) + 1
    record = {**asdict(settings), "critic": _critic_path(settings),
              "policy": str(work_dir / "policy"), "policy_sha256": policy_digest(work_dir),
              "compute_dtype": compute_dtype(settings.precision),
              "label_pool": str(work_dir / "data" / "label.parquet"),
              "rl_problems": problems, "max_prompt_length": MAX_PROMPT_LENGTH, "longest_prompt": longest_prompt,
              "max_response_length": MAX_RESPONSE_LENGTH}
    check_settings(run_dir, record)  # before the data is written: another run's directory is left as it is
    train, val = run_dir / "data" / "train.parquet", run_dir / "data" / "val.parquet"
    train.parent.mkdir(parents=True, exist_ok=True)
    train_problems.to_parquet(train)
    val_problems.to_parquet(val)
    name = run_dir.name
    overrides = [
        *_arm_overrides(settings),
        f"reward.custom_reward_function.path={score.__file__}",
        f"data.train_files={train}", f"data.val_files={val}",
        f"data.seed={settings.seed}", f"actor_rollout_ref.rollout.seed={settings.seed}",
        f"actor_rollout_ref.model.path={work_dir / 'policy'}",
        f"actor_rollout_ref.actor.optim.lr={settings.lr}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={settings.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={settings.micro_batch}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "trainer.project_name=verl_prm_word_problems",
        # the rollout's log-probs beside the actor's: verl logs their gap (training/rollout_probs_diff_*)
        *(["actor_rollout_ref.rollout.calculate_log_probs=True"] if settings.log_probs else []),
        f"trainer.default_local_dir={run_dir / 'checkpoints'}", "trainer.max_actor_ckpt_to_keep=1",
        # each held-out problem's response and score at every evaluation: the report's bootstrap over problems
        f"trainer.validation_data_dir={run_dir / 'validation'}",
        f"trainer.total_epochs={epochs}",
    ]
    args = main_ppo_args(run_dir.parent, "grpo", steps=settings.steps, size=size, run_name=name,
                         test_freq=settings.test_freq, save_freq=settings.test_freq,
                         val_before_train=settings.test_freq > 0, resume=True, plugin=settings.arm != "grpo",
                         extra=overrides, precision=settings.precision)
    return [sys.executable, "-m", "verl.trainer.main_ppo", *args], run_dir, record


def summary(metrics: list[dict]) -> dict:
    """Per logged step: the step's seconds, its generation seconds, the mean reward and response length; the
    held-out accuracy where evaluated."""
    rows = {}
    for record in metrics:
        data = record["data"]
        row = rows.setdefault(record["step"], {})
        for name, key in (("step_s", "timing_s/step"), ("gen_s", "timing_s/gen"), ("reward", "critic/score/mean"),
                          ("response_length", "response_length/mean"), ("val", VALIDATION_KEY),
                          ("old_log_prob_s", "timing_s/old_log_prob"), ("update_actor_s", "timing_s/update_actor"),
                          ("update_weights_s", "timing_s/update_weights"), ("adv_s", "timing_s/adv"),
                          ("reward_s", "timing_s/reward"),
                          ("probs_diff_mean", "training/rollout_probs_diff_mean"),
                          ("probs_diff_max", "training/rollout_probs_diff_max")):
            if key in data:
                row[name] = data[key]
    return rows


def check_settings(run_dir: Path, record: dict) -> None:
    """A run directory holds one run: a start with other settings than the first is refused, naming them."""
    from verl_prm.resume import settings_differences

    path = run_dir / "settings.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    if path.exists():
        saved = json.loads(path.read_text())
        changed = settings_differences(saved, record)
        if changed:
            raise ValueError(f"{run_dir} holds a run with other settings ({'; '.join(changed[:6])}): give another "
                             "--out, or remove the directory to start it again")
    else:
        path.write_text(json.dumps(record, indent=1))


def _watch(started_run) -> tuple[int, list[float]]:
    """Wait for the run to exit, sampling the 1-minute load average every ``LOAD_SAMPLE_SECONDS``."""
    loads = [os.getloadavg()[0]]
    while True:
        if started_run.poll() is not None:  # poll also samples the run's memory
            return started_run.process.returncode, loads
        try:
            return started_run.process.wait(timeout=LOAD_SAMPLE_SECONDS), loads
        except subprocess.TimeoutExpired:
            loads.append(os.getloadavg()[0])


ARCHIVE_LEFT_OUT = ("checkpoints", "data")


def archived(archive: str | Path, settings: RunSettings) -> dict | None:
    """The settings of this arm and seed's finished run in ``archive`` (None if it has none). An archived run with
    other settings is an error naming them, besides those a machine decides: the policy's weights (another
    machine's SFT rounds differently) and the precision (``auto`` resolves by the CPU); the report shows each run's
    policy and compute dtype."""
    from verl_prm.resume import settings_differences

    done = Path(archive) / f"{settings.arm}_seed{settings.seed}"
    if not (done / "DONE.json").exists():
        return None
    saved = json.loads((done / "settings.json").read_text())
    mine = {**asdict(settings), "critic": _critic_path(settings)}
    changed = settings_differences({key: saved.get(key) for key in mine}, mine, ignore=("precision",))
    if changed:
        raise ValueError(f"{done} holds this arm and seed, finished with other settings ({'; '.join(changed[:6])}): "
                         "give another --archive, or remove that directory to run it again")
    return saved


def archive_run(run_dir: Path, archive: str | Path) -> Path:
    """Copy a finished run's records (all but its checkpoints and data) to ``archive/<run>``: what the report reads,
    small enough to commit, so that later sessions on fresh machines skip the run and report it. Written beside
    and renamed: an interrupted copy leaves no run behind."""
    import shutil

    target = Path(archive).resolve() / run_dir.name
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(run_dir, partial, ignore=shutil.ignore_patterns(*ARCHIVE_LEFT_OUT))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def run(work_dir: str | Path, out: str | Path, settings: RunSettings, log=print,
        archive: str | Path | None = None) -> int:
    """Start (or resume) one run and wait for it; a finished run (``DONE.json`` in its directory or in
    ``archive``) is not started again, and a run that finishes is copied to ``archive`` (:func:`archive_run`).
    Returns main_ppo's exit status (0 for a finished run)."""
    from verl_prm.apps.arithmetic.pipeline import environment

    if archive is not None and (saved := archived(archive, settings)) is not None:
        log(f"[word_problems_rl] {settings.arm}_seed{settings.seed}: finished before, archived in {archive} "
            f"(policy {str(saved.get('policy_sha256'))[:12]})")
        return 0
    cmd, run_dir, record = command(work_dir, out, settings)
    if (run_dir / "DONE.json").exists():
        log(f"[word_problems_rl] {run_dir.name}: finished before ({run_dir / 'DONE.json'})")
        return 0
    log(f"[word_problems_rl] {run_dir.name}: main_ppo -> {run_dir} (log: {run_dir / 'main_ppo.log'})")
    env, started_at, started = environment(), time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
    started_run = start_run(cmd, run_dir, threads=settings.threads)
    try:
        returncode, loads = _watch(started_run)
    finally:
        started_run.stop()
    seconds = time.perf_counter() - started
    start = {"started": started_at, "seconds": seconds, "returncode": returncode,
             "peak_rss_gib": started_run.peak_bytes / 2**30, "load_1min_mean": sum(loads) / len(loads),
             "load_1min_max": max(loads), "environment": env}
    with open(run_dir / "starts.jsonl", "a") as starts:
        starts.write(json.dumps(start) + "\n")
    records = read_records(run_dir)
    (run_dir / "summary.json").write_text(json.dumps({**start, "steps": summary(records)}, indent=1))
    outputs = run_curves(records, VALIDATION_KEY, settings.prompts_per_step * settings.responses_per_prompt)
    trained = [row["step"] for row in outputs["training"]]
    if returncode == 0 and trained and trained[-1] == settings.steps:
        all_starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
        done = {"settings": record, "outputs": outputs, "seconds": sum(s["seconds"] for s in all_starts),
                "environment": env}
        (run_dir / "DONE.json").write_text(json.dumps(done, indent=1))
    if archive is not None and (run_dir / "DONE.json").exists():
        log(f"[word_problems_rl] {run_dir.name}: archived in {archive_run(run_dir, archive)}")
    log(f"[word_problems_rl] {run_dir.name}: exit {returncode} after {seconds:.0f} s, "
        f"{len(trained)} of {settings.steps} steps trained")
    return returncode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m studies.word_problems_rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="the word-problem recipe's work dir")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm", choices=ARMS, nargs="+", required=True,
                        help="one or more arms; with several arms or seeds the runs go one after another")
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--responses-per-prompt", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="sequences per forward/backward pass of the actor (memory, not the result)")
    parser.add_argument("--lr", type=finite_float(0.0, low_open=True), default=2e-6)
    parser.add_argument("--test-freq", type=int, default=10, help="-1: no held-out evaluation")
    parser.add_argument("--val-problems", type=int, default=128)
    parser.add_argument("--skip", type=int, default=None,
                        help="label-pool problems the RL data leaves out (default: those the work dir's label "
                             "stage labels, the learned PAV's training problems)")
    parser.add_argument("--critic", type=Path, default=None,
                        help="the pav_learned arm's PAV: a verl-prm train checkpoint directory (value_head)")
    parser.add_argument("--critic-calibration", choices=CALIBRATIONS, default="none",
                        help="none: the PAV's raw values; auto: its calibration.json")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="the rollout's and the actor's compute precision (verl_prm.precision)")
    parser.add_argument("--log-probs", action="store_true",
                        help="the rollout returns log-probs: verl logs their gap to the actor's")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each of the run's processes")
    parser.add_argument("--archive", type=Path, default=None,
                        help="finished runs' records (no checkpoints) are copied here, and a run finished here "
                             "is not started again (e.g. a directory of the repository: runs outlive the machine)")
    return parser


def _terminated(signum, frame):  # `kill PID` stops the run (and its Ray processes) as Ctrl-C does
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        skip = default_skip(args.work_dir) if args.skip is None else args.skip
        queue = [RunSettings(arm=arm, seed=seed, steps=args.steps, prompts_per_step=args.prompts_per_step,
                             responses_per_prompt=args.responses_per_prompt, micro_batch=args.micro_batch,
                             lr=args.lr, test_freq=args.test_freq, val_problems=args.val_problems, skip=skip,
                             critic=str(args.critic) if arm == "pav_learned" and args.critic else None,
                             calibration=args.critic_calibration, precision=args.precision,
                             log_probs=args.log_probs, threads=args.threads)
                 for seed in dict.fromkeys(args.seed) for arm in dict.fromkeys(args.arm)]
    except ValueError as error:
        parser.error(str(error))
    signal.signal(signal.SIGTERM, _terminated)
    failed = []
    for settings in queue:  # seed by seed, so that a stopped queue leaves every arm with as many seeds
        try:
            returncode = run(args.work_dir, args.out, settings, archive=args.archive)
        except ValueError as error:
            returncode = f"refused: {error}"
        except KeyboardInterrupt as stop:  # Ctrl-C or `kill PID`: the run and its Ray processes are stopped
            print(f"[word_problems_rl] stopped ({stop or 'Ctrl-C'}) during {settings.arm} seed {settings.seed}; the "
                  "same command resumes it from its last checkpoint", file=sys.stderr)
            return 130
        if returncode != 0:
            failed.append(f"{settings.arm} seed {settings.seed}: {returncode}")
    if failed:
        print("[word_problems_rl] not finished: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
