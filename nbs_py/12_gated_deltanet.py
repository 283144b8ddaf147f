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
# Both rule functions, and the Triton rule of chapter 13 (`triton_gated_delta_rule`), take the same
# arguments in the same order, `(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)`,
# layout `[B, T, H, D]`; the PyTorch chunked one adds `chunk_size`, the Triton one `keep_prep`.

# %%
#| export
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hymo.config import ModelConfig, check_triton_chunk
from hymo.models.layers import RMSNorm, SwiGLU

# %%
import timeit
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_fail, test_close
from torch.testing import assert_close

# %%
torch.manual_seed(0);


# %% [markdown]
# ## The reference: a loop over time
#
# Inputs are checked once, with messages that say what to fix. `cu_seqlens` describes a *packed*
# batch: $N$ documents laid end to end in one row ($B = 1$), document $n$ occupying tokens
# `cu_seqlens[n]:cu_seqlens[n+1]`. The state restarts at every document, so `initial_state` and the
# final state then have one entry per document, `[N, H, K, V]`.

# %%
#| export
def _check_cu_seqlens(cu_seqlens, B: int, T: int,
                      read: bool | None = True, # Also check the values: one read, which on a GPU waits for it; None: on a CPU only
                     ) -> int:
    "Raise `ValueError` unless `cu_seqlens` packs documents into one row of T tokens; return their number N."
    if B != 1: raise ValueError(f"cu_seqlens packs documents into one row: B must be 1, got B={B}; flatten the batch first")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):  # uint8's diff() wraps
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor of document boundaries, e.g. torch.tensor([0, {T}]) for one document; "
                         f"got {cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if read is None: read = cu_seqlens.device.type == "cpu"
    if cu_seqlens.ndim != 1 or len(cu_seqlens) < 1 or read and bool(  # one read of a GPU tensor, not three: each read waits
            (cu_seqlens[0] != 0) | (cu_seqlens[-1] != T) | (cu_seqlens.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must be a non-decreasing [N+1] tensor from 0 to T={T}; got {cu_seqlens.tolist()}")
    return len(cu_seqlens) - 1


def _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> int:
    "Raise `ValueError` naming the argument whose shape does not fit the `[B, T, H, D]` layout; return the number of sequences."
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, H): raise ValueError(f"{name} must be [B, T, H] = [{B}, {T}, {H}]; got {tuple(x.shape)}")
    if K < 1 or v.shape[-1] < 1: raise ValueError(f"the head sizes K={K} and V={v.shape[-1]} must be at least 1")
    if not all(x.is_floating_point() for x in (q, k, v, g, beta)):  # an integer v would come back rounded to integers
        raise TypeError(f"q, k, v, g and beta must be floating point; got {q.dtype}, {k.dtype}, {v.dtype}, {g.dtype}, {beta.dtype}")
    n = B if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None and initial_state.shape != (n, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [{'N' if cu_seqlens is not None else 'B'}, H, K, V] = "
                         f"[{n}, {H}, {K}, {v.shape[-1]}]; got {tuple(initial_state.shape)}")
    if initial_state is not None and (not initial_state.is_floating_point() or initial_state.device != v.device):
        raise TypeError(f"initial_state must be a floating-point tensor on v's device ({v.device}); got "
                        f"{initial_state.dtype} on {initial_state.device}")  # an integer or complex state: cast silently
    return n


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
    output_final_state: bool = False,  # Also return the state after the last token, fp32 (fp64 for fp64 inputs)
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1); the state restarts per document
):
    "The gated delta rule as a loop over time in fp32. Returns `(o [B, T, H, V], final_state [B, H, K, V] ([N, ...] with cu_seqlens) or None)`."
    _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:  # one document at a time, each from its own initial state
        outs, states = [], []
        for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, h = naive_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, h0, True)
            outs.append(o); states.append(h)
        if not outs:  # no document (cu_seqlens = [0]): no output, no state
            (_, _, H, K), V = q.shape, v.shape[-1]
            outs, states = [v.new_zeros(1, 0, H, V)], [q.new_zeros(0, H, K, V, dtype=torch.promote_types(v.dtype, torch.float32))]
        return torch.cat(outs, 1), (torch.cat(states) if output_final_state else None)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype, acc = v.dtype, torch.promote_types(v.dtype, torch.float32)  # computed in fp32 (fp64 stays fp64, for checks)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
    o = []
    for t in range(T):
        S = S * g[:, t, :, None, None].exp()                                # S' = alpha_t S_{t-1}
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])            # v_t - S'^T k_t   (B, H, V)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * err)  # S' + k_t u_t^T
        o.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))          # S_t^T (scale q_t)
    o = torch.stack(o, 1) if T else v.new_zeros(B, 0, H, V)                 # (B, T, H, V)
    return o.to(dtype), (S if output_final_state else None)  # o in the inputs' dtype, like the other rules


# %% [markdown]
# Inputs for the checks: sizes that are deliberately not powers of two, random gates. With the
# default `g_scale` the decays are strong (the median $\alpha_t$ is about 0.75, so a chunk of 64
# multiplies the incoming state by about $4\cdot10^{-13}$, and hardly ever by more than $10^{-7}$, which would
# hide a mistake in how the state is carried between chunks); `g_scale=0.01` gives weak decays (a
# chunk keeps 0.2 to 0.55 of its incoming state, 0.39 in the median), and the checks use both.

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
# With the rows of $V_{new}, K, V$ being the chunk's tokens ($V_{new}$'s rows are the $u_t$), this is
# $(I + A)\,V_{new} = \mathrm{diag}(\beta) V - \mathrm{diag}(\beta\Gamma) K S_0$,
# with the strictly lower-triangular
# $$A = \mathrm{strict\_tril}\big(\mathrm{diag}(\beta)\, K K^\top \odot D\big), \qquad D_{ti} = e^{\gamma_t - \gamma_i}\ (i \le t),\ 0\ \text{otherwise}.$$
# $I + A$ is unit lower-triangular, so it is always invertible; call its inverse
# $T_{ut} = (I + A)^{-1}$ (`T_ut`; $T$ stays the sequence length). Then
# $$W = T_{ut}\,\mathrm{diag}(\beta\Gamma)\,K, \qquad U = T_{ut}\,\mathrm{diag}(\beta)\,V, \qquad V_{new} = U - W S_0 .$$
# $W$ and $U$ do not depend on $S_0$: they are computed for all chunks at once, in parallel. Only
# $V_{new}$ (the $u_t$ of the loop) needs the incoming state. This is the WY representation of the
# product of the Householder-like factors $\alpha_t(I - \beta_t k_t k_t^\top)$, and inverting $I + A$ this way is
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
# product becomes `inf * 0 = nan`. Differences of cumulative sums, masked before `exp`, stay in $[0, 1]$
# for any gates whose sums stay finite.

# %%
g_strong = torch.full((64,), -2.0).cumsum(0)
factored = g_strong.exp()[:, None] * (-g_strong).exp()[None, :]
masked = (g_strong[:, None] - g_strong[None, :]).masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), float("-inf")).exp()
print("factored form finite:", factored.isfinite().all().item(), "| masked differences finite:", masked.isfinite().all().item())
assert not factored.isfinite().all() and masked.isfinite().all() and masked.max() <= 1


