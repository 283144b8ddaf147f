# %% [markdown]
# # Optimisers
#
# > NorMuon for the hidden matrices, AdamW for everything else, cautious weight decay, and the warmup-stable-decay schedule.

# %%
#| default_exp training.optim

# %% [markdown]
# HyMo trains with two optimisers at once. The 2-D weight matrices inside the blocks (every
# `*_proj`, the SwiGLU `w1/w2/w3`, the stacked expert weights) are updated by **NorMuon**, a
# variant of Muon that orthogonalises the momentum before it is applied. Everything else (the
# tied embedding/head, norms, biases, the GDN gate parameters `A_log` and `dt_bias`, the depthwise
# convolutions, the MoE router) is updated by **AdamW**. Both use **cautious weight decay**, and
# both follow the same **warmup-stable-decay** (WSD) learning-rate schedule.
#
# This chapter builds each piece from a plain reference, checks the exported version against it,
# and ends with what changes when the parameters are FSDP-2 shards.

# %%
#| export
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from itertools import chain
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hymo.config import DECAY_SHAPES, TrainingConfig, validate_training

# %%
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_close, test_fail

from hymo.config import load_config
from hymo.models.layers import RMSNorm, SwiGLU


# %% [markdown]
# ## From SGD with momentum to Muon
#
# SGD with momentum keeps $M \leftarrow \beta M + (1-\beta) G$ and steps $W \leftarrow W - \eta M$.
# For a weight matrix $W \in \mathbb{R}^{m \times n}$ the gradient is a sum of outer products
# $\sum_t \delta_t x_t^\top$ over the tokens of the batch, and in practice such matrices have a very
# skewed spectrum: a handful of singular directions carry most of the norm. Stepping along $M$
# therefore moves the weights a lot in those few directions and hardly at all in the others.
#
# Muon (Jordan et al., 2024) replaces $M = U \Sigma V^\top$ by its *orthogonal polar factor*
# $O = U V^\top$: same singular vectors, every singular value set to 1. It is the steepest-descent
# direction under the spectral norm: of all updates with $\|\Delta W\|_2 \le 1$, $-UV^\top$ decreases
# the linearised loss $\langle G, \Delta W \rangle$ the most. Every direction the gradient touches gets
# the same step, however small its singular value was.
#
# The naive reference computes the polar factor with an SVD:

# %%
def orthogonalize_svd(G):
    "Reference polar factor U Vᵀ of G [..., m, n] (singular values set to 1), in fp32."
    U, S, Vh = torch.linalg.svd(G.float(), full_matrices=False)
    return U @ Vh


# %%
torch.manual_seed(0)
G = torch.randn(32, 32) @ torch.diag(torch.logspace(0, -2, 32)) @ torch.randn(32, 64)  # (32, 64), skewed spectrum
O = orthogonalize_svd(G)
test_close(torch.linalg.svdvals(O), torch.ones(32), eps=1e-4)
test_close(O @ O.T, torch.eye(32), eps=1e-4)  # a wide O has orthonormal rows

# %% [markdown]
# ### Newton–Schulz: the polar factor with matrix products only
#
# An SVD is slow on a GPU and does not run in bf16. Muon instead applies an odd matrix polynomial a
# few times. Normalise $X_0 = G / \|G\|_F$ so that every singular value is in $[0, 1]$, then iterate
# $$A = X X^\top, \qquad B = b A + c A^2, \qquad X \leftarrow a X + B X ,$$
# which is $X \leftarrow a X + b (XX^\top) X + c (XX^\top)^2 X$. Because the polynomial is odd it acts
# on each singular value separately: $U \Sigma V^\top \mapsto U \varphi(\Sigma) V^\top$ with
# $\varphi(\sigma) = a\sigma + b\sigma^3 + c\sigma^5$. The quintic coefficients
# $(a, b, c) = (3.4445, -4.7750, 2.0315)$ are tuned for speed rather than exact convergence: the
# slope $a \approx 3.4$ at zero inflates small singular values fast, at the price that 1 is not a
# fixed point ($\varphi(1) \approx 0.70$): the iterates do not converge but stay in a band around 1,
# $[0.68, 1.14]$ after five steps for any $\sigma_0 \ge 0.01$. Five iterations in bf16 are enough.
#
# When $m > n$ the iteration runs on $X^\top$ so that the Gram matrix $XX^\top$ is the smaller
# $\min(m, n)^2$ one. A leading batch dimension (stacked experts `[E, m, n]`) is orthogonalised matrix
# by matrix, because every product works on the last two dimensions.
#
# Each iteration is three batched products and nothing else: `baddbmm` computes $bA + cA^2$ and
# $aX + BX$ with the scalars applied inside the matrix multiply, instead of a product followed by
# two elementwise passes over the result. $X$ is made contiguous once after the transpose, and the
# result once on the way back, so that NorMuon's row norms read contiguous rows. On an H200 the
# iterations for the 750M model's stacked expert matrices (`[16, 16, 2304, 896]` in bf16) take
# 28 ms this way, against 43 ms with the scalars applied in separate passes, and land closer to
# the fp32 result (relative error 1.0e-2 against 2.2e-2), because the scalars are applied to the
# fp32 accumulator.

# %%
#| export
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # (a, b, c) of the quintic φ(σ) = aσ + bσ³ + cσ⁵


def ns_dtype(t: torch.Tensor) -> torch.dtype:
    """The Newton–Schulz compute dtype: bf16 on a GPU, where tensor cores make the five iterations
    cheap; fp32 on a CPU, where bf16 is no faster, so CPU runs stay reproducible across world sizes
    (bf16 rounding would turn reduction-order noise in the gradients into visible differences)."""
    return torch.bfloat16 if t.is_cuda else torch.float32


def newton_schulz(G: torch.Tensor, # Update [..., m, n]; leading dimensions are independent matrices
                  steps: int = 5, # Quintic Newton–Schulz iterations
                  eps: float = 1e-7, # Guards the Frobenius normalisation of an all-zero G
                  dtype: torch.dtype | None = None, # Compute dtype; None: `ns_dtype(G)` (bf16 on GPU, fp32 on CPU)
                 ) -> torch.Tensor:
    "Approximate polar factor U Vᵀ of each matrix of G [..., m, n]: singular values ≥ 1 % of ‖G‖_F land in [0.68, 1.14], smaller ones in [0, 1.21]."
    if G.ndim < 2: raise ValueError(f"newton_schulz needs a matrix [..., m, n]; got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFS
    X = G.to(dtype or ns_dtype(G))
    tall = G.size(-2) > G.size(-1)
    if tall: X = X.mT  # (..., n, m): iterate on the wide side, Gram matrix min(m, n)²
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + eps)).contiguous()  # every σ in (0, 1]
    lead = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # (batch, k, l) with k = min(m, n)
    for _ in range(steps):
        A = torch.bmm(X, X.mT)  # (batch, k, k)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A²
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    X = X.view(*lead, *X.shape[-2:])
    return X.mT.contiguous() if tall else X  # rows contiguous again for the row norms that follow


# %% [markdown]
# Where do singular values go? The scalar map $\varphi$ applied $k$ times shows it: the curves on
# the left start at $\sigma/\|G\|_F$ (log axis) and after five steps everything above about $10^{-2}$
# sits in a band around 1, $[0.68, 1.14]$. Below that the curves have not settled: a value near
# $0.004\,\|G\|_F$ lands on the overshoot's peak, $1.20$, and smaller ones have not been lifted yet.
# On the right, the spectrum of a skewed $128 \times 512$ matrix before (normalised by its largest
# value) and after five bf16 iterations, as on a GPU (`dtype=torch.bfloat16`; a CPU run of the
# optimiser iterates in fp32, `ns_dtype`).

# %%
#| fig-alt: "Left: the quintic Newton-Schulz map applied one to five times, against sigma over the Frobenius norm. Right: the singular values of a 128 by 512 gradient, before (divided by the largest) and after newton_schulz, which gathers them near 1."
def phi(s, k=1):
    "The scalar quintic applied k times (float64)."
    a, b, c = NS_COEFFS
    for _ in range(k): s = a * s + b * s**3 + c * s**5
    return s

s0 = torch.logspace(-3, 0, 400, dtype=torch.float64)
band = phi(s0[s0 >= 0.01], 5)
print(f"after 5 steps, σ0 ≥ 0.01 lands in [{band.min():.3f}, {band.max():.3f}]; the peak over all σ0 is {phi(s0, 5).max():.3f}")
assert 0.68 < band.min() and band.max() < 1.14 and phi(s0, 5).max() < 1.21

torch.manual_seed(0)
G = torch.randn(128, 32) @ torch.randn(32, 512) + 0.3 * torch.randn(128, 512)  # (128, 512): a strong rank-32 part plus noise
sv_before = torch.linalg.svdvals(G)
sv_after = torch.linalg.svdvals(newton_schulz(G, dtype=torch.bfloat16).float())

fig, ax = plt.subplots(1, 2, figsize=(9, 3))
for k in range(1, 6): ax[0].semilogx(s0, phi(s0, k), label=f"{k} step{'s' if k > 1 else ''}")
ax[0].set(xlabel="σ / ‖G‖_F", ylabel="φᵏ(σ)", title="quintic Newton–Schulz"); ax[0].legend(fontsize=7)
ax[1].plot(sv_before / sv_before.max(), ".", ms=3, label="G (÷ σ_max)")
ax[1].plot(sv_after, ".", ms=3, label="newton_schulz(G)")
ax[1].set(xlabel="index", ylabel="singular value", title="a 128×512 gradient"); ax[1].legend(fontsize=7)
plt.tight_layout(); plt.show()

# %% [markdown]
# The bf16 iteration keeps the singular vectors of the SVD reference: projected onto them,
# $U^\top \mathrm{NS}(G) V$ is diagonal up to bf16 noise, and its diagonal is $\varphi^5$ of the
# normalised singular values: in the band, except the noise values between about $0.003$ and $0.005\,\|G\|_F$
# (56 of this matrix's 128), which land near the overshoot's peak, up to 1.20; the very smallest, at
# $0.0025\,\|G\|_F$, come out near 1 again.

# %%
U, S, Vh = torch.linalg.svd(G, full_matrices=False)
D = U.T @ newton_schulz(G, dtype=torch.bfloat16).float() @ Vh.T  # (128, 128)
off = D - torch.diag(torch.diag(D))
print(f"diag in [{torch.diag(D).min():.3f}, {torch.diag(D).max():.3f}], largest off-diagonal {off.abs().max():.3f}")
assert off.abs().max() < 0.05  # diagonal up to bf16 noise
test_close(torch.diag(D), phi((S / S.norm()).double(), 5).float(), eps=0.02)  # φ⁵ of each σ / ‖G‖_F, up to bf16 rounding
for shape in [(64, 256), (256, 64), (3, 96, 32)]:  # wide, tall, stacked experts
    sv = torch.linalg.svdvals(newton_schulz(torch.randn(shape)).float())
    assert 0.6 < sv.min() and sv.max() < 1.2, (shape, sv.min(), sv.max())
test_fail(lambda: newton_schulz(torch.randn(5)), contains="needs a matrix")


