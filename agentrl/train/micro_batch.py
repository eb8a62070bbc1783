"""How many packed rows one forward/backward takes when `trainer.rows_per_micro_batch` is left unset.

A small model's training step is bound by the host: each micro-batch launches every layer's forward and backward
(compiled regions whose wrappers cost far more host time than their kernels take on the GPU), so a step of four
8k-token rows run one at a time takes about twice as long as the same rows run together (BENCHMARKS.md, the
overlap and vs TRL tables). A large model's step is bound by the GPU, and its activations are what limit a micro-batch.
So the default takes as many rows as an estimate of their saved activations fits in `ACTIVATION_BUDGET` (and in a
quarter of the GPU's memory): three 8k-token rows of SmolLM2-135M on an H200, one of Qwen3-0.6B (whose one-row step
already holds most of the issue's 20 GiB budget: BENCHMARKS.md, the train step with defaults).
"""

from __future__ import annotations

import torch

ACTIVATION_BUDGET = 16 * 2**30  # bytes of saved activations one micro-batch may hold


def activation_bytes_per_token(config, dtype: torch.dtype) -> int:
    """An estimate of what the backward keeps per token, from the model's config: per decoder layer the
    residual stream and norms (6 x hidden), the MLP's gate, up and activation (3 x intermediate), and attention's
    q, k, v and output. A rough estimate from the config alone: it knows nothing of what a compiled layer recomputes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    heads = getattr(text, "num_attention_heads", None) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    per_layer = 6 * hidden + 3 * inter + (2 * heads + 2 * kv_heads) * head_dim
    return per_layer * layers * torch.empty((), dtype=dtype).element_size()


def default_rows_per_micro_batch(model: torch.nn.Module, row_tokens: int) -> int:
    """Rows a micro-batch: within `ACTIVATION_BUDGET`, and on a GPU within a quarter of its memory too (the engine's
    KV pool, the weights and the optimizer's state share the rest), so a small card keeps one row."""
    param = next(model.parameters())
    budget = ACTIVATION_BUDGET
    if param.device.type == "cuda":
        budget = min(budget, torch.cuda.get_device_properties(param.device).total_memory // 4)
    return rows_within(budget, activation_bytes_per_token(model.config, param.dtype), row_tokens)


def rows_within(budget: int, bytes_per_token: int, row_tokens: int) -> int:
    return max(1, budget // (bytes_per_token * row_tokens))
