# %% [markdown]
# # Gated DeltaNet in Triton
#
# > The chunked gated delta rule as Triton kernels: a forward, a hand-written backward behind a PyTorch operator, a fused recurrent kernel for decoding, and packed sequences.

# %%
#| default_exp models.gdn_triton

# %% [markdown]
# Chapter 12 turned the gated-delta-rule loop into chunks of $C = 64$ tokens whose insides are
# matrix products (`chunk_gated_delta_rule_torch`). This chapter writes the same algorithm as GPU
# kernels. The exported API has the contract of chapter 12's functions, same arguments in the same
# order, layout `[B, T, H, D]`:
#
# | function | what it is |
# |---|---|
# | `triton_gated_delta_rule` | chunked forward and hand-written backward (training, prefill); differentiable in q, k, v, g, beta and the initial state |
# | `gdn_chunk_fwd`, `gdn_chunk_bwd` | the PyTorch operators (`torch.library.custom_op`) that join the two, with autograd and `torch.compile` support |
# | `fused_recurrent_gated_delta_rule` | forward only, a token at a time with the state on chip (decoding) |
#
# Every kernel is checked against `naive_gated_delta_rule`, the loop of chapter 12. On a machine
# without a GPU the kernels run in Triton's interpreter, which executes each program with NumPy:
# the same code, slowly. That is how this notebook and the tests run on CPU.

# %%
import os
import torch

# %%
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: set before the first @triton.jit

# %%
#| export
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hymo.config import TRITON_CHUNK
from hymo.models.gdn import _check_rule_inputs

