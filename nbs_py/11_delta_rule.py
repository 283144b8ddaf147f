# %% [markdown]
# # The delta rule and the gated delta rule
#
# > The state as an associative memory, why adding to it collides, the delta rule as online regression, and the gate that makes it Gated DeltaNet.

# %% [markdown]
# Chapter 10 ended with the state update of linear attention, $S_t = S_{t-1} + k_t v_t^\top$. This
# chapter looks at that state as a memory, shows what goes wrong when writes are only ever *added*,
# derives the fix (the delta rule) as one step of gradient descent, and adds the decay gate that
# gives the gated delta rule. Every claim is checked numerically. The exported reference and the
# fast form are in chapter 12.
#
# Layout, used everywhere in HyMo: per head the state is $S \in \mathbb{R}^{K\times V}$ (key-major), a
# write adds $k\,v^\top$, a read is $S^\top q$.

# %%
import math
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from fastcore.test import test_eq, test_close
from torch.testing import assert_close

# %%
torch.manual_seed(0)
K, V = 16, 8


# %% [markdown]
# ## The state is an associative memory
#
# Writing pairs $(k_i, v_i)$ additively gives $S = \sum_i k_i v_i^\top$. Reading with key $k_j$:
# $$S^\top k_j = \sum_i v_i\,(k_i^\top k_j) = \underbrace{v_j\,\lVert k_j\rVert^2}_{\text{the value}} + \underbrace{\sum_{i\ne j} v_i\,(k_i^\top k_j)}_{\text{crosstalk}} .$$
# With orthonormal keys the crosstalk vanishes and the memory is exact, but there are at most $K$
# orthonormal keys in $\mathbb{R}^K$.

# %%
def write_additive(keys, vals):
    "S = sum_i k_i v_i^T: keys [n, K], vals [n, V] -> [K, V]."
    return keys.T @ vals


keys_orth = torch.linalg.qr(torch.randn(K, K))[0].T[:10]      # 10 orthonormal keys, (10, K)
vals = torch.randn(10, V)
S = write_additive(keys_orth, vals)
assert_close(keys_orth @ S, vals, atol=1e-5, rtol=1e-5)       # every read S^T k_j returns v_j

# %% [markdown]
# ## Additive writes collide
#
# Two ways it breaks. First, **rewriting a key adds** instead of replacing: after $(k, v_1)$ then
# $(k, v_2)$ the memory returns $v_1 + v_2$. Second, with **more keys than dimensions** (or just
# non-orthogonal keys) the crosstalk grows: for random unit keys each term $k_i^\top k_j$ has variance
# $1/K$, so the noise in a read grows like $\sqrt{(n-1)/K}$: by $n \approx K$ it is as large as the value
# read, and the memory returns mostly noise.

# %%
k1, v1, v2 = F.normalize(torch.randn(K), dim=0), torch.randn(V), torch.randn(V)
S = torch.outer(k1, v1) + torch.outer(k1, v2)
assert_close(S.T @ k1, v1 + v2)                                # not v2: the old value is still there


def read_error(S, keys, vals):
    "Mean relative error of reading every key back from S."
    return ((keys @ S - vals).norm(dim=-1) / vals.norm(dim=-1)).mean().item()


ns = [2, 4, 8, 16, 32, 64]
err_add = []
for n in ns:
    keys, vals = F.normalize(torch.randn(n, K), dim=-1), torch.randn(n, V)
    err_add.append(read_error(write_additive(keys, vals), keys, vals))
print("additive memory, relative read error:", dict(zip(ns, [round(e, 2) for e in err_add])))
assert err_add[-1] > 1.5 and err_add[0] < err_add[-1]


