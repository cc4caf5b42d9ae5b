"""The CPU generation engine (verl_prm.generation): its precision choice, its sampling against transformers'
own warpers and ``generate``, prefix reuse, batching and its errors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verl_prm.generation import GenerationEngine, GenerationRequest, PrefixCache
from verl_prm.precision import resolve_dtype
from verl_prm import precision as precision_module
from verl_prm.generation.sampling import warp_logits

VOCAB = 64
EOS = 1


@pytest.fixture(scope="module")
def tiny_lm():
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # a peaked, varied next-token distribution (random init is nearly uniform)
        model.lm_head.weight.mul_(8.0)
    return model


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (count,), generator=generator).tolist()
    return [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in lengths]


# ---------------------------------------------------------------- precision
AMX_CPU = "processor : 0\nflags : fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4_CPU = "processor : 0\nflags : fpu sse2 avx2 avx512f avx512_bf16\n"
AVX2_CPU = "processor : 0\nflags : fpu sse2 avx2 fma\n"


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(precision_module.platform, "machine", lambda: "x86_64")
    assert precision_module.cpu_bf16_flags.__wrapped__(AMX_CPU) == ("amx_bf16", "avx512_bf16")
    assert precision_module.cpu_bf16_flags.__wrapped__(ZEN4_CPU) == ("avx512_bf16",)
    assert precision_module.cpu_bf16_flags.__wrapped__(AVX2_CPU) == ()


def test_auto_precision_is_bf16_only_with_native_instructions_and_a_bf16_request_without_them_is_refused():
    assert resolve_dtype("auto", "cpu", native=True) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", native=False) == torch.float32
    assert resolve_dtype("float32", "cpu", native=True) == torch.float32
    with pytest.raises(ValueError, match="without native bf16 instructions.*precision='auto' or 'float32'"):
        resolve_dtype("bfloat16", "cpu", native=False)
    assert resolve_dtype("bfloat16", "cpu", native=False, allow_emulated=True) == torch.bfloat16
    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'bfloat16', 'float32'\), got 'float16'"):
        resolve_dtype("float16", "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_from_pretrained_loads_the_dtype_the_cpu_flags_choose(tmp_path, tiny_lm, monkeypatch, native):
    tiny_lm.save_pretrained(tmp_path)
    monkeypatch.setattr(precision_module, "native_bf16_instructions", lambda: native)
    engine = GenerationEngine.from_pretrained(str(tmp_path), precision="auto", device="cpu", eos_token_ids=[EOS])
    assert engine.dtype == (torch.bfloat16 if native else torch.float32)
    (output,) = engine.generate([GenerationRequest([5, 6, 7], max_tokens=4, seed=0)])
    assert 1 <= len(output.token_ids) <= 4 and all(0 <= t < VOCAB for t in output.token_ids)


# ---------------------------------------------------------------- sampling
def test_warped_logits_equal_transformers_warpers_row_by_row():
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB) * 3
    settings = [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.5, 10, 0.6), (2.0, 1, 0.9), (1.0, 64, 0.3)]
    temperature = torch.tensor([s[0] for s in settings])
    top_k = torch.tensor([s[1] for s in settings])
    top_p = torch.tensor([s[2] for s in settings])
    ours = warp_logits(logits, temperature, top_k, top_p)
    for row, (t, k, p) in enumerate(settings):
        chain = [TemperatureLogitsWarper(t)]
        if k > 0:
            chain.append(TopKLogitsWarper(k))
        if p < 1:
            chain.append(TopPLogitsWarper(p))
        reference = LogitsProcessorList(chain)(None, logits[row: row + 1].clone())[0]
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(reference)), row
        kept = ~torch.isinf(reference)
        torch.testing.assert_close(ours[row][kept], reference[kept])


def test_next_token_distribution_equals_generate_s(tiny_lm):
    """Chi-square goodness of fit of 4,000 seeded first tokens against the distribution ``generate`` samples
    from (the model's float32 logits through transformers' temperature, top-k and top-p warpers). The seeds are
    fixed, so the outcome is deterministic; a correct sampler would fail at this threshold with probability 1e-4."""
    prompt, (t, k, p) = [7, 3, 9, 22, 41], (0.8, 20, 0.9)
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([prompt])).logits[:, -1].float()
    chain = LogitsProcessorList([TemperatureLogitsWarper(t), TopKLogitsWarper(k), TopPLogitsWarper(p)])
    expected_p = torch.softmax(chain(torch.tensor([prompt]), logits.clone()), dim=-1)[0].double()
    assert (expected_p > 0).sum() >= 5  # a distribution with several outcomes
    engine = GenerationEngine(tiny_lm, eos_token_ids=[EOS], max_batch_size=500)
    draws = 4000
    outputs = engine.generate([GenerationRequest(prompt, max_tokens=1, temperature=t, top_k=k, top_p=p, seed=seed)
                               for seed in range(draws)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outputs]), minlength=VOCAB).double()
    assert counts[expected_p == 0].sum() == 0  # nothing outside the warped support
    expected = expected_p * draws
    big = expected >= 5  # pool the rare outcomes into one cell
    observed_cells = torch.cat([counts[big], counts[~big].sum()[None]])
    expected_cells = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected_cells > 0
    observed_cells, expected_cells = observed_cells[keep], expected_cells[keep]
    statistic = float(((observed_cells - expected_cells) ** 2 / expected_cells).sum())
    # Pearson's statistic is chi-square with (cells - 1) degrees of freedom: P(X > x) = Q((cells - 1) / 2, x / 2)
    p_value = float(torch.special.gammaincc(torch.tensor((len(expected_cells) - 1) / 2.0, dtype=torch.float64),
                                            torch.tensor(statistic / 2.0, dtype=torch.float64)))
    assert p_value > 1e-4, (statistic, p_value)


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_a_batch(tiny_lm):
    engine = GenerationEngine(tiny_lm, eos_token_ids=[EOS], prefix_cache_tokens=0)
    requests = [GenerationRequest(ids, max_tokens=12, temperature=1.0, top_p=0.95, seed=100 + i)
                for i, ids in enumerate(prompts(6))]
    together = engine.generate(requests)
    alone = [engine.generate([request])[0] for request in requests]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


# ---------------------------------------------------------------- greedy, batching and prefix reuse
def test_greedy_output_equals_plain_generate_for_prompts_of_different_lengths(tiny_lm):
    engine = GenerationEngine(tiny_lm, eos_token_ids=[EOS], max_batch_size=4)  # 9 prompts: three batches
    batch = prompts(9, seed=3)
    outputs = engine.generate([GenerationRequest(ids, max_tokens=15, temperature=0) for ids in batch])
    for ids, output in zip(batch, outputs):
        with torch.no_grad():
            reference = tiny_lm.generate(torch.tensor([ids]), max_new_tokens=15, do_sample=False,
                                         eos_token_id=EOS, pad_token_id=0)[0, len(ids):].tolist()
        if EOS in reference:
            reference = reference[: reference.index(EOS) + 1]
        assert output.token_ids == reference
        assert output.stop_reason == ("eos" if reference[-1] == EOS else "length")


def test_greedy_output_with_and_without_prefix_reuse_is_identical(tiny_lm):
    cached = GenerationEngine(tiny_lm, eos_token_ids=[EOS])
    uncached = GenerationEngine(tiny_lm, eos_token_ids=[EOS], prefix_cache_tokens=0)
    roots = [ids + [2] * 20 for ids in prompts(3, seed=5)]  # >= 16 tokens: long enough to be cached
    root_outputs = cached.generate([GenerationRequest(ids, max_tokens=30, temperature=0) for ids in roots])
    assert root_outputs == uncached.generate([GenerationRequest(ids, max_tokens=30, temperature=0) for ids in roots])
    # branches: each root's prompt plus the first k of its generated tokens, as a tree's second round asks
    branches = [GenerationRequest(ids + out.token_ids[:k], max_tokens=12, temperature=0)
                for ids, out in zip(roots, root_outputs) for k in (1, 6, 11) if k < len(out.token_ids)]
    with_reuse = cached.generate(branches)
    without = uncached.generate(branches)
    assert [o.token_ids for o in with_reuse] == [o.token_ids for o in without]
    assert all(o.reused_tokens == len(b.prompt_ids) - 1 for o, b in zip(with_reuse, branches))
    assert all(o.reused_tokens == 0 for o in without)
    assert cached.stats.reused_tokens == sum(len(b.prompt_ids) - 1 for b in branches)


def test_identical_prompts_in_a_batch_are_prefilled_once(tiny_lm):
    engine = GenerationEngine(tiny_lm, eos_token_ids=[EOS], prefix_cache_tokens=0)
    prompt = prompts(1, seed=9)[0]
    outputs = engine.generate([GenerationRequest(prompt, max_tokens=5, seed=s) for s in range(4)])
    assert [o.prefill_tokens for o in outputs] == [len(prompt), 0, 0, 0]
    assert engine.stats.prefill_tokens == len(prompt) and engine.stats.shared_tokens == 3 * len(prompt)


def test_a_stop_rule_ends_a_request_and_rows_finish_independently(tiny_lm):
    engine = GenerationEngine(tiny_lm, eos_token_ids=[EOS])
    batch = prompts(3, seed=11)
    stopped = engine.generate([GenerationRequest(batch[0], max_tokens=20, temperature=0, stop=lambda ids: len(ids) >= 3),
                               GenerationRequest(batch[1], max_tokens=7, temperature=0),
                               GenerationRequest(batch[2], max_tokens=20, temperature=0)])
    free = engine.generate([GenerationRequest(ids, max_tokens=20, temperature=0) for ids in batch])
    assert stopped[0].token_ids == free[0].token_ids[:3] and stopped[0].stop_reason in ("stop", "eos")
    assert stopped[1].token_ids == free[1].token_ids[:7]
    assert stopped[2].token_ids == free[2].token_ids


# ---------------------------------------------------------------- continuous batching
def _tree_through_the_batcher(batcher, roots, long_prompt, seed=None):
    """A long request decoding while short roots end and their branches (root prompt + 4 of its tokens) are
    sent as each root ends; returns the outputs in order of completion as (name, output)."""
    import asyncio

    done = []

    async def run(name, request):
        output = await batcher.generate(request)
        done.append((name, output))
        return output

    async def root_then_branch(i, ids):
        root = await run(f"root{i}", GenerationRequest(ids, max_tokens=8, temperature=0))
        await run(f"branch{i}", GenerationRequest(ids + root.token_ids[:4], max_tokens=6, temperature=1.0,
                                                  top_p=0.9, seed=None if seed is None else seed + i))

    async def main():
        await asyncio.gather(run("long", GenerationRequest(long_prompt, max_tokens=300, temperature=0)),
                             *(root_then_branch(i, ids) for i, ids in enumerate(roots)))

    asyncio.run(main())
    return done


def test_requests_join_the_running_batch_and_decode_as_they_would_alone(tiny_lm):
    """Branches sent when their roots end join the batch while a long request still decodes (they end before
    it), reuse their root's keys and values, and give what each request gives alone: greedy rows the same
    tokens, seeded sampled rows the same draws."""
    from verl_prm.generation import ContinuousBatcher

    no_eos = [VOCAB + 1]  # never sampled: every request runs to its max_tokens
    batcher = ContinuousBatcher(GenerationEngine(tiny_lm, eos_token_ids=no_eos), gather_seconds=0.05)
    roots = [ids + [2] * 16 for ids in prompts(3, seed=21)]  # >= 16 tokens: long enough to be cached
    long_prompt = prompts(1, seed=22)[0]
    done = _tree_through_the_batcher(batcher, roots, long_prompt, seed=500)
    names = [name for name, _ in done]
    assert names[-1] == "long" and len(names) == 7, names  # every branch ended while the long request decoded
    outputs = dict(done)
    assert all(outputs[f"branch{i}"].reused_tokens == len(roots[i]) + 3 for i in range(3))  # root's prompt + 3
    assert batcher.engine.stats.batches >= 2 and not batcher.busy

    alone = GenerationEngine(tiny_lm, eos_token_ids=no_eos, prefix_cache_tokens=0)
    assert outputs["long"].token_ids == alone.generate([GenerationRequest(long_prompt, max_tokens=300,
                                                                          temperature=0)])[0].token_ids
    for i, ids in enumerate(roots):
        root = alone.generate([GenerationRequest(ids, max_tokens=8, temperature=0)])[0]
        assert outputs[f"root{i}"].token_ids == root.token_ids
        branch = alone.generate([GenerationRequest(ids + root.token_ids[:4], max_tokens=6, temperature=1.0,
                                                   top_p=0.9, seed=500 + i)])[0]
        assert outputs[f"branch{i}"].token_ids == branch.token_ids


def test_a_failing_request_fails_its_batch_and_the_batcher_serves_the_next_ones(tiny_lm):
    import asyncio

    from verl_prm.generation import ContinuousBatcher

    batcher = ContinuousBatcher(GenerationEngine(tiny_lm, eos_token_ids=[EOS]))

    def broken(ids):
        raise RuntimeError("stop rule failed")

    async def failing():
        return await asyncio.gather(
            batcher.generate(GenerationRequest([5, 6, 7], max_tokens=5, stop=broken)),
            batcher.generate(GenerationRequest([8, 9], max_tokens=5)), return_exceptions=True)

    results = asyncio.run(failing())
    assert all(isinstance(r, RuntimeError) and "stop rule failed" in str(r) for r in results), results
    assert not batcher.busy
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        asyncio.run(batcher.generate(GenerationRequest([5], max_tokens=0)))
    output = asyncio.run(batcher.generate(GenerationRequest([5, 6, 7], max_tokens=4, temperature=0)))
    assert output.token_ids == GenerationEngine(tiny_lm, eos_token_ids=[EOS]).generate(
        [GenerationRequest([5, 6, 7], max_tokens=4, temperature=0)])[0].token_ids


def test_prefix_cache_finds_the_longest_shared_prefix_and_evicts_the_oldest():
    cache = PrefixCache(capacity_tokens=64)
    tensors = lambda n: ([torch.zeros(1, n, 2)], [torch.zeros(1, n, 2)])  # noqa: E731
    first = list(range(40))
    cache.add(first, *tensors(40))
    entry, length = cache.longest_prefix(first[:35] + [99, 98], limit=36)
    assert entry.tokens == tuple(first) and length == 35
    assert cache.longest_prefix([5] * 30, limit=29) == (None, 0)
    cache.add(list(range(100, 140)), *tensors(40))  # 80 tokens > 64: the first entry goes
    assert len(cache) == 1 and cache.longest_prefix(first, limit=39) == (None, 0)
    cache.add(list(range(100, 150)), *tensors(50))  # extends the entry it replaces
    assert len(cache) == 1 and cache.tokens == 50


@pytest.mark.parametrize("bad, message", [
    (dict(prompt_ids=[]), "empty prompt_ids"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=2.0), "max_tokens must be an integer >= 1"),
    (dict(temperature=math.nan), "temperature must be finite"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(prompt_ids=[3, VOCAB]), "token ids outside the model's vocabulary of 64: \\[64\\]"),
])
def test_a_bad_request_is_refused_naming_it_before_any_generation(tiny_lm, bad, message):
    engine = GenerationEngine(tiny_lm, eos_token_ids=[EOS])
    good = GenerationRequest([3, 4], max_tokens=3)
    fields = dict(prompt_ids=[3, 4], max_tokens=3) | bad
    with pytest.raises(ValueError, match=f"generation request 1: {message}"):
        engine.generate([good, GenerationRequest(**fields)])
    assert engine.stats.generated_tokens == 0


# ---------------------------------------------------------------- fused projections and bf16 attention
def _fresh_tiny_lm(seed: int = 1):
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def test_fused_projections_compute_what_the_separate_modules_compute_and_follow_in_place_weight_updates():
    from verl_prm.generation.fused_projections import fuse_projections

    separate, fused = _fresh_tiny_lm(), _fresh_tiny_lm()
    keys = {name: tensor.clone() for name, tensor in fused.state_dict().items()}
    assert fuse_projections(fused) == 4  # q/k/v (with Qwen2's biases) and gate/up in each of 2 layers
    assert {name: tensor for name, tensor in fused.state_dict().items()}.keys() == keys.keys()
    assert all(torch.equal(fused.state_dict()[name], tensor) for name, tensor in keys.items())
    ids = torch.tensor(prompts(3, seed=21)[0])[None]
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, separate(ids).logits, rtol=1e-5, atol=1e-5)
        # the hf rollout's weight load: copy_ into the state dict's tensors, in place
        other = _fresh_tiny_lm(seed=2)
        for name, tensor in other.state_dict().items():
            fused.state_dict()[name].copy_(tensor)
        torch.testing.assert_close(fused(ids).logits, other(ids).logits, rtol=1e-5, atol=1e-5)
    # with gradients on, each module computes with its own parameters: the same gradients as unfused
    fused(ids).logits.square().mean().backward()
    other(ids).logits.square().mean().backward()
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.0.self_attn.v_proj.bias"):
        torch.testing.assert_close(fused.get_parameter(name).grad, other.get_parameter(name).grad)
    # weights replaced rather than written in place: fuse_projections restacks them
    with torch.no_grad():
        fused.model.layers[0].mlp.gate_proj.weight = torch.nn.Parameter(torch.zeros_like(
            fused.model.layers[0].mlp.gate_proj.weight))
        other.model.layers[0].mlp.gate_proj.weight.zero_()
        assert fuse_projections(fused) == 4
        torch.testing.assert_close(fused(ids).logits, other(ids).logits, rtol=1e-5, atol=1e-5)


def test_bf16_attention_equals_transformers_eager_attention_with_padding_and_grouped_heads():
    """The bf16 path (PyTorch's SDPA on the cache's views) against transformers' own ``eager_attention_forward``
    (``repeat_kv``, float32 softmax) on the same bf16 inputs; keys and values are views of a longer buffer, as the
    engine's cache hands them over, and the mask pads the first positions of one row."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from verl_prm.generation.attention import grouped_query_attention

    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, length = 3, 6, 2, 16, 11
    buffer = torch.randn(2, batch, kv_heads, length + 5, dim, generator=generator).to(torch.bfloat16)
    key, value = buffer[0, :, :, :length], buffer[1, :, :, :length]
    for queries in (1, 4):
        query = torch.randn(batch, heads, queries, dim, generator=generator).to(torch.bfloat16)
        mask = torch.zeros(batch, 1, queries, length + 5, dtype=torch.bfloat16)
        mask[1, :, :, :4] = torch.finfo(torch.bfloat16).min  # row 1: four padding positions
        module = torch.nn.Module()
        module.num_key_value_groups, module.training = heads // kv_heads, False
        expected, _ = eager_attention_forward(module, query, key, value, mask[..., :length], scaling=dim ** -0.5)
        out, _ = grouped_query_attention(module, query, key, value, mask, scaling=dim ** -0.5)
        assert out.shape == expected.shape == (batch, queries, heads, dim) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _resident_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status")


def test_memory_a_worker_thread_freed_is_handed_back():
    """What a thread frees stays in its glibc arena (a rollout server's waves run on worker threads) until
    release_freed_memory: 400 MB freed in a thread are resident before it and not after."""
    import threading

    from verl_prm.generation.engine import release_freed_memory

    def wave():
        big = torch.empty(8 * 2**20, dtype=torch.uint8)
        del big  # glibc's dynamic mmap threshold rises to 8 MB: the 1 MB tensors below come from the arena
        kept = [torch.ones(2**20, dtype=torch.uint8) for _ in range(400)]
        del kept

    if not release_freed_memory():
        pytest.skip("the C library has no malloc_trim")
    baseline = _resident_mib()
    thread = threading.Thread(target=wave)
    thread.start()
    thread.join()
    retained = _resident_mib() - baseline
    assert release_freed_memory()
    released = retained - (_resident_mib() - baseline)
    assert retained > 200 and released > 200, (retained, released)
