"""The lm_head's one-pass softmax statistics (`head_kernels`, Triton) against the fp64 reference: in Triton's CPU
interpreter (a child process, as `tests/engine/test_triton_attention.py` explains), and on CUDA through the
trainer's fused head."""

from __future__ import annotations

import pytest
import torch
from tests.children import INTERPRETING, interpreter_child, patch_triton_interpreter, run_in_interpreter

from agentrl.train.lm_head import _chunk_stats

pytest.importorskip("triton")

in_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the child of test_kernel_in_interpreter")
INTERPRETER_RUN = interpreter_child(__file__, "-k", "interpreted")


@pytest.mark.child(INTERPRETER_RUN)
def test_kernel_in_interpreter():
    if INTERPRETING:
        pytest.skip("this process is the interpreter run")
    run_in_interpreter(INTERPRETER_RUN)


@in_interpreter
@pytest.mark.parametrize("rows,vocab", [(3, 5000), (2, 2049), (4, 100)])
def test_interpreted_stats_equal_the_reference(rows, vocab):
    patch_triton_interpreter()
    from agentrl.train.head_kernels import online_stats_triton

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0, 7] = 60.0  # one dominant logit: the running maximum moves late in its block
    targets = torch.randint(0, vocab, (rows,), generator=g)
    want = _chunk_stats(logits.double(), targets, 1 / 0.7)
    got = online_stats_triton(logits, targets, 1 / 0.7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_head_on_cuda_equals_fp64():
    """The trainer's head on CUDA (the one-pass statistics, the compiled gradient step, bf16 GEMMs writing fp32)
    against the loss backpropagated through fp64 logits on the CPU."""
    from agentrl.train.config import LossConfig
    from agentrl.train.lm_head import chunked_logprobs
    from agentrl.train.loss import TokenLoss, policy_loss
    from tests.train.test_head_loss import _tokens

    g = torch.Generator().manual_seed(0)
    n, width, vocab = 700, 64, 32000
    hidden = (torch.randn(n, width, generator=g) * 0.5).bfloat16()
    weight = (torch.randn(vocab, width, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, vocab, (n,), generator=g)
    tokens = _tokens(n, 9, g)
    cfg = LossConfig()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logprobs = torch.log_softmax(h64 @ w64.t() / 0.8, dim=-1).gather(1, targets[:, None]).squeeze(1)
    want, _ = policy_loss(logprobs, tokens, cfg, current_version=3)
    want.backward()

    h, w = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_()
    lp, _, got = chunked_logprobs(h, w, targets.cuda(), temperature=0.8, chunk_size=256,
                                  token_loss=TokenLoss(tokens, cfg, current_version=3, device=torch.device("cuda")))
    got.backward()
    torch.testing.assert_close(lp.cpu().double(), logprobs.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(got.cpu().double(), want.detach().double(), rtol=1e-4, atol=1e-6)
    # bf16 gradients (the logits' gradient rounded once to bf16 before each GEMM): within 1% in norm
    for have, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert float((have.cpu().double() - ref).norm() / ref.norm()) < 1e-2
