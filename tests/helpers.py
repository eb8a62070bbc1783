"""Helpers shared by the tests, in one module: test files import from here and never from each other.

Sections: shared data, engine references (prompts, transformers' greedy decode, recomputed logits, weight
perturbation, stand-in CUDA graphs), host reads a CUDA capture refuses, packed-training references, the scripted
tool-calling policy, and stand-in tracker packages. Tests run in child processes (Triton's interpreter, children
started ahead) have their own module, `tests.children`.
"""

from __future__ import annotations

import importlib.machinery
import sys
import traceback
import types
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from agentrl.engine import Engine, EngineConfig, SamplingParams
from agentrl.engine.attention import current_step
from agentrl.sample import TrainingSample

# ---------------------------------------------------------------------------------------------- shared data

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_DATA = SHARED / "data"

# ---------------------------------------------------------------------------------------- engine references

def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def recomputed_logits(model, completion) -> torch.Tensor:
    """Logits that predicted each generated token, from one forward over prompt + generated."""
    ids = completion.prompt_ids + completion.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    n = len(completion.prompt_ids)
    return logits[n - 1:len(ids) - 1]


def warped_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' own warpers, in generate's order, as the independent reference."""
    scores = logits.clone()
    if params.temperature != 1:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.log_softmax(-1)


def perturb_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.05)


# ---------------------------------------------------------------------- stand-in CUDA graphs (CPU)

GRAPH_CONFIG = dict(num_pages=64, max_model_len=128, max_num_seqs=16, max_tokens_per_step=64)

def binding(engine):
    return engine.storage.kv.data_ptr(), tuple(p.data_ptr() for p in engine.view.parameters())


def graph_engine(model, log: list | None = None, mixed: bool = False, on_capture: Callable | None = None,
                 **overrides) -> Engine:
    """An engine whose decode steps (and with `mixed`, steps that prefill) replay stand-in graphs, made by the
    engine's own `graph_sets` as on CUDA.
    `on_capture(engine)` is called inside each capture."""
    engine = Engine(model, EngineConfig(**{**GRAPH_CONFIG, **overrides}))
    log = [] if log is None else log

    def capture(fn, pool):
        bound = binding(engine)
        log.append(bound)
        if on_capture is not None:
            on_capture(engine)
        fn()  # as cuda_capture's warm-up run: the capture-time buffers must make a valid forward too

        def replay():
            assert binding(engine) == bound, "a graph was replayed over storage that moved since its capture"
            return fn()

        return replay

    decode, mixed_graphs = engine.graph_sets(capture, mixed)
    engine.graphs = decode
    if mixed:
        engine.mixed_graphs = mixed_graphs
    return engine


def completions_of(engine, ids, timeout: float = 60) -> dict:
    """The completions of requests `ids` from a background engine, by request id (waits for all of them)."""
    got = {}
    while len(got) < len(ids):
        c = engine.get_completion(timeout=timeout)
        got[c.request_id] = c
    return got


def two_turns(engine, prompts, params, tool_tokens):
    """Turn 1, then every conversation resubmitted with its completion and a few more tokens: the second turn's
    prompts are chunks after a cached prefix."""
    first = engine.generate(prompts, params)
    again = [p + o.token_ids + t for p, o, t in zip(prompts, first, tool_tokens)]
    return first + engine.generate(again, params)


# ------------------------------------------------------------------------- host reads a capture refuses

class HostReads(TorchDispatchMode):
    """Records the ops that make the host wait for the device (a CUDA capture refuses them), with where each was
    called from (`file:function`, the innermost agentrl, transformers or fla frame). `repeat_interleave` over a tensor
    of counts is one: how fla builds chunk indices from `cu_seqlens` on the device. `unwatched(kernel)` wraps a kernel
    whose reads are exempt (the attention's CPU stand-in reads its boundaries; flash does not)."""

    HOST = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
            "item", "equal", "is_nonzero", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.paused, self.reads = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ in self.HOST:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if any(k in f.filename for k in ("/fla/", "agentrl/", "transformers/"))]
            where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].name}" if frames else "?"
            self.reads.append((str(func), where))
        return func(*args, **(kwargs or {}))

    def unwatched(self, kernel):
        def run(*args):
            self.paused = True
            try:
                return kernel(*args)
            finally:
                self.paused = False
        return run