INTERPRET = bool(triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1, read once: kernels are decorated at import
GATE_FLOOR = tl.constexpr(-110.0)  # gates are read as at least this: e^-110 is 0 in fp32, and no -inf - (-inf) (see the prep kernel)


def _library_for_interpreter():
    """Triton's own `@triton.jit` library functions (`tl.zeros`, `tl.sum`, ...) are built when Triton is first
    imported. PyTorch may import Triton before `TRITON_INTERPRET=1` is set, and then they are GPU functions
    that the interpreter refuses to call. Rebuild them for the interpreter (what `@triton.jit` does under it)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    for mod in (tl, tl.standard):
        for name, f in list(vars(mod).items()):
            if isinstance(f, JITFunction): setattr(mod, name, InterpretedFunction(f.fn))


if INTERPRET: _library_for_interpreter()

# %%
import json
from pathlib import Path
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_fail
from torch.testing import assert_close
from hymo.models.gdn import chunk_gated_delta_rule_torch, naive_gated_delta_rule

# %%
DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def atol_for(gpu: float) -> float:
    "A check's tolerance: `gpu` where products of fp32 inputs run in tf32; 2e-5 in the interpreter's plain fp32 (errors about 3e-6)."
    return gpu if DEV == "cuda" else 2e-5


# %% [markdown]
# ## Triton in five ideas
#
# 1. **Programs.** A kernel is a Python function decorated with `@triton.jit`. Launching it as
#    `kernel[grid](args)` runs one *program* per point of `grid` (up to three axes), all in
#    parallel, with no order among them. `tl.program_id(0)` tells a program who it is. A CUDA
#    programmer would say thread block: Triton hides the threads of the block.
# 2. **Blocks.** A program computes on whole tiles. `tl.arange(0, BT)` is the vector
#    `0, 1, …, BT-1` and its length must be a power of two known when compiling (`tl.constexpr`,
#    written in CAPS here). Broadcasting (`o_r[:, None] * stride + o_c[None, :]`) makes a tile of
#    pointers; `tl.load` turns it into a tile of values held in registers.
# 3. **Masks.** A tile sticks out past the end of the data whenever the length is not a multiple of
#    the block: `tl.load(p, mask=m, other=0.)` reads only where `m` holds and fills zeros elsewhere;
#    `tl.store(p, x, mask=m)` writes only there.
# 4. **`tl.dot`.** The product of two tiles (each side at least 16) runs on the tensor cores,
#    accumulating in fp32. Given fp32 tiles it uses tf32 by default (each operand rounded to 10
#    mantissa bits, a relative error of up to 2^-11, about 5e-4); `input_precision="ieee"` gives
#    exact fp32 products, off the tensor cores.
# 5. **Compilation.** Each new combination of `constexpr` values, argument dtypes, launch options
#    (`num_warps`, `num_stages`) and integer arguments' specialisations (equal to 1, divisible by 16)
#    compiles a new kernel (cached after). Loops with a bound known only at run time (`range(0, NT)`) stay loops.
#
# The kernels below name things the way flash-linear-attention does: `i_` program and loop
# indices, `o_` offset vectors, `p_` pointer tiles (and `m_` their masks), `b_` tiles of values.
#
# A warm-up kernel with all five ideas: each program scales 16 rows of an `[R, C]` matrix by a
# per-row factor and multiplies the result by a `[C, C]` matrix, with the rows past `R` masked.

# %%
@triton.jit
def scale_matmul_kernel(x, s, w, y, R, C: tl.constexpr, BR: tl.constexpr):
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)                                   # this program's rows
    o_c = tl.arange(0, C)
    m_r = o_r < R
    b_x = tl.load(x + o_r[:, None] * C + o_c[None, :], mask=m_r[:, None], other=0.)   # (BR, C)
    b_s = tl.load(s + o_r, mask=m_r, other=0.)                                          # (BR,)
    b_w = tl.load(w + o_c[:, None] * C + o_c[None, :])                                  # (C, C)
    b_y = tl.dot(b_x * b_s[:, None], b_w)                                               # (BR, C), fp32
    tl.store(y + o_r[:, None] * C + o_c[None, :], b_y, mask=m_r[:, None])


x, s, w = torch.randn(37, 16, device=DEV), torch.randn(37, device=DEV), torch.randn(16, 16, device=DEV)
y = torch.full_like(x, float("nan"))                                    # poisoned: every row must be written
scale_matmul_kernel[(triton.cdiv(37, 16),)](x, s, w, y, 37, 16, 16)    # 3 programs, the last one 5 rows long
assert_close(y, (x * s[:, None]) @ w, rtol=2e-3, atol=2e-3)              # tf32 on a GPU


# %% [markdown]
# ## The chunked algorithm, in the form the kernels use
#
# Per head, cut the sequence into chunks of $C = 64$ tokens. In a chunk, let $Q, K \in
# \mathbb{R}^{C\times K}$, $V \in \mathbb{R}^{C\times V}$, $G_i = \sum_{j\le i} g_j$ the cumulative
# log-decay inside the chunk, $\Gamma_{ij} = e^{G_i - G_j}$ for $j \le i$ (else 0), and $S_0$ the
# state entering the chunk. Unrolling $S_t = e^{g_t}(I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t
# v_t^\top$ over the chunk (chapter 12 derives it) gives
#
# $$L = \mathrm{strict\_tril}\big(\mathrm{diag}(\beta)\,K K^\top \odot \Gamma\big), \qquad A = (I + L)^{-1},$$
# $$W = A\,\mathrm{diag}(\beta \odot e^{G}) K, \qquad U = A\,\mathrm{diag}(\beta) V - W S_0,$$
# $$O = \bar Q S_0 + P U, \qquad S_C = e^{G_C} S_0 + \bar K^\top U,$$
#
# with $\bar Q = s\,\mathrm{diag}(e^{G}) Q$ (reads the old state), $P = s\,(Q K^\top \odot \Gamma)$
# (causal, diagonal included) and $\bar K = \mathrm{diag}(e^{G_C - G}) K$ (writes the new one); $s$
# is the query scale and $G_C$ the last cumulative decay of the chunk. Every exponent is a difference
# $G_i - G_j \le 0$ for gates $g \le 0$ (the mixer's $-e^{A_{\log}}\,\mathrm{softplus}(\cdot)$ always is;
# the rule does not check a hand-given positive gate), masked *before* `exp`: no factor exceeds 1.
#
# The letters follow the kernels' variable names, and differ from chapter 12's (and the first
# workshop deck's), which derived the same system:
#
# | this chapter, the kernels | chapter 12 | what it is |
# |---|---|---|
# | $L$ | $A$ | strictly lower-triangular $\mathrm{strict\_tril}(\mathrm{diag}(\beta) K K^\top \odot \Gamma)$ |
# | $A = (I + L)^{-1}$ | $T = (I + A)^{-1}$ (`T_ut`) | the inverse the UT transform computes |
# | $\Gamma$, the matrix $e^{G_i - G_j}$ | $D$ | decay between two tokens of a chunk |
# | $G$, $e^{G}$ | $\gamma$, $\Gamma = e^{\gamma}$ (a vector) | cumulative log-decay, and decay since the chunk's start |
# | $U = A\,\mathrm{diag}(\beta) V - W S_0$ | $V_{new} = U - W S_0$ | the corrected values; chapter 12's $U$ is $T\,\mathrm{diag}(\beta) V$ alone |
#
# So "prep (gates, $A$)" in the benchmarks below is the inverse, chapter 12's $T$. Some letters do double duty, as
# the kernels' arguments do: $K$ and $V$ are the key and value matrices of a chunk and also the head sizes, and
# inside a kernel `T` becomes the length of the current document of a packed row.
#
# Two kinds of work follow. $A$ depends only on the chunk's own $K$, $\beta$, $g$, so all chunks of
# all heads are solved at once (a grid of $T/64 \times B H$ programs). The rest carries $S$ from
# chunk to chunk: one program per head walks its chunks in order and keeps $S$ on chip, in fp32.
# At HyMo's shape ($K = V = 32$, 40 heads, $B = 4$) that is 160 programs, each holding a $32\times32$
# state: small, latency-bound work, which is why the state never leaves the chip between chunks.

# %% [markdown]
# ## Kernel 1: the gates and the UT matrix $A$, all chunks in parallel
#
# Each program owns a chunk of one head. Its first lines find where the chunk lies. Plain batches
# lay sequence $n$ at tokens $nT \ldots nT + T - 1$; a packed row (`cu_seqlens`, $B = 1$) lays
# document $n$ at `cu_seqlens[n]:cu_seqlens[n+1]`, cut into its own chunks, so a chunk never spans
# two documents. `chunk_indices` lists (document, chunk) for every program of a chunk-parallel grid
# and `chunk_offsets` where each document's chunks start in the per-chunk buffers.

# %%
#| export
@triton.jit
def _tile(base, r0, R, stride, c0, C, BR: tl.constexpr, BC: tl.constexpr):
    "Pointers and in-bounds mask of the [BR, BC] tile at (r0, c0) of a row-major [R, C] matrix with row stride `stride`."
    o_r = r0 + tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BC)
    return base + o_r[:, None] * stride + o_c[None, :], (o_r[:, None] >= 0) & (o_r[:, None] < R) & (o_c[None, :] < C)


@triton.jit
def _seq_bounds(cu_seqlens, chunk_offsets, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    "First token `bos`, length `T`, chunk count `NT` and first per-chunk slot `boh` of sequence `i_n`."
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        bos = i_n * T
        boh = i_n * tl.cdiv(T, BT)
    return bos, T, tl.cdiv(T, BT), boh


@triton.jit
def _chunk_id(cu_seqlens, chunk_indices, chunk_offsets, i_c, i_b, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    "Program `(i_c, i_b)` of a chunk-parallel grid: chunk `i_t` of sequence `i_n`, with its `bos`, `T`, `boh`."
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
    else:
        i_n, i_t = i_b, i_c
    bos, T, NT, boh = _seq_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    return i_n, i_t, bos, T, boh


@triton.jit
def _decay_tril(b_g, m, BT: tl.constexpr):
    "Gamma_ij = exp(G_i - G_j) where the mask `m` holds (j <= i, inside the sequence), else 0; masked before exp."
    b_d = tl.where(m, b_g[:, None] - b_g[None, :], 0.)
    return tl.where(m, tl.exp(b_d), 0.)


# %% [markdown]
# $L$ is strictly lower triangular, so $A = (I+L)^{-1}$ could come out row by row by forward
# substitution, $A_i = e_i - \sum_{j<i} L_{ij} A_j$. But a register tile cannot be indexed by a
# run-time row number: each of the 63 steps must pick its row out with a masked sum across the whole
# $64\times64$ tile, and those cross-warp reductions made a first version of this kernel take 2.3 ms
# at HyMo's shape (measured; the whole forward budget is 0.6 ms). So the solve works on blocks.
# Cut the chunk into four blocks of 16 tokens and $L$ into $16\times16$ blocks $L_{cb}$ (block row
# $c$, block column $b$; only $c \ge b$ are non-zero). Then $A$ is block lower triangular too, and
# block forward substitution gives it a block at a time:
#
# 1. **The diagonal blocks** $D_b = (I + L_{bb})^{-1}$, by forward substitution on each
#    $16\times16$ tile: 15 steps, each picking row $i$ of $L_{bb}$ out with a masked sum and
#    finding row $i$ of $D_b$ as $e_i - \sum_{j<i} L_{ij} D_j$. The tile is small enough for one
#    warp to hold it, so every sum stays inside the warp (shuffles between its 32 threads, never a
#    barrier across warps), and the four blocks are independent work the GPU interleaves. The
#    kernel carries $D_b^\top$, starting from $I$: row $i$ of $L_{bb}$ comes out along one axis of
#    the tile, and the sum over $j$ leaves $D_i - e_i$ along the other, the axis along which column
#    $i$ of $D_b^\top$ is written. Round 12's kernel carried $(D_b - I)^\top$ instead and subtracted
#    $L_i$ itself, which lies along the axis it was picked out along, not the sum's, so every step moved two small vectors between
#    layouts through shared memory (51 layout conversions in the compiled kernel against 41, counted then and not kept). On
#    the H200 the kernel took 0.178 ms that way and 0.151 ms this way (an identical copy of its body,
#    timed in `benchmarks/gdn_prep_solve.py`'s harness in the same run), with $A$'s errors against
#    float64 unchanged in every case that script tries (round 13).
# 2. **The blocks below them**, from $(I + L)A = I$ read block by block:
#    $$A_{cb} = -D_c \sum_{b \le j < c} L_{cj} A_{jb}, \qquad A_{bb} = D_b,$$
#    first the blocks next to the diagonal ($A_{10}, A_{21}, A_{32}$), then $A_{20}, A_{31}$, then
#    $A_{30}$: sixteen $16\times16$ products on the tensor cores.
#
# Every block is its own small tile, built from the keys, gates and $\beta$ of its two token
# blocks, loaded apart: no tile is ever cut out of a larger one.
#
# **Gates.** The kernels work with differences of in-chunk cumulative gates, $G_t - G_i$, and a
# gate of $-\infty$ (a hard reset, which chapter 12's rule takes) would make them
# $-\infty - (-\infty)$, which is `nan`; a very strong finite gate would swallow the small gaps after it.
# So the prep kernel reads every gate as at least $-110$ (`GATE_FLOOR`): $e^{-110}$ is $0$ in fp32,
# whose smallest number is about $e^{-103}$, so each decay is what it was, and 64 clamped gates sum to
# at most $7\,040$ in magnitude, where fp32 still resolves $5\times10^{-4}$. The gradient of a
# clamped gate comes out $0$ to fp32 rounding (a difference of sums), as the true one is $0$ ($e^{g}$ is $0$ there too).
# This departs from chapter 12's remedy, which sums each segment of gates directly: the kernels
# keep differences of cumulative sums, so after gates near the floor a small gap is resolved only
# to about $5\times10^{-4}$ in the exponent (eight gates of $-105$ and then gates of $-10^{-3}$:
# the output is $3\times10^{-5}$ off the float64 loop, chapter 12's PyTorch path $10^{-7}$), a
# bound the model's gates, a few units each, never come near.
# A NaN gate stays NaN (`tl.maximum` alone returns the floor for it), so its head's output is NaN
# from that token on, as the loop's is (and in the earlier tokens of its chunk, whose products it
# enters): a broken `A_log` or `dt_bias` reaches the trainer's check of the loss.
#
# **Precision.** The solve's products ($D$, $L$ and the blocks of $A$) take fp32 operands, which the
# tensor cores round to tf32 (10 bits of mantissa); $KK^\top$ is formed from the keys in their own
# dtype (bf16 in training), and $A$ is stored in the inputs' dtype. Stored in bf16, it came out within
# $2\times10^{-3}$ to $4\times10^{-3}$ of its largest entry on the H200, as the previous kernel's
# did (below). Products in `tf32x3` (three tf32 products that recover about fp32's accuracy) gave
# $A$ to $10^{-6}$ before storing, but took 0.26 ms against 0.18 with tf32 products (both with
# round 12's substitution, in round 13's run). One
# shortcut fails on precision: the diagonal blocks from the series
# $(I + L_{bb})^{-1} = (I - L_{bb})(I + L_{bb}^2)(I + L_{bb}^4)(I + L_{bb}^8)$ (exact, since
# $L_{bb}^{16} = 0$) sums powers of $L_{bb}$ that grow far beyond the inverse when keys point in
# similar directions, and the terms cancel. In tf32 it was wrong by 0.13 of $A$'s largest entry on
# nearly aligned keys, and by about 1.4 on the tests' hard chunks. In fp32 it lost two digits against substitution (the tests' hard chunks, in Triton's
# CPU interpreter: $4\times10^{-5}$ against $4\times10^{-7}$). The questions at the end of the
# chapter list what else was tried; `benchmarks/gdn_prep_solve.py` times and checks these ways.
#
# (Until round 12 the diagonal blocks were solved together on one `[4, 16, 16]` tile by four warps,
# whose sums crossed warps, and merged by four $64\times64$ products, $A = (I - N)(I + N^2)D$ with
# $N = D L_\text{off}$. That took 0.24 ms on the H200 where round 12's kernel took 0.177–0.178 ms, with the
# same errors: $2\times10^{-3}$ to $4\times10^{-3}$ of $A$'s largest entry once stored in bf16,
# `benchmarks/results/gdn_prep_solve.json`.)

# %%
#| export
@triton.jit
def _gates16(g, beta, gc, bos, T, i_t, i_h, b: tl.constexpr, carry, H: tl.constexpr, BT: tl.constexpr):
    "Token block `b` (16 tokens) of chunk `i_t`: cumulative gates G (with `carry`, the blocks before), beta, in-sequence mask; stores G."
    o_t = i_t * BT + 16 * b + tl.arange(0, 16)
    m = (o_t >= 0) & (o_t < T)
    b_x = tl.load(g + (bos + o_t) * H + i_h, mask=m, other=0.).to(tl.float32)
    b_x = tl.where(b_x == b_x, tl.maximum(b_x, GATE_FLOOR), b_x)  # a NaN stays NaN (tl.maximum would drop it)
    b_g = tl.cumsum(b_x, 0) + carry
    tl.store(gc + (bos + o_t) * H + i_h, b_g, mask=m)
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m, other=0.).to(tl.float32)
    return b_g, b_beta, m, carry + tl.sum(b_x, 0)


@triton.jit
def _keys16(k, bos, T, i_t, i_h, b: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    "The keys of token block `b` of chunk `i_t`, [16, K] (zeros past the sequence)."
    p_k, m_k = _tile(k + (bos * H + i_h) * K, i_t * BT + 16 * b, T, H * K, 0, K, 16, K)
    return tl.load(p_k, mask=m_k, other=0.)


@triton.jit
def _L16(k_c, k_b, g_c, g_b, beta_c, m_c, DIAG: tl.constexpr):
    "Block (c, b), c >= b, of L = strict_tril(diag(beta) K K^T * Gamma) [16, 16]; `DIAG`: c == b, strictly lower."
    o = tl.arange(0, 16)
    if DIAG: m = (o[:, None] > o[None, :]) & m_c[:, None]
    else: m = m_c[:, None] & (o[None, :] >= 0)                          # a later block: every column precedes every row
    d = tl.where(m, g_c[:, None] - g_b[None, :], 0.)                      # G_i - G_j <= 0, masked before exp
    return tl.where(m, tl.dot(k_c, tl.trans(k_b)) * beta_c[:, None] * tl.exp(d), 0.)


@triton.jit
def _inv16(b_L):
    "D = (I + L)^-1 of a strictly lower [16, 16] fp32 tile by forward substitution, carrying D^T (column i = row i of D)."
    o = tl.arange(0, 16)
    b_DT = (o[:, None] == o[None, :]).to(tl.float32)                    # rows not yet found are those of I
    for i in range(1, 16):
        b_l = tl.sum(tl.where(o[:, None] == i, b_L, 0.), 0)              # row i of L, along axis 1
        b_d = -tl.sum(b_DT * b_l[None, :], 1)                            # D_i - e_i = -sum_{j<i} L_ij D_j, along axis 0
        b_DT = tl.where(o[None, :] == i, b_DT + b_d[:, None], b_DT)      # ... is column i of D^T
    return tl.trans(b_DT)


@triton.jit
def _below_diagonal(D0, D1, D2, D3, L10, L20, L21, L30, L31, L32, PREC: tl.constexpr):
    "A's blocks below the diagonal, A_cb = -D_c sum_{b <= j < c} L_cj A_jb, nearest the diagonal first; products in PREC."
    A10 = -tl.dot(D1, tl.dot(L10, D0, input_precision=PREC), input_precision=PREC)
    A21 = -tl.dot(D2, tl.dot(L21, D1, input_precision=PREC), input_precision=PREC)
    A32 = -tl.dot(D3, tl.dot(L32, D2, input_precision=PREC), input_precision=PREC)
    A20 = -tl.dot(D2, tl.dot(L20, D0, input_precision=PREC) + tl.dot(L21, A10, input_precision=PREC), input_precision=PREC)
    A31 = -tl.dot(D3, tl.dot(L31, D1, input_precision=PREC) + tl.dot(L32, A21, input_precision=PREC), input_precision=PREC)
    A30 = -tl.dot(D3, tl.dot(L30, D0, input_precision=PREC) + tl.dot(L31, A10, input_precision=PREC)
                  + tl.dot(L32, A20, input_precision=PREC), input_precision=PREC)
    return A10, A20, A21, A30, A31, A32


@triton.jit
def _store16(A, x, bos, T, i_t, i_h, c: tl.constexpr, b: tl.constexpr, H: tl.constexpr, BT: tl.constexpr):
    "Block (c, b) of chunk `i_t`'s A [BT, BT] (stored per token: A [B, T, H, BT])."
    p, m = _tile(A + (bos * H + i_h) * BT, i_t * BT + 16 * c, T, H * BT, 16 * b, BT, 16, 16)
    tl.store(p, x.to(A.dtype.element_ty), mask=m)


@triton.jit
def _store_A(A, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, bos, T, i_t, i_h, H: tl.constexpr, BT: tl.constexpr):
    "All sixteen blocks of chunk `i_t`'s A, zeros above the diagonal."
    Z = tl.zeros([16, 16], dtype=tl.float32)
    _store16(A, D0, bos, T, i_t, i_h, 0, 0, H, BT); _store16(A, Z, bos, T, i_t, i_h, 0, 1, H, BT)
    _store16(A, Z, bos, T, i_t, i_h, 0, 2, H, BT); _store16(A, Z, bos, T, i_t, i_h, 0, 3, H, BT)
    _store16(A, A10, bos, T, i_t, i_h, 1, 0, H, BT); _store16(A, D1, bos, T, i_t, i_h, 1, 1, H, BT)
    _store16(A, Z, bos, T, i_t, i_h, 1, 2, H, BT); _store16(A, Z, bos, T, i_t, i_h, 1, 3, H, BT)
    _store16(A, A20, bos, T, i_t, i_h, 2, 0, H, BT); _store16(A, A21, bos, T, i_t, i_h, 2, 1, H, BT)
    _store16(A, D2, bos, T, i_t, i_h, 2, 2, H, BT); _store16(A, Z, bos, T, i_t, i_h, 2, 3, H, BT)
    _store16(A, A30, bos, T, i_t, i_h, 3, 0, H, BT); _store16(A, A31, bos, T, i_t, i_h, 3, 1, H, BT)
    _store16(A, A32, bos, T, i_t, i_h, 3, 2, H, BT); _store16(A, D3, bos, T, i_t, i_h, 3, 3, H, BT)


@triton.jit
def _prep_kernel(k, g, beta, gc, A, cu_seqlens, chunk_indices, chunk_offsets, T,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    "Chunk-parallel: cumulative log-decays `gc` [B, T, H] and A = (I + strict_tril(diag(beta) K K^T ⊙ Γ))^-1 [B, T, H, BT]."
    tl.static_assert(BT == 64, "the solve is written for four 16-token blocks")
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_n, i_t, bos, T, boh = _chunk_id(cu_seqlens, chunk_indices, chunk_offsets, i_c, i_b, T, BT, IS_VARLEN)
    g0, s0, m0, c = _gates16(g, beta, gc, bos, T, i_t, i_h, 0, 0., H, BT)   # gates, beta, mask of each token block
    g1, s1, m1, c = _gates16(g, beta, gc, bos, T, i_t, i_h, 1, c, H, BT)
    g2, s2, m2, c = _gates16(g, beta, gc, bos, T, i_t, i_h, 2, c, H, BT)
    g3, s3, m3, c = _gates16(g, beta, gc, bos, T, i_t, i_h, 3, c, H, BT)
    k0 = _keys16(k, bos, T, i_t, i_h, 0, H, K, BT)
    k1 = _keys16(k, bos, T, i_t, i_h, 1, H, K, BT)
    k2 = _keys16(k, bos, T, i_t, i_h, 2, H, K, BT)
    k3 = _keys16(k, bos, T, i_t, i_h, 3, H, K, BT)
    D0 = _inv16(_L16(k0, k0, g0, g0, s0, m0, True))                        # A_bb = (I + L_bb)^-1
    D1 = _inv16(_L16(k1, k1, g1, g1, s1, m1, True))
    D2 = _inv16(_L16(k2, k2, g2, g2, s2, m2, True))
    D3 = _inv16(_L16(k3, k3, g3, g3, s3, m3, True))
    L10 = _L16(k1, k0, g1, g0, s1, m1, False)                                # the blocks of L below the diagonal
    L21 = _L16(k2, k1, g2, g1, s2, m2, False)
    L32 = _L16(k3, k2, g3, g2, s3, m3, False)
    L20 = _L16(k2, k0, g2, g0, s2, m2, False)
    L31 = _L16(k3, k1, g3, g1, s3, m3, False)
    L30 = _L16(k3, k0, g3, g0, s3, m3, False)
    A10, A20, A21, A30, A31, A32 = _below_diagonal(D0, D1, D2, D3, L10, L20, L21, L30, L31, L32, "tf32")
    _store_A(A, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, bos, T, i_t, i_h, H, BT)


# %% [markdown]
# The host side computes the chunk tables of a packed row and launches the kernel on a grid of
# (chunks, heads). The true number of chunks, $\sum_n \lceil L_n / 64 \rceil$, sits on the GPU, and
# reading it would make the host wait for everything queued before it; under `torch.compile` the operator's fake
# implementation (below) has only shapes to size its outputs from. The grid takes the bound
# $\lfloor (T + 63N)/64 \rfloor$ instead, which the shapes give: a document adds at most one short
# chunk. (The public wrapper, `triton_gated_delta_rule`, does read `cu_seqlens` once per call, to check that the
# boundaries are valid before any kernel indexes with them: one wait per call on a GPU, with packed documents only.) The spare slots name chunks past the last document's end, where every load and store is
# masked. They still do their arithmetic: about $N/2$ programs per head, some 3 % more of this
# kernel and of the local-gradient kernel at HyMo's documents of about 1 024 tokens. (An early
# return would save it; it is not in yet, because it has not run on the GPU.) Checked against `torch.linalg.solve_triangular` on a full chunk and a 6-token tail chunk, two heads:

# %%
#| export
BT = TRITON_CHUNK  # chunk length C = 64; the kernels' tiles are BT x BT (the model config refuses another with these kernels)


def _chunk_tables(cu_seqlens: Optional[torch.Tensor], # [N+1] document boundaries, or None
                  B: int, T: int): # Batch and sequence length
    """`(chunk_indices [NC, 2], chunk_offsets [N+1], NC)`: (document, chunk) per chunk slot and each document's first chunk.
    With documents NC is `_max_chunks`, a bound known from the shapes, so that nothing waits to read the true count from
    the GPU; the slots past the last chunk point past the last document's end, where their programs' loads and stores are masked."""
    if cu_seqlens is None: return None, None, B * triton.cdiv(T, BT)
    nts = (cu_seqlens.diff() + BT - 1) // BT                                        # chunks per document
    offsets = F.pad(nts.cumsum(0), (1, 0)).to(torch.int32)
    nc = _max_chunks(B, T, len(nts), True)
    slot = torch.arange(nc, device=nts.device)
    doc = torch.searchsorted(offsets[1:], slot, right=True).clamp(max=len(nts) - 1)  # (NC,) the document of each slot
    indices = torch.stack([doc, slot - offsets[doc]], 1)
    return indices.to(torch.int32).contiguous(), offsets, nc


def _prepare(k, g, beta, cu_seqlens, tables):
    "Launch `_prep_kernel`: returns `(gc [B, T, H] fp32, A [B, T, H, BT] in k's dtype)`."
    B, T, H, K = k.shape
    chunk_indices, chunk_offsets, nc = tables
    gc = torch.empty(B, T, H, dtype=torch.float32, device=k.device)
    A = torch.empty(B, T, H, BT, dtype=k.dtype, device=k.device)
    grid = (triton.cdiv(T, BT), B * H) if cu_seqlens is None else (nc, H)
    _prep_kernel[grid](k, g, beta, gc, A, cu_seqlens, chunk_indices, chunk_offsets, T, H, K, BT,
                       cu_seqlens is not None, **LAUNCH["prep"])
    return gc, A


LAUNCH = dict(prep=dict(num_warps=1), fwd=dict(), states=dict(), local=dict(num_warps=4))  # per-kernel launch options (benchmarks sweep them)


# %%
def rand_inputs(B=1, T=70, H=2, K=16, V=16, dtype=torch.float32, device=DEV, seed=0, g_mult=6):
    "Random `(q, k, v, g, beta)`: q, k L2-normalised, g <= 0 (some large), beta in (0, 1)."
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    g = F.logsigmoid(r(B, T, H) + 3) * g_mult                       # 6: mostly near 0, a few near -10
    return [x.to(device) for x in (q.to(dtype), k.to(dtype), r(B, T, H, V).to(dtype), g, torch.rand(B, T, H, generator=gen))]


def exact_A(k, g, beta, t0, n, h):
    "(I + L)^-1 of the n tokens from t0 of head h (batch 0), in float64 by `torch.linalg.solve_triangular`."
    kk, G, b = k[0, t0:t0 + n, h].double(), g[0, t0:t0 + n, h].double().cumsum(0), beta[0, t0:t0 + n, h].double()
    low = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
    L = b[:, None] * (kk @ kk.T) * (G[:, None] - G[None, :]).masked_fill(~low, -torch.inf).exp()
    eye = torch.eye(n, dtype=torch.float64, device=k.device)
    return torch.linalg.solve_triangular(eye + L, eye, upper=False)


q, k, v, g, beta = rand_inputs(T=70, K=32)
k[0, 8:24, 1] = F.normalize(k[0, 8:24, 1] + 3 * k[0, 8, 1], dim=-1)  # a run of nearly parallel keys: larger entries in A
gc, A = _prepare(k, g, beta, None, _chunk_tables(None, 1, 70))
tol = 5e-3 if DEV == "cuda" else 1e-5                               # a GPU forms K K^T from fp32 keys in tf32
for h in range(2):
    assert_close(A[0, :64, h].double(), exact_A(k, g, beta, 0, 64, h), rtol=0, atol=tol)
    assert_close(A[0, 64:, h, :6].double(), exact_A(k, g, beta, 64, 6, h), rtol=0, atol=tol)   # the 6-token tail chunk
    assert (A[0, 64:, h, 6:] == 0).all()                            # past the sequence's end
assert_close(gc[0, 64:, 1], g[0, 64:, 1].cumsum(0))                # the tail chunk restarts its sum


# %% [markdown]
# ## Kernel 2: the state pass
#
# One program per (sequence, head), holding all of the head's value columns (`_bv`). The columns of
# $S$ are independent (each column of $U$, $O$ and $S_C$ needs only the same column of $S_0$ and of
# $V$), so blocks of columns could go to separate programs at the cost of recomputing $W$ in each;
# that was slower here, and then crashed (the question "Why does one program walk all the chunks
# of a head" below). The program walks its chunks in order with $S$ in fp32 registers.
#
# Two habits matter in a latency-bound loop like this one:
#
# - **Precision where it counts.** Tiles enter `tl.dot` in the input dtype `DT` (bf16 runs the
#   tensor cores at full rate and halves the shared memory the operands need), every product
#   accumulates in fp32, and the gates and every exponent stay fp32. The state is carried in fp32,
#   but the products that read it take it rounded to `DT`, and the backward stores each chunk's
#   $S_0$ and $dS_C$ in `DT` ($U$, $P$ and, in the backward, $dU$ are rounded to it too where they enter a product). These
#   roundings are why the bf16 error grows with how much of the state a chunk carries on: more with
#   weak decays than with strong ones (the GPU parity below). With fp32 inputs the products are tf32.
# - **Load the next chunk before computing this one.** A GPU issues a load and only waits where the
#   value is first used, so the loads of chunk $t+1$ placed at the top of iteration $t$ travel from
#   memory while chunk $t$ is computed (software pipelining by hand).
#
# The same loop serves the backward, which needs the state entering every chunk: `SAVE_H` stores it,
# and `SAVE_O=False` skips the output (and the loads of $Q$ it needs): a backward recomputes states,
# not outputs.

# %%
#| export
@triton.jit
def _load_chunk(q, k, x, gc, beta, A, bos, T, i_t, i_h, i_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BV: tl.constexpr, LOAD_Q: tl.constexpr):
    "Everything a state pass reads of chunk `i_t` (zeros outside the sequence): gates, A, K, Q and a `[BT, BV]` block of `x` (V or dO)."
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = (o_t >= 0) & (o_t < T)
    b_g = tl.load(gc + (bos + o_t) * H + i_h, mask=m_t, other=0.)
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.)
    i_l = tl.minimum(i_t * BT + BT, T) - 1                                  # last token of the chunk
    b_gl = tl.load(gc + (bos + i_l) * H + i_h, mask=(i_l >= 0) & (i_l < T), other=0.)
    p_A, m_A = _tile(A + (bos * H + i_h) * BT, i_t * BT, T, H * BT, 0, BT, BT, BT)
    p_k, m_k = _tile(k + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
    p_x, m_x = _tile(x + (bos * H + i_h) * V, i_t * BT, T, H * V, i_v * BV, V, BT, BV)
    b_A = tl.load(p_A, mask=m_A, other=0.)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_x = tl.load(p_x, mask=m_x, other=0.)
    if LOAD_Q:
        p_q, m_q = _tile(q + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
        b_q = tl.load(p_q, mask=m_q, other=0.)
    else:
        b_q = b_k
    return b_g, b_beta, m_t, b_gl, b_A, b_k, b_q, b_x


@triton.jit
def _state_pass(q, k, v, gc, beta, A, h0, ht, o, h, cu_seqlens, chunk_offsets, scale, T, i_v, i_nh,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_H: tl.constexpr, SAVE_O: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    "Walk the chunks of (sequence, head) `i_nh` in order, carrying S[:, i_v*BV:(i_v+1)*BV] in fp32."
    DT = k.dtype.element_ty
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, NT, boh = _seq_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    o_i = tl.arange(0, BT)
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        p_h0, m_h0 = _tile(h0 + i_nh * K * V, 0, K, V, i_v * BV, V, K, BV)
        b_h = tl.load(p_h0, mask=m_h0, other=0.).to(tl.float32)
    b_g, b_beta, m_t, b_gl, b_A, b_k, b_q, b_v = _load_chunk(q, k, v, gc, beta, A, bos, T, 0, i_h, i_v, H, K, V, BT, BV, SAVE_O)
    for i_t in range(0, NT):
        n_g, n_beta, n_t, n_gl, n_A, n_k, n_q, n_v = _load_chunk(q, k, v, gc, beta, A, bos, T, i_t + 1, i_h, i_v,
                                                                 H, K, V, BT, BV, SAVE_O)   # prefetch
        if SAVE_H:                                                   # S_0 of chunk i_t, for the backward
            p_h, m_h = _tile(h + ((boh + i_t) * H + i_h) * K * V, 0, K, V, i_v * BV, V, K, BV)
            tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_h)
        b_w = tl.dot(b_A, (b_k * (b_beta * tl.exp(b_g))[:, None]).to(DT))          # W = A diag(beta e^G) K     (BT, K)
        b_u = tl.dot(b_A, (b_v * b_beta[:, None]).to(DT)) - tl.dot(b_w.to(DT), b_h.to(DT))   # U = A diag(beta) V - W S_0
        b_uD = b_u.to(DT)
        if SAVE_O:
            m_s = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
            b_P = tl.dot(b_q, tl.trans(b_k)) * _decay_tril(b_g, m_s, BT) * scale
            b_o = tl.dot((b_q * (tl.exp(b_g) * scale)[:, None]).to(DT), b_h.to(DT)) + tl.dot(b_P.to(DT), b_uD)  # Qbar S_0 + P U
            p_o, m_o = _tile(o + (bos * H + i_h) * V, i_t * BT, T, H * V, i_v * BV, V, BT, BV)
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_o)
        b_e = tl.where(m_t, tl.exp(tl.where(m_t, b_gl - b_g, 0.)), 0.)             # e^{G_C - G_i} <= 1
        b_h = b_h * tl.exp(b_gl) + tl.dot(tl.trans((b_k * b_e[:, None]).to(DT)), b_uD)   # S_C = e^{G_C} S_0 + Kbar^T U
        b_g, b_beta, m_t, b_gl, b_A, b_k, b_q, b_v = n_g, n_beta, n_t, n_gl, n_A, n_k, n_q, n_v
    if STORE_HT:
        p_ht, m_ht = _tile(ht + i_nh * K * V, 0, K, V, i_v * BV, V, K, BV)
        tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=m_ht)


@triton.jit
def _fwd_kernel(q, k, v, gc, beta, A, h0, ht, o, h, cu_seqlens, chunk_offsets, scale, T,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_H: tl.constexpr, IS_VARLEN: tl.constexpr):
    "Sequential over chunks: one program per (value block, sequence x head) computes o, the final state and, if asked, every chunk's S_0."
    _state_pass(q, k, v, gc, beta, A, h0, ht, o, h, cu_seqlens, chunk_offsets, scale, T, tl.program_id(0), tl.program_id(1),
                H, K, V, BT, BV, USE_H0, STORE_HT, SAVE_H, True, IS_VARLEN)


def _bv(V: int) -> int:
    "Value columns per program of the sequential kernels: all of them, one program per (sequence, head)."
    return V


def _state_launch(name: str, K: int, V: int) -> dict:
    """Launch options of a sequential kernel: 8 warps once the state passes 64 x 64 (fewer register spills), unless
    `LAUNCH` says; never with keys narrower than 64, whose 16-bit backward then makes illegal accesses (Triton 3.6)."""
    return {"num_warps": 8 if K * V > 64 * 64 and K >= 64 else 4, **LAUNCH[name]}


def _max_chunks(B: int, T: int, N: int, varlen: bool) -> int:
    "Chunks of a batch, or at most this many for N packed documents: sum ceil(l_i / 64) <= (T + 63 N) // 64."
    return (T + (BT - 1) * N) // BT if varlen else B * triton.cdiv(T, BT)


def _chunk_fwd(q, k, v, gc, beta, A, scale, h0, output_final_state, cu_seqlens, chunk_offsets, save_h=False):
    "Launch `_fwd_kernel` on padded contiguous inputs: `(o, final state or None, S_0 of every chunk [chunks, H, K, V] or None)`."
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    hs = q.new_empty(_max_chunks(B, T, N, cu_seqlens is not None), H, K, V) if save_h else None
    BV = _bv(V)
    _fwd_kernel[(triton.cdiv(V, BV), N * H)](q, k, v, gc, beta, A, h0, ht, o, hs, cu_seqlens, chunk_offsets,
                                            scale, T, H, K, V, BT, BV, h0 is not None, output_final_state, save_h,
                                            cu_seqlens is not None, **_state_launch("fwd", K, V))
    return o, ht, hs


# %% [markdown]
# The forward alone already matches the loop, across a chunk boundary (T = 70):

# %%
q, k, v, g, beta = rand_inputs(T=70, K=16, V=32)
h0 = torch.randn(1, 2, 16, 32, device=DEV)
gc, A = _prepare(k, g, beta, None, _chunk_tables(None, 1, 70))
o, ht, _ = _chunk_fwd(q, k, v, gc, beta, A, 16 ** -0.5, h0, True, None, None)
o_ref, ht_ref = naive_gated_delta_rule(q, k, v, g, beta, None, h0, True)
assert_close(o, o_ref, rtol=0, atol=atol_for(3e-3)); assert_close(ht, ht_ref, rtol=0, atol=atol_for(3e-3))


# %% [markdown]
# ## The backward, by hand
#
# Autograd cannot see inside a kernel, so the gradient is derived once, per chunk, by running the
# forward's equations backwards. Given $dO$ and $dS_C$ (the gradient reaching the chunk's final
# state from everything later):
#
# $$dU = P^\top dO + \bar K\, dS_C, \qquad dS_0 = \bar Q^\top dO + e^{G_C} dS_C - W^\top dU .$$
#
# The second equation, for $dS_0$, is a recurrence running from the last chunk to the first, and neither needs
# $S_0$. So the backward has three launches, the last two being kernels 3 and 4 in `_chunk_bwd`:
#
# 1. kernel 1 again (gates and $A$, recomputed rather than kept from the forward, unless the caller
#    asks to keep them: `keep_prep`, below);
# 2. one launch (kernel 3) with two kinds of program: `i_d = 0` re-runs the state pass and stores $S_0$ of
#    every chunk; `i_d = 1` walks the chunks backwards carrying $dS$ and stores $dS_C$ of every
#    chunk, ending at the initial state's gradient. Neither waits for the other, and at HyMo's
#    shape each is only 160 programs, so together they fill the GPU better than one after the other.
#    With `keep_prep` the forward's own state pass has already stored every $S_0$ (`SAVE_H`), and
#    this launch runs the $dS$ programs alone (`ONLY_DS`);
# 3. with $S_0$ and $dS_C$ stored, the rest is local to a chunk and runs in parallel (kernel 4):
#
# $$dP = dO\,U^\top,\quad d\bar Q = dO\,S_0^\top,\quad d\bar K = U\,dS_C^\top,\quad dW = -dU\,S_0^\top,$$
# $$dA = dU\,(\mathrm{diag}(\beta)V)^\top + dW\,(\mathrm{diag}(\beta e^G)K)^\top, \qquad dL = -A^\top dA\, A^\top \text{ (strict lower part)},$$
#
# then through the definitions of $P$, $\bar Q$, $\bar K$, $W$, $U$ and $L$ to $dq$, $dk$, $dv$,
# $d\beta$ and $dG$. Every factor $e^{G_i - G_j}$ contributes $+x$ to $dG_i$ and $-x$ to $dG_j$,
# with $x$ the sum of (gradient of the product) ⊙ (the product) over the entries it scales, e.g.
# $x_{ij} = dP_{ij} P_{ij}$; the factors $e^{G_i}$ of $W$ and $\bar Q$ contribute to $dG_i$ alone; $G_C$ collects $e^{G_C}\langle dS_C, S_0\rangle + \sum_i \langle d\bar K_i, \bar K_i\rangle$.
# Finally $G = \mathrm{cumsum}(g)$ inside the chunk, so $dg_i = \sum_{j \ge i} dG_j$, a reversed
# cumulative sum.
#
# By the function's default what is kept between forward and backward is only the inputs: $A$, the
# chunk states and everything derived are recomputed, so each layer's activation memory holds its
# inputs and nothing more. The model's mixer asks to keep them (`keep_prep`, below).

# %%
#| export
@triton.jit
def _dstate_pass(q, k, gc, beta, A, do, dht, dh0, dh, cu_seqlens, chunk_offsets, scale, T, i_v, i_nh,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                 USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr):
    "Walk the chunks last to first carrying dS in fp32; store dS_C, the gradient of each chunk's final state."
    DT = k.dtype.element_ty
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, NT, boh = _seq_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    o_i = tl.arange(0, BT)
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        p_dht, m_dht = _tile(dht + i_nh * K * V, 0, K, V, i_v * BV, V, K, BV)
        b_dh = tl.load(p_dht, mask=m_dht, other=0.).to(tl.float32)
    b_g, b_beta, m_t, b_gl, b_A, b_k, b_q, b_do = _load_chunk(q, k, do, gc, beta, A, bos, T, NT - 1, i_h, i_v, H, K, V, BT, BV, True)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        n_g, n_beta, n_t, n_gl, n_A, n_k, n_q, n_do = _load_chunk(q, k, do, gc, beta, A, bos, T, i_t - 1, i_h, i_v,
                                                                  H, K, V, BT, BV, True)   # prefetch
        p_dh, m_dh = _tile(dh + ((boh + i_t) * H + i_h) * K * V, 0, K, V, i_v * BV, V, K, BV)
        tl.store(p_dh, b_dh.to(dh.dtype.element_ty), mask=m_dh)
        b_w = tl.dot(b_A, (b_k * (b_beta * tl.exp(b_g))[:, None]).to(DT))
        m_s = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
        b_P = tl.dot(b_q, tl.trans(b_k)) * _decay_tril(b_g, m_s, BT) * scale
        b_e = tl.where(m_t, tl.exp(tl.where(m_t, b_gl - b_g, 0.)), 0.)
        b_dhD = b_dh.to(DT)
        b_du = tl.dot(tl.trans(b_P.to(DT)), b_do) + tl.dot((b_k * b_e[:, None]).to(DT), b_dhD)    # dU = P^T dO + Kbar dS_C
        b_dh = (b_dh * tl.exp(b_gl) + tl.dot(tl.trans((b_q * (tl.exp(b_g) * scale)[:, None]).to(DT)), b_do)
                - tl.dot(tl.trans(b_w.to(DT)), b_du.to(DT)))                                       # dS_0
        b_g, b_beta, m_t, b_gl, b_A, b_k, b_q, b_do = n_g, n_beta, n_t, n_gl, n_A, n_k, n_q, n_do
    if STORE_DH0:
        p_dh0, m_dh0 = _tile(dh0 + i_nh * K * V, 0, K, V, i_v * BV, V, K, BV)
        tl.store(p_dh0, b_dh.to(dh0.dtype.element_ty), mask=m_dh0)


@triton.jit
def _bwd_states_kernel(q, k, v, gc, beta, A, h0, h, do, dht, dh0, dh, cu_seqlens, chunk_offsets, scale, T,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                       USE_H0: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
                       ONLY_DS: tl.constexpr):
    """Grid (value blocks, N*H, 2): `i_d = 0` stores every chunk's S_0 (forward pass), `i_d = 1` every chunk's dS_C
    (backward pass). With `ONLY_DS = 1` (S_0 kept from the forward) the grid is (value blocks, N*H, 1), all dS."""
    i_v, i_nh, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2) + ONLY_DS
    if i_d == 0:
        _state_pass(q, k, v, gc, beta, A, h0, None, None, h, cu_seqlens, chunk_offsets, scale, T, i_v, i_nh,
                    H, K, V, BT, BV, USE_H0, False, True, False, IS_VARLEN)
    else:
        _dstate_pass(q, k, gc, beta, A, do, dht, dh0, dh, cu_seqlens, chunk_offsets, scale, T, i_v, i_nh,
                     H, K, V, BT, BV, USE_DHT, STORE_DH0, IS_VARLEN)


@triton.jit
def _bwd_local_kernel(q, k, v, gc, beta, A, h, dh, do, dq, dk, dv, dg, dbeta,
                      cu_seqlens, chunk_indices, chunk_offsets, scale, T,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                      IS_VARLEN: tl.constexpr, HOLD: tl.constexpr):
    """Chunk-parallel: with S_0 and dS_C of its chunk stored, a program computes dq, dk, dv, dg, dbeta of its 64 tokens.
    `HOLD` keeps P and K K^T * Gamma across the value loop instead of recomputing them after it (see `_hold_local`)."""
    DT = k.dtype.element_ty
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_n, i_t, bos, T, boh = _chunk_id(cu_seqlens, chunk_indices, chunk_offsets, i_c, i_b, T, BT, IS_VARLEN)
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    b_g, b_beta, m_t, b_gl, b_A, b_k, b_q, b_v = _load_chunk(q, k, v, gc, beta, A, bos, T, i_t, i_h, 0, H, K, V, BT, BV, True)
    m_s = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
    m_L = (o_i[:, None] > o_i[None, :]) & m_t[:, None]
    b_G = _decay_tril(b_g, m_s, BT)                                   # Gamma
    b_eg = tl.where(m_t, tl.exp(b_g), 0.)                             # e^{G_i}
    b_e = tl.where(m_t, tl.exp(tl.where(m_t, b_gl - b_g, 0.)), 0.)    # e^{G_C - G_i}
    b_kb = (b_k * (b_beta * b_eg)[:, None]).to(DT)                    # diag(beta e^G) K
    b_AT = tl.trans(b_A)
    b_wD = tl.dot(b_A, b_kb).to(DT)                                   # W
    if HOLD:
        b_P = tl.dot(b_q, tl.trans(b_k)) * b_G * scale                # P = scale (Q K^T * Gamma)
        b_PT = tl.trans(b_P.to(DT))
        b_kkG = tl.dot(b_k, tl.trans(b_k)) * b_G                      # K K^T * Gamma
    else:
        b_PT = tl.trans((tl.dot(b_q, tl.trans(b_k)) * b_G * scale).to(DT))   # P^T, P = scale (Q K^T * Gamma)
    b_kd = (b_k * b_e[:, None]).to(DT)                                # Kbar
    b_dw = tl.zeros([BT, K], dtype=tl.float32)
    b_dqg = tl.zeros([BT, K], dtype=tl.float32)
    b_dkd = tl.zeros([BT, K], dtype=tl.float32)
    b_dP = tl.zeros([BT, BT], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dhh = tl.zeros([K, BV], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):                              # V in blocks of BV columns
        p_v, m_v = _tile(v + (bos * H + i_h) * V, i_t * BT, T, H * V, i_v * BV, V, BT, BV)
        p_do, m_do = _tile(do + (bos * H + i_h) * V, i_t * BT, T, H * V, i_v * BV, V, BT, BV)
        p_h, m_h = _tile(h + ((boh + i_t) * H + i_h) * K * V, 0, K, V, i_v * BV, V, K, BV)
        p_dh, m_dh = _tile(dh + ((boh + i_t) * H + i_h) * K * V, 0, K, V, i_v * BV, V, K, BV)
        b_v = tl.load(p_v, mask=m_v, other=0.)
        b_do = tl.load(p_do, mask=m_do, other=0.)
        b_h = tl.load(p_h, mask=m_h, other=0.)
        b_dh = tl.load(p_dh, mask=m_dh, other=0.)
        b_vb = (b_v * b_beta[:, None]).to(DT)
        b_u = (tl.dot(b_A, b_vb) - tl.dot(b_wD, b_h)).to(DT)          # U
        b_du = (tl.dot(b_PT, b_do) + tl.dot(b_kd, b_dh)).to(DT)       # dU
        b_dw -= tl.dot(b_du, tl.trans(b_h))
        b_dqg += tl.dot(b_do, tl.trans(b_h))
        b_dkd += tl.dot(b_u, tl.trans(b_dh))
        b_dP += tl.dot(b_do, tl.trans(b_u))
        b_dA += tl.dot(b_du, tl.trans(b_vb))
        b_dvb = tl.dot(b_AT, b_du)                                    # d(diag(beta) V)
        b_dbeta += tl.sum(b_dvb * b_v, 1)
        b_dhh += b_dh.to(tl.float32) * b_h.to(tl.float32)
        p_dv, m_dv = _tile(dv + (bos * H + i_h) * V, i_t * BT, T, H * V, i_v * BV, V, BT, BV)
        tl.store(p_dv, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_dv)
    b_dgl = tl.sum(tl.sum(b_dhh, 1), 0) * tl.exp(b_gl)               # G_C from e^{G_C} S_0
    # load K and Q again (and unless HOLD recompute Gamma, P and K K^T * Gamma) rather than hold them across the loop
    p_k, m_k = _tile(k + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
    p_q, m_q = _tile(q + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    b_q = tl.load(p_q, mask=m_q, other=0.)
    # W = A diag(beta e^G) K
    b_dwD = b_dw.to(DT)
    b_kb = (b_k * (b_beta * b_eg)[:, None]).to(DT)
    b_dA += tl.dot(b_dwD, tl.trans(b_kb))
    b_dkb = tl.dot(b_AT, b_dwD)
    b_dk = b_dkb * (b_beta * b_eg)[:, None]
    b_dbeta += tl.sum(b_dkb * b_k, 1) * b_eg
    b_dG = tl.sum(b_dkb * b_kb, 1)
    # A = (I + L)^-1, L = strict_tril(diag(beta) K K^T * Gamma)
    b_dL = tl.where(m_L, -tl.dot(tl.dot(b_AT, b_dA.to(DT)).to(DT), b_AT), 0.)
    if not HOLD:
        b_G = _decay_tril(b_g, m_s, BT)                               # Gamma
        b_kkG = tl.dot(b_k, tl.trans(b_k)) * b_G                      # K K^T * Gamma
    b_dbeta += tl.sum(b_dL * b_kkG, 1)
    b_dLL = b_dL * b_kkG * b_beta[:, None]                            # dL * L
    b_dG += tl.sum(b_dLL, 1) - tl.sum(b_dLL, 0)
    b_dkk = (b_dL * b_G * b_beta[:, None]).to(DT)
    b_dk += tl.dot(b_dkk, b_k) + tl.dot(tl.trans(b_dkk), b_k)
    # P = scale (Q K^T * Gamma)
    b_dP = tl.where(m_s, b_dP, 0.)
    if HOLD: b_dPP = b_dP * b_P                                       # dP * P
    else: b_dPP = b_dP * (tl.dot(b_q, tl.trans(b_k)) * b_G * scale)
    b_dG += tl.sum(b_dPP, 1) - tl.sum(b_dPP, 0)
    b_dqk = (b_dP * b_G * scale).to(DT)
    b_dq = tl.dot(b_dqk, b_k) + b_dqg * (b_eg * scale)[:, None]      # ... + from Qbar
    b_dk += tl.dot(tl.trans(b_dqk), b_q)
    b_dG += tl.sum(b_dqg * b_q * (b_eg * scale)[:, None], 1)
    # Kbar = diag(e^{G_C - G}) K
    b_dk += b_dkd * b_e[:, None]
    b_x = tl.sum(b_dkd * b_k * b_e[:, None], 1)
    b_dG -= b_x
    b_dgl += tl.sum(b_x, 0)
    b_dG += tl.where(o_t == tl.minimum(i_t * BT + BT, T) - 1, b_dgl, 0.)
    b_dG = tl.where(m_t, b_dG, 0.)
    b_dg = tl.sum(b_dG, 0) - tl.cumsum(b_dG, 0) + b_dG                # dg_i = sum_{j >= i} dG_j
    p_dq, m_dq = _tile(dq + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
    p_dk, m_dk = _tile(dk + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
    tl.store(p_dq, b_dq.to(dq.dtype.element_ty), mask=m_dq)
    tl.store(p_dk, b_dk.to(dk.dtype.element_ty), mask=m_dk)
    tl.store(dg + (bos + o_t) * H + i_h, b_dg, mask=m_t)
    tl.store(dbeta + (bos + o_t) * H + i_h, b_dbeta, mask=m_t)


def _bv_local(K: int, V: int) -> int:
    "Value columns per step of the local-gradient kernel (wide heads take narrower steps to fit shared memory)."
    return min(V, 32 if K <= 64 else 16)


def _hold_local(K: int, dtype: torch.dtype) -> bool:
    """Whether the local-gradient kernel keeps P and K K^T * Gamma across its value loop. Recomputing them after the
    loop frees registers (bf16 at K = 32: 0.489 -> 0.459 ms on the H200), but the tail's two extra products then need
    their K-wide operands in shared memory at once: fp32 tiles at K = 128 asked for 256 KiB, over the H200's 227."""
    return dtype.itemsize == 4 and K > 64


def _chunk_bwd(q, k, v, g, beta, gc, A, hs, scale, h0, cu_seqlens, do, dht, need_dh0):
    """Kernel 1's gc and A and the chunk states hs as kept from the forward (or recomputed when None), then kernels 3
    and 4: `(dq, dk, dv, dg, dbeta, dh0 or None)`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    tables = _chunk_tables(cu_seqlens, B, T)
    chunk_indices, chunk_offsets, nc = tables
    if gc is None: gc, A = _prepare(k, g, beta, cu_seqlens, tables)
    only_ds = hs is not None
    if hs is None: hs = q.new_empty(nc, H, K, V)                       # S_0 of every chunk, in the input dtype
    dh = q.new_empty(nc, H, K, V)                                      # dS_C of every chunk
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32) if need_dh0 else None
    BV = _bv(V)
    _bwd_states_kernel[(triton.cdiv(V, BV), N * H, 1 if only_ds else 2)](
        q, k, v, gc, beta, A, h0, hs, do, dht, dh0, dh, cu_seqlens, chunk_offsets, scale, T, H, K, V, BT, BV, h0 is not None,
        dht is not None, need_dh0, cu_seqlens is not None, int(only_ds), **_state_launch("states", K, V))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    grid = (triton.cdiv(T, BT), B * H) if cu_seqlens is None else (nc, H)
    _bwd_local_kernel[grid](q, k, v, gc, beta, A, hs, dh, do, dq, dk, dv, dg, dbeta, cu_seqlens, chunk_indices,
                            chunk_offsets, scale, T, H, K, V, BT, _bv_local(K, V), cu_seqlens is not None,
                            _hold_local(K, q.dtype), **LAUNCH["local"])
    return dq, dk, dv, dg, dbeta, dh0


@contextmanager
def _fits_gpu(what: str, q: torch.Tensor, v: torch.Tensor):
    "Turn a launch that needs more shared memory or registers than this GPU has into an error that says what fits."
    try: yield
    except triton.runtime.errors.OutOfResources as e:  # heads wider than 128, or a GPU smaller than an H100
        raise RuntimeError(f"the GDN {what} does not fit this GPU for {q.dtype} heads of K={q.shape[-1]}, V={v.shape[-1]} "
                           f"(padded): {e}. Heads of 128 or less fit an H100 or H200 (HyMo's are 32); for wider ones use "
                           "chunk_gated_delta_rule_torch (gdn_kernel='torch')") from e


# %% [markdown]
# ## A PyTorch operator with a hand-written backward
#
# The two launchers become one differentiable PyTorch operator. `torch.library.custom_op` registers
# a Python function as an operator (`torch.ops.hymo.gdn_chunk_fwd`); `register_fake` says what it
# returns from the shapes alone, so `torch.compile` can trace a model through it as one opaque node
# instead of breaking the graph around it; `register_autograd` attaches the backward, itself an
# operator. `setup_context` saves the inputs. The forward also returns kernel 1's cumulative gates
# `gc` and the inverses `A`, and with `keep_prep` the state $S_0$ of every chunk (`hs`); with
# `keep_prep` all three are saved and the backward neither runs kernel 1 again nor re-runs the state
# pass, otherwise they are dropped and recomputed. Keeping them costs memory, `A` being as large
# as a 64-wide head of values (84 MB per layer at the 750M model's 4 × 4096 tokens, 2 GB for its 24
# GDN layers) and the states a quarter of that ($K \times V$ per chunk and head in the input dtype,
# 21 MB per layer). It saves, per layer on an H200, a launch of kernel 1 (0.24 ms then, 0.151 ms since round 13) and half of the
# state launch (0.30 → 0.19 ms), for 0.012 ms more in the forward, which now stores the states
# (0.183 → 0.195 ms). The default is to recompute, which keeps this operator's peak within 2× its
# inputs and outputs at HyMo's shape (1.74×, measured below; 2.12× with 16 heads of 128); the model's mixer keeps them (`GatedDeltaNet.keep_prep`),
# where 105 MB is small beside the rest of a layer's activations. With packed documents the number
# of chunks depends on the lengths, which the fake tensor cannot see, so `hs` has room for the most
# chunks $N$ documents of $T$ tokens can have, $\lfloor (T + 63N)/64 \rfloor$ (`_max_chunks`).
# The gradient of the initial state is computed only when it is asked for. An operator
# returns tensors, never `None`: a final state nobody asked for, or a `dh0` nobody needs, is an
# empty tensor.

# %%
#| export
def _none_if_empty(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None or x.numel() == 0 else x


def _check_prepared(q, k, v, g, beta, initial_state):
    "Refuse what `_prepare_inputs` would have changed: the operators read padded, contiguous heads and fp32 gates."
    K, V = q.shape[-1], v.shape[-1]
    padded = lambda n: n >= 16 and n & (n - 1) == 0
    loose = [n for n, x in zip(("q", "k", "v", "g", "beta", "initial_state"), (q, k, v, g, beta, initial_state))
             if x is not None and not x.is_contiguous()]
    if not (padded(K) and padded(V)) or loose or g.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError(f"the GDN operators read head sizes that are powers of two of at least 16, contiguous tensors and "
                         f"fp32 g and beta; got K={K}, V={V}, {', '.join(loose) or 'no tensor'} not contiguous, g {g.dtype}, "
                         f"beta {beta.dtype}: call triton_gated_delta_rule, which prepares them")


@torch.library.custom_op("hymo::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                  initial_state: Optional[torch.Tensor], output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                  keep_prep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on padded, contiguous inputs (g, beta fp32): `(o, final state or an empty tensor, gc, A, hs)`, hs being
    every chunk's S_0 with `keep_prep` (else empty); with `keep_prep` autograd keeps gc, A and hs."""
    _check_prepared(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    tables = _chunk_tables(cu_seqlens, B, T)
    with _fits_gpu("forward", q, v):
        gc, A = _prepare(k, g, beta, cu_seqlens, tables)
        o, ht, hs = _chunk_fwd(q, k, v, gc, beta, A, scale, initial_state, output_final_state, cu_seqlens, tables[1], keep_prep)
    return o, (ht if ht is not None else q.new_empty(0, dtype=torch.float32)), gc, A, (hs if hs is not None else q.new_empty(0))


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keep_prep):
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    V = v.shape[3]
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    hs = q.new_empty(_max_chunks(B, T, N, cu_seqlens is not None), H, K, V) if keep_prep else q.new_empty(0)
    return torch.empty_like(v), ht, q.new_empty(B, T, H, dtype=torch.float32), q.new_empty(B, T, H, BT, dtype=k.dtype), hs


@torch.library.custom_op("hymo::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
                  dht: Optional[torch.Tensor], need_dh0: bool, gc: Optional[torch.Tensor], A: Optional[torch.Tensor],
                  hs: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor, torch.Tensor]:
    "Backward: `(dq, dk, dv, dg, dbeta, dh0 or an empty tensor)`; gc, A and hs from the forward, or None to recompute them."
    _check_prepared(q, k, v, g, beta, initial_state)
    with _fits_gpu("backward", q, v):
        dq, dk, dv, dg, dbeta, dh0 = _chunk_bwd(q, k, v, g, beta, gc, A, hs, scale, initial_state, cu_seqlens,
                                                do.contiguous(), None if dht is None else dht.contiguous(), need_dh0)
    return dq, dk, dv, dg, dbeta, (dh0.to(initial_state.dtype) if dh0 is not None else q.new_empty(0, dtype=torch.float32))


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, need_dh0, gc, A, hs):
    dh0 = torch.empty_like(initial_state) if need_dh0 and initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta), dh0


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keep_prep = inputs
    _, _, gc, A, hs = output
    ctx.mark_non_differentiable(gc, A, hs)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *((gc, A, hs) if keep_prep else (None,) * 3))
    ctx.scale = scale


