"""The critic worker's placement options on CPU: offload between scorings (``verl_prm.placement.offload``) and the
FSDP2-sharded critic (``verl_prm.placement.shard=fsdp``) run as two processes over gloo, launched torchrun-like
(``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment, as verl's RayWorkerGroup sets them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TOL = 1e-5  # fp32: the sharded forward runs the same kernels on all-gathered weights


def _policy_batch(tokenizer, rows):
    """verl layout: prompts left-padded [B, P], responses right-padded with EOS [B, T], attention_mask [B, P+T],
    and the step split of the responses at "\\n"."""
    from verl import DataProto

    from verl_prm.steps import split_steps

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_rows = [tokenizer.encode(q, add_special_tokens=False) for q, _ in rows]
    response_rows = [tokenizer.encode(a, add_special_tokens=False) + [eos] for _, a in rows]
    width_p, width_r = max(map(len, prompt_rows)), max(map(len, response_rows)) + 2
    prompts = torch.tensor([[pad] * (width_p - len(r)) + r for r in prompt_rows])
    responses = torch.tensor([r + [pad] * (width_r - len(r)) for r in response_rows])
    mask = torch.cat([torch.tensor([[0] * (width_p - len(r)) + [1] * len(r) for r in prompt_rows]),
                      torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in response_rows])], dim=1)
    split = split_steps(responses, mask[:, width_p:], tokenizer, "\n")
    return DataProto.from_dict(tensors={
        "prompts": prompts, "responses": responses, "attention_mask": mask, "step_ends": split.step_ends,
        "num_steps": split.num_steps,
    })


@pytest.fixture(scope="module")
def gsm8k_pairs(repo_data):
    rows = [json.loads(line) for line in (repo_data / "gsm8k_test.jsonl").read_text().splitlines()[:5]]
    # one long row and four short ones: the token-balanced shards then need different micro-batch counts
    pairs = [(r["question"], r["answer"]) for r in rows]
    long_question, long_answer = pairs[0]
    pairs[0] = (long_question, "\n".join([long_answer] * 3))
    return pairs


# ---------------------------------------------------------------------------------------------- shard layout
@pytest.mark.parametrize("rows,world", [(5, 2), (4, 2), (7, 3), (2, 4), (0, 2)])
def test_shard_rows_are_torch_chunk_layout(rows, world):
    """FSDP2 shards dim 0 as torch.chunk does (torch.distributed.fsdp.fully_shard docs: 'chunks on dim-0')."""
    from verl_prm.integrations.verl.sharded_critic import shard_rows

    chunks = list(torch.chunk(torch.arange(rows), world)) if rows else []
    for rank in range(world):
        start, stop = shard_rows(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == expected


# ---------------------------------------------------------------------------------------------- offload
@pytest.fixture(autouse=True)
def _environment(restored_environ):  # the workers below write into os.environ (tests/conftest.py)
    yield


def _worker(monkeypatch, cls, **kwargs):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return cls(**kwargs)


def test_offload_moves_weights_around_each_scoring_and_keeps_values(monkeypatch, critic_dir, bpe_small, gsm8k_pairs):
    from verl_prm.critic.scorer import ProverCritic
    from verl_prm.integrations.verl import critic_worker
    from verl_prm.integrations.verl.critic_worker import (
        OFFLOAD_SECONDS_KEY,
        ProverCriticWorker,
    )

    kwargs = {"format": "value_head", "max_tokens_per_batch": 256, "dtype": "float32", "device": "cpu"}
    worker = _worker(monkeypatch, ProverCriticWorker, model_path=str(critic_dir), critic_kwargs=kwargs,
                     offload="cpu")
    moves: list[str] = []
    real_move = critic_worker.move_critic

    def recording_move(adapter, device):
        moves.append(str(device))
        return real_move(adapter, device)

    real_score = ProverCriticWorker._score

    def recording_score(self, *args, **kwargs):
        moves.append("score")
        return real_score(self, *args, **kwargs)

    monkeypatch.setattr(critic_worker, "move_critic", recording_move)
    monkeypatch.setattr(ProverCriticWorker, "_score", recording_score)
    info = worker.init_model()
    assert info["offload"] == "cpu" and moves == ["cpu"]  # held on the host after loading

    data = _policy_batch(bpe_small, gsm8k_pairs)
    reference = ProverCritic.from_pretrained(str(critic_dir), **kwargs)
    expected = reference.score_policy_batch(data.batch["prompts"], data.batch["responses"],
                                            data.batch["attention_mask"], _split(data))
    for _ in range(2):  # two scorings: the values survive the host round trip
        out = worker.compute_step_values(data)
        torch.testing.assert_close(out.batch["step_values"], expected.step_values, atol=0, rtol=0)
        torch.testing.assert_close(out.batch["prompt_values"], expected.prompt_values, atol=0, rtol=0)
        seconds = out.meta_info["metrics"][OFFLOAD_SECONDS_KEY]
        assert seconds >= 0.0
    # to the worker's device before each scoring, to the host after it
    assert moves == ["cpu", "cpu", "score", "cpu", "cpu", "score", "cpu"]


def test_offload_none_never_moves(monkeypatch, critic_dir, bpe_small, gsm8k_pairs):
    from verl_prm.integrations.verl import critic_worker
    from verl_prm.integrations.verl.critic_worker import (
        OFFLOAD_SECONDS_KEY,
        ProverCriticWorker,
    )

    worker = _worker(monkeypatch, ProverCriticWorker, model_path=str(critic_dir),
                     critic_kwargs={"format": "value_head", "device": "cpu"})
    moves = []
    monkeypatch.setattr(critic_worker, "move_critic", lambda adapter, device: moves.append(device) or 0.0)
    worker.init_model()
    out = worker.compute_step_values(_policy_batch(bpe_small, gsm8k_pairs[:2]))
    assert moves == [] and out.meta_info["metrics"][OFFLOAD_SECONDS_KEY] == 0.0


def test_offload_mode_is_checked(monkeypatch, critic_dir):
    from verl_prm.integrations.verl.critic_worker import ProverCriticWorker

    with pytest.raises(ValueError, match=r"offload must be one of \('none', 'cpu'\), got 'gpu'"):
        _worker(monkeypatch, ProverCriticWorker, model_path=str(critic_dir), offload="gpu")


def test_move_critic_round_trip_through_another_device_keeps_values(critic_dir):
    """A real move needs a second device: on CUDA, critic -> GPU -> host -> GPU gives the same values and frees
    the GPU memory in between."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: on CPU the host is the worker's device, covered by the test above")
    from verl_prm.critic.scorer import ProverCritic
    from verl_prm.integrations.verl.critic_worker import move_critic

    critic = ProverCritic.from_pretrained(str(critic_dir), dtype="float32", device="cuda")
    ids = [[5, 6, 7, 8, 9, 10]]
    before = critic.score_sequences(ids, [1], [[3, 5]])
    held = torch.cuda.memory_allocated()
    move_critic(critic.adapter, torch.device("cpu"))
    assert torch.cuda.memory_allocated() < held
    move_critic(critic.adapter, torch.device("cuda"))
    after = critic.score_sequences(ids, [1], [[3, 5]])
    torch.testing.assert_close(after.step_values, before.step_values, atol=0, rtol=0)