# %% [markdown]
# ### Shape scaling, and what Muon's learning rate means in AdamW units
#
# An $m \times n$ matrix with $k = \min(m, n)$ unit singular values has $\|O\|_F = \sqrt{k}$, so the
# root mean square of its entries is $\sqrt{k / mn} = 1/\sqrt{\max(m, n)}$. HyMo multiplies the
# orthogonalised update by
# $$s(m, n) = \sqrt{\max(1, m/n)} ,$$
# the rule of Keller Jordan's Muon and modded-nanogpt. For a wide or square matrix ($m \le n$) the
# RMS stays $1/\sqrt{n}$; for a tall one it becomes $\sqrt{m/n}/\sqrt{m} = 1/\sqrt{n}$ as well. Either
# way the per-entry step is $\eta_\text{muon}/\sqrt{n}$, with $n$ the fan-in: the RMS of the
# pre-activation change $\Delta W x$ for a unit-RMS input uncorrelated with the update is the same for
# every layer width. That is a heuristic for "the learning rate transfers across widths": an input
# aligned with the update sees a larger change, and exact transfer asks for a spectral norm
# $\lVert \Delta W \rVert_2 \propto \sqrt{m/n}$, which $\sqrt{\max(1, m/n)}$ only approximates.
#
# The other common rule (Moonshot's *Muon is Scalable*, 2025) multiplies by $0.2\sqrt{\max(m,n)}$,
# which sets the update RMS to about 0.2 (exactly 0.2 for an exact, full-rank polar factor; Newton–Schulz's singular values spread around 1, and a low-rank update's RMS is lower), about what AdamW's update RMS is in practice, so that
# Muon can reuse AdamW's learning rate. We keep the first rule because HyMo's `muon_lr = 0.02` is in
# its units; the two are related by
# $$\eta_\text{AdamW-equivalent} = \frac{\eta_\text{muon}}{0.2\,\sqrt{n}} ,$$
# for the 750M model's fan-ins:

# %%
#| export
def muon_shape_scale(rows: int, # m: output features (rows of the weight)
                     cols: int, # n: input features (columns, the fan-in)
                    ) -> float:
    "Factor max(1, m/n)^½ applied to an orthogonalised [m, n] update: its RMS becomes 1/√n for any shape."
    return max(1.0, rows / cols) ** 0.5


# %%
cfg750 = load_config("hymo_750m")
print(f"{'matrix':24s} {'m × n':>12s} {'update RMS':>11s} {'≈ AdamW lr':>11s}")
for name, (m, n) in {"ffn.w1 (up, tall)": (2560, 896), "ffn.w2 (down, wide)": (896, 2560),
                     "experts.w1 (tall)": (2304, 896), "GDN o_proj (wide)": (896, 1280)}.items():
    Q = torch.linalg.qr(torch.randn(max(m, n), min(m, n))).Q  # orthonormal columns: all singular values 1
    O = (Q if m >= n else Q.T) * muon_shape_scale(m, n)  # (m, n)
    rms = O.pow(2).mean().sqrt().item()
    test_close(rms, n ** -0.5, eps=1e-4)
    print(f"{name:24s} {f'{m} × {n}':>12s} {rms:11.4f} {cfg750.train.muon_lr * rms / 0.2:11.2e}")
print(f"HyMo's adamw_lr = {cfg750.train.adamw_lr:.0e}")


# %% [markdown]
# The residual-stream fan-in $n = 896$ gives an AdamW-equivalent rate of $3.3 \times 10^{-3}$, 11 % above
# HyMo's `adamw_lr` ($3 \times 10^{-3}$): the two optimisers move their weights at about the same per-entry speed.
# (The wide down-projections, $n = 2560$, step about $1.7\times$ slower per entry, as $1/\sqrt{n}$ says
# they should.)
#
# ## NorMuon: normalise each output neuron
#
# An orthogonal update is balanced across singular directions, but not across *neurons*. For a
# wide matrix ($m \le n$) the exact polar factor has orthonormal rows, so every output neuron gets
# the same step; for a tall matrix ($m > n$: `w1`, `w3`, the expert up-projections) only the columns
# are orthonormal, the $n$ units of squared norm are shared unevenly among the $m$ rows, and some
# neurons get much larger updates than others. Newton–Schulz's band of $[0.68, 1.14]$ adds more
# unevenness on top.
#
# NorMuon (Li et al., 2025) adds Adam's per-coordinate idea at the granularity of a neuron: keep a
# running mean of each row's mean square and divide by its root,
# $$v \leftarrow \beta_2 v + (1 - \beta_2)\, \tfrac1n \textstyle\sum_j O_{ij}^2, \qquad
#   \hat O_{ij} = O_{ij} / \sqrt{\max(v_i, 10^{-10})}, \qquad
#   U = \hat O \cdot \frac{\|O\|_F}{\|\hat O\|_F} ,$$
# with $v \in \mathbb{R}^{m \times 1}$ (one number per output neuron, $\beta_2 = 0.95$). The last factor
# gives the update back the Frobenius norm of $O$, so the shape scaling and learning rate above keep
# their meaning: NorMuon redistributes the step among neurons without changing its size. The floor
# on $v$ is modded-nanogpt's (the paper adds an $\epsilon$ to $\sqrt{v}$ instead): a row whose
# updates are all but zero, RMS below $10^{-5}$, is not blown up to the size of the others. The
# rescale also makes a bias correction of $v$ unnecessary: dividing $v$ by $1 - \beta_2^t$ scales
# $\hat O$ by one number, which the rescale removes. That holds because all of a matrix's rows start
# their means together, as they do here (a dense matrix's rows all get gradients from the first
# step; an expert that gets no tokens freezes its whole $v$, see below); a row that woke up later
# than the others would get steps up to $1/\sqrt{1 - \beta_2} \approx 4.5\times$ theirs until its
# mean caught up. The state is $m$ floats per matrix, negligible next to the momentum's $mn$.
#
# The rescale follows the authors' reference code and modded-nanogpt's NorMuon rather than the
# paper's Algorithm 1. Li et al.'s algorithm sets the step's size directly, with
# $\hat\eta = 0.2\,\eta\sqrt{mn}/\lVert\hat O\rVert_F$ in their Algorithm 1 (Moonshot's RMS matching, so that AdamW's
# learning rates carry over) and plain momentum. HyMo keeps Muon's units instead: Nesterov
# momentum, the shape factor $\sqrt{\max(1, m/n)}$ and a learning rate of 0.02 keep their meaning
# from Muon, and the row normalisation only redistributes the step. HyMo, like the paper and the
# authors' code, always normalises rows (output neurons); modded-nanogpt picks the side by the
# matrix's shape or kind. On a wide matrix, whose exact polar factor already has rows of one norm,
# NorMuon here only evens out Newton–Schulz's band.
#
# Written as three passes over $O$ (divide, take both norms, rescale), this is mostly memory
# traffic: at the 750M model's 1.2 billion NorMuon weights each fp32 pass is some 9 GB. One pass
# is enough, because everything except the final product is a number per row. With
# $a_i = \sum_j O_{ij}^2$ (one reduction), $\|O\|_F^2 = \sum_i a_i$ and
# $\|\hat O\|_F^2 = \sum_i a_i / v_i$, so
# $$U_{ij} = O_{ij} \cdot \frac{s(m, n)}{\sqrt{v_i}} \sqrt{\frac{\sum_k a_k}{\sum_k a_k / v_k}}$$
# is one multiply by a per-row factor, into which the shape scale $s(m, n)$ of the step above is
# folded too (`gain`). $O$ may stay in bf16: the row sums accumulate in fp32 and the product comes out in
# fp32.

# %%
#| export
def normuon_rownorm(O: torch.Tensor, # Orthogonalised update [..., m, n] (bf16 from Newton–Schulz, or fp32)
                    v: torch.Tensor, # Running mean square of each row [..., m, 1], fp32
                    beta2: float, # Decay of v
                    gain: float = 1.0, # Shape scale s(m, n), applied in the same product
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    "NorMuon's step: update v, divide each row of O by √v, rescale each matrix to gain · ‖O‖_F; returns (U fp32, v)."
    f, v = normuon_row_factor(O, v, beta2, gain)
    return O * f, v  # one pass over O; fp32 by type promotion


def normuon_row_factor(O: torch.Tensor, # Orthogonalised update [..., m, n]
                       v: torch.Tensor, # Running mean square of each row [..., m, 1], fp32
                       beta2: float, # Decay of v
                       gain: float = 1.0, # Shape scale s(m, n)
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    "Everything of `normuon_rownorm` but the product: `(f [..., m, 1] fp32, v)` with U = O · f, one reduction over O."
    s = torch.linalg.vector_norm(O, dim=-1, keepdim=True, dtype=torch.float32).square()  # (..., m, 1) row sums of squares
    v = v.lerp(s / O.size(-1), 1 - beta2)
    r = v.clamp_min(1e-10).rsqrt()
    rescale = (s.sum((-2, -1), keepdim=True) / (r.square() * s).sum((-2, -1), keepdim=True).clamp_min(1e-20)).sqrt()
    return r * (rescale * gain), v


# %% [markdown]
# On a tall matrix whose gradient is much larger in a few rows, the orthogonalised update still
# leaves row norms uneven (the loud rows some 1.75 times the quiet ones); after a few NorMuon steps they are nearly equal, and the
# total norm has not moved.

# %%
torch.manual_seed(0)
m, n = 384, 128
row_scale = torch.ones(m, 1); row_scale[:16] = 20.0  # 16 "loud" neurons
v = torch.zeros(m, 1)
for t in range(10):
    O = newton_schulz(row_scale * torch.randn(m, n)).float()
    U, v = normuon_rownorm(O, v, beta2=0.95)
    Oh = O / v.clamp_min(1e-10).sqrt()                                # the three-pass form, for comparison
    torch.testing.assert_close(U, Oh * O.norm() / Oh.norm())
cv = lambda X: (X.norm(dim=1).std() / X.norm(dim=1).mean()).item()  # spread of row norms
print(f"row-norm spread (std/mean): orthogonalised {cv(O):.3f} → NorMuon {cv(U):.3f}")
print(f"loud rows / quiet rows norm: {O[:16].norm(dim=1).mean() / O[16:].norm(dim=1).mean():.2f} → "
      f"{U[:16].norm(dim=1).mean() / U[16:].norm(dim=1).mean():.2f}")
test_close(U.norm(), O.norm(), eps=1e-3)
assert cv(U) < 0.5 * cv(O)


# %% [markdown]
# ## Cautious weight decay
#
# Decoupled weight decay pulls every weight towards zero: $x \leftarrow x - \eta(u + \lambda x)$,
# where $u$ is the optimiser's update. Where the update is pushing $x$ *away* from zero, the decay
# and the update fight each other, and the decay wins on weights the loss wants large. Cautious
# weight decay (Chen et al., 2025) applies the decay only where the two agree in sign,
# $$x \leftarrow x - \eta\big(u + \lambda\, \mathbf{1}[u \odot x \ge 0] \odot x\big) ,$$
# that is, only on the coordinates the update is already shrinking. The mask is computed from the
# weights before the step.

# %%
#| export
def weight_decay_term(x: torch.Tensor, # Parameter before the step
                      u: torch.Tensor, # The optimiser's update (the step is x ← x − η·u)
                      cautious: bool, # Decay only where u and x agree in sign
                     ) -> torch.Tensor:
    "The decay direction d in x ← x − η(u + λd): x itself, or 1[u⊙x ≥ 0]⊙x when cautious."
    return x * (u * x >= 0) if cautious else x


# %%
x = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5])
u = torch.tensor([0.3, -0.3, -0.2, 0.2, 0.0])
test_eq(weight_decay_term(x, u, cautious=True), torch.tensor([1.0, 0.0, -1.0, 0.0, 0.5]))
test_eq(weight_decay_term(x, u, cautious=False), x)


