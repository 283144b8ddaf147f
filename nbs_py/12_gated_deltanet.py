# %% [markdown]
# # Gated DeltaNet: the chunked form and the block
#
# > The gated delta rule as a loop (the reference), its chunked WY/UT form (the training path), and the Gated DeltaNet mixer and block.

# %%
#| default_exp models.gdn

# %% [markdown]
# Chapter 11 derived the gated delta rule. Per head, with the state $S \in \mathbb{R}^{K\times V}$
# (key-major, HyMo's layout), $\alpha_t = e^{g_t}$, $g_t \le 0$, $\beta_t \in (0, 1)$, and `q`, `k`
# L2-normalised:
# $$S_t = \alpha_t\,(I - \beta_t k_t k_t^\top)\,S_{t-1} + \beta_t k_t v_t^\top, \qquad o_t = S_t^\top(\text{scale}\cdot q_t).$$
# Computed in the order a kernel uses ("decay first, then read the error"):
# $$S' = \alpha_t S_{t-1}, \qquad u_t = \beta_t\,(v_t - S'^\top k_t), \qquad S_t = S' + k_t u_t^\top .$$
#
# This chapter turns the loop over $T$ tokens into a loop over $T/C$ chunks of $C = 64$ tokens whose
# insides are matrix products, checks it against the loop at every step, and then builds the
# Gated DeltaNet mixer and block around it. The exported API:
#
# | function | what it is |
# |---|---|
# | `naive_gated_delta_rule` | the textbook loop over time, fp32: the reference every fast path is tested against |
# | `chunk_gated_delta_rule_torch` | the chunked (WY / UT transform) algorithm in pure PyTorch: differentiable, any $T$ |
# | `GatedDeltaNet` | the mixer: projections, short convolution, gates, the rule, gated output norm |
# | `GatedDeltaNetBlock` | `x + mixer(norm(x))`, then `x + SwiGLU(norm(x))` |
#
# All three rule functions take the same arguments in the same order:
# `(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)`, layout `[B, T, H, D]`.

# %%
#| export
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hymo.config import ModelConfig
from hymo.models.layers import RMSNorm, SwiGLU

# %%
import time

import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_fail, test_close
from torch.testing import assert_close

torch.manual_seed(0)


# %% [markdown]
# ## The reference: a loop over time
#
# Inputs are checked once, with messages that say what to fix. `cu_seqlens` describes a *packed*
# batch: $N$ documents laid end to end in one row ($B = 1$), document $n$ occupying tokens
# `cu_seqlens[n]:cu_seqlens[n+1]`. The state restarts at every document, so `initial_state` and the
# final state then have one entry per document, `[N, H, K, V]`.

# %%
#| export
def _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    "Raise `ValueError` naming the argument whose shape does not fit the `[B, T, H, D]` layout."
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H): raise ValueError(f"{name} must be [B, T, H] = [{B}, {T}, {H}]; got {tuple(x.shape)}")
    n = B
    if cu_seqlens is not None:
        if B != 1: raise ValueError(f"cu_seqlens packs documents into one row: B must be 1, got B={B}; flatten the batch first")
        if cu_seqlens.ndim != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or (cu_seqlens.diff() < 0).any():
            raise ValueError(f"cu_seqlens must be a non-decreasing [N+1] tensor from 0 to T={T}; got {cu_seqlens.tolist()}")
        n = len(cu_seqlens) - 1
    if initial_state is not None and initial_state.shape != (n, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [{'N' if cu_seqlens is not None else 'B'}, H, K, V] = "
                         f"[{n}, {H}, {K}, {v.shape[-1]}]; got {tuple(initial_state.shape)}")


# %% [markdown]
# The loop keeps the state in fp32 whatever the input dtype, and returns `o` in `v`'s dtype.

