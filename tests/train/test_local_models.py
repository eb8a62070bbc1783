"""Any local GGUF as a model: a `.gguf` file (or a directory holding exactly one) loads as a plain trainable
checkpoint whose weights are exactly the file's, converted once into the cache (keyed by the file's identity,
written atomically) and read from there afterwards; names that give no model fail in one line, before torch in the
pre-flight check. The GGUFs are written here with the `gguf` package from tiny random transformers models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl import models
from agentrl.chat import ChatFormat
from agentrl.models import ModelNotFound, check_model_name, load_model

QWEN25 = (Path(__file__).parents[1] / "chat" / "qwen2.5_chat_template.jinja").read_text()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens, as in Qwen2.5's vocabulary
USER_DEFINED = ["<tool_call>", "</tool_call>"]  # plain added tokens there
MERGES = [("Ġ", "t"), ("h", "e")]
HF_TO_GGUF = {
    "model.embed_tokens.": "token_embd.", "lm_head.": "output.", "model.norm.": "output_norm.",
    "input_layernorm.": "attn_norm.", "post_attention_layernorm.": "ffn_norm.",
    "self_attn.q_proj.": "attn_q.", "self_attn.k_proj.": "attn_k.", "self_attn.v_proj.": "attn_v.",
    "self_attn.o_proj.": "attn_output.", "mlp.gate_proj.": "ffn_gate.", "mlp.up_proj.": "ffn_up.",
    "mlp.down_proj.": "ffn_down.", "model.layers.": "blk.",
}


# ----------------------------------------------------------------------------------------- a tiny GGUF


def vocabulary() -> tuple[list[str], list[int]]:
    """Byte-level BPE tokens in GPT-2's byte alphabet, two merges, then the special tokens; with llama.cpp's token
    types (1 normal, 3 control, 4 user-defined)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES] + SPECIAL + USER_DEFINED
    types = [1] * (256 + len(MERGES)) + [3] * len(SPECIAL) + [4] * len(USER_DEFINED)
    return tokens, types


def reference_model(arch: str, seed: int = 0):
    """A tiny random transformers model of `arch` (qwen2 untied with attention biases, llama tied), every weight
    drawn at random so that a swapped or offset tensor shows in the comparison."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokens, _ = vocabulary()
    common = dict(vocab_size=len(tokens), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  bos_token_id=tokens.index("<|endoftext|>"), eos_token_id=tokens.index("<|im_end|>"),
                  pad_token_id=tokens.index("<|endoftext|>"))
    if arch == "qwen2":
        config = Qwen2Config(tie_word_embeddings=False, rope_theta=1e6, **common)
    else:
        config = LlamaConfig(tie_word_embeddings=True, head_dim=8, rope_theta=1e4, **common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama's q/k rows (rotary halves to interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, chat_template: str | None = QWEN25) -> Path:
    """`model` as llama.cpp would write it: GGUF names, F32 tensors, q/k permuted for llama, and the tokenizer."""
    import gguf

    config, arch = model.config, model.config.model_type
    tokens, types = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(config.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    w.add_pad_token_id(config.pad_token_id)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, tensor in gguf_tensors(model).items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_tensors(model) -> dict[str, np.ndarray]:
    config, out = model.config, {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().copy()
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        for hf, gg in HF_TO_GGUF.items():
            name = name.replace(hf, gg)
        out[name] = array
    return out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The GGUFs converted (not read from the cache) while a test runs."""
    done, convert = [], models.convert_gguf

    def counted(gguf_path, target, **kwargs):
        done.append(Path(gguf_path))
        return convert(gguf_path, target, **kwargs)

    monkeypatch.setattr(models, "convert_gguf", counted)
    return done