# %% [markdown]
# ### Sums of segments, not differences of sums
#
# Differences of cumulative sums still fail in two cases. A gate of $-\infty$ is a hard reset
# ($\alpha_t = 0$: forget everything), and then $\gamma$ is $-\infty$ from that token on, so
# $\gamma_t - \gamma_i = -\infty - (-\infty)$ is `nan` for every pair after it. And a strong but finite
# gate makes $\gamma_t$ and $\gamma_i$ both large, so the small sum between them is lost to rounding:
# after $g = -10^6$, fp32 steps in $0.0625$, and a segment that should be $-0.3$ comes out as $-0.25$
# or $-0.3125$. The exported function therefore sums each segment directly,
# $\gamma_t - \gamma_i = \sum_{i < l \le t} g_l$: copy $g$ into every column of a $C \times C$
# matrix, zero it on and above the diagonal, take cumulative sums down the columns (Mamba-2
# computes its `segsum` this way), set the entries above the diagonal to $-\infty$, then `exp`. No two
# large numbers are subtracted, so every entry is as exact as the gates that form it. It costs one
# $C \times C$ cumulative sum per chunk, and the last row of $D$ is the $e^{\gamma_C - \gamma_i}$
# that the state update needs. The mask goes before `exp`, not after (`exp().tril()`): `exp` keeps
# its output for the backward, and `D` is that same tensor, so autograd holds one $C \times C$
# matrix per chunk rather than two (at the 750M shape, 4 GB over the 24 GDN blocks).

# %%
#| exports
def _segment_decays(g: torch.Tensor, # Log-decays of one chunk [..., C]
                   ) -> torch.Tensor:
    "`D [..., C, C]`: entry `[t, i]` is exp(Σ_{i < l <= t} g_l) = e^{γ_t - γ_i} for i <= t, 0 above the diagonal."
    C = g.shape[-1]
    below = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)  # entry [l, i] takes g_l where l > i
    above = torch.ones(C, C, dtype=torch.bool, device=g.device).triu(1)  # entry [t, i] with i > t: no segment, 0
    return torch.where(below, g[..., :, None], 0.0).cumsum(-2).masked_fill(above, float("-inf")).exp()  # D is exp's saved output


# %%
g_reset = torch.full((16,), -0.1, dtype=torch.float64)
g_reset[2], g_reset[11] = -1e6, float("-inf")                 # a very strong gate, then a hard reset
gam = g_reset.float().cumsum(0)
by_differences = (gam[:, None] - gam[None, :]).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf")).exp()
by_segments = _segment_decays(g_reset.float())
exact = torch.tensor([[math.exp(g_reset[i + 1:t + 1].sum()) if i <= t else 0.0 for i in range(16)] for t in range(16)])
print(f"differences: {by_differences.isnan().sum()} NaN entries, worst error where finite "
      f"{(by_differences - exact).nan_to_num(0).abs().max():.2e}; segment sums: worst error {(by_segments - exact).abs().max():.2e}")
assert by_differences.isnan().any() and (by_differences - exact).nan_to_num(0).abs().max() > 1e-2
assert (by_segments - exact).abs().max() < 1e-6


# %% [markdown]
# ### Assembling it
#
# The exported function pads $T$ up to a multiple of $C$ with tokens that change nothing
# ($k = v = q = 0$, $g = 0$, $\beta = 0$: no decay, no write), computes $A$, $T$, $W$, $U$ and the
# intra-chunk scores for all chunks at once, and then walks the chunks, carrying the state. With
# `cu_seqlens` it lays the documents out as rows of a padded batch, which is exact for the same
# reason: trailing padding changes neither outputs nor state. Everything runs in fp32 and is
# differentiable by autograd (`torch.linalg.solve_triangular` has a backward).
#
# Causality here holds for finite inputs. A NaN or infinity at token $t$ reaches the outputs of its
# chunk before $t$ too (the zeros above the diagonal of $T$ and of the scores multiply it, and
# $0 \cdot \text{NaN}$ is NaN), where the loop keeps it to $t$ onwards: to find the first bad
# token, run the loop. Other heads, rows and documents are not touched.

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
    return torch.where(keep.view(*keep.shape, *[1] * (out.ndim - 2)), out, 0.0), keep  # (a product would keep g = -inf's NaN)


def _chunk_rule(q, k, v, g, beta, scale, S, output_final_state, C):
    "Chunked gated delta rule on fp32 `[B, T, H, D]` inputs with T a multiple of C; S is the initial state [B, H, K, V] or None."
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // C
    if NT == 0:  # no token: no output, and the state as it came
        return v.new_zeros(B, 0, H, V), ((q.new_zeros(B, H, K, V) if S is None else S) if output_final_state else None)
    q, k, v = (x.reshape(B, NT, C, H, x.shape[-1]).transpose(2, 3) for x in (q, k, v))  # (B, NT, H, C, D)
    g, beta = (x.reshape(B, NT, C, H).transpose(2, 3) for x in (g, beta))     # (B, NT, H, C)
    gc = g.cumsum(-1)                                                          # gamma: cumulative log-decay in the chunk
    D = _segment_decays(g)                                                     # e^{gamma_t - gamma_i}, summed directly (B, NT, H, C, C)
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * D).tril(-1)                                # strict_tril(diag(beta) K K^T ⊙ D)
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    T_ut = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)  # (I + A)^-1
    W = T_ut @ (kb * gc.exp()[..., None])                                      # (B, NT, H, C, K)
    U = T_ut @ (v * beta[..., None])                                           # (B, NT, H, C, V)
    q = q * scale
    attn = q @ k.transpose(-1, -2) * D                                         # intra-chunk scores (B, NT, H, C, C)
    q_dec = q * gc.exp()[..., None]                                            # Gamma_t q_t, reads the old state
    k_dec = k * D[..., -1, :, None]                                            # e^{gamma_C - gamma_i} k_i, writes the new one
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
    output_final_state: bool = False,  # Also return the state after the last token, fp32 (fp64 for fp64 inputs)
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1); the state restarts per document
    chunk_size: int = 64,  # Tokens per chunk C
):
    "The gated delta rule by chunks (WY representation, UT transform) in fp32 PyTorch. Returns `(o [B, T, H, V], final_state [B or N, H, K, V] or None)`."
    _check_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    chunk_size = int(chunk_size)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    dtype, acc = v.dtype, torch.promote_types(v.dtype, torch.float32)  # fp32 inside (fp64 stays fp64, for checks)
    xs = [x.to(acc) for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.to(acc)
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
    for g_scale in (0.3, 0.01):  # strong and weak decays
        args = make_inputs(T=T, seed=T, g_scale=g_scale)
        o_n, S_n = naive_gated_delta_rule(*args, initial_state=h0, output_final_state=True)
        o_c, S_c = chunk_gated_delta_rule_torch(*args, initial_state=h0, output_final_state=True)
        err = max((o_n - o_c).abs().max().item(), (S_n - S_c).abs().max().item())
        print(f"T={T:4d}, g_scale={g_scale}: max |naive - chunk| = {err:.1e}")
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


for g_scale in (0.3, 0.01):
    args = make_inputs(T=130, g_scale=g_scale)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(naive_gated_delta_rule, args, h0),
                          grads(chunk_gated_delta_rule_torch, args, h0)):
        print(f"g_scale={g_scale}: d{name:13s} max |naive - chunk| = {(a - b).abs().max():.1e} (max |grad| {a.abs().max():.1f})")
        assert_close(a, b, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=0)  # fp32 rounding, relative to the gradient's size