# %% [markdown]
# Entries 0 and 2 are being shrunk by the update anyway, so they are decayed too; entries 1 and 3
# are being grown, so they are left alone.
#
# AdamW, below, updates many tensors at once with PyTorch's `_foreach_*` operations (one
# launch for a whole list instead of one per tensor). There is no `_foreach` comparison, so the
# list form builds the mask from a sign: $\mathbf{1}[u x \ge 0] = \min(\operatorname{sign}(u x) + 1,\ 1)$,
# which is 0 where the signs disagree and 1 elsewhere, exactly the mask above. The decay term is
# then `mask * x`, which `_foreach_addcmul` folds into the update.
#
# Under FSDP the parameters and updates are `DTensor` shards, and `DTensor` runs a `_foreach`
# operation only if it has a sharding rule for it. Torch 2.11 has none for `_foreach_sign_` (its
# first FSDP optimiser step failed on the H200 with `NotImplementedError`; torch 2.13 gets past
# it). The mask is elementwise and a parameter and its update are sharded alike, so for shards it
# is computed on the local tensors and wrapped back in the parameter's layout: no communication,
# the same numbers, and only operations that every version has.

# %%
#| export
def foreach_decay_mask(xs: list[torch.Tensor], # Parameters before the step
                       us: list[torch.Tensor], # The updates, one per parameter, laid out like it
                      ) -> list[torch.Tensor]:
    "The cautious mask 1[u⊙x ≥ 0] of each (x, u) pair as 0/1 floats, in four list-wide launches."
    if any(isinstance(x, DTensor) for x in xs):  # FSDP shards: on the local tensors, then in x's layout again
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        mask = foreach_decay_mask([local(x) for x in xs], [local(u) for u in us])
        return [DTensor.from_local(m, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
                if isinstance(x, DTensor) else m for m, x in zip(mask, xs)]
    mask = torch._foreach_mul(us, xs)
    torch._foreach_sign_(mask)
    torch._foreach_add_(mask, 1)
    torch._foreach_clamp_max_(mask, 1)  # sign -1 -> 0, sign 0 or 1 -> 1
    return mask


# %%
xs, us = [x, -x, torch.randn(7)], [u, u, torch.randn(7)]
for m_, x_, u_ in zip(foreach_decay_mask(xs, us), xs, us):
    test_eq(m_ * x_, weight_decay_term(x_, u_, cautious=True))


# %% [markdown]
# NorMuon's last step, $x \leftarrow x - \eta(U + \lambda d)$ with $U = O \cdot f$, touches every weight
# once more. Written as PyTorch operations over a list of parameters it is seven passes (the
# product, the mask's four, the sum, the step), each reading and writing 4 bytes per fp32 weight.
# The function below is that step for one parameter, and it is also a fast path: through
# `torch.compile` it becomes one kernel that reads $O$ (bf16), the row factor and the weight and
# writes the weight, with $U$, the mask and the sum kept in registers. The learning rate and decay
# go in as 0-dim tensors, so that the schedule's new $\eta$ every step does not recompile it, and the
# parameter as a plain tensor, since dynamo fixes the sizes of a `Parameter` and would compile again
# for every shape.
#
# A compiled call costs the host about 70 µs (dynamo checks its guards, then the wrapper launches
# the kernel), which is more than that kernel takes for a matrix of a million weights. So NorMuon
# compiles the update only where a parameter has `FUSED_MIN_NUMEL` ($2^{22}$) entries or more on
# this GPU (this rank's rows, under FSDP): in HyMo's 750M model on one GPU, the 24 stacks of routed
# experts, 33 M weights each and two thirds of all of NorMuon's. The 308 smaller matrices keep the
# list-wide launches, a few per group of same-shaped matrices. Under FSDP on 8 GPUs a rank holds 2
# of a stack's 16 experts, 4.1 M entries, just under $2^{22}$ = 4.19 M, so there every matrix takes
# the list-wide launches: 70 µs of host time per call would not pay for kernels of that size. On one H200 (`benchmarks/optim_step.py`,
# round 18 on the results page) this took NorMuon from 100–101 ms to 85–86 ms per step, with the
# same fp32 weights bit for bit; compiling every parameter instead was slower than the experts
# alone (93 against 85–86 ms): the GPU then waited on the host through the groups of small matrices. (Round 28's
# rule that leaves matrices without a gradient alone costs a norm per matrix: 88.1 ms since, 103.4 ms list-wide.)

# %%
#| export
def normuon_apply(x: torch.Tensor, # Parameter [..., m, n] (this rank's rows), updated in place
                  o: torch.Tensor, # Its orthogonalised update O [..., m, n] (bf16 from Newton–Schulz, or fp32)
                  f: torch.Tensor, # Row factor [..., m, 1] from `normuon_row_factor`: U = O · f
                  lr: float | torch.Tensor, # η (a 0-dim tensor on x's device when compiled)
                  wd: float | torch.Tensor, # λ, likewise
                  cautious: bool, # Decay only where U and x agree in sign
                 ) -> None:
    "x ← x − η(U + λd), U = O·f, d the (cautious) decay term: NorMuon's update of one parameter, in place."
    u = o * f  # fp32 by type promotion
    x.sub_(lr * (u + wd * weight_decay_term(x, u, cautious)))


FUSED_MIN_NUMEL = 1 << 22  # NorMuon compiles the update of parameters this large (on a GPU); smaller ones take list-wide launches


@functools.cache
def normuon_apply_fused():
    "`normuon_apply` through `torch.compile`: one kernel per parameter on a GPU (a few graphs: by rank, dtype and `cautious`)."
    return torch.compile(normuon_apply, dynamic=True)  # past the recompile limit: eager, not an error


# %%
x = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.5]])
o, f = torch.tensor([[0.6, -0.6, -0.4, 0.4, 0.0]]), torch.tensor([[0.5]])  # U = O·f is the u above
y = x.clone(); normuon_apply(y, o, f, lr=0.1, wd=0.5, cautious=True)
torch.testing.assert_close(y, x - 0.1 * (o * f + 0.5 * torch.tensor([[1.0, 0.0, -1.0, 0.0, 0.5]])))


# %% [markdown]
# ## NorMuon, the optimiser
#
# Putting the pieces together, one step for a matrix $W$ with gradient $G$:
#
# 1. momentum $M \leftarrow \beta M + (1-\beta) G$, Nesterov look-ahead $N = (1-\beta) G + \beta M$ ($\beta$ = `momentum`);
# 2. $O$ = `newton_schulz(N)` in bf16;
# 3. $U, v$ = `normuon_rownorm(O, v, beta2, gain=s(m, n))`: the row-normalised update, scaled by $s(m, n)$;
# 4. $W \leftarrow W - \eta\,(U + \lambda\, d)$ with $d$ the (cautious) decay term.
#
# One exception, which plain Muon does not make: a matrix whose gradient is exactly zero this step
# gets $U = 0$. Newton–Schulz gives its output one size whatever the size of its input, so a stale
# momentum, shrinking by $\beta$ each step, would still move the matrix a full step in its old
# direction, for hundreds of steps. The matrices this happens to are routed experts that received
# no token in a step (a dead expert, or one whose tokens were all dropped). Their momentum still
# decays and their $v$ stays as it was; the decoupled decay still applies. (AdamW, given a zero
# gradient, applies its decay too, but it also keeps stepping along its decaying first moment,
# which is what this exception prevents; a parameter whose `.grad` is None is skipped by both.)
#
# First the plain loop on one matrix, written without any of the helpers:

# %%
def normuon_reference(W, grads, lr, momentum=0.95, beta2=0.95, wd=0.1, steps=5):
    "From-scratch NorMuon with Nesterov momentum and cautious weight decay on one [m, n] matrix."
    W, M, v = W.clone(), torch.zeros_like(W), torch.zeros(W.shape[0], 1)
    m, n = W.shape
    for G in grads:
        M = momentum * M + (1 - momentum) * G
        if not G.any():  # no gradient this step: no update from the stale momentum, only the decay
            W = W - lr * wd * W; continue
        N = (1 - momentum) * G + momentum * M
        X = N.to(ns_dtype(N))                         # Newton–Schulz (bf16 on GPU, fp32 on CPU) on the wide side
        if m > n: X = X.T
        X = X / (X.norm() + 1e-7)
        for _ in range(steps):
            A = X @ X.T
            X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
        O = (X.T if m > n else X).float()
        v = beta2 * v + (1 - beta2) * (O**2).mean(1, keepdim=True)
        Oh = O / v.sqrt()
        U = Oh * O.norm() / Oh.norm() * max(1, m / n) ** 0.5
        W = W - lr * (U + wd * W * (U * W >= 0))
    return W


# %% [markdown]
# The exported optimiser does the same for any number of 2-D `[m, n]` or stacked 3-D `[E, m, n]`
# parameters (each expert's matrix is orthogonalised and row-normalised on its own), and for
# FSDP-2 shards (see the end of the chapter). `_gather_stack` and `_local_stack` are the only places
# where sharded tensors become whole or go back to their shards; everything else runs on plain
# tensors, this rank's rows.

# %%
#| export
def _local(t: torch.Tensor) -> torch.Tensor:
    "This rank's piece of a DTensor (the same storage: in-place changes reach the DTensor), a plain tensor as is."
    return t.to_local() if isinstance(t, DTensor) else t


def _stacked_placements(ref: DTensor) -> list:
    "`ref`'s placements for a stack `[k, *ref.shape]` of tensors laid out like it: each sharded dimension moves up one."
    for pl in ref.placements:  # FSDP-2 (and HSDP) shard matrices by rows: Shard(0) of [m, n] or of [E, m, n]
        if type(pl) not in (Shard, Replicate) or (isinstance(pl, Shard) and pl.dim >= ref.ndim - 1):
            raise NotImplementedError(f"NorMuon takes DTensor matrices sharded along a dimension other than the last "
                                      f"(Shard(d), d < {ref.ndim - 1}) or replicated, as FSDP-2 lays them out; got "
                                      f"{ref.placements}. Shard the parameter by rows, or give it to AdamW.")
    return [Shard(pl.dim + 1) if isinstance(pl, Shard) else pl for pl in ref.placements]


def _gather_stack(local: torch.Tensor, # [k, *shard shape]: this rank's pieces of k tensors laid out like `ref`
                  ref: torch.Tensor, # One of them (a DTensor, or a plain tensor: then nothing to gather)
                  shape: tuple, # The whole stack's shape: (k, ..., m, n), or (k, ..., m, 1) for row statistics
                 ) -> torch.Tensor:
    "The whole stack: one all-gather for all k (communication!) when `ref` is a DTensor."
    if not isinstance(ref, DTensor): return local
    return DTensor.from_local(local, ref.device_mesh, _stacked_placements(ref), run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride()).full_tensor()


def _local_stack(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    "This rank's rows of a whole stack `[k, *ref.shape]` (local slicing, no communication: every rank holds the same)."
    if not isinstance(ref, DTensor): return full
    return distribute_tensor(full, ref.device_mesh, _stacked_placements(ref), src_data_rank=None).to_local()


def _like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    "`full` laid out like `ref`: this rank's shard of it as a DTensor when `ref` is one (local slicing, no communication)."
    if not isinstance(ref, DTensor): return full
    return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)


