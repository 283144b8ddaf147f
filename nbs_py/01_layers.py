# %% [markdown]
# # Shared layers
#
# > RMSNorm and the SwiGLU feed-forward: the two small pieces every block uses.

# %%
#| default_exp models.layers

# %% [markdown]
# Every HyMo block is pre-norm: `x = x + mixer(norm(x))`, then `x = x + ffn(norm(x))`. The norm is
# RMSNorm everywhere, and the feed-forward is SwiGLU, in the GDN blocks (dense) and in every expert
# of the MoE; the multi-token-prediction heads use RMSNorm with a plain SiLU MLP (chapter 40). Both
# are defined once, here.

# %%
#| export
import torch
import torch.nn as nn
import torch.nn.functional as F

# %%
from fastcore.test import test_eq, test_close


# %% [markdown]
# ## RMSNorm
#
# For a vector $x \in \mathbb{R}^d$,
# $$\mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\tfrac1d \sum_i x_i^2 + \epsilon}} \odot w .$$
# Unlike LayerNorm it neither subtracts the mean nor adds a bias. It is computed in fp32 even when
# activations are bf16, and rounded to bf16 once, at the end. (PyTorch's `mean` of a bf16 tensor
# already accumulates in fp32; what a bf16 computation would round, to 8 significant bits, are the
# squares, their mean, its reciprocal square root and the two products.)

# %%
#| export
class RMSNorm(nn.Module):
    "Root-mean-square norm over the last dimension, computed in fp32 (fp64 stays fp64), with a learned gain `weight`."
    def __init__(self, dim: int, # Size of the normalised (last) dimension
                 eps: float = 1e-6): # Added to the mean square before the square root
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # x: (..., dim)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 -> fp32; fp64 (the chapters' exact checks) stays
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)

    def reset_parameters(self): nn.init.ones_(self.weight)


# %%
norm = RMSNorm(8)
x = torch.randn(2, 3, 8)
y = norm(x)
test_close(y.pow(2).mean(-1), torch.ones(2, 3), eps=1e-4)
torch.testing.assert_close(y, F.rms_norm(x, (8,), eps=1e-6))


# %% [markdown]
# On bf16 inputs, at the model's width and with a learned gain, the output is the fp64 result
# rounded once: within about half a unit in the last place (ulp) of bf16 (the fp32 result is
# rounded again to bf16, so it can exceed half an ulp by a hair). The same formula evaluated in
# bf16 is several times further off:

# %%
def bf16_ulps(y, ref):
    "Largest error of `y` against `ref` in units of bf16's spacing at `ref` (2^-7 of its power of two)."
    spacing = 2.0 ** torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) * 2**-7
    return ((y.double() - ref) / spacing).abs().max().item()


torch.manual_seed(0)
norm = RMSNorm(896)
with torch.no_grad(): norm.weight.copy_(1 + 0.5 * torch.randn(896))
x = (3 * torch.randn(64, 896)).bfloat16()
ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
w16 = norm.weight.detach().bfloat16()
in_bf16 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w16
print(f"error in bf16 ulps: RMSNorm {bf16_ulps(norm(x), ref):.2f}, the same in bf16 {bf16_ulps(in_bf16, ref):.2f}")
assert norm(x).dtype == torch.bfloat16 and bf16_ulps(norm(x), ref) <= 0.51 and bf16_ulps(in_bf16, ref) > 1


# %% [markdown]
# ## SwiGLU
#
# A gated feed-forward (Shazeer, 2020): $\mathrm{SwiGLU}(x) = W_2\,(\mathrm{SiLU}(W_1 x) \odot W_3 x)$,
# with $W_1, W_3 \in \mathbb{R}^{h \times d}$ and $W_2 \in \mathbb{R}^{d \times h}$. It has
# $3dh$ parameters and costs $2 \cdot 3dh$ FLOPs per token forward: a multiply-add is two FLOPs.
# The names `w1` (gate), `w2` (down) and `w3` (up) follow Llama and DeepSeek checkpoints.

# %%
#| export
class SwiGLU(nn.Module):
    "SwiGLU feed-forward `w2(silu(w1 x) * w3 x)`, no biases."
    def __init__(self, dim: int, # Input and output width
                 inter_dim: int): # Hidden width h
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)  # gate
        self.w2 = nn.Linear(inter_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, inter_dim, bias=False)  # up

    def forward(self, x):  # x: (..., dim) -> (..., dim)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# %%
ffn = SwiGLU(16, 40)
test_eq(ffn(torch.randn(2, 5, 16)).shape, (2, 5, 16))
test_eq(sum(p.numel() for p in ffn.parameters()), 3 * 16 * 40)

# %% [markdown]
# The design document's expert (896 → 2304 → 896) therefore has $3 \cdot 896 \cdot 2304 \approx 6.19$ M
# parameters and costs about 12.4 MFLOPs per token forward.

# %%
test_eq(3 * 896 * 2304, 6_193_152)

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why RMSNorm rather than LayerNorm?
# LayerNorm subtracts the mean, divides by the standard deviation and adds a bias; RMSNorm only
# divides by the root mean square and scales. Zhang and Sennrich (2019) found the re-centring adds
# little to a transformer's quality, while it costs a second statistic per row (the mean, beside the
# mean square), a subtraction over every element and a bias vector per norm. The norm is
# memory-bound, so the saving is mostly in the simpler backward and the parameters it does not
# keep, not in bytes read: both read the row once. Llama, DeepSeek and Qwen all use RMSNorm; so does HyMo.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why pre-norm, `x + f(norm(x))`, and not the original Transformer's `norm(x + f(x))`?
# In pre-norm the residual stream is a plain sum: the gradient reaches every block through an
# identity path that no norm rescales. Post-norm puts a norm on that path at every block; Xiong et
# al. (2020) showed that at initialisation its gradients are largest near the output, so it needs a
# learning-rate warmup to train stably, while pre-norm's stay well-behaved across depth. The price
# of pre-norm is that the stream's scale grows with depth, so the model ends with a final norm
# before the output head (`HyMo.norm`, chapter 41).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why do SwiGLU feed-forwards use a hidden width near $8d/3$ rather than $4d$?
# A SwiGLU has three matrices where the classic MLP has two. With hidden width $h = \tfrac23 \cdot 4d
# = 8d/3$, its $3dh$ parameters and FLOPs equal those of a $4d$ two-matrix MLP, which is how Shazeer
# (2020) compared them. HyMo's dense FFN uses $h = 2560 \approx 2.86\,d$ at $d = 896$: a little
# above $8d/3 \approx 2389$, and a multiple of 256, a width GPU matrix kernels tile without a
# remainder.
# :::
