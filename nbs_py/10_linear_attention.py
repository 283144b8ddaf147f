# %% [markdown]
# # Linear attention
#
# > From softmax attention to a recurrence with a fixed-size state: the parallel and recurrent forms, and what each costs.

# %% [markdown]
# A GDN block is a kind of *linear attention*. This chapter builds linear attention from softmax
# attention in four small steps, checking the forms against each other numerically, and ends with the two ways to compute
# it (a $T\times T$ matrix, or a loop with a fixed-size state) and what each costs. Nothing here is
# exported: the next two chapters turn it into the gated delta rule and its fast form.

# %%
import math
import time
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from fastcore.test import test_eq, test_close
from torch.testing import assert_close

# %%
torch.manual_seed(0);


# %% [markdown]
# ## Softmax attention and its quadratic cost
#
# For one head with queries, keys and values $Q, K \in \mathbb{R}^{T\times d}$, $V \in \mathbb{R}^{T\times d_v}$,
# causal softmax attention is
# $$O = \mathrm{softmax}\!\Big(\frac{QK^\top}{\sqrt d} + M\Big)\,V, \qquad M_{ti} = 0 \text{ if } i \le t,\ -\infty \text{ otherwise}.$$
# Row $t$ of the $T\times T$ score matrix holds token $t$'s similarity to every earlier token. That
# matrix is the cost: $T^2 d$ multiply-adds ($2T^2 d$ FLOPs) for the scores, $T^2 d_v$ for the weighted sum, $T^2$
# numbers in memory if it is materialised (FlashAttention avoids storing it, not computing it), and,
# when generating, a cache of all $T$ past keys and values that grows with every token.

# %%
def softmax_attention(q, k, v):
    "Causal softmax attention for one head: q, k [T, d], v [T, dv] -> [T, dv]."
    T, d = q.shape
    scores = q @ k.T / math.sqrt(d)                                        # (T, T)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


T, d, dv = 50, 16, 24
q, k, v = torch.randn(T, d), torch.randn(T, d), torch.randn(T, dv)
assert_close(softmax_attention(q, k, v), F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0])


# %% [markdown]
# ## Replace the softmax with a feature map
#
# Write the softmax as a normalised kernel: $o_t = \sum_{i\le t} \kappa(q_t, k_i)\, v_i \,/\, \sum_{i\le t}\kappa(q_t, k_i)$
# with $\kappa(q, k) = e^{q^\top k/\sqrt d}$. Any kernel that is a dot product of features,
# $\kappa(q, k) = \phi(q)^\top\phi(k)$ with $\phi(x) \ge 0$, gives *linear attention* (Katharopoulos et
# al., 2020). Their choice was $\phi(x) = \mathrm{elu}(x) + 1$. In matrix form (the *parallel form*):
# $$O = \frac{(\phi(Q)\phi(K)^\top \odot L)\, V}{(\phi(Q)\phi(K)^\top \odot L)\,\mathbf 1}, \qquad L = \text{lower-triangular ones}.$$

# %%
def phi(x): return F.elu(x) + 1


def linear_attention_parallel(q, k, v):
    "Causal linear attention, parallel form: q, k [T, d], v [T, dv] -> [T, dv]. Builds a T x T matrix."
    A = (phi(q) @ phi(k).T).tril()                                         # (T, T), masked kernel values
    return (A @ v) / A.sum(-1, keepdim=True)


o_par = linear_attention_parallel(q, k, v)
test_eq(o_par.shape, (T, dv))


# %% [markdown]
# ## The same thing as a recurrence
#
# Pull $\phi(q_t)$ out of the sums, because it does not depend on $i$:
# $$o_t = \frac{\phi(q_t)^\top \sum_{i\le t}\phi(k_i)v_i^\top}{\phi(q_t)^\top\sum_{i\le t}\phi(k_i)}
# = \frac{S_t^\top\phi(q_t)}{z_t^\top\phi(q_t)}, \qquad S_t = S_{t-1} + \phi(k_t)\,v_t^\top,\quad z_t = z_{t-1} + \phi(k_t).$$
# The *state* $S_t \in \mathbb{R}^{d\times d_v}$ summarises the whole prefix in a fixed size: each token
# costs $O(d\,d_v)$ whatever $T$ is, and generating needs no growing cache. This is the *recurrent
# form*; it computes exactly the parallel form:

# %%
def linear_attention_recurrent(q, k, v):
    "Causal linear attention, recurrent form: a loop over t with a [d, dv] state."
    S, z, out = torch.zeros(q.shape[1], v.shape[1]), torch.zeros(q.shape[1]), []
    for t in range(len(q)):
        S = S + torch.outer(phi(k[t]), v[t])                               # write
        z = z + phi(k[t])
        out.append(S.T @ phi(q[t]) / (z @ phi(q[t])))                      # read
    return torch.stack(out)


assert_close(linear_attention_recurrent(q, k, v), o_par, atol=1e-5, rtol=1e-5)

# %% [markdown]
# ## Why the mask matters
#
# Without a causal mask the reordering is plain associativity, $(\phi(Q)\phi(K)^\top)V = \phi(Q)(\phi(K)^\top V)$:
# one $d\times d_v$ summary of the whole sequence, read by every query. With the mask each query may
# only see its prefix, so the summary must be a *running* sum, one $S_t$ per position. The loop
# keeps only the current one; computing all of them at once (a cumulative sum) would store
# $T\cdot d\cdot d_v$ numbers, which is why the fast algorithms of the next chapters work on chunks.

# %%
pq, pk = phi(q), phi(k)
assert_close((pq @ pk.T) @ v, pq @ (pk.T @ v), atol=1e-3, rtol=1e-5)        # non-causal: reorder freely
S_all = torch.cumsum(pk[:, :, None] * v[:, None, :], 0)                    # (T, d, dv): every prefix state
o_cum = torch.einsum("tdv,td->tv", S_all, pq) / (pq * pk.cumsum(0)).sum(-1, keepdim=True)
assert_close(o_cum, o_par, atol=1e-5, rtol=1e-5)                           # causal: prefix sums


# %% [markdown]
# Modern linear attention drops the denominator $z_t^\top\phi(q_t)$ (it can get close to zero and
# destabilise training; an output norm does its job). GLA keeps $\phi$ the identity; DeltaNet and
# Gated DeltaNet (and HyMo) use SiLU and then an L2 normalisation of $q$ and $k$. The state update $S_t = S_{t-1} + k_t v_t^\top$ is then the starting point of the next
# chapter, which asks what is wrong with *adding* to a memory.

# %% [markdown]
# ## Time and memory against T
#
# The parallel form does $O(T^2)$ work in a few large matrix products; the recurrent form does
# $O(T)$ work in $T$ tiny steps. Memory: the parallel form holds the $T\times T$ matrix, the recurrent
# form only its $d\times d_v$ state (plus the outputs both must produce). Measured on this CPU for
# one head, $d = d_v = 32$; the memory curve is the size of each form's largest intermediate, computed
# from the shapes.

# %%
#| fig-alt: "Two log-log plots against the sequence length T, for the parallel and the recurrent forms of linear attention: time in ms, and the largest intermediate in KiB, which grows as T squared for the parallel form and stays constant for the recurrent one."
def best_time(f, *args, reps=3):
    "Best wall time of `reps` calls after one untimed call (the first call of an op pays one-off costs), in seconds."
    f(*args)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(*args); ts.append(time.perf_counter() - t0)
    return min(ts)


Ts = [128, 256, 512, 1024, 2048]
res = {"parallel": [], "recurrent": []}
for T_ in Ts:
    x = [torch.randn(T_, 32) for _ in range(3)]
    res["parallel"].append(best_time(linear_attention_parallel, *x))
    res["recurrent"].append(best_time(linear_attention_recurrent, *x, reps=1))
mem = {"parallel": [T_ * T_ * 4 for T_ in Ts], "recurrent": [32 * 32 * 4 + 32 * 4 for _ in Ts]}

fig, ax = plt.subplots(1, 2, figsize=(8, 3))
for name in res:
    ax[0].loglog(Ts, [t * 1e3 for t in res[name]], "o-", label=name)
    ax[1].loglog(Ts, [m / 2**10 for m in mem[name]], "o-", label=name)
