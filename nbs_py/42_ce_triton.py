# %% [markdown]
# # The cross-entropy chunk in one kernel
#
# > Loss and logit gradient of one chunk of rows in a Triton kernel: an online log-sum-exp pass and a gradient pass, checked against chapter 40's `ce_chunk`.

# %%
#| default_exp models.ce_triton

# %% [markdown]
# Chapter 40 computes the loss without materialising all the logits: `linear_cross_entropy` walks
# the rows in chunks, and for each chunk `ce_chunk` turns the logits $z$ $[c, |V|]$ into the loss
# and the gradient $\partial\ell/\partial z$. On a GPU `ce_chunk` went through `torch.compile`,
# which fuses it into one reduction kernel. At the 750M shape (chunks of 4 177 rows × 64 256
# classes, 537 MB of bf16 logits each) that kernel took 0.89 ms per chunk in the model's profile on
# the H200, 11 ms of a 241 ms micro-batch over the three heads. The least it must move is one read
# of the logits and one write of the gradient, 1.07 GB: about 0.22–0.25 ms at the 4.3–4.8 TB/s
# the card reaches. This chapter writes the kernel by hand.
#
# | function | what it is |
# |---|---|
# | `triton_ce_chunk` | `ce_chunk`'s contract, in Triton: `(Σ_rows w · (logsumexp(z) − z_y), (softmax(z) − e_y) · w)` |

# %%
import os
import torch

# %%
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: set before the first @triton.jit

# %%
#| export
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hymo.models.gdn_triton import INTERPRET  # importing it also readies Triton's library for the interpreter

# %%
from fastcore.test import test_close, test_eq, test_fail
from hymo.models.mtp import ce_chunk

# %%
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# %% [markdown]
# ## Log-sum-exp in one pass
#
# A row of 64 256 logits is 128 KB in bf16, too much for one program's registers, so a program
# walks its row in blocks of $B_V$ classes. The stable $\operatorname{logsumexp}(z) = m +
# \log\sum_j e^{z_j - m}$ needs the maximum $m$ first, which would cost a pass of its own. The
# online form keeps, in each of the $B_V$ lanes, a running maximum $m$ and a sum $s$ relative to
# it; a new value $z$ updates them as
# $$m' = \max(m, z), \qquad s' = s\, e^{m - m'} + e^{z - m'},$$
# so $s$ always equals $\sum e^{z_j - m}$ over the values the lane has seen. At the end the lanes
# are combined the same way: $M = \max_\text{lanes} m$, $S = \sum_\text{lanes} s\, e^{m - M}$,
# $\operatorname{logsumexp} = M + \log S$. (FlashAttention's softmax is the same recurrence, over
# blocks of keys.) A second pass reads the row again and writes
# $\partial\ell/\partial z_j = w\,(e^{z_j - \operatorname{lse}} - [j = y])$. The second read is of
# 128 KB the program read moments before, so part of it may come from the GPU's 50 MB L2 cache
# rather than from memory (not measured: a few hundred rows in flight hold more than 50 MB).
#
# The lanes start at $m = -10^{38}$ rather than $-\infty$: when a row is shorter than a block
# (the block is the next power of two, so $V = 50$ takes 64 lanes), the lanes past $V$ never see a
# real logit, and starting them at $-\infty$ would give $e^{-\infty - (-\infty)}$ = NaN. The price is a limit on
# the logits: a row whose logits are all below $-10^{38}$ (fp32's floor is $-3.4\cdot10^{38}$) would come out as
# $-\infty$ rather than its true loss. A language model's logits are a bf16 product of a normalised hidden state and
# the embedding, far inside that range.
#
# The targets are not checked on the host (that would make it wait for the GPU). The trainer
# refuses data whose vocabulary does not fit the model before it starts, so a target outside
# $[0, V)$ is a caller's mistake; unchecked, it would read a logit of another row. As a defence the
# kernel writes NaN as that row's loss instead, so the step is non-finite and the trainer skips it
# and says so, where `ce_chunk`'s gather would fail.

