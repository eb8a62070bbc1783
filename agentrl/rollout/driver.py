"""The multi-turn rollout driver: keeps `rollouts_in_flight` rollouts decoding, forever if asked.

Each rollout is one coroutine: submit the prompt ids → await the engine's completion → parse tool calls → run
the tools (a thread pool for sync tools, the event loop for async ones, a timeout per call) → append the
suffix ids of the tool messages → resubmit the whole sequence, whose history the prefix cache serves. When a
rollout ends, a new one starts at once, so the engine's batch stays full: a decode step costs about the same
whatever it carries (it reads every weight once), so a half-empty batch is half a step wasted.

The engine runs in its own thread (tp = 1), or, when nobody drives it, this loop steps it between awaits.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from agentrl.chat import parse_tool_calls
from agentrl.engine.types import Completion, SamplingParams
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.groups import Group, ReadyPool, group_advantages
from agentrl.rollout.metrics import DriverStats
from agentrl.rollout.prompts import Prompt, PromptIterator
from agentrl.rollout.trajectory import Trajectory


class RolloutDriver:
    def __init__(self, env, engine, chat_format, prompts: PromptIterator, config: RolloutConfig | None = None,
                 pool: ReadyPool | None = None, *, seed: int | None = None, bounded: bool = False):
        """`seed`: per-rollout sampling seeds derive from it (None: the engine's generator). `bounded`: stop
        starting groups while `config.max_ready_samples` wait in the pool (training's backpressure)."""
        config = config if config is not None else RolloutConfig()
        self.env = env
        self.engine = engine
        self.fmt = chat_format
        self.prompts = prompts
        self.config = config
        self.seed = seed
        self.max_ready_samples = config.max_ready_samples if bounded else None
        self.pool = pool if pool is not None else ReadyPool()
        self.stats = DriverStats(target_in_flight=config.rollouts_in_flight)
        self._group_ids = itertools.count()
        self._rollout_seeds = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---------------------------------------------------------------- entry points
    def run(self, max_groups: int | None = None, on_group: Callable[[Group], None] | None = None) -> list[Group]:
        """Run in this thread until the prompts run out (or `max_groups` groups finished); return the groups.
        Whoever receives a group marks its prompt consumed (`prompts.consumed`) once its work is kept: eval at
        once, the trainer after the optimizer step that used it."""
        collected: list[Group] = []

        def keep(group: Group):
            collected.append(group)
            if on_group is not None:
                on_group(group)

        asyncio.run(self._main(max_groups, keep))
        return collected

    def start(self) -> None:
        """Run in a background thread, putting finished groups into `self.pool`, until `stop()`."""
        def target():
            try:
                asyncio.run(self._main(None, self.pool.put))
            except BaseException as exc:  # surfaced to the trainer by `check()`
                self.error = exc

        self._thread = threading.Thread(target=target, name="agentrl-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("the rollout driver failed") from self.error

    # ---------------------------------------------------------------- the loop
    async def _main(self, max_groups: int | None, emit: Callable[[Group], None]) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(self.config.tool_workers, thread_name_prefix="agentrl-tool"))
        self._pump_stop = False
        # Either the driver steps the engine itself, or it watches the engine's own thread: a thread that died never
        # calls back, and without the watch every rollout (and the trainer behind them) would wait forever.
        pump = asyncio.create_task(self._watch() if self.engine.running_in_background else self._pump())
        pending: list[Group] = []  # one entry per group member not yet started
        tasks: set[asyncio.Task] = set()
        groups_started = 0
        try:
            while not self._stop.is_set():
                # Refill up to the target: new members of started groups first, then new prompts.
                throttled = False
                while len(tasks) < self.config.rollouts_in_flight:
                    if not pending:
                        if self._pool_full():
                            throttled = True
                            break
                        if max_groups is not None and groups_started >= max_groups:
                            break
                        try:
                            prompt = next(self.prompts)
                        except StopIteration:
                            break
                        group = Group(next(self._group_ids), prompt, self.config.group_size)
                        groups_started += 1
                        pending = [group] * group.size
                    tasks.add(asyncio.create_task(self._rollout(pending.pop())))
                more_prompts = bool(pending) or not (
                    self.prompts.exhausted() or (max_groups is not None and groups_started >= max_groups))
                self.stats.observe_in_flight(len(tasks), refilling=more_prompts and not throttled)
                if not tasks:
                    if throttled:  # everything finished is waiting for the trainer: wait for it to take some
                        await asyncio.sleep(0.005)
                        continue
                    break
                done, _ = await asyncio.wait(tasks | {pump}, return_when=asyncio.FIRST_COMPLETED)
                if pump in done:
                    pump.result()  # the engine failed: raise it here rather than leave rollouts waiting
                tasks -= done
                # A failing rollout is a bug: it surfaces here. Every failed task's exception is retrieved first,
                # as one never retrieved is logged with its traceback whenever (and on whichever thread) the task
                # is collected.
                errors = [e for e in (task.exception() for task in done) if e is not None]
                if errors:
                    raise errors[0]
                # Several members of one group can finish in the same wait: each returns the group, complete by
                # then, and it must still be scored and emitted once.
                finished = {}
                for task in done:
                    group = task.result()
                    finished[group.group_id] = group
                for group in finished.values():
                    if group.complete:
                        self._score(group)
                        emit(group)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # settled, so none is logged when collected
            self._pump_stop = True
            await pump

    def _pool_full(self) -> bool:
        limit = self.max_ready_samples
        return limit is not None and self.pool.num_samples() >= limit

    async def _pump(self) -> None:
        """Step an engine that nobody else drives, off the event loop so tools and callbacks keep running."""
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, thread_name_prefix="agentrl-engine") as executor:
            while not self._pump_stop:
                if self.engine.has_work():
                    await loop.run_in_executor(executor, self.engine.step)
                else:
                    await asyncio.sleep(0.001)

    async def _watch(self) -> None:
        """Raise the background engine thread's failure (checked twice a second) until the driver stops."""
        while not self._pump_stop:
            self.engine.check()
            await asyncio.sleep(0.5)

    async def _generate(self, ids: list[int], sampling: SamplingParams) -> Completion:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def deliver(completion: Completion):
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(completion))
            except RuntimeError:  # the loop closed (driver stopped) before the engine finished this request
                pass

        request_id = self.engine.submit(ids, sampling, callback=deliver)
        try:
            return await future
        except asyncio.CancelledError:
            self.engine.cancel(request_id)  # a stopped driver hands its engine back with nothing left decoding
            raise

    def _sampling(self, budget: int) -> SamplingParams:
        c = self.config
        seed = None if self.seed is None else self.seed * 1_000_003 + next(self._rollout_seeds)
        return SamplingParams(max_new_tokens=budget, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              seed=seed,
                              stop_sequences=tuple(map(tuple, self.fmt.stop_sequences)) if c.stop_after_tool_call else ())

    async def _rollout(self, group: Group) -> Group:
        c, env, fmt = self.config, self.env, self.fmt
        prompt: Prompt = group.prompt
        episode = env.start(prompt.sample)  # its messages start as the prompt
        messages = list(episode.messages)
        traj = Trajectory(prompt_index=prompt.index, epoch=prompt.epoch, group_id=group.group_id,
                          gold=prompt.sample.get("answer"))
        traj.append(fmt.prompt_ids(messages), trainable=False)
        traj.prompt_len = len(traj.input_ids)
        self.stats.rollouts_started += 1
        for turn in range(c.max_turns):
            budget = min(c.max_new_tokens, c.max_sample_tokens - len(traj.input_ids))
            if budget <= 0:
                traj.finish_reason = "truncated"
                break
            completion = await self._generate(list(traj.input_ids), self._sampling(budget))
            start = len(traj.input_ids)
            traj.append(completion.token_ids, trainable=True, logprobs=completion.logprobs,
                        versions=completion.versions)
            traj.turn_spans.append((start, len(traj.input_ids)))
            traj.cached_tokens.append(completion.cached_tokens)
            traj.prefilled_tokens.append(start - completion.cached_tokens)
            text = fmt.decode(completion.token_ids)
            episode.messages.append({"role": "assistant", "content": text})
            calls = parse_tool_calls(text)
            if env.is_done(episode, text, calls):
                episode.final_text = text
                traj.finish_reason = "length" if completion.finish_reason in ("length", "max_model_len") else "done"
                break
            if turn == c.max_turns - 1:
                traj.finish_reason = "max_turns"
                break
            results = await env.execute(episode, calls)  # recorded in episode.tool_calls
            tool_messages = [r.message for r in results]
            episode.messages.extend(tool_messages)
            suffix = fmt.suffix_ids(tool_messages, completion.token_ids)
            room = c.max_sample_tokens - len(traj.input_ids)
            if len(suffix) >= room:
                # A tool result that would cross the budget is cut and the rollout ends: the masks stay right
                # because the cut tokens are context, never trained on.
                traj.append(suffix[:room], trainable=False)
                traj.finish_reason = "truncated"
                break
            traj.append(suffix, trainable=False)
        episode.done = True
        traj.messages = episode.messages
        traj.tool_calls = episode.tool_calls
        traj.answer = episode.final_text
        traj.reward, traj.reward_components = env.total_reward(episode)
        self.stats.rollouts_finished += 1
        group.trajectories.append(traj)
        return group

    def _score(self, group: Group) -> None:
        if self.config.drop_truncated:
            kept = [t for t in group.trajectories if not t.truncated]
            self.stats.dropped_truncated += len(group.trajectories) - len(kept)
            group.trajectories = kept
            group.size = len(kept)
        if not group.trajectories:
            return
        advantages = group_advantages([t.reward for t in group.trajectories], self.config.advantage)
        for traj, adv in zip(group.trajectories, advantages):
            traj.advantage = adv
