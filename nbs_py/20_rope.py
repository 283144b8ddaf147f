# %% [markdown]
# # Rotary position embeddings
#
# > RoPE from plane rotations, why it only sees relative positions, why it will not go inside a compressed latent, and the decoupled (partial) RoPE that MLA uses instead.

# %%
#| default_exp models.rope

# %% [markdown]
# Attention by itself is blind to order: permute the keys and values together and each query gets
# the same answer. Rotary position embeddings (RoPE; Su et al. 2021, *RoFormer*) put position back
# by *rotating* queries and keys by an angle proportional to their position. The dot product of two
# rotated vectors depends only on the difference of the angles, so attention scores see relative
# position, with no learned table and no length limit built into the weights.
#
# This chapter derives RoPE from 2-D rotations, checks the relative-position property numerically,
# then shows the one place where RoPE gets in the way: Multi-Head Latent Attention (next chapter)
# wants to fold the key up-projection into the query, and a rotation in between forbids it. The fix
# is *decoupled* RoPE: rotate only a small slice of each head, and give that slice its own key.

# %%
#| export
from __future__ import annotations

import torch

# %%
import math
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_close, test_fail

# %%
torch.manual_seed(0);  # the checks below draw random vectors


# %% [markdown]
# ## One pair of dimensions is one rotation
#
# Take a 2-vector $x = (x_0, x_1)$ at position $m$ and rotate it by the angle $m\theta$:
# $$R(m\theta)\,x = \begin{pmatrix}\cos m\theta & -\sin m\theta\\ \sin m\theta & \cos m\theta\end{pmatrix}
# \begin{pmatrix}x_0\\x_1\end{pmatrix}.$$
# Rotations compose by adding angles and their transpose is their inverse, so for a query $q$ at
# position $m$ and a key $k$ at position $n$
# $$\big(R(m\theta) q\big)^\top \big(R(n\theta) k\big) = q^\top R(m\theta)^\top R(n\theta)\, k = q^\top R\big((n-m)\theta\big)\, k .$$
# The score depends on $n - m$ only. A rotation turns a plane, so a $d$-dimensional head is cut into
# $d/2$ pairs of dimensions. If every pair turned at the same frequency $\theta$, the score would be
# periodic in the distance, with period $2\pi/\theta$ tokens, so distant positions would alias onto near ones; so pair $i$ turns at its own frequency
# $$\theta_i = \text{theta}^{-2i/d}, \qquad i = 0, \dots, d/2 - 1,$$
# from one radian per token ($i = 0$) down to $\text{theta}^{-(d-2)/d}$, just above
# $1/\text{theta}$ ($1.8 \times 10^{-4}$ radians per token at $d = 32$ and theta $= 10^4$). The full
# rotation $R_m$ is block-diagonal with the $2\times2$ blocks $R(m\theta_i)$.
#
# First the naive reference: build $R_m$ as a matrix.

# %%
def rope_matrix(m: int, # Position
                d: int, # Rotated width (even)
                theta: float = 10000.0, # Base
               ) -> torch.Tensor: # [d, d] block-diagonal rotation R_m
    "The RoPE rotation at position `m` as an explicit matrix (pairs `(2i, 2i+1)`)."
    R = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        a = m * theta ** (-2 * i / d)
        R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
    return R


# %%
d = 8
q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
score = lambda m, n: (rope_matrix(m, d) @ q) @ (rope_matrix(n, d) @ k)
test_close(score(3, 7), score(103, 107), eps=1e-10)   # same distance, same score
test_close(score(3, 7), q @ rope_matrix(4, d) @ k, eps=1e-10)  # = q^T R_{n-m} k
assert abs(score(3, 7) - score(3, 8)) > 1e-3          # a different distance changes it
test_close(torch.linalg.norm(rope_matrix(5, d) @ q), torch.linalg.norm(q), eps=1e-10)  # lengths are kept


