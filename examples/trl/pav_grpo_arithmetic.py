"""PAV-GRPO in TRL on the arithmetic task: the recipe's tiny policy and prover critic, TRL's GRPOTrainer, CPU.

    # a policy and a PAV critic from the arithmetic recipe (about 8 minutes on 2 CPU cores):
    python -m verl_prm.apps.arithmetic --scale cpu --work-dir runs/arithmetic_cpu --stages data,sft,label,pav
    # PAV-GRPO in TRL (alpha 3, Best-of-4 prover, one step per operation):
    python examples/trl/pav_grpo_arithmetic.py --policy runs/arithmetic_cpu/policy \\
        --critic runs/arithmetic_cpu/pav/checkpoint-0000500 --output-dir runs/trl_pav_grpo
    # the same run with alpha = 0: TRL's own GRPO advantages, for comparison
    python examples/trl/pav_grpo_arithmetic.py ... --alpha 0 --output-dir runs/trl_grpo
    # no recipe run at hand: a random tiny policy and critic, to see the wiring work
    python examples/trl/pav_grpo_arithmetic.py --random-init --max-steps 3 --output-dir runs/trl_smoke

Prints TRL's logs (``rewards/correct/mean`` is the share of correct sampled answers, ``pav/*`` the critic's
metrics) and writes them to ``OUTPUT_DIR/log_history.json``, with held-out accuracy before and after training.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """The outcome reward: 1 when the completion's final ``answer N`` line is the problem's answer."""
    from verl_prm.apps.arithmetic.task import extract_answer

    return [1.0 if extract_answer(c) == a else 0.0 for c, a in zip(completions, answer)]


def random_models(directory: Path):
    """A random tiny policy and a random value-head critic with the recipe's tokenizer (no training)."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    from verl_prm.apps.arithmetic.model import ModelConfig, build_model, build_tokenizer

    tokenizer = build_tokenizer()
    policy = build_model(tokenizer, ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=2, num_key_value_heads=2))
    policy.save_pretrained(directory / "policy")
    tokenizer.save_pretrained(directory / "policy")
    critic = Qwen2ForTokenClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256))
    critic.save_pretrained(directory / "critic")
    tokenizer.save_pretrained(directory / "critic")
    return directory / "policy", directory / "critic"


def accuracy(model, tokenizer, prompts: list[str], answers: list[int], max_new_tokens: int, samples: int) -> float:
    """Share of correct answers of ``samples`` sampled completions (temperature 1) per held-out prompt."""
    from verl_prm.apps.arithmetic.task import extract_answer

    model.eval()
    hits = total = 0
    with torch.no_grad():
        for start in range(0, len(prompts), 32):
            batch = prompts[start:start + 32]
            encoded = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**encoded, do_sample=True, temperature=1.0, max_new_tokens=max_new_tokens,
                                 num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
            for k, text in enumerate(texts):
                hits += extract_answer(text) == answers[start + k // samples]
                total += 1
    model.train()
    return hits / total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="the recipe's policy directory (WORK_DIR/policy)")
    parser.add_argument("--critic", help="the recipe's PAV checkpoint (WORK_DIR/pav/checkpoint-*)")
    parser.add_argument("--random-init", action="store_true", help="random tiny policy and critic instead")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--alpha", type=float, default=3.0, help="PAV weight (0: TRL's own GRPO advantages)")
    parser.add_argument("--best-of-k", type=int, default=4, help="Best-of-K prover of the critic's values")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.random_init and not (args.policy and args.critic):
        parser.error("give --policy and --critic (the arithmetic recipe's outputs), or --random-init")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from verl_prm.critic import ProverCritic
    from verl_prm.integrations.trl import PavGRPOTrainer
    from verl_prm.apps.arithmetic.model import render
    from verl_prm.apps.arithmetic.pipeline import SCALES
    from verl_prm.apps.arithmetic.task import generate_problems

    torch.manual_seed(args.seed)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.random_init:
        policy_path, critic_path = random_models(Path(tempfile.mkdtemp(prefix="trl_pav_")))
    else:
        policy_path, critic_path = Path(args.policy), Path(args.critic)
    scale = SCALES["cpu"]  # the task the recipe's CPU policy was trained on
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    problems = generate_problems(args.max_steps * args.prompts_per_step + args.eval_prompts, scale.task,
                                 seed=10_000 + args.seed)
    train, held_out = problems[args.eval_prompts:], problems[:args.eval_prompts]
    dataset = Dataset.from_dict({"prompt": [render(tokenizer, p.prompt_text) for p in train],
                                 "answer": [p.answer for p in train]})
    eval_prompts = [render(tokenizer, p.prompt_text) for p in held_out]
    eval_answers = [p.answer for p in held_out]

    model = AutoModelForCausalLM.from_pretrained(policy_path)
    before = accuracy(model, tokenizer, eval_prompts, eval_answers, scale.max_new_tokens, samples=2)

    # --- what a TRL user adds: a prover critic, the step rule and the PAV knobs ------------------------------
    critic = ProverCritic.from_pretrained(str(critic_path), tokenizer=tokenizer, device="cpu")
    trainer = PavGRPOTrainer(
        model=model, reward_funcs=[correct], train_dataset=dataset, processing_class=tokenizer,
        args=GRPOConfig(output_dir=str(output_dir), use_cpu=True, bf16=False, max_steps=args.max_steps,
                        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
                        num_generations=args.num_generations, max_completion_length=scale.max_new_tokens,
                        learning_rate=args.learning_rate, logging_steps=1, save_strategy="no", report_to="none",
                        seed=args.seed),
        critic=critic,
        steps={"delimiter": "\n"},  # one step per line: one operation per step
        pav={"alpha": args.alpha, "best_of_k": args.best_of_k, "drop_truncated": True},
    )
    # ----------------------------------------------------------------------------------------------------------
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = accuracy(trainer.model, tokenizer, eval_prompts, eval_answers, scale.max_new_tokens, samples=2)
    summary = {"alpha": args.alpha, "best_of_k": args.best_of_k, "steps": args.max_steps,
               "completions_per_step": args.prompts_per_step * args.num_generations,
               "train_seconds": round(seconds, 1), "held_out_accuracy_before": before,
               "held_out_accuracy_after": after, "eval_completions": 2 * len(eval_prompts)}
    (output_dir / "log_history.json").write_text(json.dumps({"summary": summary,
                                                             "log_history": trainer.state.log_history}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
