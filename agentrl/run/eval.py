"""Offline evaluation: multi-turn rollouts through the driver, one JSON summary line, every trajectory in JSONL."""

from __future__ import annotations

import json
import time
from pathlib import Path

from agentrl.rollout import PromptIterator, RolloutDriver, summarize
from agentrl.run.build import chat_format, default_device, load_env_and_data, load_policy, make_engine
from agentrl.run.config import EvalConfig

# The summary's headline keys, filled from the environments' reward components where they exist.
HEADLINE = {"answer_f1": ("answer_f1",), "answer_em": ("answer_em",), "accuracy": ("correct", "answer_em")}


def evaluate(config: EvalConfig, progress: bool = True) -> dict:
    env, dataset = load_env_and_data(config.env, split=config.split, limit=config.limit)
    model, tokenizer = load_policy(config.model, config.device or default_device())
    fmt = chat_format(tokenizer, env, config.model)
    engine = make_engine(model, tokenizer, fmt, config.engine, config.rollout, config.seed)
    prompts = PromptIterator(dataset, shuffle=False, max_epochs=1)
    driver = RolloutDriver(env, engine, fmt, prompts, config.rollout, seed=config.seed)

    out = Path(config.out) if config.out else None
    sink = out.open("w") if out else None
    trajectories = []
    start = time.perf_counter()
    with _progress(progress, len(dataset)) as advance:
        def on_group(group):
            for traj in group.trajectories:
                trajectories.append(traj)
                if sink:  # line by line: an interrupted eval keeps every rollout that finished
                    sink.write(json.dumps(traj.to_json()) + "\n")
                    sink.flush()
            prompts.consumed(group.prompt)
            advance()

        try:
            driver.run(on_group=on_group)
        finally:
            if sink:
                sink.close()
    seconds = time.perf_counter() - start
    summary = summarize(trajectories)
    result = {"env": config.env.name, "model": config.model.name, "n": summary["n"]}
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
