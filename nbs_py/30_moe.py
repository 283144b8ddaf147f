# %% [markdown]
# # DeepSeekMoE
#
# > Shared and routed SwiGLU experts, top-k routing in fp32, grouped dispatch, capacity with counted drops, and load balancing without an auxiliary loss (a gate bias steered by expert load).

# %%
#| default_exp models.moe

# %% [markdown]
# Every MLA block of HyMo has a mixture-of-experts feed-forward instead of a dense SwiGLU. This
# chapter builds it from the routing rule up: how a token picks its experts, how the tokens of an
# expert are gathered so that the expert runs as one matrix multiply, what a capacity limit does,
# why the router runs in fp32, and how the load is kept balanced. Three balancing rules are
# compared on a deliberately skewed router: the classical auxiliary loss, DeepSeek-V3's sign rule,
# and HyMo's EMA variant.
#
# Of DeepSeekMoE's two ideas (Dai et al., 2024), HyMo takes shared-expert isolation, one expert every
# token runs, and not fine-grained segmentation: its 16 routed experts of width 2304, nearly the
# dense FFN's 2560, with top-2 routing, are as coarse as GShard's or Mixtral's, where DeepSeekMoE
# splits each expert into many narrow ones and routes each token to more of them.

# %%
#| export
from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hymo.config import ModelConfig, validate_part
from hymo.models.layers import SwiGLU

# %%
import time
from contextlib import nullcontext

import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_close, test_fail

from hymo.config import load_config

# %% [markdown]
# ## The arithmetic first
#
# An expert is a SwiGLU (chapter 01) of width $d$ = `dim` and hidden width $h$ = `moe_inter_dim`:
# $3dh$ parameters, and $2 \cdot 3dh$ FLOPs per token forward, because a multiply-add is two FLOPs.
# A layer holds `moe_n_routed` routed experts and `moe_n_shared` shared ones. Every token runs the
# shared experts and `moe_top_k` routed ones, plus the router, an $E \times d$ matrix ($E$ =
# `moe_n_routed`). For the 750M design:

# %%
m = load_config("hymo_750m").model
d, h, E, k, S = m.dim, m.moe_inter_dim, m.moe_n_routed, m.moe_top_k, m.moe_n_shared
expert_params = 3 * d * h
layer_params = (E + S) * expert_params + d * E
active_flops = 2 * (k + S) * expert_params + 2 * d * E
dense_flops = 2 * (E + S) * expert_params + 2 * d * E
print(f"one expert: {expert_params / 1e6:.2f} M params, {2 * expert_params / 1e6:.1f} MFLOPs/token forward")
print(f"one MoE layer: {layer_params / 1e6:.1f} M params stored, {active_flops / 1e6:.1f} MFLOPs/token "
      f"({k} routed + {S} shared + router); running all experts would cost {dense_flops / 1e6:.0f} MFLOPs")
print(f"8 MoE layers: {8 * layer_params / 1e6:.0f} M stored, {8 * (k + S) * expert_params / 1e6:.0f} M active expert params")
test_eq(expert_params, 6_193_152)
test_close(2 * expert_params / 1e6, 12.4, eps=0.05)


# %% [markdown]
# The design document's "sparse FLOPs per layer = 2 × 6.2 M = 12 M" counts each parameter as one
# FLOP and forgets the shared expert: the real figure is three experts of 12.4 MFLOPs each, about
# 37 MFLOPs per token per MoE layer. The ratio it wants, stored over active, is $(E+S)/(k+S) = 17/3$,
# not the document's 8.3× (for the routed experts alone it would be $E/k = 8$).

# %% [markdown]
# ## Routing from scratch
#
# The router is a linear map $W_g \in \mathbb{R}^{E \times d}$ then a score function: for a token
# $x$, `scores` $s = \mathrm{softmax}(W_g x)$ (the design document, DeepSeek-V2) or
# $s = \sigma(W_g x)$ (DeepSeek-V3). Each token picks the $k$ experts with the largest
# $s_i + b_i$, where $b$ is the `gate_bias` used for load balancing (below), and its output is
#
# $$y = \sum_{j=1}^{S} \mathrm{FFN}^{\text{shared}}_j(x) + \gamma_r \sum_{i \in \mathrm{TopK}(s + b)} w_i\, \mathrm{FFN}_i(x),
# \qquad w_i = s_i \ \text{(softmax)} \quad\text{or}\quad w_i = \frac{s_i}{\sum_{j \in \mathrm{TopK}} s_j}\ \text{(sigmoid)} .$$
#
# The bias only decides *which* experts run; the mixing weights $w$ come from the unbiased scores,
# so the balancing never distorts what a chosen expert contributes. Sigmoid scores are independent
# per expert and do not sum to one, so V3 normalises the chosen ones; softmax scores are already a
# distribution and DeepSeek-V2 uses the top-k probabilities as they are. Both then multiply the routed
# sum by a constant, the *routed scaling factor* $\gamma_r$ (`moe_route_scale`): 2.5 in V3, 16 in V2's
# released configuration (1 in V2-Lite's). It sets how much the routed experts weigh against the
# shared one. Normalised sigmoid weights always sum to 1, so V3's 2.5 gives the routed part a weight
# of 2.5 beside the shared expert's 1; the top $k$
# of $E$ softmax probabilities sum to little more than $k/E$ while the router is near uniform
# (V2's 6 of 160: about 0.04, which its 16 brings to about 0.6), so with HyMo's 2 of 16 the routed
# experts start out adding about a sixth of a weight (measured below) beside the shared expert's
# full one. HyMo keeps the design document's $\gamma_r = 1$: the shared expert carries the layer at
# first and the routed part grows as the router learns to be sure. `moe_score_func: sigmoid` with
# `moe_route_scale: 2.5` gives V3's scoring and scaling (V3 also balances by sign, `moe_balance:
# sign`, and first picks groups of experts, which HyMo does not).
# The router learns only through the weights $w$, so
# sigmoid scores need $k \ge 2$: with one expert chosen its normalised weight is exactly 1, whatever
# $W_g$ is, and the router would get no gradient at all (the config refuses that pair).
#
# A naive router, one token at a time, to check the batched one against:

# %%
def route_naive(x, W_g, b, k, score_func="softmax", route_scale=1.0):
    "Route each token of `x` [N, d] separately: list of (experts, weights), the weights times `route_scale` (γ_r)."
    out = []
    for xt in x:
        logits = W_g @ xt
        s = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        chosen = sorted(range(len(s)), key=lambda i: -(s[i] + b[i]).item())[:k]
        w = s[chosen]
        if score_func == "sigmoid": w = w / w.sum()
        out.append((chosen, route_scale * w))
    return out


# %% [markdown]
# What the chosen weights add up to at the start, at the 750M model's router (d = 896, E = 16,
# k = 2, the router's initial N(0, 0.006²), unit-RMS tokens):

# %%
torch.manual_seed(0)
d_r, E_r, k_r = 896, 16, 2
x_i, W_i = torch.randn(2000, d_r), 0.006 * torch.randn(E_r, d_r)  # tokens, the router at its init
routed_sum = {sf: torch.stack([w.sum() for _, w in route_naive(x_i, W_i, torch.zeros(E_r), k_r, sf)]).mean().item()
              for sf in ("softmax", "sigmoid")}
print({sf: round(v, 3) for sf, v in routed_sum.items()}, f"k/E = {k_r / E_r}")
assert k_r / E_r < routed_sum["softmax"] < 0.25 and abs(routed_sum["sigmoid"] - 1) < 1e-5

