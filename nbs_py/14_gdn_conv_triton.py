# %% [markdown]
# # The GDN prelude in one kernel
#
# > Short convolution, SiLU and the per-head L2 norm of q and k as one Triton kernel forward and three backward, checked against chapter 12's PyTorch prelude.

# %%
#| default_exp models.gdn_conv_triton

# %% [markdown]
# Before the delta rule sees them, the mixer of chapter 12 passes its projected $q, k, v$ through
# three cheap steps: a causal depthwise convolution of width $W = 4$, a SiLU, and a unit L2 norm per
# head of $q$ and $k$. In PyTorch that is `conv_silu_norm`. Each step reads and writes the whole
# $[B, T, 2HK + HV]$ activation, and so does each step of its backward. At the 750M shape
# ($B\,T = 16\,384$ tokens, 3 840 channels) that activation is 126 MB in bf16. `torch.compile`
# fuses the steps into a few kernels, but they re-read shifted copies of the input: in isolation
# the compiled prelude takes 2.0 ms per layer, forward and backward, for about 0.6 GB of necessary
# traffic (0.13 ms at the H200's bandwidth). Eager PyTorch takes 8.4 ms.
#
# None of this needs that much memory traffic. A program can hold a tile of $B_T$ rows × a few heads,
# read the $W - 1$ rows before it as well, and do the whole prelude in registers. The backward can
# recompute the forward from the input rather than saving it. This chapter writes the kernels (one
# forward, three backward) and checks them against `conv_silu_norm`, forward and gradients.
#
# | function | what it is |
# |---|---|
# | `triton_conv_silu_norm` | the prelude for training and prefill: same contract as `conv_silu_norm` without the carried cache; differentiable in the input and the weights |
# | `conv_silu_norm_fwd`, `conv_silu_norm_bwd` | the PyTorch operators (`torch.library.triton_op`) behind it; under `torch.compile` inductor launches their kernels itself |

# %%
import os
import torch

# %%
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: set before the first @triton.jit

# %%
#| export
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from torch._library.triton import is_wrap_triton_enabled
from torch._subclasses.fake_tensor import is_fake

from hymo.models.gdn import _check_conv_weight, _check_cu_seqlens, _prelude_shapes
from hymo.models.gdn_triton import INTERPRET  # importing it also readies Triton's library for the interpreter

EPS = tl.constexpr(1e-6)  # F.normalize's eps, as in conv_silu_norm

# %%
from fastcore.test import test_eq, test_fail
from hymo.models.gdn import conv_silu_norm

# %%
DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0);


# %% [markdown]
# ## The maths, forward and backward
#
# Per channel $c$ with weights $w_{c,0..W-1}$ (the last one multiplies the current token), and per
# head of $D$ channels for the norm:
#
# $$u_t = \sum_{j=0}^{W-1} w_j\, x_{t-W+1+j}, \qquad s_t = u_t\,\sigma(u_t), \qquad
# y_t = \frac{s_t}{\max(\lVert s_t\rVert, \epsilon)} \text{ (q and k heads) or } y_t = s_t \text{ (v)},$$
#
# where $x_\tau = 0$ before the start of the sequence (or of the document, in a packed row) and
# $\lVert s_t\rVert$ is taken over the $D$ channels of the head. Going back from $\bar y_t =
# \partial\mathcal L/\partial y_t$:
#
# - the norm: with $r = \max(\lVert s\rVert, \epsilon)$, $\bar s = \bar y / r - [\lVert s\rVert > \epsilon]\; y\,(y\cdot\bar y)/r$
#   (the projection removes the part of $\bar y$ that would only change the length of $s$);
# - the SiLU: $\bar u = \bar s\,\sigma(u)\,\big(1 + u\,(1-\sigma(u))\big)$;
# - the convolution: $\bar x_t = \sum_j w_j\, \bar u_{t+W-1-j}$ (the same taps, read forwards,
#   and $\bar u_\tau = 0$ past the end of the document), and $\bar w_j = \sum_t \bar u_t\, x_{t-W+1+j}$.
#
# So $\bar x$ at rows $t..t+B_T-1$ needs $\bar u$ at rows up to $t+B_T+W-2$, which belong partly
# to the next tile. The backward is therefore split at $\bar u$, into three kernels:
#
# 1. **$\bar u$** recomputes $u$ from $x$ (the same shifted loads as the forward), goes back through
#    the norm and the SiLU, and writes $\bar u$ (in fp32, a $[B, T, 2HK + HV]$ buffer).
# 2. **$\bar x$** reads $\bar u$ at the $W$ shifted rows and writes $\bar x$. It handles all channels
#    at once, since it no longer needs whole heads.
# 3. **$\bar w$** reads $\bar u$ and $x$ and sums $\bar u_t\, x_{t-W+1+j}$ over a stretch of rows
#    per program. The tile is $[B_T, W_P, B_C]$ ($W_P$ the power of two at or above $W$): rows, taps
#    and channels, with $x$ loaded at the $W$
#    shifted rows along the tap axis, so that every product lands where it belongs. The rows are
#    summed once, at the end; PyTorch adds up the per-program sums.
#
# The extra loads of shifted rows are of rows the neighbouring programs also read, which stay in
# cache. Earlier versions did more in fewer kernels and were slower (numbers in "Speed on an
# H200"). The first was a single kernel that recomputed $u$ and $\bar u$ at all $W$ row offsets a
# tile needs. It moved less memory but did $W$ times the arithmetic, and it was 1.5× slower than
# two kernels. The second summed $\bar w$ inside the $\bar u$ kernel, with the tap in a padded lane
# of a four-dimensional tile, which made that kernel 2.6× slower than it is alone.
#
# ## The kernels
#
# A forward or $\bar u$ program owns $B_T$ rows and $G$ heads of one segment (q, k or v); the tile
# is $[B_T, G, D_p]$, with $D_p$ the head size rounded up to a power of two and masked. A $\bar x$
# program owns $B_T$ rows × $B_C$ channels, and a $\bar w$ program $R_T$ rows × $B_C$ channels,
# $B_T$ rows at a time. Packed rows
# pass `starts`, the first row of each token's document: a tap that reaches before it reads zero,
# and in the backward a $\bar u$ from another document is not carried back.