# %%
#| exports
def naive_gated_delta_rule(
    q: torch.Tensor,  # Queries [B, T, H, K], L2-normalised per head
    k: torch.Tensor,  # Keys [B, T, H, K], L2-normalised per head
    v: torch.Tensor,  # Values [B, T, H, V]
    g: torch.Tensor,  # Log-decay [B, T, H], g <= 0: the state is multiplied by exp(g) before each write
    beta: torch.Tensor,  # Write strength [B, T, H], in (0, 1)
    scale: Optional[float] = None,  # Query scale; None is K**-0.5
    initial_state: Optional[torch.Tensor] = None,  # State [B, H, K, V] ([N, H, K, V] with cu_seqlens); None is zeros
    output_final_state: bool = False,  # Also return the state after the last token, fp32
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1); the state restarts per document
):
    "The gated delta rule as a loop over time in fp32. Returns `(o [B, T, H, V], final_state [B, H, K, V] or None)`."
    _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:  # one document at a time, each from its own initial state
        outs, states = [], []
        for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, h = naive_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, h0, True)
            outs.append(o); states.append(h)
        return torch.cat(outs, 1), (torch.cat(states) if output_final_state else None)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    o = []
    for t in range(T):
        S = S * g[:, t, :, None, None].exp()                                # S' = alpha_t S_{t-1}
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])            # v_t - S'^T k_t   (B, H, V)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * err)  # S' + k_t u_t^T
        o.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))          # S_t^T (scale q_t)
    o = torch.stack(o, 1) if T else v.new_zeros(B, 0, H, V)                 # (B, T, H, V)
    return o.to(v.dtype), (S if output_final_state else None)


# %% [markdown]
# Inputs for the checks: sizes that are deliberately not powers of two, random gates in the range a
# trained model produces.

# %%
def make_inputs(B=2, T=100, H=3, K=12, V=20, dtype=torch.float32, g_scale=0.3, seed=0):
    "Random `(q, k, v, g, beta)` in the rule's layout; q, k L2-normalised, g <= 0, beta in (0, 1)."
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    g = F.logsigmoid(r(B, T, H) + 3) * g_scale / 0.05  # mostly small negative, some large
    return q.to(dtype), k.to(dtype), r(B, T, H, V).to(dtype), g, torch.rand(B, T, H, generator=gen)


q, k, v, g, beta = make_inputs()
o, S = naive_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
test_eq(o.shape, (2, 100, 3, 20)); test_eq(S.shape, (2, 3, 12, 20))
print(f"g in [{g.min():.2f}, {g.max():.2f}], alpha = exp(g) in [{g.exp().min():.3f}, {g.exp().max():.3f}]")

# %% [markdown]
# The loop computes exactly the matrix form $S_t = \alpha_t (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top$:

# %%
b, h = 1, 2
S_ref = torch.zeros(12, 20)
for t in range(100):
    kt = k[b, t, h][:, None]  # (K, 1)
    S_ref = g[b, t, h].exp() * (torch.eye(12) - beta[b, t, h] * kt @ kt.T) @ S_ref + beta[b, t, h] * kt @ v[b, t, h][None]
assert_close(S[b, h], S_ref, atol=1e-5, rtol=1e-5)
assert_close(o[b, -1, h], S_ref.T @ (q[b, -1, h] * 12 ** -0.5), atol=1e-5, rtol=1e-5)

# %% [markdown]
# Packed documents: running with `cu_seqlens` is the same as running each document on its own.

# %%
q1, k1, v1, g1, b1 = (x[:1] for x in (q, k, v, g, beta))
cu = torch.tensor([0, 30, 31, 100])
h0 = torch.randn(3, 3, 12, 20)
o_p, S_p = naive_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=h0, output_final_state=True, cu_seqlens=cu)
for n in range(3):
    s, e = cu[n].item(), cu[n + 1].item()
    o_n, S_n = naive_gated_delta_rule(q1[:, s:e], k1[:, s:e], v1[:, s:e], g1[:, s:e], b1[:, s:e], initial_state=h0[n:n + 1], output_final_state=True)
    assert_close(o_p[:, s:e], o_n); assert_close(S_p[n:n + 1], S_n)

# %% [markdown]
# Bad shapes fail with a message that says what is expected:

# %%
test_fail(lambda: naive_gated_delta_rule(q, k, v, g[..., :2], beta), contains="g must be [B, T, H]")
test_fail(lambda: naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu), contains="B must be 1")
test_fail(lambda: naive_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=h0[:2], cu_seqlens=cu), contains="initial_state must be [N, H, K, V]")