# %% [markdown]
# ## The fast form
#
# Nobody multiplies by a $d \times d$ matrix that is almost all zeros. Pair $i$ of $x$, $(x_{2i}, x_{2i+1})$, becomes
# $$(x_{2i}\cos m\theta_i - x_{2i+1}\sin m\theta_i,\;\; x_{2i}\sin m\theta_i + x_{2i+1}\cos m\theta_i),$$
# which needs only the tables $\cos m\theta_i$ and $\sin m\theta_i$, one row per position. HyMo
# pairs *adjacent* dimensions $(2i, 2i+1)$, as DeepSeek-V3's reference code does (it views the pairs
# as complex numbers, and so does Meta's Llama code); GPT-NeoX's `rotate_half`, which Hugging Face
# uses (its Llama port included, whose conversion permutes the query and key weights to match), pairs
# $i$ with $i + d/2$ instead. The two are the same
# up to a fixed permutation of the rotated dimensions, so they are equally good, but a checkpoint
# must be read with the convention it was trained with.
#
# The tables are computed from the positions on the fly, in fp32: $d/2$ cosines per token is
# nothing next to attention, there is no buffer to keep in step with `max_seq_len`, and a module
# built on the meta device needs no re-initialisation for them. `positions` may be any integer
# tensor: `arange(T)` for a fresh sequence, `offset + arange(T)` when decoding after `offset`
# cached tokens, or per-document positions for packed sequences (below).

# %%
#| exports
def rope_inv_freq(dim: int, # Rotated width d (even)
                  theta: float = 10000.0, # Base of the frequencies
                  device=None) -> torch.Tensor: # [d/2] fp32: theta^(-2i/d)
    "The angular frequency θ_i of every rotated pair, in radians per token."
    if dim % 2 or dim <= 0: raise ValueError(f"RoPE rotates pairs of dimensions: dim={dim} must be even and positive")
    return theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def rope_cos_sin(positions: torch.Tensor, # Integer positions [T] or [B, T]
                 dim: int, # Rotated width d (even)
                 theta: float = 10000.0, # Base of the frequencies
                ) -> tuple[torch.Tensor, torch.Tensor]: # cos, sin: [T, d/2] or [B, T, d/2], fp32
    "cos(m θ_i) and sin(m θ_i) for every position m in `positions` and every pair i."
    if positions.is_complex() or (positions.is_floating_point() and positions.device.type == "cpu"  # (a GPU's: unread)
                                  and bool((positions != positions.round()).any())):  # 0.5 is no token's place
        raise TypeError(f"rope_cos_sin: positions must be whole numbers (e.g. torch.arange(T)), got {positions.dtype} "
                        f"{positions.flatten()[:4].tolist()}")
    angles = positions.float()[..., None] * rope_inv_freq(dim, theta, positions.device)  # (..., T, d/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, # Vectors to rotate [B, T, H, d]; H may be 1 (a key shared by all heads)
               cos: torch.Tensor, # [T, d/2] or [B, T, d/2] from `rope_cos_sin`
               sin: torch.Tensor, # Same shape as `cos`
              ) -> torch.Tensor: # [B, T, H, d], dtype of `x`
    "Rotate every adjacent pair `(x[2i], x[2i+1])` of `x` by the angle of its position; computed in fp32 (fp64 in fp64)."
    if x.dim() != 4:  # [B, T, d] would be read as [T, H, d]: rotated by the batch index
        raise ValueError(f"apply_rope: x must be [B, T, H, d] (H = 1 for a key shared by all heads); got {tuple(x.shape)}")
    if x.shape[-1] != 2 * cos.shape[-1]:
        raise ValueError(f"apply_rope: x has {x.shape[-1]} dims but the tables rotate {2 * cos.shape[-1]}; "
                         "pass only the rotated slice of x, and tables made with dim = that slice's width")
    if cos.shape[-2] != x.shape[-3]:  # a table of one position would broadcast over all T: every token at one angle
        raise ValueError(f"apply_rope: x has {x.shape[-3]} positions but the tables {cos.shape[-2]}; give one position per token")
    if sin.shape != cos.shape or cos.dim() not in (2, 3) or (cos.dim() == 3 and cos.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"apply_rope: cos and sin must both be [T, d/2], or [B, T, d/2] with B = {x.shape[0]} (or 1); "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}: make them together with rope_cos_sin")
    ct = torch.promote_types(x.dtype, torch.float32)  # bf16 and fp16 are rotated in fp32; fp64 is not rounded to it
    x0, x1 = x.to(ct).unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, d/2) each
    cos, sin = cos[..., None, :], sin[..., None, :]  # (.., T, 1, d/2): one angle for all heads
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).to(x.dtype)  # (B, T, H, d)


