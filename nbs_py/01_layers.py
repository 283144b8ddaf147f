# %% [markdown]
# # Shared layers
#
# > RMSNorm and the SwiGLU feed-forward: the two small pieces every block uses.

# %%
#| default_exp models.layers

# %% [markdown]
# Every HyMo block is pre-norm: `x = x + mixer(norm(x))`, then `x = x + ffn(norm(x))`. The norm is
# RMSNorm and the feed-forward is SwiGLU, in the GDN blocks (dense), in every expert of the MoE,
# and in the multi-token-prediction heads. They are defined once, here.

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
# Unlike LayerNorm it neither subtracts the mean nor adds a bias. The reduction runs in fp32 even
# when activations are bf16: a sum of 896 squares in bf16 keeps only about three significant
# digits.

# %%
#| export
class RMSNorm(nn.Module):
    "Root-mean-square norm over the last dimension, computed in fp32, with a learned gain `weight`."
    def __init__(self, dim: int, # Size of the normalised (last) dimension
                 eps: float = 1e-6): # Added to the mean square before the square root
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # x: (..., dim)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def reset_parameters(self): nn.init.ones_(self.weight)


# %%
norm = RMSNorm(8)
x = torch.randn(2, 3, 8)
y = norm(x)
test_close(y.pow(2).mean(-1), torch.ones(2, 3), eps=1e-4)
torch.testing.assert_close(y, F.rms_norm(x, (8,), eps=1e-6))


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