# %% [markdown]
# ## The chunked form
#
# The loop does $T$ dependent steps, each a rank-one update of a $K \times V$ matrix: tiny work,
# no parallelism over time, nothing for tensor cores to chew on. The chunked algorithm of Yang,
# Kautz & Hatamizadeh (2025), building on DeltaNet's parallel form (Yang et al., 2024), splits the
# sequence into chunks of $C$ tokens. Inside a chunk everything becomes $C \times C$ and
# $C \times K$ matrix products; only the state is carried from chunk to chunk, $T/C$ serial steps.
#
# Fix one head and one chunk; number its tokens $t = 1..C$ and call the incoming state $S_0$.
#
# ### Step 1: unroll the state inside a chunk
#
# Write the cumulative log-decay inside the chunk as $\gamma_t = \sum_{s \le t} g_s$ (variable
# `gc`) and $\Gamma_t = e^{\gamma_t}$. Since $S_t = \alpha_t S_{t-1} + k_t u_t^\top$, unrolling gives
# $$S_t = \Gamma_t S_0 + \sum_{i \le t} e^{\gamma_t - \gamma_i}\, k_i u_i^\top .$$
# Every exponent here is $\le 0$: $\gamma_t - \gamma_i = \sum_{i < s \le t} g_s$ for $i \le t$. The
# state is a decayed sum of rank-one writes, as in linear attention, but with the *corrected*
# values $u_i$ instead of $v_i$. We check it against the loop on one chunk, recording the $u_t$.

# %%
def chunk_by_loop(k, v, g, beta, S0):
    "One head, one chunk, by the loop: returns the corrected values u [C, V] and the states S_t [C, K, V]."
    S, us, Ss = S0, [], []
    for t in range(len(k)):
        S = g[t].exp() * S
        u = beta[t] * (v[t] - S.T @ k[t])
        S = S + torch.outer(k[t], u)
        us.append(u); Ss.append(S)
    return torch.stack(us), torch.stack(Ss)


C, Kd, Vd = 16, 12, 20
kc, vc, gc_in, bc = k[0, :C, 0], v[0, :C, 0], g[0, :C, 0], beta[0, :C, 0]  # one head, one chunk: (C, K), (C, V), (C,), (C,)
S0 = torch.randn(Kd, Vd)
u_loop, S_loop = chunk_by_loop(kc, vc, gc_in, bc, S0)

gc = gc_in.cumsum(0)  # gamma_t, (C,)
t = 9
S_unrolled = gc[t].exp() * S0 + sum((gc[t] - gc[i]).exp() * torch.outer(kc[i], u_loop[i]) for i in range(t + 1))
assert_close(S_unrolled, S_loop[t], atol=1e-5, rtol=1e-5)

# %% [markdown]
# ### Step 2: the corrected values solve a triangular system (the UT transform)
#
# Substitute the unrolled $S_{t-1}$ into $u_t = \beta_t (v_t - \alpha_t S_{t-1}^\top k_t)$, using
# $\alpha_t \Gamma_{t-1} = \Gamma_t$:
# $$u_t = \beta_t v_t - \beta_t \Gamma_t\, S_0^\top k_t - \sum_{i < t} \beta_t\, (k_t^\top k_i)\, e^{\gamma_t - \gamma_i}\, u_i .$$
# With the rows of $U, K, V$ being the chunk's tokens, this is $(I + A)\,U = \mathrm{diag}(\beta) V - \mathrm{diag}(\beta\Gamma) K S_0$,
# with the strictly lower-triangular
# $$A = \mathrm{strict\_tril}\big(\mathrm{diag}(\beta)\, K K^\top \odot D\big), \qquad D_{ti} = e^{\gamma_t - \gamma_i}\ (i \le t),\ 0\ \text{otherwise}.$$
# $I + A$ is unit lower-triangular, so it is always invertible; call its inverse
# $T = (I + A)^{-1}$. Then
# $$W = T\,\mathrm{diag}(\beta\Gamma)\,K, \qquad U = T\,\mathrm{diag}(\beta)\,V, \qquad V_{new} = U - W S_0 .$$
# $W$ and $U$ do not depend on $S_0$: they are computed for all chunks at once, in parallel. Only
# $V_{new}$ (the $u_t$ of the loop) needs the incoming state. This is the WY representation of the
# product of Householder-like factors $(I - \beta_t k_t k_t^\top)$, and inverting $I + A$ this way is
# the UT transform. `D` is built by masking the exponent with $-\infty$ *before* `exp`, so no
# positive exponent is ever evaluated.

