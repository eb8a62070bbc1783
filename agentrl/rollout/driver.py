"""The multi-turn rollout driver: keeps `rollout.in_flight` rollouts decoding, forever if asked.

Each rollout is one coroutine: submit the prompt ids → await the engine's completion → parse tool calls → run
the tools (a thread pool for sync tools, the event loop for async ones, a timeout per call) → append the
suffix ids of the tool messages → resubmit the whole sequence, whose history the prefix cache serves. When a
rollout ends, a new one starts at once, so the engine's batch stays full: a decode step costs about the same
whatever it carries (it reads every weight once), so a half-empty batch is half a step wasted.

The engine runs in its own thread (tp = 1), or, when nobody drives it, this loop steps it between awaits.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
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


def turn_seed(seed: int, group_id: int, member: int, turn: int) -> int:
    """The sampling seed of one turn, a function of the run's seed and the turn's identity only."""
    digest = hashlib.blake2b(f"{seed}/{group_id}/{member}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits


class RolloutDriver:
    def __init__(self, env, engine, chat_format, prompts: PromptIterator, config: RolloutConfig | None = None,
                 pool: ReadyPool | None = None, *, seed: int | None = None, bounded: bool = False,
                 deterministic: bool = False):
        """`seed`: each turn's sampling seed derives from it and the turn's identity (group, member, turn), never
        from timing (None: the engine's generator). `bounded`: stop starting groups while
        `config.max_ready_samples` wait in the pool (training's backpressure). `deterministic`: the engine (which
        this driver must step itself) runs only once every live rollout waits on it, and takes their requests in
        (group, member) order, so what it computes does not depend on how fast tools return."""
        config = config if config is not None else RolloutConfig()
        self.env = env
        self.engine = engine
        self.fmt = chat_format
        self.prompts = prompts
        self.config = config
        self.seed = seed
        self.max_ready_samples = config.max_ready_samples if bounded else None
        self.pool = pool if pool is not None else ReadyPool()
        self.stats = DriverStats(target_in_flight=config.in_flight)
        self.deterministic = deterministic
        self._next_group_id = 0
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main_task: asyncio.Task | None = None
        self._skipped_in_a_row = 0  # prompts too long for max_sample_tokens, one after another
        self._held: list = []  # deterministic mode: requests waiting for the next engine step, with their keys
        self._in_engine = 0  # deterministic mode: requests submitted and not yet delivered
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

        try:
            asyncio.run(self._main(max_groups, keep))
        except asyncio.CancelledError:  # stop() ends the run: the groups finished so far are its result
            if not self._stop.is_set():
                raise
        return collected

    def start(self) -> None:
        """Run in a background thread, putting finished groups into `self.pool`, until `stop()`."""
        def target():
            try:
                asyncio.run(self._main(None, self.pool.put))
            except asyncio.CancelledError:  # stop() cancelled the loop's main task
                pass
            except BaseException as exc:  # surfaced to the trainer by `check()`
                self.error = exc

        self._thread = threading.Thread(target=target, name="agentrl-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop starting rollouts and cancel the ones in flight (their prompts stay unconsumed), promptly: the loop
        is woken rather than left to notice at the next finished rollout."""
        self._stop.set()
        if self._loop is not None and self._main_task is not None:
            try:
                self._loop.call_soon_threadsafe(self._main_task.cancel)
            except RuntimeError:  # the loop already closed
                pass
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check(self) -> None:
        if self.error is not None:
            if isinstance(self.error, ValueError):  # a problem with the inputs, said in its own words
                raise self.error
            raise RuntimeError("the rollout driver failed") from self.error

    def state_dict(self) -> dict:
        return {"next_group_id": self._next_group_id}

    def load_state_dict(self, state: dict) -> None:
        self._next_group_id = int(state["next_group_id"])

    # ---------------------------------------------------------------- the loop
    async def _main(self, max_groups: int | None, emit: Callable[[Group], None]) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(self.config.tool_workers, thread_name_prefix="agentrl-tool"))
        self._loop, self._main_task = loop, asyncio.current_task()
        self._pump_stop = False
        # Either the driver steps the engine itself, or it watches the engine's own thread: a thread that died never
        # calls back, and without the watch every rollout (and the trainer behind them) would wait forever.
        pump = asyncio.create_task(self._watch() if self.engine.running_in_background else self._pump())
        pending: list[tuple[Group, int]] = []  # (group, member) not yet started
        tasks: set[asyncio.Task] = set()
        self._tasks = tasks
        groups_started = 0
        try:
            while not self._stop.is_set():
                # Refill up to the target: new members of started groups first, then new prompts.
                throttled = False
                while len(tasks) < self.config.in_flight:
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
                        if self._too_long(prompt):
                            continue
                        group = Group(self._next_group_id, prompt, self.config.group_size)
                        self._next_group_id += 1
                        groups_started += 1
                        pending = [(group, member) for member in reversed(range(group.size))]
                    tasks.add(asyncio.create_task(self._rollout(*pending.pop())))
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
            await asyncio.gather(pump, return_exceptions=True)
            self._loop = self._main_task = None

    def _too_long(self, prompt: Prompt) -> bool:
        """Whether `prompt` leaves no room to generate within `max_sample_tokens`: such a prompt is skipped (marked
        consumed, counted in `stats.prompts_too_long`, announced once), and a whole epoch of them is an error rather
        than a run that never trains."""
        n = len(self.fmt.prompt_ids(self.env.start(prompt.sample).messages))
        if n < self.config.max_sample_tokens:
            self._skipped_in_a_row = 0
            return False
        self.prompts.consumed(prompt)
        self.stats.prompts_too_long += 1
        self._skipped_in_a_row += 1
        if self.stats.prompts_too_long == 1:
            print(f"agentrl: prompt {prompt.index} takes {n} tokens, no fewer than rollout.max_sample_tokens "
                  f"({self.config.max_sample_tokens}); prompts that long are skipped and counted", file=sys.stderr)
        if self._skipped_in_a_row >= len(self.prompts.dataset):
            raise ValueError(f"every prompt is at least rollout.max_sample_tokens ({self.config.max_sample_tokens}) "
                             f"tokens long; raise it")
        return True

    def _pool_full(self) -> bool:
        limit = self.max_ready_samples
        return limit is not None and self.pool.num_samples() >= limit

    async def _pump(self) -> None:
        """Step an engine that nobody else drives, off the event loop so tools and callbacks keep running."""
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, thread_name_prefix="agentrl-engine") as executor:
            while not self._pump_stop:
                if self.deterministic and not self._submit_held():
                    await asyncio.sleep(0.001)  # a rollout is still parsing or running tools
                    continue
                if self.engine.has_work():
                    await loop.run_in_executor(executor, self.engine.step)
                else:
                    await asyncio.sleep(0.001)

    def _submit_held(self) -> bool:
        """Deterministic mode: once every live rollout waits on the engine, hand it the held requests in (group,
        member) order and say it may step; False while some rollout is still between requests."""
        if any(task.done() for task in self._tasks):
            return False  # the driver has yet to collect it and start the next rollout in its place
        if len(self._held) + self._in_engine < len(self._tasks):
            return False
        for _, ids, sampling, deliver in sorted(self._held, key=lambda held: held[0]):
            self._in_engine += 1
            self.engine.submit(ids, sampling, callback=deliver)
        self._held.clear()
        return True

    async def _watch(self) -> None:
        """Raise the background engine thread's failure (checked twice a second) until the driver stops."""
        while not self._pump_stop:
            self.engine.check()
            await asyncio.sleep(0.5)

    async def _generate(self, ids: list[int], sampling: SamplingParams, key: tuple) -> Completion:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def deliver(completion: Completion):
            if self.deterministic:
                self._in_engine -= 1  # on the engine's step, which the pump awaits: no race with the loop
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(completion))
            except RuntimeError:  # the loop closed (driver stopped) before the engine finished this request
                pass

        if self.deterministic:
            held = (key, ids, sampling, deliver)
            self._held.append(held)
            try:
                return await future
            except asyncio.CancelledError:
                if held in self._held:
                    self._held.remove(held)
                raise
        request_id = self.engine.submit(ids, sampling, callback=deliver)
        try:
            return await future
        except asyncio.CancelledError:
            self.engine.cancel(request_id)  # a stopped driver hands its engine back with nothing left decoding
            raise

    def _sampling(self, budget: int, key: tuple) -> SamplingParams:
        c = self.config
        seed = None if self.seed is None else turn_seed(self.seed, *key)
        return SamplingParams(max_new_tokens=budget, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              seed=seed, **tool_call_stops(self.fmt, self.engine, c.stop_after_tool_call))

    async def _rollout(self, group: Group, member: int) -> Group:
        c, env, fmt = self.config, self.env, self.fmt
        prompt: Prompt = group.prompt
        episode = env.start(prompt.sample)  # its messages start as the prompt
        messages = list(episode.messages)
        sample_id = prompt.sample.get("id")
        traj = Trajectory(prompt_index=prompt.index, epoch=prompt.epoch, group_id=group.group_id, member=member,
                          gold=prompt.sample.get("answer"), sample_id=None if sample_id is None else str(sample_id))
        traj.append(fmt.prompt_ids(messages), trainable=False)
        traj.prompt_len = len(traj.input_ids)
        self.stats.rollouts_started += 1
        for turn in range(c.max_turns):
            budget = min(c.max_new_tokens, c.max_sample_tokens - len(traj.input_ids))
            if budget <= 0:
                traj.finish_reason = "truncated"
                break
            key = (group.group_id, member, turn)
            sampling = self._sampling(budget, key)
            traj.turn_seeds.append(sampling.seed)
            traj.turn_budgets.append(budget)
            completion = await self._generate(list(traj.input_ids), sampling, key)
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


def tool_call_stops(fmt, engine, enabled: bool) -> dict:
    """`SamplingParams` fields that end a turn after its tool call (`rollout.stop_after_tool_call`): the end tag
    as ids, and as text where the engine can decode (a model may write the tag's text in other pieces than the ids,
    `engine/stop_strings.py`). The driver and `agentrl replay` both take them from here."""
    if not enabled:
        return {}
    text = tuple(fmt.stop_strings) if getattr(engine, "stops_on_text", False) else ()
    return {"stop_sequences": tuple(map(tuple, fmt.stop_sequences)), "stop_strings": text}