# %% [markdown]
# The claim about sigmoid scores and $k = 1$, checked: the router's gradient is zero with one expert
# chosen and not with two.

# %%
x_r, W_r = torch.randn(5, 8), torch.randn(4, 8, requires_grad=True)  # 5 tokens, 4 experts
for top_k, no_gradient in ((1, True), (2, False)):
    w_r = torch.stack([w for _, w in route_naive(x_r, W_r, torch.zeros(4), top_k, "sigmoid")])  # (5, top_k)
    (grad_r,) = torch.autograd.grad((w_r * torch.randn_like(w_r)).sum(), W_r)
    assert (grad_r.abs().max() < 1e-6) == no_gradient, (top_k, grad_r.abs().max())


# %% [markdown]
# ## Stacked experts and grouped dispatch
#
# A loop "for each expert, find its tokens" is slow on a GPU: many small matrix multiplies. The fast
# way sorts the $N k$ (token, expert) *assignments* by expert, so that each expert's tokens form one
# contiguous segment, and runs all experts as a single grouped matrix multiply over the segments.
# For that the routed experts' weights are stacked: `w1`, `w3` of shape [E, h, d] and `w2` of shape
# [E, d, h], one `nn.Linear`-style weight per expert.
#
# `counts[e]` is the number of rows of expert `e`; the segments are consecutive, so expert `e` owns
# rows `offs[e-1]:offs[e]` with `offs = cumsum(counts)`. Two implementations of "run each segment
# through its expert" follow: a loop over the segments (it needs the counts on the host, so it calls
# `.tolist()`, a host sync; unavoidable for a Python loop), and `torch._grouped_mm`, one kernel that
# reads the offsets from the device, no sync.

# %%
#| export
def experts_loop(xs: torch.Tensor, # [M, d] assignments sorted by expert
                 counts: torch.Tensor, # [E] rows per expert (int)
                 w1: torch.Tensor, # [E, h, d] gate projections
                 w2: torch.Tensor, # [E, d, h] down projections
                 w3: torch.Tensor, # [E, h, d] up projections
                ) -> torch.Tensor: # [M, d]
    "Run segment `e` of `xs` through SwiGLU expert `e`, one expert at a time (syncs to read `counts`)."
    segments = torch.split(xs, counts.tolist())  # host sync: the loop needs the sizes
    return torch.cat([F.linear(F.silu(F.linear(s, w1[e])) * F.linear(s, w3[e]), w2[e])
                      for e, s in enumerate(segments)])


def experts_grouped(xs: torch.Tensor, # [M, d] assignments sorted by expert
                    counts: torch.Tensor, # [E] rows per expert (int)
                    w1: torch.Tensor, # [E, h, d] gate projections
                    w2: torch.Tensor, # [E, d, h] down projections
                    w3: torch.Tensor, # [E, h, d] up projections
                   ) -> torch.Tensor: # [M, d]
    "Same as `experts_loop` with three `torch._grouped_mm` calls and no host sync."
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of every segment
    w1, w2, w3 = (w.to(xs.dtype) for w in (w1, w2, w3))
    g = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)  # (M, h)
    u = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)  # (M, h)
    return torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)  # (M, d)


HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")

# %% [markdown]
# `_grouped_mm(a, b, offs)` takes `a` as [M, K] and `b` as [E, K, N]; the transpose of a weight
# stored as [E, N, K] is the column-major layout its CUDA kernel wants. On CUDA it needs bf16 (and a
# Hopper GPU); this torch also has a CPU version, so the two paths can be compared here, including an
# empty expert:

# %%
g = torch.Generator().manual_seed(0)
E_, d_, h_ = 4, 16, 24
w1, w3 = torch.randn(2, E_, h_, d_, generator=g) / d_**0.5
w2 = torch.randn(E_, d_, h_, generator=g) / h_**0.5
counts = torch.tensor([5, 0, 9, 2])
xs = torch.randn(int(counts.sum()), d_, generator=g)
ref = experts_loop(xs, counts, w1, w2, w3)
try: torch.testing.assert_close(experts_grouped(xs, counts, w1, w2, w3), ref)
except (RuntimeError, NotImplementedError) as e: print("no CPU _grouped_mm in this torch:", e)
torch.testing.assert_close(ref[:5], F.linear(F.silu(xs[:5] @ w1[0].T) * (xs[:5] @ w3[0].T), w2[0]))


# %% [markdown]
# A decoding step routes one token (per sequence) to $k$ experts: $N k \le E$ assignments. Sorting
# them is overhead, the loop reads the counts on the host, and a host read is what keeps a decoding
# step from being captured as a CUDA graph (chapter 41). For so few tokens there is a third way:
# gather each token's $k$ experts' weights and run them as batched products. It reads each chosen
# expert's three matrices once per assignment, which for one token is what any method reads. For
# many sequences decoded together it reads an expert once per token that chose it, and materialises
# those copies (at the 750M size, 64 sequences would gather about 1.6 GB of bf16 weights per MoE layer and step);
# `generate` decodes one sequence, so HyMo leaves that case as it is.

# %%
#| export
def experts_gathered(x: torch.Tensor, # [N, d] tokens, unsorted
                     idx: torch.Tensor, # [N, k] each token's experts
                     w1: torch.Tensor, # [E, h, d] gate projections
                     w2: torch.Tensor, # [E, d, h] down projections
                     w3: torch.Tensor, # [E, h, d] up projections
                    ) -> torch.Tensor: # [N, k, d] assignment (n, j) through expert idx[n, j]
    "Each token through its own k experts, their weights gathered: no sort, no host sync. For a few tokens (decoding)."
    g = torch.einsum("nd,nkhd->nkh", x, w1[idx])  # (N, k, h)
    u = torch.einsum("nd,nkhd->nkh", x, w3[idx])  # (N, k, h)
    return torch.einsum("nkh,nkdh->nkd", F.silu(g) * u, w2[idx])  # (N, k, d)


def _recording(x: torch.Tensor) -> bool:
    "Whether a CUDA graph is being recorded on `x`'s GPU (never inside torch.compile's tracing, nor on a CPU)."
    return x.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()


# %%
idx_ = torch.tensor([[2, 0], [3, 2]])                      # two tokens, k = 2
x_ = torch.randn(2, d_, generator=g)
ys_ = experts_gathered(x_, idx_, w1, w2, w3)
for n in range(2):
    for j in range(2):
        e = idx_[n, j]
        torch.testing.assert_close(ys_[n, j], F.linear(F.silu(x_[n] @ w1[e].T) * (x_[n] @ w3[e].T), w2[e]))


