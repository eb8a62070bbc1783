"""What one decoder layer's backward keeps per token, eager and compiled, against `train/micro_batch.py`'s estimate.

The trainer's default micro-batch (`default_rows_per_micro_batch`) takes as many packed rows as an estimate of their
saved activations fits in a budget. This measures the real figure: one decoder layer of each model shape (random
bf16 weights, built from its config, no files) runs a forward over `--tokens` tokens under a saved-tensors hook that
records every tensor autograd keeps (parameters aside, each storage once), eagerly and compiled the way the trainer
compiles its layers on GPU (`torch.compile(dynamic=True)`). Attention is SDPA, which keeps what flash attention's
varlen kernel keeps (q, k, v, the output and the log-sum-exp). Runs on the CPU; the figures are the same on any device.

    python benchmarks/saved_activations.py [--tokens 1024] [--shapes smollm2,qwen3-0.6b,qwen2.5-1.5b] [--list]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

SHAPES = {
    "smollm2": ("llama", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                              head_dim=64, num_hidden_layers=30)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, num_hidden_layers=28)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                   num_key_value_heads=2, num_hidden_layers=28)),
}


def saved_bytes(layer, rotary, hidden: int, tokens: int, params: set[int], listing: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `layer` over `tokens` tokens."""
    import torch

    seen: dict[int, tuple] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(tokens)[None]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=rotary(x, pos), attention_mask=None, position_ids=pos)
    if listing:
        for shape, dtype, n in sorted(seen.values(), key=lambda v: -v[2]):
            print(f"    {shape} {dtype} {n / tokens:.0f} B/token")
    return sum(n for _, _, n in seen.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--list", action="store_true", help="print every saved tensor")
    args = ap.parse_args()
    import torch
    import transformers

    from agentrl.train.micro_batch import activation_bytes_per_token, has_head_norms

    torch.manual_seed(0)
    print("| shape | eager B/token/layer | compiled B/token/layer | estimate, eager | estimate, compiled |")
    print("|---|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        model_type, dims = SHAPES[name]
        config = transformers.AutoConfig.for_model(model_type, vocab_size=1000, **dims)  # the whole model's, for the
        one = transformers.AutoConfig.for_model(model_type, vocab_size=1000, **{**dims, "num_hidden_layers": 1})
        model = transformers.AutoModel.from_config(one).to(torch.bfloat16)  # estimate; one layer is measured
        model.set_attn_implementation("sdpa")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        layer = model.layers[0]
        measured = []
        for compiled in (False, True):
            if compiled:
                layer.compile(dynamic=True)
            if args.list:
                print(f"  {name}, {'compiled' if compiled else 'eager'}:")
            measured.append(saved_bytes(layer, model.rotary_emb, config.hidden_size, args.tokens, params, args.list)
                            / args.tokens)
        per_layer = [activation_bytes_per_token(config, torch.bfloat16, compiled=c, head_norms=has_head_norms(model))
                     / config.num_hidden_layers for c in (False, True)]
        print(f"| {name} | {measured[0]:,.0f} | {measured[1]:,.0f} | {per_layer[0]:,.0f} | {per_layer[1]:,.0f} |")


if __name__ == "__main__":
    main()