# %% [markdown]
# The fast form agrees with the matrix, position by position:

# %%
T, H, d = 6, 3, 8
x = torch.randn(2, T, H, d)
cos, sin = rope_cos_sin(torch.arange(T), d)
y = apply_rope(x, cos, sin)
y_ref = torch.stack([x[:, m].double() @ rope_matrix(m, d).T for m in range(T)], 1)  # (B, T, H, d)
torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=0)
test_eq(cos.shape, (T, d // 2))
test_fail(lambda: apply_rope(torch.randn(1, T, H, 10), cos, sin), contains="only the rotated slice")
test_fail(lambda: apply_rope(x, *rope_cos_sin(torch.tensor([5]), d)), contains="one position per token")  # not broadcast
test_fail(lambda: rope_inv_freq(7), contains="must be even")
test_close(rope_inv_freq(32)[-1].item(), 10000 ** (-30 / 32), eps=1e-9)  # the slowest pair: 1.8e-4 rad per token


# %% [markdown]
# The `rotate_half` convention is the same rotation with the dimensions listed in another
# order: put the even dimensions first and the odd ones after, rotate pair $i$ as
# $(x_i, x_{i + d/2})$, and undo the reordering.

# %%
def apply_rope_rotate_half(x, cos, sin):  # GPT-NeoX / Hugging Face convention: pair i is (x[i], x[i + d/2])
    x1, x2 = x.chunk(2, -1)
    cos, sin = (torch.cat((t, t), -1)[..., None, :] for t in (cos, sin))  # (T, 1, d): the same angle on both halves
    return x * cos + torch.cat((-x2, x1), -1) * sin

perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))  # evens first, then odds
torch.testing.assert_close(apply_rope_rotate_half(x[..., perm], cos, sin)[..., perm.argsort()], y, atol=1e-6, rtol=0)
assert (apply_rope_rotate_half(x, cos, sin) - y).abs().max() > 0.1  # without the reordering they differ

# %% [markdown]
# And the relative-position property holds for the fast form: shift both sequences by the same
# offset and every score $q_m^\top k_n$ stays put (to fp32 rounding), which is exactly what makes
# decoding at an offset correct.

# %%
T, d = 16, 32
q, k = torch.randn(1, T, 1, d), torch.randn(1, T, 1, d)
def scores(offset):
    cos, sin = rope_cos_sin(offset + torch.arange(T), d)
    qr, kr = apply_rope(q, cos, sin)[0, :, 0], apply_rope(k, cos, sin)[0, :, 0]  # (T, d)
    return qr @ kr.T  # (T, T): entry (m, n) is q_m . k_n
torch.testing.assert_close(scores(0), scores(1000), atol=1e-3, rtol=1e-4)
assert (scores(0) - (q[0, :, 0] @ k[0, :, 0].T)).abs().max() > 0.1  # and the rotation did change the scores

