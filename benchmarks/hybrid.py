"""The hybrid (linear + full attention) model on one GPU: engine decode, turn-2 prefill with state snapshots, and
the train step, each against transformers on the same model. One run, one markdown table per part (issue #15).

Model: Qwen3.5-0.8B's text decoder with random bf16 weights, built from its public config (`QWEN35_08B`). Source
of the values: the Qwen/Qwen3.5-0.8B model card's architecture section (24 layers laid out as 6 x (3 gated delta
nets + 1 gated attention), hidden 1024, FFN 3584, attention 8 query / 2 KV heads of 256, delta nets 16 QK and 16 V
heads of 128, vocabulary 248,320, tied embeddings), which two independent re-implementations found with the search
tools agree with (a Rust `ModelSpec` read from the checkpoint's config.json, and a set of Qwen3.5 "facts": 16 key
/ 16 value heads of 128, conv kernel 4, conv width 2 x 2048 + 2048). The rotary settings (theta 1e7, a quarter of
each head rotated) and the eos/pad ids do not change any figure here.

1. Decode: P prompts x (256 -> 256 tokens), greedy, eos ignored, through the engine (paged KV for the 6 attention
   layers, per-sequence state slots for the 18 delta nets, CUDA graphs for decode steps) and through transformers'
   padded `generate` (sdpa, its own cache; the whole batch at once, halved on OOM). Roofline, with
   benchmarks/engine.py's conventions (every weight read once a step, tied matrices once; the live KV at the mean
   context prompt + new / 2; tokens/s <= batch x bandwidth / bytes per step) plus what a delta net adds: each
   sequence's state read and written every step, the conv window (kernel - 1 inputs, model dtype) and the fp32
   recurrent matrix of every value head. Bandwidth: the H200's 4.8 TB/s (the measured copy bandwidth is printed
   beside it). tok/s = tokens generated / the whole timed pass, its prefill included, as in engine.py; of
   `--passes` timed passes (new prompts each) the last is reported. Goals: >= 40% of the roofline, >= 8x `generate`.
2. Turn-2 prefill, mirroring engine.py's multi-turn case: N conversations of a 1024-token prompt -> 64 tokens, then
   the whole history + 100 new tokens -> 64. Turn 2's prefill phase (until every request has its first token) with
   the prefix cache (the history's pages from the cache, the delta nets' state from the snapshot at the deepest
   cached page), without it, and with the new tokens alone as the prompt. Each engine first runs the same shapes
   on other tokens (compiles, graph captures, kernel specialisations are not timed). Goal: <= 1.3x the new tokens
   alone. The engine's snapshot counters are printed.
3. Train step (`hybrid_train.py`): agentrl's trainer on packed rows (the default GPU path of `agentrl train`);
   transformers' model on padded batches with full fp32 logits, with its fused kernels and with its torch
   reference kernels. Goal: >= 30% MFU for agentrl.

Every timed pass has a time limit: past it the pass stops, what it generated is counted over the time it took, and
the table says so. `--smoke` runs every part on a tiny Qwen3.5-like model on the CPU in fp32 (a check that the
script runs, no figure); there any error ends the run, on the GPU a failing part is reported and the next one runs.

usage: python benchmarks/hybrid.py [--quick] [--skip-hf] [--parts decode,prefill,train] [--tokens 25000]
                                   [--steps 3] [--budget 300] [--smoke] [--step-times] [--cprofile] [--profile]
                                   [--train-profile] [--train-groups] [--train-compile] [--engine-eager]
                                   [--engine-unfused] [--passes 2] [--step-tokens N]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for `benchmarks` and `agentrl`

from benchmarks.engine import copy_bandwidth, random_prompts, weight_bytes  # noqa: E402
from benchmarks.engine_passes import drive, greedy, profile_decode, step_table  # noqa: E402
from benchmarks.hybrid_train import (  # noqa: E402
    delta_rule_kernel, free_memory, peak_gib, reset_peak, sync, train_table)

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, the datasheet figure
LAYER_PATTERN = ["linear_attention"] * 3 + ["full_attention"]
QWEN35_08B = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, layer_types=LAYER_PATTERN * 6,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
    max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    eos_token_id=248046, pad_token_id=248044,
)


@dataclass(frozen=True)
class Sizes:
    decode: tuple[int, int, int]  # prompts, prompt tokens, new tokens
    prefill: tuple[int, int, int, int]  # conversations, turn-1 prompt, generated per turn, new tokens in turn 2
    train_tokens: int
    reference_tokens: int  # transformers' torch reference kernels: far slower, so fewer tokens
    steps: int
    limit_s: float  # time limit of one timed pass (half of it for an untimed warm-up pass)


def sizes_for(args) -> Sizes:
    if args.smoke:
        return Sizes((4, 24, 8), (4, 40, 8, 10), args.tokens or 3000, 1000, 1, 60.0)
    if args.quick:
        return Sizes((64, 256, 64), (64, 1024, 64, 100), args.tokens or 8000, 2000, args.steps or 2, 30.0)
    tokens = args.tokens or 25000
    return Sizes((256, 256, 256), (256, 1024, 64, 100), tokens, max(tokens // 4, 2000), args.steps or 3, 40.0)


# ------------------------------------------------------------------------------------------------ the model

def build_model(smoke: bool, seed: int = 0):
    """Qwen3.5-0.8B's text decoder (random bf16 weights, CUDA), or with --smoke the tiny test model's config
    (fp32, CPU)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from agentrl.models import tiny_config

    torch.manual_seed(seed)
    if smoke:
        return Qwen3_5ForCausalLM(tiny_config("tiny-qwen3.5")).float().eval()
    with torch.device("cuda"):
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_08B)).to(torch.bfloat16).eval()


