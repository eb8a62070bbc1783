"""TRL's GRPOTrainer and `agentrl train` side by side: one model, one prompt pool, one budget, one table.

Both systems train the same checkpoint on the same environment's prompts (rendered by agentrl's chat format, so
TRL sees the identical prompt text) and reward (TRL's reward function calls the environment's own reward on each
completion), one after the other in this process. agentrl runs `agentrl.run.train.train` with its default options;
only the mirrored budget fields are set. TRL's `GRPOConfig` is built from that same `TrainConfig` field by field
(`trl_fields`: the mapping table, printed with the fields that cannot be matched and why).

Per system: s/step (median over the steps after `--warmup-steps`), generated and trained tokens/s (the measured
steps' completion tokens, resp. prompt + completion tokens, over their wall time), peak GPU memory
(torch.cuda.max_memory_allocated, reset before each system) and the mean reward of the steps. TRL runs once per
generation backend available without vLLM: transformers `generate` (its default) and, where TRL offers it,
transformers' continuous batching.

usage: python benchmarks/vs_trl.py [--model smollm2-135m-instruct] [--data ../shared/data/gsm8k/train.jsonl]
           [--steps 30] [--warmup-steps 10] [--prompts 8] [--completions 8] [--max-new-tokens 128]
           [--trl-backends generate,continuous_batching] [--trl-micro-batch N] [--out table.md]
           [--agentrl-variants "rollout.rollouts_in_flight=64;trainer.row_tokens=8192,..."] [--again]
CPU smoke: python benchmarks/vs_trl.py --model tiny-qwen3 --steps 2 --prompts 2 --completions 2 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.run.config import TrainConfig

BACKENDS = {"generate": {}, "continuous_batching": {"use_transformers_continuous_batching": True}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--env", default="gsm8k_math")
    p.add_argument("--data", default="../shared/data/gsm8k/train.jsonl", help="'' for the built-in data")
    # The steady state: in 12-step runs three of the eight measured steps captured a shape bucket of the trainer's
    # graphs or ran one eagerly for the first time, and one row measured twice moved by a third (BENCHMARKS.md).
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=10, help="first steps left out of the medians and rates")
    p.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    p.add_argument("--completions", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--trl-backends", default="generate,continuous_batching")
    p.add_argument("--trl-micro-batch", type=int, default=None,
                   help="TRL's per-device batch (gradient accumulation makes up the rest); default: the whole step")
    p.add_argument("--out", default=None, help="also write the table here as markdown")
    p.add_argument("--agentrl-variants", default="",
                   help="more agentrl rows, ';'-separated, each a ','-separated list of key=value overrides of the "
                        "default config (what a default would gain by changing)")
    p.add_argument("--again", action="store_true",
                   help="the default row once more after the variants: what being the process's first row costs")
    return p.parse_args(argv)


def agentrl_config(args, run_dir: str, overrides: list[str] = ()) -> TrainConfig:
    """agentrl's defaults with the mirrored budget set: one answer turn, no tools (the calculator is off);
    `overrides` (`key=value`) on top, for a variant row."""
    data = args.data if args.data and Path(args.data).exists() else None
    if args.data and data is None:
        print(f"vs_trl: {args.data} not found; both systems use the environment's built-in data", file=sys.stderr)
    return TrainConfig.from_dict({
        "steps": args.steps,
        "env": {"name": args.env, "data": data, "args": {"use_calculator": False} if args.env == "gsm8k_math" else {}},
        "model": {"name": args.model},
        "rollout": {"group_size": args.completions, "groups_per_step": args.prompts, "max_turns": 1,
                    "max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        "optim": {"lr": args.lr},
        "checkpoint": {"run_dir": run_dir, "save_every": 0, "resume": False},
    }, overrides=list(overrides))


def trl_fields(cfg: TrainConfig, *, cuda: bool, micro_batch: int | None = None) -> tuple[dict, list, list]:
    """(GRPOConfig keyword arguments, mapping rows (ours, ours' value, TRL field, TRL value), unmatched rows
    (ours, why)) for `cfg`. One optimizer step per generation batch, as ours: one step per `samples_per_step`."""
    r, loss, optim = cfg.rollout, cfg.loss, cfg.optim
    n = r.samples_per_step
    micro = micro_batch or n
    if n % micro:
        raise ValueError(f"--trl-micro-batch {micro} does not divide the {n} samples of a step")
    dtype = ("bfloat16" if cuda else "float32") if cfg.model.dtype == "auto" else cfg.model.dtype
    scale = {"mean_std": "group", "mean": "none"}[r.advantage]
    optimizer = "adamw_torch_fused" if cuda else "adamw_torch"
    schedule = ("cosine", None) if optim.min_lr_ratio == 0 else ("cosine_with_min_lr",
                                                                  {"min_lr_rate": optim.min_lr_ratio})
    rows = [  # ours, its value, TRL's field, its value
        ("rollout.group_size", r.group_size, "num_generations", r.group_size),
        ("rollout.groups_per_step × group_size", n, "generation_batch_size", n),
        ("one optimizer step per batch", n, "per_device_train_batch_size × gradient_accumulation_steps",
         (micro, n // micro)),
        ("rollout.max_new_tokens", r.max_new_tokens, "max_completion_length", r.max_new_tokens),
        ("rollout.temperature", r.temperature, "temperature", r.temperature),
        ("rollout.top_p", r.top_p, "top_p", r.top_p),
        ("rollout.top_k", r.top_k, "top_k", r.top_k),
        ("rollout.advantage", r.advantage, "scale_rewards", scale),
        ("rollout.drop_truncated", r.drop_truncated, "mask_truncated_completions", r.drop_truncated),
        ("optim.lr", optim.lr, "learning_rate", optim.lr),
        ("optim.warmup_steps", optim.warmup_steps, "warmup_steps", optim.warmup_steps),
        ("optim.min_lr_ratio (warmup + cosine)", optim.min_lr_ratio, "lr_scheduler_type (+ kwargs)", schedule),
        ("optim.weight_decay", optim.weight_decay, "weight_decay", optim.weight_decay),
        ("optim.betas", optim.betas, "adam_beta1, adam_beta2", tuple(optim.betas)),
        ("optim.eps", optim.eps, "adam_epsilon", optim.eps),
        ("optim.max_grad_norm", optim.max_grad_norm, "max_grad_norm", optim.max_grad_norm or 0.0),
        ("AdamW (fused on CUDA)", "adamw", "optim", optimizer),
        ("loss.type", loss.type, "loss_type", loss.type),
        ("loss.clip_eps", loss.clip_eps, "epsilon", loss.clip_low),
        ("loss.clip_eps_high (None: clip_eps)", loss.clip_eps_high, "epsilon_high", loss.clip_high),
        ("no KL, no reference model", None, "beta", 0.0),
        ("one update per batch", 1, "num_iterations", 1),
        ("model.dtype", cfg.model.dtype, "model_init_kwargs.dtype, bf16", (dtype, dtype == "bfloat16")),
        ("model.gradient_checkpointing", cfg.model.gradient_checkpointing, "gradient_checkpointing",
         cfg.model.gradient_checkpointing),
        ("steps", cfg.steps, "max_steps", cfg.steps),
        ("seed", cfg.seed, "seed", cfg.seed),
        ("environment reward (env.total_reward)", cfg.env.name, "reward_funcs", "env.total_reward on the text"),
        ("chat format's end-of-turn ids", "fmt.eos_token_ids", "generation_kwargs.eos_token_id", "the same ids"),
    ]
    kwargs = dict(
        num_generations=r.group_size, generation_batch_size=n, per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro, max_completion_length=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, top_k=r.top_k, scale_rewards=scale, mask_truncated_completions=r.drop_truncated,
        learning_rate=optim.lr, warmup_steps=optim.warmup_steps, lr_scheduler_type=schedule[0],
        lr_scheduler_kwargs=schedule[1], weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_epsilon=optim.eps, max_grad_norm=optim.max_grad_norm or 0.0,
        optim=optimizer, loss_type=loss.type, epsilon=loss.clip_low, epsilon_high=loss.clip_high, beta=0.0,
        num_iterations=1, model_init_kwargs={"dtype": dtype}, bf16=dtype == "bfloat16",
        gradient_checkpointing=cfg.model.gradient_checkpointing, max_steps=cfg.steps, seed=cfg.seed,
        # Bookkeeping only: log every step, write nothing.
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    unmatched = [
        ("loss.tis_cap", f"{loss.tis_cap}: ours caps the importance weight against the engine's behaviour logprobs "
         "(generation runs beside training); TRL's transformers path generates on-policy and has no behaviour "
         "logprobs (its vllm_importance_sampling_* options apply only with use_vllm)"),
        ("loss.max_staleness, loss.stale_weight", "ours bounds the staleness of asynchronous rollouts; TRL "
         "generates and trains in turn, so nothing is stale"),
        ("rollout.rollouts_in_flight, max_ready_batches", "ours generates continuously beside the trainer; TRL "
         "generates each step's batch, then trains on it"),
        ("rollout.max_sample_tokens", f"{r.max_sample_tokens}: ours cuts a rollout past it; TRL has no prompt cap "
         "(GSM8K prompts are far below it)"),
        ("rollout.max_turns, tools", "one turn, no tool schema (env.args.use_calculator=false for gsm8k_math); "
         "TRL's tool loop is not used"),
        ("trainer.* (row_tokens, share_prefix, ...)", "ours packs samples into rows and computes a group's "
         "prompt once; TRL pads each micro-batch (--trl-micro-batch sets its size)"),
        ("trainer.skip_zero_advantage", f"{cfg.trainer.skip_zero_advantage}: ours leaves the samples of zero "
         "advantage (a group that scored alike) out of the forward and backward, as they add nothing to the "
         "gradient; TRL computes them. Trained tokens/s count every sample of the step in both"),
        ("engine.gpu_memory_fraction", f"{cfg.engine.gpu_memory_fraction}: ours sizes its KV pool up front from "
         "the free GPU memory, and the peak includes it; TRL's generate allocates a cache per batch"),
        ("model.attn_implementation", "ours: varlen flash attention on GPU (sdpa on CPU); TRL: transformers' "
         "default"),
        ("chat template", "TRL gets each prompt as the text agentrl's ChatFormat renders (no tokenizer template)"),
        ("prompt order", "both draw from the same rows, each in its own seeded shuffle"),
        ("reward text", "TRL decodes completions without special tokens; ours keeps them (the answer is the same)"),
    ]
    if loss.type == "dr_grpo" and loss.dr_grpo_max_tokens != r.max_new_tokens:
        unmatched.append(("loss.dr_grpo_max_tokens", f"{loss.dr_grpo_max_tokens}: TRL's dr_grpo divides by "
                          f"max_completion_length ({r.max_new_tokens})"))
    if optim.warmup_steps:
        unmatched.append(("optim.warmup_steps (shape)", "ours warms up from 1/warmup, transformers' from 0"))
    return kwargs, rows, unmatched


@dataclass
class Steps:
    """Per-step measurements of one system."""
    name: str
    seconds: list = field(default_factory=list)
    generated: list = field(default_factory=list)
    trained: list = field(default_factory=list)
    reward: list = field(default_factory=list)
    waited: list = field(default_factory=list)  # agentrl: seconds the step waited for finished rollouts
    trained_s: list = field(default_factory=list)  # agentrl: seconds of the trainer's step (optimizer included)
    packed_s: list = field(default_factory=list)  # agentrl: seconds of packing the step's batch, before the above
    rest_s: list = field(default_factory=list)  # agentrl: the step's seconds less its wait, packing and trainer step
    captured: list = field(default_factory=list)  # agentrl: CUDA graphs the trainer captured in the step
    staleness: list = field(default_factory=list)  # agentrl: trained tokens' mean age in policy versions
    left_out: list = field(default_factory=list)  # agentrl: (samples of zero advantage, samples) a step
    compiling: list = field(default_factory=list)  # agentrl: (trainer's, engine's) seconds of torch.compile
    peak_gib: float | None = None
    error: str | None = None

    def summary(self, warmup: int) -> dict:
        skip = warmup if len(self.seconds) > warmup else 0
        secs = sum(self.seconds[skip:]) or float("nan")
        return {"s/step": statistics.median(self.seconds[skip:]), "gen tok/s": sum(self.generated[skip:]) / secs,
                "trained tok/s": sum(self.trained[skip:]) / secs,
                "reward": statistics.fmean(self.reward) if self.reward else float("nan")}


def measured(fn, name: str) -> Steps:
    """Run `fn(steps)` with peak GPU memory reset before and read after; a failure becomes the row's note."""
    import torch
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    steps = Steps(name)
    try:
        fn(steps)
    except Exception as exc:  # one system failing still leaves the others' rows
        steps.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
        print(f"vs_trl: {name} failed: {steps.error}", file=sys.stderr)
    if cuda:
        steps.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    return steps


def run_agentrl(cfg: TrainConfig, steps: Steps) -> None:
    from agentrl.run.train import train

    train(cfg, progress=False)
    for line in (Path(cfg.checkpoint.run_dir) / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        steps.seconds.append(m["seconds"])
        steps.generated.append(m["generated_tokens"])
        steps.trained.append(m["trained_tokens"])
        steps.reward.append(m["rollout/reward"])
        steps.waited.append(m["wait_seconds"])
        steps.trained_s.append(m["train_seconds"])
        steps.packed_s.append(m.get("pack_seconds", 0.0))
        steps.rest_s.append(m["seconds"] - m["wait_seconds"] - m["train_seconds"] - m.get("pack_seconds", 0.0))
        steps.captured.append(m.get("flat_graphs_captured", 0))
        steps.staleness.append(m.get("loss/staleness_mean"))  # none where the step ran no sample
        steps.left_out.append((m.get("zero_advantage_samples", 0), m.get("rollout/n", 0)))
        steps.compiling.append((m.get("compile_seconds_trainer", 0.0), m.get("compile_seconds_engine", 0.0)))


def plain_model_dir(name: str, tmp: Path) -> Path:
    """The plain checkpoint directory TRL loads: the embedded model's converted copy, a tiny model saved here
    with its tokenizer, or a local directory / hub id as given."""
    from agentrl import models

    if name == models.EMBEDDED:
        return models.embedded_model_dir()
    if name in models.TINY_MODELS:
        model, tok = models.load_model(name)
        model.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
        return tmp / name
    return Path(models.locate_model(name)[0])


def run_trl(cfg: TrainConfig, kwargs: dict, model_dir: Path, out_dir: str, steps: Steps) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.chat import ChatFormat
    from agentrl.env import Episode
    from agentrl.run.build import load_env_and_data

    env, rows = load_env_and_data(cfg.env, split="train")
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    fmt = ChatFormat(tok, env.tools())
    # One TRL row per environment row: the prompt text agentrl renders, and the row's index for the reward.
    dataset = Dataset.from_dict({"prompt": [fmt.render(env.prompt(s), add_generation_prompt=True) for s in rows],
                                 "row": list(range(len(rows)))})

    def reward(prompts, completions, completion_ids, row, **_):
        values = []
        for text, index in zip(completions, row):
            sample = rows[index]
            episode = Episode(sample=sample, messages=env.prompt(sample) + [{"role": "assistant", "content": text}],
                              num_prompt_messages=len(env.prompt(sample)), final_text=text, done=True)
            values.append(env.total_reward(episode)[0])
        prompt_tokens = sum(len(tok(p)["input_ids"]) for p in prompts)
        generated = sum(len(ids) for ids in completion_ids)
        steps.generated.append(generated)
        steps.trained.append(generated + prompt_tokens)
        steps.reward.append(statistics.fmean(values))
        return values

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            steps.seconds.append(now - self.last)
            self.last = now

    config = GRPOConfig(output_dir=out_dir, generation_kwargs={"eos_token_id": list(fmt.eos_token_ids)}, **kwargs)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepClock()])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    trainer.train()
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt_ids_match(cfg: TrainConfig, model_dir: Path) -> bool:
    """Whether TRL's tokenization of the rendered prompt text gives agentrl's prompt ids (first row)."""
    from transformers import AutoTokenizer

    from agentrl.chat import ChatFormat
    from agentrl.run.build import load_env_and_data

    env, rows = load_env_and_data(cfg.env, split="train", limit=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    fmt = ChatFormat(tok, env.tools())
    messages = env.prompt(rows[0])
    return tok(fmt.render(messages, add_generation_prompt=True))["input_ids"] == fmt.prompt_ids(messages)


def _mean_or_dash(values: list) -> str:
    return f"{statistics.fmean(values):.2f}" if values else "-"


def render(args, results: list[Steps], rows: list, unmatched: list, header: list[str]) -> str:
    ours = next((s for s in results if s.name == "agentrl" and not s.error), None)
    base = ours.summary(args.warmup_steps)["s/step"] if ours and ours.seconds else None
    lines = [*header, "", "| system | s/step (median) | generated tok/s | trained tok/s | peak GPU GiB | reward "
             "(mean of steps) | s/step ÷ agentrl default |", "|---|---:|---:|---:|---:|---:|---:|"]
    for s in results:
        if s.error or not s.seconds:
            lines.append(f"| {s.name} | failed: {s.error or 'no steps'} | | | | | |")
            continue
        m = s.summary(args.warmup_steps)
        peak = f"{s.peak_gib:.2f}" if s.peak_gib is not None else "n/a (CPU)"
        speed = f"{m['s/step'] / base:.2f}×" if base else "—"
        lines.append(f"| {s.name} | {m['s/step']:.3f} | {m['gen tok/s']:.0f} | {m['trained tok/s']:.0f} | {peak} "
                     f"| {m['reward']:.3f} | {speed} |")
    for s in results:
        skip = args.warmup_steps if len(s.waited) > args.warmup_steps else 0
        if s.waited[skip:] and not s.error:
            lines.append(f"{s.name}: a step's median wait for finished rollouts "
                         f"{statistics.median(s.waited[skip:]):.3f} s, median trainer step "
                         f"{statistics.median(s.trained_s[skip:]):.3f} s, median packing "
                         f"{statistics.median(s.packed_s[skip:]):.3f} s, median rest of the step "
                         f"{statistics.median(s.rest_s[skip:]):.3f} s, trained tokens' mean staleness "
                         f"{_mean_or_dash([v for v in s.staleness[skip:] if v is not None])} policy versions, "
                         f"samples of zero advantage (left out of the forward by default) "
                         f"{sum(z for z, _ in s.left_out[skip:])} of {sum(n for _, n in s.left_out[skip:])}.")
    lines += ["", "Seconds per step: " + "; ".join(f"{s.name} [{', '.join(f'{v:.3f}' for v in s.seconds)}]"
                                                  for s in results if s.seconds)]
    captures = [f"{s.name}: steps {[i + 1 for i, c in enumerate(s.captured) if c]}" for s in results if any(s.captured)]
    if captures:
        lines.append("Steps in which the trainer captured CUDA graphs (a bucket's second micro-batch): "
                     + "; ".join(captures))
    compiles = [f"{s.name}: " + ", ".join(f"step {i + 1} ({t:.1f} s trainer, {e:.1f} s engine)"
                                          for i, (t, e) in enumerate(s.compiling) if t + e >= 0.05)
                for s in results if any(t + e >= 0.05 for t, e in s.compiling)]
    if compiles:
        lines.append("Steps in which torch.compile ran (its seconds by thread): " + "; ".join(compiles))
    lines += ["", "Reward per step: " + "; ".join(f"{s.name} [{', '.join(f'{v:.2f}' for v in s.reward)}]"
                                                 for s in results if s.reward)]
    trl = [(s.summary(args.warmup_steps)["s/step"], s.name) for s in results
           if s.name.startswith("TRL") and s.seconds and not s.error]
    if len(trl) > 1:
        lines.append(f"Faster TRL backend: {min(trl)[1]}.")
    lines += ["", "| agentrl | value | TRL GRPOConfig | value |", "|---|---|---|---|"]
    lines += [f"| {a} | {va} | {b} | {vb} |" for a, va, b, vb in rows]
    lines += ["", "| not matched | why |", "|---|---|"] + [f"| {a} | {why} |" for a, why in unmatched]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    import trl

    from agentrl.run.run_dir import write_atomic

    backends = [b for b in args.trl_backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"vs_trl: unknown TRL backend(s) {sorted(unknown)}; choose from {sorted(BACKENDS)}")
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp_name:
        tmp = Path(tmp_name)
        cfg = agentrl_config(args, str(tmp / "agentrl"))
        kwargs, rows, unmatched = trl_fields(cfg, cuda=cuda, micro_batch=args.trl_micro_batch)
        model_dir = plain_model_dir(cfg.model.name, tmp)
        same_prompt = prompt_ids_match(cfg, model_dir)
        results = [measured(lambda s: run_agentrl(cfg, s), "agentrl")]
        for i, variant in enumerate(v for v in args.agentrl_variants.split(";") if v.strip()):
            overrides = ["--" + o.strip().removeprefix("--") for o in variant.split(",") if o.strip()]
            other = agentrl_config(args, str(tmp / f"agentrl-{i}"), overrides)
            results.append(measured(lambda s: run_agentrl(other, s), f"agentrl {' '.join(overrides)}"))
        if args.again:
            again = agentrl_config(args, str(tmp / "agentrl-again"))
            results.append(measured(lambda s: run_agentrl(again, s), "agentrl, default options again"))
        for backend in backends:
            options = {**kwargs, **BACKENDS[backend]}
            results.append(measured(lambda s: run_trl(cfg, options, model_dir, str(tmp / f"trl-{backend}"), s),
                                    f"TRL {backend}"))
    device = torch.cuda.get_device_name() if cuda else "CPU"
    measured_steps = (f"the steps after the first {args.warmup_steps}" if args.steps > args.warmup_steps
                      else "all steps (--steps is not above --warmup-steps)")
    header = [f"## agentrl vs TRL {trl.__version__} GRPOTrainer (transformers {transformers.__version__}, "
              f"torch {torch.__version__}, {device})", "",
              f"{cfg.model.name} on {cfg.env.name} ({cfg.env.data or 'built-in data'}): {args.prompts} prompts × "
              f"{args.completions} completions a step, ≤ {args.max_new_tokens} new tokens, temperature "
              f"{args.temperature}, lr {args.lr}, {args.steps} steps, medians and rates over {measured_steps}. "
              f"Tokens/s: the measured steps' completion (generated) or prompt + completion (trained) tokens over "
              f"their wall time. Prompt ids identical in both systems: "
              f"{'yes' if same_prompt else 'NO'}."]
    text = render(args, results, rows, unmatched, header)
    print(text)
    if args.out:
        write_atomic(Path(args.out), text)
    return 0 if all(not s.error for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