# %% [markdown]
# The tolerance is looser than machine epsilon for a reason worth knowing: at position 1000 the
# angles reach 1000 radians, where neighbouring fp32 numbers are $6 \cdot 10^{-5}$ apart, and the
# rounded $\theta_i$ and $m\theta_i$ put errors of a few $10^{-5}$ radians in the angles (up to $3.2 \cdot 10^{-5}$
# against fp64 at positions 1000 to 1015).
# Angles grow with position, so very long contexts compute them in fp32 at least (never bf16: at
# position 4 095 bf16 angles are off by radians). `rope_cos_sin`'s fp32 angles are off by up to $1.4 \cdot 10^{-4}$
# rad at position 4 095 and $2.3 \cdot 10^{-3}$ at 65 535; a model trained much longer than HyMo's 4 096 would
# compute $m\theta_i$ in fp64 and round only the cosines to fp32.
#
# With $q = k = \mathbf{1}$ the score as a function of the distance $n - m$ is
# $\sum_i 2\cos((n-m)\theta_i)$: it starts high and oscillates down, going negative at some
# distances (RoFormer §3.4.3 proves that an upper bound on such scores decays with distance). The fast pairs average out after a few tokens; only the
# slow ones keep distant tokens distinguishable.

# %%
#| fig-alt: "The RoPE score divided by d, for q = k = 1, against the distance between tokens on a symlog axis, for d = 32 and d = 128: it oscillates and decays with distance."
dist = torch.arange(0, 4096)
for d_ in (32, 128):
    cos_, _ = rope_cos_sin(dist, d_)
    plt.plot(dist, 2 * cos_.sum(-1) / d_, lw=0.7, label=f"d = {d_}")
plt.xscale("symlog", linthresh=10); plt.xlabel("distance n - m (tokens)"); plt.ylabel("score / d, q = k = 1")
plt.legend(); plt.gcf().set_size_inches(6, 2.8); plt.tight_layout(); plt.show()

# %% [markdown]
# ## Why RoPE will not go inside a compressed latent
#
# Multi-Head Latent Attention caches one small latent $c_s \in \mathbb{R}^{d_c}$ per token instead of
# every head's key and value, and up-projects it: $k_s = W^{UK} c_s$. Without RoPE, a score is
# $$q_t^\top k_s = (W^Q x_t)^\top W^{UK} c_s = x_t^\top \underbrace{W^{Q\top} W^{UK}}_{\text{fixed}} c_s ,$$
# so at inference $W^{UK}$ can be *absorbed* into the query side: compute $\tilde q_t = W^{UK\top} q_t
# \in \mathbb{R}^{d_c}$ once per query and dot it with the cached latents directly, never
# materialising a key. With RoPE on the whole head,
# $$(R_t W^Q x_t)^\top (R_s W^{UK} c_s) = x_t^\top W^{Q\top} R_{s-t} W^{UK} c_s ,$$
# and the matrix in the middle changes with the distance $s - t$. There is no one matrix to absorb;
# one would have to cache the rotated keys $R_s W^{UK} c_s$ of every head, which is the full
# multi-head cache MLA was built to avoid. Numerically:

# %%
D, d_c, d_h = 12, 4, 8
W_Q, W_UK = torch.randn(d_h, D, dtype=torch.float64), torch.randn(d_h, d_c, dtype=torch.float64)
x_t, c_s = torch.randn(D, dtype=torch.float64), torch.randn(d_c, dtype=torch.float64)
M = W_Q.T @ W_UK  # (D, d_c): the absorbed matrix
test_close((W_Q @ x_t) @ (W_UK @ c_s), x_t @ M @ c_s, eps=1e-10)  # no RoPE: absorbed works
rope_score = lambda t, s: (rope_matrix(t, d_h) @ W_Q @ x_t) @ (rope_matrix(s, d_h) @ W_UK @ c_s)
M_rel = lambda delta: W_Q.T @ rope_matrix(delta, d_h) @ W_UK  # depends on s - t
test_close(rope_score(2, 5), x_t @ M_rel(3) @ c_s, eps=1e-10)
assert abs(rope_score(2, 5) - x_t @ M @ c_s) > 1e-3      # the fixed M is wrong with RoPE
assert (M_rel(3) - M_rel(4)).abs().max() > 1e-3          # and no single matrix serves every distance