# %% [markdown]
# ## Capacity: which assignments are dropped
#
# A capacity factor $c$ caps every expert at $C = \lceil c \cdot N k / E \rceil$ assignments per
# forward, $c$ times the mean load. HyMo's rule for an over-full expert: **it keeps the $C$
# assignments with the highest (unbiased) router score, ties going to the earlier token, and drops
# the rest.** Lowest score first, rather than latest token first, so that position in the batch
# does not decide which tokens lose an expert and the assignments the router is least sure of are
# the ones that go. A dropped assignment contributes nothing: that token still gets its other
# experts, the shared expert, and the residual connection, but one of its $k$ terms is missing.
# The kept weights are not renormalised: the dropped expert's score stays in their normaliser (the
# top-$k$ sum with sigmoid scores, the softmax's sum over all experts with softmax), so its router
# row still gets a gradient through the kept terms, and with sigmoid scores the token's routed
# weights sum to less than $\gamma_r$.
#
# What dropping costs: quality for the dropped tokens, and it is never silent here: every forward
# adds the number of dropped assignments to the `dropped_tokens` buffer, reported by
# `update_gate_bias`. What it buys: with experts on other GPUs (expert parallelism) $C$ bounds the
# all-to-all buffers and the busiest GPU's work. HyMo's model code is single-device (FSDP shards
# weights, not experts), so on one GPU the dropped rows are still computed, to keep shapes static
# and the routing free of host syncs, and then multiplied by zero: the cap changes the result, not
# the cost. DeepSeek-V3 trains dropless; the default 1.5 is the design document's choice, and
# `moe_capacity_factor: null` turns it off.
#
# The keep mask comes from two stable sorts: by descending score, then by expert, which leaves the
# assignments grouped by expert and by descending score inside each (ties in token order). An
# assignment's rank inside its expert's segment is its sorted position minus the segment start.
# The counts are a comparison with every expert summed over the assignments, a reduction that
# `torch.compile` fuses. (`index_add_` of ones gives the same counts, but compiled for a GPU it
# fell back to a sorting scatter-add: 0.23 ms per MoE layer at the 750M model's micro-batch on an
# H200, in a profile not kept in `benchmarks/results`. `bincount` would need a host sync to size its output.)

# %%
#| export
def sort_assignments(idx: torch.Tensor, # [N, k] chosen experts
                     score: torch.Tensor, # [N, k] their unbiased router scores
                     n_experts: int, # E
                     capacity: int | None, # C, or None for dropless
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "Order the N·k assignments by expert (then by score, for capacity); return `order` [M], `counts` [E], `keep` [N, k]."
    e = idx.flatten()  # (M,) with M = N*k
    counts = (e[:, None] == torch.arange(n_experts, device=e.device)).sum(0)  # (E,) a reduction: no scatter, no sync
    if capacity is None:
        return torch.argsort(e, stable=True), counts, torch.ones_like(idx, dtype=torch.bool)
    by_score = torch.argsort(score.flatten(), descending=True, stable=True)  # ties: earlier token first
    order = by_score[torch.argsort(e[by_score], stable=True)]  # by expert, then by score
    starts = counts.cumsum(0) - counts  # (E,) first row of each expert's segment
    rank = torch.arange(e.numel(), device=e.device) - starts[e[order]]  # position inside the segment
    keep = torch.empty_like(e, dtype=torch.bool).scatter_(0, order, rank < capacity)
    return order, counts, keep.view_as(idx)


# %% [markdown]
# Checked against a direct reading of the rule, expert by expert:

# %%
N_, k_, E_, C_ = 40, 2, 4, 12
g = torch.Generator().manual_seed(1)
idx = torch.stack([torch.randperm(E_, generator=g)[:k_] for _ in range(N_)])
idx[:20, 0] = 0  # expert 0 is over-full
score = torch.rand(N_, k_, generator=g)
order, cnt, keep = sort_assignments(idx, score, E_, C_)
for e in range(E_):
    mine = [(-score[n, j].item(), n, j) for n in range(N_) for j in range(k_) if idx[n, j] == e]
    kept = {(n, j) for _, n, j in sorted(mine)[:C_]}
    test_eq({(n, j) for _, n, j in mine if keep[n, j]}, kept)
test_eq(int((~keep).sum()), sum(max(0, c - C_) for c in cnt.tolist()))
test_eq(idx.flatten()[order].tolist(), sorted(idx.flatten().tolist()))
print("per-expert counts", cnt.tolist(), "capacity", C_, "dropped", int((~keep).sum()))


# %% [markdown]
# ## Moving rows without a scatter
#
# The experts read the tokens in `order` and their outputs go back to token order. With
# `inv`, the inverse permutation of `order`, both moves are gathers: assignment $m$ reads token
# `order[m] // k`, and token $n$'s $j$-th output is row `inv[n k + j]` of the experts' output.
# Plain indexing (`x[order // k]`) would be right too, but autograd's backward of an index is a
# scatter-add (`index_put_` with `accumulate=True`), which on a GPU adds with atomics or sorts the
# indices first. Here the backward of each move is again a gather through the other permutation,
# followed, for the dispatch, by a sum over the $k$ copies of a token. The change was not timed on
# its own: in the 750M model's profile on an H200, inductor's kernels (which include these moves)
# fell from 29.7 to 28.8 ms per micro-batch in the round that made it.

# %%
#| export
class GatherRows(torch.autograd.Function):
    """`x[idx // k]` for a permutation `idx` of `range(len(x) * k)` with inverse `inv`: each row of x lands k times.
    The backward is a gather through `inv` and a sum over each row's k copies, not a scatter-add."""
    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor, k: int = 1) -> torch.Tensor:  # x: [N, d] -> [N*k, d]
        ctx.save_for_backward(inv)
        ctx.k = k
        return x[idx // k]

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # g: [N*k, d] -> [N, d]
        inv, = ctx.saved_tensors
        gx = g[inv]
        return (gx.view(-1, ctx.k, g.shape[-1]).sum(1) if ctx.k > 1 else gx), None, None, None


# %% [markdown]
# Checked against plain indexing and its autograd, for a dispatch ($k = 2$) and a permutation:

# %%
g = torch.Generator().manual_seed(2)
N_, k_, d_ = 7, 2, 5
perm = torch.randperm(N_ * k_, generator=g)
inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(N_ * k_))
cot = torch.randn(N_ * k_, d_, generator=g)
for kk, rows in ((k_, N_), (1, N_ * k_)):
    xx = torch.randn(rows, d_, generator=g, requires_grad=True)
    ref = xx[perm // kk]
    out = GatherRows.apply(xx, perm, inv, kk)
    assert torch.equal(out, ref)
    (gr,), (go,) = torch.autograd.grad(ref, xx, cot), torch.autograd.grad(out, xx, cot)
    torch.testing.assert_close(go, gr)

# %% [markdown]
# ## Why the router runs in fp32
#
# bf16 has fp32's 8-bit exponent, so it underflows only near fp32's limits (around $10^{-38}$): $10^{-30}$ is fine,
# and a 16-way softmax's probabilities near $1/16$ are nowhere near any underflow. (The design
# document's "probabilities below 6e-8 vanish" is fp16's subnormal limit, not bf16's.) What bf16
# lacks is mantissa: 8 bits of precision (7 stored), 2 to 3 significant digits. The probabilities of a near-uniform
# router differ by a few thousandths (its logits by a few hundredths); rounded to bf16 they collide or swap, and the top-k changes.

# %%
test_eq(torch.tensor(1e-30).bfloat16().item() > 0, True)  # no underflow
test_eq(torch.tensor(1e-30).half().item(), 0.0)  # fp16 does underflow
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 896, generator=g)  # RMS-normed tokens have unit RMS
W_g = torch.randn(16, 896, generator=g) * 0.006  # a freshly initialised router
p32 = (x @ W_g.T).softmax(-1)  # (N, E) the router in fp32
p16 = (x.bfloat16() @ W_g.bfloat16().T).softmax(-1)  # the same router left in bf16
top2 = lambda p: p.topk(2).indices.sort(-1).values
flip = (top2(p32) != top2(p16)).any(-1).float().mean().item()
v = p16.topk(3).values
tie = (v[:, 1] == v[:, 2]).float().mean().item()
print(f"top-2 set differs for {flip:.1%} of tokens; 2nd and 3rd bf16 probabilities tie for {tie:.1%}")
print(f"bf16 spacing at 1/16: {2**-4 * 2**-7:.5f}; median fp32 gap between 2nd and 3rd probability: "
      f"{(p32.sort(-1, descending=True).values[:, 1:3].diff(dim=-1).abs()).median():.5f}")