class NorMuon(torch.optim.Optimizer):
    "NorMuon: Nesterov momentum, Newton–Schulz orthogonalisation, per-row second-moment normalisation, cautious weight decay."
    def __init__(self, params: Iterable, # 2-D [m, n] or stacked 3-D [E, m, n] parameters (or param groups)
                 lr: float = 0.02, # η; the update RMS is η/√n (see `muon_shape_scale`)
                 momentum: float = 0.95, # β of the momentum
                 nesterov: bool = True, # Orthogonalise the Nesterov look-ahead (1-β)G + βM instead of M
                 beta2: float = 0.95, # Decay of the per-row second moment v
                 ns_steps: int = 5, # Newton–Schulz iterations
                 weight_decay: float = 0.0, # λ: decoupled decay, x ← x − ηλx
                 cautious: bool = True, # Decay only where the update and the parameter agree in sign
                 fused: bool | None = None, # The final update as one compiled kernel per parameter (True) or as list-wide
                                            # launches (False); None: compiled on a GPU for FUSED_MIN_NUMEL entries or more
                ):
        self.fused = fused  # for every group, not a per-group option (benchmarks toggle it between steps)
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, beta2=beta2, ns_steps=ns_steps,
                                      weight_decay=weight_decay, cautious=cautious))

    def add_param_group(self, param_group: dict):
        "As `Optimizer.add_param_group` (which `__init__` calls for each group), refusing a group's values or shapes NorMuon cannot use."
        super().add_param_group(param_group)  # fills in the defaults
        g = self.param_groups[-1]
        lr, momentum, beta2, ns_steps, wd = (g[k] for k in ("lr", "momentum", "beta2", "ns_steps", "weight_decay"))
        bad = None
        try:  # `not >=` refuses NaN; None or a string where a number belongs is a TypeError
            ok = lr >= 0 and 0 <= momentum < 1 and 0 <= beta2 < 1 and wd >= 0 and isinstance(ns_steps, numbers.Integral) and not isinstance(ns_steps, bool) and ns_steps >= 1
        except TypeError: ok = False
        flags = {k: g[k] for k in ("nesterov", "cautious")}  # a YAML 'no' read as text would be true
        if not ok or not all(isinstance(v, bool) for v in flags.values()):
            bad = (f"NorMuon: need lr ≥ 0, 0 ≤ momentum < 1, 0 ≤ beta2 < 1, a whole number ns_steps ≥ 1, weight_decay ≥ 0, "
                   f"nesterov and cautious True or False; got lr={lr}, momentum={momentum}, beta2={beta2}, "
                   f"ns_steps={ns_steps}, weight_decay={wd}, " + ", ".join(f"{k}={v!r}" for k, v in flags.items()))
        elif (p := next((p for p in g["params"] if p.ndim not in (2, 3)), None)) is not None:
            bad = (f"NorMuon takes 2-D [m, n] or stacked 3-D [E, m, n] matrices; got shape {tuple(p.shape)}. "
                   "Give 1-D parameters, embeddings and convolutions to AdamW (see `param_group`).")
        if bad:
            self.param_groups.pop()
            raise ValueError(bad)

    @torch.no_grad()
    def step(self, closure=None):
        "One update of every parameter that has a gradient."
        loss = None
        if closure is not None:
            with torch.enable_grad(): loss = closure()
        for group in self.param_groups:
            # parameters of one shape (and, for FSDP-2 shards, one layout) are updated together
            for ps in _same_shape([p for p in group["params"] if p.grad is not None and p.numel()]):  # empty: nothing to do
                self._update(ps, group)
        return loss

    def load_state_dict(self, state_dict: dict):
        """As `Optimizer.load_state_dict`, which casts every state tensor to its parameter's dtype, except
        `second_moment`: it stays fp32 (in bf16 it would be rounded; with fp64 parameters, refused by `lerp`)."""
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])  # matched in order, as the base class does
        v = {p: state_dict["state"][k]["second_moment"] for k, p in zip(saved, chain.from_iterable(g["params"] for g in self.param_groups))
             if "second_moment" in state_dict["state"].get(k, {})}
        super().load_state_dict(state_dict)
        for p, s in v.items(): self.state[p]["second_moment"] = s.detach().to(device=p.device, dtype=torch.float32, copy=True)

    def _update(self, ps: list, group: dict):
        """Update parameters of one shape together: one Newton–Schulz over the stacked `[k, m, n]`
        (far fewer, larger kernels than k separate ones). FSDP-2 shards are stacked too, this rank's
        rows of each; the stack is all-gathered once, in the Newton–Schulz dtype, and this rank's rows
        of the result are sliced back. Everything else runs on this rank's rows as plain tensors."""
        lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
        if isinstance(ps[0], DTensor): _stacked_placements(ps[0])  # a layout it cannot stack is refused before any change
        for p in ps:
            if not self.state[p]:  # both in p's layout: a DTensor shard when p is one, so DCP saves them sharded
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                self.state[p]["second_moment"] = _like(torch.zeros(*p.shape[:-1], 1, device=p.device), p)  # (..., m, 1)
        xs, grads = [_local(p) for p in ps], [_local(p.grad) for p in ps]
        Ms = [_local(self.state[p]["momentum_buffer"]) for p in ps]
        vs = [_local(self.state[p]["second_moment"]) for p in ps]
        torch._foreach_lerp_(Ms, grads, 1 - beta)
        N = grads[0].new_empty(len(ps), *grads[0].shape, dtype=ns_dtype(grads[0]))  # (k, ..., m, n): this rank's rows
        for i, (g, M) in enumerate(zip(grads, Ms)):  # each look-ahead written straight into its slice, in the NS dtype
            if group["nesterov"]: torch.lerp(g, M, beta, out=N[i])
            else: N[i].copy_(M)
        k, shape = len(ps), tuple(ps[0].shape)
        O = newton_schulz(_gather_stack(N, ps[0], (k, *shape)), group["ns_steps"])
        rows = torch.stack([torch.linalg.vector_norm(g, float("inf"), -1, True).ne(0) for g in grads]).float()  # exact, any dtype
        V, R = _gather_stack(torch.cat([torch.stack(vs), rows], -1), ps[0], (k, *shape[:-1], 2)).split(1, -1)  # one gather
        f, v = normuon_row_factor(O, V, group["beta2"], muon_shape_scale(*shape[-2:]))  # U = O · f
        live = R.amax((-2, -1), keepdim=True) > 0  # (k, ..., 1, 1): a matrix (an expert) without gradient takes
        f, v = f * live, torch.where(live, v, V)   # no update from its stale momentum, and keeps its v
        O, f, v = (_local_stack(t, ps[0]) for t in (O, f, v))  # this rank's rows
        torch._foreach_copy_(vs, list(v.unbind(0)))
        fused = self.fused if self.fused is not None else xs[0].is_cuda and xs[0].numel() >= FUSED_MIN_NUMEL
        if fused:  # p ← p − η (O·f + λ d), one kernel per parameter; η and λ as tensors (a new η does not recompile),
            # the parameters as plain tensors (dynamo would fix a Parameter's sizes, and compile again for every shape)
            lr, wd = torch.full((), lr, device=xs[0].device), torch.full((), wd, device=xs[0].device)
            for i, x in enumerate(xs): normuon_apply_fused()(x.detach(), O[i], f[i], lr, wd, group["cautious"])
            return
        us = [u.to(x.dtype) for u, x in zip((O * f).unbind(0), xs)]  # U in the parameters' dtype: list-wide launches from here
        if wd and group["cautious"]: us = torch._foreach_addcmul(us, foreach_decay_mask(xs, us), xs, value=wd)  # u + λ d
        elif wd: us = torch._foreach_add(us, xs, alpha=wd)
        torch._foreach_sub_(xs, us, alpha=lr)  # p ← p − η (u + λ d)


def _same_shape(params: list) -> list[list]:
    "Group parameters by shape, dtype, device and (for DTensors) layout, in first-seen order."
    groups = {}
    for p in params:
        layout = (tuple(p.placements), p.device_mesh) if isinstance(p, DTensor) else None
        groups.setdefault((tuple(p.shape), p.dtype, p.device, layout), []).append(p)
    return list(groups.values())


# %% [markdown]
# Plain (unsharded) parameters of the same shape are updated together: their Nesterov updates are
# stacked into one `[k, m, n]` tensor and orthogonalised by one batched Newton–Schulz, which
# issues a few large kernels instead of many small ones (on the H200 this took the 750M step from
# 0.85 s to 0.68 s). Each matrix is still normalised on its own, so the result is the same as one
# matrix at a time. FSDP-2 shards are stacked the same way (end of the chapter).
#
# Around Newton–Schulz the step is memory traffic over 1.2 billion fp32 weights, so the code avoids
# passes: each Nesterov look-ahead is written by `torch.lerp(..., out=)` straight into its slice
# of the bf16 stack, the row normalisation is the one-pass form above, and the final update is
# `normuon_apply` compiled (large parameters on a GPU) or three list-wide launches,
# $u + \lambda\,\text{mask} \odot p$ by `_foreach_addcmul` and $p - \eta(\cdot)$ by `_foreach_sub_`,
# after the mask's four. `benchmarks/optim_step.py` times both optimisers alone on the 750M model
# (one H200, CUDA events around `step()`): NorMuon over its 332 matrices went from 124.6 to 101.1 ms
# with the list-wide launches (round 6), to 85–86 ms with the compiled update (round 18), and is 88.1 ms since
# round 28's zero-gradient rule. The
# batched Newton–Schulz is, by count, about 25 TFLOP of it (five iterations of three products on
# every matrix), some 50–55 ms at the 450–485 TFLOP/s these batched bf16 products reach (410–495
# in the other layouts tried, `experiments.json`); the rest is the elementwise passes and the
# launches of the small matrices.
#
# The second moment $v$ is fp32 whatever the parameters' dtype, and stays so through a checkpoint:
# `Optimizer.load_state_dict` casts every state tensor to its parameter's dtype, which would round a
# bf16 model's $v$ on resume (and hand fp64 parameters an fp64 $v$ that `lerp` then refuses), so
# NorMuon's `load_state_dict` puts the saved fp32 values back. A resumed optimiser steps exactly as
# one that never stopped (`tests/test_optim.py`, in fp32, bf16 and fp64).
#
# Five steps on one matrix agree with the from-scratch loop, for a tall and a wide matrix:

# %%
torch.manual_seed(0)
for shape in [(48, 16), (16, 40)]:
    W0 = torch.randn(shape) * 0.1
    grads = [torch.randn(shape) for _ in range(5)]
    p = nn.Parameter(W0.clone())
    opt = NorMuon([p], lr=0.02, weight_decay=0.1)
    for g in grads: p.grad = g; opt.step()
    torch.testing.assert_close(p.data, normuon_reference(W0, grads, lr=0.02))
test_fail(lambda: NorMuon([nn.Parameter(torch.ones(3))]), contains="Give 1-D parameters")

# %% [markdown]
# A stacked expert weight `[E, m, n]` is the same as E separate matrices:

# %%
torch.manual_seed(0)
W0, grads = torch.randn(3, 24, 8), [torch.randn(3, 24, 8) for _ in range(3)]
stacked, single = nn.Parameter(W0.clone()), [nn.Parameter(W0[e].clone()) for e in range(3)]
o1, o2 = NorMuon([stacked], weight_decay=0.1), NorMuon(single, weight_decay=0.1)
for g in grads:
    stacked.grad = g.clone(); o1.step()
    for e in range(3): single[e].grad = g[e].clone()
    o2.step()
