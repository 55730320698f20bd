"""One decoding step of a linearizable attention-family layer (power1, power2 without a clamp) as
Triton kernels: features, decay, the state and normaliser advanced in place, the denominator and
the output, for every (batch row, head).

    phi(k) = scale^p k  or  scale^2 k (x) k          phi(q) = q  or  q (x) q   (p = 1, 2)
    S = exp(A) S + phi(k)^T v                        z = exp(A) z + phi(k)     (fp32, where they lie)
    o = phi(q) S / den                               den: phi(q) . z, clamped or + 1e-4, the count, count^c, or 1

The step reads and writes the state once: for power2 one program holds the rows (a, b) of a few
first indices a (its query and key features are x_a x_b for a block of b; the indices taken from
alternate ends so that every program reads as many packed rows), so the features are never
written to memory. The state of power2 may be packed (the d (d + 1) / 2 rows a <= b, see
`attnlab.models.ops.attention_family`): half the bytes of the full d^2 rows, which the kernel also
reads. power2's programs write partial sums over their rows; a second, small kernel adds them,
divides and writes the output. power1 (one program per head) finishes in the first.

power2's windowed step (`windowed_step`, the engine's on CUDA) reads the state without writing it:
`_read_kernel` forms phi(q) S and phi(q) . z over contiguous ranges of whole rows (each row's indices from
a table), and `_window_finish_kernel`, one program per (batch row, head), adds the attention to the
window of recent tokens, puts this token in it and, on the step that fills it, folds the window into
the state: one read and write of the state per window instead of per token.

A prompt's state (the prefill) is `linear_state_update`: for power2 one program per few first indices
a and head multiplies the keys' tile, scaled by scale^2 k_a and the decay to the prompt's end, with
the values' tile (16-bit products with fp32 sums from 16-bit inputs, fp32 ones from fp32), so the d^2 features of
the prompt's tokens never exist in memory; the outputs are the quadratic form's.

The PyTorch references are `recurrent_step`, `windowed_step` and `linear_state_update` in
`attnlab.models.ops.attention_family`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attnlab.models.ops.attention_family import RECENT_BUFFERS, SUM_DENOMINATORS, linear_feature_count
from attnlab.models.ops.attention_family import linear_state_update as reference_state_update


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"

STEP_FIRST_INDICES = 4  # power2's first indices per step program (their packed rows balanced across programs)
# rows (a, b) per tile and warps per step program, for bf16 and fp32 states alike. Timed in the model
# (`attnlab bench decode`, 2mamba, 8 rows x 20 layers x 16 heads of 64, H100): the fp32 state's step kernel
# took 1.37 ms per token in tiles of 64 rows on 4 warps, 1.16 ms in tiles of 32 on 2.
STEP_BLOCK_J = 32
STEP_WARPS = 2
# The prompt's state (`_state_kernel`): a program forms the features of a few first indices a at once,
# STATE_FEATURE_ROWS rows (a, b) in all, from one load of each tile of keys and values, in steps of
# STATE_BLOCK_T tokens (one first index a program, as before, re-read the keys and values d times). Timed on an
# H100 at the decode benchmark's shape (`benchmarks/power2_state_kernel.py`: 8 x 2048 tokens, 16 heads of 64, bf16):
# 0.81 ms a layer (170 TFLOP/s) in 256 rows, 32 tokens, 4 warps; 0.97-4.2 ms in the 15 other shapes of 64 to 512
# rows, 32 or 64 tokens, 4 or 8 warps; one first index a program took 2.29 ms.
# The windowed step's read (`_read_kernel`): each head's rows split into READ_PROGRAMS contiguous ranges, read in
# tiles of READ_BLOCK_ROWS whole rows by READ_WARPS warps. Timed on an H100 (`benchmarks/power2_step_kernel.py`: one
# 2mamba layer's whole step, 8 rows x 16 heads of 64, folds included, captured): 36.7 us (fp32 state) and 17.5 us
# (bf16) in 8 ranges, 64 rows, 2 warps; 37.1-81.0 and 17.3-80.1 us in the 26 other choices of 8-32 ranges, 32-128
# rows, 2-8 warps (16 ranges of 64 rows on 4 warps: 49.6 and 31.7 us); the step that rewrites the state took 63.6 and 31.4.
READ_PROGRAMS = 8
READ_BLOCK_ROWS = 64
READ_WARPS = 2
FOLD_BLOCK_J = 32  # rows (a, b) per tile where the windowed step's finish kernel folds a full window into the state
STATE_FEATURE_ROWS = 256
STATE_BLOCK_T = 32
STATE_WARPS = 4

DENOMINATOR_MODES = {"none": 0, "sum": 1, "sum_clamped": 2, "sum_detached": 3, "count": 4, "count_power": 5,
                     "sum_detached_eps": 6}


DECAY_FUNCTIONS = {None: 0, "neg_softplus": 1}  # what the kernels make of `log_decay`: itself, or -softplus of it


@triton.jit
def _log_decay(x, DECAY_FN: tl.constexpr):
    """The log-decay from the kernels' input: x, or -softplus(x) (linear above 20, as torch's)."""
    if DECAY_FN == 1:
        return -tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return x


@triton.jit
def _finish(acc, den, count, power, MODE: tl.constexpr):
    """acc / the finished denominator (1 where it is 0), as `_finish_denominator` then `_divide`."""
    if MODE == 0:
        return acc
    if MODE == 1:
        f = den
    elif MODE == 4:
        f = count
    elif MODE == 5:  # count ** power, 0 for no token
        f = tl.where(count > 0, tl.exp2(power * tl.log2(tl.maximum(count, 1.0))), 0.0)
    elif MODE == 6:
        f = den + 1e-4  # the ops' DETACHED_EPS
    else:
        f = tl.maximum(den, 1.0)
    return acc / tl.where(f == 0.0, 1.0, f)


@triton.jit
def _step_kernel(Q, K, V, LOGD, STATE, NORM, COUNT, CPOW, PART, PART_DEN, O,
                 sqb, sqh, skb, skh, svb, svh, sdb, sdh, scale_k,
                 H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr,
                 POWER: tl.constexpr, PACKED: tl.constexpr, HAS_DECAY: tl.constexpr, MODE: tl.constexpr,
                 FINISH: tl.constexpr, BJ: tl.constexpr, BV: tl.constexpr, A_PER: tl.constexpr, DECAY_FN: tl.constexpr):
    i_g, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    offs_v = i_v * BV + tl.arange(0, BV)
    m_v = offs_v < DV
    b_v = tl.load(V + i_b * svb + i_h * svh + offs_v, mask=m_v, other=0.0).to(tl.float32)
    decay = 1.0
    if HAS_DECAY:
        decay = tl.exp(_log_decay(tl.load(LOGD + i_b * sdb + i_h * sdh).to(tl.float32), DECAY_FN))
    q_row = Q + i_b * sqb + i_h * sqh
    k_row = K + i_b * skb + i_h * skh
    p_state = STATE + i_bh.to(tl.int64) * F * DV
    p_norm = NORM + i_bh.to(tl.int64) * F
    acc = tl.zeros([BV], tl.float32)
    den = tl.zeros([BJ], tl.float32)
    for t in tl.static_range(A_PER):
        # power2: the program's A_PER first indices a, from alternate ends of A_PER equal ranges so
        # that their packed rows (D - a each) add up to the same count in every program
        i_a = t * (D // A_PER) + (i_g if t % 2 == 0 else D // A_PER - 1 - i_g)
        # rows (a, b) for b in [lo, D) (power2), or b in [0, D) (power1)
        lo = 0
        first_row = 0
        q_a = 1.0
        k_a = 1.0
        if POWER == 2:
            q_a = tl.load(q_row + i_a).to(tl.float32)
            k_a = tl.load(k_row + i_a).to(tl.float32)
            lo, first_row = _power2_rows(i_a, D, PACKED)
        for j0 in range((lo // BJ) * BJ, D, BJ):
            offs_j = j0 + tl.arange(0, BJ)
            m_j = (offs_j >= lo) & (offs_j < D)
            q_j = tl.load(q_row + offs_j, mask=m_j, other=0.0).to(tl.float32)
            k_j = tl.load(k_row + offs_j, mask=m_j, other=0.0).to(tl.float32)
            phi_q = q_a * q_j
            phi_k = k_a * k_j * scale_k
            if PACKED:  # the rows a < b stand for (a, b) and (b, a)
                phi_q = tl.where(offs_j > i_a, 2.0 * phi_q, phi_q)
            rows = first_row + offs_j - lo
            p_s = p_state + rows[:, None] * DV + offs_v[None, :]
            m_s = m_j[:, None] & m_v[None, :]
            b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
            b_s = b_s * decay + phi_k[:, None] * b_v[None, :]
            tl.store(p_s, b_s.to(STATE.dtype.element_ty), mask=m_s)  # a 16-bit state is rounded only where it is stored
            acc += tl.sum(phi_q[:, None] * b_s, 0)
            if (MODE >= 1 and MODE <= 3) or MODE == 6:  # the normaliser: rows owned by the first block of values
                m_z = m_j & ((offs_j * 0 + i_v) == 0)  # a tensor condition: Triton's interpreter refuses a scalar in a mask
                b_z = tl.load(p_norm + rows, mask=m_z, other=0.0)
                b_z = b_z * decay + phi_k
                tl.store(p_norm + rows, b_z, mask=m_z)
                den += tl.where(m_z, phi_q * b_z, 0.0)
    if FINISH:
        count = tl.load(COUNT + i_b).to(tl.float32)
        power = tl.load(CPOW + i_h).to(tl.float32)
        o = _finish(acc, tl.sum(den, 0), count, power, MODE)
        tl.store(O + i_bh * DV + offs_v, o.to(O.dtype.element_ty), mask=m_v)
    else:
        part = i_g.to(tl.int64) * tl.num_programs(2) + i_bh
        tl.store(PART + part * DV + offs_v, acc, mask=m_v)
        if i_v == 0:
            tl.store(PART_DEN + part, tl.sum(den, 0))


@triton.jit
def _power2_rows(i_a, D: tl.constexpr, PACKED: tl.constexpr):
    """power2's rows (a, b) of first index a: b runs over [lo, D), stored from row first_row on. Returns (lo, first_row)."""
    if PACKED:  # only b >= a
        return i_a, i_a * D - i_a * (i_a - 1) // 2
    return i_a * 0, i_a * D