# ----------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_gguf_loads_as_a_trainable_model_with_exactly_its_weights(tmp_path, arch, conversions):
    reference = reference_model(arch)
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", reference)
    model, tok = load_model(str(path))
    assert conversions == [path]
    assert type(model) is type(reference) and model.config.tie_word_embeddings == reference.config.tie_word_embeddings
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    ids = torch.tensor([tok.encode("<|im_start|>user\nthe hat<|im_end|>\n", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # Plain and trainable: no quantization left, every parameter learns, and it saves like any checkpoint.
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.save_pretrained(tmp_path / "saved")

    # The tokenizer is the file's: byte-level BPE with its merges, special tokens whole, and its chat template.
    assert tok.convert_ids_to_tokens(tok.encode(" the", add_special_tokens=False)) == ["Ġt", "he"]
    assert tok.encode("<|im_end|><tool_call>", add_special_tokens=False) == [
        vocabulary()[0].index("<|im_end|>"), vocabulary()[0].index("<tool_call>")]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.chat_template == QWEN25


def test_the_second_load_reads_the_cache_and_a_replaced_file_is_converted_again(tmp_path, cache, conversions,
                                                                                   monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", reference_model("qwen2", seed=1))
    first, _ = load_model(str(path))
    copies = sorted((cache / "gguf").iterdir())
    assert [c.name[:2] for c in copies] == ["m-"] and conversions == [path]
    source = json.loads((copies[0] / "agentrl_source.json").read_text())
    assert source == {"path": str(path.resolve()), "size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}

    again, _ = load_model(str(path))  # keyed by the file's identity, not by how its path is spelled
    monkeypatch.chdir(tmp_path)
    also, _ = load_model("./m.gguf")
    assert conversions == [path]
    for model in (again, also):
        assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), model.state_dict().values()))

    # The same path, new content: converted again, and the stale copy removed.
    replaced = reference_model("qwen2", seed=2)
    write_gguf(path, replaced)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    model, _ = load_model(str(path))
    assert len(conversions) == 2 and len(list((cache / "gguf").iterdir())) == 1
    assert torch.equal(model.model.embed_tokens.weight, replaced.model.embed_tokens.weight)


def test_the_tokenizer_is_the_files_whatever_transformers_kept(tmp_path):
    """transformers 5.17 converts a GGUF's tokenizer with only three of its added tokens and `<|endoftext|>` as the
    end token; the conversion restores the file's: `<tool_call>` one token at its id, `<|im_end|>` the end. The
    tokenizer 5.17 gives is rebuilt here from the full one, its other added tokens and end token dropped."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = write_gguf(tmp_path / "m.gguf", reference_model("qwen2"))
    full = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    spec = json.loads(full.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIAL]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>")
    tokens = vocabulary()[0]
    assert tok.encode("<tool_call>", add_special_tokens=False) != [tokens.index("<tool_call>")]  # split in pieces
    models._register_gguf_added_tokens(tok, path)
    assert tok.encode("<|im_end|><tool_call>x</tool_call>", add_special_tokens=False) == [
        tokens.index("<|im_end|>"), tokens.index("<tool_call>"), tokens.index("x"), tokens.index("</tool_call>")]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and len(tok) == len(tokens)


def test_a_copy_from_an_older_conversion_is_converted_again(tmp_path, cache, conversions):
    path = write_gguf(tmp_path / "m.gguf", reference_model("qwen2"))
    load_model(str(path))
    (copy,) = (cache / "gguf").iterdir()
    (copy / "agentrl_conversion.json").unlink()  # as a copy made before the conversion had a version
    model, tok = load_model(str(path))
    assert conversions == [path, path]
    assert [c.name for c in (cache / "gguf").iterdir()] == [copy.name]  # replaced in place, nothing left beside
    assert json.loads((copy / "agentrl_conversion.json").read_text()) == {"conversion": models._CONVERSION}
    load_model(str(path))
    assert conversions == [path, path]


def test_an_interrupted_conversion_leaves_no_checkpoint_behind(tmp_path, cache, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    path = write_gguf(tmp_path / "m.gguf", reference_model("llama"))
    save = PreTrainedTokenizerBase.save_pretrained

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt  # after the weights were written, before the tokenizer

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(path))
    assert list((cache / "gguf").iterdir()) == []  # neither a target nor the temporary directory
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save)
    model, tok = load_model(str(path))
    assert tok.chat_template == QWEN25 and len(list((cache / "gguf").iterdir())) == 1


def test_a_directory_holding_one_gguf_is_that_model(tmp_path, conversions):
    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / "README.md").write_text("a model card")
    path = write_gguf(folder / "tiny.gguf", reference_model("qwen2"))
    by_dir, _ = load_model(str(folder))
    by_file, _ = load_model(str(path))
    assert conversions == [path]  # one file, one copy, however it is named
    assert all(torch.equal(a, b) for a, b in zip(by_dir.state_dict().values(), by_file.state_dict().values()))


def test_the_chat_format_of_a_gguf_model_is_its_own_template(tmp_path):
    model, tok = load_model(str(write_gguf(tmp_path / "m.gguf", reference_model("qwen2"))))
    fmt = ChatFormat(tok, [{"type": "function", "function": {"name": "search", "parameters": {}}}])
    assert fmt.template_name == "tokenizer" and fmt.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")
    prompt = [{"role": "user", "content": "the hat?"}]
    generated = fmt.encode('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    tool = [{"role": "tool", "name": "search", "content": "the hat"}]
    ids = fmt.prompt_ids(prompt) + generated + fmt.suffix_ids(tool, generated)
    messages = prompt + [{"role": "assistant", "content": fmt.decode(generated)}] + tool
    assert ids == fmt.encode(fmt.render(messages, add_generation_prompt=True))


# ----------------------------------------------------------------------------------------- names that give no model


def not_found(name: str) -> str:
    with pytest.raises(ModelNotFound) as caught:
        check_model_name(name)
    with pytest.raises(ModelNotFound) as loading:
        load_model(name)
    assert str(caught.value) == str(loading.value)
    return str(caught.value)


def test_names_that_give_no_model_fail_in_one_line(tmp_path):
    choices = "pass a local directory, a .gguf file or one of: smollm2-135m-instruct, tiny-qwen3, tiny-qwen3.5"
    assert not_found(str(tmp_path / "no.gguf")) == f"no such file: {tmp_path / 'no.gguf'}; {choices}"
    two = tmp_path / "two"
    two.mkdir()
    for name in ("b-q8_0.gguf", "a-q4_k_m.gguf"):
        (two / name).write_bytes(b"GGUF")
    assert not_found(str(two)) == f"{two} holds 2 .gguf files (a-q4_k_m.gguf, b-q8_0.gguf); pass the path of the one " \
                                  f"to load"
    (tmp_path / "fake.gguf").write_text("not a gguf")
    assert not_found(str(tmp_path / "fake.gguf")) == f"{tmp_path / 'fake.gguf'} is not a GGUF file (it does not " \
                                                     f"start with GGUF)"
    # A directory with a config.json is a transformers checkpoint, whatever .gguf files lie beside it.
    (two / "config.json").write_text("{}")
    assert models.find_gguf(str(two)) is None
    check_model_name(str(two))


def test_the_check_passes_local_models_and_hub_ids_without_torch(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", reference_model("llama"))
    code = ("import sys; from agentrl.models import check_model_name\n"
            "for name in sys.argv[1:]: check_model_name(name)\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    names = [str(path), str(tmp_path), "tiny-qwen3", "Qwen/Qwen2.5-0.5B-Instruct"]
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", ["eval", "train"])
def test_the_command_line_refuses_a_missing_gguf_before_torch(tmp_path, command):
    code = ("import sys; from agentrl.cli import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)")
    argv = [command, "gsm8k_math", "--model", str(tmp_path / "model.gguf")]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"agentrl {command}: model.name: no such file: {tmp_path / 'model.gguf'}; pass "
                                        f"a local directory, a .gguf file or one of: smollm2-135m-instruct, tiny-qwen3, "
                                        f"tiny-qwen3.5"]