def _gdn_backward(ctx, do, dht, dgc, dA, dhs):
    q, k, v, g, beta, initial_state, cu_seqlens, gc, A, hs = ctx.saved_tensors
    need_dh0 = initial_state is not None and ctx.needs_input_grad[6]
    dq, dk, dv, dg, dbeta, dh0 = gdn_chunk_bwd(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do,
                                               _none_if_empty(dht), need_dh0, gc, A, hs)
    return dq, dk, dv, dg, dbeta, None, _none_if_empty(dh0), None, None, None


gdn_chunk_fwd.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)

# %% [markdown]
# The room kept for the chunk states of packed documents is never too small, and is exact when
# every document but the last is one token longer than a whole number of chunks:

# %%
gen = torch.Generator().manual_seed(0)
for _ in range(200):
    N = int(torch.randint(1, 9, (1,), generator=gen))
    lens = torch.randint(0, 300, (N,), generator=gen)
    cu = F.pad(lens.cumsum(0), (1, 0))
    assert int(_chunk_tables(cu, 1, int(cu[-1]))[1][-1]) <= _max_chunks(1, int(cu[-1]), N, True)  # the true count
cu = torch.tensor([0, 65, 130, 140])                                       # 2 + 2 + 1 chunks
test_eq(int(_chunk_tables(cu, 1, 140)[1][-1]), _max_chunks(1, 140, 3, True))