# %% [markdown]
# ## The delta rule: write the *difference*
#
# Before writing $v_t$ under $k_t$, read what the memory already returns for $k_t$,
# $\hat v_t = S_{t-1}^\top k_t$, and write only the correction, scaled by a strength $\beta_t \in (0,1)$:
# $$S_t = S_{t-1} + \beta_t\,k_t\,(v_t - S_{t-1}^\top k_t)^\top = (I - \beta_t k_t k_t^\top)\,S_{t-1} + \beta_t\,k_t v_t^\top .$$
# This is the delta rule of Widrow and Hoff, used as a fast-weight memory by Schlag, Irie &
# Schmidhuber (2021), who named the model DeltaNet; Yang et al. (2024) made it trainable at scale by
# parallelising it over the sequence in chunks (the WY / UT form of chapter 12). With
# $\lVert k_t\rVert = 1$ and $\beta_t = 1$ the read for $k_t$ afterwards is exactly $v_t$: a rewrite
# *replaces*.

# %%
def delta_write(S, k, v, beta):
    "One delta-rule write: S [K, V], k [K] (unit norm), v [V], beta in (0, 1]."
    return S + beta * torch.outer(k, v - S.T @ k)


S = delta_write(delta_write(torch.zeros(K, V), k1, v1, 1.0), k1, v2, 1.0)
assert_close(S.T @ k1, v2)                                     # the old value is gone

# %% [markdown]
# ### It is one step of online regression
#
# Treat $S$ as the weights of a linear model that should map $k_t$ to $v_t$, with loss
# $\mathcal L_t(S) = \tfrac12\lVert S^\top k_t - v_t\rVert^2$. Its gradient is
# $\nabla_S\mathcal L_t = k_t\,(S^\top k_t - v_t)^\top$, and one step of gradient descent with learning
# rate $\beta_t$ is
# $$S - \beta_t\nabla_S\mathcal L_t = S - \beta_t k_t (S^\top k_t - v_t)^\top = (I - \beta_t k_t k_t^\top) S + \beta_t k_t v_t^\top,$$
# the delta rule. (Linear attention's additive write is the same step on the loss
# $-\langle S^\top k_t, v_t\rangle$, whose gradient $-k_t v_t^\top$ does not depend on $S$: the write
# ignores what is already stored, so a stale value under $k_t$ is never removed, and the loss has no
# minimum.) Autograd agrees:

# %%
S0 = torch.randn(K, V, requires_grad=True)
k_t, v_t, beta_t = F.normalize(torch.randn(K), dim=0), torch.randn(V), 0.7
loss = 0.5 * (S0.T @ k_t - v_t).pow(2).sum()
loss.backward()
with torch.no_grad():
    assert_close(S0 - beta_t * S0.grad, (torch.eye(K) - beta_t * torch.outer(k_t, k_t)) @ S0 + beta_t * torch.outer(k_t, v_t))

# %% [markdown]
# Being regression, repeated passes over a set of pairs solve it when it can be solved: with $n \le K$
# independent keys the memory eventually stores every pair exactly, something no amount of
# additive writing can do. (This cyclic version is Kaczmarz's method. With more pairs than key
# dimensions and a fixed $\beta$ it does not settle on the least-squares fit: it ends in a cycle that
# favours the pairs written last; reaching the least-squares fit needs a shrinking step.) In a model
# each pair is seen once, so the memory is one pass of this, favouring recent writes.

# %%
keys, vals = F.normalize(torch.randn(12, K), dim=-1), torch.randn(12, V)
S, errs = torch.zeros(K, V), []
for epoch in range(100):
    for j in range(12): S = delta_write(S, keys[j], vals[j], 1.0)
    errs.append(read_error(S, keys, vals))
print(f"delta rule, cycling 12 pairs: read error after 1 pass {errs[0]:.3f}, after 100 passes {errs[-1]:.1e}")
print(f"additive memory, same pairs: {read_error(write_additive(keys, vals), keys, vals):.3f}")
assert errs[-1] < 1e-3 and errs[0] > 0.1