# %%
causal = torch.ones(C, C, dtype=torch.bool).tril()  # i <= t
D = (gc[:, None] - gc[None, :]).masked_fill(~causal, float("-inf")).exp()  # (C, C), entries in [0, 1]
A = (bc[:, None] * kc @ kc.T * D).tril(-1)
T_ut = torch.linalg.solve_triangular(torch.eye(C) + A, torch.eye(C), upper=False)
W = T_ut @ (kc * (bc * gc.exp())[:, None])   # (C, K)
U = T_ut @ (vc * bc[:, None])                 # (C, V)
V_new = U - W @ S0
assert_close(V_new, u_loop, atol=1e-5, rtol=1e-5)
print(f"|D| max {D.max():.3f}; T is unit lower-triangular: {torch.allclose(T_ut.diagonal(), torch.ones(C))}")

# %% [markdown]
# ### Step 3: outputs and the state passed on
#
# Reading the unrolled state with $\tilde q_t = \text{scale}\cdot q_t$:
# $$o_t = \Gamma_t\, S_0^\top \tilde q_t + \sum_{i \le t} e^{\gamma_t-\gamma_i} (k_i^\top \tilde q_t)\, u_i
# \quad\Longrightarrow\quad O = \mathrm{diag}(\Gamma)\,\tilde Q S_0 + (\tilde Q K^\top \odot D)\, V_{new},$$
# the first term reads the old state (inter-chunk), the second is causal linear attention over the
# chunk with the corrected values (intra-chunk). At the end of the chunk ($t = C$):
# $$S_C = \Gamma_C\, S_0 + \big(K \odot e^{\gamma_C - \gamma}\big)^\top V_{new} .$$
# Again all exponents are $\le 0$.

# %%
qc = q[0, :C, 0] * Kd ** -0.5
O = (qc * gc.exp()[:, None]) @ S0 + (qc @ kc.T * D) @ V_new
S_C = gc[-1].exp() * S0 + (kc * (gc[-1] - gc).exp()[:, None]).T @ V_new
assert_close(O, torch.einsum("tkv,tk->tv", S_loop, qc), atol=1e-5, rtol=1e-5)
assert_close(S_C, S_loop[-1], atol=1e-5, rtol=1e-5)

# %% [markdown]
# ### Why only non-positive exponents
#
# A tempting shortcut writes $e^{\gamma_t - \gamma_i} = e^{\gamma_t}\cdot e^{-\gamma_i}$ so that
# $D$ becomes a rank-one product. But $-\gamma_i$ grows with the chunk: with a strong gate,
# $g = -2$ per token, $e^{-\gamma_{64}} = e^{128}$ is beyond fp32's range ($\approx e^{88.7}$) and the
# product becomes `inf * 0 = nan`. Differences of cumulative sums, masked before `exp`, never leave $[0, 1]$.

# %%
g_strong = torch.full((64,), -2.0).cumsum(0)
factored = g_strong.exp()[:, None] * (-g_strong).exp()[None, :]
masked = (g_strong[:, None] - g_strong[None, :]).masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), float("-inf")).exp()
print("factored form finite:", factored.isfinite().all().item(), "| masked differences finite:", masked.isfinite().all().item())
assert not factored.isfinite().all() and masked.isfinite().all() and masked.max() <= 1


# %% [markdown]
# ### Assembling it
#
# The exported function pads $T$ up to a multiple of $C$ with tokens that change nothing
# ($k = v = q = 0$, $g = 0$, $\beta = 0$: no decay, no write), computes $A$, $T$, $W$, $U$ and the
# intra-chunk scores for all chunks at once, and then walks the chunks, carrying the state. With
# `cu_seqlens` it lays the documents out as rows of a padded batch, which is exact for the same
# reason: trailing padding changes neither outputs nor state. Everything runs in fp32 and is
# differentiable by autograd (`torch.linalg.solve_triangular` has a backward).

