"""The continuous-batching engine: requests in, token-exact completions with behaviour logprobs out.

Data flow:

    submit()      → inbox → Scheduler.waiting
    step()        → Scheduler.schedule(): admit waiting sequences (mapping their cached prefix pages; a hybrid
                    model's only up to the deepest page with a state snapshot, state_snapshots.py),
                    one token for every decoding sequence, prefill chunks under the token budget; pages
                    from the PagePool, preempting the newest sequence when a decode finds none
                  → layout_step() (step_layout.py): every scheduled token in one row [1, T], StepMetadata
                    (slots, query spans, context lengths, block tables) and the sampler's knobs, in one
                    host-to-device copy
                  → forward of the model view (the training model's own parameters): each attention
                    layer calls paged_attention_forward → backend.write_kv + backend.attend over
                    KVStorage (Triton on CUDA); linear-attention layers read and write their state slots
                    (restored from a snapshot first when resuming, copied into snapshots at page boundaries);
                    the lm_head runs only on the rows whose next token is wanted. On CUDA a pure-decode
                    step replays the CUDA graph of its batch-size bucket instead, and a step that prefills the graph of
                    its token bucket (cuda_graphs.py; a hybrid model's prefills run eagerly)
                  → Sampler: tokens + behaviour logprobs of all rows, one device-to-host transfer (the
                    step's only sync)
                  → append, tag with policy_version, check stops; Scheduler.register advertises the
                    pages that became full in the prefix cache
                  → Completions (returned, passed to callbacks, or queued for get_completion)

Two drive modes: `start()` runs steps on a background thread (results through callbacks or
`get_completion`), or the owner calls `step()` itself. Every state change happens under one lock held for a
whole step, so `pause()`, `release_kv()` and `bump_version()` never land in the middle of a forward; a thread that
waits on it is let in before the background thread's next step (step_lock.py).

A tensor-parallel model (`agentrl.parallel.apply_tensor_parallel`) is decoded from its shards in place, each rank
holding the KV of its own heads. Its requests are tp rank 0's: each step every rank takes in what tp rank 0
received since the last one, and the ranks compare what they took in and sampled (`tensor_parallel.py`). The
ranks must issue their collectives in one host order, so only the owner's `step()` drives it, on every rank as
many times.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import numpy as np
import torch

from agentrl.engine.attention import PagedStep, register, stepping
from agentrl.engine.background import BackgroundMode
from agentrl.engine.backends import make_backend
from agentrl.engine.config import (EngineConfig, resolve_eos_ids, resolve_max_model_len,
                                   resolve_max_tokens_per_step)
from agentrl.engine.cuda_graphs import DecodeGraphs, ForwardParts, MixedGraphs, graphs_supported
from agentrl.engine.fused_projections import FusedProjections
from agentrl.engine.kv_pool import PagePool
from agentrl.engine.kv_storage import KVStorage
from agentrl.engine.linear_state import LinearStates
from agentrl.engine.state_snapshots import StateSnapshots
from agentrl.engine.model_view import compile_decoder_layers, geometry, make_view, model_device_dtype
from agentrl.engine.sampler import Sampler
from agentrl.engine.scheduler import FINISHED, Scheduler, Sequence
from agentrl.engine.stats import EngineStats
from agentrl.engine.streams import EngineStream
from agentrl.engine.step_layout import fill_placeholders, layout_step, step_inputs, upload
from agentrl.engine.step_lock import StepLock
from agentrl.engine.stop_strings import StopStrings
from agentrl.engine.tensor_parallel import TensorParallel
from agentrl.engine.types import Completion, SamplingParams


PLACEHOLDER = -1  # a sampled token whose value is still on the device


@dataclass
class _InFlight:
    """A launched step: what it scheduled, where its sampled tokens go, and its results on their way to the host."""

    batch: list
    placed: list[tuple[Sequence, int]]  # (sequence, index of the placeholder in its tokens), in sampled-row order
    version: int
    tokens: torch.Tensor | None  # sampled ids on the device: the next step's placeholders are filled from them
    results: torch.Tensor | None  # [2, N] float64 tokens and logprobs (pinned host memory on CUDA)
    event: object  # CUDA event recorded after the copy (None off CUDA)


class Engine(BackgroundMode):
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None):
        self.config = config = config or EngineConfig()
        self.model = model
        self.device, self.dtype = model_device_dtype(model)
        self.tp = TensorParallel.of(model)
        geo = self.geometry = geometry(model, self.tp.size if self.tp else 1)
        self.view = make_view(model, register())
        # None: on CUDA, dense and hybrid models alike (a hybrid's compiled around `linear_state._core`: its decode
        # step measured 5.8 ms compiled against 8.0 eager, BENCHMARKS.md, and its tokens equal the eager engine's on
        # the GPU). Under tp the layers run DTensor hooks that swap parameters around each module's forward: left
        # eager.
        compile_layers = config.compile if config.compile is not None else self.device.type == "cuda"
        if compile_layers and self.tp is None:
            compile_decoder_layers(self.view)
        self.linear = LinearStates(self.view, geo, config.max_num_seqs) if geo.linear_layers else None
        # Before the trainer builds its optimizer or graphs: this re-points the model's own parameters.
        self.fused = FusedProjections(self.view, self.linear.modules.values() if self.linear is not None else ()) \
            if config.fuse_projections and self.tp is None else None
        config = self.config = replace(config, max_tokens_per_step=resolve_max_tokens_per_step(
            config, hybrid=self.linear is not None))
        self.eos_token_ids = resolve_eos_ids(config, model, tokenizer)
        self._stop_strings = StopStrings(tokenizer) if tokenizer is not None else None
        self._layer_slot = {layer: i for i, layer in enumerate(geo.attention_layers)}
        page_bytes = KVStorage.bytes_per_page(len(geo.attention_layers), config.page_size, geo.num_kv_heads,
                                              geo.head_dim, self.dtype)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        if self.tp is not None:  # every tp rank the same pages: the smallest free memory of the group decides
            free = self.tp.agree_at_construction(config, free)
        snapshot_bytes = self.linear.bytes_per_state if self.linear is not None and config.enable_prefix_cache else 0
        num_pages, num_snapshots = config.resolve_num_pages(page_bytes, free, snapshot_bytes)
        if self.linear is not None and config.enable_prefix_cache and not num_snapshots:
            # A cached page restores KV but not the recurrent state after it: without snapshots to resume
            # from, hybrid models recompute their prompts.
            config = self.config = replace(config, enable_prefix_cache=False)
        self.max_model_len = resolve_max_model_len(config, geo.max_position_embeddings, num_pages * config.page_size)
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_cache, config.prefix_cache_max_age)
        self.snapshots = StateSnapshots(self.linear, num_snapshots) if config.enable_prefix_cache and \
            self.linear is not None else None
        if self.snapshots is not None:
            self.pool.on_forget = self.snapshots.drop
            self.linear.snapshots = self.snapshots  # captured decode steps write page-boundary snapshots into them
        self.storage = KVStorage(len(geo.attention_layers), num_pages, config.page_size, geo.num_kv_heads,
                                 geo.head_dim, self.dtype, self.device)
        self.backend = make_backend(config.attention_backend, self.device, config.page_size)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_tokens_per_step,
                                   resumable=self.snapshots.has if self.snapshots is not None else None)
        graphs = config.cuda_graphs and self.device.type == "cuda" and self.backend.supports_graphs
        graphs = graphs and graphs_supported(self.view)
        graphs = graphs and self.tp is None  # a tp graph would capture NCCL all-reduces: not verified safe, so eager
        self.forward_parts = ForwardParts(self.view, self.backend, self.storage, self._layer_slot, geo,
                                          config.page_size, self.device, self.max_model_len, self.linear)
        self._lock = StepLock()  # held for a whole step; others are let in between steps (step_lock.py)
        # Hybrid models prefill eagerly: a chunk's delta rule runs per sequence, planned on the host.
        self.graphs, self.mixed_graphs = (self.graph_sets(mixed=config.mixed_step_graphs and self.linear is None)
                                          if graphs else (None, None))
        self.sampler = Sampler(self.device)
        self._stream = EngineStream(self.device, config.separate_stream)  # the background thread's (streams.py)
        self.policy_version = 0
        self._stats = EngineStats(total_pages=num_pages)
        self._inbox_lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._cancels: deque[int] = deque()
        self._live: dict[int, Sequence] = {}
        self._next_id = 0
        self._rng = random.Random(config.seed)
        self._recompute_pending = False
        self._in_flight: _InFlight | None = None
        self._released = False
        self._init_background()

    def graph_sets(self, capture=None, mixed: bool = True) -> tuple[DecodeGraphs, MixedGraphs | None]:
        """The decode graphs and (with `mixed`) the mixed-step graphs over this engine's parts, each captured by
        `capture` (None: `cuda_capture`; tests pass a stand-in) while other threads' GPU work beside the engine
        is held off (`StepLock.exclusive`)."""
        cfg, exclusive = self.config, self._lock.exclusive
        decode = DecodeGraphs(self.forward_parts, cfg.max_num_seqs, capture=capture, exclusive=exclusive)
        return decode, (MixedGraphs(self.forward_parts, cfg.max_num_seqs, cfg.max_tokens_per_step, capture=capture,
                                    exclusive=exclusive) if mixed else None)

    # -- requests -------------------------------------------------------------------------------------
    def submit(self, token_ids, sampling: SamplingParams | None = None, callback=None) -> int:
        sampling = sampling or SamplingParams()
        ids = list(map(int, token_ids))
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len "
                             f"{self.max_model_len}")
        vocab = self.geometry.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab})")
        if sampling.stop_strings and self._stop_strings is None:
            raise ValueError("stop_strings need the engine's tokenizer (Engine(..., tokenizer=...))")
        with self._inbox_lock:
            request_id = self._next_id
            self._next_id += 1
            seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
            self._inbox.append(self._sequence(request_id, ids, sampling, callback, seed))
        self._wake.set()
        return request_id

    def _sequence(self, request_id: int, ids: list[int], sampling: SamplingParams, callback, seed: int) -> Sequence:
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        return Sequence(request_id, len(ids), ids, sampling, frozenset(stop_ids), callback, seed)

    @property
    def stops_on_text(self) -> bool:
        """Whether requests may carry `stop_strings` (the engine has a tokenizer)."""
        return self._stop_strings is not None

    def cancel(self, request_id: int) -> None:
        """Ends the request at the next step; its completion (finish_reason "cancelled") is delivered as usual.
        Under tp only tp rank 0's cancels count."""
        with self._inbox_lock:
            self._cancels.append(request_id)
        self._wake.set()

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        if self.running_in_background:
            done: dict[int, Completion] = {}
            cond = threading.Condition()

            def collect(c: Completion):
                with cond:
                    done[c.request_id] = c
                    cond.notify_all()

            ids = [self.submit(p, s, collect) for p, s in zip(prompts, params)]
            with cond:
                while len(done) < len(ids):
                    cond.wait(0.1)
                    self.check()
            return [done[i] for i in ids]
        ids = [self.submit(p, s) for p, s in zip(prompts, params)]
        wanted, done = set(ids), {}
        while len(done) < len(ids):
            for completion, has_callback in self._step():
                if completion.request_id in wanted:
                    done[completion.request_id] = completion
                elif not has_callback:
                    self._results.put(completion)
        return [done[i] for i in ids]

    # -- stepping -------------------------------------------------------------------------------------
    def step(self) -> list[Completion]:
        """One scheduler iteration: admit, prefill chunks and decode. Returns the requests finished in it."""
        return [c for c, _ in self._step()]

    def _step(self) -> list[tuple[Completion, bool]]:
        with self._lock:
            if self._released:
                raise RuntimeError("the KV pool is released; call restore_kv() before stepping")
            finished = self._drain_inbox()
            if self._recompute_pending:
                self._recompute_pending = False
                finished += self._complete_in_flight()
                self.scheduler.preempt_all()
                self.pool.clear_cache()
            batch = self.scheduler.schedule()
            launched = self._launch(batch, self.policy_version) if batch else None
            # Step n+1 is queued on the device before the host waits for step n: the device never idles
            # while the host appends tokens, checks stops and schedules.
            finished += self._complete_in_flight()
            self._in_flight = launched
            if not self.config.overlap:
                finished += self._complete_in_flight()
        done = []
        for seq in finished:
            completion = self._completion(seq)
            if seq.callback is not None:
                seq.callback(completion)
            done.append((completion, seq.callback is not None))
        return done

    def _launch(self, batch, version: int) -> _InFlight:
        """Queue one step on the device: forward, sampling, and the copy of its results to the host. Sampled
        sequences get a placeholder token, resolved by `_complete`."""
        sampling = [item.seq for item in batch if item.samples]
        params = [seq.params for seq in sampling]
        extra = {}
        if any(p.temperature > 0 for p in params):  # counter: the index the sampled token will take
            extra["sampling"] = Sampler.columns(params, [s.seed for s in sampling], [len(s.tokens) for s in sampling])
        fills = [(i, item.seq.source_row) for i, item in enumerate(batch) if item.decode and item.seq.unresolved]
        if fills:
            extra["fill_rows"] = np.array([r for r, _ in fills] + [s for _, s in fills], dtype=np.int64)
        previous = self._in_flight.tokens if self._in_flight is not None else None
        if self.fused is not None:
            self.fused.refresh()
        st = self._stats
        linear = None
        if self.linear is not None:
            st.snapshot_resumes += sum(item.seq.resume_page is not None for item in batch)
            linear = self.linear.plan(batch, self.scheduler.running, self.pool.page_size, self.snapshots)
        if self.graphs is not None and self.graphs.accepts(batch):
            logits, dev = self.graphs.run(batch, extra, previous, linear)
            st.graph_steps += 1
        elif self.mixed_graphs is not None and self.mixed_graphs.accepts(batch):
            logits, dev = self.mixed_graphs.run(batch, extra, previous)
            st.mixed_graph_steps += 1
        else:
            logits, dev = self._forward(batch, extra, previous, linear)
        if linear is not None:
            self.linear.after(linear)
        self.scheduler.advance(batch)
        st.steps += 1
        decodes = sum(item.decode for item in batch)
        st.decode_steps += decodes > 0
        st.decoded_seqs += decodes
        st.prefilled_tokens += sum(item.length for item in batch if not item.decode)
        if not sampling:
            return _InFlight(batch, [], version, None, None, None)
        tokens, logprobs = self.sampler(logits, params, dev.get("sampling"))
        # One device-to-host transfer per step, started now and waited for one step later; ids are exact in float64.
        results = torch.stack([tokens.double(), logprobs.double()])
        event = None
        if results.is_cuda:
            host = torch.empty(results.shape, dtype=results.dtype, pin_memory=True)
            host.copy_(results, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            results = host
        placed = []
        for row, seq in enumerate(sampling):
            placed.append((seq, len(seq.tokens)))
            seq.tokens.append(PLACEHOLDER)
            seq.unresolved += 1
            seq.source_row = row
            seq.final = seq.num_generated >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_model_len
        return _InFlight(batch, placed, version, tokens, results, event)

    def _complete_in_flight(self) -> list[Sequence]:
        """Wait for the step in flight, if any: resolve its placeholders, check stops, advertise full pages."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        finished = []
        if flight.placed:
            if flight.event is not None:
                flight.event.synchronize()
            host_tokens, host_logprobs = flight.results.tolist()
            if self.tp is not None:
                self.tp.fold_tokens(host_tokens)
            for (seq, index), tok, lp in zip(flight.placed, host_tokens, host_logprobs):
                if seq.status == FINISHED:  # cancelled meanwhile: its placeholders were dropped
                    continue
                seq.tokens[index] = int(tok)
                seq.unresolved -= 1
                seq.logprobs.append(lp)
                seq.versions.append(flight.version)
                self._stats.generated_tokens += 1
                reason = self._stop_reason(seq, index)
                if reason:
                    self._finish(seq, reason)
                    finished.append(seq)
        self.scheduler.register(flight.batch)
        return finished

    def _forward(self, batch, extra: dict, previous, linear=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The eager forward of one step: logits `[N, vocab]` of its sampled rows, and its uploaded parts.
        `linear`: the step's plan of linear-attention states (hybrid models)."""
        host = layout_step(batch, self.pool.page_size)
        dev = upload({**host.parts, **extra, **(linear.parts() if linear is not None else {})}, self.device)
        fill_placeholders(dev["ids"], dev, previous)
        input_ids, position_ids, rows, meta = step_inputs(host, dev, self.pool.page_size)
        self.backend.prepare(meta)
        step = PagedStep(self.backend, self.storage, meta, self._layer_slot)
        kwargs = {}
        if linear is not None:
            linear.bind(dev)
            self.linear.before(linear)
            kwargs[LinearStates.KWARG] = linear
        with torch.no_grad(), stepping(step):
            out = self.view(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=rows,
                            **kwargs)
        return out.logits[0], dev

    def _stop_reason(self, seq: Sequence, index: int) -> str:
        """Why `seq` ends at its token `index` (just resolved), or ""."""
        if seq.tokens[index] in seq.stop_ids:
            return "stop"
        generated = index + 1 - seq.prompt_len
        for stop in seq.params.stop_sequences:
            if 0 < len(stop) <= generated and tuple(seq.tokens[index + 1 - len(stop):index + 1]) == tuple(stop):
                return "stop"
        if seq.params.stop_strings and self._stop_strings.hit(seq.tokens, seq.prompt_len, index,
                                                                seq.params.stop_strings):
            return "stop"
        if generated >= seq.params.max_new_tokens:
            return "length"
        if index + 1 >= self.max_model_len:
            return "max_model_len"
        return ""

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.unresolved:  # tokens sampled after the end (or a cancel): never part of the completion
            del seq.tokens[-seq.unresolved:]
            seq.unresolved = 0
        self.scheduler.finish(seq, reason)
        if self.linear is not None:
            self.linear.free(seq)
        self._live.pop(seq.request_id, None)

    def _drain_inbox(self) -> list[Sequence]:
        with self._inbox_lock:
            new, self._inbox = list(self._inbox), deque()
            cancels, self._cancels = list(self._cancels), deque()
        if self.tp is not None:
            new, cancels = self.tp.take_in(new, cancels, self.policy_version, self._sequence)
        for seq in new:
            self._live[seq.request_id] = seq
            self.scheduler.add(seq)
            self._stats.prompt_tokens += seq.prompt_len
        finished = []
        for request_id in cancels:
            seq = self._live.get(request_id)
            if seq is not None:
                self._finish(seq, "cancelled")
                finished.append(seq)
        return finished

    def _completion(self, seq: Sequence) -> Completion:
        return Completion(
            request_id=seq.request_id, prompt_ids=seq.tokens[:seq.prompt_len],
            token_ids=seq.tokens[seq.prompt_len:], logprobs=list(seq.logprobs), versions=list(seq.versions),
            finish_reason=seq.finish_reason, cached_tokens=seq.cached_tokens or 0,
        )

    def has_work(self) -> bool:
        with self._inbox_lock:
            if self._inbox or self._cancels:
                return True
        mirrors = self.tp is not None and bool(self.tp.mirrors)  # waiting for tp rank 0's copy: a step takes it in
        return mirrors or self._in_flight is not None or self.scheduler.has_work()

    # -- weights and memory ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def pause(self):
        """No step runs inside: wrap an optimizer step (and the bump) so no token mixes two weight sets."""
        with self._lock.outside(), self._stream.joined():
            t = time.perf_counter()
            try:
                yield self
            finally:
                self._stats.paused_seconds += time.perf_counter() - t

    def beside(self):
        """Wrap GPU work that another thread runs while the engine keeps stepping (the trainer's forward and
        backward). The engine captures no CUDA graph meanwhile: another thread's kernels, allocations or
        synchronisations during a capture invalidate it and fail themselves. `pause()` inside is fine."""
        return self._lock.beside()

    def bump_version(self, version: int | None = None) -> int:
        with self._lock.outside():
            self.policy_version = self.pool.version = self.policy_version + 1 if version is None else int(version)
            if self.config.kv_on_update == "recompute":
                self._recompute_pending = True
            return self.policy_version

    def warmup(self) -> None:
        """Capture the graphs of every bucket now (decode steps by batch size, steps that prefill by token count)
        rather than at the first step of each kind (which does it otherwise). No-op without graphs."""
        with self._lock.outside(), self._stream.joined():
            for graphs in (self.graphs, self.mixed_graphs):
                if graphs is not None and not self._released:
                    graphs.warmup()

    def release_kv(self) -> None:
        """Hand the KV pool's device memory back (e.g. for a training step); live sequences keep their KV
        on the host and continue exactly after `restore_kv()`. Decode graphs are kept: they are replayed again
        if the restored pool lands at the same address, and captured again if not (see cuda_graphs.py)."""
        with self._lock.outside(), self._stream.joined():
            if self._released:
                return
            self.pool.drop_unreferenced()  # those pages are not saved: stop advertising them
            live = self.pool.live_pages()
            self._stats.kv_released_bytes = self.storage.release(live)
            if self.linear is not None:
                self.linear.release()
            if self.snapshots is not None:  # those of dropped pages went with them; those of live pages are kept
                self._stats.kv_released_bytes += self.snapshots.release()
            self._stats.kv_releases += 1
            self._released = True

    def restore_kv(self) -> None:
        with self._lock.outside(), self._stream.joined():
            if not self._released:
                return
            self.storage.restore()
            if self.linear is not None:
                self.linear.restore()
            if self.snapshots is not None:
                self.snapshots.restore()
            self._released = False
        self._wake.set()

    @property
    def stats(self) -> EngineStats:
        with self._lock.outside():
            st = replace(self._stats)
            st.pause_wait_seconds = self._lock.wait_seconds
            st.capture_wait_seconds = self._lock.capture_wait_seconds
            st.running, st.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
            with self._inbox_lock:
                st.waiting += len(self._inbox)
            st.preemptions = self.scheduler.preemptions
            st.cached_tokens = self.scheduler.prefix_hit_tokens
            st.free_pages, st.cached_pages = self.pool.num_free, self.pool.num_cached
            st.stale_pages = self.pool.stale_pages
            st.graph_captures = sum(g.captures for g in (self.graphs, self.mixed_graphs) if g is not None)
            if self.snapshots is not None:
                snaps = self.snapshots
                st.state_snapshots, st.snapshots_taken, st.snapshot_bytes = len(snaps), snaps.taken, snaps.nbytes
            return st