# %% [markdown]
# The differences above are fp32 rounding (about $10^{-6}$ of each tensor's size), not a flaw of the
# algebra: in fp64 the two paths agree to $10^{-14}$.

# %%
args64, h64 = [x.double() for x in args], h0.double()
err64 = max((a - b).abs().max().item() for a, b in zip(grads(naive_gated_delta_rule, args64, h64),
                                                       grads(chunk_gated_delta_rule_torch, args64, h64)))
print(f"fp64: max gradient difference {err64:.1e}")
assert err64 < 1e-12

# %% [markdown]
# Edge cases. With $g = 0$ there is no decay (plain DeltaNet); with $\beta \to 0$ nothing is
# written, so the state is the initial one decayed; with $\beta = 0$ and $g = 0$ as well it stays
# the initial one and the output is its read-out:

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
# How much faster is it? On this CPU, at the tiny model's head sizes (a rough measure, the best of
# three calls after an untimed one; the GPU story is the Triton chapter's). Both paths are linear in
# $T$; the chunked one also pays a fixed cost per call (padding, the batched solve, setting up its
# larger operations), which more tokens spread thinner, so its lead can grow a little with $T$.
# The timings are rough (a shared CPU): between 3 and 4.5 times in the runs of this page:

# %%
best_time = lambda f, args: min(timeit.repeat(lambda: f(*args), number=1, repeat=4)[1:])  # the first call is untimed

for T in (256, 1024):
    args = make_inputs(B=4, T=T, H=4, K=32, V=32)
    tn, tc = best_time(naive_gated_delta_rule, args), best_time(chunk_gated_delta_rule_torch, args)
    print(f"T={T:5d}: loop {tn * 1e3:7.1f} ms, chunked {tc * 1e3:6.1f} ms ({tn / tc:.1f}x)")


# %% [markdown]
# ## The Gated DeltaNet mixer
#
# The rule needs, per token and head, a query, a key, a value, a decay and a write strength. The
# mixer makes them from the residual stream $x \in \mathbb{R}^{D}$ (`dim`), following the GDN paper
# and its reference implementation in flash-linear-attention:
#
# 1. `q_proj`, `k_proj` (to $H\cdot K$) and `v_proj` (to $H\cdot V$), each followed by a causal
#    depthwise convolution of width `gdn_conv_size` and SiLU. The short convolution lets a token
#    see its few predecessors directly, which the recurrence alone only does through the state.
# 2. Per-head L2 norm of `q` and `k`. With $\lVert k_t\rVert = 1$ and $\beta_t \in (0,1)$,
#    $I - \beta_t k_t k_t^\top$ has eigenvalues $1 - \beta_t$ and $1$: the transition never amplifies
#    the state (chapter 11 says what that does and does not bound).
# 3. The decay $g_t = -e^{A_{log}}\cdot\mathrm{softplus}(a_t + dt_{bias})$, per head, in fp32, with
#    $a_t$ from `a_proj`; this is Mamba-2's $\Delta_t A$ with $\Delta_t = \mathrm{softplus}(a_t + dt_{bias})$
#    and $A = -e^{A_{log}}$. (The design document squashes with a sigmoid instead; HyMo uses the
#    softplus form of Mamba-2 and GDN.)
# 4. $\beta_t = \sigma(b_t)$ with $b_t$ from `b_proj`.
# 5. The rule; then an RMSNorm over each head's $V$ outputs, multiplied by $\mathrm{SiLU}$ of a
#    gate from `g_proj`, and `o_proj` back to $D$.
#
# One departure is in the sizes. HyMo's heads are many and small, the design document's
# $H = 40$ heads of $K = V = 32$ at the 750M model's $D = 896$, where flash-linear-attention's
# GDN layer defaults to a few wide heads (head size 256, values twice as wide: six heads at width
# 2048) and Qwen3-Next's GDN layers use heads of 128. A head's state holds about $K$ independent
# associations (chapter 10), so a small head remembers less, but there are more of them, and the
# state per layer, $H \cdot K \cdot V$ values, is 40 960 here against 6 × 256 × 512 ≈ 786 k there. The
# chunked rule takes any $K$ and $V$ (the tests use 12 and 20; the Triton wrapper pads a head to a
# power of two of at least 16); which size trains better at this scale is an ablation HyMo leaves open.
#
# The six input projections all read the same $x$, so the forward runs them as three matrix products,
# stacking the weights that can share one (`in_proj_weights`): $q, k, v$, which go through the short
# convolution; the output gate $g$; and $a, b$, which become the decay and the write strength. Fewer,
# wider products keep the GPU busier than six narrow ones (two of them only $H$ wide). Why not one,
# or two? The backward of a split is a concatenation. With a single product, the gradient of the
# prelude's input must be copied into a $[B, T, 2HK + 2HV + 2H]$ buffer beside the gates'
# gradients, and at the 750M shape `torch.compile`'s kernel for that took 0.48 ms per layer (in an
# early profile whose table is not kept). With
# $q, k, v$ in a product of their own, the prelude's backward writes that product's gradient
# directly. The same held, on a smaller scale, for $g$ stacked with $a$ and $b$: the compiled
# backward built their $[B, T, HV + 2H]$ gradient in one kernel that mixed three elementwise
# formulas with a concatenation, and took about 140 µs per layer (`benchmarks/results/
# train_step_profile.txt`), about four times what it moves. With $g$ apart, a compiled GDN block
# (forward and backward, 4 × 4096 tokens, H200) went from 4.51 to 4.45 ms
# (`benchmarks/results/block_step.json`). The parameters stay six separate matrices, which is what the optimiser (chapter 50)
# orthogonalises.
#
# ### The short convolution, document-aware
#
# $y_t = \sum_{j=0}^{W-1} w_{W-1-j}\, x_{t-j}$ per channel, where $x_{t-j}$ is taken only from the
# same document: at a document's start the taps read the carried `cache` (the last $W-1$ inputs of
# that sequence, zeros for a fresh one) instead of the previous document. Without documents, each
# row is one sequence, and the convolution is $W$ shifted multiply-adds on the row with its
# `cache` (or zeros) in front: `torch.compile` fuses them, forward and backward, into a kernel or
# two, where cuDNN's depthwise `conv1d` backward took 1.35 ms per layer in an early 750M profile
# (its table is not kept). The
# shapes never depend on the values, so a decoding step can be captured as a CUDA graph
# (chapter 41). Packed documents (`cu_seqlens`) gather the $W$ taps of every token by index; their
# boundaries' values are checked where reading them is free, on a CPU (on a GPU the read would wait
# for it, and in the mixer the rule that follows reads them).

# %%
#| export
def _check_conv_weight(weight: torch.Tensor, C: int):
    "Refuse a depthwise kernel that is not `[C, W]` with W >= 1 (it would broadcast over the channels)."
    if weight.ndim != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] = [{C}, W] with a window W of at least 1 (an nn.Conv1d depthwise "
                         f"weight [C, 1, W] is weight[:, 0]); got {tuple(weight.shape)}")