# %%
#| exports
def _unpack_docs(x, cu_seqlens):
    "Packed `[1, T, ...]` → padded `[N, L, ...]` (L the longest document), zeros after each document's end."
    lens = cu_seqlens.diff()
    L = int(lens.max()) if len(lens) else 0
    pos = torch.arange(L, device=x.device)
    idx = (cu_seqlens[:-1, None] + pos).clamp(max=max(x.shape[1] - 1, 0))  # (N, L)
    keep = pos < lens[:, None]                                             # (N, L)
    out = x[0][idx]                                                        # (N, L, ...)
    return out * keep.view(*keep.shape, *[1] * (out.ndim - 2)).to(out.dtype), keep


def _chunk_rule(q, k, v, g, beta, scale, S, output_final_state, C):
    "Chunked gated delta rule on fp32 `[B, T, H, D]` inputs with T a multiple of C; S is the initial state [B, H, K, V] or None."
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // C
    q, k, v = (x.reshape(B, NT, C, H, -1).transpose(2, 3) for x in (q, k, v))  # (B, NT, H, C, D)
    g, beta = (x.reshape(B, NT, C, H).transpose(2, 3) for x in (g, beta))     # (B, NT, H, C)
    gc = g.cumsum(-1)                                                          # gamma: cumulative log-decay in the chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, NT, H, C, C), in [0, 1]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * D).tril(-1)                                # strict_tril(diag(beta) K K^T ⊙ D)
    eye = torch.eye(C, device=q.device)
    T_ut = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)  # (I + A)^-1
    W = T_ut @ (kb * gc.exp()[..., None])                                      # (B, NT, H, C, K)
    U = T_ut @ (v * beta[..., None])                                           # (B, NT, H, C, V)
    q = q * scale
    attn = q @ k.transpose(-1, -2) * D                                         # intra-chunk scores (B, NT, H, C, C)
    q_dec = q * gc.exp()[..., None]                                            # Gamma_t q_t, reads the old state
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]                           # e^{gamma_C - gamma_i} k_i, writes the new one
    S = q.new_zeros(B, H, K, V) if S is None else S
    o = []
    for n in range(NT):
        v_new = U[:, n] - W[:, n] @ S                                          # (B, H, C, V)
        o.append(q_dec[:, n] @ S + attn[:, n] @ v_new)                        # (B, H, C, V)
        S = S * gc[:, n, :, -1, None, None].exp() + k_dec[:, n].transpose(-1, -2) @ v_new
    o = torch.stack(o, 1).transpose(2, 3).reshape(B, T, H, V)                  # (B, NT, H, C, V) -> (B, T, H, V)
    return o, (S if output_final_state else None)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,  # Queries [B, T, H, K], L2-normalised per head
    k: torch.Tensor,  # Keys [B, T, H, K], L2-normalised per head
    v: torch.Tensor,  # Values [B, T, H, V]
    g: torch.Tensor,  # Log-decay [B, T, H], g <= 0
    beta: torch.Tensor,  # Write strength [B, T, H], in (0, 1)
    scale: Optional[float] = None,  # Query scale; None is K**-0.5
    initial_state: Optional[torch.Tensor] = None,  # State [B, H, K, V] ([N, H, K, V] with cu_seqlens); None is zeros
    output_final_state: bool = False,  # Also return the state after the last token, fp32
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1); the state restarts per document
    chunk_size: int = 64,  # Tokens per chunk C
):
    "The gated delta rule by chunks (WY representation, UT transform) in fp32 PyTorch. Returns `(o [B, T, H, V], final_state or None)`."
    _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size < 1: raise ValueError(f"chunk_size={chunk_size} must be positive")
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    dtype, xs = v.dtype, [x.float() for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.float()
    if cu_seqlens is not None:
        xs, keep = zip(*(_unpack_docs(x, cu_seqlens) for x in xs))            # each (N, L, ...)
        keep = keep[0]
    pad = -xs[0].shape[1] % chunk_size
    xs = [F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad)) for x in xs]              # zeros after the end change nothing
    o, S = _chunk_rule(*xs, scale, h0, output_final_state, chunk_size)
    o = o[:, :xs[0].shape[1] - pad]                                            # drop the padding
    o = o[keep][None] if cu_seqlens is not None else o                         # (B, T, H, V)
    return o.to(dtype), S


