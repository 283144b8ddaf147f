# %% [markdown]
# # Multi-Head Latent Attention
#
# > DeepSeek's MLA with grouped key/value up-projection: a 160-number cache per token per layer, decoupled RoPE, causal SDPA for training and absorbed attention for decoding.

# %%
#| default_exp models.mla

# %% [markdown]
# HyMo's 8 full-attention blocks use Multi-Head Latent Attention (MLA; DeepSeek-V2, kept in V3).
# Keys and values are not projected from the residual stream directly: the stream is first
# compressed to one small latent $c^{KV}_t \in \mathbb{R}^{d_c}$ per token, and keys and values are
# up-projected from it. At inference only the latent is cached (plus one small rotary key, see the
# [RoPE chapter](20_rope.ipynb)), and the up-projections are folded into the query and the output,
# so the cache stays small while every head still attends with its own queries.
#
# The chapter builds it in four steps: a from-scratch DeepSeek-style MLA in the paper's notation
# (the reference), the exported module with DeepSeek-V3's parameter names (checked against the
# reference), HyMo's grouped variant, and the cached, absorbed decode path (checked against the
# uncached forward).

# %%
#| export
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hymo.config import ModelConfig
from hymo.models.layers import RMSNorm
from hymo.models.moe import DeepSeekMoE
from hymo.models.rope import apply_rope, check_cu_seqlens, positions_from_cu_seqlens, rope_cos_sin

# %%
import copy
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_close, test_fail
from hymo.config import load_config

# %%
torch.manual_seed(0);


# %% [markdown]
# ## The reference: DeepSeek's MLA in the paper's notation
#
# For token $t$ with hidden state $x_t \in \mathbb{R}^D$, heads $h = 1..H$ (DeepSeek-V2, §2.1; the two
# RMSNorms on the latents are added in its §3.1.2 and are in the released code):
#
# $$c^Q_t = \mathrm{RMSNorm}(W^{DQ} x_t) \in \mathbb{R}^{d_q}, \qquad
#   q^C_{t,h} = W^{UQ}_h c^Q_t \in \mathbb{R}^{d_\text{nope}}, \qquad
#   q^R_{t,h} = \mathrm{RoPE}_t(W^{QR}_h c^Q_t) \in \mathbb{R}^{d_\text{rope}}$$
# $$c^{KV}_t = \mathrm{RMSNorm}(W^{DKV} x_t) \in \mathbb{R}^{d_c}, \qquad
#   k^C_{t,h} = W^{UK}_h c^{KV}_t, \qquad v_{t,h} = W^{UV}_h c^{KV}_t \in \mathbb{R}^{d_v}, \qquad
#   k^R_t = \mathrm{RoPE}_t(W^{KR} x_t) \in \mathbb{R}^{d_\text{rope}}$$
# $$o_{t,h} = \sum_{s \le t} \mathrm{softmax}_s\!\Big(\frac{[q^C_{t,h}; q^R_{t,h}]^\top [k^C_{s,h}; k^R_s]}{\sqrt{d_\text{nope} + d_\text{rope}}}\Big)\, v_{s,h},
#   \qquad y_t = W^O [o_{t,1}; \dots; o_{t,H}] .$$
#
# The rotary key $k^R_t$ has no head index: one per token, shared by every head. The softmax scale
# is $(d_\text{nope} + d_\text{rope})^{-1/2}$, the width of the dot product (DeepSeek-V3 multiplies
# it by a YaRN factor only when it stretches the context; HyMo does not). The reference below is
# written for clarity, not speed: one sequence, a Python loop over heads, an explicit causal mask.

# %%
def naive_mla(x, # [T, D] one sequence
              W_DQ, g_Q, W_UQ, W_QR, # [d_q, D], [d_q], [H, d_nope, d_q], [H, d_rope, d_q]
              W_DKV, g_KV, W_UK, W_UV, W_KR, # [d_c, D], [d_c], [H, d_nope, d_c], [H, d_v, d_c], [d_rope, D]
              W_O, # [D, H * d_v]
              theta=10000.0, eps=1e-6):
    "DeepSeek-V2/V3 MLA from the paper's equations, one head at a time: [T, D] -> [T, D]."
    T, H, d_nope, d_rope = x.shape[0], W_UQ.shape[0], W_UQ.shape[1], W_KR.shape[0]
    rms = lambda v, g: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * g
    cos, sin = rope_cos_sin(torch.arange(T), d_rope, theta)
    rope = lambda v: apply_rope(v[None, :, None], cos, sin)[0, :, 0]  # (T, d_rope), rotated by position
    c_Q, c_KV = rms(x @ W_DQ.T, g_Q), rms(x @ W_DKV.T, g_KV)  # (T, d_q), (T, d_c)
    k_R = rope(x @ W_KR.T)  # (T, d_rope): one rotary key per token, shared by all heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    outs = []
    for h in range(H):
        q = torch.cat([c_Q @ W_UQ[h].T, rope(c_Q @ W_QR[h].T)], -1)  # (T, d_nope + d_rope)
        k = torch.cat([c_KV @ W_UK[h].T, k_R], -1)  # (T, d_nope + d_rope)
        v = c_KV @ W_UV[h].T  # (T, d_v)
        s = (q @ k.T) / math.sqrt(d_nope + d_rope)  # (T, T)
        outs.append(s.masked_fill(~causal, float("-inf")).softmax(-1) @ v)  # (T, d_v)
    return torch.cat(outs, -1) @ W_O.T  # (T, D)


# %% [markdown]
# ## The module
#
# DeepSeek-V3's released checkpoint fuses the paper's matrices, and HyMo keeps its parameter names
# (those of its Hugging Face model; the reference inference code renames them `wq_a`, `wkv_a`, ...)
# so that weights map one to one:
#
# | module | maps | holds |
# |---|---|---|
# | `q_a_proj` | $D \to d_q$ | $W^{DQ}$ |
# | `q_a_layernorm` | RMSNorm($d_q$) | $g_Q$ |
# | `q_b_proj` | $d_q \to H (d_\text{nope} + d_\text{rope})$ | $W^{UQ}_h$ and $W^{QR}_h$, per head `[nope; rope]` |
# | `q_proj` (if $d_q = 0$) | $D \to H (d_\text{nope} + d_\text{rope})$ | queries without the low-rank path |
# | `kv_a_proj_with_mqa` | $D \to d_c + d_\text{rope}$ | $W^{DKV}$ then $W^{KR}$ (the "MQA" rotary key) |
# | `kv_a_layernorm` | RMSNorm($d_c$) | $g_{KV}$ |
# | `kv_b_proj` | $d_c \to G (d_\text{nope} + d_v)$ | $W^{UK}_g$ and $W^{UV}_g$, per group `[k_nope; v]` |
# | `o_proj` | $H d_v \to D$ | $W^O$ |
#
# The one architectural difference from DeepSeek-V3 is $G$, `mla_n_kv_groups`: DeepSeek up-projects a key and a
# value for every head ($G = H$); HyMo up-projects $G = 4$ groups and lets each serve $H/G = 4$
# query heads, as grouped-query attention does. With $G = H$ the module *is* DeepSeek-V3's MLA
# layer (V3's released model also stretches its context with YaRN, which changes the RoPE tables
# and the softmax scale; HyMo trains at its own length and leaves YaRN out; `nope_layers`, an
# ablation, is off by default).
#
# The module checks what it is given: an input that is not [B, T, D], positions by hand outside
# the 0..`max_seq_len`-1 the model trains on, and decoding past `max_seq_len` are refused with a
# message; so are a cache of integer buffers and one whose device count disagrees with its length.
#
# The forward is split into the pieces that the decoder reuses: `queries` and `latents` (what is
# cached), `keys_values` (the up-projection) and `attend`. Attention is
# `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=G < H)`: the grouped keys are
# never repeated in memory. On the H200 (torch 2.11) SDPA picks cuDNN's kernel for it, and at the
# 750M model's shape (4 × 4096 tokens) that is the fastest choice: 2.04–2.08 ms forward and
# backward, against 2.95 ms for FlexAttention, 3.56–3.57 ms for the flash kernels and 2.3 ms for cuDNN
# with the keys and values repeated instead (`benchmarks/results/experiments.json`, round 15). The
# flash kernels run it too, and they need the query/key width to equal the value width:
# $d_\text{nope} + d_\text{rope} = 96 + 32 = 128 = d_v$ in the 750M model.
#
# Packed documents (`cu_seqlens`, batch of one row) attend only within their own document, and
# RoPE positions restart at every document. The reference, `attend_documents_loop`, runs causal SDPA
# once per document: exact, and what the fast path is tested against. On a GPU `attend_documents`
# makes one call of the flash kernel's variable-length form instead (`varlen_flash_attention`):
# it reads the document boundaries itself, so one launch covers the whole row, and its grouped
# keys are never repeated either. The loop was the first version, and on the H200 a document-masked
# 750M step took 17.2 s for 8 micro-batches (3.2 % MFU) against 1.74 s without documents: there
# SDPA picks cuDNN, and cuDNN builds a new execution plan for every new sequence length it meets,
# that is, for nearly every document. One packed row of 16 384 tokens in 17 documents took
# 1.6–2.8 s forward and backward with new lengths (4.2 s the first call, with warm-up), 6 ms with lengths seen before;
# the varlen call takes 2.5–2.8 ms once warm (28.7 ms the first call; the same row as one causal sequence under
# cuDNN: 6.6 ms), and the step 1.93–2.16 s over the rounds that measured it; the latest, with the MTP targets also
# masked per document, 2.11 s (26.2 % MFU, attention counted within documents; 1.70 s without documents)
# (`benchmarks/results/train_step.json`).
#
# `forward_decode`, the cached decoder, is derived in its own section below. Two limits to know:
# the document path reads the longest document's length, which synchronises with the GPU and breaks
# a `torch.compile` graph once per forward, and every row of a decoding batch has the same length.
# The document path runs outside any compiled graph (`torch.compiler.disable`): traced, the loop was
# compiled again for every new number of documents in a row, eight times on the 750M preset before
# `torch.compile` gave up.