# %%
#| export
@triton.jit
def _conv_tile(x, w, starts, rows, o_c, m_c, T, sxt, W: tl.constexpr, HAS_STARTS: tl.constexpr,
               BT: tl.constexpr, G: tl.constexpr, DP: tl.constexpr):
    "u = sum_j w[c, j] x[row - W + 1 + j, c] on a [BT, G, DP] tile, fp32, zero before each document's start."
    b_u = tl.zeros([BT, G, DP], dtype=tl.float32)
    b_s = tl.zeros([BT], dtype=tl.int32)
    if HAS_STARTS: b_s = tl.load(starts + rows, mask=rows < T, other=0)
    for j in tl.static_range(W):
        r = rows - (W - 1) + j
        m_r = (r >= b_s) & (r < T)
        b_x = tl.load(x + r[:, None, None] * sxt + o_c, mask=m_r[:, None, None] & m_c, other=0.).to(tl.float32)
        b_u += b_x * tl.load(w + o_c * W + j, mask=m_c, other=0.).to(tl.float32)
    return b_u


@triton.jit
def _conv_fwd_kernel(x, w, y, starts, T, sxb, sxt, c0, NH, D: tl.constexpr, W: tl.constexpr, NORM: tl.constexpr,
                     HAS_STARTS: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, DP: tl.constexpr):
    "The segment at channel c0: y [B, T, NH*D] = norm?(silu(conv(x))) for rows [i_t*BT, +BT) and heads [i_g*G, +G) of sequence i_b."
    i_t, i_g, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    o_h, o_d = i_g * G + tl.arange(0, G), tl.arange(0, DP)
    o_c = o_h[None, :, None] * D + o_d[None, None, :]                       # (1, G, DP) channel in the segment
    m_c = (o_h[None, :, None] < NH) & (o_d[None, None, :] < D)
    b_u = _conv_tile(x + i_b * sxb + c0, w + c0 * W, starts, rows, o_c, m_c, T, sxt, W, HAS_STARTS, BT, G, DP)
    b_y = b_u * (1 / (1 + tl.exp(-b_u)))
    if NORM:
        b_y = b_y / tl.maximum(tl.sqrt(tl.sum(b_y * b_y, axis=2)), EPS)[:, :, None]
    p_y = y + (i_b * T + rows[:, None, None]) * (NH * D) + o_c
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=(rows < T)[:, None, None] & m_c)


@triton.jit
def _conv_du_kernel(x, w, dy, du, starts, T, sxb, sxt, C, c0, NH, D: tl.constexpr, W: tl.constexpr, NORM: tl.constexpr,
                    HAS_STARTS: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, DP: tl.constexpr):
    "The segment at channel c0: its columns of du [B, T, C] fp32 for rows [i_t*BT, +BT) and heads [i_g*G, +G), recomputing u."
    i_t, i_g, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_t * BT + tl.arange(0, BT)
    o_h, o_d = i_g * G + tl.arange(0, G), tl.arange(0, DP)
    o_c = o_h[None, :, None] * D + o_d[None, None, :]
    m_c = (o_h[None, :, None] < NH) & (o_d[None, None, :] < D)
    m = (rows < T)[:, None, None] & m_c
    b_u = _conv_tile(x + i_b * sxb + c0, w + c0 * W, starts, rows, o_c, m_c, T, sxt, W, HAS_STARTS, BT, G, DP)
    b_g = tl.load(dy + (i_b * T + rows[:, None, None]) * (NH * D) + o_c, mask=m, other=0.).to(tl.float32)
    b_sig = 1 / (1 + tl.exp(-b_u))
    if NORM:
        b_sv = b_u * b_sig
        b_n = tl.sqrt(tl.sum(b_sv * b_sv, axis=2))[:, :, None]
        b_r = tl.maximum(b_n, EPS)
        b_y = b_sv / b_r
        b_g = b_g / b_r - tl.where(b_n > EPS, b_y * tl.sum(b_y * b_g, axis=2)[:, :, None] / b_r, 0.)
    b_du = b_g * b_sig * (1 + b_u * (1 - b_sig))
    tl.store(du + (i_b * T + rows[:, None, None]) * C + c0 + o_c, b_du.to(du.dtype.element_ty), mask=m)