assert flip > 0.01
flips = lambda p: (top2(p32) != top2(p)).any(-1).float().mean().item()
inputs_only = flips((x.bfloat16().float() @ W_g.T).softmax(-1))  # fp32 router, inputs from a bf16 residual stream
weight_too = flips((x.bfloat16().float() @ W_g.bfloat16().float().T).softmax(-1))  # ... and its weight gathered in bf16
print(f"fp32 router, top-2 changed by bf16 inputs: {inputs_only:.2%}; by bf16 inputs and weight: {weight_too:.2%}")
# the prose's 2.6 %, 0.17 % and 0.32 % (within a few tokens of 4096: summation order may differ between BLAS builds)
assert abs(flip - 0.026) < 0.002 and abs(inputs_only - 0.0017) < 0.0008 and abs(weight_too - 0.0032) < 0.0008


# %% [markdown]
# The gate is an [E, d] matrix multiply, a tiny fraction of the experts' work, so computing it in
# fp32 (autocast off, inputs and weight upcast) costs nothing measurable. Its inputs still arrive
# rounded to bf16 (the residual stream is bf16 under mixed precision), which alone changes the top-2
# set of 0.17 % of the tokens above. On one GPU the weight stays fp32 (the trainer keeps the router
# out of its bf16 copies, chapter 70). Under FSDP the mixed-precision policy gathers every parameter
# of a block in bf16, the router's included, and the weight's rounding brings that to 0.32 %: far
# from the 2.6 % of a bf16 router, and left so, since keeping one small matrix in fp32 would need
# an FSDP group of its own inside every compiled MLA block.

# %% [markdown]
# ## Load balancing
#
# Left alone, a router tends to collapse onto a few experts: they get more tokens, learn faster,
# score higher, and get more tokens. Three cures, which are easy to confuse:
#
# 1. **Auxiliary loss** (Switch Transformer, GShard, DeepSeek-V2). Add
#    $\mathcal{L}_{\text{aux}} = \alpha E \sum_i f_i P_i$ to the loss, with $f_i$ the fraction of
#    assignments that went to expert $i$ and $P_i$ the mean router probability of expert $i$. Its
#    gradient (through $P$) pushes the router itself towards balance, competing with the language
#    model loss; $\alpha$ must be tuned.
# 2. **DeepSeek-V3's aux-loss-free rule.** A per-expert bias $b_i$ is added to the scores for
#    selection only. After every step, with $\bar{c}$ the mean of this step's counts $c_i$:
#    $$b_i \leftarrow b_i + \gamma\, \mathrm{sign}(\bar{c} - c_i).$$
#    No EMA, no dead band (V3 used $\gamma = 0.001$ for its first 14.3 T tokens and 0 for the last 500 B). This is `moe_balance='sign'`.
# 3. **HyMo's EMA variant** (`moe_balance='ema'`, the default). Smooth the counts over steps,
#    $\hat{c} \leftarrow \delta \hat{c} + (1 - \delta) c$ with $\delta$ = `moe_ema_decay` = 0.98
#    (a window of about 50 steps), and move only experts outside a dead band of $\pm\epsilon$ =
#    `moe_dead_band` = 5 % around the mean:
#    $$b_i \leftarrow b_i - \gamma\,[\hat{c}_i > (1+\epsilon)\bar{\hat{c}}] + \gamma\,[\hat{c}_i < (1-\epsilon)\bar{\hat{c}}],$$
#    with $\gamma$ = `moe_bias_speed` = 0.001. The EMA and the band stop the bias from jittering
#    by $\pm\gamma$ every step once balanced; the price is lag.
#
# The design document calls the EMA rule DeepSeek-V3's: it is not, V3's rule is 2. Both bias rules
# are gradient-free: the bias is a buffer updated under `no_grad`, and it never enters the mixing
# weights, so it does not pull on the language model loss.
#
# The counts are summed over all micro-batches of an optimiser step and, under data parallelism,
# over all ranks (one all-reduce), so that every rank applies the same update and the biases stay
# identical. The EMA and the bias change training, so both are saved in the `state_dict`
# (persistent buffers); the design document's non-persistent EMA made an exact resume impossible.
# The accumulators are saved too; the trainer checkpoints between optimiser steps, where they are
# zero, but a `state_dict` taken between two micro-batches (in a notebook, say) keeps them.

# %% [markdown]
# ## The module

# %%
#| export
class SwiGLUExpert(SwiGLU):
    "A SwiGLU feed-forward used as an expert; `reset_parameters(std)` draws its three matrices from N(0, std²)."
    def reset_parameters(self, std: float): # Standard deviation of w1, w2, w3
        for lin in (self.w1, self.w2, self.w3): nn.init.normal_(lin.weight, std=std)


# %% [markdown]
# The `n_shared` shared experts of width $h$ are summed for every token, which is exactly one SwiGLU
# of width $n_{\text{shared}} h$ (the hidden units just sit side by side), so they are stored as one.
#
# The fast path is chosen in one line of `_dispatch`: `_grouped_mm` on CUDA when the experts compute
# in bf16 (bf16 input or a bf16 autocast), else the loop. Setting `moe.impl` to `'loop'` or
# `'grouped'` forces one, for tests. In eval mode, a call with no more assignments than experts (a
# decoding step) skips the sort and takes `experts_gathered`, unless `impl` forces a path; so does
# any call while a CUDA graph is being recorded (a batch of decoding sequences), since the loop's
# host read cannot be recorded.