# %% [markdown]
# ## Decoupled (partial) RoPE
#
# "Partial RoPE" in GPT-J and GPT-NeoX means rotating a slice of each head's own key; that alone would
# not save the absorption, since a key computed from the latent and then rotated still has to be
# cached per head. DeepSeek-V2 also *decouples* the rotated slice from the latent. It splits every
# query and key head in two:
#
# * a **nope** part of $d_\text{nope}$ dimensions, computed from the latent and never rotated, so
#   the absorption above works for it;
# * a **rope** part of $d_\text{rope}$ dimensions, rotated. The key's rope part does not come from
#   the latent: it is its own small projection of $x_s$, *one vector per token shared by all heads*
#   (like multi-query attention), so the cache grows by only $d_\text{rope}$ numbers per token.
#
# The score is the sum of the two parts:
# $$q_t^\top k_s = q^\text{nope}_t{}^\top k^\text{nope}_s + (R_t q^\text{rope}_t)^\top (R_s k^\text{rope}_s).$$
# In HyMo's 750M, $d_\text{nope} = 96$ and $d_\text{rope} = 32$: a quarter of each 128-dim head
# carries position. The rotation is applied to the slice only; concatenation restores the head:

# %%
d_nope, d_rope, T, H = 6, 4, 5, 2
q = torch.randn(1, T, H, d_nope + d_rope)
cos, sin = rope_cos_sin(torch.arange(T), d_rope)
q_nope, q_rope = q.split([d_nope, d_rope], -1)
q_rot = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)  # (1, T, H, d_nope + d_rope)
R2 = torch.block_diag(torch.eye(d_nope, dtype=torch.float64), rope_matrix(2, d_rope))
torch.testing.assert_close(q_rot[0, 2].double(), q[0, 2].double() @ R2.T, atol=1e-6, rtol=0)  # = diag(I, R_m) q


# %% [markdown]
# ## Positions for packed documents
#
# Training packs several documents into one window and passes their boundaries as `cu_seqlens`,
# the cumulative lengths `[0, L_0, L_0 + L_1, ..., T]` (flash-attention's varlen convention). Each
# document must look as if it started the sequence, so its positions restart at 0. For token $j$ in
# document $i$, the position is $j - \text{cu\_seqlens}_i$; `searchsorted` finds $i$ for all tokens
# at once.

