"""benchmarks/hybrid.py's train-step part, and the kernel and device helpers it shares with the other parts.

Three full train steps (forward, backward, then the same clip + fused AdamW step `agentrl train` takes) on the
hybrid model, each on samples of 200-2000 tokens (a third prompt, the rest trained) from train_step.py:
- (a) agentrl's `Trainer` set up as `agentrl train` sets it up on a GPU (`agentrl.run.build`): packed rows of 8192
  tokens laid end to end, flash varlen attention, flash-linear-attention's delta rule given the sample boundaries
  (checked first on the model: kernels that leak across samples send it to the per-sample path, and the table
  says which ran), the chunked lm_head over trained positions only;
- (b) transformers' model on padded batches (each sample a row, right-padded, micro-batches of at most 8192 padded
  tokens, the trainer's row budget), sdpa, full logits cast to fp32 -> log_softmax -> gather -> the same loss,
  as train_step.py's transformers baseline; the delta rule is whatever transformers dispatches to (fla when
  installed);
- (c) as (b) with transformers' torch reference kernels (fla hidden: the modeling module's kernel entry points
  replaced by the torch functions they wrap), on fewer tokens and one timed step: it is slow.

FLOPs of a step (MFU over 790 TFLOP/s, the H200's measured bf16 dense peak, as train_step.py):
- 6 x non-embedding params per token, and 6 x vocab x hidden per trained target: every matrix multiply forward and
  backward, the head only where the loss reads it, as train_step.py counts (until 2026-12-02 both counted the head
  at every token; agentrl computes it at trained positions only, transformers' rows everywhere);
- full attention, the 6 attention layers only: 12 x layers x (heads x head_dim) x sum over samples of n^2 / 2
  (QK^T and PV on the causal half, forward + backward);
- the delta rule, the 18 linear layers: 18 x layers x value heads x key_dim x value_dim per token. Its recurrent
  form does three dk x dv products a token and head (the prediction S^T k, the rank-1 update k delta^T, the readout
  S^T q: 2 dk dv FLOPs each), the backward twice the forward. The chunked kernels do more arithmetic than this
  (the products inside each chunk), which the count does not credit. The short conv (2 x kernel x channels a
  token) and the norms are left out: < 0.1% of the total.
Tokens/s and FLOPs count real tokens only: a padded batch's pad tokens are work that earns nothing.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import time
from dataclasses import dataclass

import torch

from agentrl.train.pack import TrainableTokens
from benchmarks.train_step import PEAK_FLOPS, make_group_samples, make_samples

ROW_TOKENS = 8192  # agentrl's default row budget; the padded baselines' micro-batch budget too
# transformers' entry points for the delta net's kernels, in the modeling module of Qwen3.5 (and Qwen3-Next):
# each dispatches to the kernel package when installed, else to the torch function it wraps.
KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")


# ------------------------------------------------------------------------------------------------ device

def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


def free_memory(device) -> None:
    gc.collect()  # the optimizer and its scheduler hold each other
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ kernels

def modeling_modules(model) -> list:
    """The modeling modules whose functions the model's linear-attention layers call."""
    found = []
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if hasattr(layer, "in_proj_b") and module is not None and module not in found:
            found.append(module)
    return found


def implementation_module(fn) -> str:
    """The module of the function a transformers kernel entry point runs: the kernel package's when it dispatched
    to one (the closure's `implementation`, found down the chain of wrappers agentrl puts over it), else the torch
    function's own."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        cells = zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())) if code is not None else ()
        implementation = dict(cells).get("implementation")
        if implementation is not None:
            return getattr(implementation, "__module__", "") or ""
        if getattr(fn, "__wrapped__", None) is None:
            return getattr(fn, "__module__", "") or ""
        fn = fn.__wrapped__
    return ""


def delta_rule_kernel(model) -> str:
    """'fla' or 'torch': what the delta rule's entry point dispatches to now."""
    mods = modeling_modules(model)
    fn = getattr(mods[0], "torch_chunk_gated_delta_rule", None) if mods else None
    if fn is None:
        return "?"
    return "fla" if implementation_module(fn).startswith("fla") else "torch"


