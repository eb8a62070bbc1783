"""Regenerating a logged rollout, token by token: `agentrl replay RUN_DIR --sample ID`.

With `metrics.log_samples`, every trained rollout goes to `samples.jsonl` with what regenerating it needs: its
token ids, each turn's span, sampling seed and budget, the sampling parameters, and the behaviour logprob and policy
version of every generated token. Replay loads the weights of the policy version that generated each turn (the
run's checkpoint of that step, or the initial model for version 0), feeds the turn's recorded context to a fresh
engine with the recorded seed, and diffs what comes out against the log: in a deterministic run the tokens and
logprobs are identical; otherwise it reports where the tokens part and by how much the logprobs differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.run.run_dir import cut_metrics

SAMPLES = "samples.jsonl"


def sample_id(traj) -> str:
    return f"g{traj.group_id}m{traj.member}"


class SampleLog:
    """Appends one line per trained rollout; a resumed run first drops the lines past its checkpoint."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        self.path = run_dir / SAMPLES
        if resume_step is not None:
            cut_metrics(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()

    def write(self, step: int, trajectories, rollout) -> None:
        sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
                    "stop_after_tool_call": rollout.stop_after_tool_call}
        with self.path.open("a") as f:
            for traj in trajectories:
                turns = [{"start": a, "end": b, "seed": seed, "budget": budget,
                          "logprobs": traj.behaviour_logprobs[a:b], "versions": traj.versions[a:b]}
                         for (a, b), seed, budget in zip(traj.turn_spans, traj.turn_seeds, traj.turn_budgets)]
                record = {"id": sample_id(traj), "step": step, "prompt_index": traj.prompt_index, "epoch": traj.epoch,
                          "input_ids": traj.input_ids, "sampling": sampling, "turns": turns}
                f.write(json.dumps(record) + "\n")


@dataclass
class TurnDiff:
    turn: int
    version: int
    tokens: int  # generated tokens in the log
    identical: bool
    first_difference: int | None = None  # position in the turn where the tokens part, if they do
    max_logprob_diff: float = 0.0  # over the tokens both agree on
    logprob_diffs: list[float] = field(default_factory=list, repr=False)

    def line(self) -> str:
        head = f"turn {self.turn} (policy version {self.version}, {self.tokens} tokens): "
        if self.identical:
            return head + "identical tokens and logprobs"
        where = ("same tokens" if self.first_difference is None
                 else f"tokens part at position {self.first_difference}")
        return head + f"{where}; max |logprob difference| {self.max_logprob_diff:.3g} before that"


def find_sample(run_dir: Path, wanted: str) -> dict:
    path = run_dir / SAMPLES
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: replay needs a run trained with --metrics.log_samples=true")
    ids = []
    with path.open() as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("id") == wanted:
                return record
            ids.append(record.get("id"))
    shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
    raise KeyError(f"no sample {wanted!r} in {path} (it holds {len(ids)}: {shown})")


def replay(run_dir: str | Path, wanted: str) -> list[TurnDiff]:
    """Regenerate sample `wanted` of the run in `run_dir`; one diff per turn. A deterministic run regenerates the
    sample's whole step from the checkpoint before it, so every rollout shares the batch it had; otherwise each turn
    is regenerated alone from its recorded context under the weights of its first token's policy version."""
    from agentrl.run.config import TrainConfig

    run_dir = Path(run_dir)
    cfg = TrainConfig.from_yaml(run_dir / "config.yaml", [f"--checkpoint.run_dir={run_dir}"])
    record = find_sample(run_dir, wanted)
    if cfg.deterministic:
        return _replay_step(cfg, run_dir, record)
    return _replay_turns(cfg, run_dir, record)


def _checkpoint_of(run_dir: Path, version: int) -> Path | None:
    from agentrl.train.checkpoint import step_dir

    if version == 0:
        return None
    checkpoint = step_dir(run_dir, version)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint} is gone (checkpoint.save_every / keep_last): replaying policy version "
                                f"{version} needs it")
    return checkpoint


def _diff(index: int, version: int, tokens: list[int], logprobs: list[float], turn: dict, logged: list[int]):
    agree = next((i for i, (a, b) in enumerate(zip(tokens, logged)) if a != b), min(len(tokens), len(logged)))
    deltas = [abs(a - b) for a, b in zip(logprobs[:agree], turn["logprobs"][:agree])]
    same_tokens = tokens == logged
    return TurnDiff(turn=index, version=version, tokens=len(logged), identical=same_tokens and not any(deltas),
                    first_difference=None if same_tokens else agree, max_logprob_diff=max(deltas, default=0.0),
                    logprob_diffs=deltas)


def _replay_step(cfg, run_dir: Path, record: dict) -> list[TurnDiff]:
    from agentrl.run.build import build_run, generate_step

    version = record["step"] - 1  # a deterministic step generates from the weights the step before left
    run = build_run(cfg, checkpoint=_checkpoint_of(run_dir, version))
    try:
        found = [t for g in generate_step(run) for t in g.trajectories if sample_id(t) == record["id"]]
    finally:
        run.engine.stop()
    if not found:
        raise KeyError(f"regenerating step {record['step']} did not produce {record['id']}")
    traj = found[0]
    diffs = []
    for index, (turn, (a, b)) in enumerate(zip(record["turns"], traj.turn_spans)):
        logged = record["input_ids"][turn["start"]:turn["end"]]
        diffs.append(_diff(index, version, traj.input_ids[a:b], traj.behaviour_logprobs[a:b], turn, logged))
    if len(traj.turn_spans) != len(record["turns"]) or traj.input_ids != record["input_ids"]:
        diffs.append(TurnDiff(turn=len(diffs), version=version, tokens=0, identical=False,
                              first_difference=0))  # the conversations part (another tool result, another turn)
    return diffs


def _replay_turns(cfg, run_dir: Path, record: dict) -> list[TurnDiff]:
    import torch

    from agentrl.engine import SamplingParams
    from agentrl.env import load_environment
    from agentrl.run.build import chat_format, default_device, load_policy, make_engine
    from agentrl.rollout.driver import tool_call_stops
    from agentrl.train.checkpoint import load_checkpoint

    env = load_environment(cfg.env.name, **cfg.env.args)
    device = default_device()
    diffs = []
    loaded: dict = {}
    for index, turn in enumerate(record["turns"]):
        version = next((v for v in turn["versions"] if v >= 0), 0)
        if version not in loaded:
            torch.manual_seed(cfg.seed)  # the initial weights, as the run built them
            model, tokenizer = load_policy(cfg.model, device)
            checkpoint = _checkpoint_of(run_dir, version)
            if checkpoint is not None:
                load_checkpoint(checkpoint, model, restore_rng=False)
            fmt = chat_format(tokenizer, env, cfg.model)
            # The engine as the run configured it (the same compile choice).
            engine = make_engine(model, tokenizer, fmt, cfg.engine, cfg.rollout, cfg.seed,
                                 deterministic=cfg.deterministic)
            loaded = {version: engine}
        engine = loaded[version]
        s = record["sampling"]
        params = SamplingParams(max_new_tokens=turn["budget"], temperature=s["temperature"], top_p=s["top_p"],
                                top_k=s["top_k"], seed=turn["seed"],
                                **tool_call_stops(fmt, engine, s["stop_after_tool_call"]))
        [out] = engine.generate([record["input_ids"][:turn["start"]]], params)
        logged = record["input_ids"][turn["start"]:turn["end"]]
        diffs.append(_diff(index, version, out.token_ids, out.logprobs, turn, logged))
    for engine in loaded.values():
        engine.stop()
    return diffs