# %% [markdown]
# ## Checks against the loop
#
# Outputs and final states agree to $10^{-5}$ in fp32, for lengths around the chunk boundary and
# sizes that are not powers of two:

# %%
h0 = torch.randn(2, 3, 12, 20)
for T in (1, 63, 64, 65, 200):
    args = make_inputs(T=T, seed=T)
    o_n, S_n = naive_gated_delta_rule(*args, initial_state=h0, output_final_state=True)
    o_c, S_c = chunk_gated_delta_rule_torch(*args, initial_state=h0, output_final_state=True)
    err = max((o_n - o_c).abs().max().item(), (S_n - S_c).abs().max().item())
    print(f"T={T:4d}: max |naive - chunk| = {err:.1e}")
    assert err <= 1e-5


# %% [markdown]
# Gradients, through autograd on both sides, agree as well (of `q, k, v, g, beta` and the initial state):

# %%
def grads(rule, args, h0, chunk_size=64):
    "Gradients of a fixed random loss of (o, final state) w.r.t. the six inputs."
    args = [x.clone().requires_grad_() for x in args]
    h = h0.clone().requires_grad_()
    kw = dict(chunk_size=chunk_size) if rule is chunk_gated_delta_rule_torch else {}
    o, S = rule(*args, initial_state=h, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1)
    (o * torch.randn(o.shape, generator=gen)).sum().add((S * torch.randn(S.shape, generator=gen)).sum()).backward()
    return [x.grad for x in args] + [h.grad]


args = make_inputs(T=130)
for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(naive_gated_delta_rule, args, h0),
                      grads(chunk_gated_delta_rule_torch, args, h0)):
    print(f"d{name:13s} max |naive - chunk| = {(a - b).abs().max():.1e}")
    assert_close(a, b, atol=1e-5, rtol=0)

# %% [markdown]
# Edge cases. With $g = 0$ there is no decay (plain DeltaNet); with $\beta \to 0$ nothing is
# written, so the state stays the initial one and the output is its read-out:

# %%
q, k, v, g, beta = make_inputs(T=90)
for gg, bb in ((torch.zeros_like(g), beta), (g, torch.full_like(beta, 1e-8))):
    o_n, S_n = naive_gated_delta_rule(q, k, v, gg, bb, initial_state=h0, output_final_state=True)
    o_c, S_c = chunk_gated_delta_rule_torch(q, k, v, gg, bb, initial_state=h0, output_final_state=True)
    assert_close(o_c, o_n, atol=1e-5, rtol=0); assert_close(S_c, S_n, atol=1e-5, rtol=0)
o_c, S_c = chunk_gated_delta_rule_torch(q, k, v, torch.zeros_like(g), torch.zeros_like(beta), initial_state=h0, output_final_state=True)
assert_close(S_c, h0)
assert_close(o_c, torch.einsum("bhkv,bthk->bthv", h0, q * 12 ** -0.5))

# %% [markdown]
# Packed documents give the same result as running each document alone (the documents here are
# shorter than, equal to and longer than a chunk):

# %%
args = make_inputs(B=1, T=200, seed=3)
cu = torch.tensor([0, 5, 69, 133, 200])
h0 = torch.randn(4, 3, 12, 20)
o_p, S_p = chunk_gated_delta_rule_torch(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
o_n, S_n = naive_gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
assert_close(o_p, o_n, atol=1e-5, rtol=0); assert_close(S_p, S_n, atol=1e-5, rtol=0)

# %% [markdown]
# How much faster is it? On this CPU, at the tiny model's head sizes (a rough measure; the GPU story
# is the Triton chapter's):

# %%
for T in (256, 1024):
    args = make_inputs(B=4, T=T, H=4, K=32, V=32)
    tn = time.perf_counter(); naive_gated_delta_rule(*args); tn = time.perf_counter() - tn
    tc = time.perf_counter(); chunk_gated_delta_rule_torch(*args); tc = time.perf_counter() - tc
    print(f"T={T:5d}: loop {tn * 1e3:7.1f} ms, chunked {tc * 1e3:6.1f} ms ({tn / tc:.0f}x)")