# -------------------------------------------------------------------------- packed-training references

def train_samples(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompt = 1 + k % 3
        trainable = [0] * prompt + [1] * (n - prompt)
        if n > 6:  # a tool result in the middle: context, not trained on
            trainable[n // 2] = 0
        out.append(TrainingSample(ids, trainable, [-1.0 * t for t in trainable], [0 if t else -1 for t in trainable],
                               advantage=float(k)))
    return out


WELL_CONDITIONED_INIT = 0.02  # transformers' default initializer range


def tiny_qwen35(initializer_range: float, dtype=torch.float32, device="cpu", seed: int = 0):
    """Tiny Qwen3.5 at another initializer range than the tiny models' 1.0, which is wide enough for varied greedy
    text and ill-conditioned enough that fp32's own rounding error is large (see
    `tests/train/test_linear_conv.py::test_the_fp32_bound_is_above_fp32_rounding`)."""
    from agentrl.models import tiny_model

    model, _ = tiny_model("tiny-qwen3.5", seed, initializer_range=initializer_range)
    return model.to(device=device, dtype=dtype)


def per_sample_logprobs(model, samples):
    """Reference: each sample alone, unpacked, through the ordinary full-logits forward."""
    lps = []
    for s in samples:
        ids = torch.tensor([s.input_ids], device=model.device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
        lps.append(logp[torch.tensor(s.trainable[1:], dtype=torch.bool, device=model.device)])
    return torch.cat(lps)


def in_packed_order(ref, samples, batch):
    """Reorder per-sample reference logprobs (sample after sample) into the packed row-major order."""
    by_sample = [list(t) for t in torch.split(ref, [s.num_trainable for s in samples])]
    return torch.stack([by_sample[i].pop(0) for i in batch.trainable_tokens().sample_index.tolist()])


# ---------------------------------------------------------------------------- scripted policy

"""A deterministic tool-calling policy for tests: a tiny random model whose logits are steered onto a script.

`ScriptedPolicy` wraps a causal LM (the tiny random Qwen3 with the byte tokenizer). After the wrapped model's
own forward, every row whose next token is wanted gets a bonus on the scripted token: its logit becomes the
row's maximum plus `margin`. Greedy decoding therefore follows the script exactly, while the logprob the
engine reports (the plain log-softmax of those logits) still depends on the real model, so a test can check
it against an independent forward (`steer` is the one rule both sides use). The margin is finite on purpose:
sampled at temperature > 0, the policy would leave its script now and then.

The script is a function `script(question, turn) -> str`: the text of assistant turn `turn` (0-based) for the
rollout whose first user message is `question`. Its tokens are emitted one by one, then `<|im_end|>`. Where a
sequence stands is read from the sequence itself: the question from the first `<|im_start|>user` block, the
turn from the number of `<|im_start|>assistant` headers, the position in the turn from the tokens after the
last one.

Where the history comes from: inside the engine each sequence is fed only its new tokens, so the wrapper
mirrors the paged KV layout with one token id per KV slot (written at the step's `slot_mapping`, read
through the sequence's block table): it reads a sequence's history exactly the way paged attention reads its
keys, prefix-cache hits and preemptions included. Nothing in the engine knows it is being scripted.
"""
IM_START, IM_END = 257, 258
USER_HEADER = [IM_START, *b"user\n"]
ASSISTANT_HEADER = [IM_START, *b"assistant\n"]

Script = Callable[[str, int], str]


def encode(text: str) -> list[int]:
    """Byte-tokenizer ids of `text`; the chat tags in it (`<tool_call>`, `<|im_end|>`, ...) become single ids."""
    from agentrl.tokenizer import byte_tokenizer

    return list(byte_tokenizer().encode(text, add_special_tokens=False))


def steer(logits: torch.Tensor, token, margin: float) -> torch.Tensor:
    """A copy of `logits` (`[V]`, or `[N, V]` with one token per row) with each row's `token` raised to the
    row's maximum + `margin`."""
    rows = logits.reshape(-1, logits.shape[-1]).clone()
    token = torch.as_tensor(token).reshape(-1, 1)
    rows.scatter_(1, token, rows.max(dim=-1, keepdim=True).values + margin)
    return rows.reshape(logits.shape)


def _headers(history: torch.Tensor, header: list[int]) -> list[int]:
    """Start positions of `header` (which begins with a special id) in a 1-d tensor of ids."""
    n = len(header)
    return [i for i in (history == header[0]).nonzero().flatten().tolist()
            if history[i:i + n].tolist() == header]


def question_of(history: torch.Tensor) -> str | None:
    """The first user message's text, or None."""
    users = _headers(history, USER_HEADER)
    if not users:
        return None
    start = users[0] + len(USER_HEADER)
    ends = (history[start:] == IM_END).nonzero()
    if len(ends) == 0:
        return None
    return bytes(history[start:start + int(ends[0])].tolist()).decode("utf-8")


class ScriptedPolicy(nn.Module):
    """`model` steered onto `script`, to be served by `agentrl.engine.Engine` (which makes its own view of it)."""

    def __init__(self, model: nn.Module, script: Script, margin: float = 2.0):
        super().__init__()
        self.inner = model
        self.script = script
        self.margin = margin
        self._turn_ids: dict[tuple[str, int], list[int]] = {}
        self._slot_tokens = torch.zeros(0, dtype=torch.long)  # one token id per KV slot (engine view only)

    @property
    def config(self):
        return self.inner.config

    def turn_ids(self, question: str, turn: int) -> list[int]:
        """The ids assistant turn `turn` generates for `question`: the script's text, then `<|im_end|>`."""
        key = (question, turn)
        if key not in self._turn_ids:
            self._turn_ids[key] = encode(self.script(question, turn)) + [IM_END]
        return self._turn_ids[key]

    def next_token(self, history) -> int:
        """The scripted continuation of a sequence (ids, list or 1-d tensor) that ends inside an assistant turn."""
        history = torch.as_tensor(history, dtype=torch.long)
        question = question_of(history)
        headers = _headers(history, ASSISTANT_HEADER)
        if question is None or not headers:
            raise AssertionError("the scripted policy was asked to continue a sequence with no assistant turn")
        generated = history[headers[-1] + len(ASSISTANT_HEADER):].tolist()
        wanted = self.turn_ids(question, len(headers) - 1)
        if generated != wanted[:len(generated)] or len(generated) > len(wanted):
            raise AssertionError(f"the sequence left the script in turn {len(headers) - 1} of {question!r}: "
                                 f"generated {generated}, scripted {wanted}")
        if len(generated) == len(wanted):
            # The turn is over, but the engine queued this step before it saw the turn's last token (it overlaps
            # step n+1 with step n): whatever is sampled here is discarded.
            return wanted[-1]
        return wanted[len(generated)]

    def forward(self, input_ids, position_ids=None, logits_to_keep=0, **kwargs):
        step = current_step()
        if step is None:
            raise RuntimeError("ScriptedPolicy steers the engine's forward only; use `.inner` for a plain forward")
        out = self.inner(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        meta = step.meta
        slots = meta.slot_mapping.cpu().long()
        written = slots >= 0  # a negative slot is a padding row that writes no KV
        need = int(slots.max()) + 1
        if need > len(self._slot_tokens):
            grown = torch.zeros(max(need, 2 * len(self._slot_tokens)), dtype=torch.long)
            grown[:len(self._slot_tokens)] = self._slot_tokens
            self._slot_tokens = grown
        self._slot_tokens[slots[written]] = input_ids[0].cpu()[written]
        # Rows whose logits were kept are the last query row of the sequences that sample, in batch order.
        ends = {meta.host_query_start[s] + meta.host_query_lens[s] - 1: s for s in range(meta.num_seqs)}
        rows = logits_to_keep.tolist() if torch.is_tensor(logits_to_keep) else []
        tables, ps = meta.block_tables.cpu().long(), meta.page_size
        logits = out.logits
        for j, row in enumerate(rows):
            s = ends[row]
            pos = torch.arange(meta.host_seq_lens[s])
            history = self._slot_tokens[tables[s, pos // ps] * ps + pos % ps]
            logits[0, j] = steer(logits[0, j], self.next_token(history), self.margin)
        return out


# ------------------------------------------------------------------------------- stand-in trackers

# Stand-ins for the optional tracker packages (trackio, tensorboard), installed into `sys.modules` so the
# wiring can be checked without them: every call they receive is recorded.
def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() reports it installed
    return module


def install_fake_trackers(monkeypatch) -> dict:
    calls = {"init": [], "log": [], "finish": 0, "scalars": [], "writers": [], "closed": 0}
    trackio = _module("trackio")
    trackio.init = lambda **kwargs: calls["init"].append(kwargs)
    trackio.log = lambda values, step=None: calls["log"].append((step, dict(values)))

    def finish():
        calls["finish"] += 1

    trackio.finish = finish

    class SummaryWriter:
        def __init__(self, log_dir):
            calls["writers"].append(log_dir)

        def add_scalar(self, key, value, step):
            calls["scalars"].append((key, value, step))

        def flush(self):
            pass

        def close(self):
            calls["closed"] += 1

    writer = _module("torch.utils.tensorboard")
    writer.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    monkeypatch.setitem(sys.modules, "tensorboard", _module("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", writer)
    return calls


# ------------------------------------------------------------------------------- an environment with spread


def byte_sum_environment():
    """GSM8K's calculator environment, rewarded by a hash of the answer's text: a random tiny model then gets a
    spread of rewards in every group, so advantages (and updates) are never all zero."""
    from environments.gsm8k_math import load_environment

    env = load_environment()

    def reward(episode):
        text = episode.final_text or ""
        return (sum(text.encode("utf-8", "replace")) % 97) / 96

    env.reward = reward
    return env


# ------------------------------------------------------------------------------ multi-process launches


def torchrun(nproc: int, args: list[str], timeout_s: float, cwd: Path | None = None) -> str:
    """`python -m torch.distributed.run --nproc-per-node=N args` (gloo on CPU); its output, or the test fails on an
    error or on a hang (a deadlocked collective: gloo's own timeout is 30 minutes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return launched(cmd, nproc, timeout_s, cwd)


def accelerate_launch(nproc: int, args: list[str], timeout_s: float, cwd: Path | None = None) -> str:
    """`accelerate launch --multi_gpu --num_processes N args`, as a user types it; without a GPU accelerate starts
    the processes through torch's launcher and agentrl picks gloo. Output or failure as `torchrun`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
           "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", *args]
    return launched(cmd, nproc, timeout_s, cwd)


def launched(cmd: list[str], nproc: int, timeout_s: float, cwd: Path | None) -> str:
    """Run a launcher command for `nproc` processes in its own session: its output, or the test fails."""
    import os
    import signal
    import subprocess

    import pytest

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it started: one session
        log, _ = proc.communicate()
        pytest.fail(f"{nproc} processes running {cmd} did not finish in {timeout_s} s (deadlock?)\n{log[-4000:]}")
    if proc.returncode:
        pytest.fail(f"{nproc} processes running {cmd} failed (exit {proc.returncode})\n{log[-6000:]}")
    return log