def backward_note(model, varlen: bool) -> str:
    """Which backward the packed delta rule takes where it is not fla's own throughout."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.linear_conv import _REFERENCE_RULE

    if not varlen:
        return ""
    if any(getattr(m, _REFERENCE_RULE, False) for m in model.modules()):
        return " (backward: transformers' reference rule, sample by sample)"
    if not delta_rule_backward.active():
        return ""
    return f" (backward: fla, its refused gated dq/dk/dw/dg call answered by {delta_rule_backward.describe()})"


@contextlib.contextmanager
def torch_reference_kernels(model):
    """While active, the model's linear-attention layers run transformers' torch reference functions, as they do
    when flash-linear-attention and causal-conv1d are not installed."""
    saved = []
    for module in modeling_modules(model):
        for name in KERNEL_FUNCTIONS:
            fn = getattr(module, name, None)
            if fn is not None:
                saved.append((module, name, fn))
                setattr(module, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


# ------------------------------------------------------------------------------------------------ FLOPs

def train_flops(model, samples) -> dict[str, float]:
    """A train step's FLOPs over `samples`, by term (see the module docstring). The vocabulary projection counts at
    the trained targets only, the positions the loss reads (as `train_step.flops_per_step`): a row that computes
    logits everywhere does work the step does not need."""
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    lengths = [len(s) for s in samples]
    tokens = sum(lengths)
    targets = sum(sum(s.trainable[1:]) for s in samples)
    types = list(c.layer_types)
    dense = 6 * params * tokens + 6 * c.vocab_size * c.hidden_size * targets
    pairs = sum(n * n / 2 for n in lengths)  # causal query-key pairs
    attention = 12 * types.count("full_attention") * c.num_attention_heads * c.head_dim * pairs
    delta = (18 * types.count("linear_attention") * c.linear_num_value_heads * c.linear_key_head_dim
             * c.linear_value_head_dim * tokens)
    return {"dense": dense, "attention": attention, "delta": delta, "total": dense + attention + delta}


# ------------------------------------------------------------------------------------------------ padded batches

@dataclass
class PaddedGroup:
    """Samples as right-padded rows, with the loss's view of their trained tokens in row-major order."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    index: torch.Tensor  # [M]: flat position (row * L + t) whose output predicts each trained token
    tokens: TrainableTokens  # sample_index local to the group


def padded_groups(samples, budget: int, device) -> list[PaddedGroup]:
    """The samples in order, as micro-batches whose padded size (rows x longest) stays within `budget` tokens."""
    groups, current, width = [], [], 0
    for s in samples:
        wider = max(width, len(s))
        if current and wider * (len(current) + 1) > budget:
            groups.append(current)
            current, wider = [], len(s)
        current.append(s)
        width = wider
    if current:
        groups.append(current)
    return [_padded(g, device) for g in groups]


