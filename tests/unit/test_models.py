"""graphrl.models against transformers: same logits, same greedy tokens, GGUF files load, saves load back.

Weights are re-drawn with std 0.15 so next-token distributions are far from uniform and a wrong RoPE
frequency, mask or position moves the logits well past the 1e-4 tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphrl.errors import GraphRLError
from graphrl.executors.models.sampling import generate
from graphrl.models import checkpoint_dims, from_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

VOCAB = 48


def _hf_model(tie: bool, llama3_rope: bool, seed: int = 0):  # noqa: ANN202
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope:  # original context 16, so the 40-token inputs below reach the scaled band
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    return model.eval()


@pytest.mark.parametrize(("tie", "llama3_rope", "shard"), [(True, True, True), (False, False, False)])
def test_logits_match_transformers(tmp_path, tie: bool, llama3_rope: bool, shard: bool) -> None:
    hf = _hf_model(tie, llama3_rope)
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "10GB")
    assert (tmp_path / "model.safetensors.index.json").exists() is shard
    ours, tokenizer = from_pretrained(tmp_path)
    assert tokenizer is None and ours.dims.tie_embeddings is tie
    assert (ours.dims.rope_scaling is not None) is llama3_rope
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits.float()
        got = ours(ids)
    assert got.shape == (3, 40, VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def left_padded_prompts(lengths: list[int], vocab: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of `lengths` tokens, left-padded with 0 to the longest: (ids, mask)."""
    prompt_len = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), prompt_len, dtype=torch.int64)
    mask = torch.zeros(len(lengths), prompt_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        ids[row, prompt_len - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, prompt_len - n:] = True
    return ids, mask


def assert_greedy_as_transformers(hf, ours, vocab: int, new_tokens: int = 24) -> None:  # noqa: ANN001
    """`ours` continues left-padded prompts greedily with the tokens `hf.generate` picks."""
    ids, mask = left_padded_prompts([3, 11, 7], vocab)
    with torch.no_grad():
        expected = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new_tokens, do_sample=False,
                               min_new_tokens=new_tokens, pad_token_id=0)[:, ids.shape[1]:]
    out = generate(ours, ids, mask, new_tokens, temperature=0.0, eos_id=None, pad_id=0)
    assert torch.equal(out.response_ids, expected)


def test_greedy_generation_matches_transformers_with_left_padding(tmp_path) -> None:
    hf = _hf_model(tie=True, llama3_rope=True)
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    assert_greedy_as_transformers(hf, ours, VOCAB)


def test_saved_policy_loads_back_into_transformers(tmp_path) -> None:
    hf = _hf_model(tie=True, llama3_rope=True)
    hf.save_pretrained(tmp_path / "hf")
    ours, _ = from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes (interleaved rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(path, hf, arch: str = "llama") -> None:  # noqa: ANN001
    """A GGUF file of `hf` as llama.cpp's converter writes it for `arch` (llama: q/k rows interleaved for its
    rotary layout; qwen2: rows as they are, with the q/k/v biases)."""
    gguf = pytest.importorskip("gguf")
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    tokens = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 3)]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf.state_dict().items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
            if module == "self_attn.q_proj" and arch == "llama":
                array = _llama_cpp_permute(array, cfg.num_attention_heads)
            elif module == "self_attn.k_proj" and arch == "llama":
                array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_written_by_gguf_loads(tmp_path) -> None:
    pytest.importorskip("accelerate")
    hf = _hf_model(tie=True, llama3_rope=False)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, hf)
    assert checkpoint_dims(path).num_kv_heads == 2
    ours, tokenizer = from_pretrained(path)
    assert tokenizer is not None and tokenizer.eos_token_id == 2
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_a_qwen2_gguf_file_loads_as_transformers_reads_it(tmp_path) -> None:
    """Released Qwen2/2.5 GGUF files have architecture qwen2: biases on q/k/v, rows unpermuted."""
    pytest.importorskip("accelerate")
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) * 0.15 + (0.0 if param.dim() == 2 else 1.0))
    path = tmp_path / "qwen.gguf"
    _write_gguf(path, hf, arch="qwen2")
    ours, _ = from_pretrained(path)
    assert ours.dims.family == "qwen2" and ours.dims.qkv_bias
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="qwen.gguf", dtype=torch.float32)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-4, rtol=0)  # the file is right
        torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)