# %%
#| export
class DeepSeekMoE(nn.Module):
    "Shared + top-k routed SwiGLU experts with an fp32 router and gate-bias load balancing; [B, T, d] -> [B, T, d]."
    IMPLS = ("auto", "loop", "grouped")  # how the routed experts run (`impl`): see `_dispatch`

    def __init__(self, config: ModelConfig): # Uses dim, init_std and the moe_* fields
        super().__init__()
        c = validate_part(config, "moe_")  # a module built from a hand-made config is checked too
        self.dim, self.n_routed, self.top_k, self.inter_dim = c.dim, c.moe_n_routed, c.moe_top_k, c.moe_inter_dim
        self.score_func, self.balance, self.capacity_factor = c.moe_score_func, c.moe_balance, c.moe_capacity_factor
        self.bias_speed, self.ema_decay, self.dead_band, self.init_std = c.moe_bias_speed, c.moe_ema_decay, c.moe_dead_band, c.init_std
        self.route_scale = c.moe_route_scale  # γ_r
        self.impl = "auto"  # one of IMPLS
        self.record_stats = True  # False: a training forward adds nothing to the counts (`stats_paused`)
        E, h, d = self.n_routed, self.inter_dim, self.dim
        self.gate = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, h, d))  # gate projections of the routed experts
        self.w2 = nn.Parameter(torch.empty(E, d, h))  # down projections
        self.w3 = nn.Parameter(torch.empty(E, h, d))  # up projections
        self.shared = SwiGLUExpert(d, c.moe_n_shared * h) if c.moe_n_shared else None
        # Balancing state: all persistent, so that a resumed run is exact.
        self.register_buffer("gate_bias", torch.zeros(E))  # b, added to the scores for selection only
        self.register_buffer("ema_counts", torch.zeros(E))  # ĉ, the EMA of per-step counts ('ema')
        self.register_buffer("expert_counts", torch.zeros(E, dtype=torch.long))  # assignments per expert since the last update
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.long))  # dropped assignments since the last update
        self.reset_parameters()

    def reset_parameters(self):
        """Initialise every parameter and buffer (meta-device friendly).

        | tensor | init |
        | --- | --- |
        | `gate.weight` | N(0, 0.006²): logits ≈ 0.006·√d ≈ 0.2 for unit-RMS input, near-uniform first routing |
        | `w1`, `w2`, `w3`, shared expert | N(0, init_std²); in a `HyMo`, `init_weights` then redraws the `w2`s at the residual scale init_std/√(2 n_layers) (chapter 41) |
        | `gate_bias`, `ema_counts`, `expert_counts`, `dropped_tokens` | 0 |
        """
        nn.init.normal_(self.gate.weight, std=0.006)
        for w in (self.w1, self.w2, self.w3): nn.init.normal_(w, std=self.init_std)
        if self.shared is not None: self.shared.reset_parameters(self.init_std)
        for b in (self.gate_bias, self.ema_counts, self.expert_counts, self.dropped_tokens): b.zero_()

    def gate_forward(self, x: torch.Tensor) -> torch.Tensor: # x: [N, d] -> scores [N, E], fp32 (fp64 for fp64 x)
        "Router scores in fp32 (fp64 stays fp64), autocast off: softmax or sigmoid of `gate(x)`."
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(acc), self.gate.weight.to(acc))  # (N, E)
        return logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()

    def route(self, x: torch.Tensor): # x: [N, d]
        "Top-k experts by `scores + gate_bias`; weights from the unbiased scores. Returns idx, weight, score, all [N, k]."
        scores = self.gate_forward(x)  # (N, E)
        idx = torch.topk(scores + self.gate_bias.float(), self.top_k, dim=-1).indices  # (N, k) selection only
        score = scores.gather(-1, idx)  # (N, k) unbiased
        weight = score / (score.sum(-1, keepdim=True) + 1e-20) if self.score_func == "sigmoid" else score  # (0/0 if all underflow)
        return idx, self.route_scale * weight, score

    def capacity(self, n_tokens: int) -> int | None:
        "C = ceil(capacity_factor · N · k / E) assignments per expert, or None (dropless); `_dispatch` applies it in training only."
        cf = self._capacity_fraction  # made where the factor is set (no str() of a traced SymFloat)
        if cf is None: return None
        # in integers (a traced n_tokens too): 1.1 · 400 · 2 / 8 is 110.00000000000001 in floats, whose ceiling is 111
        return -(-(cf.numerator * n_tokens * self.top_k) // (cf.denominator * self.n_routed))

    @property
    def capacity_factor(self) -> float | None:
        return None if self._capacity_fraction is None else float(self._capacity_fraction)

    @capacity_factor.setter
    def capacity_factor(self, value: float | None):  # 0 would drop every assignment without a word
        if value is not None and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf):
            raise ValueError(f"DeepSeekMoE.capacity_factor={value!r}: give a positive number, or None for dropless routing")
        # a float as the decimal it prints as (1.1 is 11/10, np.float32(1.1) too, 1.0000001 stays itself); 1/3 as 1/3
        self._capacity_fraction = (None if value is None else Fraction(value) if isinstance(value, numbers.Rational)
                                   else Fraction(str(value)))

    @property
    def impl(self) -> str: return self._impl

    @impl.setter
    def impl(self, value: str):  # refused where it is set: a misspelt path would silently run the loop
        if value not in self.IMPLS: raise ValueError(f"DeepSeekMoE.impl={value!r}: choose one of {', '.join(map(repr, self.IMPLS))}")
        self._impl = value

    def forward(self, x: torch.Tensor) -> torch.Tensor: # x: [B, T, d]
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"DeepSeekMoE expects [B, T, {self.dim}], got {list(x.shape)}: reshape the input to (batch, time, dim)")
        B, T, d = x.shape
        xf = x.reshape(B * T, d)  # (N, d)
        idx, weight, score = self.route(xf)  # (N, k) each
        if self.impl == "auto" and not self.training and (B * T * self.top_k <= self.n_routed or _recording(x)):  # decoding
            # (or a CUDA graph being recorded, which cannot hold the loop's host read): no sort, no host sync
            ys, w = experts_gathered(xf, idx, self.w1, self.w2, self.w3), weight  # (N, k, d), (N, k)
        else:
            ys, w = self._dispatch(xf, idx, weight, score)
        y = (ys.to(torch.promote_types(ys.dtype, torch.float32)) * w.unsqueeze(-1)).sum(1).to(x.dtype)  # (N, d), in fp32 (fp64: fp64)
        if self.shared is not None: y = y + self.shared(xf)
        return y.view(B, T, d)

    def _dispatch(self, xf: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, score: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]: # ys [N, k, d] in token order, weights [N, k] (0 where dropped)
        "Sort the assignments by expert, apply the capacity (training), run the experts' segments, and unsort."
        N, d = xf.shape
        cap = self.capacity(N) if self.training else None  # inference is dropless, hence causal
        order, counts, keep = sort_assignments(idx, score, self.n_routed, cap)
        if self.training and self.record_stats:  # balancing statistics (eval batches must not steer the bias)
            self.expert_counts += counts
            self.dropped_tokens += (~keep).sum()
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        cdt = torch.get_autocast_dtype("cuda") if xf.is_cuda and torch.is_autocast_enabled("cuda") else xf.dtype
        mode = self.impl if self.impl != "auto" else ("grouped" if HAS_GROUPED_MM and xf.is_cuda and cdt == torch.bfloat16 else "loop")
        run = experts_grouped if mode == "grouped" else experts_loop
        xs = GatherRows.apply(xf.to(cdt) if mode == "grouped" else xf, order, inv, self.top_k)  # (M, d) sorted by expert
        ys = run(xs, counts, self.w1, self.w2, self.w3)  # (M, d)
        ys = GatherRows.apply(ys, inv, order).view(N, self.top_k, d)  # (N, k, d) back in token order
        return ys, torch.where(keep, weight, 0.0)  # dropped assignments contribute nothing

    @torch.no_grad()
    def update_gate_bias(self) -> dict:
        "Once per optimiser step: all-reduce the counts, update `gate_bias` by `moe_balance`, zero the accumulators."
        if self.gate_bias.dtype != torch.float32 or self.ema_counts.dtype != torch.float32:
            raise TypeError("gate_bias/ema_counts must stay fp32 (a 0.001 step vanishes in bf16): use autocast or "
                            "FSDP mixed precision instead of casting the module with .to(torch.bfloat16)")
        stats = torch.cat([self.expert_counts, self.dropped_tokens.view(1)])  # (E+1,) one all-reduce
        if dist.is_available() and dist.is_initialized(): dist.all_reduce(stats)
        c, dropped = stats[:-1].float(), stats[-1].float()  # (E,), ()
        if self.balance == "ema":
            self.ema_counts.mul_(self.ema_decay).add_(c, alpha=1 - self.ema_decay)
            mean = self.ema_counts.mean()
            up = (self.ema_counts < (1 - self.dead_band) * mean).float()
            down = (self.ema_counts > (1 + self.dead_band) * mean).float()
            self.gate_bias.add_(up - down, alpha=self.bias_speed)
        elif self.balance == "sign":
            self.gate_bias.add_(torch.sign(c.mean() - c), alpha=self.bias_speed)
        self.expert_counts.zero_()
        self.dropped_tokens.zero_()
        total = c.sum().clamp_min(1)
        return {"moe_load_max_mean": c.max() / (total / self.n_routed), "moe_drop_frac": dropped / total}


# %% [markdown]
# A tiny MoE to test with: the `hymo_tiny` sizes, four routed experts, top-2, one shared expert.

