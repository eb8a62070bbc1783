"""How many packed rows one forward/backward takes when `trainer.rows_per_micro_batch` is left unset.

A small model's training step is bound by the host: each micro-batch launches every layer's forward and backward
(compiled regions whose wrappers cost far more host time than their kernels take on the GPU), so a step of four
8k-token rows run one at a time takes about twice as long as the same rows run together (BENCHMARKS.md, the
overlap and vs TRL tables). A large model's step is bound by the GPU, and its activations are what limit a micro-batch.
So the default takes as many rows as an estimate of their saved activations fits in `ACTIVATION_BUDGET` (and in a
quarter of the GPU's memory). The estimate counts what a decoder layer keeps for its backward, as measured by
`benchmarks/saved_activations.py` (BENCHMARKS.md, "saved activations"): compiled layers (the GPU default for dense
models) keep less than eager ones. On an H200: four 8k-token rows of SmolLM2-135M with compiled layers (two eager),
one of Qwen3-0.6B (whose one-row step already holds most of the issue's 20 GiB budget: BENCHMARKS.md, the train step
with defaults).
"""

from __future__ import annotations

import torch

from agentrl.models import decoder_layers

ACTIVATION_BUDGET = 16 * 2**30  # bytes of saved activations one micro-batch may hold


def activation_bytes_per_token(config, dtype: torch.dtype, compiled: bool = False, head_norms: bool = False) -> int:
    """An estimate of what the backward keeps per token, from the model's config, in `dtype` elements per decoder layer,
    counted from what `benchmarks/saved_activations.py` lists a layer keeping (BENCHMARKS.md, "saved activations"):

    - compiled layers (`compiled`): the MLP's gate, up and activation (3 x intermediate); four hidden-wide tensors
      (the layer's input, both norms' outputs, the attention's output); the rotated queries and the attention output
      by head (2 x q width), keys and values (2 x kv width); with per-head q/k norms (`head_norms`, Qwen3) their
      inputs too; the rotary tables (2 x head_dim).
    - eager layers: the MLP's product as well (4 x intermediate), and both norms' inputs again as fp32 (2 x 2 x
      hidden in 16-bit elements); with per-head norms, their fp32 inputs and normed outputs (3 x (q + kv) width).

    A hybrid model's linear-attention layers are counted as attention layers: a rough figure, not measured."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    heads = getattr(text, "num_attention_heads", None) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    per_layer = 4 * hidden + 2 * q_width + 2 * kv_width + 2 * head_dim
    if compiled:
        per_layer += 3 * inter + ((q_width + kv_width) if head_norms else 0)
    else:
        per_layer += 4 * inter + 4 * hidden + (3 * (q_width + kv_width) if head_norms else 0)
    return per_layer * layers * torch.empty((), dtype=dtype).element_size()


def has_head_norms(model: torch.nn.Module) -> bool:
    """Whether the attention normalizes queries and keys per head (Qwen3's `q_norm` / `k_norm`)."""
    return any(name.endswith(".q_norm") for name, _ in model.named_modules())


def layers_compiled(model: torch.nn.Module) -> bool:
    """Whether the decoder layers were `torch.compile`d in place (`Module.compile`, as the trainer compiles them)."""
    layers = decoder_layers(model)
    return bool(layers) and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)


def default_rows_per_micro_batch(model: torch.nn.Module, row_tokens: int) -> int:
    """Rows a micro-batch: within `ACTIVATION_BUDGET`, and on a GPU within a quarter of its memory too (the engine's
    KV pool, the weights and the optimizer's state share the rest), so a small card keeps one row."""
    param = next(model.parameters())
    budget = ACTIVATION_BUDGET
    if param.device.type == "cuda":
        budget = min(budget, torch.cuda.get_device_properties(param.device).total_memory // 4)
    per_token = activation_bytes_per_token(model.config, param.dtype, compiled=layers_compiled(model),
                                           head_norms=has_head_norms(model))
    return rows_within(budget, per_token, row_tokens)


def rows_within(budget: int, bytes_per_token: int, row_tokens: int) -> int:
    return max(1, budget // (bytes_per_token * row_tokens))