def test_missing_checkpoint_is_a_user_error(tmp_path) -> None:
    with pytest.raises(GraphRLError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")


def test_any_of_several_stop_ids_ends_a_row(tmp_path) -> None:
    hf = _hf_model(tie=True, llama3_rope=False)
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids, dtype=torch.bool)
    free = generate(ours, ids, mask, 8, temperature=0.0, eos_id=None)
    stops = [int(free.response_ids[0, 2]), int(free.response_ids[1, 4])]
    out = generate(ours, ids, mask, 8, temperature=0.0, eos_id=stops)
    for row in range(2):
        first_stop = next(i for i, t in enumerate(free.response_ids[row].tolist()) if t in stops)
        assert out.response_mask[row].sum() == first_stop + 1  # up to and including the first stop token
        assert torch.equal(out.response_ids[row, :first_stop + 1], free.response_ids[row, :first_stop + 1])


def test_graphrl_import_writes_a_folder_that_loads(tmp_path) -> None:
    from click.testing import CliRunner

    from graphrl.cli import main

    hf = _hf_model(tie=False, llama3_rope=True)
    hf.save_pretrained(tmp_path / "src", max_shard_size="40KB")
    result = CliRunner().invoke(main, ["import", str(tmp_path / "src"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".graphrl-import.json", "config.json",
                                                                     "model.safetensors"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def _import(*args: str):  # noqa: ANN202
    from click.testing import CliRunner

    from graphrl.cli import main

    return CliRunner().invoke(main, ["import", *args])


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):  # noqa: ANN001, ANN201
    src = tmp_path_factory.mktemp("hf") / "src"
    _hf_model(tie=True, llama3_rope=False).save_pretrained(src)
    return src


def test_import_refuses_a_folder_it_did_not_write(tmp_path, hf_source) -> None:
    """`graphrl import SRC OUT_DIR` ran shutil.rmtree(OUT_DIR) first: a folder's files were deleted without a
    word. A non-empty folder is refused (exit 2, naming it), with or without --force, and left as it was."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--force"]):
        result = _import(str(hf_source), str(out), *extra)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and str(out) in result.output
        assert (out / "notes.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling left


def test_import_refuses_the_working_folder_and_its_parents(tmp_path, hf_source, monkeypatch) -> None:
    """`graphrl import SRC ..` emptied the parent folder (the working folder with it), and `.` crashed
    with a traceback; both exit 2 now and delete nothing."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.yaml").write_text("name: x\n")
    monkeypatch.chdir(work)
    for target in (".", "..", str(tmp_path)):
        result = _import(str(hf_source), target, "--force")
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
    assert (work / "job.yaml").exists() and hf_source.is_dir()


def test_import_force_replaces_only_an_earlier_import(tmp_path, hf_source) -> None:
    """--force replaces a folder an earlier import wrote (its marker lists its files), but not once the
    user added a file of their own to it."""
    out = tmp_path / "model"
    assert _import(str(hf_source), str(out)).exit_code == 0
    again = _import(str(hf_source), str(out))
    assert again.exit_code == 2 and "--force" in again.output
    assert _import(str(hf_source), str(out), "--force").exit_code == 0
    assert (out / ".graphrl-import.json").is_file() and (out / "model.safetensors").is_file()
    (out / "my_eval.json").write_text("{}")
    refused = _import(str(hf_source), str(out), "--force")
    assert refused.exit_code == 2 and "my_eval.json" in refused.output
    assert (out / "my_eval.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary or replaced folder left


def test_import_into_an_empty_folder(tmp_path, hf_source) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert _import(str(hf_source), str(out)).exit_code == 0
    assert (out / "config.json").is_file()