# %%
cfg = load_config("hymo_tiny").model
moe = DeepSeekMoE(cfg)
x = torch.randn(2, 32, cfg.dim)
y = moe(x)
test_eq(y.shape, x.shape)
test_fail(lambda: moe(x.view(64, cfg.dim)), contains="expects [B, T, 128]")
test_eq(moe.expert_counts.sum().item(), 2 * 32 * cfg.moe_top_k)
print({n: tuple(p.shape) for n, p in moe.named_parameters()})
test_eq(sum(p.numel() for p in moe.parameters()),
        (cfg.moe_n_routed + cfg.moe_n_shared) * 3 * cfg.dim * cfg.moe_inter_dim + cfg.dim * cfg.moe_n_routed)

# %% [markdown]
# The batched router agrees with the naive one, with a bias that changes the selection, and with V3's
# $\gamma_r = 2.5$:

# %%
for sf, scale in (("softmax", 1.0), ("sigmoid", 1.0), ("sigmoid", 2.5)):
    moe.score_func, moe.route_scale = sf, scale
    moe.gate_bias.copy_(torch.tensor([0.3, 0.0, -0.2, 0.1]))
    xt = torch.randn(10, cfg.dim)
    idx, weight, score = moe.route(xt)
    for n, (chosen, w) in enumerate(route_naive(xt, moe.gate.weight, moe.gate_bias, cfg.moe_top_k, sf, scale)):
        test_eq(idx[n].tolist(), chosen)
        test_close(weight[n], w, eps=1e-6)
moe.score_func, moe.route_scale = "softmax", 1.0
moe.gate_bias.zero_();


# %% [markdown]
# ### The dense reference
#
# The slowest correct MoE runs every expert on every token and masks: a [N, E] matrix of mixing
# weights, zero except at the chosen and kept experts. Both dispatch paths must match it.

# %%
def moe_dense_reference(moe, x):
    "Every routed expert on every token, combined with a dense [N, E] weight matrix; [B, T, d] -> [B, T, d]."
    B, T, d = x.shape
    xf = x.reshape(B * T, d)
    idx, weight, score = moe.route(xf)
    cap = moe.capacity(B * T) if moe.training else None  # the capacity applies in training only
    _, _, keep = sort_assignments(idx, score, moe.n_routed, cap)
    W = torch.zeros(B * T, moe.n_routed).scatter(1, idx, torch.where(keep, weight, 0.0))  # (N, E)
    Y = torch.stack([F.linear(F.silu(F.linear(xf, moe.w1[e])) * F.linear(xf, moe.w3[e]), moe.w2[e])
                     for e in range(moe.n_routed)], 1)  # (N, E, d)
    y = (W.unsqueeze(-1) * Y).sum(1) + (moe.shared(xf) if moe.shared is not None else 0)
    return y.view(B, T, d)


# %% [markdown]
# The capacity is a training-time device: in `eval()` mode (validation, generation) the MoE routes
# dropless, so that whether a token reaches its experts never depends on the other tokens of the
# batch, later ones included, and inference stays causal. In training it does depend on them: which
# assignments an expert drops is decided by score over the whole micro-batch, so a token's output can
# change with the tokens after it. That is the price of a fixed buffer per expert, paid only where the
# capacity bites; a dropless run (`moe_capacity_factor: null`) is causal in training too. The
# comparison therefore runs in training mode, where the capacity bites.

# %%
moe.train()
for cf in (None, 1.0, 0.5):
    moe.capacity_factor = cf
    ref = moe_dense_reference(moe, x)
    moe.impl = "loop"
    torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-4)
    moe.impl = "grouped"
    try: torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-4)
    except (RuntimeError, NotImplementedError) as e: print("no CPU _grouped_mm:", e)
moe.impl, moe.capacity_factor = "auto", cfg.moe_capacity_factor
moe.expert_counts.zero_(); moe.dropped_tokens.zero_();  # these calls were checks, not training steps

# %% [markdown]
# In eval mode a single token (per sequence) takes the gathered path, and it matches the reference
# too; so does a batch of one-token sequences, up to $E / k$ of them:

# %%
moe.eval()
n_tok = moe.n_routed // moe.top_k
x1 = torch.randn(n_tok, 1, cfg.dim)
for xb in (x1[:1], x1):
    torch.testing.assert_close(moe(xb), moe_dense_reference(moe, xb), atol=1e-5, rtol=1e-4)
moe.impl = "loop"  # the sorted path, for comparison
torch.testing.assert_close(moe(x1), moe_dense_reference(moe, x1), atol=1e-5, rtol=1e-4)
moe.impl = "auto"
moe.train();

# %% [markdown]
# On a GPU the grouped path runs in bf16; there it is checked against the loop in the same precision
# (cells marked `gpu` are skipped in CI). The weights are small at initialisation (std 0.02), so an
# absolute tolerance would pass almost anything: the check is on the relative size of the
# difference.

# %%
#| gpu
mg = DeepSeekMoE(cfg).cuda()  # fp32 master weights, bf16 compute through autocast, as in training
xg = torch.randn(4, 64, cfg.dim, device="cuda")
outs = {}
for mg.impl in ("grouped", "loop"):
    mg.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16): yg = mg(xg)
    yg.float().pow(2).mean().backward()
    outs[mg.impl] = (yg, mg.w1.grad.clone(), mg.gate.weight.grad.clone())
rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(outs["grouped"], outs["loop"])]
print("relative differences (output, expert grad, router grad):", [f"{r:.1e}" for r in rel])
assert max(rel) < 1e-2, rel  # bf16 rounding may differ between the paths; a wrong expert or weight is O(1)
with torch.no_grad():  # the check can fail: the grouped path with experts 0 and 1 swapped in w1
    mg.impl, w1 = "grouped", mg.w1.detach().clone()
    mg.w1[[0, 1]] = w1[[1, 0]]
    with torch.autocast("cuda", dtype=torch.bfloat16): bad = mg(xg)
    mg.w1.copy_(w1)
wrong = ((bad.float() - outs["loop"][0].float()).norm() / outs["loop"][0].float().norm()).item()
print(f"with two experts swapped: {wrong:.2f}")
assert wrong > 0.1, wrong
mg.impl = "auto"

# %% [markdown]
# Measured once on one H200 (torch 2.11, bf16 autocast; commit 4d6ec60 of 2 December, before the
# gathered moves and the counts by reduction above, and not kept in `benchmarks/results`), a 750M-design layer (16 experts of
# 896 → 2304, top-2, one shared) on 4 × 4096 tokens, forward + backward: 6.7 ms grouped against
# 16.1 ms for the loop, about 270 TFLOP/s of expert work per MoE layer (shared + 2 routed
# experts), about 180 TFLOP/s counting only the routed experts' products against the whole 6.7 ms (which also
# holds the shared expert, the router and the sort). The grouped products themselves ran at about 570 TFLOP/s in
# round 19's profile (`benchmarks/results/experiments.json`).

# %% [markdown]
# Gradients reach the router through the mixing weights (the selection itself is not
# differentiable), and every routed expert that received a token gets one:

# %%
moe.zero_grad()
moe(x).pow(2).mean().backward()
assert moe.gate.weight.grad.abs().sum() > 0
test_eq((moe.w1.grad.flatten(1).abs().sum(1) > 0).tolist(), (moe.expert_counts > 0).tolist())
moe.zero_grad(); moe.update_gate_bias();