# %%
#| exports
def check_cu_seqlens(cu_seqlens: torch.Tensor, # Document boundaries [N + 1], int32 or int64
                     T: int, # Length of the packed sequence
                    ) -> list[int]: # The boundaries, read once (on the host)
    "Raise `ValueError` unless `cu_seqlens` is an int32/int64 1-D tensor `0 = c_0 < c_1 < ... < c_N = T`; return its values."
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor [0, ..., T] of document boundaries, got "
                         f"{cu_seqlens.dtype} {cu_seqlens}")  # floats, bools and bytes (whose differences wrap) refused
    b = cu_seqlens.tolist()  # one read of the values
    if b[0] != 0 or b[-1] != T or any(e <= s for s, e in zip(b, b[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T} (one entry per document boundary), got {b}")
    return b


@torch.compiler.disable  # data-dependent checks: traced, they would break the graph and recompile for every new N
def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, # Document boundaries [N + 1]: 0, L_0, L_0 + L_1, ..., T
                              T: int, # Length of the packed sequence
                              max_len: int | None = None, # Longest document allowed (the model's max_seq_len); None: any
                             ) -> torch.Tensor: # [T] positions, restarting at 0 at each document
    "Per-token position inside its own document, for RoPE on packed sequences."
    b = check_cu_seqlens(cu_seqlens, T)
    if max_len is not None and (longest := max(e - s for s, e in zip(b, b[1:]))) > max_len:  # positions never trained on
        raise ValueError(f"a packed document has {longest} tokens > max_seq_len={max_len}: split long documents or raise max_seq_len")
    t = torch.arange(T, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[1:], t, right=True)  # (T,) index of each token's document
    return t - cu_seqlens[doc]


# %%
cu = torch.tensor([0, 3, 4, 8])
test_eq(positions_from_cu_seqlens(cu, 8), torch.tensor([0, 1, 2, 0, 0, 1, 2, 3]))
test_eq(positions_from_cu_seqlens(torch.tensor([0, 5]), 5), torch.arange(5))
test_fail(lambda: positions_from_cu_seqlens(torch.tensor([0, 3, 7]), 8), contains="from 0 to T=8")
test_fail(lambda: positions_from_cu_seqlens(torch.tensor([0.0, 8.0]), 8), contains="int32 or int64")
test_eq(positions_from_cu_seqlens(cu, 8, max_len=4)[-1].item(), 3)  # the longest document fits exactly
test_fail(lambda: positions_from_cu_seqlens(cu, 8, max_len=3), contains="4 tokens > max_seq_len=3")

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why does RoPE encode relative position even though each vector is rotated by its absolute position?
# Rotations are orthogonal and compose by adding angles, so $(R_m q)^\top (R_n k) = q^\top R_m^\top
# R_n k = q^\top R_{n-m} k$. The absolute angles cancel in the dot product and only the distance
# survives. Values are not rotated, so the output mixes content only; position acts through the
# attention weights.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why several frequencies rather than one?
# A single angle per token makes the score periodic in the distance, with period $2\pi/\theta$
# tokens (not a whole number in general, so at whole tokens it nearly repeats), and distant
# positions would alias onto near ones. The geometric ladder $\theta_i = \text{theta}^{-2i/d}$ gives fast pairs that
# resolve neighbouring tokens and slow pairs (the slowest turns $\text{theta}^{-(d-2)/d}$ radians a token: a wavelength of about 35 000 tokens at $d = 32$)
# that still separate tokens thousands apart. Raising `rope_theta` slows every pair but the fastest (which turns 1 radian a token whatever
# the base), the slower ones the more, which is what
# long-context recipes do.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why can't MLA apply RoPE to keys up-projected from the cached latent?
# Because the decode trick of MLA is to absorb $W^{UK}$ into the query: $q^\top W^{UK} c_s$ with
# $W^{UK\top} q$ computed once. With RoPE, the score is $x_t^\top W^{Q\top} R_{s-t} W^{UK} c_s$: the
# rotation sits between $W^Q$ and $W^{UK}$ and depends on the distance, so no fixed matrix can be
# absorbed. You would have to cache every head's rotated key, losing the compression. Decoupled RoPE
# keeps the latent position-free and adds a small rotated key (32 dims in HyMo) shared by all heads.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why is the rotary key shared by all heads, and what does that cost?
# Each extra cached number per token is paid for at every MLA layer (8 of 32 in the 750M model; the
# GDN layers keep a fixed-size state instead) and every context position. A
# per-head rotary key would add $H \cdot d_\text{rope} = 512$ numbers per token in the 750M model,
# four times the 128-number latent; a shared one adds 32. The cost is expressiveness: every head
# sees the same positional key, like multi-query attention for the positional part, while the
# per-head queries still decide how much position matters to each head.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Do RoPE positions have to restart at each document of a packed sequence?
# In exact arithmetic, not if attention is masked per document: scores depend only on distances
# inside the document, and a constant offset cancels. Restarting still matters in practice. Angles
# are computed in fp32 and lose precision as positions grow, so a document placed at offset 4000
# would see slightly different scores than alone; and restarting gives training exactly the
# positions that decoding a fresh document will use, so a packed forward can be tested for
# equality against running each document separately. Without document masking the window is one
# sequence and positions must run on.
# :::