# %% [markdown]
# ## Gating: the gated delta rule
#
# The delta rule can overwrite one key but has no way to forget everything at once, as a model
# needs when the topic changes or a document ends. Mamba-2-style gating multiplies the state by a
# data-dependent decay $\alpha_t \in (0, 1]$ before each write. Together (Yang, Kautz & Hatamizadeh,
# *Gated Delta Networks*, ICLR 2025, Eq. 10), per head:
# $$\boxed{S_t = \alpha_t\,(I - \beta_t k_t k_t^\top)\,S_{t-1} + \beta_t\,k_t v_t^\top, \qquad o_t = S_t^\top(\text{scale}\cdot q_t)}$$
# with $S \in \mathbb{R}^{K\times V}$, $\alpha_t = e^{g_t}$, $g_t \le 0$, $\beta_t \in (0, 1)$,
# $q_t, k_t$ L2-normalised and $\text{scale} = K^{-1/2}$ (the paper's Eq. 10 reads $o_t = \mathbf{S}_t q_t$,
# with no scale; $K^{-1/2}$ is flash-linear-attention's default, and the per-head RMSNorm after the
# rule, chapter 12, cancels any constant scale up to its $\epsilon$). Multiplying out,
# $\alpha_t(I - \beta_t k_tk_t^\top)S_{t-1} + \beta_t k_t v_t^\top = S' + \beta_t k_t(v_t - S'^\top k_t)^\top$ with $S' = \alpha_t S_{t-1}$,
# so the same step is computed as
# $$S' = \alpha_t S_{t-1}, \qquad u_t = \beta_t\,(v_t - S'^\top k_t), \qquad S_t = S' + k_t u_t^\top :$$
# decay first, then read the error against the decayed memory, then write. In regression terms,
# $\alpha_t < 1$ is weight decay on the fast weights $S$.
#
# The paper writes the state the other way round, value-major: $\mathbf{S}_t \in \mathbb{R}^{V\times K}$,
# $\mathbf{S}_t = \mathbf{S}_{t-1}\,\alpha_t(I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top$, $o_t = \mathbf{S}_t q_t$.
# HyMo's $S$ is its transpose, $S = \mathbf{S}^\top$ (key-major, as flash-linear-attention's
# kernels store the state by default): transposing the paper's equation gives the box above, term by term.
#
# The decay is kept in log space, $g_t = \log\alpha_t$: products of decays over a span become sums
# (chapter 12 uses cumulative sums of $g$), and decays close to one stay precise: $g = -10^{-4}$ is
# stored within 0.2 % even in bf16 (8 significant bits), while $\alpha = 0.9999$ rounds to exactly 1 in bf16, a
# memory that never forgets. (HyMo computes $g$ in fp32 anyway.) Its sums need fp32 too: a running
# sum of a thousand $g = -10^{-4}$ in bf16 stalls at $-0.031$ (a decay of 0.969, not 0.905), as each
# term falls below half a step of the total; the chunked rule sums $g$ after casting it to fp32.

# %%
def gated_delta_step(S, q, k, v, g, beta, scale):
    "One step of the gated delta rule for one head, decay first. S [K, V] -> (S_t, o_t)."
    S = g.exp() * S
    u = beta * (v - S.T @ k)
    S = S + torch.outer(k, u)
    return S, S.T @ (scale * q)


S_a = S_b = torch.randn(K, V)
for t in range(20):
    q_, k_ = F.normalize(torch.randn(K), dim=0), F.normalize(torch.randn(K), dim=0)
    v_, g_, b_ = torch.randn(V), -torch.rand(()) * 0.5, torch.rand(())
    S_a, o_a = gated_delta_step(S_a, q_, k_, v_, g_, b_, K ** -0.5)
    S_b = g_.exp() * (torch.eye(K) - b_ * torch.outer(k_, k_)) @ S_b + b_ * torch.outer(k_, v_)  # the boxed form
    assert_close(S_a, S_b, atol=1e-5, rtol=1e-5)