# %% [markdown]
# The public function checks the inputs (with chapter 12's messages), pads head sizes that are not
# powers of two (`tl.arange` needs them, and `tl.dot` sides of at least 16) with zeros and slices the
# padding off again. Zero padding is exact: a zero key column adds nothing to $k^\top k$ or $q^\top
# k$, and a zero value column stays a zero state column. The scale is taken from the true $K$.

# %%
#| export
def _padded(n: int) -> int: return max(16, triton.next_power_of_2(n))


def _pad_last(x: Optional[torch.Tensor], *sizes: int) -> Optional[torch.Tensor]:
    "Zero-pad the last `len(sizes)` dims of `x` up to `sizes` (None passes through)."
    if x is None: return None
    pad = [p for d, n in zip(reversed(range(x.ndim)), reversed(sizes)) for p in (0, n - x.shape[d])]
    return F.pad(x, pad) if any(pad) else x


def _prepare_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    "Check and pad: `(q, k, v, g, beta, scale, initial_state, cu_seqlens)` ready for the kernels."
    N = _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)  # sequences: B, or the packed row's documents
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q, k, v must share one dtype among float32, bfloat16, float16; got {q.dtype}, {k.dtype}, {v.dtype} "
                        "(for float64, use chunk_gated_delta_rule_torch)")
    (B, T, H, K), V = q.shape, v.shape[-1]
    Kp, Vp = _padded(K), _padded(V)
    if q.dtype != torch.float32 and Vp < Kp:  # 16-bit heads wider in K than in V crash or go wrong on Triton 3.6
        Vp = Kp                                # (K=64, V=16: o off by 0.9): zero value columns make them square
    if max(B, N) * H > 65535:  # the grids' second axis is (sequence, head)
        raise ValueError(f"{max(B, N)} sequences x {H} heads: more programs than a CUDA grid's second axis holds (65 535); "
                         "split the batch, or the packed row's documents, into several calls")
    chunks = B * triton.cdiv(T, BT) + (N if cu_seqlens is not None else 0)  # a packed row: at most one part-chunk a document more
    if max(B * T * H * max(Kp, Vp, BT), chunks * H * Kp * Vp) >= 2 ** 31:  # the kernels' offsets are int32
        raise ValueError(f"[B, T, H] = [{B}, {T}, {H}] with K={K}, V={V}: the per-chunk states ({chunks} chunks) or the "
                         "[B, T, H, 64] buffers pass the kernels' int32 offsets; split the batch or the sequence")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 before the kernels are imported, "
                           "or use chunk_gated_delta_rule_torch")
    if INTERPRET and q.dtype == torch.bfloat16:  # the interpreter's bf16 tl.dot is wrong (Triton 3.9)
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (_pad_last(x, n).contiguous() for x, n in ((q, Kp), (k, Kp), (v, Vp)))
    if cu_seqlens is not None: cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    return (q, k, v, g.float().contiguous(), beta.float().contiguous(), K ** -0.5 if scale is None else scale,
            None if initial_state is None else _pad_last(initial_state, Kp, Vp).contiguous(), cu_seqlens)  # read row-major