def causal_conv1d(
    x: torch.Tensor,  # Inputs [B, T, C]
    weight: torch.Tensor,  # Depthwise kernel [C, W]; weight[:, -1] multiplies the current token
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
    cache: Optional[torch.Tensor] = None,  # The W-1 inputs before x, oldest first, [B, W-1, C] ([N, W-1, C] with cu_seqlens); None is zeros
    output_final_state: bool = False,  # Also return the new cache (the last W-1 inputs of each sequence)
):
    "Causal depthwise convolution that never reads across documents. Returns `(y [B, T, C], cache or None)`."
    if x.ndim != 3: raise ValueError(f"x must be [B, T, C]; got shape {tuple(x.shape)}")
    B, T, C = x.shape
    _check_conv_weight(weight, C)
    W = weight.shape[-1]
    if cu_seqlens is None:  # every row is its own document: W shifted multiply-adds
        if cache is not None and cache.shape != (B, W - 1, C):
            raise ValueError(f"the conv cache must be [{B}, {W - 1}, {C}]; got {tuple(cache.shape)}")
        xp = F.pad(x, (0, 0, W - 1, 0)) if cache is None else torch.cat([cache.to(x.dtype), x], 1)  # (B, W-1+T, C)
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 at least; fp64 (the chapters' exact checks) stays
        xf, wf = xp.to(acc), weight.to(acc)
        y = sum(xf[:, j:j + T] * wf[:, j] for j in range(W)).to(x.dtype)  # summed in fp32, rounded once
        return y, (xp[:, T:].clone() if output_final_state else None)    # the new cache: the last W-1 inputs (a copy,
                                                                          # not a view that would keep all of xp alive)
    N, dev = _check_cu_seqlens(cu_seqlens, B, T, read=None), x.device  # a GPU's values: the rule reads them
    lens = cu_seqlens.diff()
    cache = x.new_zeros(N, W - 1, C) if cache is None else cache.to(x.dtype)  # as the rows' path: the cache in x's dtype
    if cache.shape != (N, W - 1, C): raise ValueError(f"the conv cache must be [{N}, {W - 1}, {C}]; got {tuple(cache.shape)}")
    buf = torch.cat([cache.reshape(N * (W - 1), C), x[0]])                  # (N(W-1) + T, C): caches, then tokens
    doc = torch.repeat_interleave(torch.arange(N, device=dev), lens)       # (T,) document of each token

    def src(d, rel):  # row of buf holding the input at position `rel` (may be negative) of document d
        return torch.where(rel >= 0, N * (W - 1) + cu_seqlens[d] + rel, d * (W - 1) + (W - 1) + rel)

    pos = torch.arange(T, device=dev) - cu_seqlens[doc]                    # (T,) position inside the document
    taps = buf[src(doc[:, None], pos[:, None] - torch.arange(W, device=dev))]  # (T, W, C): x_t, x_{t-1}, ...
    acc = torch.promote_types(x.dtype, torch.float32)
    y = (taps.to(acc) * weight.flip(-1).T.to(acc)).sum(1).to(x.dtype).view(1, T, C)  # (B, T, C), summed in fp32, rounded once
    new_cache = None
    if output_final_state:
        d = torch.arange(N, device=dev)[:, None]
        new_cache = buf[src(d, lens[:, None] - (W - 1) + torch.arange(W - 1, device=dev))]  # (N, W-1, C)
    return y, new_cache


# %% [markdown]
# Both paths equal the library convolution, packed documents do not leak into each other, and a
# carried cache continues a row exactly, a whole chunk or one token at a time (decoding):

# %%
xc, wc = torch.randn(2, 10, 6), torch.randn(6, 4)
ref = F.conv1d(F.pad(xc.transpose(1, 2), (3, 0)), wc[:, None], groups=6).transpose(1, 2)
assert_close(causal_conv1d(xc, wc)[0], ref)                         # shifted multiply-adds
y_packed, _ = causal_conv1d(xc.reshape(1, 20, 6), wc, cu_seqlens=torch.tensor([0, 10, 20]))  # gathered taps
assert_close(y_packed.view(2, 10, 6), ref)
y_a, c_a = causal_conv1d(xc[:, :7], wc, output_final_state=True)   # run 7 tokens, carry the cache ...
y_b, _ = causal_conv1d(xc[:, 7:], wc, cache=c_a)                   # ... then the other 3
assert_close(torch.cat([y_a, y_b], 1), ref)
c, ys = None, []
for t in range(10):                                                # one token per call
    y_t, c = causal_conv1d(xc[:, t:t + 1], wc, cache=c, output_final_state=True)
    ys.append(y_t)
assert_close(torch.cat(ys, 1), ref)
test_fail(lambda: causal_conv1d(xc, wc, cache=c[:, :2]), contains="the conv cache must be [2, 3, 6]")


# %% [markdown]
# ### The prelude: convolution, SiLU, norm
#
# Steps 1 and 2 together are the mixer's *prelude*, which turns the projected $[B, T, 2HK + HV]$
# into the rule's inputs. It is written once, here, as the reference; chapter 14 fuses it into one
# Triton kernel forward and three backward with the same contract, and the mixer uses them on the GPU.

# %%
#| export
def _prelude_shapes(qkv: torch.Tensor, H: int, K: int, V: Optional[int] = None) -> tuple[int, int, int, int]:
    "`(B, T, C, V)` of a fused `[B, T, 2HK + HV]` input, refusing channels that do not split into H heads of K, K and V (V if given)."
    if qkv.ndim != 3: raise ValueError(f"qkv must be [B, T, C]; got shape {tuple(qkv.shape)}")
    B, T, C = qkv.shape
    if H < 1 or K < 1: raise ValueError(f"n_heads={H} and head_k_dim={K} must be at least 1")
    if V is not None and C != H * (2 * K + V):
        raise ValueError(f"qkv has {C} channels: expected 2*H*K + H*V = {H * (2 * K + V)} with H={H}, K={K}, V={V}; "
                         f"check n_heads, head_k_dim and head_v_dim")
    if C - 2 * H * K <= 0 or (C - 2 * H * K) % H:
        raise ValueError(f"qkv has {C} channels: expected 2*H*K + H*V with H={H}, K={K} and a whole V >= 1; "
                         f"check n_heads and head_k_dim")
    return B, T, C, (C - 2 * H * K) // H


def conv_silu_norm(
    qkv: torch.Tensor,  # Projected q, k, v [B, T, 2HK + HV]
    weight: torch.Tensor,  # Depthwise conv weights [2HK + HV, W]; weight[:, -1] multiplies the current token
    n_heads: int,  # H
    head_k_dim: int,  # K; the value head size is (C - 2HK) / H
    cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
    cache: Optional[torch.Tensor] = None,  # The conv window carried from a previous call, [B, W-1, C] ([N, W-1, C] with cu_seqlens)
    output_final_state: bool = False,  # Also return the new conv window
    head_v_dim: Optional[int] = None,  # V, checked against the channels if given (without it, other H and K may split C too)
):
    "Short conv, SiLU, unit L2 norm per head of q and k. Returns `(q [B, T, H, K], k, v [B, T, H, V], conv cache or None)`."
    B, T, C, V = _prelude_shapes(qkv, n_heads, head_k_dim, head_v_dim)
    H, K = n_heads, head_k_dim
    y, cache = causal_conv1d(qkv, weight.to(qkv.dtype), cu_seqlens, cache, output_final_state)
    q, k, v = F.silu(y).split([H * K, H * K, H * V], -1)
    # back to the input's dtype (bf16 under autocast, where the norm itself runs in fp32)
    acc = torch.promote_types(y.dtype, torch.float32)  # fp64 stays fp64
    q = F.normalize(q.view(B, T, H, K).to(acc), dim=-1, eps=1e-6).to(y.dtype)  # (B, T, H, K), unit norm per head
    k = F.normalize(k.view(B, T, H, K).to(acc), dim=-1, eps=1e-6).to(y.dtype)
    return q, k, v.view(B, T, H, V), cache


# %% [markdown]
# ### The decay parameters and their initialisation
#
# `A_log` and `dt_bias` are initialised as in Mamba-2 (the GDN reference code draws $A$ from $(0, 16)$ instead):
# $A \sim \mathcal U[1, 16]$, `A_log` $= \log A$; $\Delta \sim \text{logUniform}[0.001, 0.1]$ (floored
# at $10^{-4}$) and `dt_bias` $= \mathrm{softplus}^{-1}(\Delta) = \Delta + \log(1 - e^{-\Delta})$, so that
# at $a_t = 0$ the step is exactly $\Delta$. The initial per-token decay $\alpha = e^{-A\Delta}$ thus
# spans from $e^{-16\cdot 0.1} \approx 0.2$ (a memory of about one token) to
# $e^{-0.001} \approx 0.999$ (about a thousand tokens): heads start with a spread of time scales.
# Both are excluded from weight decay by their names (the optimiser chapter), and both live in fp32.

# %%
#| export
class GDNState(NamedTuple):
    "What a Gated DeltaNet mixer carries from one call to the next (decoding, or chunks of a long text)."
    recurrent: torch.Tensor  # The delta-rule state S, fp32 [B, H, K, V] ([N, H, K, V] with cu_seqlens)
    conv: torch.Tensor  # The last W-1 inputs of the short convolution, [B, W-1, 2HK + HV] ([N, ...] with cu_seqlens)


def _load_triton(part: str):
    "The Triton function for `part`: 'rule' or 'recurrent' (chapter 13), or 'prelude' (chapter 14); None where Triton or its module is missing."
    try:  # plain imports, which torch.compile can trace
        if part == "rule": from hymo.models.gdn_triton import triton_gated_delta_rule as fn
        elif part == "recurrent": from hymo.models.gdn_triton import fused_recurrent_gated_delta_rule as fn
        else: from hymo.models.gdn_conv_triton import triton_conv_silu_norm as fn
    except ModuleNotFoundError as e:
        if e.name in ("triton", "hymo.models.gdn_triton", "hymo.models.gdn_conv_triton"): return None
        raise  # a real import bug inside the kernel module must not silently fall back
    return fn


# %%
#| export
class GatedDeltaNet(nn.Module):
    "The Gated DeltaNet token mixer: `[B, T, dim]` → `[B, T, dim]`, linear in T, with a fixed-size state per sequence."
    def __init__(self, config: ModelConfig):  # Uses dim, gdn_n_heads, gdn_head_k_dim, gdn_head_v_dim, gdn_conv_size, gdn_chunk_size, gdn_kernel, norm_eps, init_std, n_layers
        super().__init__()
        c = config
        self.config, self.kernel, self.chunk_size = c, c.gdn_kernel, c.gdn_chunk_size
        self.keep_prep = True  # the Triton rule keeps its gates, A [B, T, H, 64] and chunk states for the backward (chapter 13)
        self.n_heads, self.head_k_dim, self.head_v_dim = H, K, V = c.gdn_n_heads, c.gdn_head_k_dim, c.gdn_head_v_dim
        self.q_proj = nn.Linear(c.dim, H * K, bias=False)
        self.k_proj = nn.Linear(c.dim, H * K, bias=False)
        self.v_proj = nn.Linear(c.dim, H * V, bias=False)
        self.a_proj = nn.Linear(c.dim, H, bias=False)  # decay input a_t
        self.b_proj = nn.Linear(c.dim, H, bias=False)  # write strength input b_t
        self.g_proj = nn.Linear(c.dim, H * V, bias=False)  # output gate
        self.o_proj = nn.Linear(H * V, c.dim, bias=False)
        self.q_conv1d, self.k_conv1d = (nn.Conv1d(H * K, H * K, c.gdn_conv_size, groups=H * K, bias=False) for _ in range(2))
        self.v_conv1d = nn.Conv1d(H * V, H * V, c.gdn_conv_size, groups=H * V, bias=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.o_norm = RMSNorm(V, eps=c.norm_eps)  # per head, weight shared by the heads
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise every parameter (works after `to_empty` from the meta device).

        | parameter | init |
        |---|---|
        | q, k, v, a, b, g projections | N(0, init_std²) |
        | o_proj | N(0, (init_std / sqrt(2 n_layers))²), GPT-2's residual scaling |
        | q/k/v_conv1d | PyTorch's Conv1d default, U(±1/sqrt(conv_size)) |
        | A_log | log U[1, 16] |
        | dt_bias | softplus⁻¹(dt), dt ~ logUniform[0.001, 0.1] floored at 1e-4 |
        | o_norm.weight | 1 |
        """
        c = self.config
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj):
            nn.init.normal_(lin.weight, std=c.init_std)
        nn.init.normal_(self.o_proj.weight, std=c.init_std / math.sqrt(2 * c.n_layers))
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d): conv.reset_parameters()
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.o_norm.reset_parameters()

    def forward(self,
                x: torch.Tensor,  # Inputs [B, T, dim]
                cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
                initial_state: Optional[GDNState] = None,  # State carried from a previous call; None starts fresh
                output_final_state: bool = False,  # Also return the `GDNState` after the last token
               ):
        "Mix tokens with the gated delta rule. Returns `y [B, T, dim]`, or `(y, GDNState)` if `output_final_state`."
        if x.ndim != 3 or x.shape[-1] != self.config.dim:
            raise ValueError(f"x must be [B, T, dim={self.config.dim}]; got shape {tuple(x.shape)}")
        if initial_state is not None and not isinstance(initial_state, GDNState):
            raise TypeError(f"initial_state must be the GDNState that a call with output_final_state=True returned "
                            f"(its .recurrent and .conv), not a {type(initial_state).__name__}")
        if initial_state is not None and any(s is None for s in initial_state):  # a missing conv window would read as zeros
            raise ValueError("initial_state needs both parts, .recurrent and .conv, as a call with output_final_state=True "
                             "returns them; GDNState(recurrent, None) would continue with the convolution's window zeroed")
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k_dim, self.head_v_dim
        # the six input projections as three matrix products (the parameters stay separate matrices)
        w_qkv, w_ab = self.in_proj_weights()
        qkv = F.linear(x, w_qkv)                                                  # (B, T, 2HK + HV)
        gate = self.g_proj(x)                                                     # (B, T, HV)
        a, b = F.linear(x, w_ab).split([H, H], -1)                                # (B, T, H) x 2
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # (2HK + HV, W)
        kernel = self.kernel if self.kernel != "auto" else ("triton" if x.is_cuda and _load_triton("rule") else "torch")
        rule = self._rule(kernel)
        if T == 1 and initial_state is not None and not torch.is_grad_enabled():  # a decoding step: the recurrence itself
            rule = _load_triton("recurrent") if kernel == "triton" else naive_gated_delta_rule
        if kernel == "triton" and initial_state is None and not output_final_state:  # the fused prelude (chapter 14)
            q, k, v = _load_triton("prelude")(qkv, w, H, K, cu_seqlens, head_v_dim=V)
            conv_state = None
        else:
            q, k, v, conv_state = conv_silu_norm(qkv, w, H, K, cu_seqlens, None if initial_state is None else initial_state.conv,
                                                 output_final_state, V)              # (B, T, H, K) x 2, (B, T, H, V)
        acc = torch.promote_types(a.dtype, torch.float32)  # the gates in fp32 (fp64 in fp64)
        g = -self.A_log.to(acc).exp() * F.softplus(a.to(acc) + self.dt_bias.to(acc))  # (B, T, H), <= 0
        beta = b.to(acc).sigmoid()                                                    # (B, T, H), in (0, 1)
        o, S = rule(q, k, v, g, beta, None, None if initial_state is None else initial_state.recurrent,
                                  output_final_state, cu_seqlens)                     # (B, T, H, V)
        o = self.o_norm(o) * F.silu(gate.view(B, T, H, V))
        y = self.o_proj(o.reshape(B, T, H * V))
        return (y, GDNState(S, conv_state)) if output_final_state else y

    def in_proj_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        "The stacked input projections: q, k, v `[2HK + HV, dim]` (the prelude's input) and a, b `[2H, dim]`; g has its own product."
        return (torch.cat([p.weight for p in (self.q_proj, self.k_proj, self.v_proj)]),
                torch.cat([p.weight for p in (self.a_proj, self.b_proj)]))

    def _rule(self, kernel: str):
        "The gated-delta-rule function named by `kernel`: 'triton', 'torch' or 'naive'."
        if kernel == "triton":
            check_triton_chunk(self.chunk_size, self.kernel)  # 'auto' on a GPU comes here too: never another length than asked
            rule = _load_triton("rule")
            if rule is None: raise RuntimeError("gdn_kernel='triton' but hymo.models.gdn_triton (or Triton) is not importable; use gdn_kernel='torch'")
            return lambda *a: rule(*a, keep_prep=self.keep_prep)
        if kernel == "torch":
            return lambda *a: chunk_gated_delta_rule_torch(*a, chunk_size=self.chunk_size)
        if kernel == "naive": return naive_gated_delta_rule
        raise ValueError(f"gdn_kernel={kernel!r}: choose 'auto', 'triton', 'torch' or 'naive'")


# %% [markdown]
# A tiny-preset mixer maps `[B, T, dim]` to the same shape; its decays at initialisation cover the
# intended range of time scales:

# %%
from hymo.config import load_config

# %%
cfg = load_config("hymo_tiny").model
mixer = GatedDeltaNet(cfg)
x = torch.randn(2, 70, cfg.dim)
test_eq(mixer(x).shape, x.shape)
A, dt = mixer.A_log.exp(), F.softplus(mixer.dt_bias)
assert ((A >= 1) & (A <= 16)).all() and ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
print("initial per-token decay alpha = exp(-A dt) per head:", (-A * dt).exp().detach().numpy().round(3))

# %% [markdown]
# Every kernel the mixer can pick gives the same output (the naive loop, the chunked torch path; the
# Triton path is checked against both in its own chapter). Changing `kernel` is the one line that
# switches paths.

# %%
x3 = torch.randn(2, 200, cfg.dim)  # four chunks: the state is carried, and decayed, three times
mixer.kernel = "naive"; y_naive, s_naive = mixer(x3, output_final_state=True)
mixer.kernel = "torch"; y_torch, s_torch = mixer(x3, output_final_state=True)
print(f"|y| ~ {y_naive.abs().mean():.1e}; max |torch - naive|: y {(y_torch - y_naive).abs().max():.1e}, "
      f"state {(s_torch.recurrent - s_naive.recurrent).abs().max():.1e}")
assert_close(y_torch, y_naive, atol=1e-6, rtol=1e-4)  # the outputs are about 6e-3: a tolerance on their scale
assert_close(s_torch.recurrent, s_naive.recurrent, atol=1e-6, rtol=1e-4); assert_close(s_torch.conv, s_naive.conv)
mixer.kernel = cfg.gdn_kernel


# %% [markdown]
# Those two share every line of the mixer but the rule. What checks the mixer itself, its
# projections, convolutions, gates and output norm, is the paper's mixer written out token by token
# from the same parameters, with nothing shared: PyTorch's `conv1d` for the short convolutions, the
# decay $\alpha_t = \exp(-e^{A_{\log}}\,\mathrm{softplus}(a_t + \mathrm{dt\_bias}))$ itself rather
# than its log, the recurrence as the boxed equation of chapter 11.

# %%
#| export
def reference_mixer(m: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The Gated DeltaNet mixer written out from the paper, one token at a time, from `m`'s parameters: each of q, k, v
    projected, causally convolved on its own (width W), SiLU; q and k L2-normalised per head; decay
    α = exp(-exp(A_log)·softplus(a + dt_bias)), write strength β = sigmoid(b); S ← αS + β k (v - αSᵀk)ᵀ, o = Sᵀq/√K;
    per-head RMSNorm of o times SiLU of the output gate, then o_proj."""
    B, T, _ = x.shape
    H, K, V = m.n_heads, m.head_k_dim, m.head_v_dim
    def conv(proj, c):  # [B, T, C] -> [B, T, C], causal, depthwise
        u = proj(x).transpose(1, 2)
        return F.conv1d(F.pad(u, (c.kernel_size[0] - 1, 0)), c.weight, groups=u.shape[1]).transpose(1, 2)
    q = F.normalize(F.silu(conv(m.q_proj, m.q_conv1d)).view(B, T, H, K), dim=-1)
    k = F.normalize(F.silu(conv(m.k_proj, m.k_conv1d)).view(B, T, H, K), dim=-1)
    v = F.silu(conv(m.v_proj, m.v_conv1d)).view(B, T, H, V)
    alpha = torch.exp(-m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias))  # (B, T, H) in (0, 1)
    beta = torch.sigmoid(m.b_proj(x))                                          # (B, T, H)
    S, outs = x.new_zeros(B, H, K, V), []
    for t in range(T):
        S = alpha[:, t, :, None, None] * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) / math.sqrt(K))
    o = torch.stack(outs, 1)                                                   # (B, T, H, V)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * m.o_norm.weight
    o = o * F.silu(m.g_proj(x).view(B, T, H, V))
    return m.o_proj(o.reshape(B, T, H * V))


