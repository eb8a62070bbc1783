"""The benchmarks' kernel-time totals: device kernels counted once (an op's event also carries its kernels' time)."""

from types import SimpleNamespace

import pytest

from torch.autograd import DeviceType

from benchmarks.kernel_profile import kernel_kinds, kernel_ms


def _event(key, device_type, us, annotation=False):
    return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us, is_user_annotation=annotation)


def test_kernels_are_counted_once_and_sorted_by_kind():
    events = [_event("aten::mm", DeviceType.CPU, 4000),  # the op: its kernel's time again
              _event("sm90_xmma_gemm_bf16bf16_bf16f32", DeviceType.CUDA, 4000),
              _event("aten::_flash_attention_forward", DeviceType.CPU, 1500),
              _event("void pytorch_flash::flash_fwd_kernel<...>", DeviceType.CUDA, 1500),
              _event("triton_poi_fused_add_mul_0", DeviceType.CUDA, 500),
              _event("chunk_gated_delta_rule_fwd_kernel_h", DeviceType.CUDA, 700),
              _event("void at::native::index_elementwise_kernel<...>", DeviceType.CUDA, 200),
              _event("void at::native::chunk_cat_cuda_kernel<...>", DeviceType.CUDA, 100),  # a copy, not fla's
              _event("void pytorch_flash::flash_bwd_convert_dq_kernel<...>", DeviceType.CUDA, 300),  # not a conv
              _event("triton_poi_fused__to_copy_convert_element_type_1", DeviceType.CUDA, 200),  # nor this
              _event("void at::native::conv_depthwise2d_forward_kernel<...>", DeviceType.CUDA, 400),
              _event("train step", DeviceType.CUDA, 9000, annotation=True)]  # a span, not a kernel
    assert kernel_ms(events) == pytest.approx(7.9)
    kinds = kernel_kinds(events)
    assert [k for k, _ in kinds] == ["gemm", "attention", "fused (inductor)", "delta rule (fla, agentrl)", "conv",
                                     "copy / index / fill"]
    assert [ms for _, ms in kinds] == pytest.approx([4.0, 1.8, 0.7, 0.7, 0.4, 0.3])


def test_trace_gaps_are_charged_to_the_host_frames_around_them():
    """Two kernels 100 us apart (a 100-us gap) and two close ones: one gap, charged to the deepest of our frames
    running at its middle and to the frame that launched the kernel ending it."""
    from benchmarks.trace_gaps import busy_intervals, gaps, summary

    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [x("kernel", "gemm", 0, 50, correlation=1), x("kernel", "flash", 150, 50, correlation=2),
              x("kernel", "copy", 205, 10, correlation=3), x("kernel", "side", 160, 10, correlation=4),
              x("python_function", "agentrl/train/trainer.py(90): step", 0, 300),
              x("python_function", "agentrl/train/pack.py(10): pack_samples", 60, 70),
              x("python_function", "torch/nn/modules/module.py(1): _call_impl", 80, 20),
              x("python_function", "agentrl/train/logprobs.py(470): packed_token_logprobs", 140, 5),
              x("cuda_runtime", "cudaLaunchKernel", 142, 2, correlation=2)]
    assert [(s, e) for s, e, _ in busy_intervals(events)] == [(0, 50), (150, 200), (205, 215)]
    found = gaps(events, min_us=20)
    assert [(g.start, g.end, g.during, g.launched_by) for g in found] == [
        (50, 150, "agentrl/train/pack.py(10): pack_samples", "agentrl/train/logprobs.py(470): packed_token_logprobs")]
    assert summary(events).startswith("device busy 0.1 ms of a 0.2 ms span (first to last kernel); 1 gaps over 20 us")


def test_the_step_flops_count_the_head_only_where_the_loss_reads_it():
    """Two batches of the same tokens, one with a third of them untrained: they differ by the head's 6 x vocab x
    hidden FLOPs at each untrained target and by nothing else (the decoder and attention run over every token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.sample import TrainingSample
    from agentrl.train.pack import pack_samples
    from benchmarks.train_step import flops_per_step

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)

    def batch(prompt):
        samples = [TrainingSample(list(range(n)), [0] * prompt + [1] * (n - prompt), [0.0] * n,
                                  [-1] * prompt + [0] * (n - prompt)) for n in (30, 12)]
        return pack_samples(samples, 64)

    all_trained, a_third_untrained = batch(1), batch(5)
    untrained = 2 * (5 - 1)
    assert int(all_trained.loss_mask.sum()) - int(a_third_untrained.loss_mask.sum()) == untrained
    assert flops_per_step(model, all_trained) - flops_per_step(model, a_third_untrained) == 6 * 100 * 32 * untrained
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    pairs = (30 * 30 + 12 * 12) / 2
    assert flops_per_step(model, all_trained) == 6 * body * 42 + 6 * 100 * 32 * 40 + 12 * 2 * 4 * 8 * pairs