def triton_gated_delta_rule(
    q: torch.Tensor,  # Queries [B, T, H, K], L2-normalised per head
    k: torch.Tensor,  # Keys [B, T, H, K], L2-normalised per head
    v: torch.Tensor,  # Values [B, T, H, V], same dtype as q and k (fp32, bf16 or fp16)
    g: torch.Tensor,  # Log-decay [B, T, H], g <= 0
    beta: torch.Tensor,  # Write strength [B, T, H], in (0, 1)
    scale: Optional[float] = None,  # Query scale; None is K**-0.5
    initial_state: Optional[torch.Tensor] = None,  # State [B, H, K, V] ([N, H, K, V] with cu_seqlens); None is zeros
    output_final_state: bool = False,  # Also return the state after the last token, fp32
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1); the state restarts per document
    keep_prep: bool = False,  # Keep kernel 1's gc and A [B, T, H, 64] and the chunk states for the backward instead of recomputing them
):
    "The chunked gated delta rule in Triton, differentiable. Returns `(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32 or None)`."
    args = _prepare_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)  # checked first: chapter 12's messages
    (B, T, H, K), V = q.shape, v.shape[-1]
    if T == 0:  # nothing to launch
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        S = args[6].to(torch.float32, copy=True) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=torch.float32)  # a new tensor, as for T > 0
        return v.new_zeros(B, 0, H, V), (S[:, :, :K, :V] if output_final_state else None)
    o, ht, *_ = gdn_chunk_fwd(*args[:7], output_final_state, args[7], keep_prep)
    return o[..., :V].to(v.dtype), (ht[:, :, :K, :V] if output_final_state else None)