def _padded(group, device) -> PaddedGroup:
    width = max(len(s) for s in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    index, target, behaviour, advantage, versions, owner = [], [], [], [], [], []
    for r, s in enumerate(group):
        ids[r, :len(s)] = torch.tensor(s.input_ids)
        mask[r, :len(s)] = 1
        for t in range(len(s) - 1):  # position t predicts token t + 1
            if s.trainable[t + 1]:
                index.append(r * width + t)
                target.append(s.input_ids[t + 1])
                behaviour.append(s.behaviour_logprobs[t + 1])
                advantage.append(s.advantage)
                versions.append(s.versions[t + 1])
                owner.append(r)
    tokens = TrainableTokens(torch.tensor(target), torch.tensor(behaviour, dtype=torch.float32),
                             torch.tensor(advantage, dtype=torch.float32), torch.tensor(versions),
                             torch.tensor(owner), len(group))
    return PaddedGroup(ids.to(device), mask.to(device), torch.tensor(index).to(device), tokens.to(device))


def batch_denominator(groups: list[PaddedGroup], cfg) -> float:
    """The loss's `D` over all groups (each micro-batch's loss is divided by the whole batch's, as the trainer's)."""
    from agentrl.train.loss import loss_denominator

    offsets = torch.cumsum(torch.tensor([0] + [g.tokens.num_samples for g in groups[:-1]]), 0).tolist()
    parts = [g.tokens for g in groups]
    whole = TrainableTokens(*(torch.cat([getattr(p, f) for p in parts]) for f in
                              ("target_ids", "behaviour_logprobs", "advantages", "versions")),
                            torch.cat([p.sample_index + o for p, o in zip(parts, offsets)]),
                            sum(p.num_samples for p in parts))
    return float(loss_denominator(whole, cfg, 0))


def hf_full_logits_step(model, groups: list[PaddedGroup], stepper, cfg, denominator: float) -> None:
    """transformers' forward with full logits, cast to fp32, log_softmax, gather, the policy loss, backward; then
    the optimizer step."""
    from agentrl.train.loss import policy_loss

    loss_sum = torch.zeros((), device=groups[0].input_ids.device)
    for g in groups:
        logits = model(input_ids=g.input_ids, attention_mask=g.attention_mask, use_cache=False).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).flatten(0, 1)
        picked = logprobs.index_select(0, g.index).gather(1, g.tokens.target_ids[:, None])[:, 0]
        loss, _ = policy_loss(picked, g.tokens, cfg, current_version=0, denominator=denominator)
        loss.backward()
        loss_sum = loss_sum + loss.detach()
        del logits, logprobs, picked, loss
    stepper.step(loss_sum)


# ------------------------------------------------------------------------------------------------ the rows

def measure(step, steps: int, device, limit_s: float, smoke: bool, warmup: int = 1) -> dict:
    """`warmup` untimed steps, then `steps` timed ones (only the warm-up when its first step alone took past
    `limit_s`); the timed steps' own times are printed."""
    try:
        reset_peak(device)
        for i in range(warmup):
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            warm = time.perf_counter() - start
            if i == 0 and warm > limit_s:
                return {"seconds": warm, "peak": peak_gib(device), "timed": "the warm-up step alone (past the limit)"}
        reset_peak(device)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - start)
        print(f"timed steps: {', '.join(f'{t:.3f}' for t in times)} s", flush=True)
        # Reserved too: memory the CUDA graphs' pool holds is reserved at capture, in the warm-up, and no allocation
        # after the reset counts it.
        peak = (f"{peak_gib(device):.1f} / {torch.cuda.max_memory_reserved() / 2**30:.1f}"
                if torch.device(device).type == "cuda" else None)
        return {"seconds": sum(times) / steps, "peak": peak,
                "timed": f"{steps} step{'s' * (steps > 1)} after {warmup} warm-up{'s' * (warmup > 1)}"}
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    except Exception as exc:  # one path failing (a kernel, a compile) must not hide the others
        if smoke:
            raise
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def agentrl_row(model, samples, steps: int, device, limit_s: float, smoke: bool, profile: bool = False,
                share: bool = True, compile_layers: bool | None = None, micro_rows: int | None = None,
                graphs: bool | None = None, stand_in: bool = False) -> dict:
    """agentrl's trainer as `agentrl train` builds it on this device; `profile`: then one step's kernel table;
    `share=False`: `trainer.share_prefix=false`; `compile_layers`: `model.compile_layers` (None: the default);
    `micro_rows`: `trainer.rows_per_micro_batch` (None: the default); `graphs`: `trainer.cuda_graphs` (None: the
    default); `stand_in`: fla's refused gated backward call answered by agentrl's PyTorch version rather than by
    fla's kernel at a spared block width (the default)."""
    from agentrl.train import delta_rule_backward

    delta_rule_backward.KERNEL, delta_rule_backward._VERDICTS = not stand_in, {}
    try:
        return _agentrl_row(model, samples, steps, device, limit_s, smoke, profile, share, compile_layers, micro_rows,
                            graphs)
    finally:
        delta_rule_backward.KERNEL = True


