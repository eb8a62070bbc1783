"""A training run survives its tools: a tool raising SystemExit on one call in ten is a tool error, not the end.

The policy is scripted (tests/helpers.py: ScriptedPolicy) so every rollout makes ten calls in its first turn,
the tenth of which raises SystemExit: from an async tool for one question, from a sync tool for the other. A
SystemExit escaping a tool would stop the rollout driver (and the run with it); counted as a tool error, every
step's tool_error_rate is exactly 1/10.
"""

from __future__ import annotations

import json

from agentrl import Environment, tool
from agentrl.engine.attention import current_step
from agentrl.run.config import TrainConfig
from agentrl.run.train import train
from tests.helpers import ScriptedPolicy

CALLS_PER_ROLLOUT = 10
FAILING = CALLS_PER_ROLLOUT - 1  # the index of the call that raises


class FlakyProbes(Environment):
    name = "flaky_probes"
    tool_timeout_s = 30.0  # a SystemExit taken for a hang would show as a timeout, and a slow test

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.failed: list[str] = []
        self.rewards = 0

    @tool
    async def probe(self, i: int) -> str:
        """Probe asynchronously.

        Args:
            i: Which probe.
        """
        if i == FAILING:
            self.failed.append("async")
            raise SystemExit(f"probe {i}")
        return f"p{i}"

    @tool
    def sprobe(self, i: int) -> str:
        """Probe synchronously.

        Args:
            i: Which probe.
        """
        if i == FAILING:
            self.failed.append("sync")
            raise SystemExit(f"probe {i}")
        return f"s{i}"

    def load_dataset(self, split="train", path=None, limit=None):
        return [{"question": "async", "answer": ""}, {"question": "sync", "answer": ""}]

    def reward(self, episode):
        self.rewards += 1  # a spread within each group, so its advantages are not all zero
        return float(self.rewards % 2)


def script(question: str, turn: int) -> str:
    if turn == 0:
        name = "probe" if question == "async" else "sprobe"
        return "".join('<tool_call>{"name": "%s", "arguments": {"i": %d}}</tool_call>' % (name, i)
                       for i in range(CALLS_PER_ROLLOUT))
    return "done"


class TrainableScript(ScriptedPolicy):
    """The scripted policy with what training reads of a transformers model, taken from the wrapped one (the
    trainer computes its logprobs from the decoder and the lm_head, unsteered)."""

    def get_decoder(self):
        return self.inner.get_decoder()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    @property
    def device(self):
        return self.inner.device

    @property
    def dtype(self):
        return self.inner.dtype

    def save_pretrained(self, path, **kwargs):
        self.inner.save_pretrained(path, **kwargs)

    def forward(self, *args, **kwargs):
        if current_step() is None:
            return self.inner(*args, **kwargs)
        return super().forward(*args, **kwargs)


def test_a_tool_raising_system_exit_on_one_call_in_ten_is_a_tool_error(tmp_path, monkeypatch):
    from agentrl.models import load_model

    env = FlakyProbes()

    def scripted_model(name, **kwargs):
        model, tokenizer = load_model("tiny-qwen3", **kwargs)
        # A wide margin: sampled at temperature 1, the policy must not leave its script.
        return TrainableScript(model, script, margin=60.0), tokenizer

    monkeypatch.setattr("agentrl.models.load_model", scripted_model)
    monkeypatch.setattr("agentrl.run.build.load_environment", lambda name, **kwargs: env)
    cfg = TrainConfig.from_dict({}, [
        "--env.name=gsm8k_math", "--model.name=tiny-qwen3", "--steps=2", f"--checkpoint.run_dir={tmp_path}",
        "--rollout.group_size=2", "--rollout.groups_per_step=2", "--rollout.rollouts_in_flight=4",
        "--rollout.max_turns=2", "--rollout.max_new_tokens=512", "--rollout.max_sample_tokens=2048",
        "--trainer.row_tokens=2048"])
    last = train(cfg, progress=False)

    assert last["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        n = r["rollout/n"]
        assert n == 4
        assert r["rollout/tool_error_rate"] == 1 / CALLS_PER_ROLLOUT
        assert r["rollout/tool_status/tool_error"] == 1.0  # one per rollout ...
        assert r["rollout/tool_status/ok"] == CALLS_PER_ROLLOUT - 1  # ... and the nine others delivered
        assert r["rollout/tool_calls_per_rollout"] == CALLS_PER_ROLLOUT
        assert r["rollout/mean_turns"] == 2.0
    assert {"async", "sync"} <= set(env.failed)