# %% [markdown]
# ### Checks against the loop
#
# Forward, final state and every gradient, on sizes chosen to hit the edges: T not a multiple of 64,
# head sizes that are not powers of two, an initial state, a gradient arriving at the final state,
# and a packed row of three documents (one shorter than a chunk, one spanning two chunks). The
# reference is the fp32 loop differentiated by autograd; the loss weights outputs and final state
# with random tensors so that every gradient path is exercised. `rand_inputs`' decays are strong (a
# chunk of 64 keeps about $10^{-13}$ of its incoming state), so a third case draws weak ones
# (`g_mult=0.2`: a chunk keeps about 0.4) over three chunks: without it, a mistake in how the state
# or its gradient crosses a whole chunk would pass (doubling the carried state did).

# %%
def check_against_loop(B, T, H, K, V, cu_seqlens=None, dtype=torch.float32, atol=atol_for(2e-3), g_mult=6):
    "Run the Triton rule and the loop on the same inputs; compare o, the final state and all six gradients."
    xs = rand_inputs(B, T, H, K, V, dtype=dtype, seed=T, g_mult=g_mult)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, H, K, V, device=DEV)
    outs = {}
    for name, rule in (("triton", triton_gated_delta_rule), ("loop", naive_gated_delta_rule)):
        leaves = [x.detach().clone().requires_grad_() for x in (*xs, h0)]
        o, ht = rule(*leaves[:5], None, leaves[5], True, cu_seqlens)
        gen = torch.Generator(device=DEV).manual_seed(1)
        ((o.float() * torch.randn(o.shape, generator=gen, device=DEV)).sum()
         + (ht * torch.randn(ht.shape, generator=gen, device=DEV)).sum()).backward()
        outs[name] = [o.float(), ht] + [x.grad.float() for x in leaves]
    for name, a, b in zip("o ht dq dk dv dg dbeta dh0".split(), outs["triton"], outs["loop"]):
        assert_close(a, b, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


check_against_loop(B=2, T=70, H=1, K=12, V=20)                              # odd T, padded head sizes
check_against_loop(B=1, T=90, H=2, K=16, V=16, cu_seqlens=torch.tensor([0, 10, 80, 90], device=DEV))
check_against_loop(B=1, T=150, H=2, K=16, V=16, g_mult=0.2)                  # weak decays: the state crosses chunks

# %% [markdown]
# Wrong inputs fail with chapter 12's messages, plus the dtype rule of the kernels:

# %%
q, k, v, g, beta = rand_inputs(T=8)
test_fail(lambda: triton_gated_delta_rule(q, k, v[:, :4], g, beta), contains="v must be [B, T, H, V]")
test_fail(lambda: triton_gated_delta_rule(q, k, v.half(), g, beta), contains="must share one dtype")


# %% [markdown]
# ## Decoding: the fused recurrent kernel
#
# Generating text feeds one token at a time with the state carried over. The chunked path would
# solve a $64\times64$ system to advance one token; the recurrence itself is cheaper. One program
# per (sequence, head) keeps its $S$ in fp32 registers (the grid has an axis for blocks of value
# columns, one block at every size HyMo uses: `_bv`) and runs
# the loop of chapter 12 ("decay, read the error, write"), token after token:
# $$S' = e^{g_t} S, \qquad u_t = \beta_t (v_t - S'^\top k_t), \qquad S = S' + k_t u_t^\top, \qquad o_t = S^\top (s\,q_t).$$
# It is forward only (decoding needs no gradient) and refuses inputs that want one.

# %%
#| export
@triton.jit
def _fused_recurrent_kernel(q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                            USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr):
    "Token by token: one program carries S[:, i_v*BV:(i_v+1)*BV] of one (sequence, head) in fp32 registers."
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        bos = i_n * T
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_h = tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * H + i_h) * V + o_v
    p_o = o + (bos * H + i_h) * V + o_v
    p_g = g + bos * H + i_h
    p_beta = beta + bos * H + i_h
    for _ in range(0, T):
        b_q = tl.load(p_q).to(tl.float32) * scale
        b_k = tl.load(p_k).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.).to(tl.float32)
        b_h *= tl.exp(tl.load(p_g))                                         # S' = e^g S
        b_u = tl.load(p_beta) * (b_v - tl.sum(b_h * b_k[:, None], 0))       # u = beta (v - S'^T k)
        b_h += b_k[:, None] * b_u[None, :]                                  # S = S' + k u^T
        tl.store(p_o, tl.sum(b_h * b_q[:, None], 0).to(o.dtype.element_ty), mask=m_v)   # o = S^T (s q)
        p_q += H * K
        p_k += H * K
        p_v += H * V
        p_o += H * V
        p_g += H
        p_beta += H
    if STORE_HT:
        tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_h.to(ht.dtype.element_ty), mask=m_v[None, :])


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,  # Queries [B, T, H, K], L2-normalised per head
    k: torch.Tensor,  # Keys [B, T, H, K], L2-normalised per head
    v: torch.Tensor,  # Values [B, T, H, V], same dtype as q and k
    g: torch.Tensor,  # Log-decay [B, T, H], g <= 0
    beta: torch.Tensor,  # Write strength [B, T, H], in (0, 1)
    scale: Optional[float] = None,  # Query scale; None is K**-0.5
    initial_state: Optional[torch.Tensor] = None,  # State [B, H, K, V] ([N, H, K, V] with cu_seqlens); None is zeros
    output_final_state: bool = False,  # Also return the state after the last token, fp32
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1); the state restarts per document
):
    "Forward-only recurrent kernel for decoding a few tokens with a carried state. Returns `(o [B, T, H, V], final_state fp32 or None)`."
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        raise RuntimeError("fused_recurrent_gated_delta_rule has no backward; use triton_gated_delta_rule for training, "
                           "or call it under torch.no_grad()")
    args = _prepare_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)  # checked first: chapter 12's messages
    (B, T, H, K), V, dtype = q.shape, v.shape[-1], v.dtype
    q, k, v, g, beta, scale, h0, cu_seqlens = args
    Kp, Vp = q.shape[-1], v.shape[-1]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, Kp, Vp, dtype=torch.float32) if output_final_state else None
    BV = _bv(Vp)
    with _fits_gpu("decoding kernel", q, v):
        _fused_recurrent_kernel[(triton.cdiv(Vp, BV), N * H)](q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T, H, Kp, Vp,
                                                             BV, h0 is not None, output_final_state, cu_seqlens is not None)
    return o[..., :V].to(dtype), (ht[:, :, :K, :V] if ht is not None else None)


# %% [markdown]
# Decoding must continue where a prefill left off, to fp32 rounding: the chunked kernel reads a prompt of 67
# tokens, then the recurrent kernel takes three more tokens one call at a time from the carried
# state. Outputs and state equal one pass of the loop over all 70 tokens.

# %%
q, k, v, g, beta = rand_inputs(B=2, T=70, H=2, K=12, V=20)
o_ref, S_ref = naive_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
o, S = triton_gated_delta_rule(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], output_final_state=True)
steps = [o]
with torch.no_grad():
    for t in range(67, 70):
        o_t, S = fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                  beta[:, t:t + 1], initial_state=S, output_final_state=True)
        steps.append(o_t)
