"""The training loop: finished groups from the ready pool → packed rows → chunked logprobs → loss → in-place step.

Generation never waits for training: the engine decodes in its own thread from the very parameters the
optimizer updates, the rollout driver keeps its batch full, and the trainer takes the oldest ready groups. The
optimizer step runs under `engine.pause()` so no decode step reads a half-updated set of weights, and the
version bump that follows tags every later token with the new policy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from agentrl.train.config import ConfigError, TrainConfig


def to_train_sample(traj):
    from agentrl.train.samples import TrainSample

    return TrainSample(input_ids=traj.input_ids, trainable=traj.trainable, behaviour_logprobs=traj.logprobs,
                       versions=traj.versions, advantage=traj.advantage, group_id=traj.group_id, reward=traj.reward)


class MetricsLog:
    """One JSON line per step, flushed at once so a crashed run keeps its curve; the same record goes to the
    configured trackers."""

    def __init__(self, path: Path, resume: bool, trackers=None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if resume else "w")
        self._trackers = trackers

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._trackers is not None:
            self._trackers.log(record)

    def close(self) -> None:
        self._file.close()
        if self._trackers is not None:
            self._trackers.close()


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    from agentrl import load_environment
    from agentrl.chat import ChatFormat
    from agentrl.engine import Engine, EngineConfig
    from agentrl.models import load_model
    from agentrl.rollout import PromptIterator, RolloutConfig, RolloutDriver, summarize
    from agentrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from agentrl.engine.model_view import compile_decoder_layers
    from agentrl.train.logprobs import is_hybrid, packed_token_logprobs, packing_error
    from agentrl.train.loss import loss_denominator, policy_loss
    from agentrl.train.tracking import Trackers
    from agentrl.train.optim import Stepper, build_optimizer, build_scheduler
    from agentrl.train.pack import pack_samples

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    env = load_environment(cfg.rollout.environment, **cfg.rollout.env_args)
    dataset = env.load_dataset(split="train", path=cfg.rollout.data, limit=cfg.rollout.data_limit)
    model, tokenizer = load_model(cfg.model.name, dtype=_dtype(cfg.model.dtype, device), device=device)
    attn_implementation = _attention_implementation(cfg, model, device)
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if is_hybrid(model) and cfg.model.hybrid_varlen:
        error = packing_error(model, hybrid_varlen=True)
        if error > 1e-2:  # measured in the zero-sync design: kernels ignoring boundaries differ by ~3, not ~1e-4
            raise RuntimeError(f"varlen kernels leak across packed samples (error {error:.3g}); "
                               "set model.hybrid_varlen=false to use the boundary-respecting path")

    fmt = ChatFormat(tokenizer, env.tools())
    engine = Engine(model, EngineConfig(**asdict(cfg.engine), max_model_len=cfg.rollout.max_sample_tokens,
                                        eos_token_ids=tuple(fmt.eos_token_ids), seed=cfg.seed), tokenizer=tokenizer)
    if cfg.model.compile_layers:  # the engine's view is a copy made above, with compiled layers of its own
        compile_decoder_layers(model, activation_memory_budget=cfg.model.activation_memory_budget)
    prompts = PromptIterator(dataset, seed=cfg.seed)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    stepper = Stepper(model, optimizer, scheduler, cfg.optim)

    run_dir = Path(cfg.checkpoint.run_dir)
    start_step = 0
    checkpoint = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, scheduler)
        start_step = state["step"]
        prompts.load_state_dict(state["extra"]["prompts"])
        stepper.load_state_dict(state["extra"]["stepper"])
        engine.bump_version(start_step)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    resumed = checkpoint is not None
    trackers = Trackers(cfg.checkpoint.report_to, run_dir, cfg.checkpoint.project, asdict(cfg), resumed)
    log = MetricsLog(run_dir / "metrics.jsonl", resume=resumed, trackers=trackers)

    r = cfg.rollout
    driver = RolloutDriver(env, engine, fmt, prompts, RolloutConfig(
        num_generations=r.group_size, rollouts_in_flight=r.rollouts_in_flight, max_turns=r.max_turns,
        max_tokens_per_turn=r.max_new_tokens, max_total_tokens=r.max_sample_tokens, temperature=r.temperature,
        seed=cfg.seed, advantage=cfg.loss.advantage, drop_truncated=r.drop_truncated,
        max_ready_samples=r.max_ready_batches * r.groups_per_step * r.group_size))
    samples_per_step = r.groups_per_step * r.group_size
    pad_multiple = cfg.row_pad_multiple if device == "cuda" else 1  # rows, or the flat layout's length
    engine.start()
    driver.start()
    last: dict = {}
    bar = _Progress(progress, cfg.steps, start_step)
    started = time.perf_counter()
    engine_before = engine.stats
    try:
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            groups = _take(driver, samples_per_step)
            waited = time.perf_counter() - t0
            trajectories = [t for g in groups for t in g.trajectories]
            samples = [to_train_sample(t) for t in trajectories if any(t.trainable)]
            # Everything a micro-batch needs is built on the host and copied without blocking; the only waits
            # on the device come after the last backward (the loss and the metrics).
            batch = pack_samples(samples, cfg.row_tokens, pad_token_id=tokenizer.pad_token_id or 0,
                                 pad_to_multiple=pad_multiple)
            version = engine.policy_version
            tokens = batch.trainable_tokens()
            denominator = float(loss_denominator(tokens, cfg.loss, version))
            if cfg.release_kv_during_step:
                engine.release_kv()
            t_train = time.perf_counter()
            loss_sum, pending = 0.0, []
            n_rows = batch.input_ids.shape[0]
            for first in range(0, n_rows, cfg.rows_per_micro_batch):
                host_micro = batch.select_rows(first, min(first + cfg.rows_per_micro_batch, n_rows))
                micro, micro_tokens = host_micro.to(device), host_micro.trainable_tokens().to(device)
                # Under the temperature the engine sampled with: the behaviour logprobs are of logits / T, and the
                # importance ratio must compare like with like.
                logprobs, entropy = packed_token_logprobs(model, micro, chunk_size=cfg.logprob_chunk_size,
                                                          hybrid_varlen=cfg.model.hybrid_varlen,
                                                          pad_multiple=pad_multiple, temperature=r.temperature)
                loss, metrics = policy_loss(logprobs, micro_tokens, cfg.loss, current_version=version,
                                            entropy=entropy, denominator=denominator, defer_metrics=True)
                loss.backward()
                loss_sum = loss_sum + loss.detach()
                pending.append(metrics)
            loss_total = float(loss_sum)
            metrics_rows = [m.resolve() for m in pending]
            with engine.pause():  # no decode step sees half the parameters updated
                result = stepper.step(torch.tensor(loss_total))
                engine.bump_version()
            if cfg.release_kv_during_step:
                engine.restore_kv()
            for group in groups:
                prompts.consumed(group.prompt)
            train_seconds = time.perf_counter() - t_train
            step_seconds = time.perf_counter() - t0
            engine_now = engine.stats
            engine_step = _engine_step_metrics(engine_before, engine_now, step_seconds)
            engine_before = engine_now
            last = {"step": step + 1, "loss": loss_total, "grad_norm": result.grad_norm, "lr": result.lr,
                    "skipped": result.skipped, "seconds": step_seconds, "wait_seconds": waited,
                    "train_seconds": train_seconds, "trained_tokens": batch.num_tokens,
                    "trained_tokens_per_s": batch.num_tokens / max(train_seconds, 1e-9),
                    "generated_tokens": int(tokens.target_ids.numel()), "rows": n_rows,
                    "ready_groups": len(driver.pool), "ready_pool_age_s": driver.pool.oldest_age(),
                    "rollouts_in_flight": driver.stats.in_flight,
                    **engine_step, **_merge(metrics_rows),
                    **{f"rollout/{k}": v for k, v in summarize(trajectories).items()},
                    **{f"engine/{k}": v for k, v in asdict(engine_now).items()}}
            if step % cfg.checkpoint.log_every == 0 or step + 1 == cfg.steps:
                log.write(last)
            bar.update(last)
            out_of_time = cfg.time_limit_s is not None and time.perf_counter() - started > cfg.time_limit_s
            saving = cfg.checkpoint.save_every and (step + 1) % cfg.checkpoint.save_every == 0
            if saving or step + 1 == cfg.steps or out_of_time:
                with engine.pause():
                    save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, keep_last=cfg.checkpoint.keep_last,
                                    extra={"prompts": prompts.state_dict(), "stepper": stepper.state_dict()})
            if out_of_time:
                break
        with engine.pause():
            # A plain model directory beside the checkpoints: what `agentrl eval --model` and users load.
            model.save_pretrained(run_dir / "final")
            tokenizer.save_pretrained(run_dir / "final")
    finally:
        driver.stop()
        engine.stop()
        log.close()
        bar.close()
    return last


def _attention_implementation(cfg: TrainConfig, model, device: str) -> str | None:
    """The training forward's attention (None: leave transformers' default, sdpa). On GPU the varlen kernel wherever
    the flat layout applies (dense models, or hybrid ones with varlen kernels) and flash can run (bf16/fp16)."""
    from agentrl.train.logprobs import is_hybrid
    from agentrl.train.varlen_attention import ATTN_IMPLEMENTATION, register, varlen_attention_available

    name = cfg.model.attn_implementation
    if name is None:
        if device != "cuda":
            return None
        flat = not is_hybrid(model) or cfg.model.hybrid_varlen
        half = model.dtype in (torch.float16, torch.bfloat16)
        name = ATTN_IMPLEMENTATION if flat and half and varlen_attention_available() else "flex_attention"
    if name == ATTN_IMPLEMENTATION:
        if not varlen_attention_available():
            raise RuntimeError(f"model.attn_implementation={ATTN_IMPLEMENTATION} needs CUDA with flash attention "
                               "(sm80 or newer); use flex_attention or sdpa here")
        register()  # transformers accepts only registered names
    return name


def _engine_step_metrics(before, after, seconds: float) -> dict:
    """What generation did during one trainer step: tokens/s, and the share of the step it sat idle (nothing to
    run) or paused (held off by the optimizer step or a checkpoint)."""
    seconds = max(seconds, 1e-9)
    return {"generated_tokens_per_s": (after.generated_tokens - before.generated_tokens) / seconds,
            "engine_idle_share": (after.idle_seconds - before.idle_seconds) / seconds,
            "engine_paused_share": (after.paused_seconds - before.paused_seconds) / seconds}


def _take(driver, n: int):
    while True:
        groups = driver.pool.take(n, timeout=1.0)
        if groups:
            return groups
        # A failed driver or engine thread would otherwise leave the trainer waiting forever.
        driver.check()
        driver.engine.check()


def _merge(rows: list[dict]) -> dict:
    """Token-weighted mean of micro-batch metrics (max / min keep their extreme; histograms add up)."""
    total = sum(r.get("tokens", 0) for r in rows) or 1
    out: dict = {}
    for key in {k for r in rows for k in r}:
        hists = [r[key] for r in rows if isinstance(r.get(key), dict)]
        if hists:
            merged: dict = {}
            for hist in hists:
                for bucket, count in hist.items():
                    merged[str(bucket)] = merged.get(str(bucket), 0) + count
            out[f"loss/{key}"] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
            continue
        values = [(r[key], r.get("tokens", 0)) for r in rows if key in r and isinstance(r[key], (int, float))]
        if not values:
            continue
        if key == "tokens":
            out[key] = sum(v for v, _ in values)
        elif key.endswith("max"):
            out[f"loss/{key}"] = max(v for v, _ in values)
        elif key.endswith("min"):
            out[f"loss/{key}"] = min(v for v, _ in values)
        else:
            out[f"loss/{key}"] = sum(v * w for v, w in values) / total
    return out


class _Progress:
    def __init__(self, enabled: bool, total: int, done: int):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self._bar = Progress(*Progress.get_default_columns(), "{task.fields[info]}", transient=False)
            self._task = self._bar.add_task("train", total=total, completed=done, info="")
            self._bar.start()

    def update(self, m: dict) -> None:
        if self._bar is not None:
            info = f"reward {m.get('rollout/reward', 0):.3f} tools {m.get('rollout/tool_call_rate', 0):.2f}"
            self._bar.update(self._task, advance=1, info=info)
        else:
            print(json.dumps({k: m[k] for k in ("step", "loss", "seconds") if k in m}
                             | {"reward": m.get("rollout/reward")}), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def parse_args(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser(prog="agentrl train", description="GRPO training of a tool-using agent.",
                                epilog="Any config key can be set as --section.key=value (e.g. --optim.lr=1e-6).")
    p.add_argument("env", help="environment name, e.g. hotpotqa_search or gsm8k_math")
    p.add_argument("--model", default=None, help="hub id, local dir, tiny-qwen3, or smollm2-135m-instruct")
    p.add_argument("--config", default=None, help="YAML file of config sections")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--data", default=None, help="local json/jsonl path; default: the environment's built-in data")
    p.add_argument("--run-dir", default=None)
    known, rest = p.parse_known_args(argv)
    overrides = [f"--rollout.environment={known.env}"]
    for flag, key in ((known.model, "model.name"), (known.max_steps, "steps"), (known.data, "rollout.data"),
                      (known.run_dir, "checkpoint.run_dir")):
        if flag is not None:
            overrides.append(f"--{key}={flag}")
    if known.run_dir is None and not any(a.lstrip("-").startswith("checkpoint.run_dir") for a in rest):
        overrides.append(f"--checkpoint.run_dir=runs/{known.env}")
    for item in rest:
        if not item.startswith("--") or "=" not in item:
            p.error(f"unrecognised argument {item!r}: overrides look like --section.key=value")
        overrides.append(item)
    if known.config:
        return TrainConfig.from_yaml(known.config, overrides)
    return TrainConfig.from_dict({}, overrides)


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)  # a bad config fails here, before any model is loaded
    except ConfigError as exc:
        print(f"agentrl train: invalid config: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(train(cfg)))
    return 0