assert_close(o_a, S_b.T @ (K ** -0.5 * q_), atol=1e-5, rtol=1e-5)
test_eq(torch.tensor(0.9999, dtype=torch.bfloat16).item(), 1.0)       # alpha = 0.9999 in bf16: never forgets
g_bf = torch.tensor(-1e-4, dtype=torch.bfloat16)                        # g = log(0.9999) in bf16: fine
test_close(g_bf.item(), -1e-4, eps=2e-7)                                # within 0.2 %
test_close(g_bf.float().mul(1000).exp().item(), 0.9999 ** 1000, eps=1e-3)  # decay over 1000 tokens, g summed in fp32
test_close(sum([g_bf] * 1000, torch.tensor(0., dtype=torch.bfloat16)).exp().item(), 0.969, eps=1e-3)  # summed in bf16: stalls

# %% [markdown]
# The delta rule also keeps the state in check without any normalisation of $S$: with
# $\lVert k_t\rVert = 1$, $I - \beta_t k_t k_t^\top$ has eigenvalues $1 - \beta_t$ (along $k_t$) and 1,
# so it never amplifies, and along $k_t$ the new content is a $\beta_t$-weighted mix of the old read
# and $v_t$. (Any $\beta_t \in [0, 2]$ keeps that eigenvalue in $[-1, 1]$; the sigmoid keeps it
# positive. Flash-linear-attention's `allow_neg_eigval` takes $\beta = 2\,\sigma(\cdot)$ instead, for
# the negative eigenvalues that Grazzi et al., ICLR 2025, show help state tracking.) That rules out exponential growth, $\lVert S_t\rVert \le \lVert S_{t-1}\rVert + \beta_t\lVert v_t\rVert$,
# but it is not a bound by itself: keys that keep landing where the state reads nothing ($S^\top k_t = 0$,
# possible whenever $V < K$) erase nothing, and the norm grows like $\sqrt t$ as with additive writes.
# A decay $\alpha_t \le \bar\alpha < 1$ (gating, above) gives a true bound. For typical keys, as here,
# the delta rule's state settles at about the size of a state holding one value per key direction it
# can hold, $\sqrt{\min(K, V)}\,\lVert v\rVert$, while additive writes grow like $\sqrt t$:

# %%
S_add, S_del, norms = torch.zeros(K, V), torch.zeros(K, V), []
for t in range(3000):
    k_, v_ = F.normalize(torch.randn(K), dim=0), torch.randn(V)
    S_add = S_add + torch.outer(k_, v_)
    S_del = delta_write(S_del, k_, v_, torch.rand(()).item())
    norms.append((S_add.norm().item(), S_del.norm().item()))
print(f"|S| after 3000 writes: additive {norms[-1][0]:.0f}, delta rule {norms[-1][1]:.1f} "
      f"(sqrt(min(K, V)) |v| ~ {math.sqrt(min(K, V) * V):.1f})")
assert norms[-1][0] > 10 * norms[-1][1] and max(n[1] for n in norms) < 3 * math.sqrt(K * V)

# %% [markdown]
# Typical, not guaranteed: here $V = 8 < K = 16$, so the state always reads nothing along some key.
# Writing each unit value under such a key erases nothing, and every write adds $\beta^2$ to $\lVert S\rVert^2$:

# %%
S_adv = torch.zeros(K, V)
for t in range(1000):
    k_ = F.normalize(torch.linalg.svd(S_adv.T, full_matrices=True).Vh[-1], dim=0)  # S^T k = 0
    S_adv = delta_write(S_adv, k_, F.normalize(torch.randn(V), dim=0), 0.5)
print(f"|S| after 1000 writes under keys the state reads as zero: {S_adv.norm():.2f} = 0.5 * sqrt(1000)")
test_close(S_adv.norm().item(), 0.5 * math.sqrt(1000), eps=1e-3)