assert_close(torch.cat(steps, 1), o_ref, rtol=0, atol=atol_for(2e-3)); assert_close(S, S_ref, rtol=0, atol=atol_for(2e-3))
test_fail(lambda: fused_recurrent_gated_delta_rule(q.requires_grad_(), k, v, g, beta), contains="no backward")

# %% [markdown]
# ## Speed and memory on an H200
#
# Two numbers first. At HyMo's shape ($B = 4$, $T = 4096$, $H = 40$, $K = V = 32$, bf16) a forward
# must read $q, k, v$ and write $o$: $4 \cdot 4\,096 \cdot 40 \cdot 128 \cdot 2$ bytes $\approx 168$ MB,
# about 40 µs at the 4.3 TB/s a device-to-device copy reaches on this card. Its arithmetic is about
# 2 MFLOP per chunk and head, 20 GFLOP in all: 20 µs at the card's 989 TFLOP/s peak, some 50 µs at
# the 40 % such small products reach. So no forward can beat about 0.05 ms; what keeps a real one above that is the solve for $A$
# and, above all, the sequential state pass: 160 programs,
# each walking 64 chunks one after another, a latency-bound loop on a 132-multiprocessor GPU.
#
# `benchmarks/gdn_kernel.py` times the three implementations with `triton.testing.do_bench`
# (median) and `benchmarks/gdn_verify.py` measures parity on the GPU (and exits 1, naming each case, when an error
# is over its tolerance, about three times the worst measured, or a run does not repeat bit for bit). The numbers below were measured
# on one H200 and stored in `benchmarks/results/gdn_kernel.json`, which this notebook plots (so it
# runs without a GPU). That run (2026-12-02) predates rounds 12–14, which made kernel 1 and the backward faster: its
# Triton rows and launches are kept here as the record of that version, and the current kernels' times are round 19's
# table further down (solve 0.150 ms, state pass + $o$ 0.195 ms, forward + backward 0.981 ms with `keep_prep`, the
# model's path, whose backward skips kernel 1 and the state pass). The 1.445 ms here recomputes them (`keep_prep=False`);
# the old kernels on the `keep_prep` path summed to about 1.12 ms (the launches printed below), so rounds 12–14 saved
# about 0.14 ms and keeping $A$ and the states the rest. To measure again:

# %%
import subprocess, sys, tempfile

# %%
#| gpu
scratch = Path(tempfile.mkdtemp(prefix="hymo-bench-"))  # benchmarks/results/ is the results page's record: copy rows by hand
subprocess.run([sys.executable, "../benchmarks/gdn_kernel.py", "--out", str(scratch / "gdn_kernel.json")], check=True)
subprocess.run([sys.executable, "../benchmarks/gdn_verify.py", "--out", str(scratch / "gdn_verify.json")], check=True)
print("written to", scratch)

# %%
bench = json.loads((Path("..") / "benchmarks/results/gdn_kernel.json").read_text())
r, m = bench["shapes"]["hymo_750m"] if "shapes" in bench else bench["hymo_750m"], bench["meta"]  # (the file predates "shapes")
print(f"{m['device']}, torch {m['torch']}, Triton {m['triton']}, {m['date']}; B={r['B']} T={r['T']} H={r['H']} K={r['K']} V={r['V']}, bf16")
rows = [("Triton (this chapter)", r["triton_fwd_ms"], r["triton_fwd_bwd_ms"]),
        ("PyTorch chunked (ch. 12)", r["torch_chunk_fwd_ms"], r["torch_chunk_fwd_bwd_ms"]),
        (f"naive loop (T={r['naive_T_measured']}, x{r['T'] // r['naive_T_measured']})", r["naive_fwd_ms_extrapolated"], r["naive_fwd_bwd_ms_extrapolated"])]
print(f"{'':34s}{'forward ms':>12s}{'fwd+bwd ms':>12s}")
for name, f, fb in rows: print(f"{name:34s}{f:12.3f}{fb:12.3f}")
print("Triton launches (ms):", ", ".join(f"{k} {v:.3f}" for k, v in r["triton_kernels_ms"].items()))
ks = bench["launches_keep_states"]["triton_kernels_ms"]  # a later run, once the forward could store the states
print("keep_prep (the model's path): forward storing S_0 {:.3f} ms, dS pass alone {:.3f} ms (S and dS together {:.3f} ms)".format(
      ks["state pass + o, saving S_0"], ks["dS pass alone (S_0 kept)"], ks["S and dS passes"]))
print(f"fwd+bwd peak memory {r['triton_fwd_bwd_peak_MB']:.0f} MiB = {r['peak_over_io']:.2f} x inputs+outputs "
      f"({r['inputs_outputs_MB']:.0f} MiB); PyTorch chunked {r['torch_chunk_fwd_bwd_peak_MB']:.0f} MiB")
assert r["triton_fwd_ms"] <= 0.6 and r["triton_fwd_bwd_ms"] <= 2.0 and r["peak_over_io"] <= 2.0  # the targets

# %%
#| fig-alt: "Left: time in ms, on a log scale, of the forward and of forward plus backward of one GDN layer at the HyMo 750M shape, for the Triton kernel, the PyTorch chunked path and the naive recurrence (extrapolated). Right: the time of each Triton launch."
fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
x = range(len(rows))
a1.bar([i - 0.2 for i in x], [f for _, f, _ in rows], 0.4, label="forward")
a1.bar([i + 0.2 for i in x], [fb for _, _, fb in rows], 0.4, label="forward + backward")
a1.set_yscale("log"); a1.set_xticks(list(x), ["Triton", "PyTorch\nchunked", "naive\n(extrap.)"]); a1.set_ylabel("ms"); a1.legend(fontsize=8)
a1.set_title("one GDN layer, HyMo 750M shape", fontsize=9)
k = r["triton_kernels_ms"]
names = ["prep (gates, A)", "state pass + o", "S and dS passes", "local grads"]
a2.barh(names, [k[n] for n in names]); a2.invert_yaxis(); a2.set_xlabel("ms"); a2.set_title("Triton launches (backward: prep, S/dS, local)", fontsize=9)
plt.tight_layout(); plt.show()

# %% [markdown]
# The first version of kernel 1 solved $A$ row by row on the whole tile; solving the diagonal
# blocks together on one tile took it from the first figure to the second, and round 12's kernel,
# every block its own tile, to the third (everything else changed less). The last line is round
# 12's run of every launch, the model's path included:

# %%
f0, k12 = bench["first_version"], bench["launches_round12"]
print(f"prep: {f0['triton_kernels_ms']['prep (gates, A)']:.2f} ms -> {k['prep (gates, A)']:.2f} ms -> "
      f"{k12['triton_kernels_ms']['prep (gates, A)']:.3f} ms;  "
      f"forward {f0['triton_fwd_ms']:.2f} -> {r['triton_fwd_ms']:.2f} ms;  forward+backward {f0['triton_fwd_bwd_ms']:.2f} -> {r['triton_fwd_bwd_ms']:.2f} ms")
print(f"round 12 ({k12['meta']['date']}):", ", ".join(f"{n} {v:.3f}" for n, v in k12["triton_kernels_ms"].items()))

# %% [markdown]
# Parity on the GPU, relative RMSE $\lVert \text{ref} - \text{out}\rVert_2 / \lVert\text{ref}\rVert_2$
# against the fp32 loop on the same bf16 inputs. With these rows' strong decays the errors are
# about 0.003, mostly from the roundings inside the kernels (the bf16 $A$, $U$ and state as product
# operands, above): the final state and the gradients of the gates, the write strengths and the
# initial state come back in fp32 and are off by 2.4e-3 to 3.0e-3 all the same. The output and the
# gradients of $q$, $k$, $v$ are rounded once more, to bf16; a bf16 rounding alone gives a relative
# RMSE of 1.7e-3, and as errors add in quadrature that is about a quarter of their squared error.
# The targets were 0.005 for $o$ and the state and 0.01 for the gradients.

# %%
print(f"{'T':>5s} {'B':>2s} " + " ".join(f"{n:>7s}" for n in "o ht dq dk dv dg dbeta dh0".split()))
for p in bench["parity"]:
    print(f"{p['T']:5d} {p['B']:2d} " + " ".join(f"{p[n]:7.1e}" for n in "o ht dq dk dv dg dbeta dh0".split()))