def linear_state_bytes(config, dtype: torch.dtype) -> int:
    """One sequence's delta-net state over all linear layers: conv windows in the model dtype, recurrent fp32 (as
    `agentrl.engine.linear_state.LinearStates` holds it)."""
    conv = (2 * config.linear_num_key_heads * config.linear_key_head_dim
            + config.linear_num_value_heads * config.linear_value_head_dim) * (config.linear_conv_kernel_dim - 1)
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    layers = config.layer_types.count("linear_attention")
    return layers * (conv * torch.empty((), dtype=dtype).element_size() + recurrent * 4)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    full = config.layer_types.count("full_attention")
    return 2 * full * config.num_key_value_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def decode_step_bytes(model, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Bytes one decode step moves at the roofline, averaged over the generation (the KV grows linearly)."""
    cfg, dtype = model.config, model.dtype
    mean_context = prompt_len + new_tokens / 2
    return {"weights": weight_bytes(model), "kv": batch * mean_context * kv_bytes_per_token(cfg, dtype),
            "state": 2 * batch * linear_state_bytes(cfg, dtype)}  # read and written


def hf_generate(model, prompts, new_tokens: int, limit_s: float, device) -> dict:
    """transformers' padded `generate`, greedy, every prompt the same length: the whole set as one batch, halved
    until it fits; stopped by `max_time` at the limit (tokens counted from what came back)."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts, device=device)
    batch = len(prompts)
    while True:
        try:
            with torch.no_grad():  # warm-up: the kernels' first compiles and autotuning, at this batch size
                model.generate(ids[:batch], attention_mask=torch.ones_like(ids[:batch]), max_new_tokens=4,
                               do_sample=False, pad_token_id=0)
            reset_peak(device)
            generated, stopped = 0, False
            sync(device)
            start = time.perf_counter()
            for i in range(0, len(prompts), batch):
                left = limit_s - (time.perf_counter() - start)
                if left <= 0:
                    stopped = True
                    break
                chunk = ids[i:i + batch]
                with torch.no_grad():
                    out = model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, max_time=left)
                made = out.shape[1] - chunk.shape[1]
                stopped = stopped or made < new_tokens
                generated += made * chunk.shape[0]
            sync(device)
            return {"batch": batch, "generated": generated, "seconds": time.perf_counter() - start,
                    "stopped": stopped, "peak": peak_gib(device)}
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ output