# %% [markdown]
# ## Balancing in action
#
# A deliberately skewed router: synthetic tokens share a common direction $\mu$, and the router rows
# of experts 0–2 are aligned with it, so those experts score highest for almost every token.
# Balancing needs only the routing, so the simulation runs the module's router and counting
# (`route`, `sort_assignments`, `update_gate_bias`) and skips the experts: 1024 tokens per step, 16
# experts, top-2, capacity 1.5, $\gamma = 0.001$, 500 steps per rule. The auxiliary-loss run trains
# the router on $\mathcal{L}_{\text{aux}}$ alone ($\alpha = 0.01$, SGD); the bias rules never touch
# the router weights.

# %%
def skewed_moe(balance, seed=0, **overrides):
    c = load_config("hymo_tiny", dim=32, moe_n_routed=16, moe_top_k=2, moe_inter_dim=8, moe_n_shared=0,
                    moe_balance=balance, moe_capacity_factor=1.5, **overrides).model
    torch.manual_seed(seed)
    moe = DeepSeekMoE(c)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.05)
        moe.gate.weight[:3] += torch.tensor([0.3, 0.2, 0.15])[:, None] * MU
    return moe

def aux_loss(scores, idx, E, alpha=0.01):
    "Switch/GShard balance loss α·E·Σ f_i P_i (f: fraction of assignments, P: mean probability)."
    f = torch.zeros(E).index_add_(0, idx.flatten(), torch.ones(idx.numel())) / idx.numel()
    return alpha * E * (f * scores.mean(0)).sum()

def simulate(rule, steps=500, n_tok=1024, **overrides):
    "Route `steps` batches through a skewed router under `rule`; per step: counts, max/mean load, drop fraction."
    torch.manual_seed(1)
    moe = skewed_moe("none" if rule == "aux" else rule, **overrides)
    opt = torch.optim.SGD(moe.gate.parameters(), lr=2.0)
    hist = []
    for _ in range(steps):
        x = torch.randn(n_tok, 32) + MU  # (N, d)
        with torch.no_grad(): idx, weight, score = moe.route(x)  # balancing needs only the routing
        _, counts, keep = sort_assignments(idx, score, moe.n_routed, moe.capacity(n_tok))
        moe.expert_counts += counts
        moe.dropped_tokens += (~keep).sum()
        if rule == "aux":
            opt.zero_grad(); aux_loss(moe.gate_forward(x), idx, moe.n_routed).backward(); opt.step()
        m = moe.update_gate_bias()
        hist.append((counts, m["moe_load_max_mean"].item(), m["moe_drop_frac"].item()))
    return hist

MU = torch.randn(32, generator=torch.Generator().manual_seed(3))
MU = MU / MU.norm() * 2
t0, threads = time.time(), torch.get_num_threads()
torch.set_num_threads(1)  # tiny ops: thread start-up would cost more than the work
runs = {rule: simulate(rule) for rule in ("none", "aux", "sign", "ema")}
torch.set_num_threads(threads)
print(f"simulated in {time.time() - t0:.1f} s")

# %%
#| fig-alt: "Three panels for the four balancing rules none, aux, sign and ema: the max over mean expert load by step on a log scale, the percentage of dropped assignments by step, and each expert's load over the mean in the last 50 steps."
fig, ax = plt.subplots(1, 3, figsize=(12, 3))
for rule, hist in runs.items():
    ax[0].plot([r for _, r, _ in hist], label=rule)
    ax[1].plot([100 * d for _, _, d in hist], label=rule)
    ax[2].plot(torch.stack([c for c, _, _ in hist[-50:]]).float().mean(0) / (1024 * 2 / 16), "o-", ms=3, label=rule)
ax[0].set(title="max / mean load", xlabel="step", yscale="log")
ax[1].set(title="dropped assignments (%)", xlabel="step")
ax[2].set(title="load / mean, last 50 steps", xlabel="expert")
ax[0].legend(); plt.tight_layout(); plt.show()

# %%
final = {rule: sum(r for _, r, _ in hist[-50:]) / 50 for rule, hist in runs.items()}
print({k: round(v, 2) for k, v in final.items()})
assert final["none"] > 3 and max(final["aux"], final["sign"], final["ema"]) < 1.3
windows = lambda hist: [sum(r for _, r, _ in hist[i:i + 25]) / 25 for i in range(0, len(hist), 25)]  # mean max/mean load
settled_step = lambda hist: next((25 * i for i, w in enumerate(windows(hist)) if max(windows(hist)[i:]) < 1.35), None)  # None: never
for rule in ("sign", "ema"): print(f"{rule:5s} max/mean, 25-step windows:", " ".join(f"{v:.2f}" for v in windows(runs[rule])))
settled = {rule: settled_step(runs[rule]) for rule in ("sign", "ema")}
print("within 1.35 for good from step", settled)
assert (settled["sign"], settled["ema"]) == (100, 300)  # the prose below
assert sum(d for _, _, d in runs["ema"][-50:]) < sum(d for _, _, d in runs["none"][-50:]) / 10

# %% [markdown]
# Without balancing the skewed experts take most of the tokens and the capacity drops a large share
# of assignments. Both bias rules first close the gap at the same pace (their 25-step windows agree
# up to step 75, 2.95 and 2.96 in the one from step 50; the sign rule is there by step 125): at $\gamma$
# per step, the bias has to travel the score gap between favoured and neglected experts. Then they
# differ (the 25-step windows above):
#
# - The **sign rule** reaches the noise floor then (about 1.2 from step 125) and stays there,
#   jittering by $\pm\gamma$.
#   (With 128 assignments per expert on average, the busiest of 16 experts is about 15 % above the
#   mean from sampling noise alone: uniform top-2 draws for 1024 tokens give a max/mean of 1.15 on
#   average. The bias's jitter of $\pm\gamma$ adds a little, so both rules settle near 1.2.)
# - The **EMA rule** overshoots: the EMA reports the load of the last ~50 steps, so the bias keeps
#   moving for tens of steps after the load has crossed the mean, and then has to come back. With
#   softmax scores near $1/E \approx 0.06$, an overshoot of tens of $\gamma$ is large: its windows
#   swing between about 1.5 and 2 up to step 225 and settle near 1.2 only from about step 350, nearly
#   three times as long as the sign rule (within 1.35 for good from step 300 against 100). Once
#   settled, the EMA and the dead band stop the jitter, and it ends slightly better balanced than
#   the sign rule. That is the trade HyMo's variant makes: smoother steady state, slower and
#   oscillating approach. Both of its knobs change the approach (the runs below): a smaller decay
#   (a shorter window, about 10 steps at 0.9) shortens the lag to the sign rule's; and the dead band
#   is what damps the swings: without it the lagging rule keeps overshooting and is still swinging
#   at step 500.
# - The **auxiliary loss** balances too, but only by changing the router weights, the same weights
#   the language-model loss wants to use; here there is no language-model loss to fight it.

# %%
torch.set_num_threads(1)
variants = {"decay 0.9": simulate("ema", moe_ema_decay=0.9), "band 0": simulate("ema", moe_dead_band=0.0)}
torch.set_num_threads(threads)
for name, hist in variants.items():
    step = settled_step(hist)
    print(f"ema, {name:9s}: within 1.35 for good {'never in 500 steps' if step is None else f'from step {step}'}; "
          f"last 50 steps {sum(r for _, r, _ in hist[-50:]) / 50:.2f}")