def _agentrl_row(model, samples, steps, device, limit_s, smoke, profile, share, compile_layers, micro_rows, graphs):
    import dataclasses

    from agentrl.engine.model_view import compile_decoder_layers
    from agentrl.run import build
    from agentrl.run.build import _trainable
    from agentrl.run.config import TrainConfig
    from agentrl.train import delta_rule_backward
    from agentrl.train.config import LossConfig, ModelConfig, OptimConfig, TrainerConfig
    from agentrl.train.logprobs import packing_error
    from agentrl.train.trainer import Trainer
    from benchmarks.capture_watch import watch_captures

    model_cfg = ModelConfig(name="qwen3.5-0.8b-shaped", compile_layers=compile_layers)
    _, _, varlen = _trainable(model_cfg, model, None, device.type)
    error = packing_error(model, hybrid_varlen=True, relative=True) if varlen else None
    # Compiled layers where `agentrl train` would compile them (its default leaves hybrid models eager).
    compiled = bool(getattr(build, "compile_layers", None) and build.compile_layers(model_cfg, model, device.type))
    if compiled:
        compile_decoder_layers(model, activation_memory_budget=model_cfg.activation_memory_budget,
                               **getattr(build, "TRAINER_COMPILE", {}))
    # As `agentrl train` compiles them: the gated backward's stand-in with the layers (a process-wide choice).
    delta_rule_backward.compile_stand_in(compiled)
    trainer_cfg = TrainerConfig(row_tokens=ROW_TOKENS, share_prefix=share, rows_per_micro_batch=micro_rows,
                                cuda_graphs=graphs)
    graphs = build.trainer_graphs(dataclasses.replace(TrainConfig(), model=model_cfg, trainer=trainer_cfg), model,
                                  device.type) and varlen
    trainer = Trainer(model, trainer_cfg, LossConfig(), OptimConfig(), cuda_graphs=graphs,
                      total_steps=steps + 2, hybrid_varlen=varlen)
    packed = trainer.pack(samples)  # also the trainer's one-time check of prefix sharing, as its first step runs it
    rows = len(packed.rows) if hasattr(packed, "rows") else packed.input_ids.shape[0]
    computed = f", {packed.num_tokens:,} tokens computed" if packed.num_tokens != sum(len(x) for x in samples) else ""
    counts = []

    def step():
        metrics = trainer.step(samples, policy_version=0)
        counts.append({k[len("flat_graphs_"):]: v for k, v in metrics.items() if k.startswith("flat_graphs_")})

    # With graphs, a bucket runs eagerly the first time and is captured the second: two steps before the timed ones.
    with watch_captures() if graphs else contextlib.nullcontext():
        result = measure(step, steps, device, limit_s, smoke, warmup=2 if graphs else 1)
    if graphs:
        print(f"graph buckets a step (eager / captured / replayed): "
              f"{', '.join('/'.join(str(c.get(k, 0)) for k in ('eager', 'captured', 'replayed')) for c in counts)}",
              flush=True)
    if profile and "error" not in result:
        from benchmarks.kernel_profile import print_profile

        label = "(a) agentrl trainer" + ", CUDA graphs" * graphs + ", compiled layers" * compiled
        print_profile(label, lambda: trainer.step(samples, policy_version=0), model)
    if compiled:  # the transformers rows run eager layers
        for module in model.modules():
            module.__dict__.pop("_compiled_call_impl", None)
    per_micro = f", {trainer.rows_per_micro_batch} a micro-batch"
    layout = (f"{rows} packed row(s) of <= {ROW_TOKENS}{per_micro}{computed}, flat varlen (boundary check: relative "
              f"error {error:.1e})"
              if varlen
              else f"{rows} packed row(s) of <= {ROW_TOKENS}{per_micro}, each sample run on its own"
              + (" (varlen kernels refused by the boundary check)" if device.type == "cuda" else ""))
    attention = model.config._attn_implementation
    kernel = f"{delta_rule_kernel(model)}{' varlen' if varlen else ''}{backward_note(model, varlen)}, {attention}" \
             f"{', compiled layers' * compiled}{', CUDA graphs' * (trainer.graphs is not None)}"
    return {**result, "layout": layout, "kernel": kernel, "varlen": varlen}