@triton.jit
def _conv_dw_kernel(du, x, dwp, starts, T, NT, sxb, sxt, C, W: tl.constexpr, HAS_STARTS: tl.constexpr,
                    BT: tl.constexpr, RT: tl.constexpr, BC: tl.constexpr, WP: tl.constexpr):
    "All channels: dwp[b*NT + i, j, c] = sum over the i-th RT rows t of du[t, c] x[t - W + 1 + j, c], fp32."
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c, o_w = i_c * BC + tl.arange(0, BC), tl.arange(0, WP)
    m_c = o_c < C
    b_dw = tl.zeros([BT, WP, BC], dtype=tl.float32)  # per row and tap; the rows are summed once, at the end
    for i_s in range(0, RT // BT):
        rows = i_t * RT + i_s * BT + tl.arange(0, BT)
        m_r = rows < T
        b_du = tl.load(du + (i_b * T + rows[:, None]) * C + o_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0.)
        b_s = tl.zeros([BT], dtype=tl.int32)
        if HAS_STARTS: b_s = tl.load(starts + rows, mask=m_r, other=0)
        r = rows[:, None] - (W - 1) + o_w[None, :]                                  # (BT, WP) the row tap j reads
        m_x = (r >= b_s[:, None]) & m_r[:, None] & (o_w[None, :] < W)
        b_x = tl.load(x + i_b * sxb + r[:, :, None] * sxt + o_c[None, None, :],
                      mask=m_x[:, :, None] & m_c[None, None, :], other=0.).to(tl.float32)  # (BT, WP, BC)
        b_dw += b_du[:, None, :] * b_x
    tl.store(dwp + ((i_b * NT + i_t) * W + o_w[:, None]) * C + o_c[None, :], tl.sum(b_dw, axis=0),
             mask=(o_w[:, None] < W) & m_c[None, :])


@triton.jit
def _conv_dx_kernel(du, w, dx, starts, T, C, W: tl.constexpr, HAS_STARTS: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    "All channels: dx[t, c] = sum_s w[c, W-1-s] du[t+s, c] over the du of t's own document, on [BT, BC] tiles."
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, o_c = i_t * BT + tl.arange(0, BT), i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_dx = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(W):  # du at row t + s feeds dx at row t through tap W-1-s
        r = rows + s
        m_r = r < T
        if HAS_STARTS: m_r = m_r & (tl.load(starts + r, mask=m_r, other=0) <= rows)  # not from the next document
        b_du = tl.load(du + (i_b * T + r[:, None]) * C + o_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0.).to(tl.float32)
        b_dx += b_du * tl.load(w + o_c * W + (W - 1 - s), mask=m_c, other=0.)[None, :]
    tl.store(dx + (i_b * T + rows[:, None]) * C + o_c[None, :], b_dx.to(dx.dtype.element_ty),
             mask=(rows < T)[:, None] & m_c[None, :])


# %% [markdown]
# ## Host side: three segments, two operators
#
# The input is one `[B, T, 2HK + HV]` tensor (the mixer's q, k, v projection, possibly a column
# slice of a wider one: only its channel stride must be 1). It holds three segments, q, k and v. The
# forward and the $\bar u$ kernel run once per segment, at its own channel offset (q and k are
# normalised, v is not); the $\bar x$ and $\bar w$ kernels run once over all channels.
# `LAUNCH` holds the tile sizes; `_tile_sizes` picks $G$ so that a tile row spans about 128 channels,
# unless `LAUNCH` names a $G$.
#
# The two operators are `torch.library.triton_op`s, not opaque `custom_op`s, and every launch goes
# through `_traceable`, which wraps it in `torch.library.wrap_triton` when it is traced. Run eagerly they behave the same; under `torch.compile`,
# inductor sees the kernels and launches them from its own generated code. That matters for the
# host, not for the GPU. On the hosts of two H200 machines, launching one of these kernels from
# Python took 20.5 and 31.9 µs, and calling the forward operator 116 and 130 µs, against 8–9 µs
# for an eager `torch.add` (`benchmarks/host_launch.py`, in "Speed on an H200"; measured while the
# eager operator still wrapped each launch in `wrap_triton`, about 10 µs each, which it now skips). The 750M model's
# forward was short of host time: most of the GPU's long waits came just before the first kernel of
# a GDN block (`benchmarks/results/host_waits.json`). With inductor launching the prelude, the
# GPU's waits of 10 µs or more fell from 4.9 to 1.0 ms per micro-batch, measured one after the
# other on one machine (the results page has the rest of the story). Two things keep the kernels
# traceable: each segment is addressed by its channel offset `c0` instead of a slice of the input,
# so no kernel writes into a view, and a tensor that the kernels never read stands in for a missing
# `starts`, so no argument is None.

# %%
#| export
# Tiles: BT rows (x BC channels for dx and dw); the dw kernel walks RT rows per program and sums over them.
# The fastest in benchmarks/gdn_conv_kernel.py --sweep on an H200 (see "Speed on an H200").
LAUNCH = dict(fwd=dict(BT=16, num_warps=2), du=dict(BT=8, num_warps=8), dx=dict(BT=32, BC=128, num_warps=4),
              dw=dict(BT=8, RT=512, BC=64, num_warps=4))


def _segments(H: int, K: int, V: int):
    "(channel offset, heads, head size, normalised) of q, k and v in the fused input."
    return ((0, H, K, True), (H * K, H, K, True), (2 * H * K, H, V, False))


def _tile_sizes(NH: int, D: int, G: Optional[int] = None) -> tuple[int, int]:
    "(G heads per program, DP padded head size); G from `LAUNCH` if given there, else about 128 channels' worth."
    if G is not None and (G < 1 or G & (G - 1)):
        raise ValueError(f"LAUNCH's G (heads per program) must be a power of two, 1 or more; got {G}")
    DP = triton.next_power_of_2(D)
    return min(triton.next_power_of_2(NH), G or max(1, 128 // DP)), DP


def _starts(cu_seqlens: Optional[torch.Tensor], T: int, device) -> Optional[torch.Tensor]:
    "First row of each token's document, int32 [T], from packed boundaries (None for plain rows)."
    if cu_seqlens is None: return None
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    return torch.repeat_interleave(cu[:-1], cu.diff().to(torch.int64), output_size=T).contiguous()


def _operator(name: str):
    """Declare a kernel-backed operator. On a GPU it is a `triton_op`, which `torch.compile` traces into; the
    interpreter cannot be traced, so there it is an opaque `custom_op` whose shapes come from the same function."""
    def declare(fn):
        if not INTERPRET: return torch.library.triton_op(name, fn, mutates_args=())
        op = torch.library.custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op
    return declare


def _traceable(kernel):
    "`kernel` wrapped for `torch.compile`: inside a compiled graph inductor launches it from its own wrapper code."
    if INTERPRET: return _ShapesOnly(kernel)
    # Run eagerly, a triton_op switches wrapping off; skipping `wrap_triton` then saves the host ~10 µs a launch.
    return torch.library.wrap_triton(kernel) if is_wrap_triton_enabled() else kernel


class _ShapesOnly:
    "Under the interpreter: `kernel[grid](...)` that launches nothing on fake or meta tensors, when PyTorch only wants shapes."
    def __init__(self, kernel): self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not any(isinstance(a, torch.Tensor) and (is_fake(a) or a.is_meta) for a in args):
                self.kernel[grid](*args, **kwargs)
        return launch


def _check_prepared(x: torch.Tensor, w: torch.Tensor, n_heads: int, head_k_dim: int, starts: Optional[torch.Tensor]):
    """Refuse what `triton_conv_silu_norm` would have changed or refused: the operators read x with channel stride 1,
    w as a dense fp32 [C, W] and starts as int32 [T], all on x's device, and read past any of them unchecked."""
    if x.ndim != 3 or x.stride(-1) != 1 or w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError(f"the prelude's operators read x [B, T, C] with channel stride 1 and w as a contiguous fp32 [C, W]; "
                         f"got x strides {tuple(x.stride())}, w {w.dtype} strides {tuple(w.stride())}: call "
                         "triton_conv_silu_norm, which prepares them")
    _, T, C, _ = _prelude_shapes(x, n_heads, head_k_dim)
    _check_conv_weight(w, C)
    bad_starts = starts is not None and (starts.dtype != torch.int32 or starts.shape != (T,) or starts.device != x.device)
    if w.device != x.device or bad_starts:
        raise ValueError(f"w and starts (int32 [T], each token's document start) must be on x's device ({x.device}); got w on "
                         f"{w.device}" + (f", starts {starts.dtype} {tuple(starts.shape)} on {starts.device}" if starts is not None
                                          else "") + ": call triton_conv_silu_norm, which prepares them")


@_operator("hymo::conv_silu_norm_fwd")
def conv_silu_norm_fwd(x: torch.Tensor, w: torch.Tensor, n_heads: int, head_k_dim: int,
                       starts: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "x [B, T, 2HK+HV] (channel stride 1), w [2HK+HV, W] fp32 → q, k [B, T, HK] and v [B, T, HV] in x's dtype."
    _check_prepared(x, w, n_heads, head_k_dim, starts)
    B, T, C = x.shape
    H, K = n_heads, head_k_dim
    V = (C - 2 * H * K) // H
    st = w if starts is None else starts                               # (a placeholder the kernels never read)
    outs = []
    for off, NH, D, norm in _segments(H, K, V):
        y = x.new_empty(B, T, NH * D)
        G, DP = _tile_sizes(NH, D, LAUNCH["fwd"].get("G"))
        BT = LAUNCH["fwd"]["BT"]
        _traceable(_conv_fwd_kernel)[(triton.cdiv(T, BT), triton.cdiv(NH, G), B)](
            x, w, y, st, T, x.stride(0), x.stride(1), off, NH, D, w.shape[1], norm, starts is not None,
            BT, G, DP, num_warps=LAUNCH["fwd"]["num_warps"])
        outs.append(y)
    return tuple(outs)


@_operator("hymo::conv_silu_norm_bwd")
def conv_silu_norm_bwd(x: torch.Tensor, w: torch.Tensor, n_heads: int, head_k_dim: int, starts: Optional[torch.Tensor],
                       dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    "Gradients `(dx [B, T, C] in x's dtype, dw [C, W] in w's dtype)` from those of q, k, v."
    _check_prepared(x, w, n_heads, head_k_dim, starts)
    B, T, C = x.shape
    H, K, Wd = n_heads, head_k_dim, w.shape[1]
    V = (C - 2 * H * K) // H
    du = torch.empty(B, T, C, dtype=torch.float32, device=x.device)     # the conv's output gradient, kept in fp32
    st = w if starts is None else starts                               # (a placeholder the kernels never read)
    BT = LAUNCH["du"]["BT"]
    for (off, NH, D, norm), dy in zip(_segments(H, K, V), (dq, dk, dv)):
        G, DP = _tile_sizes(NH, D, LAUNCH["du"].get("G"))
        _traceable(_conv_du_kernel)[(triton.cdiv(T, BT), triton.cdiv(NH, G), B)](
            x, w, dy.contiguous(), du, st, T, x.stride(0), x.stride(1), C, off, NH, D, Wd, norm, starts is not None,
            BT, G, DP, num_warps=LAUNCH["du"]["num_warps"])
    dx = x.new_empty(B, T, C)
    BT, BC = LAUNCH["dx"]["BT"], LAUNCH["dx"]["BC"]
    _traceable(_conv_dx_kernel)[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
        du, w, dx, st, T, C, Wd, starts is not None, BT, BC, num_warps=LAUNCH["dx"]["num_warps"])
    BT, BC = LAUNCH["dw"]["BT"], LAUNCH["dw"]["BC"]
    RT = BT * triton.cdiv(LAUNCH["dw"]["RT"], BT)                        # a whole number of BT steps
    NT = triton.cdiv(T, RT)
    dwp = torch.empty(B * NT, Wd, C, dtype=torch.float32, device=x.device)
    _traceable(_conv_dw_kernel)[(NT, triton.cdiv(C, BC), B)](
        du, x, dwp, st, T, NT, x.stride(0), x.stride(1), C, Wd, starts is not None, BT, RT, BC, triton.next_power_of_2(Wd),
        num_warps=LAUNCH["dw"]["num_warps"])
    return dx, dwp.sum(0).t().contiguous().to(w.dtype)


def _conv_setup_context(ctx, inputs, output):
    x, w, n_heads, head_k_dim, starts = inputs
    ctx.save_for_backward(x, w, starts)
    ctx.n_heads, ctx.head_k_dim = n_heads, head_k_dim


def _conv_backward(ctx, dq, dk, dv):
    x, w, starts = ctx.saved_tensors
    dx, dw = conv_silu_norm_bwd(x, w, ctx.n_heads, ctx.head_k_dim, starts, dq, dk, dv)
    return dx, dw, None, None, None


conv_silu_norm_fwd.register_autograd(_conv_backward, setup_context=_conv_setup_context)


# %% [markdown]
# The public function has `conv_silu_norm`'s contract for the case the kernels cover: no carried
# cache and no final cache (decoding keeps the PyTorch prelude, where it runs a token at a time).
# It checks what the kernels would otherwise get wrong silently, and returns views shaped per head.
# Document boundaries are checked for their kind and shape; their values (from 0 to $T$, never
# decreasing) only on the CPU. On a GPU that read would wait for the GPU once more per layer, and in
# the mixer the gated delta rule reads them right after (`_check_rule_inputs`) and refuses bad ones
# before the prelude's output is used; a direct caller on a GPU must pass valid boundaries.
#
# The kernels index with 32-bit integers, so a `qkv` of $2^{31}$ elements or more is refused, and one
# whose rows lie further apart than that (a slice of a larger buffer) is first copied into a dense
# tensor. Empty inputs ($T = 0$ or $B = 0$) give empty outputs, as the PyTorch prelude does.

# %%
#| export
def triton_conv_silu_norm(
    qkv: torch.Tensor,  # Projected q, k, v [B, T, 2HK + HV], channel stride 1
    weight: torch.Tensor,  # Depthwise conv weights [2HK + HV, W]; weight[:, -1] multiplies the current token
    n_heads: int,  # H
    head_k_dim: int,  # K; the value head size is (C - 2HK) / H
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
    head_v_dim: Optional[int] = None,  # V, checked against the channels if given
):
    "Short conv, SiLU, unit L2 norm per head of q and k, in Triton. Returns `(q [B, T, H, K], k, v [B, T, H, V])` in qkv's dtype."
    B, T, C, V = _prelude_shapes(qkv, n_heads, head_k_dim, head_v_dim)
    _check_conv_weight(weight, C)
    if weight.device != qkv.device:  # (the interpreter would skip the launch on a meta weight and return uninitialised memory)
        raise ValueError(f"weight is on {weight.device} and qkv on {qkv.device}: put both on one device")
    H, K = n_heads, head_k_dim
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"qkv must be fp32, bf16 or fp16, got {qkv.dtype}" + (" (for float64, use conv_silu_norm)"
                        if qkv.dtype == torch.float64 else ""))
    if cu_seqlens is not None:  # the values only where reading them is free: on a GPU the mixer's rule reads them next
        _check_cu_seqlens(cu_seqlens, B, T, read=None)
    if B * T * C >= 2 ** 31:
        raise ValueError(f"qkv holds {B} x {T} x {C} elements, past the kernels' int32 offsets; split the batch or the sequence")
    if qkv.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 before the kernels are imported, "
                           "or use conv_silu_norm")
    last = sum((n - 1) * st for n, st in zip(qkv.shape, qkv.stride())) if qkv.numel() else 0  # offset of its last element
    if qkv.stride(-1) != 1 or last >= 2 ** 31:  # channels apart, or a slice of a buffer past int32 offsets: a dense copy
        qkv = qkv.contiguous()
    q, k, v = conv_silu_norm_fwd(qkv, weight.float().contiguous(), H, K, _starts(cu_seqlens, T, qkv.device))
    return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)  # V given: a view of no elements cannot infer it


# %% [markdown]
# ## Checks against the PyTorch prelude
#
# In fp32 the two agree to rounding, forward and every gradient: odd lengths that leave a short
# last tile, a head size that is not a power of two (masked lanes), and an input that is a column
# slice of a wider projection, as in the mixer.

# %%
def check(B, T, H, K, V, W=4, cu=None, dtype=torch.float32, tol=1e-5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    C = 2 * H * K + H * V
    wide = torch.randn(B, T, C + 7, generator=gen).to(DEV, dtype)      # the mixer's projection is wider than qkv
    w = (torch.randn(C, W, generator=gen) * 0.5).to(DEV)
    cots = [torch.randn(B, T, H, d, generator=gen).to(DEV) for d in (K, K, V)]
    outs = []
    for fn in (conv_silu_norm, triton_conv_silu_norm):
        x = wide.detach().clone().requires_grad_(); ww = w.detach().clone().requires_grad_()
        ys = fn(x[..., 3:3 + C], ww, H, K, cu_seqlens=cu)[:3]
        sum((y.float() * c).sum() for y, c in zip(ys, cots)).backward()
        outs.append([*(y.float() for y in ys), x.grad.float(), ww.grad])
    for name, r, o in zip("q k v dx dw".split(), *outs):
        err = ((r - o).norm() / r.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.2e}"
    return outs


check(2, 70, 3, 32, 32)                                   # two full tiles and a short one
check(1, 45, 2, 12, 20, W=3, seed=1)                      # padded head sizes, another width
check(1, 90, 2, 16, 16, cu=torch.tensor([0, 10, 80, 90]), seed=2)  # packed documents
print("fp32: forward and gradients match conv_silu_norm")

# %% [markdown]
# `LAUNCH` may also set `G`, the heads per program of the forward and $\bar u$ kernels (the sweep
# tries 2 to 16). Any grouping gives the same numbers, including one wider than the head count
# and one that leaves a partial last group:

# %%
_saved = {k: dict(v) for k, v in LAUNCH.items()}
for G in (1, 2, 8):
    LAUNCH["fwd"]["G"] = LAUNCH["du"]["G"] = G
    check(2, 70, 3, 32, 32)                               # 3 heads: groups of 1, 2 (partial) and 8 (wider)
LAUNCH.update(_saved)
test_eq(_tile_sizes(40, 32), (4, 32)); test_eq(_tile_sizes(40, 32, 8), (8, 32)); test_eq(_tile_sizes(3, 32, 8), (4, 32))
test_fail(lambda: _tile_sizes(40, 32, 3), contains="power of two"); test_fail(lambda: _tile_sizes(40, 32, 0), contains="power of two")

# %% [markdown]
# Packed documents really are kept apart: the gradient of a token's input only comes from outputs of
# its own document.

# %%
x = torch.randn(1, 30, 2 * 2 * 16 + 2 * 16, device=DEV, requires_grad=True)
w = torch.randn(x.shape[-1], 4, device=DEV)
q, k, v = triton_conv_silu_norm(x, w, 2, 16, cu_seqlens=torch.tensor([0, 12, 30]))
v[:, 12].sum().backward()                                 # the first token of the second document
test_eq(x.grad[:, :12].abs().max().item(), 0.0)           # nothing reaches the first document
assert x.grad[:, 12].abs().max() > 0

# %% [markdown]
# In bf16 the kernels round once, at the end; the PyTorch prelude rounds after the convolution, after
# the SiLU and after the norm. Here the two are compared with each other on the same bf16 inputs
# (the GPU benchmark compares both with the fp32 prelude). On a CPU the kernels' errors are larger
# than on a GPU: Triton's interpreter (3.9) casts fp32 to bf16 by dropping the low bits, rounding
# toward zero, where a GPU rounds to nearest. That about doubles their own error against fp32
# (3.3e-3 against 1.7e-3 for q, k and v, emulated in PyTorch), and makes the differences printed
# here about 1.3 times what the GPU's rounding would give (about 3.7e-3; the weight gradient, kept
# in fp32, is not rounded). `tests/test_gdn_conv_triton.py` checks the single
# rounding element by element: every output and input gradient is within $2^{-7}$ of its value (a
# bf16 step) of the fp32 prelude on the same inputs, which either rounding meets and a second
# rounding inside the kernels does not.

# %%
outs = check(2, 70, 3, 32, 32, dtype=torch.bfloat16, tol=1e-2, seed=3)
print("bf16 vs PyTorch bf16, relative error:", {n: f"{((r - o).norm() / r.norm()).item():.1e}"
                                                 for n, r, o in zip("q k v dx dw".split(), *outs)})

# %% [markdown]
# Bad input gets a message:

# %%
test_fail(lambda: triton_conv_silu_norm(torch.randn(1, 8, 101, device=DEV), torch.randn(101, 4, device=DEV), 2, 16),
          contains="2*H*K + H*V")
test_fail(lambda: triton_conv_silu_norm(torch.randn(1, 8, 96, device=DEV), torch.randn(90, 4, device=DEV), 2, 16),
          contains="weight must be")
test_fail(lambda: triton_conv_silu_norm(torch.zeros(1, 1, 96, device=DEV).expand(1, 2 ** 31 // 96 + 1, 96),  # no memory needed
                                        torch.randn(96, 4, device=DEV), 2, 16), contains="int32")

# %% [markdown]
# ## Speed on an H200
#
# `benchmarks/gdn_conv_kernel.py` measures parity against the fp32 prelude at the 750M shape and
# times the kernels (`triton.testing.do_bench`, median). `--sweep` tries tile sizes and warp counts
# and picks the fastest, which is what `LAUNCH` holds. The numbers below were measured on one
# H200 (torch 2.11, Triton 3.6) and stored in `benchmarks/results/gdn_conv_kernel.json`, which this
# notebook reads, so it runs without a GPU:

# %%
import json
from pathlib import Path

# %%
res = json.loads((Path("..") / "benchmarks/results/gdn_conv_kernel.json").read_text())
m = res["meta"]
print(f"{m['device']}, torch {m['torch']}, Triton {m['triton']}, {m['date']}; shape {m['shape']}, bf16; tiles {res['launch_timed']}")
for who, errs in res["parity"].items(): print(f"relative RMSE {who:22s}", {n: f"{e:.1e}" for n, e in errs.items()})
print(f"{'':22s}{'forward ms':>12s}{'fwd+bwd ms':>12s}")
for name in ("triton", "pytorch_compiled", "pytorch_eager"):
    print(f"{name:22s}{res[name + '_fwd_ms']:12.3f}{res[name + '_fwd_bwd_ms']:12.3f}")
print(f"Triton backward operator alone: {res['triton_bwd_ms']:.3f} ms")
sw = res["sweep"]
for kind in ("fwd", "du", "dx", "dw"):
    times = {k: v for k, v in sw.items() if k.startswith(kind + " ") and isinstance(v, float)}
    print(f"sweep {kind}: {min(times.values()):.3f}-{max(times.values()):.3f} ms over {len(times)} tiles, fastest {sw['best_' + kind]}")
p2 = res["previous_two_kernel_backward"]
print(f"previous backward (du kernel also summing dw, then dx): {p2['triton_bwd_ms']:.3f} ms; in the model, us per launch",
      {k: v for k, v in p2["in_model_us_per_launch"].items() if k != "note"})
prev = res["previous_backward"]
pb = {k: v for k, v in prev["sweep"].items() if isinstance(v, float)}
p1 = {k: v for k, v in prev["first_version_sweep"].items() if isinstance(v, float)}
print(f"previous backward (one kernel, recomputing at W offsets): best {min(pb.values()):.3f} ms; "
      f"its first tiling {min(p1.values()):.3f}-{max(p1.values()):.3f} ms")
hp = res["sweep_heads_per_program"]
print(f"heads per program G ({hp['meta']['date']}): fastest forward ms by G",
      {g: round(t, 3) for g, t in hp["best_ms_by_G"]["fwd"].items()}, "; fastest backward operator ms by G",
      {g: round(t, 3) for g, t in hp["best_ms_by_G"]["du"].items()})
ab = hp["step_ab"]
print(f"750M step with the sweep's best tiles {ab['sweep_best']['step_s']:.3f} s, with LAUNCH's {ab['default']['step_s']:.3f} s")
e = res["du_bf16_experiment"]
print(f"du kept in bf16 instead of fp32: backward {e['bwd_ms_du_bf16']:.3f} ms against {e['bwd_ms_du_fp32']:.3f} ms")
print("in the 750M model, us per launch:", res["in_model_us_per_launch"])
x = res["experiment_dw_in_dx_kernel"]
print(f"experiment, dw summed in the dx kernel: backward {x['triton_bwd_ms']:.3f} ms; in the model, us per launch {x['in_model_us_per_launch']}")
assert max(res["parity"]["triton_vs_fp32"].values()) <= 5e-3  # within bf16 rounding of the fp32 prelude

host = json.loads((Path("..") / "benchmarks/results/host_launch.json").read_text())
print(f"\nhost time per call, {host['meta']['device']}, {host['meta']['date']} (benchmarks/host_launch.py):")
for name, us in host.items():
    if isinstance(us, float): print(f"{us:8.1f} us  {name}")
    elif name != "meta": print(f"{name}:", us)

# %% [markdown]
# What they say:
#
# - **Parity.** The kernels' bf16 outputs and input gradient are within 1.7e-3 of the fp32
#   prelude, half the error of PyTorch's own bf16 prelude (3.3e-3), because they round once. The
#   weight gradient is summed in fp32 and matches to 2e-7.
# - **Forward**: 0.15 ms for the three launches in the sweep, 0.22 ms timed again after it. Timed
#   as a call from Python, three short launches are partly bound by the host (in round 14 of
#   `experiments.json` the same forward took 0.27 ms so, against 3 × 49 µs of GPU time in the
#   model's profile), so the fairer figure is about 0.15 ms, 1.7 TB/s, under the H200's 4.8 TB/s.
#   The compiled PyTorch forward takes 0.37 ms.
# - **Heads per program.** A tile holds $G$ heads of 32 channels. The default, 4 heads (128
#   channels, 256 bytes of a bf16 row), is the fastest in a sweep of $G$ = 2 to 16 (round 17):
#   the forward took 0.155 ms at $G = 4$ against 0.164 (2), 0.167 (8) and 0.229 ms (16); the
#   backward operator 0.463 ms against 0.465 (a tie), 0.521 and 0.617 ms. Wider rows do not help:
#   past 4 heads each program holds more registers and the grid has fewer programs. The 750M step
#   with the sweep's best tiles (the forward's rows 8 instead of 16) took 6.401 s against 6.412 s
#   with `LAUNCH`'s, 0.2 % faster, less than the 0.5 % one machine drifted between processes this
#   round, so `LAUNCH` is unchanged.
# - **Backward**: 0.47 ms, against 0.70 ms for the previous backward (two kernels, $\bar w$ summed in
#   the $\bar u$ kernel), 1.04 ms for the single kernel before it, and about 1.7 ms for compiled
#   PyTorch. In the 750M model a layer's backward is three $\bar u$ launches of 76 µs, one $\bar x$
#   launch of 125 µs and one $\bar w$ launch of 118 µs. The $\bar w$ kernel reads 378 MB ($\bar u$
#   in fp32 and $x$ in bf16), about 3.2 TB/s; the $\bar x$ kernel moves as much at about 3 TB/s.
# - **Where $\bar w$ is summed matters more than how much it reads.** Summed inside the $\bar u$
#   kernel, a $\bar u$ launch took 200 µs instead of 76. In an experiment that was not kept
#   (`experiment_dw_in_dx_kernel` in the JSON), the $\bar x$ kernel summed it instead, with the
#   document mask it already applies, and rose from 125 to 479 µs. The $\bar u$ version kept
#   $\bar w$ per row in a four-dimensional tile with the tap in a padded lane, chosen by a mask at
#   every tap ($W$ times the multiply-adds); the $\bar x$ version reduced over the tile's rows at
#   every step. Both added that work to kernels that were already busy. The separate kernel reads
#   $\bar u$ once more (252 MB) but loads $x$ with the tap as a real axis of the tile, so each
#   product is computed once and the rows are summed once.
# - **One kernel for the whole backward is slower still, in both designs tried** (`experiments.json`,
#   round 13; not kept). It would move only $x$, the output gradients and $\bar x$ (378 MB), not
#   the 252 MB $\bar u$ written once and read twice. In the first design a program walked 128 rows
#   in steps of 8. It put each step's $\bar u$, and that of the three rows after it, in its own
#   slot of a scratch buffer, read them back shifted after a barrier, and summed $\bar w$ per tap
#   in registers: 0.70 ms. In the second, each program owned one tile of 32 rows, overlapping
#   the next by $W - 1$ rows, and shifted $\bar u$ in registers with `tl.gather`: 1.02 ms
#   (1.71 ms with the shift done as a tf32x3 product by a 0/1 matrix). The three kernels took
#   0.47 ms in the same processes. Both were correct: fp32 to 1e-7 in the interpreter, and in
#   bf16 on the GPU with the three kernels' parity.
# - **Fewer launches did not help either** (`experiments.json`, round 14). The forward and
#   $\bar u$ kernels over q, k and v in one launch each, the segment picked per program (one
#   launch has one last, partly idle wave of programs instead of three): 0.154 ms for the
#   forward, no faster than the three kernels' GPU time in the model, and
#   0.223 against 0.215 ms for $\bar u$; the 750M step 6.522 s against 6.505 s. $\bar x$ and
#   $\bar w$ in one kernel that reads $\bar u$ once: 0.337 ms at best, against 0.251 ms for the
#   two.
# - **Keeping $\bar u$ in bf16** between the kernels saved 6 % of the previous backward (0.66
#   against 0.70 ms), about 0.04 ms a layer. It was not kept for the error it adds to $\bar x$, a
#   second rounding before the taps are summed. The check made at the time ran in the interpreter,
#   whose rounding toward zero (above) biases every rounding the same way; there the error nearly
#   doubled (6.4e-3 against 3.7e-3 relative to fp32). With a GPU's rounding to nearest, emulated
#   in PyTorch on the same shape and several seeds, it grows by 20 to 40 % (1.6e-3 to 1.7e-3 becomes
#   2.3e-3 to 2.4e-3 with the output gradients rounded to bf16 first, as the kernels receive them;
#   2.35e-3 becomes 2.86e-3 with them in fp32): smaller than first measured, and still not worth 0.04 ms.
# - **A launch from Python costs the host about as much as a small kernel costs the GPU.** On the
#   H200 machine of `host_launch.json`, a Triton launch took 20.5 µs of host time (31.9 µs on
#   another H200 machine), against 49 µs of GPU time for one forward launch at the 750M shape. The
#   eager forward operator took 116 µs of host time for its three launches (with the `wrap_triton`
#   wrapping it has since dropped), and the same forward
#   compiled, where inductor launches the kernels, 68 µs including the compiled function's own
#   guards. For comparison: an eager `torch.add` 8 µs, a large `torch.mm` 19 µs. A GDN block
#   issues dozens of launches, so when the GPU work between them is short, the host sets the pace.
# - **In the 750M model** (results page), the prelude takes about 15 ms of a compiled micro-batch.
#   It took 21 ms with the previous backward, 29 ms with the single kernel, and inductor's kernels
#   took 27 ms.

# %% [markdown]
# ## Questions
#
# ::: {.callout-tip collapse="true"}
# ## `torch.compile` already fuses elementwise work. Why write this by hand?
# Because the compiler fused it badly, and because a kernel is the only way to make it fast eager.
# The convolution reads each input four times at shifted rows, and the backward needs the output
# gradient at four shifted rows too. Inductor inlined those reads and recomputed them, reaching
# about 0.3 TB/s. The kernels here are 5.9× faster than eager PyTorch, forward and backward timed
# through autograd (which also makes the gradient of the wider input; on the kernels' own 0.22 + 0.47 ms
# it is about 12×), 11.6× for the forward alone, and save memory. Compiled,
# the first version was a wash (29 ms of a micro-batch, where inductor's kernels took 27 ms); with
# the three-kernel backward the prelude takes about 15 ms. The section above has the measurements.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why recompute the forward in the backward instead of saving what it computed?
# The outputs $y$ (q, k, v) are kept anyway, by the delta rule that reads them, but they are not
# enough: the L2 norm forgets $\lVert s\rVert$ and the SiLU cannot be inverted, so the backward
# needs the convolution's output $u$. Saving $u$ would cost another 126 MB per layer at the 750M
# shape, 3 GB for 24 layers. The input $x$ is saved anyway (the projection produced it; the weight
# gradient needs it), and recomputing $u$ from it costs arithmetic, which this kernel has in excess.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why does the norm's gradient have a projection in it?
# $y = s/\lVert s\rVert$ does not change when $s$ is scaled, so a gradient along $s$ itself must
# vanish: $\partial y/\partial s = (I - y y^\top)/\lVert s\rVert$, which removes the component of
# $\bar y$ along $y$. When $\lVert s\rVert < \epsilon$ the division is by the constant $\epsilon$
# instead, and the projection term is absent. That is what autograd does through
# `F.normalize`, which uses `clamp_min`.
# :::
