"""What the engine reports about itself (`Engine.stats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0  # prompt tokens submitted
    prefilled_tokens: int = 0  # tokens run through prefill chunks (recomputes after preemption included)
    cached_tokens: int = 0  # tokens served from the prefix cache at admission
    generated_tokens: int = 0
    steps: int = 0  # forward steps
    decode_steps: int = 0  # steps that decoded at least one sequence
    decoded_seqs: int = 0  # sequences decoded, summed over steps
    preemptions: int = 0
    free_pages: int = 0
    total_pages: int = 0
    cached_pages: int = 0
    stale_pages: int = 0  # cached pages not reused for their age (`EngineConfig.prefix_cache_max_age`), computed again
    kv_releases: int = 0
    kv_released_bytes: int = 0  # live KV copied out at the last release
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    mixed_graph_steps: int = 0  # steps with prefill chunks replayed from a CUDA graph
    graph_captures: int = 0
    state_snapshots: int = 0  # hybrid models: linear-attention state snapshots held as prefix-cache resume points
    snapshots_taken: int = 0
    snapshot_resumes: int = 0  # admissions that resumed from a snapshot (their cached pages counted in cached_tokens)
    snapshot_bytes: int = 0  # device memory of the snapshot pool
    idle_seconds: float = 0.0  # the engine thread had nothing to run (no requests, or the KV pool released)
    paused_seconds: float = 0.0  # held off by pause(): optimizer steps and checkpoints
    pause_wait_seconds: float = 0.0  # other threads waited for a step to end (pause, release, stats)
    capture_wait_seconds: float = 0.0  # graph captures waited for another thread's GPU work beside (beside())

    @property
    def batch_occupancy(self) -> float:
        """Mean sequences decoded per decode step."""
        return self.decoded_seqs / self.decode_steps if self.decode_steps else 0.0