torch.testing.assert_close(stacked.data, torch.stack([s.data for s in single]))

# %% [markdown]
# And an expert that stops receiving tokens stops moving, but for the decay. Without the exception
# its step would keep the live expert's size while its momentum shrinks (the norm of $M$ is printed):

# %%
torch.manual_seed(0)
experts = nn.Parameter(torch.randn(2, 64, 32) * 0.02)
opt = NorMuon([experts], weight_decay=0.1)
for t in range(30):
    g = torch.randn(2, 64, 32)
    if t >= 10: g[1] = 0  # expert 1 is dead from step 10 on
    before = experts.detach().clone()
    experts.grad = g; opt.step()
    if t in (9, 10, 29):
        moved = (experts - before).norm(dim=(1, 2))
        print(f"step {t}: |step| live {moved[0]:.4f}, dead {moved[1]:.5f}; dead |M| {opt.state[experts]['momentum_buffer'][1].norm():.3f}")
assert moved[0] > 0.1 and abs(moved[1] - 0.02 * 0.1 * before[1].norm()) < 1e-6  # a full step; the decay ηλ|W| alone


# %% [markdown]
# ## AdamW, with cautious weight decay
#
# The parameters NorMuon does not take go to AdamW. We write AdamW out (it is short) rather than
# use `torch.optim.AdamW`, so that it can apply the same cautious decay (cautious *weight decay*, Chen
# et al. 2025; not Liang et al.'s 2024 "cautious optimizers", C-AdamW, which mask the update itself
# where it disagrees in sign with the gradient): the sign of Adam's update
# $\hat m / (\sqrt{\hat v} + \epsilon)$ is the sign of its first moment $m$, so the mask is
# $\mathbf{1}[m \odot x \ge 0]$. With `cautious=False` it is plain decoupled AdamW (Loshchilov &
# Hutter), step for step the same arithmetic as PyTorch's single-tensor implementation:
# $$m \leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2, \quad
#   x \leftarrow x - \eta\Big(\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon} + \lambda d\Big).$$

# %%
#| export
class CautiousAdamW(torch.optim.Optimizer):
    "AdamW with decoupled weight decay, optionally cautious weight decay (decay only where the update and the parameter agree in sign; not C-AdamW's update mask)."
    def __init__(self, params: Iterable, # Parameters or param groups
                 lr: float = 1e-3, # η
                 betas: tuple[float, float] = (0.9, 0.95), # (β1, β2)
                 eps: float = 1e-8, # ε added to √v̂
                 weight_decay: float = 0.0, # λ: decoupled decay, x ← x − ηλx
                 cautious: bool = True, # Decay only where the update and the parameter agree in sign
                ):
        betas = tuple(betas) if isinstance(betas, (list, tuple)) else betas  # a list from YAML; anything else is refused below
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, cautious=cautious))

    def add_param_group(self, param_group: dict):
        "As `Optimizer.add_param_group` (which `__init__` calls for each group), refusing a group's values AdamW cannot use."
        if isinstance(param_group.get("betas"), list): param_group = {**param_group, "betas": tuple(param_group["betas"])}  # YAML's
        super().add_param_group(param_group)  # fills in the defaults
        g = self.param_groups[-1]
        lr, betas, eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        try:  # `not >=` refuses NaN; None or a string where a number belongs is a TypeError
            ok = lr >= 0 and eps > 0 and wd >= 0 and isinstance(betas, tuple) and len(betas) == 2 and all(0 <= b < 1 for b in betas)
        except TypeError: ok = False
        if not ok or not isinstance(g["cautious"], bool):
            self.param_groups.pop()
            raise ValueError(f"CautiousAdamW: need lr, weight_decay ≥ 0, eps > 0 (at 0 a coordinate without gradient on "
                             f"its first step becomes 0/0, NaN), two betas in [0, 1) and cautious True or False; got "
                             f"lr={lr}, betas={betas}, eps={eps}, weight_decay={wd}, cautious={g['cautious']!r}")

    @torch.no_grad()
    def step(self, closure=None):
        "One update of every parameter that has a gradient."
        loss = None
        if closure is not None:
            with torch.enable_grad(): loss = closure()
        for group in self.param_groups:
            batches = {}  # parameters updated together: same step count (t), same kind (plain or DTensor)
            for p in group["params"]:
                if p.grad is None: continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                batches.setdefault((state["step"].item(), isinstance(p, DTensor)), []).append(p)
            for (t, _), ps in batches.items(): self._update(ps, group, t)
        return loss

    def _update(self, ps: list, group: dict, t: float):
        "One AdamW step of the parameters `ps` (all at step t), each line a list-wide `_foreach` launch."
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        gs = [p.grad for p in ps]
        ms, vs = [self.state[p]["exp_avg"] for p in ps], [self.state[p]["exp_avg_sq"] for p in ps]
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        if wd and group["cautious"]:  # sign(update) = sign(m): x ← x − ηλ·mask·x
            torch._foreach_addcmul_(ps, foreach_decay_mask(ps, ms), ps, value=-lr * wd)
        elif wd: torch._foreach_mul_(ps, 1 - lr * wd)  # PyTorch's form of x − ηλx
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, math.sqrt(1 - b2**t))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - b1**t))


# %% [markdown]
# The mask uses the first moment *after* this step's update and the parameter *before* it, as the
# formula says. Checked against a from-scratch loop, and against `torch.optim.AdamW` when not
# cautious:

# %%
def adamw_reference(x, grads, lr, betas=(0.9, 0.95), eps=1e-8, wd=0.1, cautious=True):
    "From-scratch AdamW with (cautious) decoupled decay: x ← x − η(u + λ·1[u⊙x ≥ 0]⊙x)."
    x, m, v = x.clone(), torch.zeros_like(x), torch.zeros_like(x)
    for t, g in enumerate(grads, 1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        u = (m / (1 - betas[0]**t)) / ((v / (1 - betas[1]**t)).sqrt() + eps)
        x = x - lr * (u + wd * (x * (u * x >= 0) if cautious else x))
    return x


# %%
torch.manual_seed(0)
x0, grads = torch.randn(64), [torch.randn(64) for _ in range(5)]
for cautious in (True, False):
    p = nn.Parameter(x0.clone()); opt = CautiousAdamW([p], lr=0.1, weight_decay=0.1, cautious=cautious)
    for g in grads: p.grad = g; opt.step()
    torch.testing.assert_close(p.data, adamw_reference(x0, grads, lr=0.1, cautious=cautious))

p, q = nn.Parameter(x0.clone()), nn.Parameter(x0.clone())
o1 = CautiousAdamW([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, cautious=False)
o2 = torch.optim.AdamW([q], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
for g in grads:
    p.grad, q.grad = g.clone(), g.clone(); o1.step(); o2.step()
torch.testing.assert_close(p.data, q.data, rtol=0, atol=1e-7)


# %% [markdown]
# AdamW therefore keeps plain decoupled decay available (`cautious=False`, identical to
# `torch.optim.AdamW`), and HyMo's `cautious_weight_decay=True` applies the same rule in both
# optimisers, so one flag means one thing. Written out, it is still a handful of list-wide
# `_foreach` launches per step, not one small launch per tensor and operation: the 750M model has
# 238 AdamW tensors, mostly small vectors, and a per-tensor loop of some twelve operations each cost
# the host more time than the GPU spent on them: 22.9 ms per step on an H200, against 4.4 ms as
# `_foreach` launches (`benchmarks/optim_step.py`).
#
# ## Which parameter goes where
#
# Muon's argument is about matrices that map one hidden activation to another: a linear map whose
# input and output are both dense vectors, where "every singular direction gets the same step"
# makes sense. Everything else goes to AdamW:
#
# - **the embedding** (and the head, tied to it): a lookup table, not a map; each row is touched
#   only by the tokens that use it, so a per-coordinate adaptive step is right. Muon's authors also
#   found AdamW better for the input and output layers;
# - **1-D parameters**: norm gains, biases, and GDN's `A_log` and `dt_bias` (per-head decay rate and
#   time-step offset): vectors have no singular values. They get **no weight decay**: decaying a norm
#   gain or `A_log` towards zero changes what the layer computes rather than regularising it;
# - **depthwise convolution kernels** (`q_conv1d` etc., `[C, 1, K]`): each channel's $K$ taps form
#   an independent tiny filter, not a matrix mapping $C$ inputs to $C$ outputs;
# - **the MoE router** `gate.weight` `[E, d]`, by choice rather than necessity: its rows are the
#   experts' keys, ranked against each other by the top-k. Muon orthogonalises the update, not the
#   weight, so it would not flatten the keys' norms, but it would give every key a step of the same
#   size whatever its own gradient (the polar factor of a wide update has rows of one norm), tying
#   a rarely chosen expert's key to the popular ones'; AdamW leaves each key's step to its own
#   gradient's history, and the matrix is tiny. GDN's gate
#   projections `a_proj` and `b_proj` (`[H, d]`, a decay rate and a write strength per head) are
#   wide matrices too but stay with NorMuon: each head reads only its own row, through its own
#   softplus or sigmoid, so no row is ranked against another as the router's are in its top-k.
#
# Stacked expert weights `[E, out, in]` go to NorMuon, each expert's matrix on its own (shown above).
# Fused projections are orthogonalised whole, as they are one matrix in the forward: MLA's
# `kv_b_proj` (every head's $K^{\text{nope}}$ and $V$ rows) and `kv_a_proj_with_mqa` (the latent and
# the shared RoPE key). Keller Jordan's Muon splits a fused QKV into its parts; HyMo does not.
# The rules look at the name and the shape, and are written as one small function so that you can
# read them, test them, and change them in one place. An unexpected shape raises rather than falling
# through silently. The names are HyMo's (`embed`, `head`, `gate`, ...): on another model, whose embedding is
# `wte` or whose untied head is `lm_head`, they would send those matrices to NorMuon, so rename the rules first.

# %%
#| export
def param_group(name: str, # Qualified name from `model.named_parameters()`, e.g. 'layers.3.ffn.gate.weight'
                p: torch.Tensor, # The parameter (only its shape is used)
               ) -> str:
    "Which optimiser group a parameter belongs to: 'normuon', 'adamw' (with decay) or 'adamw_no_decay'."
    parts = name.split(".")
    if p.ndim < 2 or parts[-1] in ("bias", "A_log", "dt_bias") or any("norm" in c for c in parts):
        return "adamw_no_decay"  # gains, biases, GDN's per-head decay parameters
    if (any(c.startswith("embed") for c in parts) or "head" in parts or any("conv" in c for c in parts)
            or parts[-2:] == ["gate", "weight"]):
        return "adamw"  # embedding / tied head, depthwise conv kernels, the MoE router
    if p.ndim in (2, 3): return "normuon"  # hidden matrices [m, n] and stacked experts [E, m, n]
    raise ValueError(f"param_group: no rule for '{name}' with shape {tuple(p.shape)}; add one to `param_group`")


# %% [markdown]
# The rules are first shown on a small stand-in whose names follow the patterns the rules look at
# (names with `norm`, `conv` or `embed` in them, a final `gate.weight`): a GDN-style block (projections, three depthwise convolutions, `A_log`,
# `dt_bias`, an output norm, a SwiGLU FFN) and an MLA-style block with a MoE (router `gate`,
# stacked experts, a shared expert), the final norm and a head tied to the embedding. Its forward
# is a cheap imitation (not GDN, not MLA), just enough that every parameter gets a gradient.

# %%
import torch.nn.functional as F


# %%
class StandInGDN(nn.Module):
    "GDN-named mixer: q/k/v/a/b/g/o projections, causal depthwise convs, A_log, dt_bias, o_norm. Not the real recurrence."
    def __init__(self, d, H, K):
        super().__init__()
        self.H, self.K = H, K
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = (nn.Linear(d, H * K, bias=False) for _ in range(4))
        self.a_proj, self.b_proj = nn.Linear(d, H, bias=False), nn.Linear(d, H, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Conv1d(H * K, H * K, 4, groups=H * K, bias=False) for _ in range(3))
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(H)), nn.Parameter(torch.zeros(H))
        self.o_norm = RMSNorm(K)
        self.o_proj = nn.Linear(H * K, d, bias=False)

    def forward(self, x):  # (B, T, d)
        B, T, _ = x.shape
        conv = lambda c, y: F.silu(c(F.pad(y.mT, (3, 0))).mT)  # causal depthwise conv, (B, T, H*K)
        q, k, v = (conv(c, p(x)).view(B, T, self.H, self.K) for c, p in  # (B, T, H, K)
                   [(self.q_conv1d, self.q_proj), (self.k_conv1d, self.k_proj), (self.v_conv1d, self.v_proj)])
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)  # (B, T, H), log decay ≤ 0
        w = (q * k).sum(-1).sigmoid() * self.b_proj(x).sigmoid() * g.exp()  # (B, T, H)
        y = self.o_norm(v * w[..., None]).view(B, T, -1) * F.silu(self.g_proj(x))  # (B, T, H*K)
        return self.o_proj(y)


class StandInMLA(nn.Module):
    "MLA-named mixer: q_proj, kv_a_proj → kv_norm → kv_b_proj, o_proj; plain causal attention."
    def __init__(self, d, H, r):
        super().__init__()
        self.H = H
        self.q_proj, self.kv_a_proj = nn.Linear(d, d, bias=False), nn.Linear(d, r, bias=False)
        self.kv_norm, self.kv_b_proj, self.o_proj = RMSNorm(r), nn.Linear(r, 2 * d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):  # (B, T, d)
        B, T, d = x.shape
        k, v = self.kv_b_proj(self.kv_norm(self.kv_a_proj(x))).chunk(2, -1)  # (B, T, d) each
        q, k, v = (t.view(B, T, self.H, -1).transpose(1, 2) for t in (self.q_proj(x), k, v))  # (B, H, T, d/H)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d))


class StandInExperts(nn.Module):
    "E stacked SwiGLU experts: w1, w3 [E, h, d], w2 [E, d, h]."
    def __init__(self, E, d, h):
        super().__init__()
        self.w1, self.w3 = (nn.Parameter(torch.randn(E, h, d) * 0.02) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(E, d, h) * 0.02)

    def forward(self, x):  # (N, d) -> (N, E, d), every expert on every token (a stand-in: no dispatch)
        h = F.silu(torch.einsum("nd,ehd->neh", x, self.w1)) * torch.einsum("nd,ehd->neh", x, self.w3)
        return torch.einsum("neh,edh->ned", h, self.w2)


class StandInMoE(nn.Module):
    "Router `gate` [E, d], stacked routed experts, one shared SwiGLU expert; dense soft mixing."
    def __init__(self, d, E, h):
        super().__init__()
        self.gate, self.experts, self.shared = nn.Linear(d, E, bias=False), StandInExperts(E, d, h), SwiGLU(d, h)

    def forward(self, x):  # (B, T, d)
        probs = self.gate(x).float().softmax(-1)  # (B, T, E)
        y = torch.einsum("ne,ned->nd", probs.flatten(0, 1), self.experts(x.flatten(0, 1)))  # (B*T, d)
        return y.view_as(x) + self.shared(x)


class StandInBlock(nn.Module):
    def __init__(self, mixer, ffn_name, ffn, d):
        super().__init__()
        self.norm1, self.mixer, self.norm2 = RMSNorm(d), mixer, RMSNorm(d)
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)  # 'ffn' (dense SwiGLU) or 'moe' (HyMo itself calls both `ffn`)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + getattr(self, self.ffn_name)(self.norm2(x))