# %%
#| export
@triton.jit
def _ce_kernel(z, y, w, loss, dz, V, szr, WANT_GRAD: tl.constexpr, BV: tl.constexpr):
    "One row: loss[row] = w (logsumexp(z) - z_y); with WANT_GRAD, dz[row] = w (softmax(z) - e_y) in dz's dtype."
    row = tl.program_id(0).to(tl.int64)
    z_row = z + row * szr
    o_v = tl.arange(0, BV)
    b_m = tl.full([BV], -1e38, dtype=tl.float32)      # running max per lane
    b_s = tl.zeros([BV], dtype=tl.float32)            # sum of exp(z - b_m) per lane
    for v0 in range(0, V, BV):
        b_z = tl.load(z_row + v0 + o_v, mask=v0 + o_v < V, other=-float("inf")).to(tl.float32)
        b_mn = tl.maximum(b_m, b_z)
        b_s = b_s * tl.exp(b_m - b_mn) + tl.exp(b_z - b_mn)
        b_m = b_mn
    m = tl.max(b_m, 0)
    lse = m + tl.log(tl.sum(b_s * tl.exp(b_m - m), 0))
    tgt = tl.load(y + row)
    wr = tl.load(w + row).to(tl.float32)
    ok = (tgt >= 0) & (tgt < V)  # a target outside the vocabulary makes the loss NaN, not another row's logit
    z_y = tl.load(z_row + tl.where(ok, tgt, 0)).to(tl.float32)
    tl.store(loss + row, tl.where(ok, wr * (lse - z_y), float("nan")))
    if WANT_GRAD:
        dz_row = dz + row * V
        for v0 in range(0, V, BV):
            o = v0 + o_v
            b_z = tl.load(z_row + o, mask=o < V, other=0.).to(tl.float32)
            b_g = (tl.exp(b_z - lse) - tl.where(o == tgt, 1., 0.)) * wr
            tl.store(dz_row + o, b_g.to(dz.dtype.element_ty), mask=o < V)


# %% [markdown]
# ## Host side
#
# One program per row. The per-row losses are summed in PyTorch, in a fixed order, so the loss
# does not depend on the order the programs ran in. `LAUNCH` holds the block width and warp
# count, the fastest in `benchmarks/ce_kernel.py --sweep` on an H200.

# %%
#| export
LAUNCH = dict(BV=4096, num_warps=16)


def triton_ce_chunk(z: torch.Tensor, # Logits of one chunk [c, V] (bf16 or fp32), class stride 1
                    y: torch.Tensor, # Targets [c] in [0, V), ignored rows clamped to a valid id (one outside: a NaN loss, its gradient row wrong)
                    w: torch.Tensor, # Row weights [c]: 1/n_valid for a counted row, 0 for an ignored one
                    want_grad: bool, # Also return d(loss)/dz
                   ):
    "`ce_chunk` in Triton: `(Σ_rows w · (logsumexp(z) - z_y) fp32, (softmax(z) - e_y) · w in z's dtype or None)`."
    if z.ndim != 2 or z.stride(1) != 1:
        raise ValueError(f"z must be [rows, classes] with class stride 1, got shape {tuple(z.shape)} strides {z.stride()}")
    if z.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"triton_ce_chunk takes fp32 or bf16 logits, got {z.dtype}; use ce_chunk")
    if y.dtype not in (torch.int32, torch.int64):  # a float target would be read as an address
        raise TypeError(f"y must hold integer class ids (int64 or int32), got {y.dtype}")
    if y.device != z.device or w.device != z.device:  # the interpreter would read another device's memory as garbage
        raise ValueError(f"y and w must be on z's device ({z.device}); got {y.device} and {w.device}")
    if z.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 before the kernels are imported, "
                           "or use ce_chunk")
    c, V = z.shape
    if V == 0: raise ValueError(f"z has no classes ({tuple(z.shape)}): a vocabulary of at least one id is needed")
    if y.shape != (c,) or w.shape != (c,):  # the kernel reads one target and one weight per row, unchecked
        raise ValueError(f"y and w must be [{c}], one per row of z; got {tuple(y.shape)} and {tuple(w.shape)}")
    loss = torch.empty(c, dtype=torch.float32, device=z.device)
    dz = torch.empty_like(z, memory_format=torch.contiguous_format) if want_grad else None
    if c: _ce_kernel[(c,)](z, y.contiguous(), w.contiguous(), loss, dz, V, z.stride(0), want_grad,
                           min(LAUNCH["BV"], triton.next_power_of_2(V)), num_warps=LAUNCH["num_warps"])
    return loss.sum(), dz


# %% [markdown]
# ## Checks against `ce_chunk`
#
# Same logits, targets and row weights through both; an ignored row (weight 0) must give a zero
# gradient row. The class count is not a multiple of the block, so the last block is masked.

# %%
def check(c, V, dtype, tol, BV=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(c, V, generator=gen) * 3).to(DEV, dtype)
    y = torch.randint(0, V, (c,), generator=gen).to(DEV)
    w = torch.full((c,), 1 / (c - 1), device=DEV); w[1] = 0            # row 1 is ignored
    saved = dict(LAUNCH); LAUNCH["BV"] = BV
    try: got = triton_ce_chunk(z, y, w, True)
    finally: LAUNCH.update(saved)
    ref = ce_chunk(z.double(), y, w.double(), True)                  # fp64: fp32's own rounding is ~1e-7 of the loss
    test_close(got[0].item() / ref[0].item(), 1.0, eps=tol)
    test_close(got[1].double(), ref[1], eps=tol)
    test_eq(got[1][1].abs().max().item(), 0.0)
    return got, ref


