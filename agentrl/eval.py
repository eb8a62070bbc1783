"""Offline evaluation: multi-turn rollouts through the driver, one JSON summary line, every trajectory in JSONL."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.rollout import PromptIterator, RolloutConfig, RolloutDriver, summarize

# The summary's headline keys, filled from the environments' reward components where they exist.
HEADLINE = {"answer_f1": ("answer_f1",), "answer_em": ("answer_em",), "accuracy": ("correct", "answer_em")}


@dataclass
class EvalConfig:
    env: str
    model: str = "smollm2-135m-instruct"
    data: str | None = None  # a local json/jsonl path, "hub", or None for the environment's built-in data
    split: str = "dev"
    limit: int | None = 50
    out: str | None = None
    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 4096
    temperature: float = 0.0  # greedy: an evaluation should be a function of the model
    rollouts_in_flight: int = 32
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    env_args: dict = field(default_factory=dict)  # keyword arguments of the environment, as in training


def build_engine(model, tokenizer, fmt, *, max_model_len: int, max_num_seqs: int):
    from agentrl.engine import Engine, EngineConfig

    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          eos_token_ids=tuple(fmt.eos_token_ids))
    return Engine(model, config, tokenizer=tokenizer)


def evaluate(config: EvalConfig, progress: bool = True) -> dict:
    import torch

    from agentrl import load_environment
    from agentrl.chat import ChatFormat
    from agentrl.models import load_model

    env = load_environment(config.env, **config.env_args)
    dataset = env.load_dataset(split=config.split, path=config.data, limit=config.limit)
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=device)
    model.eval()
    fmt = ChatFormat(tokenizer, env.tools())
    engine = build_engine(model, tokenizer, fmt, max_model_len=config.max_total_tokens,
                          max_num_seqs=config.rollouts_in_flight)
    rollout = RolloutConfig(num_generations=1, rollouts_in_flight=config.rollouts_in_flight, max_turns=config.max_turns,
                            max_tokens_per_turn=config.max_tokens_per_turn, max_total_tokens=config.max_total_tokens,
                            temperature=config.temperature, seed=config.seed)
    prompts = PromptIterator(dataset, shuffle=False, max_epochs=1)
    driver = RolloutDriver(env, engine, fmt, prompts, rollout)

    out = Path(config.out) if config.out else None
    sink = out.open("w") if out else None
    trajectories = []
    start = time.perf_counter()
    with _progress(progress, len(dataset)) as advance:
        def on_group(group):
            for traj in group.trajectories:
                trajectories.append(traj)
                if sink:
                    sink.write(json.dumps(traj.to_json()) + "\n")
            prompts.consumed(group.prompt)
            advance()

        try:
            driver.run(on_group=on_group)
        finally:
            if sink:
                sink.close()
    seconds = time.perf_counter() - start
    summary = summarize(trajectories)
    result = {"env": config.env, "model": config.model, "n": summary["n"]}
    for key in ("tool_call_rate", "tool_calls_per_rollout", "tool_error_rate"):
        result[key] = summary.get(key, 0.0)
    for key, sources in HEADLINE.items():
        found = [summary[s] for s in sources if s in summary]
        if found:
            result[key] = found[0]
    result["mean_turns"] = summary.get("mean_turns", 0.0)
    result["reward"] = summary.get("reward", 0.0)
    result["prefix_cache_hit_share"] = summary.get("prefix_cache_hit_share", 0.0)
    result["seconds"] = round(seconds, 2)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


class _progress:
    """A rich progress bar on a terminal, nothing otherwise (CI logs stay readable)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._bar = None

    def __enter__(self):
        import sys

        if self.enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
            task = self._bar.add_task("rollouts", total=self.total)
            return lambda: self._bar.advance(task)
        return lambda: None

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()