ax[0].set(xlabel="T", ylabel="ms", title="time (CPU, one head)"); ax[1].set(xlabel="T", ylabel="KiB", title="largest intermediate")
ax[0].legend(); plt.tight_layout(); plt.show()
for T_, tp, tr in zip(Ts, res["parallel"], res["recurrent"]): print(f"T={T_:5d}: parallel {tp * 1e3:7.2f} ms, recurrent {tr * 1e3:7.1f} ms")

# %% [markdown]
# The slopes tell the story. Memory of the parallel form grows as $T^2$ (slope 2), the state is
# constant. Time of the recurrent form grows linearly (slope 1) but starts far higher: each step is
# a tiny operation, dominated by per-step overhead, and the steps cannot run in parallel. The
# parallel form's quadratic work runs as large matrix products, so at these lengths it is
# much faster here (many times, in the run below) despite doing more arithmetic (the timings are noisy on a shared CPU,
# so they are printed, not tested; the slopes are the point). The parallel form's time slope can come out
# below 2 because at the short lengths each call's fixed costs outweigh the arithmetic; between the
# two longest lengths, where the $T^2$ work dominates, it reaches about 2, or more once the $T \times T$
# matrix outgrows the CPU's caches (printed below). Neither is
# what we want for training: the *chunked* form (chapter
# 12) takes the best of both, matrix products within chunks of 64 tokens and the recurrence between
# them.

# %%
slope = lambda ys: (math.log(ys[-1]) - math.log(ys[0])) / (math.log(Ts[-1]) - math.log(Ts[0]))
print(f"time, slope on this CPU: parallel {slope(res['parallel']):.2f}, recurrent {slope(res['recurrent']):.2f}")
print(f"parallel form from T={Ts[-2]} to {Ts[-1]}: slope {math.log2(res['parallel'][-1] / res['parallel'][-2]):.2f}")

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Where exactly does softmax attention's quadratic cost come from?
# From the $T\times T$ matrix of pairwise scores: every query is compared with every key (the
# softmax is not the cause: FlashAttention normalises a row as it goes, and unnormalised scores
# would cost the same). Computing $QK^\top$ and multiplying by $V$ is
# $O(T^2 d)$ work. FlashAttention removes the $T^2$ *memory* (it never stores the matrix) but not the
# $T^2$ *work*. At generation time the cost shows up as a KV cache growing by one entry per token.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How does a feature map make attention linear?
# If the similarity is a dot product of features, $\kappa(q,k) = \phi(q)^\top\phi(k)$, then
# $\sum_i \phi(q_t)^\top\phi(k_i)\,v_i = \phi(q_t)^\top\sum_i\phi(k_i)v_i^\top$: the sum over keys can be
# computed once, as a $d\times d_v$ state, and read by each query. With a causal mask the sum becomes
# a running sum, updated by one rank-one write per token: $O(T\,d\,d_v)$ work, a constant-size state.
# The exponential kernel of softmax has no finite feature map, which is why linear attention is a
# different model, not an approximation you can make exact.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## If the recurrent form is O(T), why is it slower than the O(T²) form in the plot?
# Because the recurrence is serial: $T$ dependent steps, each a tiny rank-one update that cannot
# keep any processor busy, with per-step overhead dominating. The parallel form does more arithmetic
# in a few big matrix products, which hardware runs near peak. Training kernels therefore use the
# chunked form (matrix products inside chunks, the recurrence between them); the one-step recurrence
# is used for decoding, where tokens arrive one at a time anyway.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What is the state's size, and what does it mean for long contexts?
# $d\times d_v$ per head (plus the normaliser if kept), independent of $T$: for HyMo's GDN heads
# $32\times32$. All of the past must be compressed into it, so it can hold only about $d$
# nearly-orthogonal key-value associations reliably. That bounded capacity is the price of linear
# cost, the reason linear attention is weaker at exact recall than softmax attention, and the
# reason hybrids keep some full-attention layers.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why do modern linear-attention layers drop the normaliser $z_t^\top\phi(q_t)$?
# The denominator can become small (its terms are non-negative but can nearly vanish), so it
# divides by a noisy quantity and destabilises training; it also forces $\phi \ge 0$. Dropping it
# and normalising the output (RMSNorm on the head's output) works better in practice and is what
# GLA, DeltaNet and Gated DeltaNet do. DeltaNet and Gated DeltaNet also L2-normalise $q$ and $k$
# (after a SiLU); GLA uses them as they are.
# :::