# %% [markdown]
# With unit-scale weights and varied gains, every term is visible in the output (a dropped gate or a
# flipped sign moves it by order one); the mixer's two rules agree with it to fp32 rounding:

# %%
ref_mixer = GatedDeltaNet(cfg)
with torch.no_grad():
    for p in ref_mixer.parameters():
        if p.ndim >= 2: p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    ref_mixer.o_norm.weight.copy_(1 + 0.3 * torch.randn_like(ref_mixer.o_norm.weight))
    ref_mixer.dt_bias.copy_(torch.randn_like(ref_mixer.dt_bias))
y_ref = reference_mixer(ref_mixer, x3)
for kernel in ("naive", "torch"):
    ref_mixer.kernel = kernel
    print(f"{kernel}: |y| ~ {y_ref.abs().mean():.2f}, max |mixer - written out| {(ref_mixer(x3) - y_ref).abs().max():.1e}")
    assert_close(ref_mixer(x3), y_ref, atol=1e-4, rtol=1e-4)

# %% [markdown]
# The chunk length `gdn_chunk_size` is the PyTorch path's to choose (any length gives the same
# output). The Triton kernels of the next chapter are written for chunks of 64 (why 64, and not 32
# or 16, is measured there), so a mixer asked for another length refuses them, including when
# `'auto'` would pick them on a GPU, rather than run 64 without saying so:

# %%
mixer32 = GatedDeltaNet(load_config("hymo_tiny", gdn_chunk_size=32).model)
test_fail(lambda: mixer32._rule("triton"), contains="(which gdn_kernel: auto picks on a GPU) run chunks of 64")  # before importing them
test_eq(mixer32(x).shape, x.shape)  # on a CPU 'auto' is the PyTorch path, at 32

# %% [markdown]
# Carrying the state: running a sequence in two calls (or one token at a time, as in decoding)
# equals running it in one, because the state includes the short convolution's window. A single
# token with a carried state and no gradient (a decoding step, chapter 41) skips the chunked
# machinery, which would pad it to a chunk: it is one step of the recurrence, `naive_gated_delta_rule`
# on one token, or on a GPU the fused recurrent kernel of chapter 13 (one launch).

# %%
y_full = mixer(x)
y1, st = mixer(x[:, :50], output_final_state=True)
test_eq(st.recurrent.shape, (2, cfg.gdn_n_heads, cfg.gdn_head_k_dim, cfg.gdn_head_v_dim))
ys = [y1]
for t in range(50, 70):  # token by token
    y_t, st = mixer(x[:, t:t + 1], initial_state=st, output_final_state=True)
    ys.append(y_t)
assert_close(torch.cat(ys, 1), y_full, atol=1e-5, rtol=1e-5)
with torch.no_grad():  # the same, through the recurrence's own step
    st, ys = None, []
    for t in range(70): y_t, st = mixer(x[:, t:t + 1], initial_state=st, output_final_state=True); ys.append(y_t)