@triton.jit
def _sum_parts(PART, PART_DEN, G, i_bh, programs, offs_v, m_v, DV: tl.constexpr, MODE: tl.constexpr, BG: tl.constexpr,
               BV: tl.constexpr):
    """The G partial sums of one (row, head) over the state's rows: (acc [BV], the denominator's sum)."""
    acc = tl.zeros([BV], tl.float32)
    den = tl.zeros([BG], tl.float32)
    for g0 in range(0, G, BG):
        offs_g = g0 + tl.arange(0, BG)
        m_g = offs_g < G
        part = offs_g.to(tl.int64) * programs + i_bh
        acc += tl.sum(tl.load(PART + part[:, None] * DV + offs_v[None, :], mask=m_g[:, None] & m_v[None, :], other=0.0), 0)
        if (MODE >= 1 and MODE <= 3) or MODE == 6:
            den += tl.load(PART_DEN + part, mask=m_g, other=0.0)
    return acc, tl.sum(den, 0)


@triton.jit
def _finish_kernel(PART, PART_DEN, COUNT, CPOW, O, G, H: tl.constexpr, DV: tl.constexpr, MODE: tl.constexpr,
                   BG: tl.constexpr, BV: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_v = i_v * BV + tl.arange(0, BV)
    m_v = offs_v < DV
    acc, den = _sum_parts(PART, PART_DEN, G, i_bh, tl.num_programs(1), offs_v, m_v, DV, MODE, BG, BV)
    count = tl.load(COUNT + i_b).to(tl.float32)
    power = tl.load(CPOW + i_h).to(tl.float32)
    o = _finish(acc, den, count, power, MODE)
    tl.store(O + i_bh * DV + offs_v, o.to(O.dtype.element_ty), mask=m_v)


@triton.jit
def _read_kernel(Q, STATE, NORM, ROW_A, ROW_B, PART, PART_DEN, sqb, sqh, ROWS_PER,
                 H: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, PACKED: tl.constexpr, MODE: tl.constexpr,
                 BR: tl.constexpr, BV: tl.constexpr):
    """The windowed step's read of power2's state: phi(q) S and phi(q) . z over a contiguous range of
    ROWS_PER rows (a, b) of one (row, head), as partial sums; each row's first and second index come from
    the tables ROW_A and ROW_B. Tiles of BR whole rows, so each load is one contiguous block of the state."""
    i_g, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    offs_v = tl.arange(0, BV)
    m_v = offs_v < DV
    q_row = Q + i_b * sqb + i_h * sqh
    p_state = STATE + i_bh.to(tl.int64) * F * DV
    start = i_g * ROWS_PER
    end = tl.minimum(start + ROWS_PER, F)
    acc = tl.zeros([BV], tl.float32)
    den = tl.zeros([BR], tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        m_r = rows < end
        a = tl.load(ROW_A + rows, mask=m_r, other=0)
        b = tl.load(ROW_B + rows, mask=m_r, other=0)
        phi = tl.load(q_row + a, mask=m_r, other=0.0).to(tl.float32) * tl.load(q_row + b, mask=m_r, other=0.0).to(tl.float32)
        if PACKED:  # the rows a < b stand for (a, b) and (b, a)
            phi = tl.where(a < b, 2.0 * phi, phi)
        b_s = tl.load(p_state + rows[:, None] * DV + offs_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0)
        acc += tl.sum(phi[:, None] * b_s.to(tl.float32), 0)
        if (MODE >= 1 and MODE <= 3) or MODE == 6:
            den += phi * tl.load(NORM + i_bh.to(tl.int64) * F + rows, mask=m_r, other=0.0)
    part = i_g.to(tl.int64) * tl.num_programs(1) + i_bh
    tl.store(PART + part * DV + offs_v, acc, mask=m_v)
    tl.store(PART_DEN + part, tl.sum(den, 0))


@triton.jit
def _window_finish_kernel(PART, PART_DEN, Q, K, V, LOGD, RK, RV, RL, RN, COUNT, CPOW, O, STATE, NORM, G,
                          sqb, sqh, skb, skh, svb, svh, sdb, sdh, scale_k,
                          H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, POWER: tl.constexpr,
                          PACKED: tl.constexpr, MODE: tl.constexpr, HAS_DECAY: tl.constexpr, WINDOW: tl.constexpr,
                          BG: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BJ: tl.constexpr, DECAY_FN: tl.constexpr):
    """The windowed step's output for one (row, head): the partial sums over the state's rows decayed
    by exp(L_t), plus the attention to the window's tokens and this one; then this token joins the
    window, and a window this token fills is folded into the state (every row of the head's state and
    normaliser read and written once per WINDOW steps) and emptied."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    offs_v = tl.arange(0, BV)
    m_v = offs_v < DV
    offs_d = tl.arange(0, BD)
    m_d = offs_d < D
    offs_w = tl.arange(0, WINDOW)
    acc, den_sum = _sum_parts(PART, PART_DEN, G, i_bh, tl.num_programs(0), offs_v, m_v, DV, MODE, BG, BV)
    held = tl.load(RN + i_bh)  # < WINDOW: a full window was folded by the step that filled it
    p_rl = RL + i_bh.to(tl.int64) * WINDOW
    log_t = tl.load(p_rl + tl.maximum(held - 1, 0))
    log_t = tl.where(held > 0, log_t, 0.0)
    if HAS_DECAY:
        log_t += _log_decay(tl.load(LOGD + i_b * sdb + i_h * sdh).to(tl.float32), DECAY_FN)
    decay = tl.exp(log_t)
    acc = acc * decay
    den_sum = den_sum * decay
    q = tl.load(Q + i_b * sqb + i_h * sqh + offs_d, mask=m_d, other=0.0).to(tl.float32)
    k = tl.load(K + i_b * skb + i_h * skh + offs_d, mask=m_d, other=0.0)
    v = tl.load(V + i_b * svb + i_h * svh + offs_v, mask=m_v, other=0.0)
    m_w = offs_w < held
    p_rk = RK + i_bh.to(tl.int64) * WINDOW * D
    p_rv = RV + i_bh.to(tl.int64) * WINDOW * DV
    k_w = tl.load(p_rk + offs_w[:, None] * D + offs_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    s_w = tl.sum(k_w * q[None, :], 1)  # [W]
    s_t = tl.sum(k.to(tl.float32) * q, 0)
    if POWER == 2:
        s_w = s_w * s_w
        s_t = s_t * s_t
    log_w = tl.load(p_rl + offs_w, mask=m_w, other=0.0)
    w = tl.where(m_w, s_w * scale_k * tl.exp(log_t - log_w), 0.0)
    w_t = s_t * scale_k
    v_w = tl.load(p_rv + offs_w[:, None] * DV + offs_v[None, :], mask=m_w[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    acc += tl.sum(w[:, None] * v_w, 0) + w_t * v.to(tl.float32)
    den_sum += tl.sum(w, 0) + w_t
    tl.store(p_rk + held * D + offs_d, k.to(RK.dtype.element_ty), mask=m_d)  # this token joins the window
    tl.store(p_rv + held * DV + offs_v, v.to(RV.dtype.element_ty), mask=m_v)
    tl.store(p_rl + held, log_t)
    count = tl.load(COUNT + i_b).to(tl.float32)
    power = tl.load(CPOW + i_h).to(tl.float32)
    o = _finish(acc, den_sum, count, power, MODE)
    tl.store(O + i_bh * DV + offs_v, o.to(O.dtype.element_ty), mask=m_v)
    if held + 1 == WINDOW:
        # S = exp(L_t) S + sum_w exp(L_t - L_w) phi(k_w)^T v_w over the full window, this token's included
        tl.debug_barrier()  # the window's last slot, just stored, is read by other threads below
        tl.store(RN + i_bh, 0)
        log_w = tl.load(p_rl + offs_w)
        w_fold = tl.exp(log_t - log_w) * scale_k  # [W]
        v_fold = tl.load(p_rv + offs_w[:, None] * DV + offs_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        p_state = STATE + i_bh.to(tl.int64) * F * DV
        p_norm = NORM + i_bh.to(tl.int64) * F
        for i_a in range(0, D):  # power2 (the windowed step's only kind)
            k_wa = tl.load(p_rk + offs_w * D + i_a).to(tl.float32) * w_fold
            lo, first_row = _power2_rows(i_a, D, PACKED)
            for j0 in range((lo // BJ) * BJ, D, BJ):
                offs_j = j0 + tl.arange(0, BJ)
                m_j = (offs_j >= lo) & (offs_j < D)
                x = tl.load(p_rk + offs_w[:, None] * D + offs_j[None, :], mask=m_j[None, :], other=0.0).to(tl.float32)
                x = x * k_wa[:, None]  # [W, BJ]: the window's features (a, b) for this tile's b, weighted
                rows = first_row + offs_j - lo
                p_s = p_state + rows[:, None] * DV + offs_v[None, :]
                m_s = m_j[:, None] & m_v[None, :]
                b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32) * decay
                b_s += tl.dot(tl.trans(x), v_fold, input_precision="ieee")
                tl.store(p_s, b_s.to(STATE.dtype.element_ty), mask=m_s)
                if (MODE >= 1 and MODE <= 3) or MODE == 6:
                    b_z = tl.load(p_norm + rows, mask=m_j, other=0.0) * decay + tl.sum(x, 0)
                    tl.store(p_norm + rows, b_z, mask=m_j)
    else:
        tl.store(RN + i_bh, held + 1)


def _heads(x: torch.Tensor, name: str) -> tuple[int, int]:
    """Batch and head strides of a [B, H, D] tensor whose last dim is contiguous."""
    if x.dim() != 3 or (x.stride(2) != 1 and x.shape[2] > 1):
        raise ValueError(f"{name} must be [B, H, D] with a contiguous last dim, got shape {tuple(x.shape)} strides {x.stride()}")
    return x.stride(0), x.stride(1)


_ROW_INDICES: dict = {}


def _row_indices(head_dim: int, packed: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second index (a, b) of each row of power2's state (packed: a <= b), int32, kept per device."""
    key = (head_dim, packed, str(device))
    if key not in _ROW_INDICES:
        if packed:
            a, b = torch.triu_indices(head_dim, head_dim)
        else:
            a, b = (t.flatten() for t in torch.meshgrid(torch.arange(head_dim), torch.arange(head_dim), indexing="ij"))
        _ROW_INDICES[key] = (a.to(device, torch.int32).contiguous(), b.to(device, torch.int32).contiguous())
    return _ROW_INDICES[key]


def _check_recent(recent: dict, names, power: int, batch: int, heads: int, head_dim: int, value_dim: int) -> int:
    """The window's length, after checking its buffers (`new_recent`); ValueError says what is wrong."""
    if power != 2:
        raise ValueError("the windowed step is power2's (power1's state is as small as its window would be)")
    keys = recent["recent_key"]
    window = keys.shape[2] if keys.dim() == 4 else 0
    shapes = {"recent_key": (batch, heads, window, head_dim), "recent_value": (batch, heads, window, value_dim),
              "recent_log_decay": (batch, heads, window), "recent_count": (batch, heads)}
    for name in names:
        t = recent[name]
        if tuple(t.shape) != shapes[name] or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {list(shapes[name])} tensor, got {tuple(t.shape)}")
    if recent["recent_log_decay"].dtype != torch.float32 or recent["recent_count"].dtype != torch.int32:
        raise ValueError("recent_log_decay must be fp32 and recent_count int32")
    if window < 16 or window & (window - 1):
        raise ValueError(f"the window must hold a power of two >= 16 tokens, got {window}")
    return window


def attention_family_step_(q, k, v, log_decay, state, normalizer, count, *, similarity: str, scale: float,
                           denominator: str = "sum", count_power: torch.Tensor | None = None,
                           packed: bool = False, recent: dict | None = None, decay_fn: str | None = None) -> torch.Tensor:
    """As `recurrent_step` (same arguments), the state and normaliser advanced in place; with `recent`
    (power2), as `windowed_step`: the state only read, the window of recent tokens advanced in place.

    q, k [B, H, D]; v [B, H, Dv] (last dims contiguous); log_decay [B, H] or None; state
    [B, H, F, Dv] (fp32, or 16-bit: read into fp32, rounded where stored) and normalizer fp32 [B, H, F] (the sum denominators), contiguous; count [B]
    (tokens so far, this one included); count_power [H] or None. F is D (power1), D (D + 1) / 2
    (power2, packed) or D^2 (power2); recent: the buffers of `new_recent`, contiguous, a window of a
    power of two >= 16 tokens; decay_fn "neg_softplus": log_decay holds x, and the log-decay is
    -softplus(x), formed in the kernels (one launch instead of three). Returns o [B, H, Dv] in v's dtype."""

    batch, heads, head_dim = q.shape
    value_dim = v.shape[-1]
    power = 1 if similarity == "power1" else 2
    features = linear_feature_count(head_dim, similarity, packed)
    if (state.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not state.is_contiguous()
            or tuple(state.shape) != (batch, heads, features, value_dim)):
        raise ValueError(f"state must be a contiguous fp32, bf16 or fp16 [{batch}, {heads}, {features}, {value_dim}] tensor, "
                         f"got {state.dtype} {tuple(state.shape)}")
    want_normalizer = denominator in SUM_DENOMINATORS
    if want_normalizer and (normalizer is None or normalizer.dtype != torch.float32 or not normalizer.is_contiguous()
                            or tuple(normalizer.shape) != (batch, heads, features)):
        raise ValueError(f"normalizer must be a contiguous fp32 [{batch}, {heads}, {features}] tensor")
    mode = DENOMINATOR_MODES[denominator]
    o = torch.empty(batch, heads, value_dim, dtype=v.dtype, device=v.device)
    block_j = min(STEP_BLOCK_J, triton.next_power_of_2(head_dim))
    block_v = min(64, triton.next_power_of_2(value_dim))
    window = 0
    if recent is not None:
        window = _check_recent(recent, RECENT_BUFFERS, power, batch, heads, head_dim, value_dim)
    a_per = 1  # power2: first indices a per program (a divisor of D), so that each program reads enough rows
    if power == 2:
        a_per = next(n for n in (STEP_FIRST_INDICES, 2, 1) if head_dim % n == 0)
    groups = head_dim // a_per if power == 2 else 1  # programs per head and block of values
    finish = groups == 1 and not window
    part = part_den = o  # not read when `finish`
    if not finish and not window:
        part = torch.empty(groups, batch * heads, value_dim, dtype=torch.float32, device=v.device)
        part_den = torch.empty(groups, batch * heads, dtype=torch.float32, device=v.device)
    if count_power is not None:
        count_power = count_power.float().contiguous()
    count = count.contiguous()
    sdb, sdh = (log_decay.stride(0), log_decay.stride(1)) if log_decay is not None else (0, 0)
    if window:  # the state is only read: contiguous ranges of whole rows per program
        buffers = [recent[name] for name in RECENT_BUFFERS]
        groups = min(READ_PROGRAMS, features)
        rows_per = -(-features // groups)
        part = torch.empty(groups, batch * heads, value_dim, dtype=torch.float32, device=v.device)
        part_den = torch.empty(groups, batch * heads, dtype=torch.float32, device=v.device)
        row_a, row_b = _row_indices(head_dim, bool(packed), v.device)
        _read_kernel[(groups, batch * heads)](
            q, state, normalizer if want_normalizer else state, row_a, row_b, part, part_den, *_heads(q, "q"), rows_per,
            H=heads, DV=value_dim, F=features, PACKED=bool(packed), MODE=mode,
            BR=READ_BLOCK_ROWS, BV=triton.next_power_of_2(value_dim), num_warps=READ_WARPS,
        )
    else:
        _step_kernel[(groups, triton.cdiv(value_dim, block_v), batch * heads)](
            q, k, v, log_decay if log_decay is not None else state, state, normalizer if want_normalizer else state, count,
            count_power if count_power is not None else state, part, part_den, o,
            *_heads(q, "q"), *_heads(k, "k"), *_heads(v, "v"), sdb, sdh, float(scale) ** power,
            H=heads, D=head_dim, DV=value_dim, F=features, POWER=power, PACKED=bool(packed and power == 2),
            HAS_DECAY=log_decay is not None, MODE=mode, FINISH=finish, BJ=block_j, BV=block_v, A_PER=a_per,
            DECAY_FN=DECAY_FUNCTIONS[decay_fn], num_warps=STEP_WARPS,
        )
    if window:
        _window_finish_kernel[(batch * heads,)](
            part, part_den, q, k, v, log_decay if log_decay is not None else state, *buffers, count,
            count_power if count_power is not None else state, o, state, normalizer if want_normalizer else state, groups,
            *_heads(q, "q"), *_heads(k, "k"), *_heads(v, "v"), sdb, sdh, float(scale) ** power,
            H=heads, D=head_dim, DV=value_dim, F=features, POWER=power, PACKED=bool(packed), MODE=mode,
            HAS_DECAY=log_decay is not None, WINDOW=window, BG=min(64, triton.next_power_of_2(groups)),
            BD=triton.next_power_of_2(head_dim), BV=max(16, triton.next_power_of_2(value_dim)),
            BJ=max(16, min(FOLD_BLOCK_J, triton.next_power_of_2(head_dim))), DECAY_FN=DECAY_FUNCTIONS[decay_fn], num_warps=4,
        )
    elif not finish:
        _finish_kernel[(triton.cdiv(value_dim, block_v), batch * heads)](
            part, part_den, count, count_power if count_power is not None else state, o, groups,
            H=heads, DV=value_dim, MODE=mode, BG=min(64, triton.next_power_of_2(groups)), BV=block_v, num_warps=4,
        )
    return o


# ---------------------------------------------------------------- the prefill's state

@triton.jit
def _state_kernel(K, V, C, S_IN, Z_IN, S_OUT, Z_OUT, T, skb, skt, skh, svb, svt, svh, scb, sct, sch, scale_k,
                  H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, F: tl.constexpr, PACKED: tl.constexpr,
                  HAS_DECAY: tl.constexpr, HAS_STATE: tl.constexpr, HAS_Z: tl.constexpr, WANT_Z: tl.constexpr,
                  PRECISION: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr):
    """Rows (a, b) of power2's state after T tokens, for BA first indices a and a block of values:
    sum_t (w_t k_ta k_tb) v_t as one product of the BA keys' tiles scaled by w_t k_ta ([BA * BB, BT],
    formed in registers from one load of the keys) with the values' tile."""
    i_ag, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    offs_a = i_ag * BA + tl.arange(0, BA)
    m_a = offs_a < D
    offs_b = tl.arange(0, BB)
    m_b = offs_b < D
    offs_v = i_v * BV + tl.arange(0, BV)
    m_v = offs_v < DV
    k_rows = K + i_b * skb + i_h * skh
    v_rows = V + i_b * svb + i_h * svh
    c_rows = C + i_b * scb + i_h * sch
    c_end = 0.0
    if HAS_DECAY:
        c_end = tl.load(c_rows + (T - 1) * sct)
    acc = tl.zeros([BV, BA * BB], tl.float32)  # the state's rows transposed: the features are the product's B operand
    z = tl.zeros([BA * BB], tl.float32)
    for t0 in range(0, T, BT):
        offs_t = t0 + tl.arange(0, BT)
        m_t = offs_t < T
        k_t = tl.load(k_rows + offs_t[:, None] * skt + offs_b[None, :], mask=m_t[:, None] & m_b[None, :], other=0.0).to(tl.float32)
        w = tl.load(k_rows + offs_t[:, None] * skt + offs_a[None, :], mask=m_t[:, None] & m_a[None, :],
                    other=0.0).to(tl.float32) * scale_k  # [BT, BA]: scale^2 k_ta
        if HAS_DECAY:  # decayed to the last token
            w = w * tl.exp(c_end - tl.load(c_rows + offs_t * sct, mask=m_t, other=0.0))[:, None]
        x = tl.reshape(w[:, :, None] * k_t[:, None, :], (BT, BA * BB))  # the features (a, b) of each token, weighted
        v_t = tl.load(v_rows + offs_t[:, None] * svt + offs_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if PRECISION == "ieee":
            acc += tl.dot(tl.trans(v_t.to(tl.float32)), x, input_precision="ieee")
        else:  # 16-bit inputs: the weighted features rounded to the values' dtype, fp32 sums
            acc += tl.dot(tl.trans(v_t), x.to(v_t.dtype))
        if WANT_Z:
            z += tl.sum(x, 0)
    acc = tl.trans(acc)
    flat = tl.arange(0, BA * BB)  # acc's rows: first index i_ag * BA + flat // BB, second flat % BB
    a = i_ag * BA + flat // BB
    b = flat % BB
    m_r = (a < D) & (b < D)
    rows = a * D + b
    if PACKED:
        m_r = m_r & (b >= a)
        rows = a * D - a * (a - 1) // 2 + b - a
    p_s = i_bh.to(tl.int64) * F * DV + rows[:, None] * DV + offs_v[None, :]
    m_s = m_r[:, None] & m_v[None, :]
    decay_all = 1.0
    if HAS_DECAY:
        decay_all = tl.exp(c_end)
    if HAS_STATE:
        acc += tl.load(S_IN + p_s, mask=m_s, other=0.0) * decay_all
    tl.store(S_OUT + p_s, acc, mask=m_s)
    if WANT_Z:
        p_z = i_bh.to(tl.int64) * F + rows
        m_z = m_r & ((rows * 0 + i_v) == 0)  # a tensor condition: Triton's interpreter refuses a scalar in a mask
        if HAS_Z:
            z += tl.load(Z_IN + p_z, mask=m_z, other=0.0) * decay_all
        tl.store(Z_OUT + p_z, z, mask=m_z)


def linear_state_update(k, v, c, state, normalizer, *, similarity: str, scale: float, packed: bool = False,
                        want_normalizer: bool = True):
    """As `attnlab.models.ops.attention_family.linear_state_update` (same arguments and results),
    power2 through `_state_kernel`: its d^2 features of a token are formed in registers only, so
    a prompt's state takes no memory beyond itself. power1 (d features) runs the reference."""
    if similarity != "power2" or torch.float64 in (k.dtype, v.dtype):
        return reference_state_update(k, v, c, state, normalizer, similarity=similarity, scale=scale, packed=packed,
                         want_normalizer=want_normalizer)
    batch, seq_len, heads, head_dim = k.shape
    value_dim = v.shape[-1]
    features = linear_feature_count(head_dim, similarity, packed)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    out = torch.empty(batch, heads, features, value_dim, dtype=torch.float32, device=k.device)
    out_z = torch.empty(batch, heads, features, dtype=torch.float32, device=k.device) if want_normalizer else None
    if state is not None:
        state = state.float().contiguous()
    if want_normalizer and normalizer is not None:
        normalizer = normalizer.float().contiguous()
    has_z = want_normalizer and normalizer is not None
    c_args = (c, c.stride(0), c.stride(1), c.stride(2)) if c is not None else (out, 0, 0, 0)
    block_v = min(64, max(16, triton.next_power_of_2(value_dim)))
    block_b = max(16, triton.next_power_of_2(head_dim))
    block_a = min(max(1, STATE_FEATURE_ROWS // block_b), triton.next_power_of_2(head_dim))  # first indices a program
    grid = (triton.cdiv(head_dim, block_a), triton.cdiv(value_dim, block_v), batch * heads)
    _state_kernel[grid](
        k, v, c_args[0], state if state is not None else out, normalizer if has_z else out, out,
        out_z if out_z is not None else out, seq_len, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), *c_args[1:], float(scale) ** 2,
        H=heads, D=head_dim, DV=value_dim, F=features, PACKED=bool(packed), HAS_DECAY=c is not None,
        HAS_STATE=state is not None, HAS_Z=has_z, WANT_Z=want_normalizer,
        # Triton's interpreter multiplies 16-bit tiles wrongly: there the products are fp32's
        PRECISION="ieee" if torch.float32 in (k.dtype, v.dtype) or _interpreting() else "low",
        BT=16 if _interpreting() else STATE_BLOCK_T, BA=block_a, BB=block_b, BV=block_v, num_warps=STATE_WARPS,
    )
    return out, out_z


linear_state_update.fused = True  # forms no features in memory: `chunk_linear_attention` may take a whole prompt at once