# %%
#| exports
def causal_sdpa(q, k, v, scale: float) -> torch.Tensor:
    "Causal `scaled_dot_product_attention` on [B, heads, T, d]; query head h reads key group h // (H/G)."
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _boundaries(q, k, v, cu_seqlens) -> list[int]:
    "The checked boundaries of a packed row `q` [1, T, H, d], `k` and `v` [1, T, G, d], on the host."
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0] == 1 and q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"packed documents are one row: q, k, v must be [1, T, heads, d] of one T; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    return check_cu_seqlens(cu_seqlens, q.shape[1])


def attend_documents_loop(q: torch.Tensor, # [1, T, H, d_qk]
                          k: torch.Tensor, # [1, T, G, d_qk]
                          v: torch.Tensor, # [1, T, G, d_v]
                          cu_seqlens: torch.Tensor, # [N+1] document boundaries
                          scale: float, # Softmax scale
                         ) -> torch.Tensor: # [1, T, H, d_v]
    "The reference: causal SDPA on each document of a packed row in turn."
    b = _boundaries(q, k, v, cu_seqlens)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, heads, T, d)
    return torch.cat([causal_sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale) for s, e in zip(b[:-1], b[1:])], 2).transpose(1, 2)


class VarlenFlash(torch.autograd.Function):
    "Causal attention within each document of a packed row: one flash launch forward, one backward (PyTorch's flash kernels)."
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):  # q [T, H, d], k and v [T, G, d], cu [N+1] int32
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                                          scale=scale)
        ctx.save_for_backward(q, k, v, o, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return o  # (T, H, d_v)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(do.contiguous(), q, k, v, o, lse, cu, cu, ctx.max_len, ctx.max_len,
                                                               0.0, True, rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def varlen_flash_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    "Whether the flash kernels take these: an NVIDIA GPU of compute capability 8.0 or newer, one fp16/bf16 dtype, equal head widths up to 256."
    return (q.is_cuda and torch.version.hip is None and q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
            and q.shape[-1] == v.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(q.device)[0] >= 8)


def varlen_flash_attention(q: torch.Tensor, # [1, T, H, d]
                           k: torch.Tensor, # [1, T, G, d]
                           v: torch.Tensor, # [1, T, G, d]
                           cu_seqlens: torch.Tensor, # [N+1] document boundaries
                           scale: float, # Softmax scale
                          ) -> torch.Tensor: # [1, T, H, d]
    "`attend_documents_loop` in one flash launch (see `varlen_flash_ok` for what it needs)."
    b = _boundaries(q, k, v, cu_seqlens)  # reads the GPU once
    max_len = max(e - s for s, e in zip(b, b[1:]))  # the kernel's grid
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    q, k, v = (t[0] if t.stride(-1) == 1 else t[0].contiguous() for t in (q, k, v))  # (T, heads, d)
    return VarlenFlash.apply(q, k, v, cu, max_len, scale)[None]


@torch.compiler.disable
def attend_documents(q: torch.Tensor, # [1, T, H, d_qk]
                     k: torch.Tensor, # [1, T, G, d_qk]
                     v: torch.Tensor, # [1, T, G, d_v]
                     cu_seqlens: torch.Tensor, # [N+1] document boundaries
                     scale: float, # Softmax scale
                    ) -> torch.Tensor: # [1, T, H, d_v]
    "Causal attention within each document of a packed row: one varlen flash launch where it runs, else the loop."
    if varlen_flash_ok(q, k, v): return varlen_flash_attention(q, k, v, cu_seqlens, scale)
    return attend_documents_loop(q, k, v, cu_seqlens, scale)


class MultiHeadLatentAttention(nn.Module):
    "DeepSeek-V3 MLA with `mla_n_kv_groups` key/value groups: [B, T, D] -> [B, T, D]."
    def __init__(self, config: ModelConfig, # Uses dim, norm_eps, init_std, n_layers, rope_theta, nope_layers and the mla_* fields
                 layer_idx: int = 0): # Block index; blocks in `config.nope_layers` skip RoPE
        super().__init__()
        c = self.config = config
        self.n_heads, self.n_kv_groups = c.mla_n_heads, c.mla_n_kv_groups
        self.d_nope, self.d_rope, self.d_v = c.mla_qk_nope_dim, c.mla_qk_rope_dim, c.mla_v_head_dim
        self.d_c, self.q_lora_rank = c.mla_kv_lora_rank, c.mla_q_lora_rank
        if self.n_heads % self.n_kv_groups:
            raise ValueError(f"mla_n_heads={self.n_heads} is not divisible by mla_n_kv_groups={self.n_kv_groups}: "
                             "every key/value group must serve the same number of query heads")
        if self.d_rope % 2: raise ValueError(f"mla_qk_rope_dim={self.d_rope} must be even: RoPE rotates pairs")
        self.n_rep = self.n_heads // self.n_kv_groups  # query heads per group
        self.qk_head_dim = self.d_nope + self.d_rope
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.use_rope = layer_idx not in c.nope_layers
        H, G, D = self.n_heads, self.n_kv_groups, c.dim
        if self.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, c.norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.d_c + self.d_rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.d_c, c.norm_eps)
        self.kv_b_proj = nn.Linear(self.d_c, G * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(H * self.d_v, D, bias=False)

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise every parameter (works after `to_empty` from the meta device).

        | parameter | init |
        |---|---|
        | q_a_proj, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj | N(0, init_std²) |
        | o_proj | N(0, (init_std / sqrt(2 n_layers))²), GPT-2's residual scaling |
        | q_a_layernorm, kv_a_layernorm | 1 |
        """
        c = self.config
        lins = [self.q_a_proj, self.q_b_proj] if self.q_lora_rank > 0 else [self.q_proj]
        for lin in lins + [self.kv_a_proj_with_mqa, self.kv_b_proj]: nn.init.normal_(lin.weight, std=c.init_std)
        nn.init.normal_(self.o_proj.weight, std=c.init_std / math.sqrt(2 * c.n_layers))
        if self.q_lora_rank > 0: self.q_a_layernorm.reset_parameters()
        self.kv_a_layernorm.reset_parameters()

    def check_input(self, x: torch.Tensor, where: str) -> torch.Size:
        "Raise unless `x` is [B, T, D]; return its shape."
        if x.dim() != 3 or x.shape[-1] != self.config.dim:
            raise ValueError(f"MultiHeadLatentAttention.{where} expects [B, T, {self.config.dim}], got {list(x.shape)}: "
                             f"give (batch, time, dim) with the model's dim={self.config.dim} last")
        return x.shape

    def rope_tables(self, positions: torch.Tensor): # [T] or [B, T] integer positions
        "cos, sin for the rotary slice, or None on a NoPE layer."
        return rope_cos_sin(positions, self.d_rope, self.config.rope_theta) if self.use_rope else None

    def queries(self, x: torch.Tensor, # [B, T, D]
                rope) -> tuple[torch.Tensor, torch.Tensor]: # q_nope [B, T, H, d_nope], q_rope [B, T, H, d_rope] (rotated)
        "Per-head queries, split into the position-free part and the rotated part."
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank > 0 else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, self.n_heads, self.qk_head_dim).split([self.d_nope, self.d_rope], -1)  # (B, T, H, ·)
        return q_nope, (apply_rope(q_rope, *rope) if rope else q_rope)

    def latents(self, x: torch.Tensor, # [B, T, D]
                rope) -> tuple[torch.Tensor, torch.Tensor]: # c_kv [B, T, d_c] (normalised), k_rope [B, T, 1, d_rope] (rotated)
        "What the decoder caches: the normalised latent and the rotated key shared by all heads."
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.d_c, self.d_rope], -1)  # (B, T, d_c), (B, T, d_rope)
        k_rope = k_rope.unsqueeze(2)  # (B, T, 1, d_rope): one head, shared
        return self.kv_a_layernorm(c_kv), (apply_rope(k_rope, *rope) if rope else k_rope)

    def keys_values(self, c_kv: torch.Tensor # [B, T, d_c]
                   ) -> tuple[torch.Tensor, torch.Tensor]: # k_nope [B, T, G, d_nope], v [B, T, G, d_v]
        "Up-project the latent to every group's position-free key and value."
        B, T, _ = c_kv.shape
        kv = self.kv_b_proj(c_kv).view(B, T, self.n_kv_groups, self.d_nope + self.d_v)  # (B, T, G, d_nope + d_v)
        return kv.split([self.d_nope, self.d_v], -1)

    def attend(self, q: torch.Tensor, # [B, T, H, d_qk]
               k: torch.Tensor, # [B, T, G, d_qk]
               v: torch.Tensor, # [B, T, G, d_v]
               cu_seqlens: Optional[torch.Tensor] = None, # [N+1] document boundaries (B == 1), or None
              ) -> torch.Tensor: # [B, T, H, d_v]
        "Causal attention; query head h reads group h // (H/G); documents of a packed row stay apart."
        if cu_seqlens is not None: return attend_documents(q, k, v, cu_seqlens, self.softmax_scale)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, d)
        return causal_sdpa(q, k, v, self.softmax_scale).transpose(1, 2)  # (B, T, H, d_v)

    def forward(self, x: torch.Tensor, # [B, T, D]
                cu_seqlens: Optional[torch.Tensor] = None, # [N+1] boundaries of packed documents (needs B == 1)
                positions: Optional[torch.Tensor] = None, # [T] or [B, T] RoPE positions; default 0..T-1, per document with cu_seqlens
               ) -> torch.Tensor: # [B, T, D]
        B, T, _ = self.check_input(x, "forward")
        if cu_seqlens is not None:
            if B != 1: raise ValueError(f"cu_seqlens packs documents into one row: got batch {B}, reshape to [1, B*T, D]")
            if positions is not None: raise ValueError("pass cu_seqlens or positions, not both: cu_seqlens sets the positions")
            positions = positions_from_cu_seqlens(cu_seqlens, T, self.config.max_seq_len)  # reads the boundaries once
        elif positions is None:
            if T > self.config.max_seq_len:  # positions 0..T-1 past the ones the tables were trained on, as by hand below
                raise ValueError(f"sequence length {T} > max_seq_len={self.config.max_seq_len}: crop the input, pack it as "
                                 "documents (cu_seqlens), or raise max_seq_len")
            positions = torch.arange(T, device=x.device)
        elif positions.numel():  # given by hand (the model never does): in the range the tables were trained on
            lo, hi = map(int, torch.aminmax(positions))
            if lo < 0 or hi >= self.config.max_seq_len:
                raise ValueError(f"positions run from {lo} to {hi}; this model's are 0..{self.config.max_seq_len - 1} "
                                 f"(max_seq_len={self.config.max_seq_len}): give positions in that range")
        rope = self.rope_tables(positions)
        q_nope, q_rope = self.queries(x, rope)  # (B, T, H, d_nope), (B, T, H, d_rope)
        c_kv, k_rope = self.latents(x, rope)  # (B, T, d_c), (B, T, 1, d_rope)
        k_nope, v = self.keys_values(c_kv)  # (B, T, G, d_nope), (B, T, G, d_v)
        q = torch.cat([q_nope, q_rope], -1)  # (B, T, H, d_qk)
        k = torch.cat([k_nope, k_rope.expand(B, T, self.n_kv_groups, self.d_rope)], -1)  # (B, T, G, d_qk)
        o = self.attend(q, k, v, cu_seqlens)  # (B, T, H, d_v)
        return self.o_proj(o.flatten(2))  # (B, T, H*d_v) -> (B, T, D)

    def forward_decode(self, x: torch.Tensor, # New tokens [B, T, D] (T = 1 per generated token, or a whole prompt)
                       cache: MLACache, # This layer's cache; the new tokens are appended to it
                      ) -> torch.Tensor: # [B, T, D]; equals `forward` on the whole sequence, restricted to the new tokens
        "Cached decoding with absorbed attention: W_UK folded into the query, W_UV applied after attention."
        B, T, _ = self.check_input(x, "forward_decode")
        cache.check_room(T, self.config.max_seq_len)  # before anything is written
        G, R = self.n_kv_groups, self.n_rep
        pos = cache.positions(T)  # (T,) positions of the new tokens, on the device
        rope = self.rope_tables(pos)
        q_nope, q_rope = self.queries(x, rope)  # (B, T, H, d_nope), (B, T, H, d_rope)
        c_new, k_rope_new = self.latents(x, rope)
        c_kv, k_rope = cache.append(c_new, k_rope_new[:, :, 0])  # (B, L, d_c), (B, L, d_rope), L = max_len
        w_uk, w_uv = self.kv_b_proj.weight.view(G, self.d_nope + self.d_v, self.d_c).split([self.d_nope, self.d_v], 1)
        q_lat = torch.einsum("btgrn,gnc->btgrc", q_nope.view(B, T, G, R, self.d_nope), w_uk).flatten(2, 3)  # (B, T, H, d_c)
        ct = torch.promote_types(q_lat.dtype, torch.float32)  # scores in fp32 as the training kernels keep them (fp64 in fp64)
        with torch.autocast(x.device.type, enabled=False):
            s = torch.einsum("bthc,bsc->bhts", q_lat.to(ct), c_kv.to(ct)) + torch.einsum("bthr,bsr->bhts", q_rope.to(ct), k_rope.to(ct))
        s = (s * self.softmax_scale).masked_fill(torch.arange(c_kv.shape[1], device=x.device) > pos[:, None], float("-inf"))
        p = s.softmax(-1).to(c_kv.dtype)  # (B, H, T, L); query at position p sees cached tokens 0..p
        o_lat = torch.einsum("bhts,bsc->bthc", p, c_kv).to(w_uv.dtype)  # (B, T, H, d_c): attention averages latents
        o = torch.einsum("btgrc,gvc->btgrv", o_lat.view(B, T, G, R, self.d_c), w_uv)  # (B, T, G, R, d_v)
        return self.o_proj(o.flatten(2))  # (B, T, H*d_v) -> (B, T, D)



# %% [markdown]
# ### Checked against the reference
#
# The notebook and the tests use the tiny preset with weights drawn at unit scale, $W \sim
# \mathcal{N}(0, 1/\text{fan\_in})$ and norm gains near 1, so that outputs are of order one and a
# small tolerance means something (with `init_std = 0.02` everything would be near zero and any two
# functions would "agree").

# %%
def randomize_(m: nn.Module, seed: int = 0):
    "Draw every weight at unit scale: matrices N(0, 1/fan_in), RMSNorm gains 1 + N(0, 0.1²)."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if p.dim() == 2
                    else 1 + 0.1 * torch.randn(p.shape, generator=g))
    return m


# %% [markdown]
# With $G = H$, copy the fused weights into the paper's separate matrices (slicing each head's
# `[nope; rope]` and `[k_nope; v]` blocks) and compare. This pins the layout of every fused matrix,
# which is what a DeepSeek checkpoint needs.

# %%
def paper_weights(m: MultiHeadLatentAttention) -> dict:
    "The module's fused weights as the paper's per-head matrices (needs G == H)."
    H, G, r = m.n_heads, m.n_kv_groups, m.q_lora_rank
    assert G == H, "the paper has one key/value up-projection per head"
    q_b = m.q_b_proj.weight.view(H, m.qk_head_dim, r)  # (H, d_nope + d_rope, d_q)
    kv_a = m.kv_a_proj_with_mqa.weight  # (d_c + d_rope, D)
    kv_b = m.kv_b_proj.weight.view(H, m.d_nope + m.d_v, m.d_c)  # (H, d_nope + d_v, d_c)
    return dict(W_DQ=m.q_a_proj.weight, g_Q=m.q_a_layernorm.weight, W_UQ=q_b[:, :m.d_nope], W_QR=q_b[:, m.d_nope:],
                W_DKV=kv_a[:m.d_c], g_KV=m.kv_a_layernorm.weight, W_UK=kv_b[:, :m.d_nope], W_UV=kv_b[:, m.d_nope:],
                W_KR=kv_a[m.d_c:], W_O=m.o_proj.weight)


cfg = load_config("hymo_tiny").model
cfg_mha = load_config("hymo_tiny", mla_n_kv_groups=cfg.mla_n_heads).model  # G = H: DeepSeek-V3's MLA
ds = randomize_(MultiHeadLatentAttention(cfg_mha))
x = torch.randn(2, 24, cfg.dim)
with torch.no_grad():
    y = ds(x)
    y_ref = torch.stack([naive_mla(xb, **paper_weights(ds), theta=cfg.rope_theta, eps=cfg.norm_eps) for xb in x])
torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
print(f"G = H = {cfg_mha.mla_n_heads}: max |module - paper| = {(y - y_ref).abs().max():.1e} (output std {y.std():.2f})")

# %% [markdown]
# ### Causality
#
# Changing tokens from position 10 on must leave outputs 0..9 exactly as they were, and change the rest.

# %%
mla = randomize_(MultiHeadLatentAttention(cfg))
x2 = x.clone(); x2[:, 10:] = torch.randn_like(x2[:, 10:])
with torch.no_grad(): y1, y2 = mla(x), mla(x2)
test_eq(y1[:, :10], y2[:, :10])
assert (y1[:, 10:] - y2[:, 10:]).abs().min() > 0


# %% [markdown]
# ### Grouping is tying
#
# A grouped MLA is a DeepSeek MLA whose per-head up-projections are tied within each group: query
# heads $gR .. gR + R - 1$ ($R = H/G$) read group $g$. Repeat each group's block of `kv_b_proj` $R$
# times and the $G = H$ module must give the same output; this also checks that `enable_gqa` pairs
# heads with groups the way `repeat_interleave` does.

# %%
def untie(m: MultiHeadLatentAttention, cfg_mha) -> MultiHeadLatentAttention:
    "The G = H module equal to grouped `m`: each group's kv_b_proj block repeated for its H/G heads."
    full = MultiHeadLatentAttention(cfg_mha)
    sd = dict(m.state_dict())
    kv_b = sd["kv_b_proj.weight"].view(m.n_kv_groups, m.d_nope + m.d_v, m.d_c)  # (G, d_nope + d_v, d_c)
    sd["kv_b_proj.weight"] = kv_b.repeat_interleave(m.n_rep, 0).flatten(0, 1)  # (H * (d_nope + d_v), d_c)
    full.load_state_dict(sd)
    return full


with torch.no_grad(): y_full = untie(mla, cfg_mha)(x)
torch.testing.assert_close(y1, y_full, atol=1e-5, rtol=1e-5)
print(f"H={mla.n_heads}, G={mla.n_kv_groups}: grouped == untied DeepSeek MLA, "
      f"kv_b_proj {mla.kv_b_proj.weight.numel()} vs {mla.n_rep * mla.kv_b_proj.weight.numel()} weights")

# %% [markdown]
# And at the level of SDPA alone, `enable_gqa` equals repeating the keys and values explicitly:

# %%
q, k, v = torch.randn(2, 8, 4, 32), torch.randn(2, 8, 2, 32), torch.randn(2, 8, 2, 32)  # (B, T, heads, d)
o = mla.attend(q, k, v)
o_rep = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))),
                                       is_causal=True, scale=mla.softmax_scale).transpose(1, 2)
torch.testing.assert_close(o, o_rep)

# %% [markdown]
# ### Packed documents
#
# Three documents of lengths 5, 1 and 10 packed in one row must give what each gives alone.

# %%
lens = [5, 1, 10]
cu = torch.tensor([0, 5, 6, 16])
xp = torch.randn(1, 16, cfg.dim)
with torch.no_grad():
    y_packed = mla(xp, cu_seqlens=cu)
    y_alone = torch.cat([mla(d) for d in xp.split(lens, 1)], 1)
torch.testing.assert_close(y_packed, y_alone, atol=1e-5, rtol=1e-5)
assert (y_packed - mla(xp)).abs().max() > 1e-2  # without cu_seqlens, documents would see each other
test_fail(lambda: mla(torch.randn(2, 16, cfg.dim), cu_seqlens=cu), contains="reshape to [1, B*T, D]")
test_fail(lambda: mla(xp, cu_seqlens=torch.tensor([0, 5, 15])), contains="from 0 to T=16")

# %% [markdown]
# ### NoPE layers
#
# A block listed in `nope_layers` rotates nothing, so its output cannot depend on positions at all.
# A RoPE block depends on relative positions only: shifting every position by the same amount leaves
# it (nearly) unchanged, while stretching them changes it.

# %%
cfg_nope = load_config("hymo_tiny", nope_layers=[3]).model  # block 3 is the tiny model's MLA block
nope = randomize_(MultiHeadLatentAttention(cfg_nope, layer_idx=3))
rope_ = randomize_(MultiHeadLatentAttention(cfg_nope, layer_idx=7))  # not in nope_layers
test_eq((nope.use_rope, rope_.use_rope), (False, True))
p0 = torch.arange(24)
with torch.no_grad():
    test_eq(nope(x, positions=3 * p0 + 5), nope(x))
    torch.testing.assert_close(rope_(x, positions=p0 + 100), rope_(x), atol=1e-4, rtol=1e-4)
    assert (rope_(x, positions=3 * p0) - rope_(x)).abs().max() > 1e-2

# %% [markdown]
# ## The 750M shapes, traced on the meta device
#
# A module built under `torch.device("meta")` has shapes but no memory, and meta tensors flow
# through every op, so the whole 4096-token forward of the real configuration can be traced in
# milliseconds. The trace calls the module's own pieces in the order `forward` does.

# %%
cfg750 = load_config("hymo_750m").model
with torch.device("meta"):
    big = MultiHeadLatentAttention(cfg750, layer_idx=3)
    xb = torch.empty(1, 4096, cfg750.dim)
    rope = big.rope_tables(torch.arange(4096))
    shapes = {"x": xb.shape, "c_q = q_a_layernorm(q_a_proj(x))": big.q_a_proj(xb).shape,
              "q = q_b_proj(c_q)": big.q_b_proj(big.q_a_proj(xb)).shape}
    q_nope, q_rope = big.queries(xb, rope)
    kv_a = big.kv_a_proj_with_mqa(xb)
    c_kv, k_rope = big.latents(xb, rope)
    k_nope, v = big.keys_values(c_kv)
    q = torch.cat([q_nope, q_rope], -1)
    k = torch.cat([k_nope, k_rope.expand(-1, -1, big.n_kv_groups, -1)], -1)
    o = big.attend(q, k, v)
    shapes |= {"q_nope": q_nope.shape, "q_rope (rotated)": q_rope.shape, "kv_a_proj_with_mqa(x)": kv_a.shape,
               "c_kv (cached)": c_kv.shape, "k_rope (cached, shared)": k_rope.shape,
               "kv_b_proj(c_kv)": big.kv_b_proj(c_kv).shape, "k_nope": k_nope.shape, "v": v.shape,
               "q = [q_nope; q_rope]": q.shape, "k = [k_nope; k_rope]": k.shape, "SDPA output": o.shape,
               "o_proj(o)": big.o_proj(o.flatten(2)).shape}
for name, s in shapes.items(): print(f"{name:34s} {tuple(s)}")
test_eq(big(xb).shape, (1, 4096, 896))
test_eq((q.shape[-1], v.shape[-1]), (128, 128))  # equal q/k and v widths: the flash backend applies
test_eq(k.shape[2], 4)

# %% [markdown]
# About $d_q$: the design document is not consistent about the query rank (its Q7 names both 128
# and 224 as "the Q-lora and KV-lora ranks", and 128 is also $d_c$). HyMo's preset uses
# `mla_q_lora_rank = 224` for queries and `mla_kv_lora_rank = 128` for the cached latent. The
# document also calls the grouping "MQA-4"; with 4 key/value groups for 16 query heads it is
# grouped-query attention (MQA has a single key/value head).
#
# The parameters of one 750M MLA block, and what DeepSeek's per-head up-projection would cost:

# %%
n_params = {n: p.numel() for n, p in big.named_parameters()}
for n, c in n_params.items(): print(f"{n:28s} {c:>10,}")
total = sum(n_params.values())
kv_b_ds = cfg750.mla_kv_lora_rank * cfg750.mla_n_heads * (cfg750.mla_qk_nope_dim + cfg750.mla_v_head_dim)
print(f"{'total':28s} {total:>10,}")
print(f"kv_b_proj with G = H (DeepSeek): {kv_b_ds:,}, i.e. +{kv_b_ds - n_params['kv_b_proj.weight']:,} per block")
test_eq(n_params["kv_b_proj.weight"], 128 * 4 * (96 + 128))
test_eq(kv_b_ds, 4 * n_params["kv_b_proj.weight"])


# %% [markdown]
# ## What the grouping costs and saves
#
# In DeepSeek-V3, `kv_b_proj` maps $d_c \to H (d_\text{nope} + d_v)$; in HyMo it maps
# $d_c \to G (d_\text{nope} + d_v)$ and group $g$ serves query heads $gR .. gR+R-1$, $R = H/G$.
# For the 750M block ($d_c = 128$, $H = 16$, $G = 4$, $d_\text{nope} + d_v = 224$):
#
# * **parameters**: `kv_b_proj` has 114,688 weights instead of 458,752: 344 k fewer per block (2.75 M
#   over 8 blocks), 12.5 % of the block's 2.75 M attention weights and a rounding error next to its
#   105 M expert weights (chapter 30).
# * **forward FLOPs** (training costs three times these, forward and backward): the up-projection
#   costs $2 d_c G (d_\text{nope} + d_v) = 0.23$ MFLOP per token instead of 0.92. The attention itself
#   is unchanged: every query head still takes a dot product with every earlier key,
#   $2 H (d_\text{qk} + d_v) = 8{,}192$ FLOPs per (query, key) pair, about 17 MFLOP per token at an
#   average causal distance of 2048.
# * **training memory**: keys and values are materialised for 4 groups, not 16 heads (1,024 instead of
#   4,096 numbers per token, saved for backward), and SDPA reads them without repeating.
# * **the cache**: identical. Only $c^{KV}$ and $k^R$ are cached, whatever $G$ is.
# * **decoding**: identical per head. With absorption (below) every query head attends to the latent
#   directly; grouping only means 4 distinct $W^{UK}$, $W^{UV}$ blocks instead of 16.
# * **the price**: expressiveness, on the key side. Four heads share each content key, so their
#   scores $q_h^\top W^{UK}_g c$ all read the latent through one 96-dimensional subspace
#   ($W^{UK}_g$'s) instead of one each. Sharing the values costs nothing at HyMo's shapes: with
#   $d_v = d_c$ (128), a head's slice of `o_proj` can absorb any per-head value map,
#   $W^O_h \leftarrow W^O_h W^{UV}_h (W^{UV}_g)^{-1}$ (when $W^{UV}_g$ is invertible, as a random one
#   is). It is a restriction of DeepSeek's MLA (tying, shown above): at equal width it can express
#   only a subset of what DeepSeek's can. Whether it trains worse is an empirical question; the bet
#   is that at 750M scale the saved memory is worth more than the lost freedom, and an ablation with
#   `mla_n_kv_groups=16` measures it (in effect the keys' freedom: its extra value weights add
#   nothing that `o_proj` could not).
#
# The value side, checked: give every head of the $G = H$ module its own value map while keeping the
# grouped keys, and the grouped module with its `o_proj` rewritten reproduces it exactly (the
# grouped module as it was does not):

# %%
def value_maps(m: MultiHeadLatentAttention) -> torch.Tensor:
    "The value maps W^UV, a view of kv_b_proj's value rows: (G, d_v, d_c), one per group (per head when G = H)."
    return m.kv_b_proj.weight.view(-1, m.d_nope + m.d_v, m.d_c)[:, m.d_nope:]


with torch.no_grad():
    ds_v = untie(mla, cfg_mha)                                  # keys tied per group, as in `mla` ...
    value_maps(ds_v).normal_(0, cfg.mla_kv_lora_rank ** -0.5)   # ... and a value map of its own for every head
    absorbed = copy.deepcopy(mla)
    W_O = absorbed.o_proj.weight.view(cfg.dim, mla.n_heads, mla.d_v)  # (D, H, d_v): head h's slice of o_proj
    to_group = torch.linalg.inv(value_maps(mla)).repeat_interleave(mla.n_rep, 0)  # (H, d_c, d_v): its group's (W^UV_g)^-1
    W_O.copy_(torch.einsum("dhv,hvc,hcw->dhw", W_O, value_maps(ds_v), to_group))  # W^O_h W^UV_h (W^UV_g)^-1
    y_ds, y_absorbed, y_grouped = ds_v(x), absorbed(x), mla(x)
torch.testing.assert_close(y_absorbed, y_ds, atol=1e-4, rtol=1e-4)
assert (y_grouped - y_ds).abs().max() > 0.1
print(f"per-head values, d_v = d_c = {mla.d_c}: max |grouped with o_proj absorbed - per-head| = {(y_absorbed - y_ds).abs().max():.1e}")

# %% [markdown]
# The counts above, from the 750M shapes:

# %%
c = cfg750
saved = kv_b_ds - n_params["kv_b_proj.weight"]
up_flops = lambda G: 2 * c.mla_kv_lora_rank * G * (c.mla_qk_nope_dim + c.mla_v_head_dim)  # forward, per token
pair_flops = 2 * c.mla_n_heads * (c.mla_qk_nope_dim + c.mla_qk_rope_dim + c.mla_v_head_dim)  # q.k and p.v per (query, key)
print(f"kv_b_proj: {saved:,} fewer weights per block ({saved / total:.1%} of its attention weights), "
      f"{saved * c.layer_types.count('mla') / 1e6:.2f} M over {c.layer_types.count('mla')} blocks")
print(f"up-projection: {up_flops(c.mla_n_kv_groups) / 1e6:.2f} MFLOP per token (G = H: {up_flops(c.mla_n_heads) / 1e6:.2f}); "
      f"attention: {pair_flops:,} FLOPs per pair, {pair_flops * 2048 / 1e6:.1f} MFLOP per token at distance 2048")
test_eq((saved, pair_flops), (344_064, 8_192))


# %% [markdown]
# ## The KV cache, counted
#
# Bytes cached per token per layer, in bf16 (2 bytes), for 16 query heads of width 128:
#
# * MHA caches every head's key and value: $2 \cdot H \cdot 128$ numbers.
# * GQA-4 caches 4 key/value heads: $2 \cdot 4 \cdot 128$.
# * MQA caches one key/value head shared by all: $2 \cdot 128$.
# * MLA caches the latent and the shared rotary key: $d_c + d_\text{rope} = 128 + 32$.

# %%
def kv_bytes_per_token(kind: str, H=16, d_head=128, G=4, d_c=128, d_rope=32, bytes_per=2) -> int:
    "Cached bytes per token per layer."
    return bytes_per * {"MHA": 2 * H * d_head, "GQA-4": 2 * G * d_head, "MQA": 2 * d_head, "MLA": d_c + d_rope}[kind]


c = cfg750
rows = {k: kv_bytes_per_token(k, c.mla_n_heads, c.mla_qk_nope_dim + c.mla_qk_rope_dim, c.mla_n_kv_groups,
                              c.mla_kv_lora_rank, c.mla_qk_rope_dim) for k in ("MHA", "GQA-4", "MQA", "MLA")}
n_mla = c.layer_types.count("mla")
print(f"{'':6s} {'B/token/layer':>14s} {'vs MLA':>7s} {f'MiB/seq @4096, {n_mla} layers':>26s}")
for k, b in rows.items(): print(f"{k:6s} {b:>14,} {b / rows['MLA']:>6.1f}x {b * 4096 * n_mla / 2**20:>26.1f}")
test_eq(list(rows.values()), [8192, 2048, 512, 320])

# %%
#| fig-alt: "Cache size in GiB per sequence against context length, both on log scales, for MHA, GQA with 4 groups, MQA and MLA over HyMo's MLA layers: four parallel lines, MLA's the lowest, just under MQA's."
ctx = torch.logspace(9, 17, 33, base=2)
for k, b in rows.items(): plt.plot(ctx, b * n_mla * ctx / 2**30, label=f"{k} ({b} B/token/layer)")
plt.xscale("log", base=2); plt.yscale("log"); plt.xlabel("context length (tokens)")
plt.ylabel(f"GiB per sequence, {n_mla} layers"); plt.legend(); plt.grid(alpha=0.3)
plt.gcf().set_size_inches(6, 3); plt.tight_layout(); plt.show()


# %% [markdown]
# ## Decoding with a latent cache
#
# A decoder keeps, per layer, the normalised latent $c^{KV}_s$ and the rotated shared key $k^R_s$
# of every past token: $d_c + d_\text{rope}$ numbers. `MLACache` preallocates them for `max_len`
# tokens and `append` writes new ones in place. All rows of a batch share one length.
#
# `append` returns the whole buffers, not just the rows written so far: the causal mask already
# hides every row past the query's position (the query at position $p$ sees rows $0..p$), so unwritten rows
# get zero weight; since they hold finite values (zeros, or a stale token's), they contribute exactly 0 (a NaN
# there would not: $0 \cdot \text{NaN}$ is NaN). The count of cached tokens is
# kept twice: `length` on the host, for the overflow check, and `pos` on the cache's device, from
# which the new tokens' positions (and their rows) are computed. So a decoding step has the same
# shapes at every length and reads no number from the GPU, which is what capturing it as a CUDA
# graph needs (chapter 41).

# %%
#| exports
@dataclass
class MLACache:
    "Per-layer decode cache: normalised latents and rotated shared keys of the tokens seen so far."
    c_kv: torch.Tensor  # [B, max_len, d_c]; rows [:length] are filled
    k_rope: torch.Tensor  # [B, max_len, d_rope]; rows [:length] are filled
    length: int = 0  # Tokens cached so far (on the host): the position of the next token
    pos: Optional[torch.Tensor] = None  # The same count on the buffers' device, [1] int64; None: `length`

    def __post_init__(self):
        if not (self.c_kv.is_floating_point() and self.k_rope.is_floating_point()):
            raise TypeError(f"MLACache holds latents and keys, not {self.c_kv.dtype}/{self.k_rope.dtype}: give floating-point "
                            "buffers, e.g. MLACache.empty(config, batch, max_len, dtype=torch.bfloat16)")
        if isinstance(self.length, bool) or not isinstance(self.length, numbers.Integral):  # 2.0 would count on as 3.0
            raise TypeError(f"MLACache length counts the tokens cached: give an int, got {self.length!r}")
        self.length = int(self.length)  # (a NumPy integer as a Python one)
        c, r = self.c_kv, self.k_rope  # a cache made by hand: its two buffers must agree, or a write stops halfway
        if c.ndim != 3 or r.ndim != 3 or c.shape[:2] != r.shape[:2] or c.dtype != r.dtype or c.device != r.device or self.length < 0:
            raise ValueError(f"MLACache holds c_kv [B, max_len, d_c] and k_rope [B, max_len, d_rope] of one dtype on one device, "
                             f"and length >= 0; got {tuple(c.shape)} {c.dtype} on {c.device}, {tuple(r.shape)} {r.dtype} on "
                             f"{r.device}, length={self.length}: make it with MLACache.empty(config, batch, max_len)")
        if self.pos is None: self.pos = torch.full((1,), self.length, dtype=torch.long, device=self.c_kv.device)
        elif (self.pos.shape != (1,) or self.pos.dtype != torch.long or self.pos.device != self.c_kv.device
              or int(self.pos) != self.length):  # (read once, when a cache is made by hand)
            raise ValueError(f"MLACache(length={self.length}, pos={self.pos.tolist()}): pos is the same count as length, on "
                             "the buffers' device, [1] int64; leave it out and it is made from length")

    @classmethod
    def empty(cls, config: ModelConfig, # Uses mla_kv_lora_rank and mla_qk_rope_dim
              batch: int, # Sequences decoded together
              max_len: int, # Most tokens the cache can hold (prompt + generated)
              device=None, dtype=torch.float32):
        shape = (batch, max_len)
        return cls(torch.zeros(*shape, config.mla_kv_lora_rank, device=device, dtype=dtype),
                   torch.zeros(*shape, config.mla_qk_rope_dim, device=device, dtype=dtype))

    def check_room(self, T: int, # New tokens
                   max_seq_len: Optional[int] = None): # The model's: positions past it are refused too
        "Raise if `T` more tokens do not fit (checked on the host: a replayed CUDA graph cannot raise)."
        if self.length + T > self.c_kv.shape[1]:
            raise ValueError(f"MLACache holds {self.c_kv.shape[1]} tokens and {self.length + T} were asked for: "
                             "allocate it with a larger max_len")
        if max_seq_len is not None and self.length + T > max_seq_len:
            raise ValueError(f"decoding to position {self.length + T - 1}, beyond this model's 0..{max_seq_len - 1} "
                             f"(max_seq_len={max_seq_len}): keep prompt and generated tokens within max_seq_len")

    def positions(self, T: int) -> torch.Tensor: # [T] int64 on the buffers' device
        "Positions of the next `T` tokens, computed on the device."
        return self.pos + torch.arange(T, device=self.pos.device)

    def append(self, c_kv: torch.Tensor, # [B, T, d_c] new latents
               k_rope: torch.Tensor, # [B, T, d_rope] new rotated keys
              ) -> tuple[torch.Tensor, torch.Tensor]: # the whole buffers [B, max_len, d_c], [B, max_len, d_rope]
        "Write `T` new tokens after the cached ones; return the buffers (rows past the new length are to be masked)."
        T = c_kv.shape[1]
        want = (self.c_kv.shape[0], self.c_kv.shape[-1], self.k_rope.shape[-1])
        if (c_kv.shape[0], c_kv.shape[-1], k_rope.shape[-1]) != want or k_rope.shape[:2] != c_kv.shape[:2]:
            raise ValueError(f"MLACache holds [B={want[0]}, L, d_c={want[1]}] latents and [B, L, d_rope={want[2]}] keys; got "
                             f"{tuple(c_kv.shape)} and {tuple(k_rope.shape)}: make the cache with MLACache.empty(config, "
                             "batch, max_len) of this model and batch")
        self.check_room(T)
        rows = self.positions(T)
        self.c_kv.index_copy_(1, rows, c_kv.to(self.c_kv.dtype))
        self.k_rope.index_copy_(1, rows, k_rope.to(self.k_rope.dtype))
        self.pos += T
        self.length += T
        return self.c_kv, self.k_rope

    def bytes_per_token(self) -> int:
        "Cached bytes per token (per layer): (d_c + d_rope) × bytes per value."
        return self.c_kv.shape[-1] * self.c_kv.element_size() + self.k_rope.shape[-1] * self.k_rope.element_size()


# %% [markdown]
# ### The naive way: up-project the cache
#
# The direct decoder rebuilds every head's keys and values from the cached latents at every step
# (`keys_values` on the whole cache), then attends. It is correct, and slow: each step re-runs
# `kv_b_proj` on all $L$ cached tokens, $2 L d_c G (d_\text{nope} + d_v)$ FLOPs. The mask lets the
# query at position $p$ see cached tokens $0..p$, so a chunk of several new tokens (a prompt) works
# too.

# %%
def decode_naive(m: MultiHeadLatentAttention, x: torch.Tensor, cache: MLACache) -> torch.Tensor:
    "Cached decoding by up-projecting the whole latent cache: x [B, T, D] -> [B, T, D]."
    B, T, _ = x.shape
    pos = cache.positions(T)
    rope = m.rope_tables(pos)
    q_nope, q_rope = m.queries(x, rope)
    c_new, k_rope_new = m.latents(x, rope)
    c_kv, k_rope = cache.append(c_new, k_rope_new[:, :, 0])  # (B, L, d_c), (B, L, d_rope), L = max_len
    k_nope, v = m.keys_values(c_kv)  # (B, L, G, d_nope), (B, L, G, d_v)
    L = c_kv.shape[1]
    k = torch.cat([k_nope, k_rope[:, :, None].expand(B, L, m.n_kv_groups, m.d_rope)], -1)  # (B, L, G, d_qk)
    q = torch.cat([q_nope, q_rope], -1)  # (B, T, H, d_qk)
    k, v = k.repeat_interleave(m.n_rep, 2), v.repeat_interleave(m.n_rep, 2)  # (B, L, H, ·)
    s = torch.einsum("bthd,bshd->bhts", q, k) * m.softmax_scale  # (B, H, T, L)
    s = s.masked_fill(torch.arange(L, device=s.device) > pos[:, None], float("-inf"))  # query at p sees keys 0..p
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)  # (B, T, H, d_v)
    return m.o_proj(o.flatten(2))


# %% [markdown]
# ### Absorbed attention
#
# Write group $g$'s slices of `kv_b_proj` as $W^{UK}_g \in \mathbb{R}^{d_\text{nope} \times d_c}$
# and $W^{UV}_g \in \mathbb{R}^{d_v \times d_c}$, and let head $h$ belong to group $g$. The
# position-free part of a score is
# $$q^C_{t,h}{}^\top k^C_{s,g} = q^C_{t,h}{}^\top W^{UK}_g c_s = \big(\underbrace{W^{UK}_g{}^\top q^C_{t,h}}_{\tilde q_{t,h} \in \mathbb{R}^{d_c}}\big)^\top c_s ,$$
# so $W^{UK}$ is *absorbed* into the query: `q_lat` is computed once per new token and dotted with
# the cached latents directly. The rotary part is $q^R_{t,h}{}^\top k^R_s$ with the cached rotated
# key; no rotation sits between $W^{UK}$ and $c_s$, which is why the rotary slice had to be
# decoupled. The values come out the same way:
# $$o_{t,h} = \sum_s p_{t,h,s} W^{UV}_g c_s = W^{UV}_g \underbrace{\textstyle\sum_s p_{t,h,s}\, c_s}_{\tilde o_{t,h} \in \mathbb{R}^{d_c}},$$
# so attention averages latents and $W^{UV}$ is applied once, after it. Seen from the cache, absorbed
# MLA is multi-query attention with one shared "head" of key width $d_c + d_\text{rope} = 160$ and
# value width $d_c = 128$. Per step, per head and per cached token it costs $d_c + d_\text{rope}$
# multiply-adds for the score and $d_c$ for the value, and nothing is ever up-projected. (One could
# also fold $W^{UV}$ into `o_proj`; like DeepSeek-V3's inference code, HyMo keeps them apart.)

# %% [markdown]
# `MultiHeadLatentAttention.forward_decode` (in the class above) is exactly this, term by term.
#
# Now the checks. For prompts of 1, 17 and 64 tokens: feed the prompt in one call, then 8 more
# tokens one at a time, and compare every output with the uncached `forward` on the whole sequence.
# The naive and the absorbed decoders must both match it.

# %%
extra = 8
for P in (1, 17, 64):
    xs = torch.randn(2, P + extra, cfg.dim)
    with torch.no_grad():
        y_full = mla(xs)
        outs = {}
        for name, step in (("naive", lambda x, c: decode_naive(mla, x, c)), ("absorbed", mla.forward_decode)):
            cache = MLACache.empty(cfg, batch=2, max_len=P + extra)
            ys = [step(xs[:, :P], cache)] + [step(xs[:, t:t + 1], cache) for t in range(P, P + extra)]
            outs[name] = torch.cat(ys, 1)
    for name, y in outs.items():
        err = (y - y_full).abs().max().item()
        print(f"prompt {P:2d}, {name:8s}: max |decode - forward| = {err:.1e}")
        assert err <= 1e-5
    torch.testing.assert_close(outs["absorbed"], outs["naive"], atol=1e-5, rtol=0)
    test_eq(cache.length, P + extra)

# %% [markdown]
# Under bf16 autocast the decoder computes its scores in fp32, as the training kernels keep theirs:
# rounded to bf16 before the softmax, scores of a few tens would carry errors of a tenth or more
# into the exponent. With weights at twice unit scale (scores up to a couple of tens, as in sharp heads), the
# cached decoder's error against the fp32 forward is then within about 10 % of the bf16 forward's own (with the
# scores in bf16 it was about 1.4 times that, 1.3 to 1.6 times across inputs).

# %%
sharp = randomize_(MultiHeadLatentAttention(cfg), seed=3)
with torch.no_grad():
    for p in sharp.parameters():
        if p.dim() == 2: p.mul_(2)
    P, E = 256, 16
    xs = torch.randn(1, P, cfg.dim)
    ref = sharp(xs)[:, -E:]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_fwd = sharp(xs.bfloat16()).float()[:, -E:]
        cache = MLACache.empty(cfg, 1, P, dtype=torch.bfloat16)
        sharp.forward_decode(xs[:, :P - E].bfloat16(), cache)
        y_dec = torch.cat([sharp.forward_decode(xs[:, t:t + 1].bfloat16(), cache) for t in range(P - E, P)], 1).float()
rel = lambda y: ((y - ref).norm() / ref.norm()).item()
print(f"bf16, relative to fp32: forward {rel(y_fwd):.4f}, cached decode {rel(y_dec):.4f}")
assert rel(y_dec) <= 1.15 * rel(y_fwd)

# %% [markdown]
# The cache is exactly $d_c + d_\text{rope}$ values per token, and it refuses to overflow:

# %%
cache = MLACache.empty(cfg, batch=1, max_len=4)
test_eq(cache.bytes_per_token(), 4 * (cfg.mla_kv_lora_rank + cfg.mla_qk_rope_dim))
test_eq(MLACache.empty(cfg750, 1, 8, dtype=torch.bfloat16).bytes_per_token(), 320)
with torch.no_grad(): mla.forward_decode(torch.randn(1, 4, cfg.dim), cache)
test_fail(lambda: mla.forward_decode(torch.randn(1, 1, cfg.dim), cache), contains="larger max_len")

# %% [markdown]
# The cost per decoding step at context $L$, per head, in multiply-adds, for the 750M block: the
# naive decoder re-expands the cache, the absorbed one never does.

# %%
L = 4096
c = cfg750
naive_macs = L * c.mla_kv_lora_rank * c.mla_n_kv_groups * (c.mla_qk_nope_dim + c.mla_v_head_dim) / c.mla_n_heads \
             + L * (c.mla_qk_nope_dim + c.mla_qk_rope_dim + c.mla_v_head_dim)
absorbed_macs = c.mla_qk_nope_dim * c.mla_kv_lora_rank + L * (2 * c.mla_kv_lora_rank + c.mla_qk_rope_dim) \
                + c.mla_kv_lora_rank * c.mla_v_head_dim
gqa_macs = L * (c.mla_qk_nope_dim + c.mla_qk_rope_dim + c.mla_v_head_dim)  # expanded keys and values cached
print(f"per head per step at L={L} (up-projection shared over heads): naive {naive_macs / 1e6:.2f} M MACs, "
      f"absorbed {absorbed_macs / 1e6:.2f} M MACs, a GQA-4-sized cache of expanded keys {gqa_macs / 1e6:.2f} M MACs")
assert gqa_macs < absorbed_macs < 1.2 * gqa_macs < naive_macs / 20


# %% [markdown]
# Re-expanding the cache every step is hopeless; the fair rival is a decoder that caches the
# expanded keys and values (a GQA-4-sized cache, 2 KiB per token). It does slightly less arithmetic,
# $L (d_\text{qk} + d_v) = 1.05$ M multiply-adds per head, but reads 6.4 times more bytes per cached
# token. Decoding one token at a time is bound by memory traffic, not arithmetic, so the absorbed
# decoder, reading 320 bytes per cached token, wins.
#
# ## The block
#
# An MLA block is pre-norm attention then pre-norm feed-forward, two residual lines. Its
# feed-forward is the mixture of experts, `DeepSeekMoE` from `hymo.models.moe`: one shared and
# `moe_n_routed` routed SwiGLU experts, each token sent to the top `moe_top_k` of them.

# %%
#| exports
class MLABlock(nn.Module):
    "Pre-norm MLA block: `x + attn(norm1(x))`, then `x + ffn(norm2(x))`; [B, T, D] -> [B, T, D]."
    def __init__(self, config: ModelConfig, # The model configuration
                 layer_idx: int): # Block index in the stack (decides RoPE vs NoPE)
        super().__init__()
        self.config = config
        self.norm1 = RMSNorm(config.dim, config.norm_eps)
        self.attn = MultiHeadLatentAttention(config, layer_idx)
        self.norm2 = RMSNorm(config.dim, config.norm_eps)
        self.ffn = DeepSeekMoE(config)

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise every parameter: attention as in `MultiHeadLatentAttention.reset_parameters`;
        norms 1; the MoE as in `DeepSeekMoE.reset_parameters`."""
        self.norm1.reset_parameters(); self.norm2.reset_parameters()
        self.attn.reset_parameters()
        self.ffn.reset_parameters()

    def forward(self, x: torch.Tensor, # [B, T, D]
                cu_seqlens: Optional[torch.Tensor] = None, # [N+1] boundaries of packed documents (B == 1)
               ) -> torch.Tensor: # [B, T, D]
        x = x + self.attn(self.norm1(x), cu_seqlens)
        x = x + self.ffn(self.norm2(x))
        return x

    def forward_decode(self, x: torch.Tensor, # New tokens [B, T, D]
                       cache: MLACache, # This block's cache, appended to
                      ) -> torch.Tensor: # [B, T, D]
        "The block with cached, absorbed attention."
        if self.training:  # the MoE would cap what each expert takes per call and count the tokens for its balancing
            raise RuntimeError("MLABlock.forward_decode is for inference: call .eval() first (HyMo.generate does)")
        x = x + self.attn.forward_decode(self.norm1(x), cache)
        x = x + self.ffn(self.norm2(x))
        return x


# %% [markdown]
# Built on the meta device, moved with `to_empty`, and reset, a block holds exactly the values of
# one built normally and reset from the same seed: `reset_parameters` restores every parameter, and
# the only buffers, the MoE's balancing counters, start at zero. Decoding in two calls, and a packed
# row, give the outputs of one plain call. Decoding is inference, and the block refuses it in training mode: there
# the MoE would cap what each expert takes by how many tokens the call holds, and count them for its balancing.

# %%
def build(meta: bool, seed: int = 0):
    with torch.device("meta" if meta else "cpu"): blk = MLABlock(cfg, layer_idx=3)
    if meta: blk.to_empty(device="cpu")
    torch.manual_seed(seed); blk.reset_parameters()
    return blk


a, b = build(meta=False), build(meta=True)
assert all((buf == 0).all() for buf in a.buffers())
for (n, p), (_, q_) in zip(a.state_dict().items(), b.state_dict().items()): test_eq(p, q_)
test_close(a.attn.kv_b_proj.weight.std(), cfg.init_std, eps=2e-3)
xb = torch.randn(1, 12, cfg.dim)
test_fail(lambda: b.forward_decode(torch.randn(1, 2, cfg.dim), MLACache.empty(cfg, 1, 4)), contains="call .eval() first")
b.eval()  # inference: the MoE is dropless and leaves its balancing counters alone
with torch.no_grad():
    cache = MLACache.empty(cfg, 1, 12)
    y_dec = torch.cat([b.forward_decode(xb[:, :5], cache), b.forward_decode(xb[:, 5:], cache)], 1)
    torch.testing.assert_close(y_dec, b(xb), atol=1e-5, rtol=0)
    torch.testing.assert_close(b(xb, torch.tensor([0, 5, 12]))[:, :5], b(xb[:, :5]), atol=1e-6, rtol=0)

# %% [markdown]
# On a GPU, in bf16, the flash backend must accept the 750M shapes (equal q/k and v widths, grouped
# keys): forcing it with `sdpa_kernel` fails loudly if it cannot run. Against an fp32 reference its
# error should be bf16 rounding, well under 2 % of the output's spread. On one H200 with torch 2.11
# this measured 0.6 % (the math backend in bf16: the same), and a forward plus backward of one
# block at B = 2, T = 4096 took 4.4 ms.

# %%
from torch.nn.attention import SDPBackend, sdpa_kernel

# %%
#| gpu
torch.backends.cuda.matmul.allow_tf32 = False
with torch.device("cuda"): g = MultiHeadLatentAttention(cfg750, layer_idx=3)
randomize_(g)
xg = torch.randn(2, 4096, cfg750.dim, device="cuda")
with torch.no_grad(), sdpa_kernel(SDPBackend.MATH): y_ref = g(xg)  # fp32 reference
with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION): y_flash = g.to(torch.bfloat16)(xg.bfloat16()).float()
rel = ((y_flash - y_ref).pow(2).mean().sqrt() / y_ref.std()).item()
print(f"flash (bf16) vs fp32: rms error / output std = {rel:.4f}")
assert rel < 0.02


