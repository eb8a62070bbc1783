"""One decode token of a gated delta net, fused, with every sequence's state read and written in place by slot.

The engine keeps each linear-attention layer's states in slot-indexed tensors (`linear_state.LinearStates`). A
decode step through a generic recurrent kernel gathers the rows' states into a temporary, runs the kernel (which
writes a new final state) and scatters that back: three round trips of the largest tensor of the step, plus the
copies that shape its inputs (repeated q/k heads, casts). These kernels read each row's state where it lives and
write it back there, once:

- `conv_step`: the short causal conv of one token per row, `[B, C]` inputs against the window of its slot
  (`conv [S, C, W]`, W = kernel - 1), SiLU applied; the window shifts by one in place.
- `delta_rule_step`: q, k `[B, Hk, Dk]` (value head h reads key head `h // (Hv // Hk)`, never materialised),
  v `[B, Hv, Dv]`, g and beta `[B, Hv]`, state `[S, Hv, Dk, Dv]` fp32. As transformers'
  `torch_recurrent_gated_delta_rule` with `use_qk_l2norm_in_kernel`: q, k L2-normalised (eps 1e-6) in fp32, q
  scaled by Dk^-1/2, `state *= exp(g)`, `state += k (beta (v - state^T k))^T`, output `state^T q` in q's dtype.

Launch grids come from shapes only and nothing reads a tensor back to the host, so a CUDA graph captures both.
Rows must name distinct slots, except that any number of rows may share one scratch slot (a captured step's
padding): their programs then race on it, which leaves some mixture of their finite updates there, read only by
padding rows again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_rule_tile(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, snap_ptr, snaps_ptr,
                     sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sbeta_b, sbeta_h, ss_s, ss_h, so_b, so_h, sn_s,
                     scale, row, h, col, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SNAP: tl.constexpr):
    """Row `row`, value head `h`, block `col` of Dv columns: each column of the state evolves on its own, so a block
    of them needs only its slice of the state plus the whole q and k. With HAS_SNAP, a row whose `snaps` entry is
    >= 0 also writes its new state there."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = col * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    hk = h // GROUP
    q = tl.load(q_ptr + row * sq_b + hk * sq_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * sk_b + hk * sk_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * sv_b + h * sv_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * sg_b + h * sg_h).to(tl.float32)
    beta = tl.load(beta_ptr + row * sbeta_b + h * sbeta_h).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    s_ptrs = state_ptr + slot * ss_s + h * ss_h + offs_k[:, None] * DV + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0) * tl.exp(g)  # [BLOCK_K, BLOCK_V]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptrs, s, mask=mask)
    if HAS_SNAP:
        snap = tl.load(snaps_ptr + row).to(tl.int64)
        n_ptrs = snap_ptr + tl.maximum(snap, 0) * sn_s + h * ss_h + offs_k[:, None] * DV + offs_v[None, :]
        tl.store(n_ptrs, s, mask=mask & (snap >= 0))
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + row * so_b + h * so_h + offs_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, snap_ptr, snaps_ptr,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sbeta_b, sbeta_h, ss_s, ss_h, so_b, so_h, sn_s,
                       scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, HAS_SNAP: tl.constexpr):
    """A program a tile (`_delta_rule_tile`) on a (row, value head, column block) grid. Launching columns first or
    on a persistent grid measured no faster with the slots in order, as the engine has them (BENCHMARKS.md,
    2026-12-02 13:50)."""
    _delta_rule_tile(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, snap_ptr, snaps_ptr,
                     sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sbeta_b, sbeta_h, ss_s, ss_h, so_b, so_h, sn_s,
                     scale, tl.program_id(0), tl.program_id(1), tl.program_id(2), GROUP, DK, DV, BLOCK_K, BLOCK_V,
                     HAS_SNAP)