@dataclass
class Report:
    device: str
    command: str
    date: str

    def table(self, title: str, columns: list[str], rows: list[list], notes: list[str] = ()) -> None:
        print(f"\n#### {title}\n\ndevice: {self.device} · command: `{self.command}` · date: {self.date}\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for row in rows:
            print("| " + " | ".join(_cell(v) for v in row) + " |")
        if notes:
            print()
            for note in notes:
                print(f"- {note}")
        sys.stdout.flush()


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def goal(ok: bool) -> str:
    return "met" if ok else "NOT met"


def pct(x: float) -> str:
    return f"{x:.1%}"


# ------------------------------------------------------------------------------------------------ 1. decode

def decode_part(model, sizes: Sizes, args, report: Report, device) -> None:
    from agentrl.engine import Engine, EngineConfig

    n, plen, new = sizes.decode
    vocab = model.config.vocab_size
    prompts = random_prompts(n, plen, vocab)
    warm = random_prompts(n, plen, vocab, seed=99)  # the same shapes, no prefix-cache hit on the timed prompts
    start = time.perf_counter()
    # The engine's own prefill budget a step (32768 tokens for a hybrid model: 128 prompts of 256 at once) unless
    # `--step-tokens` sets one (8192, as in engine.py, before 2026-12-02 ≈ 11:00 UTC).
    engine = Engine(model, EngineConfig(max_num_seqs=n, max_model_len=plen + new + 64,
                                        max_tokens_per_step=args.step_tokens,
                                        compile=False if args.engine_eager else None,
                                        fuse_projections=not args.engine_unfused))
    # The warm-up runs the timed pass's whole length: Triton kernels specialise on the contexts they meet (a first
    # run on a fresh machine compiled 29 of them inside the timed pass after a 16-token warm-up). Even so, a fresh
    # machine's first timed pass still compiled (BENCHMARKS.md), so `--passes 2` (the default) times a pass of new
    # prompts again and reports the last; every pass's figure is printed.
    drive(engine, warm, greedy(new), sizes.limit_s / 2)
    setup_s = time.perf_counter() - start
    earlier = []
    for extra in range(args.passes - 1):
        first = drive(engine, random_prompts(n, plen, vocab, seed=1000 + extra), greedy(new), sizes.limit_s)
        earlier.append(first.generated / first.seconds)
    reset_peak(device)
    stats0 = engine.stats
    step_log = [] if args.step_times else None
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    run = drive(engine, prompts, greedy(new), sizes.limit_s, step_log)
    if profiler is not None:
        import pstats

        profiler.disable()
        print("\n#### Host profile of the timed decode pass (cProfile, by own time)\n", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    if step_log is not None:
        step_table(step_log)
    engine_peak = peak_gib(device)
    stats = engine.stats
    state_check = engine.linear.bytes_per_state if engine.linear is not None else None
    if args.profile:
        profile_decode(engine, random_prompts(n, plen, vocab, seed=7), new)
    del engine
    free_memory(device)

    parts = decode_step_bytes(model, n, plen, new)
    step_bytes = sum(parts.values())
    roof = n * HBM_BYTES_PER_S / step_bytes
    tok_s = run.generated / run.seconds
    shape = f"{n} x ({plen} -> {new})"
    rows = [["agentrl engine", shape, n, tok_s, pct(tok_s / roof), run.seconds, engine_peak, "–"]]
    hf = None
    if not args.skip_hf:
        try:
            hf = hf_generate(model, prompts, new, sizes.limit_s, device)
            hf_tok_s = hf["generated"] / hf["seconds"]
            rows.append(["transformers padded `generate` (sdpa)", shape, hf["batch"], hf_tok_s,
                         pct(hf_tok_s / roof), hf["seconds"], hf["peak"], "1x"])
            rows[0][-1] = f"{tok_s / hf_tok_s:.1f}x"
        except Exception as exc:  # a baseline failing must not hide the engine's row
            if args.smoke:
                raise
            rows.append([f"`generate` failed: {type(exc).__name__}: {str(exc)[:120]}", shape] + [None] * 6)
            hf = None
    notes = [
        f"roofline {roof:,.0f} tok/s = {n} x 4.8 TB/s / {step_bytes / 1e9:.2f} GB a step: weights "
        f"{parts['weights'] / 1e9:.2f} GB, KV of the {model.config.layer_types.count('full_attention')} attention "
        f"layers at the mean context {plen + new / 2:.0f} {parts['kv'] / 1e9:.2f} GB, delta-net state read + written "
        f"{parts['state'] / 1e9:.2f} GB ({linear_state_bytes(model.config, model.dtype) / 2**20:.1f} MiB a sequence, "
        f"the engine's own sizing: {(state_check or 0) / 2**20:.1f} MiB)",
        f"goals: >= 40% of the roofline: {goal(tok_s >= 0.4 * roof)}; >= 8x `generate`: "
        + (goal(hf is not None and tok_s >= 8 * hf["generated"] / hf["seconds"]) if not args.skip_hf else "not run"),
        f"engine: set-up + warm-up pass (other prompts, same shapes) {setup_s:.1f} s, untimed; "
        f"{stats.decode_steps - stats0.decode_steps} decode steps, {stats.graph_steps - stats0.graph_steps} from CUDA "
        f"graphs; {stats.snapshots_taken - stats0.snapshots_taken} state snapshots taken (prefix cache on, the "
        f"default; their copies are not in the roofline); delta rule: {delta_rule_kernel(model)}",
    ]
    if earlier:
        notes.append(f"the row is the last of {args.passes} timed passes (new prompts each); the earlier passes: "
                     + ", ".join(f"{x:,.0f} tok/s" for x in earlier))
    if device.type == "cuda":
        bw = copy_bandwidth()
        notes.append(f"measured copy bandwidth {bw / 1e12:.2f} TB/s: the engine is at "
                     f"{pct(tok_s / (n * bw / step_bytes))} of a roofline at that figure")
    if run.stopped or (hf is not None and hf["stopped"]):
        notes.append(f"a pass hit its {sizes.limit_s:.0f}-s limit: its tok/s counts what it generated until then")
    report.table("Hybrid decode: agentrl engine vs transformers `generate`",
                 ["backend", "shape", "batch", "tok/s", "of roofline", "seconds", "peak GiB", "vs generate"],
                 rows, notes)


# ------------------------------------------------------------------------------------------------ 2. prefill

def prefill_part(model, sizes: Sizes, report: Report, device) -> None:
    """Turn 2 with the prefix cache (resuming each conversation from its state snapshot) against the cache off and
    the new tokens alone; see the module docstring."""
    from agentrl.engine import Engine, EngineConfig

    n, plen, gen, tool = sizes.prefill
    vocab = model.config.vocab_size
    limit = sizes.limit_s
    prompts, tools = random_prompts(n, plen, vocab, seed=1), random_prompts(n, tool, vocab, seed=2)
    warm, warm_tools = random_prompts(n, plen, vocab, seed=3), random_prompts(n, tool, vocab, seed=4)
    few = min(n, 16)  # kernel specialisations depend on a chunk's length, not on how many run
    common = dict(max_num_seqs=n, max_model_len=plen + 2 * gen + tool + 64, max_tokens_per_step=8192,
                  gpu_memory_fraction=0.3)
    # Room for every conversation's newest snapshot, twice over: the warm-up conversations hold theirs too.
    engine = Engine(model, EngineConfig(**common, state_snapshots=2 * n + 2 * few))
    warm_first = drive(engine, warm, greedy(gen), limit).completions  # also captures the decode graphs
    if len(warm_first) < n:
        raise RuntimeError(f"the warm-up turn 1 finished {len(warm_first)} of {n} conversations within {limit:.0f} s")
    warm_second = [p + c.token_ids + t for p, c, t in zip(warm, warm_first, warm_tools)]
    drive(engine, warm_second[:few], greedy(gen), limit / 2)
    turn1 = drive(engine, prompts, greedy(gen), limit)
    if len(turn1.completions) < n:
        raise RuntimeError(f"turn 1 finished {len(turn1.completions)} of {n} conversations within {limit:.0f} s")
    second = [p + c.token_ids + t for p, c, t in zip(prompts, turn1.completions, tools)]
    alone = [c.token_ids + t for c, t in zip(turn1.completions, tools)]
    before = engine.stats
    reset_peak(device)
    hot = drive(engine, second, greedy(gen), limit)
    hot_peak = peak_gib(device)
    after = engine.stats
    del engine
    free_memory(device)

    cold_engine = Engine(model, EngineConfig(**common, enable_prefix_cache=False))
    drive(cold_engine, warm, greedy(8), limit / 2)
    drive(cold_engine, warm_second[:few], greedy(8), limit / 2)
    drive(cold_engine, [c.token_ids + t for c, t in zip(warm_first, warm_tools)][:few], greedy(8), limit / 2)
    cold = drive(cold_engine, second, greedy(gen), limit)
    only_new = drive(cold_engine, alone, greedy(gen), limit)
    del cold_engine
    free_memory(device)

    history = sum(len(p) + len(c.token_ids) for p, c in zip(prompts, turn1.completions))
    hits = after.cached_tokens - before.cached_tokens
    resumes = after.snapshot_resumes - before.snapshot_resumes
    ratio = hot.prefill_s / only_new.prefill_s if hot.prefill_s and only_new.prefill_s else float("nan")
    rows = [["with prefix cache (resumed from snapshots)", hot.prefill_s, hot.seconds, hot.prefilled],
            ["without prefix cache", cold.prefill_s, cold.seconds, cold.prefilled],
            [f"new tokens alone ({gen} generated + {tool} new, as the prompt)", only_new.prefill_s,
             only_new.seconds, only_new.prefilled]]
    notes = [
        f"turn 2 prefill phase / new tokens alone: {ratio:.2f} (goal <= 1.3: {goal(ratio <= 1.3)}); without the "
        f"cache / with it: {cold.prefill_s / hot.prefill_s:.2f}x" if hot.prefill_s and cold.prefill_s else
        "a prefill phase did not finish within the limit",
        f"turn 1: {n} x ({plen} -> {gen}) in {turn1.seconds:.2f} s; turn 2 resubmits {plen + gen + tool} tokens a "
        f"conversation -> {gen}" + (f"; peak during turn 2 with the cache {hot_peak:.1f} GiB" if hot_peak else ""),
        f"snapshot counters in turn 2: {resumes} / {n} admissions resumed from a snapshot; {hits:,} of {history:,} "
        f"history tokens ({pct(hits / history)}) served from the cache; "
        f"{after.snapshots_taken - before.snapshots_taken} snapshots taken; {after.state_snapshots} held of a pool of "
        f"{after.snapshot_bytes / 2**30:.2f} GiB",
        f"each engine ran the same shapes on other tokens first ({n} turn-1 conversations, {few} of each turn-2 "
        f"shape), untimed",
    ]
    if any(p.stopped for p in (hot, cold, only_new)):
        notes.append(f"a pass hit its {limit:.0f}-s limit: its whole-turn time is a lower bound")
    report.table("Hybrid turn-2 prefill: prefix cache with state snapshots",
                 ["turn 2", "prefill phase s", "whole turn s", "tokens prefilled"], rows, notes)


# ------------------------------------------------------------------------------------------------ 3. train

def train_part(model, sizes: Sizes, args, report: Report, device) -> None:
    columns, rows, notes = train_table(model, sizes.train_tokens, sizes.reference_tokens, sizes.steps, sizes.limit_s,
                                       args.skip_hf, args.smoke, device, profile=args.train_profile,
                                       groups=args.train_groups, compiled_row=args.train_compile,
                                       micro_rows=tuple(int(r) for r in args.train_rows.split(",") if r),
                                       eager_rows=args.train_without_graphs, stand_in_rows=args.train_stand_in)
    report.table("Hybrid train step: agentrl trainer vs transformers", columns, rows, notes)


# ------------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, conversations and tokens")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baselines")
    ap.add_argument("--parts", default="decode,prefill,train", help="comma list of decode, prefill, train")
    ap.add_argument("--tokens", type=int, default=None,
                    help="train-step tokens (default 25000; 8000 with --quick); the torch-reference row: a quarter")
    ap.add_argument("--steps", type=int, default=None, help="timed train steps (default 3; 2 with --quick)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, CPU, fp32: checks the script runs")
    ap.add_argument("--profile", action="store_true", help="also print the kernels of a few decode steps")
    ap.add_argument("--train-profile", action="store_true", help="train: also print the kernels of one agentrl step")
    ap.add_argument("--train-compile", action="store_true",
                    help="train: also a row with the hybrid's decoder layers compiled (opt-in for hybrids)")
    ap.add_argument("--train-rows", default="", help="train: more agentrl rows with these rows a micro-batch (1,2,4)")
    ap.add_argument("--train-without-graphs", action="store_true",
                    help="train: more agentrl rows without CUDA graphs (trainer.cuda_graphs=false; on by default)")
    ap.add_argument("--train-stand-in", action="store_true",
                    help="train: more agentrl rows with fla's refused gated backward call in agentrl's PyTorch version")
    ap.add_argument("--train-groups", action="store_true",
                    help="train: hotpotqa_search-shaped groups sharing a prompt, and the trainer unshared as a row")
    ap.add_argument("--passes", type=int, default=2,
                    help="decode: timed passes of new prompts after the warm-up; the last is the table's row")
    ap.add_argument("--engine-eager", action="store_true",
                    help="decode: the engine view's decoder layers eager (compiled by default on CUDA)")
    ap.add_argument("--engine-unfused", action="store_true",
                    help="decode: each projection its own GEMM (fused groups by default: engine.fuse_projections)")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="decode: the engine's max_tokens_per_step (default: the engine's, by model)")
    ap.add_argument("--step-times", action="store_true", help="decode: the timed pass's steps by kind and time")
    ap.add_argument("--cprofile", action="store_true", help="decode: the timed pass under cProfile (host time)")
    ap.add_argument("--budget", type=float, default=300.0,
                    help="seconds: a part that would start later than this is skipped (and reported so)")
    args = ap.parse_args()
    if args.passes < 1:
        raise SystemExit("--passes must be >= 1")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"decode", "prefill", "train"}
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from decode, prefill, train")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA; --smoke runs a tiny model on the CPU")
    sizes = sizes_for(args)
    device = torch.device("cpu" if args.smoke else "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    import transformers

    report = Report(device=f"{name}, torch {torch.__version__}, transformers {transformers.__version__}",
                    command="python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
                    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    start = time.perf_counter()
    model = build_model(args.smoke)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {model.dtype}, layers "
          f"{model.config.layer_types.count('linear_attention')} delta nets + "
          f"{model.config.layer_types.count('full_attention')} attention; delta rule: {delta_rule_kernel(model)}; "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)
    failed = []
    for part in parts:
        t = time.perf_counter()
        if t - start > args.budget:
            failed.append(part)
            print(f"\n#### {part}: skipped, {t - start:.0f} s into a {args.budget:.0f}-s budget", flush=True)
            continue
        try:
            if part == "decode":
                decode_part(model, sizes, args, report, device)
            elif part == "prefill":
                prefill_part(model, sizes, report, device)
            else:
                train_part(model, sizes, args, report, device)
        except Exception:
            if args.smoke:
                raise
            failed.append(part)
            print(f"\n#### {part}: failed\n\n```\n{traceback.format_exc()[-3000:]}```", flush=True)
            free_memory(device)
        print(f"({part}: {time.perf_counter() - t:.1f} s)", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if failed:
        raise SystemExit(f"failed or skipped parts: {', '.join(failed)}")


if __name__ == "__main__":
    main()
