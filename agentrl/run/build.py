"""The one place that wires a run: environment → chat format → model → engine → rollout driver → trainer.

`build_run(cfg)` builds every part from its own config section and restores the latest checkpoint; `step(run)`
takes the oldest finished groups from the ready pool, trains on them and returns the step's metrics. Generation
never waits for training: the engine decodes in its own thread from the very parameters the optimizer updates,
the driver keeps its batch full, and the optimizer step runs under `engine.pause()` followed by the version bump
that tags every later token with the new policy. `agentrl eval` builds its parts with the same functions.
A run launched on several processes (`agentrl.run.distributed`) alternates generation and training instead, and
pools, shares out and sums what its replicas generate and train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentrl import compile_watch
from agentrl.chat import ChatFormat
from agentrl.chat.template import TOOL_TAGS
from agentrl.engine import Engine, EngineConfig
from agentrl.engine.model_view import compile_decoder_layers
from agentrl.env import Environment, load_environment
from agentrl.env.config import EnvConfig
from agentrl import models
from agentrl.rollout import PromptIterator, RolloutConfig, RolloutDriver, summarize
from agentrl.run.config import TrainConfig
from agentrl.run.distributed import ParallelRun, restore_rollout_state, warn
from agentrl.run.interrupt import critical
from agentrl.train.checkpoint import latest_checkpoint, load_checkpoint
from agentrl.train.config import ModelConfig
from agentrl.train import delta_rule_backward
from agentrl.train.cudnn_attention import cudnn_kernel, cudnn_varlen_available
from agentrl.train.fa4_attention import fa4_kernel, fa4_varlen_available
from agentrl.train.linear_conv import install_wrappers, use_reference_delta_rule, uses_reference_delta_rule
from agentrl.train.logprobs import is_hybrid, packed_backward_failure, packing_error, varlen_kernels_installed
from agentrl.train.optim import retarget_schedule
from agentrl.train.trainer import Trainer
from agentrl.train.varlen_attention import (ATTN_IMPLEMENTATION, CUDNN_IMPLEMENTATION, FA4_IMPLEMENTATION, register,
                                            takes_flat_layout, varlen_attention_available)


@dataclass
class Run:
    cfg: TrainConfig
    env: Environment
    fmt: ChatFormat
    model: torch.nn.Module
    tokenizer: object
    engine: Engine
    prompts: PromptIterator
    driver: RolloutDriver
    trainer: Trainer
    run_dir: Path
    start_step: int = 0
    steps_done: int = 0  # the last step whose update finished
    resumed: bool = False
    sample_log: object = None  # agentrl.run.replay.SampleLog when metrics.log_samples
    engine_stats: object = None  # the engine's counters at the end of the last step
    compiled_frames: int = 0  # frames dynamo had compiled by the end of the last step (`compiled_frames`)
    compile_seconds: dict = field(default_factory=dict)  # compile_watch's seconds by thread at the same point
    started: float = field(default_factory=time.perf_counter)
    parallel: ParallelRun | None = None  # this process's place in a run of several; None for one process
    froze: bool = False  # whether this run froze the objects its start left (`freeze_start_objects`)


# ------------------------------------------------------------------------------------------------ the parts


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_env_and_data(cfg: EnvConfig, split: str, limit: int | None = None) -> tuple[Environment, list[dict]]:
    env = load_environment(cfg.name, **cfg.args)
    return env, cfg.rows(list(env.load_dataset(split=split, path=cfg.data, limit=cfg.load_limit(limit))), limit)


def chat_format(tokenizer, env: Environment, cfg: ModelConfig) -> ChatFormat:
    """The conversation's token format: the tokenizer's template (or agentrl's) with the env's tools."""
    return ChatFormat(tokenizer, env.tools(), text_tags=TOOL_TAGS if cfg.tool_tags == "text" else ())


def load_policy(cfg: ModelConfig, device: str):
    """The model (in the config's dtype, on `device`, in eval mode) and its tokenizer, for generation alone."""
    model, tokenizer = _load(cfg, device)
    model.eval()
    return model, tokenizer


def load_trainable_policy(cfg: ModelConfig, device: str):
    """The model in train mode with the training forward's attention, its tokenizer, and whether a hybrid model's
    packed rows go to varlen kernels (`model.hybrid_varlen` resolved and verified on this model)."""
    model, tokenizer = _load(cfg, device)
    return _trainable(cfg, model, tokenizer, device)


def _load(cfg: ModelConfig, device: str):
    auto = torch.bfloat16 if device == "cuda" else torch.float32
    dtype = auto if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    return models.load_model(cfg.name, dtype=dtype, device=device)


def _trainable(cfg: ModelConfig, model, tokenizer, device: str):
    check_hybrid_kernels(cfg, model, device)
    varlen = is_hybrid(model) and hybrid_varlen(cfg, device)
    attn_implementation = attention_implementation(cfg, model, device)
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if varlen:
        # Relative to the hidden states' scale: kernels that ignore sample boundaries mix another sample's inputs
        # in, an error of the order of the states themselves (3.76 on a tiny model whose states reach ~4); bf16
        # rounding is ~2^-8 of the scale per operation (an absolute bound tripped on larger states).
        error = packing_error(model, hybrid_varlen=True, relative=True)
        if error > 0.1:
            if cfg.hybrid_varlen:
                raise RuntimeError(f"varlen kernels leak across packed samples (relative error {error:.3g}); "
                                   "set model.hybrid_varlen=false to use the boundary-respecting path")
            # The default: say so and take the exact per-sample path, never rows whose samples leak state.
            warn(f"the linear-attention kernels here leak state across packed samples (relative error {error:.3g}); "
                 "training runs each sample on its own instead (exact, slower)")
            varlen = False
            model.set_attn_implementation(attention_implementation(
                dataclasses.replace(cfg, hybrid_varlen=False), model, device))
    if varlen:
        # fla refuses one backward kernel on some Triton and GPU pairs: ours in its place, before the check below
        delta_rule_backward.install()
        failure = packed_backward_failure(model)
        if failure is not None:
            # The forward is fine (checked above): keep the packed rows and swap only the delta rule.
            warn(f"the linear-attention kernels cannot train here ({failure}); their delta rule runs sample by "
                 "sample inside the packed rows instead (PyTorch reference: exact, slower)")
            use_reference_delta_rule(model)
            failure = packed_backward_failure(model)
            if failure is not None:
                raise RuntimeError(f"the hybrid model cannot train on packed rows here ({failure}); "
                                   "set model.hybrid_varlen=false")
    return model, tokenizer, varlen


def hybrid_varlen(cfg: ModelConfig, device: str) -> bool:
    """Whether a hybrid model's packed rows go to varlen kernels (`model.hybrid_varlen`; None: on GPU)."""
    return cfg.hybrid_varlen if cfg.hybrid_varlen is not None else device == "cuda"


def fla_trains_it(cfg: ModelConfig, model, device: str) -> bool:
    """Whether a model is dense, or hybrid with its packed rows through flash-linear-attention's varlen kernels
    (not each sample on its own, nor the delta rule's per-sequence reference where fla cannot train)."""
    return not is_hybrid(model) or (hybrid_varlen(cfg, device) and not uses_reference_delta_rule(model))


def compile_layers(cfg: ModelConfig, model, device: str, *, tp_size: int = 1, deterministic: bool = False) -> bool:
    """Whether the trainer's decoder layers are compiled (`model.compile_layers`; None: on for CUDA runs, a hybrid
    model's through its varlen kernels, neither tensor-parallel nor deterministic; ModelConfig says why each
    exception is one).

    The engine's view compiles its copies of the same layers on its own thread (`engine_config`). Both threads run
    the same code objects, and dynamo keeps one cache per code object: each thread's new variants (grad mode,
    masks, sizes) are more compiles, which is what stalled two early GPU runs. The engine's compiles now happen in
    its warm-up (every decode and mixed-step bucket captured at the first step that needs it) and the trainer's
    layers compile dynamic from the first step, so both land in the first steps; the 200-step GPU test
    (tests/run/test_long_run_gpu.py) checks that no later step pays for one."""
    if cfg.compile_layers is not None:
        return cfg.compile_layers
    return device == "cuda" and fla_trains_it(cfg, model, device) and tp_size == 1 and not deterministic


# The trainer's layers see a new packed length at almost every micro-batch. Compiled for dynamic lengths from the
# first one, they compile in the first step only; left to dynamo's default they compile static first and again,
# dynamic, at the second length seen. With all of a step's rows in one forward/backward (the micro-batch default
# for small models) and no prefix-sharing check in the first step, that is the second step, which a compile makes
# many times slower than the rest (tests/train/test_compile_default.py).
TRAINER_COMPILE = {"dynamic": True}


def compile_trainer_layers(cfg: TrainConfig, model, device: str, **options) -> bool:
    """Compile the trainer's decoder layers where `compile_layers` resolves to true; returns whether it did. Call it
    after the engine's view is made: the view's copies must not carry the trainer's compiled calls. `options` go to
    `Module.compile` over `TRAINER_COMPILE` (a test's cheap backend)."""
    if not compile_layers(cfg.model, model, device, tp_size=cfg.parallel.tp_size, deterministic=cfg.deterministic):
        return False
    if is_hybrid(model):
        # The convolution and the chunked delta rule as graph breaks on every path, the per-sample one included:
        # traced, the PyTorch reference rule's padding to whole chunks fails inductor's lowering with dynamic shapes.
        install_wrappers(model)
        # The backward's PyTorch stand-in for the kernel fla refuses here, if it is called at all, compiled as well.
        delta_rule_backward.compile_stand_in(**{k: v for k, v in options.items() if k == "backend"})
    compile_decoder_layers(model, activation_memory_budget=cfg.model.activation_memory_budget,
                           **{**TRAINER_COMPILE, **options})
    return True


def trainer_graphs(cfg: TrainConfig, model, device: str) -> bool:
    """Whether the trainer replays its flat forward and backward from CUDA graphs (`trainer.cuda_graphs`; None: on
    for CUDA runs under the varlen attention, a hybrid model's through its varlen kernels, save the exceptions
    TrainerConfig gives reasons for)."""
    if cfg.trainer.cuda_graphs is not None:
        return cfg.trainer.cuda_graphs
    # A hybrid's delta rule through the per-sequence reference (where fla cannot train) reads the row's boundaries
    # on the host: no capture could take it.
    return (device == "cuda" and takes_flat_layout(model) and fla_trains_it(cfg.model, model, device)
            and cfg.parallel.tp_size == 1
            and not cfg.deterministic and not cfg.release_kv_during_step)


def check_hybrid_kernels(cfg: ModelConfig, model, device: str) -> None:
    """A hybrid model trained through varlen kernels needs flash-linear-attention: say which extra installs it.
    (transformers' torch fallback of those layers ignores sample boundaries: never run packed rows through it.)"""
    if is_hybrid(model) and hybrid_varlen(cfg, device) and not varlen_kernels_installed():
        default = " (the default on GPU)" if cfg.hybrid_varlen is None else ""
        raise ValueError(f"{cfg.name} has linear-attention layers, and training them on packed rows{default} needs "
                            "flash-linear-attention: pip install 'agentrl[gpu]' (or set model.hybrid_varlen=false "
                            "for the slower per-sample path)")


def attention_implementation(cfg: ModelConfig, model, device: str) -> str | None:
    """The training forward's attention (None: leave transformers' default, sdpa). On GPU a varlen kernel wherever
    the flat layout applies (dense models, or hybrid ones with varlen kernels) and it can run (bf16/fp16): for dense
    models cuDNN's on Hopper where NVIDIA's cudnn-frontend is installed (measured faster there: BENCHMARKS.md, train
    step), traced into the compiled layers (`varlen_attention.make_attention`); else flash attention's. A hybrid
    model keeps flash's with its compiled layers broken around it, the path its GPU figures were measured on
    (cuDNN's or a traced attention there: never measured)."""
    name = cfg.attn_implementation
    if name is None:
        if device != "cuda":
            return None
        flat = not is_hybrid(model) or hybrid_varlen(cfg, device)
        half = model.dtype in (torch.float16, torch.bfloat16)
        if (flat and half and not is_hybrid(model) and cudnn_varlen_available()
                and torch.cuda.get_device_capability() == (9, 0)):
            name = CUDNN_IMPLEMENTATION
        elif flat and half and varlen_attention_available():
            name = ATTN_IMPLEMENTATION
        else:  # transformers refuses flex_attention for hybrid models; their per-sample path pads, sdpa serves it
            name = "sdpa" if is_hybrid(model) else "flex_attention"
    traced = not is_hybrid(model)
    if name == ATTN_IMPLEMENTATION:
        if not varlen_attention_available():
            raise RuntimeError(f"model.attn_implementation={ATTN_IMPLEMENTATION} needs CUDA with flash attention "
                               "(sm80 or newer); use flex_attention or sdpa here")
        register(traced=traced)  # transformers accepts only registered names
    elif name == CUDNN_IMPLEMENTATION:
        if not cudnn_varlen_available():
            raise RuntimeError(f"model.attn_implementation={CUDNN_IMPLEMENTATION} needs CUDA (sm80 or newer) and "
                               "NVIDIA's cudnn-frontend: pip install nvidia-cudnn-frontend")
        register(CUDNN_IMPLEMENTATION, cudnn_kernel, traced=traced)
    elif name == FA4_IMPLEMENTATION:
        if not fa4_varlen_available():
            raise RuntimeError(f"model.attn_implementation={FA4_IMPLEMENTATION} needs CUDA on Hopper (sm90) and "
                               "FlashAttention-4: pip install flash-attn-4")
        register(FA4_IMPLEMENTATION, fa4_kernel, traced=traced)
    return name


def engine_config(cfg: EngineConfig, rollout: RolloutConfig, seed: int, eos_token_ids: tuple[int, ...], *,
                  deterministic: bool = False) -> EngineConfig:
    """The engine section with what it leaves unset taken from the run: the longest rollout, the chat format's
    end-of-turn ids, the run's seed. The view's layers compile as the engine decides (`EngineConfig.compile`),
    in training too: the 200-step GPU test passed with both threads compiled and failed with the view eager (a
    capture and a compile in step 4 at 7x the median), and the RL step measured faster (BENCHMARKS.md). A
    deterministic run keeps the view eager and recomputes KV after each update, so a resumed run (whose cache
    starts empty) computes what the straight run did."""
    return dataclasses.replace(
        cfg, max_model_len=cfg.max_model_len or rollout.max_sample_tokens,
        eos_token_ids=cfg.eos_token_ids if cfg.eos_token_ids is not None else tuple(eos_token_ids),
        seed=seed, compile=cfg.compile if cfg.compile is not None or not deterministic else False,
        kv_on_update="recompute" if deterministic else cfg.kv_on_update)


def make_engine(model, tokenizer, fmt: ChatFormat, cfg: EngineConfig, rollout: RolloutConfig, seed: int, *,
                deterministic: bool = False) -> Engine:
    """The engine over `model`'s own parameters (no copy)."""
    config = engine_config(cfg, rollout, seed, fmt.eos_token_ids, deterministic=deterministic)
    return Engine(model, config, tokenizer=tokenizer)


# ------------------------------------------------------------------------------------------------ the run


def build_run(cfg: TrainConfig, checkpoint: Path | None | str = "latest", parallel: ParallelRun | None = None) -> Run:
    """Every part of a run, restored from `checkpoint` ("latest": the run dir's newest, if resuming; None: none).
    `parallel`: this process's place in a run of several (`ParallelRun.setup`)."""
    device = parallel.device if parallel is not None else default_device()
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=device != "cpu")
    env, dataset = load_env_and_data(cfg.env, split="train")
    model, tokenizer, varlen = load_trainable_policy(cfg.model, device)
    if parallel is not None:
        parallel.prepare_model(model)
    fmt = chat_format(tokenizer, env, cfg.model)
    engine = make_engine(model, tokenizer, fmt, cfg.engine, cfg.rollout, cfg.seed,
                         deterministic=cfg.deterministic)
    compile_trainer_layers(cfg, model, device)  # after the engine's view, a copy made above
    if parallel is not None:
        parallel.prepare_engine(engine)
        prompts = parallel.prompt_iterator(dataset, cfg.seed)
    else:
        prompts = PromptIterator(dataset, seed=cfg.seed)
    trainer = Trainer(model, cfg.trainer, cfg.loss, cfg.optim, total_steps=cfg.steps,
                      temperature=cfg.rollout.temperature, hybrid_varlen=varlen,
                      pad_token_id=tokenizer.pad_token_id or 0, cuda_graphs=trainer_graphs(cfg, model, device),
                      capture_guard=engine.pause)
    # Several processes alternate generation and training, the engine taking requests in a fixed order: what tp
    # ranks need to step their engines alike.
    driver = RolloutDriver(env, engine, fmt, prompts, cfg.rollout, seed=cfg.seed, bounded=True,
                           deterministic=cfg.deterministic or parallel is not None)
    if parallel is not None:
        parallel.prepare_trainer(trainer, cfg.optim, cfg.steps)
        parallel.prepare_driver(driver)
    run_dir = Path(cfg.checkpoint.run_dir)
    start_step = 0
    if checkpoint == "latest":
        checkpoint = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if checkpoint is not None:
        options = parallel.load_options(model) if parallel is not None else {}
        state = load_checkpoint(checkpoint, model, trainer.optimizer, trainer.scheduler, **options)
        if state.get("optimizer_afresh"):
            warn(f"{checkpoint} was {state['optimizer_afresh']}: the model and schedule are loaded, the optimizer "
                 "state starts afresh")
        start_step = state["step"]
        where = (parallel.mesh.replica, parallel.mesh.n_replicas) if parallel is not None else (0, 1)
        restore_rollout_state(state["extra"], prompts, driver, *where)
        trainer.load_state_dict(state["extra"])
        retarget_schedule(trainer.scheduler, cfg.optim.lr, cfg.steps)  # the schedule this run asks for
        engine.bump_version(start_step)
    return Run(cfg=cfg, env=env, fmt=fmt, model=model, tokenizer=tokenizer, engine=engine, prompts=prompts,
               driver=driver, trainer=trainer, run_dir=run_dir, start_step=start_step, steps_done=start_step,
               resumed=checkpoint is not None, parallel=parallel)


def start(run: Run) -> None:
    if not alternating(run):  # else each step runs its rollouts in this thread (see `step`)
        run.engine.start()
        run.driver.start()
    run.engine_stats = run.engine.stats
    run.compiled_frames = compiled_frames()
    compile_watch.install()
    run.compile_seconds = compile_watch.compile_seconds()
    run.started = time.perf_counter()


def stop(run: Run) -> None:
    run.driver.stop()
    run.engine.stop()
    if run.froze:
        gc.unfreeze()  # back to the oldest generation, collectable again once the run is done with them
        run.froze = False


def freeze_start_objects(run: Run) -> None:
    """After the run's first step: the objects its start left (the model, dynamo's and inductor's compiled code,
    the tokenizer: several hundred thousand) move out of the collector's generations. A full collection walks every
    tracked object and holds the GIL throughout, stopping the engine's thread and the trainer's at once; over what a
    start leaves that took 0.37–0.40 s on the CPU box (BENCHMARKS.md, history). Frozen, later collections walk only
    what the run made since. Garbage is collected first, so nothing dead is kept."""
    gc.collect()
    gc.freeze()
    run.froze = True


def step(run: Run) -> dict:
    """One training step: the oldest finished groups → trainer → updated parameters and a new policy version."""
    t0 = time.perf_counter()
    if alternating(run):
        groups = generate_step(run)
    else:
        groups = take_groups(run.driver, run.cfg.rollout.samples_per_step)
    waited = time.perf_counter() - t0
    local_groups = groups
    if run.parallel is not None:
        groups = run.parallel.pool_groups(groups, run.cfg.rollout.groups_per_step)
    trajectories = [t for g in groups for t in g.trajectories]
    samples = [t for t in trajectories if any(t.trainable)]
    engine = run.engine

    @contextlib.contextmanager
    def update_guard():
        # No decode step sees half the parameters updated, and no interrupt stops the run there either: one that
        # arrives is held until the step has finished (the run loop raises it), so the step is saved as done.
        with critical(hold_past_end=True), engine.pause():
            yield
            engine.bump_version()

    if run.cfg.release_kv_during_step:
        engine.release_kv()
    # Beside the engine's steps, the trainer's GPU work holds off the engine's graph captures, which it would
    # invalidate (engine/step_lock.py); paused, the engine takes no step at all. The first step of a process
    # compiles the trainer's layers, and a compile traces with a process-wide flag and `Module.__call__` patched
    # for every thread: an engine step calling its compiled view's layers meanwhile fails ("FX to symbolically
    # trace a dynamo-optimized function"). So the engine is paused through that step.
    beside = run.cfg.generate_during_step and run.froze  # froze: this process has finished a step
    with engine.beside() if beside else engine.pause():
        if run.parallel is not None:
            trained = run.parallel.train(run.trainer, samples, engine.policy_version, update_guard)
        else:
            trained = run.trainer.step(samples, engine.policy_version, guard=update_guard)
    if run.cfg.release_kv_during_step:
        engine.restore_kv()
    for group in local_groups:
        run.prompts.consumed(group.prompt)
    run.steps_done += 1
    if not run.froze:
        freeze_start_objects(run)
    if run.parallel is not None:
        run.parallel.check_weights(run.model, run.steps_done, force=run.steps_done == run.cfg.steps)
    if run.sample_log is not None:
        run.sample_log.write(run.steps_done, [t for g in groups for t in g.trajectories], run.cfg.rollout)
    seconds = time.perf_counter() - t0
    now = engine.stats
    generation = _generation_metrics(run.engine_stats, now, seconds)
    run.engine_stats = now
    total_frames = compiled_frames()
    frames, run.compiled_frames = total_frames - run.compiled_frames, total_frames
    compiling, run.compile_seconds = compile_watch.since(run.compile_seconds)
    # The trainer compiles in this thread, the engine in its own (in alternating runs both in this one).
    mine = compiling.pop(threading.current_thread().name, 0.0)
    metrics = {"loss": trained.pop("loss"), **trained, "seconds": seconds, "wait_seconds": waited,
               "compiled_frames": frames, "compile_seconds_trainer": mine,
               "compile_seconds_engine": sum(compiling.values()), "ready_groups": len(run.driver.pool),
               "ready_pool_age_s": run.driver.pool.oldest_age(),
               "rollouts_in_flight": run.driver.stats.in_flight,
               "prompts_too_long": run.driver.stats.prompts_too_long, **generation,
               **{f"rollout/{k}": v for k, v in summarize(trajectories).items()},
               **{f"engine/{k}": v for k, v in dataclasses.asdict(now).items()}}
    return run.parallel.reduce_generation_metrics(metrics) if run.parallel is not None else metrics


def alternating(run: Run) -> bool:
    """Whether each step generates its rollouts to the end in this thread before training (deterministic mode,
    and every run of several processes), rather than taking them from a driver generating beside the trainer."""
    return run.cfg.deterministic or run.parallel is not None


def generate_step(run: Run) -> list:
    """Deterministic mode: the step's groups, generated to the end in this thread, in a fixed order (under
    several processes, this replica's part of them)."""
    wanted = run.cfg.rollout.groups_per_step
    if run.parallel is not None:
        wanted = run.parallel.groups_to_generate(wanted)
    groups = sorted(run.driver.run(max_groups=wanted), key=lambda g: g.group_id)
    for group in groups:
        group.trajectories.sort(key=lambda t: t.member)
    return groups


def checkpoint_extra(run: Run) -> dict:
    if run.parallel is not None:
        return run.parallel.checkpoint_extra(run.prompts, run.driver, run.trainer)
    return {"prompts": run.prompts.state_dict(), "driver": run.driver.state_dict(), **run.trainer.state_dict()}


def take_groups(driver: RolloutDriver, n: int):
    while True:
        groups = driver.pool.take(n, timeout=1.0)
        if groups:
            return groups
        # A failed driver or engine thread would otherwise leave the trainer waiting forever.
        driver.check()
        driver.engine.check()


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far, by either thread: a step that compiles is a slow
    step, and shapes that change from step to step must not keep it compiling (0 where dynamo never loaded)."""
    dynamo = sys.modules.get("torch._dynamo")
    return int(dynamo.utils.counters["frames"]["ok"]) if dynamo is not None else 0


def _generation_metrics(before, after, seconds: float) -> dict:
    """What generation did during one trainer step: tokens/s, the share of the step it sat idle (nothing to
    run) or paused (held off by the optimizer step or a checkpoint), and the seconds others waited on it: the
    trainer for a step to end (its pause, the stats it reads), a graph capture for the trainer's work to end."""
    seconds = max(seconds, 1e-9)
    return {"generated_tokens_per_s": (after.generated_tokens - before.generated_tokens) / seconds,
            "engine_idle_share": (after.idle_seconds - before.idle_seconds) / seconds,
            "engine_paused_share": (after.paused_seconds - before.paused_seconds) / seconds,
            "engine_lock_wait_seconds": after.pause_wait_seconds - before.pause_wait_seconds,
            "graph_capture_wait_seconds": after.capture_wait_seconds - before.capture_wait_seconds}