# %% [markdown]
# ## Where GDN sits among its relatives
#
# All of these are linear recurrences $S_t = A_t S_{t-1} + (\text{write})$ read by $o_t = S_t^\top q_t$;
# they differ in the transition $A_t$.
#
# | model | state update | decay | erases a key |
# |---|---|---|---|
# | linear attention | $S_{t-1} + k_t v_t^\top$ | none | no |
# | Mamba-2 (SSD) | $\alpha_t S_{t-1} + k_t v_t^\top$ | scalar per head, $\alpha_t = e^{\Delta_t A}$ | no |
# | GLA | $\mathrm{diag}(\alpha_t)\,S_{t-1} + k_t v_t^\top$ | vector over the $K$ rows | no |
# | DeltaNet | $(I - \beta_t k_t k_t^\top)S_{t-1} + \beta_t k_t v_t^\top$ | none | yes |
# | **Gated DeltaNet** | $\alpha_t(I - \beta_t k_t k_t^\top)S_{t-1} + \beta_t k_t v_t^\top$ | scalar per head | yes |
#
# In Mamba-2's own notation, $h_t = e^{\Delta_t A} h_{t-1} + \Delta_t B_t x_t^\top$, $y_t = h_t^\top C_t$:
# $B_t$ and $C_t$ are input-dependent vectors (projections of the token), playing exactly the roles
# of $k_t$ and $q_t$, and $\Delta_t x_t$ is the value. So Mamba-2 does have learned, data-dependent
# write and read keys; it is gated linear attention with a scalar decay. What GDN adds is the
# **erase term** $-\beta_t k_t k_t^\top S_{t-1}$, which removes the old value stored under $k_t$
# before writing the new one. GLA's per-row decay is finer than a scalar but still decays rather than
# erases: a scalar decay cannot remove one association without fading all the others, and a vector
# decay can only erase along its fixed coordinate axes, not along the direction $k_t$ of a learned key.
#
# The experiment: store 8 pairs under orthonormal keys, then overwrite 4 of them with new values,
# and read all 8 back. Gated linear attention is tried with every constant decay; GDN uses $\beta = 1$
# and no decay ($\alpha = 1$), so what is tested is the erase term alone: this is the plain delta rule.

# %%
#| fig-alt: "Relative read error against the constant decay alpha: gated linear attention's curve stays high at every decay, while the delta rule's error is a much lower horizontal line."
keys, old, new = torch.linalg.qr(torch.randn(K, K))[0].T[:8], torch.randn(8, V), torch.randn(8, V)
stream = [(keys[i], old[i]) for i in range(8)] + [(keys[i], new[i]) for i in range(4)]
target = torch.cat([new[:4], old[4:]])                         # the latest value of every key


def run_gla(alpha):  # Mamba-2-style: S = alpha S + k v^T
    S = torch.zeros(K, V)
    for k_, v_ in stream: S = alpha * S + torch.outer(k_, v_)
    return S


def run_gdn(alpha=1.0, beta=1.0):
    S = torch.zeros(K, V)
    for k_, v_ in stream: S = alpha * (S - beta * torch.outer(k_, S.T @ k_)) + beta * torch.outer(k_, v_)
    return S


alphas = torch.linspace(0.05, 1.0, 40)
err_gla = [read_error(run_gla(a.item()), keys, target) for a in alphas]
err_gdn = read_error(run_gdn(), keys, target)
plt.figure(figsize=(4.5, 2.8))
plt.plot(alphas, err_gla, label="gated linear attention (Mamba-2 style)")
plt.axhline(err_gdn, color="C1", label="delta rule (GDN with α = 1), β = 1")
plt.xlabel("constant decay α"); plt.ylabel("relative read error"); plt.legend(fontsize=7); plt.tight_layout(); plt.show()
print(f"best gated linear attention: {min(err_gla):.2f}; delta rule (GDN with α = 1): {err_gdn:.1e}")
assert min(err_gla) > 0.3 and err_gdn < 1e-5