def hf_row(model, samples, steps: int, device, limit_s: float, smoke: bool, reference: bool) -> dict:
    """transformers' model on padded batches, full fp32 logits; with its torch reference kernels if `reference`."""
    from agentrl.train import delta_rule_backward
    from agentrl.train.config import LossConfig, OptimConfig
    from agentrl.train.optim import Stepper, build_optimizer, build_scheduler

    model.set_attn_implementation("sdpa")
    model.train()
    cfg, optim = LossConfig(), OptimConfig()
    groups = padded_groups(samples, ROW_TOKENS, device)
    denominator = batch_denominator(groups, cfg)
    optimizer = build_optimizer(model, optim)
    stepper = Stepper(model, optimizer, build_scheduler(optimizer, optim, steps + 2), optim)
    padded = sum(g.input_ids.numel() for g in groups)
    real = sum(len(s) for s in samples)
    with torch_reference_kernels(model) if reference else contextlib.nullcontext():
        kernel = delta_rule_kernel(model)
        if kernel == "fla" and delta_rule_backward.active():  # installed in this process by the agentrl row
            kernel += f" (backward: its refused gated dq/dk/dw/dg call answered by {delta_rule_backward.describe()})"
        result = measure(lambda: hf_full_logits_step(model, groups, stepper, cfg, denominator), steps, device,
                         limit_s, smoke)
    layout = f"{len(groups)} padded micro-batches of <= {ROW_TOKENS} ({padded / real - 1:.0%} padding)"
    return {**result, "layout": layout, "kernel": f"{kernel}, sdpa"}