def _split(data):
    from verl_prm.steps import StepSplit

    batch = data.batch
    return StepSplit(step_ids=torch.full_like(batch["responses"], -1), num_steps=batch["num_steps"],
                     step_ends=batch["step_ends"], merged_steps=torch.zeros_like(batch["num_steps"]))


# ---------------------------------------------------------------------------------------------- FSDP, 2 ranks
# Each rank: a ShardedProverCriticWorker; the driver side is the real compute_step_values over a group that
# dispatches as verl's DP_COMPUTE_PROTO does (equal chunks in rank order) and collects by all_gather.
RANK_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    from verl import DataProto
    from verl_prm.integrations.verl.critic_worker import compute_step_values
    from verl_prm.integrations.verl.sharded_critic import ShardedProverCriticWorker

    def peak_rss_kib():  # VmHWM starts anew at exec (ru_maxrss keeps the peak of the parent that forked)
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])

    model_path, data_path, out_path, budget = sys.argv[1:5]
    rss_before = peak_rss_kib()
    worker = ShardedProverCriticWorker(model_path, {"format": "value_head", "dtype": "float32", "device": "cpu",
                                                    "max_tokens_per_batch": int(budget)})
    info = worker.init_model()
    rss_loaded = peak_rss_kib()
    local, total = worker.local_parameter_count()
    result = {"info": info, "local": local, "total": total, "rss_before_kib": rss_before,
              "rss_loaded_kib": rss_loaded, "head": sum(p.numel() for p in worker.critic.adapter.head.parameters())}
    if data_path != "-":
        class Group:  # verl's DP_COMPUTE_PROTO: chunk in rank order; collect: concatenate in rank order
            world_size = dist.get_world_size()
            def compute_step_values(self, data):
                mine = worker.compute_step_values(data.chunk(self.world_size)[dist.get_rank()])
                parts = [None] * self.world_size
                dist.all_gather_object(parts, mine)
                return DataProto.concat(parts)
        data = DataProto.load_from_disk(data_path)
        out = compute_step_values(Group(), data)
        result["padding_forwards"] = worker.padding_forwards
        result["metrics"] = out.meta_info["metrics"]
        torch.save(out.batch.to_dict(), out_path + ".pt")
    json.dump(result, open(out_path, "w"))
    dist.destroy_process_group()
