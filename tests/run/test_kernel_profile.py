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
              _event("train step", DeviceType.CUDA, 9000, annotation=True)]  # a span, not a kernel
    assert kernel_ms(events) == 7.0
    kinds = kernel_kinds(events)
    assert [k for k, _ in kinds] == ["gemm", "attention", "delta rule (fla, agentrl)", "fused (inductor)",
                                     "copy / index / fill"]
    assert [ms for _, ms in kinds] == pytest.approx([4.0, 1.5, 0.7, 0.5, 0.3])
