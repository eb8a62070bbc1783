"""Which layer of a hybrid model makes a packed row differ from its samples run alone, in fp32.

The GPU test `test_packed_logprobs_equal_per_sample_in_fp32` asks the packed hidden states (fla's varlen kernels,
the packed conv) to equal the per-sample ones within 1e-5; on the H200 they differed by 3.3e-4 (BENCHMARKS.md,
hybrid). This prints, layer by layer, the largest |packed - alone| of each token mixer's output and of each
layer's output, and the scale of the outputs, on the test's own lengths: the first mixer whose output differs while
its layer's input still agrees is the culprit. `--tf32` runs Triton's fp32 dots as tf32 (the first compile in a
process decides, so `--both` re-runs the script), to tell an fp32 precision loss in a kernel from a boundary leak.
Without it every fp32 dot is IEEE, fla's fused solve included (`linear_varlen.ieee_fp32_kernels`).
`--initializer-range` rebuilds the tiny model at another range than its 1.0.

Found on 2026-12-02 (BENCHMARKS.md, history): the first linear layer's output already differs by 1.0e-2 at a scale
of 260, the size of fp32's own error against fp64 there (6.6e-3, CPU): the tiny default is ill-conditioned, and the
GPU test compares a well-conditioned tiny model now (initializer range 0.02).

    python benchmarks/hybrid_packing_layers.py [--model tiny-qwen3.5] [--device cuda] [--both] [--initializer-range R]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

LENGTHS = (150, 70, 9, 33, 64, 2)  # tests/train/test_hybrid_gpu.py


def compare(model_name: str, device: str, initializer_range: float | None = None) -> None:
    import torch

    from agentrl.models import load_model
    from agentrl.run import build
    from agentrl.train import logprobs
    from agentrl.train.config import ModelConfig

    torch.backends.cudnn.allow_tf32 = False
    if initializer_range is None:
        model, _ = load_model(model_name, dtype=torch.float32, device=device)
    else:
        from agentrl.models import tiny_model

        model = tiny_model(model_name, initializer_range=initializer_range)[0].to(device)
    model.set_attn_implementation(build.attention_implementation(ModelConfig(name=model_name), model, device))
    decoder = logprobs._decoder(model)
    batch = logprobs._synthetic_row(model, LENGTHS, 0)
    seen: dict[str, list] = {}

    def hook(name):
        def record(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            seen.setdefault(name, []).append(out.detach().float())
        return record

    handles = []
    for i, layer in enumerate(decoder.layers):
        handles.append(layer.register_forward_hook(hook(f"{i} layer")))
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
        kind = "linear" if hasattr(layer, "linear_attn") and layer.linear_attn is not None else "attention"
        handles.append(mixer.register_forward_hook(hook(f"{i} {kind}")))
    with torch.no_grad():
        logprobs._varlen_hidden_states(decoder, batch)
        logprobs._per_sample_hidden_states(decoder, batch)
    for h in handles:
        h.remove()
    print(f"{model_name} (initializer range {model.config.initializer_range}) on {device}, fp32, lengths {LENGTHS}, "
          f"attention {model.config._attn_implementation}, "
          f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT', '(unset)')}")
    print(f"{'output of':<14} {'max |packed - alone|':>22} {'max |alone|':>12} {'worst sample (length)':>22}")
    for name, (packed, alone) in seen.items():
        packed = packed.reshape(-1, packed.shape[-1])
        worst, where, scale = 0.0, None, 0.0
        for j, (_, start, n) in enumerate(batch.segments[0]):
            a = alone[j, :n]
            d = float((packed[start:start + n] - a).abs().max())
            scale = max(scale, float(a.abs().max()))
            if d > worst:
                worst, where = d, n
        print(f"{name:<14} {worst:>22.3e} {scale:>12.3g} {str(where):>22}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen3.5")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tf32", action="store_true", help="Triton's fp32 dots as tf32 (TRITON_F32_DEFAULT)")
    ap.add_argument("--both", action="store_true", help="run with IEEE and with tf32 dots, one process each")
    ap.add_argument("--initializer-range", type=float, help="rebuild the tiny model at this initializer range")
    args = ap.parse_args()
    if args.both:
        for precision in ("ieee", "tf32"):
            env = {**os.environ, "TRITON_F32_DEFAULT": precision}
            extra = [] if args.initializer_range is None else ["--initializer-range", str(args.initializer_range)]
            subprocess.run([sys.executable, __file__, "--model", args.model, "--device", args.device, *extra], env=env,
                           check=False)
        return
    if args.tf32:
        os.environ["TRITON_F32_DEFAULT"] = "tf32"
    elif os.environ.setdefault("TRITON_F32_DEFAULT", "ieee") == "ieee":
        from agentrl.engine.linear_varlen import ieee_fp32_kernels

        print(f"fla's fused solve in IEEE fp32 too: {ieee_fp32_kernels()}")
    compare(args.model, args.device, args.initializer_range)


if __name__ == "__main__":
    main()
