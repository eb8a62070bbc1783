"""Train-step MFU and peak memory on the GPU: agentrl's packed step vs the HF full-logits baseline, one run.

Both paths see the same packed rows (~25k real tokens, samples of 200-2000 tokens, position ids restarting per
sample) on a bf16 model of Qwen3-0.6B's shape (`--model-shape smollm2`: SmolLM2-135M's, the embedded default's
Llama config), random weights:
- agentrl: the decoder's hidden states → chunked lm_head over trainable tokens only (bf16 GEMMs, fp32
  accumulation, no full-vocab logits) → GRPO loss → backward; attention is flex_attention's block mask over the
  padded rows, or (`+varlen`) flash varlen attention over the real tokens laid end to end (no padding computed);
- baseline: the HF forward producing full logits, cast to fp32 → log_softmax → gather → same loss → backward,
  flex_attention, gradient checkpointing.

When a variant uses varlen attention, the run first prints the largest |logprob| difference between the varlen
and flex paths on the batch (no gradients), a correctness check riding in the same GPU run.

`--shape hotpotqa` makes rollout groups instead: 8 members sharing a 1.1k-token prompt, ~1.5k tokens each (a
tool result untrained in every member's part), the shape of hotpotqa_search. `+share` packs them prefix-shared
(`agentrl.train.prefix_pack`: each group's prompt computed once); tok/s counts the samples' tokens either way, so
`nockpt+varlen@1` vs `nockpt+varlen+share@1` is the step time before and after prefix sharing, and MFU counts
the FLOPs actually computed.

`--shape gsm8k` makes the batch of an RL step of gsm8k_math: groups of 8 completions (16-128 tokens, all trained)
sharing a 320-token prompt (gsm8k_math's prompt under SmolLM2's template is 313-328 tokens).

`default` is the trainer exactly as `agentrl train` builds it with default options on this device, through
agentrl's own resolvers (`agentrl.run.build`: attention implementation, compiled layers, CUDA graphs for the
flat forward and backward; the trainer's defaults
for rows per micro-batch, prefix sharing, row width, padding and lm_head chunks), on the model in the dtype
model.dtype=auto gives (bf16 on GPU, as every variant here). Its step is
`Trainer.step`, so unlike the other variants it includes the optimizer step, and its peak memory AdamW's state; it
packs with the trainer's own `row_tokens`, not `--row-tokens`. A line after the table names what it resolved to,
and any frame compiled during the timed steps (there should be none) is reported with the row. `default-eager` is
the same with `trainer.cuda_graphs=false`, `default-nocompile` with `model.compile_layers=false`, and
`default+key=value[+...]` with any run options on top; with the default two warm-up steps, `default`'s timed
steps are replays.

MFU counts the FLOPs the step must compute: 6 x non-embedding params per token, 6 x vocab x hidden per trained
target only (the chunked head computes no other position; until 2026-12-02 it was counted at every token), and causal
attention (12 x layers x q_dim x mean context), over 790 TFLOP/s (the H200's measured bf16 dense peak,
docs/anchors.md).

Without CUDA the same code runs on the CPU in float32 (sdpa where the GPU runs flex_attention; flash varlen
variants report an error row): a smoke run that catches a broken variant before GPU time is spent, e.g.
`--model-shape smollm2 --tokens 2000 --steps 1 --warmup 1 --skip-hf --variants default,nockpt@1`. Its figures mean
nothing (MFU is against the H200's peak).

usage: python benchmarks/train_step.py [--tokens 25000] [--steps 3] [--warmup 2] [--variants default,ckpt,...]
                                     [--profile] [--shape random|hotpotqa|gsm8k] [--model-shape qwen3-0.6b|smollm2]
       variants: default | default-eager | default-nocompile | default+key=value[+key=value...]
                 | ckpt|nockpt[+compile[+mem<fraction>]][+varlen][+share][@rows per micro-batch]
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks` and `agentrl`

PEAK_FLOPS = 790e12

# SmolLM2-135M-Instruct as the embedded GGUF converts to (transformers' LlamaConfig; tests/train/test_compile_default
# checks these against it where the GGUF is installed).
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def shaped_model(shape: str, on: str):
    """Random weights of `shape`, in the dtype `agentrl train` picks on `on` (model.dtype=auto: bf16 on GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from benchmarks.engine import QWEN3_06B

    torch.manual_seed(0)
    if shape == "smollm2":
        config, cls = LlamaConfig(**SMOLLM2_135M, bos_token_id=1, eos_token_id=2, pad_token_id=2), LlamaForCausalLM
    else:
        config, cls = Qwen3Config(**QWEN3_06B, eos_token_id=151645, pad_token_id=151643), Qwen3ForCausalLM
    dtype = torch.bfloat16 if on == "cuda" else torch.float32
    with torch.device(on):
        return cls(config).to(dtype)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_samples(total_tokens: int, vocab: int, seed: int = 0):
    from agentrl.sample import TrainingSample

    rng = random.Random(seed)
    samples, used = [], 0
    while used < total_tokens:
        n = min(rng.randint(200, 2000), total_tokens - used)
        if n < 16:
            break
        prompt = max(1, n // 3)
        ids = [rng.randrange(vocab) for _ in range(n)]
        trainable = [0] * prompt + [1] * (n - prompt)
        samples.append(TrainingSample(ids, trainable, [-1.0 if t else 0.0 for t in trainable],
                                   [0 if t else -1 for t in trainable], advantage=rng.choice([-1.0, 1.0])))
        used += n
    return samples


def make_group_samples(total_tokens: int, vocab: int, seed: int = 0, members: int = 8, prompt_tokens: int = 1100,
                       sample_tokens: int = 1500):
    """hotpotqa_search-shaped groups: `members` rollouts of one prompt, each ~`sample_tokens` long: the prompt,
    a generated turn, an untrained tool result, a generated answer."""
    from agentrl.sample import TrainingSample

    rng = random.Random(seed)
    samples, used, group = [], 0, 0
    while used + members * sample_tokens <= total_tokens or not samples:
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for _ in range(members):
            n = rng.randint(sample_tokens - 200, sample_tokens + 200) - prompt_tokens
            tool = n // 3
            tail = [rng.randrange(vocab) for _ in range(n)]
            trainable = [0] * prompt_tokens + [1] * tool + [0] * tool + [1] * (n - 2 * tool)
            samples.append(TrainingSample(prompt + tail, trainable, [-1.0 if t else 0.0 for t in trainable],
                                          [0 if t else -1 for t in trainable], advantage=rng.choice([-1.0, 1.0]),
                                          group_id=group))
            used += prompt_tokens + n
        group += 1
    return samples


def make_gsm8k_samples(total_tokens: int, vocab: int, seed: int = 0, members: int = 8, prompt_tokens: int = 320,
                       completion: tuple[int, int] = (16, 128)):
    """gsm8k_math-shaped groups: `members` completions of one prompt, each generated in one turn and trained."""
    from agentrl.sample import TrainingSample

    rng = random.Random(seed)
    samples, used, group = [], 0, 0
    while used < total_tokens or not samples:
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for _ in range(members):
            n = rng.randint(*completion)
            trainable = [0] * prompt_tokens + [1] * n
            samples.append(TrainingSample(prompt + [rng.randrange(vocab) for _ in range(n)], trainable,
                                          [-1.0 if t else 0.0 for t in trainable], [0 if t else -1 for t in trainable],
                                          advantage=rng.choice([-1.0, 1.0]), group_id=group))
            used += prompt_tokens + n
        group += 1
    return samples


def flops_per_step(model, batch) -> float:
    """The FLOPs the step has to compute: 6 x the decoder's non-embedding parameters per computed token, the
    vocabulary projection (6 x vocab x hidden) only at the positions the loss reads (the chunked head computes no
    others: a third of the random shape's positions are untrained prompt), and causal attention. Until 2026-12-02
    the head was counted at every token, which credited the step with FLOPs it never ran (BENCHMARKS.md, history)."""
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters()
                 if "embed_tokens" not in n and "lm_head" not in n)
    head = 6 * c.vocab_size * c.hidden_size * head_positions(batch)
    if hasattr(batch, "units"):  # prefix-shared: the prefix once, each suffix attending to it and to itself
        pairs = sum(u.prefix_len ** 2 / 2 + sum(u.prefix_len * n + n * n / 2 for n in u.suffix_lens)
                    for row in batch.units for u in row)
    else:
        pairs = sum(n * n / 2 for row in batch.segments for _, _, n in row)
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs
    return 6 * params * batch.num_tokens + head + attention


def head_positions(batch) -> int:
    """Positions whose logits the trainer computes: each trained target once (a prefix-shared batch computes a shared
    position's logits once for all the members that train on it)."""
    if hasattr(batch, "head_index"):
        return int(batch.head_index.numel())
    return int(batch.loss_mask.sum())


def pad_multiple() -> int:
    """The trainer's row_pad_multiple, which also rounds the flat layout's length."""
    from agentrl.train.config import TrainerConfig

    return TrainerConfig().row_pad_multiple


def step_agentrl(model, batch, cfg, rows_per_micro_batch=None, host_batch=None):
    """The trainer's step without its optimizer update: micro-batches of `rows_per_micro_batch` rows (all rows at
    once if None) built from the host batch and copied without blocking, gradients accumulated, the loss
    normalised over the whole batch, metrics brought to the host once after the last backward."""
    from agentrl.train.logprobs import packed_token_logprobs
    from agentrl.train.loss import loss_denominator, policy_loss
    from agentrl.train.prefix_forward import shared_token_logprobs

    host_batch = host_batch if host_batch is not None else batch
    n_rows = host_batch.shape[0]
    per = rows_per_micro_batch or n_rows
    denominator = float(loss_denominator(host_batch.trainable_tokens(), cfg, 0))
    loss_sum, pending = 0.0, []
    for first in range(0, n_rows, per):
        host_micro = host_batch.select_rows(first, min(first + per, n_rows))
        micro, tokens = host_micro.to(device()), host_micro.trainable_tokens().to(device())
        forward = shared_token_logprobs if hasattr(micro, "units") else packed_token_logprobs
        logprobs, entropy = forward(model, micro, chunk_size=1024, pad_multiple=pad_multiple())
        loss, metrics = policy_loss(logprobs, tokens, cfg, current_version=0, entropy=entropy,
                                    denominator=denominator, defer_metrics=True)
        loss.backward()
        loss_sum = loss_sum + loss.detach()
        pending.append(metrics)
    [m.resolve() for m in pending]
    return float(loss_sum)


def step_full_logits(model, batch, cfg):
    from agentrl.train.loss import policy_loss

    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    mask = batch.loss_mask
    token_logprobs = logprobs[mask].gather(-1, batch.target_ids[mask][:, None])[:, 0]
    loss, _ = policy_loss(token_logprobs, batch.trainable_tokens(), cfg, current_version=0)
    loss.backward()
    return loss


def measure(name, fn, model, batch, cfg, steps, profile=False, trained_tokens=None, warmup=2, trace=None,
            sync_debug=False):
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    frames = torch._dynamo.utils.counters["frames"]
    try:
        for _ in range(warmup):  # compilation of the layers, flex_attention and the chunked head
            fn(model, batch, cfg)
            model.zero_grad(set_to_none=True)
        synchronize()
        if torch.cuda.is_available():
            # The warm-up's free cached blocks go back (the graphs' pools stay: their graphs own them), so the peak
            # reserved below is what the steady step holds: its live tensors, what it caches, the graphs' pools.
            # Captures no longer empty the cache themselves (graph_capture.record_graph), and the caching allocator
            # frees such blocks on its own before it would fail an allocation.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        compiled_before = frames["total"]
        # As `agentrl train` does after its first step (build.freeze_start_objects): what the start made (the model,
        # the compiled code) leaves the collector's generations, so a collection during a timed step walks only what
        # the steps made.
        gc.collect()
        gc.freeze()
        # Each step timed on its own and the median reported: one step slowed by something outside the trainer (a
        # collection, the host) moved a mean of five by a fifth between identical rows of one process.
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            fn(model, batch, cfg)
            model.zero_grad(set_to_none=True)
            synchronize()
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times)
        compiled = frames["total"] - compiled_before
        if sync_debug:
            from benchmarks.kernel_profile import print_host_syncs

            print_host_syncs(name, lambda: fn(model, batch, cfg))
            model.zero_grad(set_to_none=True)
        if profile:
            from benchmarks.kernel_profile import print_profile

            print_profile(name, lambda: fn(model, batch, cfg), model,
                          trace=f"{trace}/{name.replace(' ', '_')}.json" if trace else None)
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return {"name": name, "error": "out of memory"}
    except Exception as exc:  # one variant failing (e.g. to compile) must not hide the rest of the table
        model.zero_grad(set_to_none=True)
        return {"name": name, "error": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        gc.unfreeze()
    # Reserved counts what allocated misses: a CUDA graph's memory pool, filled at its capture (in the warm-up).
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    flops = flops_per_step(model, batch)
    trained_tokens = trained_tokens or batch.num_tokens
    return {"name": name, "seconds": seconds, "tok_s": trained_tokens / seconds, "reserved_gib": reserved,
            "mfu": flops / seconds / PEAK_FLOPS, "peak_gib": peak, "compiled_frames": compiled, "step_seconds": times}


# The trainer as `agentrl train` builds it, with these options on top.
DEFAULT_VARIANTS = {"default": [], "default-eager": ["--trainer.cuda_graphs=false"],
                    "default-nocompile": ["--model.compile_layers=false"]}


def default_overrides(variant: str) -> list[str] | None:
    """The options a `default...` variant sets on top of the defaults, or None for another kind of variant:
    `default-eager` and the like by name, `default+key=value[+key=value...]` any run option (`key` as on the command
    line without its dashes, e.g. `default+trainer.rows_per_micro_batch=2+model.activation_memory_budget=0.6`)."""
    if variant in DEFAULT_VARIANTS:
        return DEFAULT_VARIANTS[variant]
    if not variant.startswith("default+"):
        return None
    options = variant.split("+")[1:]
    if not all("=" in o and o.split("=", 1)[0] for o in options):
        raise SystemExit(f"variant {variant!r}: expected default+key=value[+key=value...]")
    return [f"--{o}" for o in options]


def parse_variant(variant: str) -> tuple[str, int | None]:
    """`kind@rows` -> (kind, rows per micro-batch or None for all rows), checked before any GPU time is spent.
    `default...` takes everything else from the trainer's defaults, so it has no parts and no @rows; its options
    are checked by the run's own config."""
    overrides = default_overrides(variant)
    if overrides is not None:
        from agentrl.run.config import TrainConfig

        try:
            TrainConfig.from_dict({}, overrides)
        except (ValueError, TypeError, KeyError) as exc:
            raise SystemExit(f"variant {variant!r}: {exc}") from None
        return variant, None
    kind, _, micro = variant.partition("@")
    parts = kind.split("+")
    budgets = [p for p in parts[1:] if p.startswith("mem")]
    bad_budget = any(not _is_fraction(p[3:]) for p in budgets) or (budgets and "compile" not in parts)
    if (parts[0] not in ("ckpt", "nockpt") or set(parts[1:]) - {"compile", "varlen", "share", *budgets}
            or bad_budget or (micro and not micro.isdigit())):
        raise SystemExit(f"variant {variant!r}: expected default or "
                         "ckpt|nockpt[+compile[+mem<fraction>]][+varlen][+share][@rows]")
    return kind, int(micro) if micro else None


def _is_fraction(text: str) -> bool:
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def reset_model(model) -> None:
    """Eager layers, transformers' default attention (sdpa), no checkpointing, empty compile caches: every variant
    starts here, as recompile limits count per code object, which all variants (and all layers) share."""
    model.set_attn_implementation("sdpa")
    model.gradient_checkpointing_disable()
    for layer in model.model.layers:
        layer._compiled_call_impl = None
    torch._dynamo.reset()
    model.train()


def set_variant(model, variant: str):
    """`ckpt` (full activation checkpointing) or `nockpt`; `+compile` compiles every decoder layer as the trainer
    does; `+mem<f>` gives the compiled layers' forward/backward split an activation memory budget `f` (its
    partitioner then recomputes the cheapest activations in the backward instead of saving them); `+varlen` swaps
    flex_attention (sdpa on CPU, where flex has no backward) for flash varlen attention over the flat layout;
    `+share` is a packing choice (see main)."""
    from agentrl.engine.model_view import compile_decoder_layers
    from agentrl.run.build import TRAINER_COMPILE
    from agentrl.train.varlen_attention import register

    parts = variant.split("+")
    reset_model(model)
    model.set_attn_implementation(register() if "varlen" in parts else rows_attention())
    if parts[0] == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if "compile" in parts:
        budget = next((float(p[3:]) for p in parts if p.startswith("mem")), 1.0)
        compile_decoder_layers(model, activation_memory_budget=budget, **TRAINER_COMPILE)  # as `agentrl train`


def rows_attention() -> str:
    return "flex_attention" if torch.cuda.is_available() else "sdpa"


def default_trainer(model, overrides: list[str] = ()):
    """The trainer `agentrl train` builds with default options (and `overrides`) on this device, around `model`,
    and a line saying what the defaults resolved to."""
    from agentrl.run import build
    from agentrl.run.config import TrainConfig
    from agentrl.train.trainer import Trainer

    cfg = TrainConfig.from_dict({}, list(overrides))
    on = device()
    reset_model(model)
    # What load_trainable_policy does after loading (attention, checkpointing, train mode, hybrid kernels), then
    # what build_run does once the engine's view exists.
    _, _, varlen = build._trainable(cfg.model, model, None, on)
    compiled = build.compile_trainer_layers(cfg, model, on)
    trainer = Trainer(model, cfg.trainer, cfg.loss, cfg.optim, total_steps=cfg.steps,
                      temperature=cfg.rollout.temperature, hybrid_varlen=varlen,
                      pad_token_id=model.config.pad_token_id or 0, cuda_graphs=build.trainer_graphs(cfg, model, on))
    t = cfg.trainer
    line = (f"default on {on}: attention {model.config._attn_implementation}, compiled layers "
            f"{'on' if compiled else 'off'} (activation budget {cfg.model.activation_memory_budget}), "
            f"{trainer.rows_per_micro_batch} row(s) a micro-batch, rows of {t.row_tokens} padded to {trainer.pad_multiple}, "
            f"prefix sharing {'on' if trainer.share_prefix else 'off'}, lm_head chunks of {t.logprob_chunk_size}, "
            f"CUDA graphs {'on' if trainer.graphs is not None else 'off'}")
    return trainer, line


def varlen_check(model, batch) -> str:
    """Largest |logprob| difference, varlen flat layout vs flex_attention padded rows, one row per forward."""
    from agentrl.train.logprobs import packed_token_logprobs
    from agentrl.train.varlen_attention import register

    out = {}
    try:
        with torch.no_grad():
            for impl in ("flex_attention", register()):
                model.set_attn_implementation(impl)
                out[impl] = torch.cat([
                    packed_token_logprobs(model, batch.select_rows(r, r + 1), pad_multiple=pad_multiple())[0]
                    for r in range(batch.shape[0])])
    except Exception as exc:  # the table below still runs (and on CPU dry runs flash cannot)
        return f"varlen vs flex check failed: {type(exc).__name__}: {exc}"[:300]
    flex, varlen = out.values()
    diff = (varlen - flex).abs()
    return (f"varlen vs flex logprobs over {diff.numel()} trained tokens: max |diff| {float(diff.max()):.3g}, "
            f"mean {float(diff.mean()):.3g} (logprobs: mean {float(flex.mean()):.3f}, std {float(flex.std()):.3f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=25000)
    ap.add_argument("--row-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (compiles)")
    ap.add_argument("--variants", default="ckpt",
                    help="comma list of default, default-eager (trainer.cuda_graphs=false), default-nocompile "
                         "(model.compile_layers=false) or "
                         "ckpt|nockpt[+compile][+varlen][+share][@rows per micro-batch], "
                         "e.g. default,ckpt,nockpt@1,nockpt+compile@1,nockpt+compile+varlen@1")
    ap.add_argument("--profile", action="store_true", help="print the kernel table of each variant")
    ap.add_argument("--trace", help="with --profile: a folder for each variant's Chrome trace (gzipped)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="print where one step of each variant makes the host wait on the device")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--shape", choices=("random", "hotpotqa", "gsm8k"), default="random",
                    help="random: samples of 200-2000 tokens; hotpotqa: groups of 8 sharing a 1.1k-token prompt; "
                         "gsm8k: groups of 8 completions of 16-128 tokens sharing a 320-token prompt")
    ap.add_argument("--model-shape", choices=("qwen3-0.6b", "smollm2"), default="qwen3-0.6b",
                    help="the random-weight model's shape: Qwen3-0.6B, or SmolLM2-135M (agentrl's default model)")
    args = ap.parse_args()
    variants = [(v, *parse_variant(v)) for v in args.variants.split(",")]

    from agentrl.train.config import LossConfig
    from agentrl.train.pack import pack_samples
    from agentrl.train.prefix_pack import pack_shared

    on = device()
    model = shaped_model(args.model_shape, on)
    reset_model(model)
    make = {"random": make_samples, "hotpotqa": make_group_samples, "gsm8k": make_gsm8k_samples}[args.shape]
    samples = make(args.tokens, model.config.vocab_size)
    host_batch = pack_samples(samples, args.row_tokens, pad_to_multiple=pad_multiple())
    shared_batch = pack_shared(samples, args.row_tokens, pad_to_multiple=pad_multiple())
    batch = host_batch.to(on)
    cfg = LossConfig()
    rows, notes = [], []
    if not args.skip_hf:  # the baseline first, on the model before any layer is compiled
        set_variant(model, "ckpt")
        model.set_attn_implementation(rows_attention())
        rows.append(measure("HF full fp32 logits, ckpt", step_full_logits, model, batch, cfg, args.steps,
                            args.profile, warmup=args.warmup))
    check = None
    if any("varlen" in kind for _, kind, _ in variants):
        check = varlen_check(model, batch)
        print(check, flush=True)  # now as well as in the summary, in case a later variant takes the process down
    for variant, kind, micro in variants:
        if default_overrides(kind) is not None:
            trainer, line = default_trainer(model, default_overrides(kind))
            notes.append(line)
            trained = trainer.pack(samples)  # also runs the trainer's one-time sharing check, as its first step does

            def fn(model, batch, cfg, trainer=trainer):
                return trainer.step(samples, policy_version=0)

            rows.append(measure(f"agentrl {variant}", fn, model, trained, cfg, args.steps, args.profile,
                                trained_tokens=host_batch.num_tokens, warmup=args.warmup, trace=args.trace,
                                sync_debug=args.sync_debug))
            del trainer, fn  # AdamW's state
            continue
        set_variant(model, kind)
        chosen = shared_batch if "share" in kind.split("+") else host_batch
        fn = functools.partial(step_agentrl, rows_per_micro_batch=micro, host_batch=chosen)
        rows.append(measure(f"agentrl {variant}", fn, model, chosen, cfg, args.steps, args.profile,
                            trained_tokens=host_batch.num_tokens, warmup=args.warmup))
    print(f"{args.model_shape} shape on {on}: {len(samples)} samples, {batch.num_tokens} tokens in "
          f"{batch.shape[0]} rows of {batch.shape[1]}")
    if any("share" in kind.split("+") for _, kind, _ in variants):
        print(f"prefix-shared: {shared_batch.num_tokens} tokens computed in {shared_batch.shape[0]} rows of "
              f"{shared_batch.shape[1]}")
    for line in notes:
        print(line)
    if check:
        print(check)
    width = max([36] + [len(r["name"]) + 1 for r in rows])
    print(f"{'path':<{width}} {'s/step':>8} {'tok/s':>9} {'MFU':>7} {'peak GiB':>9} {'reserved':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<{width}} {r['error']}")
            continue
        recompiled = f"  ({r['compiled_frames']} frames compiled in the timed steps)" if r["compiled_frames"] else ""
        print(f"{r['name']:<{width}} {r['seconds']:>8.3f} {r['tok_s']:>9,.0f} {r['mfu']:>6.1%} "
              f"{r['peak_gib']:>9.1f} {r['reserved_gib']:>9.1f}{recompiled}")
    print("s/step is the median of the timed steps; each step, s: "
          + "; ".join(f"{r['name']} [{', '.join(f'{t:.3f}' for t in r['step_seconds'])}]" for r in rows
                      if "step_seconds" in r))


if __name__ == "__main__":
    main()