class StandIn(nn.Module):
    "Two blocks (GDN + SwiGLU, MLA + MoE) with names like HyMo's; head tied to the embedding."
    def __init__(self, V=256, d=64, H=4, K=16, E=4, h=96):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.layers = nn.ModuleList([StandInBlock(StandInGDN(d, H, K), "ffn", SwiGLU(d, h), d),
                                     StandInBlock(StandInMLA(d, H, 16), "moe", StandInMoE(d, E, h), d)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)  # HyMo's init_std; N(0, 1) would start with huge logits through the tied head

    def forward(self, idx):  # (B, T) -> logits (B, T, V)
        x = self.embed(idx)
        for layer in self.layers: x = layer(x)
        return self.head(self.norm(x))


# %% [markdown]
# `param_table` lists every parameter with the group the rules give it. A tied weight appears once
# (`named_parameters` removes duplicates), so the head is trained through `embed.weight`.

# %%
#| export
def param_table(model: nn.Module) -> list[tuple[str, tuple, str]]:
    "(name, shape, group) for every trainable parameter of `model`, in order."
    return [(n, tuple(p.shape), param_group(n, p)) for n, p in model.named_parameters() if p.requires_grad]


# %%
torch.manual_seed(0)
model = StandIn()
table = param_table(model)
for name, shape, group in table: print(f"{name:36s} {str(list(shape)):14s} {group}")
groups = {name: group for name, _, group in table}
test_eq(groups["embed.weight"], "adamw")
test_eq("head.weight" in groups, False)  # tied: trained as embed.weight
for n in ["layers.0.mixer.A_log", "layers.0.mixer.dt_bias", "layers.0.norm1.weight", "layers.0.mixer.o_norm.weight",
          "layers.1.mixer.kv_norm.weight", "norm.weight"]: test_eq(groups[n], "adamw_no_decay")
for n in ["layers.0.mixer.q_conv1d.weight", "layers.1.moe.gate.weight"]: test_eq(groups[n], "adamw")
for n in ["layers.0.mixer.q_proj.weight", "layers.0.mixer.g_proj.weight", "layers.0.ffn.w1.weight",
          "layers.1.moe.experts.w1", "layers.1.moe.shared.w2.weight", "layers.1.mixer.kv_b_proj.weight"]: test_eq(groups[n], "normuon")
test_eq(param_group("layers.1.moe.gate.bias", torch.zeros(4)), "adamw_no_decay")
test_eq(param_group("mtp.heads.0.proj_in.weight", torch.zeros(8, 4)), "normuon")  # 'heads' is not the output 'head'
test_fail(lambda: param_group("layers.0.odd", torch.zeros(2, 2, 2, 2)), contains="no rule")

# %% [markdown]
# HyMo's own names differ from the stand-in's (MLA's `q_a_layernorm` and `kv_a_proj_with_mqa`, the
# MoE under `ffn` with its stacked `w1`, `w2`, `w3`, the MTP heads' `proj_in` and `proj_out`), and the
# same rules sort them as intended. On `hymo_tiny` (chapter 41):

# %%
from hymo.models.model import HyMo

# %%
real = {name: group for name, _, group in param_table(HyMo(load_config("hymo_tiny").model))}
print({g: sum(1 for v in real.values() if v == g) for g in ("normuon", "adamw", "adamw_no_decay")})
for n, g in real.items():
    leaf = n.split(".")[-2] if n.endswith(".weight") else n.split(".")[-1]
    want = ("adamw_no_decay" if "norm" in n or leaf in ("A_log", "dt_bias") else
            "adamw" if leaf in ("embed", "gate") or "conv" in leaf else "normuon")
    test_eq((n, g), (n, want))
test_eq([real[n] for n in ("layers.3.ffn.w1", "layers.3.ffn.gate.weight", "layers.3.attn.kv_a_layernorm.weight",
                           "layers.3.attn.kv_a_proj_with_mqa.weight", "mtp.heads.0.proj_in.weight")],
        ["normuon", "adamw", "adamw_no_decay", "normuon", "normuon"])


# %% [markdown]
# ## Building the two optimisers
#
# `build_optimizers` sorts the parameters with `param_group` and returns `(normuon, adamw)`. AdamW
# has two param groups, `decay` and `no_decay`; every hyper-parameter comes from `TrainingConfig`.
# The trainer steps both once per optimiser step, after its accumulated micro-batches, and sets both
# learning rates from the same schedule.

# %%
#| export
def build_optimizers(model: nn.Module, # Plain or FSDP-2 sharded model
                     cfg: TrainingConfig, # Reads muon_lr, muon_momentum, normuon_beta2, ns_steps, adamw_*, weight_decay, cautious_weight_decay
                    ) -> tuple[NorMuon, CautiousAdamW]:
    "NorMuon for hidden matrices and AdamW (groups 'decay' and 'no_decay') for the rest, as `param_group` sorts them."
    cfg = validate_training(dataclasses.replace(cfg))  # `load_config`'s checks (lr · weight_decay < 1, ...) for a config changed in code
    groups = {"normuon": [], "adamw": [], "adamw_no_decay": []}
    for name, p in model.named_parameters():
        if p.requires_grad: groups[param_group(name, p)].append(p)
    if not groups["normuon"]: raise ValueError("build_optimizers: no parameter goes to NorMuon; check `param_table(model)`")
    normuon = NorMuon(groups["normuon"], lr=cfg.muon_lr, momentum=cfg.muon_momentum, beta2=cfg.normuon_beta2,
                      ns_steps=cfg.ns_steps, weight_decay=cfg.weight_decay, cautious=cfg.cautious_weight_decay)
    adamw = CautiousAdamW([dict(params=groups["adamw"], weight_decay=cfg.weight_decay, name="decay"),
                           dict(params=groups["adamw_no_decay"], weight_decay=0.0, name="no_decay")],
                          lr=cfg.adamw_lr, betas=tuple(cfg.adamw_betas), eps=cfg.adamw_eps, cautious=cfg.cautious_weight_decay)
    return normuon, adamw


# %%
tcfg = load_config("hymo_tiny").train
normuon, adamw = build_optimizers(model, tcfg)
n_of = lambda ps: sum(p.numel() for p in ps)
print(f"NorMuon: {len(normuon.param_groups[0]['params'])} tensors, {n_of(normuon.param_groups[0]['params']):,} values")
for g in adamw.param_groups: print(f"AdamW {g['name']:8s}: {len(g['params'])} tensors, {n_of(g['params']):,} values, wd={g['weight_decay']}")
test_eq(n_of(normuon.param_groups[0]["params"]) + sum(n_of(g["params"]) for g in adamw.param_groups), n_of(model.parameters()))
test_eq((normuon.defaults["lr"], adamw.defaults["lr"], adamw.param_groups[1]["weight_decay"]), (tcfg.muon_lr, tcfg.adamw_lr, 0.0))

# %% [markdown]
# A quick check that the pair trains: next-byte prediction on the bundled Shakespeare text, 60
# steps of the stand-in with NorMuon + AdamW against AdamW alone (every parameter, decay on the
# matrices, the same learning rate as HyMo's AdamW). This is a smoke test on a toy, not a
# benchmark.

# %%
from hymo.config import package_dir

# %%
#| fig-alt: "Loss by step of a stand-in model trained with NorMuon plus AdamW and with AdamW only."
data = torch.tensor(list((package_dir() / "assets" / "tinyshakespeare.txt").read_bytes()[:200_000]))

def train_standin(use_normuon, steps=60, B=8, T=64, seed=0):
    "Loss curve of the stand-in trained for `steps` steps on random windows of the text."
    torch.manual_seed(seed)
    m = StandIn()
    if use_normuon: opts = build_optimizers(m, tcfg)
    else: opts = (CautiousAdamW([dict(params=[p for n, p in m.named_parameters() if param_group(n, p) != "adamw_no_decay"]),
                                 dict(params=[p for n, p in m.named_parameters() if param_group(n, p) == "adamw_no_decay"], weight_decay=0.0)],
                                lr=tcfg.adamw_lr, weight_decay=tcfg.weight_decay),)
    g, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        i = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[j:j + T + 1] for j in i.tolist()])  # (B, T+1)
        loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        for o in opts: o.step(); o.zero_grad()
        losses.append(loss.item())
    return losses