assert all(p[n] <= 0.005 for p in bench["parity"] for n in ("o", "ht")) and all(
    p[n] <= 0.01 for p in bench["parity"] for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"))

# %% [markdown]
# These rows are bf16 at HyMo's heads. A later run of `gdn_verify.py` on the H200 added fp32,
# packed rows of several documents, the fused recurrent kernel and wide heads ($H = 16$,
# $K = V = 128$), all within the same targets: its table is on the results page ("GDN kernel
# parity on the H200"), with the re-checks of each later change to the kernels. All of them drew
# strong decays, which let little of the carried state through. Round 28 added the mixer's initial
# decays and weak ones (a chunk keeps 0.94 of its state): at $T \le 256$ the bf16 errors grow to
# 4.8e-3 for $o$ and the state and 6.0e-3 for the gradients, inside the targets but no longer by
# much. Round 29 ran $T$ up to 4 096: with weak decays $o$ reaches 5.1e-3 at $T$ = 1 000 and 5.2e-3
# at 4 096, just over its target, and the gradients 6.3e-3; with the mixer's initial decays 4.3e-3
# and 5.4e-3 at most; in fp32 2.0e-3 and 2.7e-3 (`gdn_verify_decays_long_h200.json`). So the excess
# is most likely the bf16 rounding of the carried state as a product operand, named above (the other
# bf16 operands, $A$, $U$, $P$ and the stored $S_0$ and $dS_C$, also carry more state as decays
# weaken; no run kept the state in fp32 to separate them); keeping it in fp32 for those products
# would cost fp32 matrix products in the state pass, and is not done.

# %% [markdown]
# ## Questions
#
# ::: {.callout-tip collapse="true"}
# ## Why solve the UT matrix in 16×16 blocks instead of row by row?
# **In short:** row by row is 63 dependent steps on a tile spread over four warps, each step a
# reduction across them; four $16\times16$ blocks, solved by one warp (the kernel runs with `num_warps=1`), need 15 short steps and
# some small products. At HyMo's shape that took the solve from 2.3 ms to 0.151 ms. The story:
#
# Forward substitution is sequential: row $i$ needs rows $0..i-1$. In a Triton program the tile
# lives in registers spread over the program's threads, and a run-time row cannot be indexed, so
# every step picks its row out with a masked reduction. 63 such steps per chunk, each reducing
# across the four warps that held the $64\times64$ tile, made the first version of kernel 1 cost
# 2.3 ms at HyMo's shape. Blocks shorten the chain and shrink the tiles. The second version solved
# the four $16\times16$ diagonal blocks together on one `[4, 16, 16]` tile (15 steps) and merged
# them with $(I+N)^{-1} = (I-N)(I+N^2)$ for the strictly block-lower $N = D L_\text{off}$
# ($N^4 = 0$), four $64\times64$ products: 0.24 ms. The third (round 12) gives every block its
# own tile, built from its own loads. A $16\times16$ tile fits one warp, so the substitution's sums
# are shuffles inside a warp, and the blocks below the diagonal take sixteen $16\times16$ products
# instead of four $64\times64$ ones: 0.177 ms in round 12, launched with one warp (0.32 ms with two,
# 0.60 with four: the blocks are too small to share out). The fourth (round 13) carries $D^\top$
# rather than $(D - I)^\top$ through the substitution, so that no step moves vectors between
# layouts: 0.151 ms, timed on an identical copy of its body in `gdn_prep_solve.py`'s harness,
# where round 12's took 0.178 ms in the same run.
#
# Tried and not kept (the first two in earlier rounds, the results chapter; the rest in
# `benchmarks/gdn_prep_solve.py` and `benchmarks/results/gdn_prep_solve.json`):
#
# - Reading each row of the diagonal blocks from global memory instead of picking it out of the tile
#   (as flash-linear-attention's solver re-reads rows of the stored $L$; its off-diagonal products
#   are in full fp32, `ieee`, by default, where HyMo's are tf32): 0.41 ms in the second
#   version, the store, barrier and reloads costing more than the reduction they replace.
# - No serial steps at all, by doubling on $4\times4$ blocks and merging twice: 0.253 against 0.240
#   ms for the second version.
# - The series $(I - L)(I + L^2)(I + L^4)(I + L^8)$ for the $16\times16$ diagonal blocks, six
#   products each instead of 15 steps. In tf32 it is wrong by 0.13 of $A$'s largest entry when keys
#   are nearly aligned (0.007 when they only share a direction), and by about 1.4 on the tests'
#   hard chunks (the second version's tile and round 13's blocks alike): $(L^8)_{ij}$ reaches hundreds (224 at most there; bounded by
#   $\binom{14}{7}\,\ell^8$ for entries $|L_{ij}| \le \ell$, about 1 500 at $\ell = 0.9$ and 2 000 at the 0.937 those
#   chunks reach), and such terms cancel into entries of size 1. In
#   `tf32x3` (or exact fp32 products) it is as accurate as $A$'s tf32 products need, but takes
#   0.181 ms (0.228 ms in fp32): slower than substitution. On the whole $64\times64$ tile the
#   series ($L^{64} = 0$) is wrong even with fp32 products (by more than 1 on nearly aligned keys, in Triton's
#   interpreter: 1.6 in the run recorded, 6.0 in a later one, the size depending on the draw).
#
# The variants' times in `gdn_prep_solve.json` all come from one run on one H200 (round 13); the
# times of the first two versions and of the first idea above come from earlier rounds.
#
# The test `test_kernel_1_inverts_ill_conditioned_chunks` checks the kernel's algebra on hard chunks
# against float64, in Triton's interpreter, whose products are plain fp32 (tf32 rounding only
# happens on the GPU).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Recompute A and the chunk states in the backward, or keep them from the forward?
# **In short:** the kernel can do either. By default its backward recomputes them, which keeps its
# memory near 2× its inputs and outputs; the model asks to keep them (`keep_prep=True`), because that
# is faster and the 750M run has the memory to spare. The numbers:
#
# Recomputing saves memory. Saved per layer, $A$ alone is $B\,T\,H\cdot64$ numbers, twice the size of $q$ at $K=32$,
# and a 24-layer model would hold that for every GDN layer from forward to backward. Recomputing is
# two cheap launches (kernel 1 again, and the state pass, which runs beside the $dS$ pass in the same
# launch). The operator then keeps only its inputs, and one forward + backward peaks at 288 MiB, 1.74× the
# bytes of its inputs and outputs (measured), against 3.0 GiB (3093 MiB) for the PyTorch chunked path under autograd.
# Keeping $A$ and the gates from the forward was measured too, on the H200: forward + backward
# 1.44 → 1.24 ms per layer (a measurement not kept), but a peak of 2.24× the inputs and outputs, over the 2× this kernel was
# built to. So by default the backward recomputes them, and `keep_prep=True` keeps them. The model
# asks for that: in the 750M model's compiled micro-batch the GDN rule kernels fell from 36.5 to
# 30.0 ms with it, for 2 GB more at the peak (48.8 → 50.9 GB). Keeping the chunk states as well
# took them to 28.4 ms, for 0.5 GB more (51.4 GB); with round 6's optimiser changes (foreach updates,
# NorMuon's normalisation in one pass) the preset's whole step went from 6.933 to 6.84 s (one H200;
# `train_step.json`), about 51 ms of it from the GDN kernels (1.6 ms × 32 micro-batches).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why does one program walk all the chunks of a head, rather than one program per chunk?
# Because the state is a recurrence across chunks: chunk $t+1$ needs $S$ after chunk $t$. What can
# run in parallel (the solve for $A$, the per-chunk gradients) does, on a grid of chunks × heads.
# The carried part keeps $S$ (32×32 fp32 at HyMo's shape, 4 KB) in registers for all 64 chunks:
# it never goes to memory between chunks, and the loads of the next chunk are issued before the
# current one is computed. Splitting a head's state over two programs (16 value columns each) was
# slower in the first version (0.53 against 0.36 ms for the state pass; the 0.53 was not kept) and, in the current one,
# ended in an illegal memory access on the H200 under Triton 3.6 (the interpreter computes the same
# kernels correctly: `tests/test_gdn_triton.py`, `split_value_blocks`), as do 8 warps at $K = V = 32$; so one program per (sequence, head), 4 warps, it is.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why chunks of 64 tokens, and not 32 or 16?
# The chunk length trades two costs. What grows with $C$ per token is the inside of a chunk: the
# solve for $A$, $P$, and the $C\times C$ tiles of the local-gradient kernel, which are also what
# fills its registers. What shrinks with $C$ is the sequential part: the state passes take $T/C$
# dependent steps, and a chunk's stored $S_0$ and $dS_C$ ($K\times V$ each) cost $KV/C$ per token.
# Heads of $K = V = 32$ are small, so shorter chunks look tempting. Round 19 measured them
# (H200, Triton 3.6, bf16, $B = 4$, $T = 4096$, $H = 40$; the same kernels run at $C$ = 32 or 16,
# with solves of two and one 16-token blocks; ms, `do_bench` median):
#
# | $C$ | solve | state pass + $o$ | backward | forward + backward |
# |---|---|---|---|---|
# | 64 | 0.150 | 0.195 | 0.647 | 0.981 |
# | 32 | 0.096 | 0.223 | 1.012; 0.630 with a 2-warp local kernel | 1.323; 0.95 summed at best |
# | 16 | 0.073 | 0.313 | 1.064 | 1.441 |
#
# The solve gets cheaper and the forward's state pass slower, as expected. At $C = 32$ the backward
# needs the local-gradient kernel at 2 warps instead of 4 to win. Summing the separately timed
# parts (0.95 ms, against 0.99 ms summed the same way at 64), the whole rule is then about 4 %
# faster: some 1 ms of a 196 ms micro-batch of the 750M model, for a second solve and a second set
# of launch settings to keep right. Against the naive loop all three lengths are equally close, for
# $o$ and every gradient: relative errors of 0.003 to 0.004 in bf16, and about 0.002 in fp32
# (whose products run in tf32). So the kernels stay at 64, and a model configured with another
# `gdn_chunk_size` is refused by them (chapter 12) rather than run at 64 without saying so
# (`benchmarks/results/experiments.json`).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why does the local-gradient kernel compute $\Gamma$ and $P$ twice?
# **In short:** to fit in registers. Computing them again where they are used cut the spills from
# 264 to 148 bytes per thread and the kernel from 0.489 to 0.459 ms, with the same gradients. In detail:
# a thread has at most 255 registers, and at 4 warps a $64\times64$ fp32 tile takes 32
# of each thread's. The kernel holds several such tiles at once: the accumulators $dP$ and $dA$,
# $A$, $P^\top$ in the inputs' dtype (half a tile's registers in bf16), and (before commit e93a069)
# $\Gamma$, $P$ and $KK^\top\odot\Gamma$, kept from before the
# value loop to the end. What does not fit is spilled to local memory. You can see this without a
# GPU: `benchmarks/gdn_registers.py` compiles the kernels for the H200 (compute capability 9.0),
# specialised as a launch at HyMo's shape specialises them, and reads `ptxas -v`. The old kernel
# used 255 registers and spilled 264 bytes per thread under Triton 3.6 (460 under 3.9). Now
# $\Gamma$ and $P$ are computed again where they are used after the loop (one more
# $64\times32\times64$ product and 4 096 exponentials per chunk), and $KK^\top\odot\Gamma$ is formed
# there in the first place. That leaves 148 bytes (88 under 3.9), and the kernel went from 0.489
# to 0.459 ms at HyMo's shape on the H200, with gradients equal bit for bit. Other orders of the
# tail ran at 0.463 and 0.522 ms. The sequential passes barely spill (16 bytes, or none), and
# dropping their register prefetch of the next chunk made them slower (0.216 against 0.195 ms):
# the prefetch hides the loads' latency (`benchmarks/results/experiments.json`).
# Going the other way, capping the local-gradient kernel's registers (Triton's `maxnreg`) so that
# three or four blocks share an SM instead of two, was slower at every cap: 0.49 ms at 168
# registers (three blocks) and 0.85 at 128 (four), against 0.458 ms (round 14); the spills cost
# more than the extra warps hide. A cap of 200 still fits only two blocks of 128 threads
# (65 536 / 25 600), so it only added spills: 0.57 ms.
#
# Registers are not the only budget. The two products redone after the loop need their $K$-wide
# operands in shared memory at the same time, and with fp32 inputs and heads of 128 that came to
# 256 KiB per block under Triton 3.6, over the 227 KiB an H200 block may have: the kernel would not launch
# (`gdn_verify.py` at $K = V = 128$ in fp32 found it, in round 9). So the kernel
# keeps both orders, chosen by a compile-time flag (`HOLD`, set by `_hold_local`): fp32 inputs with
# $K > 64$ hold $P$ and $KK^\top\odot\Gamma$ across the loop as before (192 KiB), everything else
# recomputes them. (Triton 3.9 lays out shared memory more tightly: 224 KiB without `HOLD`, just under the limit,
# and 160 KiB with it. The flag stays, for the older Triton the GPU machine runs.) `gdn_registers.py` reports each kernel's shared memory, and a test compiles the
# fp32 wide case to check it fits; the bf16 kernel's PTX is the same as before the flag. Heads
# wider than 128 do not fit: the fp32 local-gradient kernel needs 352 KiB at $K = 256$ in either order (Triton 3.6,
# from a compile not kept), and compiled for the H200 under Triton 3.9 at $K = V = 256$ the fp32 forward asks for
# 464 KiB and even the bf16 state launch for 232 KiB. Any launch that does not fit stops with an error that says so
# and names the PyTorch path (`_fits_gpu`). A GPU with less shared memory than the H200 (an
# A100 block may have 163 KiB) has a lower limit still.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why pad head sizes, and why is zero padding exact?
# `tl.arange` and block shapes must be powers of two, and `tl.dot` needs sides of at least 16 (the
# autotuner has nothing to do with it, whatever the design notes say). The wrapper pads $K$ and $V$
# with zeros and slices the result. A zero key column adds nothing to $k^\top k$ or $q^\top k$, so
# $A$, $P$ and the gates are unchanged; a zero value column starts as a zero column of $S$ and stays
# one. The query scale is taken from the true $K$, not the padded one.
#
# The same exactness lets the wrapper work around two faults of Triton 3.6 on Hopper found by running unusual head
# shapes on an H100 (HyMo's $K = V = 32$ has neither). With bf16 inputs whose keys are wider than their values
# ($K = 128, V = 32$; $K = 64, V = 32$) the kernels made illegal memory accesses, and at $K = 64, V = 16$ they
# returned wrong values without an error (a relative error of 0.89 in $o$); fp32 inputs of the same shapes were
# right. So 16-bit values narrower than the keys are padded to the keys' width, which costs compute only for such
# shapes. And the sequential kernels at 8 warps with keys narrower than 64 ($K = 32, V = 256$; $K = 16, V = 512$)
# made illegal accesses in the bf16 backward, as 8 warps at $K = V = 32$ had; they now run at 4 warps, and were
# right there (relative errors 2.7e-3 to 4.6e-3).
#
# These look like the fault flash-linear-attention met in its issue 640: on Hopper, with Triton from 3.4 to before
# 3.7.1, its gated chunk backward gave wrong gradients, traced (its PR 826) to transposing a 16-bit tile cast from
# an accumulated `tl.dot`, a pattern HyMo's backward uses too (`tl.trans(b_P.to(DT))`), and seen at a key width of
# 64 but not 32 or 128. HyMo's kernels at that width were checked on an H100 under Triton 3.6 (`gdn_verify.py
# --quick --shapes k64,k64v16`, round 44 of chapter 80): with $K = V = 64$ and with $K = 64, V = 16$ (run as $V = 64$,
# above), in bf16 every output, state and gradient was within 6.04e-3 of the fp32 loop, as at $K = 32$, and in fp32
# within 2.21e-3. The same command checks another GPU or Triton.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How do packed sequences (`cu_seqlens`) stay apart?
# A packed row holds $N$ documents end to end. Every chunk belongs to exactly one document: each
# document is cut into its own chunks (the last one short), listed in `chunk_indices`, and every
# per-chunk buffer is addressed through `chunk_offsets`. Programs of the state pass each start from
# their document's own initial state and stop at its end, so no state crosses a boundary and the
# final state has one entry per document. Masks make the short last chunk behave as if padded with
# tokens that change nothing ($k = q = 0$, $\beta = 0$; their gate sums are loaded as $0$ and
# never used: the chunk's decay is read at its true last token).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## When is the fused recurrent kernel the right one?
# When few tokens arrive at a time with a state to carry: decoding. Each token then costs $O(KV)$
# per head, where a chunk would solve a $64\times64$ system for one token. For training and prefill
# the chunked path wins, because its work is matrix products on the tensor cores and only $T/64$
# steps are sequential instead of $T$: 64 times fewer dependent steps, each a few small products
# rather than a rank-one update that leaves the tensor cores idle. HyMo's decoding steps on a GPU
# run `fused_recurrent_gated_delta_rule` above (chapter 12's mixer picks it for one new token with a
# carried state and no gradient);
# its time against the chunked kernels for a token or a few has not been measured, so no ratio is
# given here. The Python reference loop, a much slower thing, takes about 0.67 s forward at
# $T = 4096$ (extrapolated from $T = 256$) against about 0.35 ms for the chunked kernels' forward (round 19's solve and
# state pass, storing every $S_0$ for `keep_prep`); that gap is
# mostly Python and launch overhead, not the algorithm.
# :::