check(5, 1000, torch.float32, 1e-6)
got, ref = check(4, 777, torch.bfloat16, 1e-2, BV=128, seed=1)
print(f"bf16 loss {got[0].item():.6f} vs fp32 {ref[0].item():.6f}")
test_eq(triton_ce_chunk(torch.randn(3, 50, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV),
                        torch.ones(3, device=DEV), False)[1], None)   # evaluation: no gradient

# %% [markdown]
# Logits far from zero are where a naive `log(sum(exp(z)))` overflows; the online form does not:

# %%
z = torch.tensor([[1000., 999., -1000.], [-5e3, -5e3, -5e3]], device=DEV)
loss, _ = triton_ce_chunk(z, torch.tensor([0, 2], device=DEV), torch.tensor([1., 1.], device=DEV), False)
test_close(loss.item(), (torch.logsumexp(z, 1) - z[[0, 1], [0, 2]]).sum().item(), eps=1e-5)

# %% [markdown]
# Bad input gets a message:

# %%
test_fail(lambda: triton_ce_chunk(torch.randn(4, 6, device=DEV).T, torch.zeros(6, dtype=torch.long, device=DEV),
                                  torch.ones(6, device=DEV), True), contains="class stride 1")
test_fail(lambda: triton_ce_chunk(torch.randn(4, 6, device=DEV, dtype=torch.float64), torch.zeros(4, dtype=torch.long, device=DEV),
                                  torch.ones(4, device=DEV), True), contains="use ce_chunk")

# %% [markdown]
# `linear_cross_entropy` (chapter 40) uses this kernel on CUDA for bf16 and fp32 logits, and
# `ce_chunk` elsewhere.
#
# ## Speed on an H200
#
# `benchmarks/ce_kernel.py` times one chunk at the 750M shape (4 177 × 64 256, bf16) for the
# kernel and for `torch.compile(ce_chunk)`, checks the kernel against the fp32 `ce_chunk`, and with
# `--sweep` tries block widths and warp counts. The numbers were measured on one H200 and stored in
# `benchmarks/results/ce_kernel.json`, which this notebook reads:

# %%
import json
from pathlib import Path

# %%
res = json.loads((Path("..") / "benchmarks/results/ce_kernel.json").read_text())
m = res["meta"]
print(f"{m['device']}, torch {m['torch']}, Triton {m['triton']}, {m['date']}; chunk {m['rows']} x {m['classes']} bf16; launch {res['launch_timed']}")
print("relative error vs fp32 ce_chunk:", {k: f"{v:.1e}" for k, v in res["parity"].items()})
for name in ("triton", "compiled"):
    print(f"{name:9s} {res[name + '_ms']:.3f} ms  ({res[name + '_TBps']:.2f} TB/s of one read and one write)")
assert res["parity"]["dz"] <= 1e-2 and res["parity"]["loss"] <= 1e-5

# %% [markdown]
# What they say: the kernel takes 0.42 ms per chunk against 0.92 ms for the compiled `ce_chunk` timed
# the same way (0.89 ms in the model's profile, above),
# 2.6 TB/s of the one read and one write it must do, and its gradient matches the fp32 reference
# to 1.5e-4 relative to the gradient's norm (the compiled version's error is the same). That
# measure says little about most entries: the norm is almost all the target entries, $w(p_y - 1)$
# near $-w$, and each of the other 64 255 entries of a row carries its own bf16 rounding, up to
# $2^{-8}$ of its value (`tests/test_ce_triton.py` checks every entry within $2^{-7}$, one bf16 step). The block
# width and warp count matter little: the sweep's 12 settings ranged over 0.42–0.67 ms, and the
# best three were within 3 % of each other. In the 750M model, the loss's softmax work fell from 10.8 to 4.9 ms
# per micro-batch (the profiles of rounds 3 and 4 in `benchmarks/results/train_step.json`).

# %% [markdown]
# ## Questions
#
# ::: {.callout-tip collapse="true"}
# ## Why not fuse the vocabulary projection into the kernel as well?
# Then the logits would never be written at all: each program would compute its rows' logits block
# by block from $h$ and $W$ and keep only the running log-sum-exp. That saves the 537 MB write and
# read per chunk, about 0.2 ms at the H200's peak bandwidth and 0.4 ms at the 2.6 TB/s this
# kernel reaches (measured above), but the kernel then has to do the $2 c\,|V|\,d$ FLOPs of the
# projection (and, for the gradients, two more products) as well as cuBLAS does, which is a much
# larger piece of work to tune. The three products take about 2 ms per chunk on an H200, five
# times the softmax pass that this kernel shortened.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## The per-lane running maximum costs an extra exponential per element. Is that a problem?
# The first pass computes two exponentials per logit ($e^{m - m'}$ and $e^{z - m'}$) and the second
# one, so about 800 million per chunk. The H200's special-function units do several trillion a
# second, so that is about 0.2 ms of issue time that overlaps with the memory reads. A kernel that
# found each block's maximum first would save one exponential per element but add a reduction
# across the block for every block.
# :::