l_mix, l_adam = train_standin(True), train_standin(False)
print(f"mean loss of the last 10 steps: NorMuon+AdamW {sum(l_mix[-10:]) / 10:.3f}, AdamW only {sum(l_adam[-10:]) / 10:.3f}")
assert sum(l_mix[-10:]) < sum(l_mix[:10])
plt.figure(figsize=(4.5, 2.8))
plt.plot(l_mix, label="NorMuon + AdamW"); plt.plot(l_adam, label="AdamW only")
plt.xlabel("step"); plt.ylabel("loss"); plt.legend(); plt.tight_layout(); plt.show()


# %% [markdown]
# On this toy, with each optimiser at HyMo's learning rate, the pair ends lower than AdamW alone
# (the numbers are printed above). One seed on a 160k-parameter model says little about scale;
# the Muon and NorMuon papers make that case with proper sweeps.
#
# ## The warmup-stable-decay schedule
#
# Both optimisers multiply their peak learning rate by one schedule. With $W$ = `warmup_steps`,
# $N$ = `max_steps`, $D = \mathrm{round}(f N)$ decay steps ($f$ = `decay_fraction`; Python's `round`,
# which takes a tie to the even number: $f = 0.25$, $N = 10$ give $D = 2$; at least one
# when $f > 0$, so that a short run asked to decay does, `TrainingConfig.decay_steps`), decay start
# $S = N - D$, and $r$ = `min_lr_ratio`:
# $$\mathrm{mult}(t) = \begin{cases}
#   (t+1)/W & t < W \\
#   1 & W \le t < S \\
#   r + (1 - r)\, \psi\big((t - S + 1)/(D + 1)\big) & S \le t
# \end{cases}
# \qquad \psi(p) = 1 - p,\;\; 1 - \sqrt{p},\;\; \tfrac12(1 + \cos \pi p)$$
# for the `linear`, `1-sqrt` and `cosine` shapes; $p$ is clipped to 1 past the end. Steps are
# 0-based and the warmup starts at $1/W$ rather than 0, so no step is wasted. The decay runs from
# the last stable step $S - 1$ (multiplier 1) to step $N$, one past the last trained step, where it
# reaches $r$; the $D$ decay steps $S \dots N-1$ take the $D$ points in between. So every decay step
# decays, even in a run whose decay is one step long, and no step trains at exactly $r$, which at
# the default $r = 0$ would be a step that changes nothing.

# %%
#| export
def wsd_schedule(step: int, # Optimiser step, 0-based
                 cfg: TrainingConfig, # Reads warmup_steps, max_steps, decay_fraction, decay_shape, min_lr_ratio
                ) -> float:
    "Learning-rate multiplier at `step`: linear warmup, constant, then a decay to `min_lr_ratio` over the last `decay_fraction` of `max_steps`."
    if cfg.decay_shape not in DECAY_SHAPES:  # refused at any step, not first at the decay's
        raise ValueError(f"decay_shape={cfg.decay_shape!r}: choose one of {', '.join(map(repr, DECAY_SHAPES))}")
    for name in ("decay_fraction", "min_lr_ratio"):  # (`load_config` refuses these too; a config changed in code is not checked)
        if not 0 <= getattr(cfg, name) <= 1: raise ValueError(f"{name}={getattr(cfg, name)} must be in [0, 1]")
    W, N = cfg.warmup_steps, cfg.max_steps
    D = cfg.decay_steps
    S = N - D  # first step of the decay
    if W > S:
        raise ValueError(f"warmup_steps={W} runs into the decay, which starts at step {S} = max_steps − {D} decay steps; "
                         "lower warmup_steps or decay_fraction")
    if step < W: return (step + 1) / W
    if step < S or D == 0: return 1.0
    p = min(1.0, (step - S + 1) / (D + 1))  # step S - 1 is the last at 1, step N the first at r
    shapes = {"linear": 1 - p, "1-sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}  # DECAY_SHAPES
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shapes[cfg.decay_shape]


def wsd_lambda(cfg: TrainingConfig, # The run's training config
              ):
    "`step -> multiplier` for `torch.optim.lr_scheduler.LambdaLR`."
    return lambda step: wsd_schedule(step, cfg)


# %% [markdown]
# A 300-step schedule (30 warmup, the last 30 % decaying, as in the tiny preset), with each shape, and on the
# right the reason WSD suits continued training: one long stable run, and a short decay branched
# off any of its checkpoints gives a finished model for that budget.

# %%
#| fig-alt: "Left: hymo_tiny's WSD learning-rate multiplier over 300 steps with the linear, 1-sqrt and cosine decay shapes. Right: a stable 1000-step run with 100-step decays branched off at steps 300, 600 and 900."
tcfg = dataclasses.replace(load_config("hymo_tiny").train, max_steps=300, warmup_steps=30)
steps = range(tcfg.max_steps + 1)
fig, ax = plt.subplots(1, 2, figsize=(9, 2.8))
for shape in ("linear", "1-sqrt", "cosine"):
    c = dataclasses.replace(tcfg, decay_shape=shape)
    ax[0].plot(steps, [wsd_schedule(t, c) for t in steps], label=shape)
ax[0].set(xlabel="step", ylabel="lr multiplier", title="hymo_tiny: WSD"); ax[0].legend(fontsize=8)
long = dataclasses.replace(tcfg, max_steps=1000, decay_fraction=0.0)
ax[1].plot(range(1000), [wsd_schedule(t, long) for t in range(1000)], "k", lw=1, label="stable run")
for s in (300, 600, 900):  # branch a 100-step decay off the checkpoint at step s
    b = dataclasses.replace(tcfg, max_steps=s + 100, decay_fraction=100 / (s + 100))
    ax[1].plot(range(s, s + 101), [wsd_schedule(t, b) for t in range(s, s + 101)])
ax[1].set(xlabel="step", title="decays branched from checkpoints"); ax[1].legend(fontsize=8)
plt.tight_layout(); plt.show()

# %% [markdown]
# Values at chosen steps, computed by hand from the formula ($W = 30$, $N = 300$, $D = 90$, $S = 210$,
# so $p = (t - 209)/91$):

# %%
test_close(wsd_schedule(0, tcfg), 1 / 30)
test_close(wsd_schedule(29, tcfg), 1.0)
test_eq(wsd_schedule(100, tcfg), 1.0)
test_eq(wsd_schedule(209, tcfg), 1.0)  # the last stable step
test_close(wsd_schedule(210, tcfg), 1 - math.sqrt(1 / 91))  # the first decay step already decays; 1-sqrt is the default
test_close(wsd_schedule(255, tcfg), 1 - math.sqrt(46 / 91))
test_close(wsd_schedule(255, dataclasses.replace(tcfg, decay_shape="cosine")), 0.5 * (1 + math.cos(math.pi * 46 / 91)))
test_close(wsd_schedule(255, dataclasses.replace(tcfg, decay_shape="linear", min_lr_ratio=0.1)), 0.1 + 0.9 * 45 / 91)
test_close(wsd_schedule(299, dataclasses.replace(tcfg, decay_shape="linear")), 1 / 91)  # the last trained step
test_eq(wsd_schedule(300, tcfg), 0.0)
short = dataclasses.replace(tcfg, max_steps=4, warmup_steps=1, decay_fraction=0.2, decay_shape="linear")  # D = 1
test_eq([wsd_schedule(t, short) for t in range(5)], [1.0, 1.0, 1.0, 0.5, 0.0])  # a one-step decay decays
tiny_decay = dataclasses.replace(short, decay_fraction=0.1, min_lr_ratio=0.5)  # 0.1 × 4 rounds to 0: one decay step all the same
test_eq([wsd_schedule(t, tiny_decay) for t in range(5)], [1.0, 1.0, 1.0, 0.75, 0.5])
test_eq([wsd_schedule(t, dataclasses.replace(short, decay_fraction=0.0)) for t in range(5)], [1.0] * 5)  # 0: no decay, on purpose
test_fail(lambda: wsd_schedule(0, dataclasses.replace(tcfg, warmup_steps=250)), contains="lower warmup_steps")

opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
sched = torch.optim.lr_scheduler.LambdaLR(opt, wsd_lambda(tcfg))
for _ in range(255): opt.step(); sched.step()
test_close(opt.param_groups[0]["lr"], 0.5 * wsd_schedule(255, tcfg))

# %% [markdown]
# Why WSD rather than cosine: a cosine schedule fixes the run length before the first step, and
# every intermediate checkpoint sits at a learning rate that is neither high nor annealed, so it is
# neither a good model nor a good starting point. Under WSD the stable phase is the same whatever
# the final budget: you can extend a run, resume it from any stable checkpoint without re-warming,
# or branch short decays (10–20 % of the steps; the `1-sqrt` shape does well there, Hägele et al.
# 2024) off several checkpoints to get a family of finished models, or a scaling-law sweep, from
# one run. WSD was named and popularised by MiniCPM (Hu et al., 2024); a schedule with no fixed end
# and a final cooldown had been used before, e.g. in Zhai et al.'s 2022 scaling of vision
# transformers (a reciprocal square root, then a linear cooldown).
#
# ## FSDP-2: orthogonalising sharded matrices
#
# Under FSDP-2 (`torch.distributed.fsdp.fully_shard`) every parameter is a `DTensor` whose rank-local
# piece is a slice along dimension 0 (`Shard(0)`), and so are its gradient and every optimiser state
# created with `zeros_like`. AdamW is elementwise, so it runs on the shards as they are. Newton–Schulz
# is not: $XX^\top$ needs the whole matrix. `NorMuon` works on this rank's rows as plain tensors
# (`to_local()`, which shares the DTensor's storage, so in-place updates reach it) and gathers on
# purpose, once per group of same-shaped matrices, in exactly two places:
#
# 1. `_gather_stack(N)`: the stack of this rank's rows of the $k$ Nesterov updates, `[k, m/R, n]`
#    in the iteration's dtype, becomes a DTensor sharded along its second dimension and is
#    all-gathered into `[k, m, n]` in one collective: bf16 on a GPU (gathering in fp32 would double
#    the traffic for nothing; on a CPU both are fp32, which keeps one- and two-process CPU runs
#    equal). Every rank then orthogonalises all $k$ whole matrices in one batched Newton–Schulz;
# 2. `_gather_stack(second moments)`: the $m$ row statistics of each (the rescale needs the whole
#    matrix's norm).
#
# Then `_local_stack` takes this rank's rows back with `distribute_tensor(..., src_data_rank=None)`,
# which slices locally (no communication: every rank holds the same full result). The momentum and
# the second moment stay DTensors laid out like the parameter, so a distributed checkpoint (DCP)
# saves them sharded and reloads them on any number of ranks.
#
# The first version took one matrix at a time and ran every elementwise step on the DTensors. Each
# DTensor operation costs the host tens of microseconds to dispatch, and there are some 330
# matrices: on one H200, through FSDP on a group of one GPU, NorMuon's step took 907 ms of host
# time, with the GPU waiting on it, against about 100 ms for the same step on plain tensors, and it
# issued two all-gathers per matrix (update and row statistics) instead of two per shape. Stacked,
# the same step took 114 ms, and the 750M step through FSDP 6.70 s instead of 7.50 s (results chapter).
#
# **Cost.** Per matrix $[m, n]$ and step, each of $R$ ranks receives $2mn(R-1)/R$ bytes (bf16), the
# same volume as FSDP's own forward all-gather of that weight, and computes the full
# Newton–Schulz, $5\,(4k^2 l + 2k^3)$ FLOPs with $k = \min(m,n)$, $l = \max(m,n)$, redundantly on
# every rank. It also holds each shape group whole while it works on it, as a single GPU does: for
# `hymo_750m` the largest group is the 16 expert matrices `[16, 2304, 896]` (w1 and w3 of 8
# layers), 528 M entries: about 1 GB in bf16 gathered, and Newton–Schulz's iterates of that size,
# briefly, after the step's activations are freed. The fp32 update $O \cdot f$ is formed only for
# this rank's rows ($2/R$ GB). The gathered part does not shrink with more ranks; a much larger
# model would split its groups into smaller stacks.

# %%
ns_flops = lambda m, n, steps=5: steps * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3)
for name, (m, n) in {"ffn.w1 2560×896": (2560, 896), "expert w1 2304×896": (2304, 896), "GDN q_proj 1280×896": (1280, 896)}.items():
    print(f"{name:22s} all-gather {2 * m * n / 2**20:5.1f} MiB (bf16), Newton–Schulz {ns_flops(m, n) / 1e9:5.1f} GFLOP per rank per step")