def train_table(model, tokens: int, reference_tokens: int, steps: int, limit_s: float, skip_hf: bool, smoke: bool,
                device, profile: bool = False, groups: bool = False,
                compiled_row: bool = False, micro_rows: tuple[int, ...] = (),
                eager_rows: bool = False, stand_in_rows: bool = False) -> tuple[list[str], list[list], list[str]]:
    """The train-step table: (columns, rows, notes); `profile`: the kernels of one agentrl step, printed; `groups`:
    hotpotqa_search-shaped groups sharing a prompt, with a row for the trainer packing them unshared; `micro_rows`:
    more agentrl rows with that many packed rows a micro-batch (one forward and backward over all of them: fewer
    layer calls, each over more tokens), compiled too with `compiled_row`; `eager_rows`: more with the flat forward
    and backward run eagerly rather than replayed from CUDA graphs (`trainer.cuda_graphs=false`; the graphs are the
    default on CUDA), compiled too with `compiled_row`; `stand_in_rows`: more with fla's refused gated backward call
    answered by agentrl's PyTorch version (where fla refuses it), compiled too with `compiled_row`."""
    vocab = model.config.vocab_size
    samples = make_group_samples(tokens, vocab) if groups else make_samples(tokens, vocab)
    reference_samples = make_samples(reference_tokens, vocab, seed=1)
    # Only the torch-reference row has a time limit: the others' warm-up steps compile (the chunked head) and
    # autotune (fla, per padded shape), which is set-up rather than a sign of a slow path.
    unlimited = float("inf")
    paths = [("(a) agentrl trainer", samples, steps,
              lambda s, k: agentrl_row(model, s, k, device, unlimited, smoke, profile))]
    if compiled_row and not smoke:  # on the CPU the hybrid takes the per-sample path, whose compiled backward fails
        paths.append(("(a'') agentrl trainer, `model.compile_layers=true`", samples, steps,
                      lambda s, k: agentrl_row(model, s, k, device, unlimited, smoke, profile, compile_layers=True)))
    for r in micro_rows:
        for compiled in (False, True) if compiled_row and not smoke else (False,):
            paths.append((f"(a{r}) agentrl trainer, `trainer.rows_per_micro_batch={r}`"
                          + ", `model.compile_layers=true`" * compiled, samples, steps,
                          lambda s, k, r=r, c=compiled: agentrl_row(model, s, k, device, unlimited, smoke,
                                                                    compile_layers=c or None, micro_rows=r)))
    for compiled in ((False, True) if compiled_row else (False,)) if eager_rows and not smoke else ():
        paths.append(("(ae) agentrl trainer, `trainer.cuda_graphs=false`" + ", `model.compile_layers=true`" * compiled,
                      samples, steps, lambda s, k, c=compiled: agentrl_row(model, s, k, device, unlimited, smoke,
                                                                            profile, compile_layers=c or None,
                                                                            graphs=False)))
    for compiled in ((False, True) if compiled_row else (False,)) if stand_in_rows and not smoke else ():
        paths.append(("(as) agentrl trainer, the refused backward call in PyTorch" + ", `model.compile_layers=true`"
                      * compiled, samples, steps,
                      lambda s, k, c=compiled: agentrl_row(model, s, k, device, unlimited, smoke, profile,
                                                           compile_layers=c or None, stand_in=True)))
    if groups:
        paths.append(("(a') agentrl trainer, `trainer.share_prefix=false`", samples, steps,
                      lambda s, k: agentrl_row(model, s, k, device, unlimited, smoke, share=False)))
    if not skip_hf:
        paths.append(("(b) transformers, full fp32 logits", samples, steps,
                      lambda s, k: hf_row(model, s, k, device, unlimited, smoke, reference=False)))
        paths.append(("(c) transformers, torch reference kernels", reference_samples, 1,
                      lambda s, k: hf_row(model, s, k, device, limit_s, smoke, reference=True)))
    rows, results = [], {}
    for name, chosen, k, run in paths:
        result = run(chosen, k)
        model.zero_grad(set_to_none=True)
        free_memory(device)
        n = sum(len(s) for s in chosen)
        results[name] = result
        if "error" in result:
            rows.append([name, f"{len(chosen)} / {n:,}", result.get("layout", ""), None, None, None, None,
                         f"failed: {result['error']}"])
            continue
        mfu = train_flops(model, chosen)["total"] / result["seconds"] / PEAK_FLOPS
        rows.append([name, f"{len(chosen)} / {n:,}", result["layout"], result["seconds"], n / result["seconds"],
                     f"{mfu:.1%}", result["peak"], f"{result['kernel']}; {result['timed']}"])
    per_token = train_flops(model, samples)
    n = sum(len(s) for s in samples)
    types = list(model.config.layer_types)
    notes = [f"FLOPs a token on (a)'s samples: {per_token['dense'] / n / 1e9:.3f} G dense (6 x params) + "
             f"{per_token['attention'] / n / 1e9:.3f} G attention (the {types.count('full_attention')} attention "
             f"layers) + {per_token['delta'] / n / 1e9:.3f} G delta rule (the {types.count('linear_attention')} delta "
             f"nets); MFU over 790 TFLOP/s",
             "every step includes the optimizer (gradient clipping + AdamW, fused on CUDA: agentrl's `Stepper`); "
             "tok/s and MFU count real tokens only"]
    a = results["(a) agentrl trainer"]
    if "error" not in a:
        mfu = train_flops(model, samples)["total"] / a["seconds"] / PEAK_FLOPS
        notes.append(f"goal: (a) >= 30% MFU: {'met' if mfu >= 0.3 else 'NOT met'}")
    if not skip_hf:
        notes.append(f"(c) runs {reference_tokens:,} tokens (other samples of the same lengths' distribution) and one "
                     "timed step: transformers' torch reference delta rule is slow")
    columns = ["path", "samples / tokens", "layout", "s/step", "tok/s", "MFU", "peak GiB (allocated / reserved)",
               "kernels; timed"]
    return columns, rows, notes