# %% [markdown]
# No decay works for gated linear attention: a small one forgets the four keys that were not
# rewritten, a large one keeps the stale values of the four that were. The delta rule erases
# exactly the overwritten associations. This is why the delta-rule family does better on
# associative recall and in-context retrieval; the decay is still useful for clearing the memory
# wholesale, and GDN has both.

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why is Gated DeltaNet better than Mamba-2 at associative recall?
# Not because Mamba-2 lacks learned keys: its $B_t$ and $C_t$ are input-dependent vectors, the
# analogues of $k_t$ and $q_t$ (there is no "$b = 1$"). The difference is the transition. Mamba-2
# can only scale the whole state by $\alpha_t$ and add $k_t v_t^\top$, so an old value stored under a
# key lingers until the decay fades it, and fading it fades everything. GDN's erase term
# $-\beta_t k_t k_t^\top S_{t-1}$ removes what is stored under $k_t$ before writing, so a key can be
# overwritten cleanly while the rest of the memory is kept.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Derive the delta rule from a loss.
# Take $\mathcal L(S) = \tfrac12\lVert S^\top k_t - v_t\rVert^2$, the error of the memory's read for
# the current key. $\nabla_S\mathcal L = k_t(S^\top k_t - v_t)^\top$; one gradient step of size $\beta_t$
# gives $S_t = S_{t-1} - \beta_t k_t(S_{t-1}^\top k_t - v_t)^\top = (I - \beta_t k_tk_t^\top)S_{t-1} + \beta_t k_t v_t^\top$.
# Adding the decay, $S_t = \alpha_t(I - \beta_t k_tk_t^\top)S_{t-1} + \beta_t k_t v_t^\top$, is the same step
# taken after shrinking the weights by $\alpha_t$ (weight decay).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What do $\beta_t$ and $\alpha_t$ each control?
# $\beta_t\in(0,1)$ is the learning rate of the write: how far the read for $k_t$ moves toward $v_t$
# ($\beta = 1$ replaces, $\beta \to 0$ ignores the token). $\alpha_t = e^{g_t}\in(0,1]$ forgets the
# whole memory uniformly, per head; in HyMo $g_t = -e^{A_{log}}\,\mathrm{softplus}(a_t + dt_{bias})$,
# Mamba-2's parameterisation, computed in fp32.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How does GDN differ from GLA?
# GLA decays the state with a vector gate, $\mathrm{diag}(\alpha_t)S_{t-1}$, one factor per key
# dimension: finer than GDN's scalar, but it only fades and adds. GDN's transition
# $\alpha_t(I - \beta_t k_tk_t^\top)$ is a scaled generalised Householder matrix: not diagonal, it
# targets the direction $k_t$ to erase it. That also makes the chunked algorithm harder (a
# triangular solve, the UT transform of chapter 12) than GLA's cumulative products.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why is the state stable even without normalising it?
# With $\lVert k_t\rVert = 1$ the matrix $I - \beta_tk_tk_t^\top$ has eigenvalues $1 - \beta_t$ (along
# $k_t$) and $1$, so with $\beta_t \in (0,1)$ and $\alpha_t\le1$ the transition never amplifies the
# state; and a write does not pile up along $k_t$, it moves the read for $k_t$ a fraction $\beta_t$ of
# the way to $v_t$. So nothing grows exponentially ($\lVert S_t\rVert \le \alpha_t\lVert S_{t-1}\rVert + \beta_t\lVert v_t\rVert$),
# and for typical keys the state stays on the scale of the values (the experiment above, against a
# $\sqrt t$ growth for additive writes). It is not a guarantee on its own: keys chosen where the state
# reads zero erase nothing and let it grow like $\sqrt t$. The decay makes it one: with
# $\alpha_t \le \bar\alpha < 1$, $\lVert S\rVert$ stays below $\max\beta_t\lVert v_t\rVert/(1-\bar\alpha)$
# plus the decayed initial state. This is why $k$ is L2-normalised; no "max state norm" trick is
# needed. Unnormalised keys with $\beta_t\lVert k_t\rVert^2 > 2$ would make the
# transition expansive and the recurrence could diverge.
# :::
