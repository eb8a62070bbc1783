"""The chunked lm_head: per-token logprobs and entropy of the trained targets, without full logits.

Full logits for 25k packed tokens at a 152k vocabulary are 15 GiB in fp32; only trainable positions need them, and
only a chunk at a time. GEMMs run in the model dtype (tensor cores), softmax statistics and gradient accumulation in
fp32. Given the loss (`token_loss`, the trainer's way), the head takes the loss's gradient in its forward while each
chunk's logits exist (`ChunkedHeadLoss`); without it, the backward recomputes each chunk's logits instead of storing
them (`ChunkedLMHead`).
"""

from __future__ import annotations

from typing import Callable

import torch


class ChunkedLMHead(torch.autograd.Function):
    """`(hidden [N, H], weight [V, H], targets [N]) -> (logprobs [N], entropy [N])`, both fp32, chunk by chunk.

    Only `[chunk, V]` logits exist at any time. The forward keeps each row's logsumexp and entropy; the backward
    recomputes the chunk's logits and accumulates the weight gradient into one fp32 buffer. Past the GEMMs the
    work is memory-bound passes over `[chunk, V]` fp32, which is why those two steps are plain functions that
    torch.compile fuses into one or two passes on GPU (time and memory against full fp32 logits: BENCHMARKS.md).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, compiled: bool):
        n = hidden.shape[0]
        stats, _ = _steps(compiled, hidden.device)
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for s, e in chunk_bounds(n, chunk_size):
            logprobs[s:e], entropy[s:e], lse[s:e] = stats(_logits(hidden[s:e], weight), targets[s:e], 1.0 / temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled
        # An unused output (entropy is usually only logged) then arrives as None and costs nothing in backward.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 6
        if (grad_logprobs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return none
        _, grad_step = _steps(ctx.compiled, hidden.device)
        chunk, inv_temp = ctx.chunk_size, 1.0 / ctx.temperature
        sums = _InputGradients(hidden, weight, need_hidden, need_weight)
        for s, e in chunk_bounds(hidden.shape[0], chunk):
            g_lp = grad_logprobs[s:e] if grad_logprobs is not None else None
            g_ent = grad_entropy[s:e] if grad_entropy is not None else None
            sums.add(s, e, grad_step(_logits(hidden[s:e], weight), targets[s:e], lse[s:e], entropy[s:e], g_lp, g_ent,
                                     inv_temp, weight.dtype))
        return (*sums.result(), None, None, None, None)


class ChunkedHeadLoss(torch.autograd.Function):
    """`(hidden, weight, targets, ..., token_loss) -> (loss, logprobs, entropy)`: the chunked lm_head with the loss's
    gradient taken in the forward, while each chunk's logits exist.

    `token_loss(logprobs, start, end)` gives the terms of rows `start:end` from their logprobs, each a function of its
    own row only (`loss.TokenLoss`); the loss is their sum. Per chunk the forward computes the logits, their
    statistics, the terms' gradient with respect to the logprobs (autograd over the `[chunk]` terms), then the
    logits' gradient and from it the hidden states' and the weight's. The backward only scales those by the
    incoming gradient: the logits are computed once a step instead of twice (`ChunkedLMHead` recomputes them).
    Logprobs and entropy come out detached; the entropy carries no gradient on this path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, compiled: bool, token_loss):
        n = hidden.shape[0]
        stats, grad_step = _steps(compiled, hidden.device)
        inv_temp = 1.0 / temperature
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        loss = hidden.new_zeros((), dtype=torch.float32)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sums = _InputGradients(hidden, weight, need_hidden, need_weight)
        for s, e in chunk_bounds(n, chunk_size):
            logits = _logits(hidden[s:e], weight)
            lp, ent, lse = stats(logits, targets[s:e], inv_temp)
            logprobs[s:e], entropy[s:e] = lp, ent
            with torch.enable_grad():
                x = lp.detach().requires_grad_()
                terms = token_loss(x, s, e).sum()
                (g_lp,) = torch.autograd.grad(terms, x)
            loss += terms.detach()
            if need_hidden or need_weight:
                sums.add(s, e, grad_step(logits, targets[s:e], lse, ent, g_lp, None, inv_temp, weight.dtype))
        ctx.save_for_backward(*sums.result())
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprobs, _grad_entropy):
        return (*(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors),
                None, None, None, None, None)


class _InputGradients:
    """The hidden states' and the weight's gradients, summed chunk by chunk from the logits' gradient `gz`.

    The GEMMs run in the model dtype; .float() copies would fall onto fp32 SIMT kernels, several times slower than
    the tensor cores. fp32 survives where it matters: in the softmax and in the buffer the weight gradient is summed
    into across chunks."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, need_hidden: bool, need_weight: bool):
        self.hidden, self.weight = hidden, weight
        self.grad_hidden = torch.empty_like(hidden) if need_hidden else None
        self.grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight
                            else None)

    def add(self, start: int, end: int, gz: torch.Tensor) -> None:
        if self.grad_hidden is not None:
            self.grad_hidden[start:end] = gz @ self.weight
        if self.grad_weight is not None:
            _accumulate(self.grad_weight, gz.t(), self.hidden[start:end])

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(grad_hidden, grad_weight)`, the weight's in its own dtype; None where not asked for."""
        weight = None if self.grad_weight is None else self.grad_weight.to(self.weight.dtype)
        return self.grad_hidden, weight


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """`[start, end)` of the chunks of `n` rows, `size` rows each; a last chunk of one row joins the one before.
    Compiled, a chunk of one row is a size dynamo specializes even in a dynamic graph (0/1 specialization): one more
    compile of both steps, in whichever training step first ends a micro-batch on one row."""
    bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    """Per row: logprob of the target, entropy, logsumexp, of softmax(logits * inv_temp); all fp32."""
    z = logits * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse[:, None])
    return z.gather(1, targets[:, None]).squeeze(1) - lse, lse - (p * z).sum(-1), lse