assert_close(torch.cat(ys, 1), y_full, atol=1e-5, rtol=1e-5)

# %% [markdown]
# Packed documents: with `cu_seqlens`, the mixer's output on each document equals running that
# document alone; nothing leaks through the convolution or the state.

# %%
docs = [torch.randn(1, n, cfg.dim) for n in (3, 64, 40)]
cu = torch.tensor([0, 3, 67, 107])
y_packed = mixer(torch.cat(docs, 1), cu_seqlens=cu)
for n, d in enumerate(docs):
    assert_close(y_packed[:, cu[n]:cu[n + 1]], mixer(d), atol=1e-5, rtol=1e-5)


# %% [markdown]
# ## The block
#
# Pre-norm, two residual branches, as every HyMo block: the GDN mixer, then a dense SwiGLU FFN of
# width `ffn_inter_dim` (every GDN block has one; see the design notes on the hybrid stack).

# %%
#| export
class GatedDeltaNetBlock(nn.Module):
    "A GDN block: `x + mixer(norm1(x))`, then `x + ffn(norm2(x))`. `[B, T, dim]` → `[B, T, dim]`."
    def __init__(self, config: ModelConfig):  # Uses the mixer's fields plus ffn_inter_dim
        super().__init__()
        self.config = config
        self.norm1 = RMSNorm(config.dim, config.norm_eps)
        self.mixer = GatedDeltaNet(config)
        self.norm2 = RMSNorm(config.dim, config.norm_eps)
        self.ffn = SwiGLU(config.dim, config.ffn_inter_dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise every parameter: the mixer as in `GatedDeltaNet.reset_parameters`; norms 1;
        ffn.w1, ffn.w3 N(0, init_std²); ffn.w2 N(0, (init_std / sqrt(2 n_layers))²)."""
        c = self.config
        self.norm1.reset_parameters(); self.norm2.reset_parameters()
        self.mixer.reset_parameters()
        nn.init.normal_(self.ffn.w1.weight, std=c.init_std)
        nn.init.normal_(self.ffn.w3.weight, std=c.init_std)
        nn.init.normal_(self.ffn.w2.weight, std=c.init_std / math.sqrt(2 * c.n_layers))

    def forward(self,
                x: torch.Tensor,  # Inputs [B, T, dim]
                cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
                initial_state: Optional[GDNState] = None,  # The mixer's state from a previous call
                output_final_state: bool = False,  # Also return the mixer's `GDNState`
               ):
        "Returns `x [B, T, dim]`, or `(x, GDNState)` if `output_final_state`."
        if output_final_state: h, state = self.mixer(self.norm1(x), cu_seqlens, initial_state, output_final_state=True)
        else: h, state = self.mixer(self.norm1(x), cu_seqlens, initial_state), None
        x = x + h
        x = x + self.ffn(self.norm2(x))
        return (x, state) if output_final_state else x


# %% [markdown]
# Shape, and causality: changing token $t$ never changes an output before $t$, and does change
# outputs after it (the FFN works token by token: only the mixer can carry $t$ forward).

# %%
block = GatedDeltaNetBlock(cfg)
x = torch.randn(2, 80, cfg.dim)
y = block(x)
test_eq(y.shape, x.shape)
x2 = x.clone(); x2[:, 37] += 1.0
y2 = block(x2)
test_eq((y2[:, :37] - y[:, :37]).abs().max().item(), 0.0)
assert (y2[:, 38:] - y[:, 38:]).abs().max() > 1e-3  # later outputs too: the mixer carries token 37 forward

# %% [markdown]
# It builds on the meta device (no memory), and `to_empty` + `reset_parameters` gives a working
# block whose parameters follow the initialisation table:

# %%
with torch.device("meta"):
    meta_block = GatedDeltaNetBlock(cfg)
test_eq(meta_block.mixer.A_log.device.type, "meta")
meta_block.to_empty(device="cpu")
meta_block.reset_parameters()
assert all(p.isfinite().all() for p in meta_block.parameters())
test_close(meta_block.mixer.q_proj.weight.std().item(), cfg.init_std, eps=2e-3)
assert ((meta_block.mixer.A_log.exp() >= 1) & (meta_block.mixer.A_log.exp() <= 16)).all()
test_eq(meta_block(x).shape, x.shape)


# %% [markdown]
# And it learns something that needs the time axis. The target is $x_t + x_{t-1}$: the residual
# path already carries $x_t$, so the block has to add the *previous* input vector, which only the
# convolution and the state can bring to position $t$. Trained on fresh random batches and scored
# on a held-out one, it ends well below what any per-token network can reach. That bound is the
# second run: the same block with the mixer's output projection held at zero is norm + FFN, token
# by token, and its best is to add nothing, a loss of $\mathbb E[x_{t-1}^2] \approx 1$.

# %%
#| fig-alt: "Mean squared error by training step on the add-the-previous-token task: the GDN block's loss ends lower than that of the same block with its mixer off."
def previous_token_fit(block, steps=200, lr=1e-2):
    "Adam on fresh batches of the target x_t + x_{t-1}; the training losses and the held-out loss."
    opt = torch.optim.Adam([p for p in block.parameters() if p.requires_grad], lr=lr)
    gen, losses = torch.Generator().manual_seed(1), []
    task = lambda x: F.mse_loss(block(x), x + F.pad(x[:, :-1], (0, 0, 1, 0)))  # x_{-1} = 0
    for step in range(steps):
        loss = task(torch.randn(8, 64, cfg.dim, generator=gen))
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
    with torch.no_grad(): return losses, task(torch.randn(16, 64, cfg.dim, generator=torch.Generator().manual_seed(99))).item()

torch.manual_seed(0)
losses, held_out = previous_token_fit(GatedDeltaNetBlock(cfg))
torch.manual_seed(0)
per_token = GatedDeltaNetBlock(cfg)
per_token.mixer.o_proj.weight.data.zero_(); per_token.mixer.o_proj.weight.requires_grad_(False)  # no mixer: per token
losses0, held_out0 = previous_token_fit(per_token)
plt.figure(figsize=(4, 2.5)); plt.plot(losses, label="GDN block"); plt.plot(losses0, label="mixer off (per token)")
plt.xlabel("step"); plt.ylabel("MSE"); plt.legend(); plt.title("add the previous token"); plt.tight_layout(); plt.show()
print(f"held-out loss: GDN block {held_out:.3f}, mixer off {held_out0:.3f}")
assert held_out < 0.85 and held_out0 > 0.95

# %% [markdown]
# ## What the state costs
#
# The recurrent state is per *sequence*, fixed in $T$: $H \cdot K \cdot V$ numbers per GDN layer.
# For the 750M design, in fp32, over its 24 GDN layers:

# %%
big = load_config("hymo_750m").model
per_layer = big.gdn_n_heads * big.gdn_head_k_dim * big.gdn_head_v_dim * 4  # bytes, fp32
n_gdn = big.layer_types.count("gdn")
print(f"{per_layer / 2**10:.0f} KiB per layer, {per_layer * n_gdn / 2**20:.2f} MiB per sequence, at any T")
test_eq(per_layer, 163_840); test_eq(n_gdn, 24)

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Is the chunked algorithm an approximation of the recurrence?
# No. It is an exact algebraic rearrangement: unroll the state inside a chunk, notice that the
# corrected values $u_t$ (the rows of $V_{new}$) satisfy a unit lower-triangular system
# $(I + A)V_{new} = \mathrm{diag}(\beta)V - \mathrm{diag}(\beta\Gamma)KS_0$,
# solve it once per chunk ($T_{ut} = (I+A)^{-1}$, giving $W$ and $U$, so $V_{new} = U - WS_0$), and then the output is an inter-chunk
# read of $S_0$ plus causal attention over the chunk with the corrected values. The only
# difference from the loop is floating-point rounding: here about $10^{-6}$ of each tensor's size
# in fp32, outputs, states and all gradients (and $10^{-14}$ in fp64).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why chunks of 64, and not 32 or 128?
# The chunk size trades three costs. Inside a chunk the work per token grows with $C$ (the
# $C\times C$ scores, and the triangular solve, $O(C^3)$ per chunk); the serial steps between
# chunks and the states kept for the backward pass shrink as $T/C$. $C = 64$ makes every
# intra-chunk product a tensor-core-sized tile ($64\times64$, $64\times K$ with $K, V \le 128$) that
# fits in on-chip memory, and it is the default of the reference kernels (flash-linear-attention).
# It is a choice to measure on your GPU, not a law; there is no evidence that 64 is an A100 sweet
# spot in particular. At HyMo's narrow heads ($K = V = 32$) chapter 13 measured $C = 32$ about 4 %
# faster for the rule's kernels on an H200, and kept 64 for simplicity. Note also that the training kernel *is* chunked; a serial time loop is what
# one uses for decoding, one token at a time.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How big is the GDN state, and how does it grow with context?
# $H\cdot K\cdot V$ numbers per layer per *sequence*: $40\cdot32\cdot32 = 40\,960$ floats, 160 KiB in
# fp32, so 3.75 MiB for the 24 GDN layers of the 750M model, whatever $T$ is. It is not a per-token
# cost (an attention KV cache is: it grows linearly with $T$). The short convolution adds $W-1 = 3$
# inputs per channel to what decoding carries.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why must every exponent in the chunked form be non-positive?
# Because the decays compound. Factoring $e^{\gamma_t-\gamma_i} = e^{\gamma_t}e^{-\gamma_i}$ needs
# $e^{-\gamma_i}$, which for a gate of $-2$ per token reaches $e^{128}$ inside a 64-token chunk,
# past fp32's $\approx e^{88.7}$: `inf`, then `inf · 0 = nan`. Computing differences of cumulative
# log-decays, masking the upper triangle with $-\infty$ *before* `exp`, keeps every factor in $[0, 1]$
# (and gives zero gradient, not `nan`, in the masked part). HyMo goes one step further and sums each
# segment $\sum_{i<l\le t} g_l$ directly: a difference of two cumulative sums is `nan` after a
# hard reset ($g = -\infty$) and loses the small gaps after a very strong gate.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why are q and k L2-normalised?
# With $\lVert k_t\rVert = 1$ the transition $I - \beta_t k_t k_t^\top$ has eigenvalues $1-\beta_t$
# (along $k_t$) and $1$ (elsewhere), so with $\beta_t\in(0,1)$ and $\alpha_t \le 1$ it never amplifies
# the state: $\lVert S_t\rVert \le \alpha_t\lVert S_{t-1}\rVert + \beta_t\lVert v_t\rVert$, so nothing
# grows exponentially, and with decays $\alpha_t \le \bar\alpha < 1$ the state stays below
# $\max_t \beta_t\lVert v_t\rVert / (1 - \bar\alpha)$ (beyond its decayed initial value) for any
# sequence length. It also makes $\beta_t$ a true
# learning rate of the online regression (a step of $\beta_t$ moves the prediction $S^\top k_t$ a
# fraction $\beta_t$ of the way to $v_t$). Normalising $q$ bounds the read-out.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Does a Triton kernel need power-of-two head sizes?
# Triton's `tl.arange` and block shapes must be powers of two (and `tl.dot` needs sides of at
# least 16), but the head size itself need not be one. HyMo's kernels pad $K$ and $V$ with zeros to
# the next power of two (at least 16) and slice the result, which is exact: chapter 13 shows why.
# (The autotuner has nothing to do with it.) The PyTorch paths here have no such constraint: the
# checks above use $K = 12$, $V = 20$.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What is the short convolution for?
# The recurrence only reaches the past through a compressed state. A causal depthwise convolution
# of width 4 on $q$, $k$, $v$ gives each token direct, cheap access to its last three neighbours
# (local n-gram features, "previous-token" information that induction-style recall needs), which
# consistently helps linear-attention models. It must respect document boundaries and, when
# decoding, carry its last $W-1$ inputs as part of the state.
# :::