assert settled_step(variants["decay 0.9"]) <= settled["sign"] < settled["ema"]  # a shorter window: no lag to speak of
assert settled_step(variants["band 0"]) is None  # no band: never within 1.35 for good in 500 steps
draws = torch.rand(500, 1024, 16, generator=torch.Generator().manual_seed(0)).topk(2, -1).indices  # uniform top-2, 500 batches
load = F.one_hot(draws, 16).sum((1, 2)).float()  # (500, 16) assignments per expert
noise_floor = (load.amax(-1) / load.mean(-1)).mean().item()
print(f"uniform top-2 routing of 1024 tokens over 16 experts: max/mean load {noise_floor:.3f} on average")
assert 1.12 < noise_floor < 1.19  # the floor the balanced rules settle just above

# %% [markdown]
# ### Rules in one step
#
# The EMA rule moves an expert only outside the band, and in the right direction:

# %%
m1 = DeepSeekMoE(load_config("hymo_tiny", moe_balance="ema").model)
m1.ema_counts.copy_(torch.tensor([150.0, 100.0, 50.0, 97.0]))  # mean 99.25: one hot, one cold, two inside the band
m1.expert_counts.copy_(torch.tensor([150, 100, 50, 97]))  # a step like the average: the EMA stays put
m1.update_gate_bias()
print("ema", m1.ema_counts.tolist(), "bias", m1.gate_bias.tolist())
test_eq(torch.sign(m1.gate_bias).tolist(), [-1.0, 0.0, 1.0, 0.0])
test_eq(m1.expert_counts.sum().item(), 0)

# %% [markdown]
# The sign rule moves every expert, by exactly $\gamma$:

# %%
m2 = DeepSeekMoE(load_config("hymo_tiny", moe_balance="sign").model)
m2.expert_counts.copy_(torch.tensor([300, 100, 0, 200]))  # mean 150
m2.update_gate_bias()
test_close(m2.gate_bias, torch.tensor([-1.0, 1.0, 1.0, -1.0]) * 0.001, eps=1e-9)


# %% [markdown]
# ### Counted once per forward
#
# The counts are added in the forward, so they are only right if every training forward is a new
# batch. Activation checkpointing breaks that: it frees a block's activations after the forward and
# runs the block's forward *again* during the backward to rebuild them, and that second forward would
# add the same assignments a second time. The rules above would not notice (they compare experts
# with each other), but the counts would no longer mean what they say. `stats_paused` switches the
# counting off for the duration of a backward; the trainer runs every backward inside it.

# %%
#| export
@contextmanager
def stats_paused(moes: list[DeepSeekMoE]): # The layers to pause, e.g. `HyMo.moe_layers()` (listed once: a model has hundreds of modules)
    "Within: the MoE layers `moes` add no balancing statistics. For a backward that re-runs their forward."
    before = [m.record_stats for m in moes]  # restored as they were: a pause inside a pause, or one a caller set
    for m in moes: m.record_stats = False
    try: yield
    finally:
        for m, was in zip(moes, before): m.record_stats = was


# %% [markdown]
# Checkpointed, the MoE counts its batch twice; with the backward inside `stats_paused`, once:

# %%
moe.train()
for paused in (False, True):
    moe.expert_counts.zero_()
    x = torch.randn(2, 32, cfg.dim, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    with stats_paused([moe]) if paused else nullcontext(): y.sum().backward()
    print(f"backward {'inside stats_paused' if paused else 'as it is'}: {moe.expert_counts.sum().item()} counted "
          f"for {2 * 32 * cfg.moe_top_k} assignments")
    test_eq(moe.expert_counts.sum().item(), (1 if paused else 2) * 2 * 32 * cfg.moe_top_k)
    test_eq(moe.record_stats, True)  # switched back on at the end
with stats_paused([moe]):
    with stats_paused([moe]): pass
    test_eq(moe.record_stats, False)  # an inner pause leaves the outer one paused
moe.expert_counts.zero_(); moe.dropped_tokens.zero_();

# %% [markdown]
# ## Meta-device build
#
# The module builds without memory on the meta device; `to_empty` then `reset_parameters` gives
# the same values as a direct build reset from the same seed, buffers included.

# %%
direct = DeepSeekMoE(cfg)
torch.manual_seed(0); direct.reset_parameters()
with torch.device("meta"): lazy = DeepSeekMoE(cfg)
lazy = lazy.to_empty(device="cpu")
torch.manual_seed(0); lazy.reset_parameters()
for (n, a), b in zip(direct.state_dict().items(), lazy.state_dict().values()): torch.testing.assert_close(a, b, msg=n)
test_eq(set(direct.state_dict()) >= {"gate_bias", "ema_counts", "expert_counts", "dropped_tokens"}, True)

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why compute the router in fp32 when everything else is bf16?
# Not because of underflow: bf16 has fp32's 8-bit exponent and represents probabilities down to
# about 1e-38 (the design document's 6e-8 is fp16's limit). The problem is bf16's 8 bits of precision
# (7 stored), 2 to 3 significant digits. A near-uniform router's probabilities differ by thousandths, which bf16
# rounds away or reorders, so the top-k set flips for a noticeable fraction of tokens (measured
# above: a few percent at initialisation). Those flips are noise in the routing and in the load
# statistics. The gate is a d×E matmul, negligible next to the experts, so fp32 is free; autocast
# must be switched off around it, or the matmul silently runs in bf16 anyway.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Is HyMo's EMA gate-bias update what DeepSeek-V3 does?
# No. V3's aux-loss-free balancing adds a per-expert bias to the (sigmoid) scores for selection
# only and, after each step, moves it by b_i += γ·sign(mean load − load_i): no EMA, no dead band.
# HyMo's default is a variant: an EMA of the counts (decay 0.98) and a ±5 % dead band, which stops
# the ±γ jitter once balanced at the cost of lag (the band also damps the overshoot the lag causes:
# without it the EMA rule never settles in the simulation above). Both are available (`moe_balance='sign'` / `'ema'`).
# V3 also keeps a tiny sequence-wise auxiliary loss as a safety net; HyMo uses none.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why must the bias affect only selection, not the mixing weights?
# The bias is a control signal for load, not something the model learned. If it entered the mixing
# weights, raising an idle expert's bias would also scale up that expert's output and distort the
# function the network computes, and the gradient to the router would see the bias. Keeping the
# weights from the unbiased scores means balancing changes which experts run, never how much a
# chosen expert contributes.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What does a capacity factor of 1.5 cost, and does DeepSeek-V3 use one?
# It caps each expert at 1.5× the mean load per forward; over-full experts drop their lowest-score
# assignments, which then contribute nothing (the token keeps its other experts, the shared expert
# and the residual). The cost is quality on the dropped tokens, worst early in training and on
# unusual batches; the benefit is bounded buffers and work per GPU under expert parallelism. V3
# trains dropless. HyMo keeps 1.5 as the design's choice but counts drops and reports the fraction
# every step; with single-device experts the cap saves no compute, so `null` (dropless) is a fair
# alternative.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why must the EMA counts and the bias be saved in the checkpoint?
# They change training: the bias decides routing, and the EMA decides the next bias updates. A
# non-persistent EMA restarts at zero after a resume, so the next updates differ and the run is no
# longer the one you would have had. Every state that influences training belongs in the
# `state_dict`; HyMo registers both as persistent buffers and tests a bit-identical resume.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How many FLOPs does one token spend in a 750M-design MoE layer?
# Each expert is 3·896·2304 ≈ 6.19 M parameters, about 12.4 MFLOPs forward (two per multiply-add).
# A token runs 2 routed experts and 1 shared expert, so ≈ 37 MFLOPs, plus 2·896·16 ≈ 29 kFLOPs of
# router. The layer stores 17 experts (≈ 105 M parameters), 17/3 ≈ 5.7× what one token uses.
# :::