test_eq(ns_flops(4, 2, steps=1), 4 * 4 * 4 + 2 * 8)

# %% [markdown]
# Over all of the 750M model's matrices that is some 25 TFLOP per step. On one GPU it is about 1 % of
# the forward and backward (4.42 GFLOP per token × 524 288 tokens ≈ 2.3 PFLOP); on 8 GPUs each rank
# does all 25 TFLOP against its 290 TFLOP share of the model's work, some 9 %, because it does not
# shrink as ranks are added: the Newton–Schulz work is repeated $R$ times. The scalable alternative is
# **owner-compute**: assign each matrix to one rank (round-robin, balanced by size); the owner
# gathers only its matrices' updates, orthogonalises them, and sends each rank its shard back (a
# gather and a scatter per matrix, or one all-to-all for all of them). Each rank then receives about
# $2P/R$ values instead of $P(R-1)/R$, with $P$ the NorMuon parameter count, and does $1/R$ of the
# Newton–Schulz work. modded-nanogpt, Dion and the NorMuon paper's FSDP2 implementation do variants of this;
# Moonshot's Distributed Muon (*Muon is Scalable*) gathers the whole matrix on every rank, as HyMo
# does. HyMo keeps the simple all-gather because it is easy to check and its cost is modest at 8 GPUs.
#
# The check: two CPU processes (gloo), a model with uneven shards (9 rows over 2 ranks, 3 experts
# over 2 ranks), five NorMuon steps sharded and unsharded from the same initial weights and batches.
# From the third step one expert, and all of rank 1's rows of another matrix, have no gradient: the
# expert must be left alone, the matrix not (whether a matrix has a gradient is decided over all its rows).
# The script is written to a file and run in a subprocess because spawned workers must be importable.

# %%
FSDP_CHECK = r'''
import socket, sys, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from hymo.training.optim import NorMuon

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 9, bias=False)                      # [9, 6]: rows split 5 + 4
        self.experts = nn.Parameter(torch.randn(3, 5, 9) * 0.3)    # [E, 5, 9]: experts split 2 + 1
        self.down = nn.Linear(5, 4, bias=False)                    # [4, 5]
        self.register_buffer("rows", torch.ones(9))                # 0 in a row of `up`: no gradient there
        self.register_buffer("used", torch.ones(3, 1, 1))          # 0 for an expert: no gradient for it
    def forward(self, x):                                          # (B, 6) -> (B, 4)
        h = torch.tanh(self.up(x) * self.rows)                     # (B, 9)
        h = torch.tanh(torch.einsum("bi,eoi->bo", h, self.experts * self.used))  # (B, 5)
        return self.down(h)

def train(model, steps=5):
    opt, g = NorMuon(model.parameters(), lr=0.05, weight_decay=0.1), torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == 2:  # from here on rank 1's rows of `up` and its expert have no gradient: the expert is left
            model.rows[5:] = 0; model.used[2] = 0  # alone, `up` is not (its other rows have one)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)  # same batch on every rank
        (model(x) - y).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
    return opt

def worker(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0); ref = Net()
    torch.manual_seed(0); net = fully_shard(Net())
    train(ref); opt = train(net)
    diff = max((p.full_tensor() - r).abs().max().item() for p, r in zip(net.parameters(), ref.parameters()))
    sharded = all(isinstance(s, DTensor) and s.placements == p.placements for p in net.parameters() for s in opt.state[p].values())
    if rank == 0: print(f"max |FSDP − single| = {diff:.2e}; states sharded like their parameters: {sharded}")
    dist.barrier()  # leave together before tearing the process group down
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
'''

# %%
import re, subprocess, sys, tempfile
from pathlib import Path

# %%
with tempfile.TemporaryDirectory() as d:
    (Path(d) / "fsdp_check.py").write_text(FSDP_CHECK)
    out = subprocess.run([sys.executable, "fsdp_check.py"], cwd=d, capture_output=True, text=True, timeout=300)
print(out.stdout.strip() or out.stderr[-2000:])
assert float(re.search(r"= ([0-9.e+-]+);", out.stdout).group(1)) <= 1e-6 and "sharded like their parameters: True" in out.stdout

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why orthogonalise the update, and why Newton–Schulz rather than an SVD?
# The momentum of a weight matrix is dominated by a few singular directions, so an SGD step
# mostly moves the weights along those. Replacing $M = U\Sigma V^\top$ by $UV^\top$ gives every
# direction the gradient touches the same step: it is steepest descent under the spectral norm.
# An SVD is slow and fp32-only on GPUs; five iterations of an odd quintic polynomial,
# $X \leftarrow aX + b(XX^\top)X + c(XX^\top)^2X$, need only matrix products, run in bf16 on tensor
# cores, and bring every singular value above about 1 % of the Frobenius norm into $[0.68, 1.14]$,
# which is exact enough for an optimiser.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What does NorMuon add to Muon, and why rescale afterwards?
# A per-output-neuron second moment: an EMA ($\beta_2 = 0.95$) of each row's mean square of the
# orthogonalised update, and each row divided by its root. Muon equalises singular directions but
# not neurons: a tall matrix's polar factor shares its norm unevenly among rows, and Newton–Schulz
# adds unevenness, so some neurons get much larger steps. Dividing by $\sqrt{v}$ evens them out,
# as Adam does per coordinate, at the cost of one float per row. The rescale back to the Frobenius
# norm of $O$ keeps the update size (and thus the learning rate and shape scaling) of Muon, and
# makes a bias correction of $v$ unnecessary while a matrix's rows start together. (The paper instead sets the update's RMS to
# $0.2\,\eta$, to reuse AdamW's learning rates; HyMo keeps Muon's.)
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How does Muon's learning rate of 0.02 compare with AdamW's 3e-3?
# With the $\sqrt{\max(1, m/n)}$ shape factor the update's entries have RMS $1/\sqrt{n}$ ($n$ the
# fan-in), so the per-entry step is $0.02/\sqrt{896} \approx 6.7 \times 10^{-4}$ for the residual
# width. AdamW's update RMS is typically about 0.2, so its per-entry step is
# $0.2 \times 3 \times 10^{-3} = 6 \times 10^{-4}$: the same speed. Equivalently, Muon's rate in AdamW
# units is $\eta/(0.2\sqrt{n})$. Moonshot's alternative scales the update to RMS 0.2 directly
# ($0.2\sqrt{\max(m,n)}$) so that AdamW's learning rate can be reused. One thing does not carry
# over: the single `weight_decay` $\lambda = 0.1$ is applied as $\eta\lambda$ by both, so the
# matrices shrink by $2 \times 10^{-3}$ a step and AdamW's parameters by $3 \times 10^{-4}$, while
# their entries move at about the same speed: relative to its updates, NorMuon's decay is some
# $6.7\times$ AdamW's (with Moonshot's RMS matching one $\lambda$ would mean the same in both).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Which parameters does HyMo keep off Muon, and why?
# The embedding and the (tied) output head. The embedding's inputs are one-hot: a row moves only
# when its token appears, and a per-coordinate adaptive step suits such sparse, rare-row gradients
# better than a spectral one. The output head's gradient is dense (the softmax reaches every row),
# but it too trains better on AdamW in practice (the Muon write-up and Moonlight keep it there);
# HyMo ties the two, so the one matrix goes to AdamW. 1-D parameters
# (norm gains, biases, `A_log`, `dt_bias`): a vector has no singular directions; they also get no
# weight decay, since shrinking them changes what the layer computes. Depthwise convolution
# kernels: each channel's taps are an independent filter, not a linear map between hidden spaces.
# The MoE router, by choice: its rows are ranked against each other in the top-k, and Muon would
# give every row's update the same size whatever its own gradient; AdamW leaves each expert's key to
# its own gradient's history, and the matrix is tiny. Stacked expert weights do go to Muon, one
# matrix per expert.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What is cautious weight decay, and why does it help?
# Decoupled decay subtracts $\eta\lambda x$ from every weight. Where the update is growing a weight
# that the loss wants large, decay and update fight, and the equilibrium weight is biased towards
# zero. Cautious decay applies $\lambda x$ only where $u \odot x \ge 0$, i.e. where the update already
# moves the weight towards zero, so it regularises without opposing the gradient. It costs one
# comparison per entry and no state. For Adam the sign of the update is the sign of the first
# moment, so the mask is $\mathbf{1}[m \odot x \ge 0]$.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why does Muon need extra communication under FSDP, and how would you remove most of it?
# FSDP shards each matrix by rows across ranks, but $XX^\top$ needs the whole matrix, so each rank
# all-gathers the update (in bf16: the size of one forward all-gather of the weights), runs
# Newton–Schulz on the whole matrix, and keeps its rows. The compute is repeated on every rank. With
# owner-compute, each matrix is assigned to one rank, which alone gathers, orthogonalises and
# scatters shards back: about $2P/R$ values received per rank instead of $P(R-1)/R$, and $1/R$ of the
# Newton–Schulz FLOPs.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why warmup-stable-decay instead of cosine?
# Cosine ties the schedule to a run length fixed in advance, and its intermediate checkpoints are
# half-annealed. WSD's stable phase does not depend on the final budget, so a run can be extended
# or resumed from any stable checkpoint, and a short decay (10–20 % of the steps, `1-sqrt` shape)
# branched off any checkpoint gives a finished model for that budget, which also makes scaling-law
# sweeps cheap. The warmup protects the early steps, when Adam's second moments are still
# inaccurate and the loss surface is sharp.
# :::