''')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path: Path, model_path: Path, data_path: str, budget: int, world: int = 2) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        out = tmp_path / f"rank{rank}.json"
        procs.append((subprocess.Popen([sys.executable, str(script), str(model_path), data_path, str(out),
                                        str(budget)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True), out))
    results = []
    for proc, out in procs:
        try:
            log, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            pytest.fail("a sharded critic rank did not finish in 240 s (a collective waiting for the other rank?)")
        assert proc.returncode == 0, log[-4000:]
        results.append(json.loads(out.read_text()))
    return results


@pytest.mark.slow
def test_sharded_critic_equals_unsharded_and_holds_half(tmp_path, critic_dir, bpe_small, gsm8k_pairs):
    from verl_prm.critic.scorer import ProverCritic

    data = _policy_batch(bpe_small, gsm8k_pairs)  # 5 rows: padded to 6 for 2 ranks, unpadded again
    data_path = tmp_path / "batch.pt"
    data.save_to_disk(data_path)
    # rows of ~[494, 160, 375, 159, 551] tokens (+ row 0 again as padding): the shards are rows {1, 2, 4} and
    # {0, 3, 5}; within the budget the two 494-token rows share a micro-batch, no two rows of the other shard do
    budget = 1024
    results = _launch(tmp_path, critic_dir, str(data_path), budget)

    out = torch.load(tmp_path / "rank0.json.pt")
    expected = ProverCritic.from_pretrained(str(critic_dir), format="value_head", dtype="float32", device="cpu",
                                            max_tokens_per_batch=budget).score_policy_batch(
        data.batch["prompts"], data.batch["responses"], data.batch["attention_mask"], _split(data))
    torch.testing.assert_close(out["num_steps"], expected.num_steps)
    torch.testing.assert_close(out["prompt_values"], expected.prompt_values, atol=TOL, rtol=0)
    torch.testing.assert_close(out["step_values"], expected.step_values, atol=TOL, rtol=0)
    # the rank with fewer micro-batches ran one-token forwards to match the other's all-gathers
    padding = sorted(r["padding_forwards"] for r in results)
    assert padding[0] == 0 and padding[1] >= 1, padding

    # each rank holds its rows of every backbone tensor plus the whole (replicated) head
    total, head = results[0]["total"], results[0]["head"]
    locals_ = [r["local"] for r in results]
    assert sum(locals_) == total + head  # the shards partition the backbone; the head is on both ranks
    for local in locals_:
        assert abs(local - total / 2) <= 0.02 * total, (local, total)


@pytest.mark.slow
def test_sharded_load_peak_rss_is_below_a_full_load(tmp_path, bpe_small):
    """No full host copy per rank: the growth of peak RSS while loading (VmHWM after minus before) of each
    sharded rank stays well below a full (unsharded) load of the same checkpoint. docs/gpu.md reports the
    numbers this prints (``pytest -s -k peak_rss``)."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    model_dir = tmp_path / "critic_100m"
    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048, num_labels=1,
                         pad_token_id=bpe_small.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForTokenClassification(config).save_pretrained(model_dir)
    bpe_small.save_pretrained(model_dir)
    weights_mib = (model_dir / "model.safetensors").stat().st_size / 2**20

    full_script = tmp_path / "full.py"
    full_script.write_text(textwrap.dedent('''
        import json, sys
        import torch
        torch.set_num_threads(1)
        def peak_rss_kib():  # VmHWM starts anew at exec (ru_maxrss keeps the peak of the parent that forked)
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
        import verl  # the same imports as a sharded rank before its load
        from verl_prm.critic.scorer import ProverCritic
        from verl_prm.integrations.verl.sharded_critic import ShardedProverCriticWorker
        before = peak_rss_kib()
        critic = ProverCritic.from_pretrained(sys.argv[1], format="value_head", dtype="float32", device="cpu")
        loaded = peak_rss_kib()
        # the weights may still be untouched pages of the memory-mapped file: read each once, as a copy to a GPU
        # or a forward would
        with torch.no_grad():
            sum(float(p.sum()) for p in critic.adapter.backbone.parameters())
        touched = peak_rss_kib()
        print(json.dumps({"rss_before_kib": before, "rss_mapped_kib": loaded, "rss_loaded_kib": touched}))
    '''))
    full = subprocess.run([sys.executable, str(full_script), str(model_dir)], capture_output=True, text=True, check=False,
                          timeout=240, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    assert full.returncode == 0, full.stderr[-4000:]
    full_rss = json.loads(full.stdout.splitlines()[-1])
    full_growth = (full_rss["rss_loaded_kib"] - full_rss["rss_before_kib"]) / 1024
    mapped_growth = (full_rss["rss_mapped_kib"] - full_rss["rss_before_kib"]) / 1024
    sharded = _launch(tmp_path, model_dir, "-", 4096)
    sharded_growth = [(r["rss_loaded_kib"] - r["rss_before_kib"]) / 1024 for r in sharded]
    print(f"\ncheckpoint {weights_mib:.0f} MiB fp32; peak RSS growth while loading: full load {full_growth:.0f} MiB "
          f"({mapped_growth:.0f} MiB before its weights are read), "
          f"sharded over 2 ranks {', '.join(f'{g:.0f}' for g in sharded_growth)} MiB")
    assert full_growth >= 0.9 * weights_mib  # the full load holds every weight once at least
    for growth in sharded_growth:
        assert growth < 0.75 * weights_mib, (growth, weights_mib)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("section,message", [
    ({"placement": {"offload": "disk"}},
     "verl_prm.placement.offload must be one of ('none', 'cpu'), got 'disk'"),
    ({"placement": {"shard": "tp"}}, "verl_prm.placement.shard must be one of ('none', 'fsdp'), got 'tp'"),
    ({"critic": {"path": "c", "format": "qwen_prm"}, "placement": {"shard": "fsdp"}},
     ("verl_prm.placement.shard=fsdp supports verl_prm.critic.format ('value_head',), got 'qwen_prm': set "
      "verl_prm.placement.shard=none")),
    ({"critic": {"path": "c", "allow_pickle": True}, "placement": {"shard": "fsdp"}},
     "verl_prm.placement.shard=fsdp reads safetensors only: set verl_prm.critic.allow_pickle=false"),
    ({"critic": {"source": "sampled"}, "placement": {"offload": "cpu"}},
     ("verl_prm.placement.offload/shard are unused with verl_prm.critic.source=sampled (no critic weights): set "
      "verl_prm.placement.offload=none and verl_prm.placement.shard=none")),
])
def test_placement_keys_are_checked(section, message):
    from verl_prm.config.hook import ConfigError, read_hook_config
    from verl_prm.integrations.verl.run_config import check_source_settings

    with pytest.raises(ConfigError) as error:
        check_source_settings(read_hook_config(section))
    assert str(error.value) == message


def test_placement_defaults_and_valid_choices():
    from verl_prm.config.hook import read_hook_config

    assert (read_hook_config(None).placement.offload, read_hook_config(None).placement.shard) == ("none", "none")
    placement = read_hook_config({"critic": {"path": "c"}, "placement": {"offload": "cpu", "shard": "fsdp"}}).placement
    assert (placement.offload, placement.shard) == ("cpu", "fsdp")