def _chunk_grad(logits, targets, lse, entropy, grad_logprobs, grad_entropy, inv_temp: float, dtype: torch.dtype):
    """Gradient w.r.t. the raw logits, in `dtype`, from the saved logsumexp and entropy.

    d logprob / dz = onehot(target) - p;  d entropy / dz = -p * (z - (lse - entropy));  dz / dlogits = inv_temp.
    `p - onehot` is formed in fp32 before the cast: p_target near 1 would round the difference to 0 in bf16.
    """
    z = logits * inv_temp
    p = torch.exp(z - lse[:, None])
    grad = torch.zeros_like(z)
    if grad_logprobs is not None:
        onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
        grad = (p - onehot.to(z.dtype)) * (-grad_logprobs)[:, None]
    if grad_entropy is not None:
        grad = grad - p * (z - (lse - entropy)[:, None]) * grad_entropy[:, None]
    return (grad * inv_temp).to(dtype)


_COMPILED = {}


def compile_chunk_steps(**options) -> tuple[Callable, Callable]:
    """`_chunk_stats` and `_chunk_grad` compiled (`options` go to torch.compile), their row dimension dynamic from
    the first call: one compile serves every chunk of two rows or more. Left to dynamo's default, the first size
    seen compiled static and the next one compiled again, in whichever training step first met a second size (a
    first micro-batch of fewer trained tokens than a chunk made that a later step)."""

    def dynamic_rows(fn):
        compiled = torch.compile(fn, **options)

        def call(*args):
            for a in args:
                if isinstance(a, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(a, 0)
            return compiled(*args)

        return call

    return dynamic_rows(_chunk_stats), dynamic_rows(_chunk_grad)


def _steps(compiled: bool, device: torch.device | None = None):
    """The chunk steps: eager, or compiled; on CUDA the statistics from one read of the logits (`head_kernels`)."""
    if not compiled:
        return _chunk_stats, _chunk_grad
    if not _COMPILED:
        _COMPILED["steps"] = compile_chunk_steps()
    stats, grad = _COMPILED["steps"]
    if device is not None and device.type == "cuda":
        from agentrl.train.head_kernels import online_stats_triton

        stats = online_stats_triton
    return stats, grad


_FP32_OUT = {}  # device type -> whether torch.mm / addmm take out_dtype there (CUDA in recent torch)


def _fp32_out(device: torch.device) -> bool:
    if device.type not in _FP32_OUT:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            c = torch.zeros(2, 2, dtype=torch.float32, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            _FP32_OUT[device.type] = bool(c[0, 0] == 2)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT[device.type] = False
    return _FP32_OUT[device.type]


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if hidden.dtype != torch.float32 and _fp32_out(hidden.device):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # low-precision GEMM writing fp32 directly
    return (hidden @ weight.t()).float()


def _accumulate(buffer: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """buffer (fp32) += a @ b, the product computed in a's dtype."""
    if a.dtype == torch.float32:
        buffer.addmm_(a, b)
    elif _fp32_out(a.device):
        torch.addmm(buffer, a, b, out_dtype=torch.float32, out=buffer)
    else:
        buffer.add_(a @ b)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     temperature: float = 1.0, chunk_size: int = 1024, compile: bool | None = None,
                     token_loss: Callable | None = None) -> tuple[torch.Tensor, ...]:
    """Per-row logprob of `targets` and entropy under `softmax(hidden @ weight.T / temperature)`, in fp32.

    `compile` (default: on CUDA) fuses the per-chunk softmax work with torch.compile; the CPU path runs the same
    functions eagerly. With `token_loss` (`loss.TokenLoss`, or any `(logprobs, start, end) -> terms` whose terms
    each depend on their own row), returns `(logprobs, entropy, loss)` instead: the loss (the terms' sum) carries
    the gradient, taken chunk by chunk in the forward (`ChunkedHeadLoss`), and the two others are detached.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden rows {hidden.shape[0]}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but the lm_head weight is {weight.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    compiled = hidden.is_cuda if compile is None else compile
    if token_loss is None:
        return ChunkedLMHead.apply(hidden, weight, targets.long(), float(temperature), int(chunk_size), compiled)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        logprobs, entropy = ChunkedLMHead.apply(hidden, weight, targets.long(), float(temperature),
                                                int(chunk_size), compiled)
        return logprobs, entropy, token_loss(logprobs, 0, hidden.shape[0]).sum()
    loss, logprobs, entropy = ChunkedHeadLoss.apply(hidden, weight, targets.long(), float(temperature),
                                                    int(chunk_size), compiled, token_loss)
    return logprobs, entropy, loss


def lm_head_weight(model) -> torch.Tensor:
    """The vocabulary projection, refusing heads the chunked path would compute wrongly (bias, logit scaling)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the chunked lm_head assumes a bias-free vocabulary projection")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) not in (None, 1.0):
            raise ValueError(f"the model's logits are post-processed ({name}); the chunked lm_head does not do that")
    weight = head.weight
    if _is_dtensor(weight):
        # Tensor parallelism keeps the vocabulary projection replicated: the local tensor is the whole matrix,
        # and to_local() carries the gradient back to the DTensor parameter.
        weight = weight.to_local()
    return weight


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