def delta_rule_config(rows: int, heads: int, dk: int, dv: int) -> dict:
    """Columns per program and warps. Wide blocks (64 columns, 2 warps) when the batch alone fills the GPU: the
    fastest of `benchmarks/delta_rule_sweep.py` at 256 rows of 16 heads of 128 x 128 on an H200 (BENCHMARKS.md);
    narrow ones (8) to spread a small batch over more programs, ~32 state elements per thread."""
    if rows * heads >= 512:
        block_v = min(triton.next_power_of_2(dv), 64)
        return {"block_v": block_v, "num_warps": max(1, min(8, triton.next_power_of_2(dk) * block_v // 4096))}
    block_v = min(triton.next_power_of_2(dv), 8)
    return {"block_v": block_v, "num_warps": max(1, min(8, triton.next_power_of_2(dk) * block_v // 1024))}


def delta_rule_step(q, k, v, g, beta, state, slots, scale: float | None = None, config: dict | None = None,
                    snapshot: torch.Tensor | None = None, snaps: torch.Tensor | None = None):
    """Advance `state[slots[i]]` by row i's token in place; returns the output `[B, Hv, Dv]` in q's dtype.
    Any strides on the batch and head dims of q, k, v, g, beta (the last dim of q, k, v contiguous); the state's
    `[Dk, Dv]` matrices contiguous. With `snapshot` (laid out as `state`) and `snaps` `[B]`, row i's new state is
    also written to `snapshot[snaps[i]]` where that is >= 0: the state at a page boundary, kept for the prefix
    cache, for one more write instead of a gather and a scatter of it after the step."""
    rows, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == rows and hv % hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (rows, hv) and slots.shape == (rows,), (g.shape, beta.shape, slots.shape)
    assert state.shape[1:] == (hv, dk, dv) and state.dtype == torch.float32, (state.shape, state.dtype)
    assert state.stride(3) == 1 and state.stride(2) == dv, "each state matrix must be contiguous"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    has_snap = _check_snapshot(state, snapshot, snaps, rows)
    out = torch.empty((rows, hv, dv), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    cfg = config or delta_rule_config(rows, hv, dk, dv)
    _delta_rule_kernel[(rows, hv, triton.cdiv(dv, cfg["block_v"]))](
        q, k, v, g, beta, state, slots, out, snapshot if has_snap else state, snaps if has_snap else slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), state.stride(0), state.stride(1), out.stride(0), out.stride(1),
        snapshot.stride(0) if has_snap else 0, dk ** -0.5 if scale is None else scale,
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=cfg["block_v"], HAS_SNAP=has_snap,
        num_warps=cfg.get("num_warps", 4))
    return out


def _check_snapshot(state, snapshot, snaps, rows: int) -> bool:
    """Whether a snapshot tensor is given, checked to share `state`'s layout within a slot."""
    if snapshot is None:
        return False
    assert snaps is not None and snaps.shape == (rows,), (None if snaps is None else snaps.shape, rows)
    assert snapshot.shape[1:] == state.shape[1:] and snapshot.dtype == state.dtype, (snapshot.shape, state.shape)
    assert snapshot.stride()[1:] == state.stride()[1:], (snapshot.stride(), state.stride())
    return True


@triton.jit
def _conv_kernel(x_ptr, conv_ptr, slots_ptr, w_ptr, bias_ptr, y_ptr, snap_ptr, snaps_ptr, sx_b, sc_s, sc_c, sw_c,
                 sy_b, sn_s, channels, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_SNAP: tl.constexpr):
    """Program (row, block of channels): y = silu(window . w[:, :W] + x w[:, W] + bias); window <- window[1:] + x,
    also written to `snap[snaps[row]]` with HAS_SNAP where that is >= 0."""
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_w = tl.arange(0, BLOCK_W)
    mask_c = offs_c < channels
    mask = mask_c[:, None] & (offs_w[None, :] < WIDTH)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    win_ptrs = conv_ptr + slot * sc_s + offs_c[:, None] * sc_c + offs_w[None, :]
    window = tl.load(win_ptrs, mask=mask, other=0.0)  # [BLOCK_C, BLOCK_W], columns past WIDTH zero
    x = tl.load(x_ptr + row * sx_b + offs_c, mask=mask_c, other=0.0)
    w = tl.load(w_ptr + offs_c[:, None] * sw_c + offs_w[None, :], mask=mask, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + offs_c * sw_c + WIDTH, mask=mask_c, other=0.0).to(tl.float32)
    y = tl.sum(window.to(tl.float32) * w, axis=1) + x.to(tl.float32) * w_last
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    y = y * tl.sigmoid(y)
    tl.store(y_ptr + row * sy_b + offs_c, y.to(y_ptr.dtype.element_ty), mask=mask_c)
    # The shifted window: column j takes column j + 1 (re-read, the loads above are done), the last takes x.
    shifted = tl.load(win_ptrs + 1, mask=mask & (offs_w[None, :] < WIDTH - 1), other=0.0)
    shifted = tl.where(offs_w[None, :] == WIDTH - 1, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()
    tl.store(win_ptrs, shifted.to(conv_ptr.dtype.element_ty), mask=mask)
    if HAS_SNAP:
        snap = tl.load(snaps_ptr + row).to(tl.int64)
        n_ptrs = snap_ptr + tl.maximum(snap, 0) * sn_s + offs_c[:, None] * sc_c + offs_w[None, :]
        tl.store(n_ptrs, shifted.to(conv_ptr.dtype.element_ty), mask=mask & (snap >= 0))


def conv_step(x, conv, slots, weight, bias=None, block_c: int = 256, snapshot: torch.Tensor | None = None,
              snaps: torch.Tensor | None = None):
    """SiLU of the depthwise causal conv of one token per row, `x [B, C]` after the window of its slot in
    `conv [S, C, W]` (updated in place); `weight [C, 1, W + 1]` as `nn.Conv1d`'s. Returns `[B, C]` in x's dtype.
    `snapshot`, `snaps`: as `delta_rule_step`'s, for the shifted windows."""
    rows, channels = x.shape
    width = conv.shape[2]
    assert conv.shape[1] == channels and weight.shape == (channels, 1, width + 1), (x.shape, conv.shape, weight.shape)
    assert x.stride(1) == 1 and conv.stride(2) == 1 and weight.stride(2) == 1 and slots.shape == (rows,)
    has_snap = _check_snapshot(conv, snapshot, snaps, rows)
    y = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block_c = min(block_c, triton.next_power_of_2(channels))
    _conv_kernel[(rows, triton.cdiv(channels, block_c))](
        x, conv, slots, weight, bias if bias is not None else weight, y, snapshot if has_snap else conv,
        snaps if has_snap else slots, x.stride(0), conv.stride(0), conv.stride(1), weight.stride(0), y.stride(0),
        snapshot.stride(0) if has_snap else 0, channels, WIDTH=width, BLOCK_W=triton.next_power_of_2(width),
        BLOCK_C=block_c, HAS_BIAS=bias is not None, HAS_SNAP=has_snap, num_warps=4 if block_c >= 256 else 1)
    return y


def decode_rows(module, mixed, g, beta, conv_states, rec_states, slots, snapshot=None):
    """`linear_state._decode_rows` for Triton: one token for each row of `mixed [B, conv_dim]` (the qkv projection)
    continuing from its slot, conv window and recurrent state updated in place. q, k and v are views of the conv
    output: no copy between the two kernels. `snapshot`: `(conv, recurrent, snaps)`, this layer's snapshot tensors
    and each row's snapshot index (-1: none), written with the new window and state. Returns the core output
    `[B, Hv, Dv]`."""
    snap_conv, snap_rec, snaps = snapshot if snapshot is not None else (None, None, None)
    y = conv_step(mixed, conv_states, slots, module.conv1d.weight, module.conv1d.bias, snapshot=snap_conv, snaps=snaps)
    kd = module.key_dim
    q = y[:, :kd].unflatten(1, (-1, module.head_k_dim))
    k = y[:, kd:2 * kd].unflatten(1, (-1, module.head_k_dim))
    v = y[:, 2 * kd:].unflatten(1, (-1, module.head_v_dim))
    return delta_rule_step(q, k, v, g, beta, rec_states, slots, snapshot=snap_rec, snaps=snaps)


def check_decode_rows(module, reference, rows: int = 3, seed: int = 0) -> str | None:
    """Why `decode_rows` cannot stand in for `reference` (the gathered path, called as `reference(module, mixed, g,
    beta, conv_states, rec_states, slots)`) on `module`'s layer here, or None. Run once when an engine starts, on
    random inputs of the layer's shapes: a kernel that fails to compile or computes differently on this GPU and
    Triton is left for the reference, rather than failing or silently skewing a run.

    Two checks. In fp32 (an fp32 copy of the layer where it is not fp32 already) both sides compute the same values,
    so differences beyond summation order are errors: the output within 1e-3 of its scale, the states within 1e-4,
    the windows exact. In the layer's own dtype (the variant the engine runs) the reference rounds the conv's output
    and its SiLU to bf16 one after the other where the kernel rounds once, so q, k and v may differ by a unit in
    their last place and the states by as much relative to an update: there the check is that the kernel compiles
    and lands within two units of the dtype (output and states), the windows still exact."""
    import copy

    dtype = module.in_proj_qkv.weight.dtype
    modules = [(module, dtype)] if dtype == torch.float32 else [(copy.deepcopy(module).float(), torch.float32),
                                                                   (module, dtype)]
    for layer, dt in modules:
        failure = _check_once(layer, reference, rows, seed)
        if failure is not None:
            return failure if dt == dtype else f"{failure} in fp32"
    return None


def _check_once(module, reference, rows: int, seed: int) -> str | None:
    weight = module.in_proj_qkv.weight
    device, dtype = weight.device, weight.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    heads = module.value_dim // module.head_v_dim
    width = module.conv_kernel_size - 1
    slots = torch.tensor([3, 0, 1, 2][:rows], device=device)
    mixed = torch.randn(rows, 2 * module.key_dim + module.value_dim, generator=gen, device=device).to(dtype)
    g = -torch.rand(rows, heads, generator=gen, device=device)
    beta = torch.rand(rows, heads, generator=gen, device=device).to(dtype)
    conv = torch.randn(rows + 2, mixed.shape[1], width, generator=gen, device=device).to(dtype)
    state = torch.randn(rows + 2, heads, module.head_k_dim, module.head_v_dim, generator=gen, device=device) * 0.1
    try:
        with torch.no_grad():
            got_conv, got_state = conv.clone(), state.clone()
            got = decode_rows(module, mixed, g, beta, got_conv, got_state, slots).float()
            want_conv, want_state = conv.clone(), state.clone()
            want = reference(module, mixed, g, beta, want_conv, want_state, slots).float()
    except Exception as exc:  # whatever the compiler or the launch raises
        return f"failed here ({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]})"
    out_tol, state_tol = (1e-3, 1e-4) if dtype == torch.float32 else (2 * 2.0 ** -7, 2 * 2.0 ** -7)
    out_err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
    state_err = float((got_state - want_state).abs().max() / want_state.abs().max().clamp_min(1e-6))
    if out_err > out_tol or state_err > state_tol or not torch.equal(got_conv, want_conv):
        return (f"differs from the reference here (output {out_err:.3g} of its scale, state {state_err:.3g}, "
                f"windows {'equal' if torch.equal(got_conv, want_conv) else 'different'})")
    return None
