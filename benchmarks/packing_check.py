"""The packed-vs-alone check a hybrid run makes before its first step (`logprobs.packing_error`), on this host's
kernels: tiny Qwen3.5 (fp32 and bf16, the tiny models' initializer range and transformers' 0.02) and the
Qwen3.5-0.8B-shaped model in bf16; absolute and relative to the states' scale (the run falls back to per-sample
rows above 0.1 relative). On CUDA with flash-linear-attention the packed rows go through its varlen kernels.

    python benchmarks/packing_check.py [--device cuda] [--skip-large]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

import torch  # noqa: E402


def check(name: str, model, lengths=(7, 5, 3)) -> None:
    from agentrl.run import build
    from agentrl.train.config import ModelConfig
    from agentrl.train.linear_conv import install_wrappers
    from agentrl.train.logprobs import packing_error

    device = next(model.parameters()).device
    model.set_attn_implementation(build.attention_implementation(ModelConfig(name="tiny-qwen3.5"), model,
                                                                 device.type))
    install_wrappers(model)
    for lens in (lengths, (150, 70, 9, 33, 64, 2)):
        absolute = packing_error(model, lengths=lens, hybrid_varlen=True)
        relative = packing_error(model, lengths=lens, hybrid_varlen=True, relative=True)
        print(f"{name:<44} lengths {str(lens):<26} absolute {absolute:.3e}  relative {relative:.3e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    from agentrl.models import tiny_model

    try:
        import triton
        print(f"triton {triton.__version__}, torch {torch.__version__}, device {args.device}")
    except ImportError:
        pass
    for dtype in (torch.float32, torch.bfloat16):
        for init in (None, 0.02):
            kwargs = {} if init is None else {"initializer_range": init}
            model, _ = tiny_model("tiny-qwen3.5", 0, **kwargs)
            model = model.to(device=args.device, dtype=dtype)
            check(f"tiny-qwen3.5 {str(dtype)[6:]} init {init or 'default'}", model)
    if not args.skip_large and args.device == "cuda":
        from benchmarks.hybrid import build_model

        check("qwen3.5-0.8b-shaped bfloat16", build_model(False))


if __name__ == "__main__":
    main()