# %% [markdown]
# Packed documents take the varlen flash path on a GPU. It must match the per-document loop, output
# and gradients, at the 750M block's widths (16 query heads over 4 key groups, width 128) and a
# packed row of 16 384 tokens in documents of random length.

# %%
#| gpu
def packed_row(T: int, mean_len: int, seed: int = 0) -> torch.Tensor:
    "Document boundaries [N+1] of a row of T tokens, each token opening a new document with probability 1/mean_len."
    starts = (torch.rand(T, generator=torch.Generator().manual_seed(seed)) < 1 / mean_len).nonzero().flatten()
    return torch.cat([torch.tensor([0]), starts[starts > 0], torch.tensor([T])])

cu = packed_row(16384, 1024)
qkv = [torch.randn(1, 16384, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (16, 4, 4)]
outs = {}
for name, f in [("varlen", varlen_flash_attention), ("loop", attend_documents_loop)]:
    o = f(*qkv, cu, 128 ** -0.5)
    outs[name] = [o.detach().float(), *(t.float() for t in torch.autograd.grad(o, qkv, torch.ones_like(o)))]
for name, a, b in zip(["o", "dq", "dk", "dv"], outs["varlen"], outs["loop"]):
    err = ((a - b).abs().max() / b.abs().max()).item()
    print(f"{len(cu) - 1} documents, {name}: max |varlen - loop| / max |loop| = {err:.2e}")
    assert err < 2e-2

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## What exactly does MLA cache, and how big is it in HyMo?
# Per token and layer, the RMS-normalised latent $c^{KV}$ ($d_c = 128$) and the rotated shared key
# $k^R$ ($d_\text{rope} = 32$): 160 values, 320 bytes in bf16. Multi-head attention with 16 heads of
# 128 would cache 4,096 values (8 KiB), 25.6 times more; GQA with 4 groups 1,024 values (2 KiB); even
# MQA, one key/value head of 128, 256 values (512 B), 1.6 times more.
# At 4,096 tokens the 8 MLA blocks of the 750M model hold 10 MiB per sequence.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How can MLA attend with 16 different heads while caching one latent?
# Because the up-projections are linear and can be moved off the cache. A head's position-free score
# is $q^\top W^{UK} c_s = (W^{UK\top} q)^\top c_s$: fold $W^{UK}$ into the query once per step. Its
# output is $\sum_s p_s W^{UV} c_s = W^{UV} \sum_s p_s c_s$: average latents, then apply $W^{UV}$ once.
# Each head keeps its own queries and its own (or its group's) $W^{UK}$, $W^{UV}$, so heads still
# attend differently; the cache is shared like multi-query attention with 160-wide keys.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why is RoPE applied only to a 32-dimensional slice with its own key?
# A rotation between $W^Q$ and $W^{UK}$ depends on the distance, $x^\top W^{Q\top} R_{s-t} W^{UK} c_s$,
# so $W^{UK}$ could no longer be absorbed and every head's rotated key would have to be cached.
# Decoupling keeps the latent position-free and carries position in a separate 32-dim slice whose
# key is computed from $x$ directly and shared by all heads, adding only 32 values per token to the
# cache. The other 96 dims of each head match on content only.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How does HyMo's grouped MLA differ from DeepSeek-V3's, and what does it buy?
# DeepSeek-V3's `kv_b_proj` maps $d_c \to H(d_\text{nope} + d_v)$, a key and value per head. HyMo's
# maps $d_c \to G(d_\text{nope} + d_v)$ with $G = 4$, each group serving 4 query heads; it equals
# DeepSeek's with those blocks tied. It saves 344 k parameters per block, three quarters of the
# up-projection FLOPs, and three quarters of the key/value activations in training; the cache and
# the decode cost are the same (the cache is the latent either way). At equal width it can express
# only a subset of what DeepSeek's can, and only on the key side: with $d_v = d_c$ the shared values
# lose nothing, since each head's `o_proj` slice can absorb a per-head value map. Whether it trains
# worse is what the `mla_n_kv_groups=16` ablation measures. It is a bet that memory matters more at this scale.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why `is_causal=True`, and why would it be wrong in the decoder?
# A language model predicts token $t+1$ from tokens $\le t$; letting position $t$ see later tokens
# in training leaks the answer and the model learns nothing usable for generation. SDPA's
# `is_causal` mask is aligned to the top-left corner (query $i$ sees keys $\le i$), which is right
# when queries and keys are the same tokens. In the decoder, new queries sit at positions
# $L..L+T-1$ of a longer key sequence, so the mask must be offset (query at position $p$ sees keys
# $0..p$); `forward_decode` builds that mask explicitly.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why does the softmax scale use $d_\text{nope} + d_\text{rope}$ and not $d_v$ or $d_c$?
# The scale keeps the variance of a score near 1: a dot product of two vectors with unit-variance
# entries has variance equal to their width, here $d_\text{nope} + d_\text{rope} = 128$. Absorption
# does not change the score, only how it is computed, so the decoder keeps the same scale even
# though it dots 160-wide vectors.
# :::
