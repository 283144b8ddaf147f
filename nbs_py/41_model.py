# %% [markdown]
# # The hybrid model
#
# > HyMo end to end: 3 Gated DeltaNet blocks for every MLA block, MoE on the attention blocks, a tied head, MTP; and what it costs in parameters, FLOPs and decode state, computed from the model.

# %%
#| default_exp models.model

# %% [markdown]
# The previous chapters built the parts: the Gated DeltaNet block (a linear-time recurrent mixer
# plus a dense SwiGLU FFN), the MLA block (softmax attention over a compressed key/value latent,
# with a DeepSeek-style mixture of experts as its FFN), and the multi-token-prediction heads. This
# chapter stacks them into `HyMo`, the model the trainer trains, and then counts, from the built
# model rather than by hand, how many parameters it stores and uses per token, how many FLOPs a
# training token costs, and how much state a sequence carries while decoding.
#
# | exported | what it is |
# |---|---|
# | `HyMo` | embedding → 32 blocks (3 GDN : 1 MLA) → final RMSNorm → tied head; MTP heads; `generate`, with `decode` carrying each block's state |
# | `build_hymo` | build on the meta device, materialise on a device, `init_weights()` |
# | `DecodeGraph` | one decoding step of `decode` captured as a CUDA graph and replayed (eager on a CPU), which `generate` uses on a GPU |
# | `param_breakdown`, `flops_breakdown`, `state_breakdown` | the accounting, part by part |
# | `doc_keys_per_query` | the mean keys an MLA query attends to in a row of packed documents, for `flops_breakdown` |

# %%
#| export
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hymo.config import ModelConfig, validate_model
from hymo.models.gdn import GatedDeltaNet, GatedDeltaNetBlock, GDNState
from hymo.models.layers import RMSNorm
from hymo.models.mla import MLABlock, MLACache, MultiHeadLatentAttention
from hymo.models.moe import DeepSeekMoE
from hymo.models.mtp import IGNORE_INDEX, MultiTokenPrediction, check_target_ids, lm_loss, lm_loss_fused

# %%
import matplotlib.pyplot as plt
from fastcore.test import test_eq, test_close, test_fail
from torch.testing import assert_close
from IPython.display import Markdown, display
from hymo.config import load_config

# %%
torch.set_num_threads(1)  # the tiny model's tensors are small: on a shared 2-core machine more threads only add contention
torch.manual_seed(0);

# %% [markdown]
# ## The stack
#
# With `mla_every = 4`, blocks $3, 7, 11, \dots$ (0-based) are MLA blocks and the other three in
# every four are GDN blocks: 24 GDN and 8 MLA in the 32-block design. `config.layer_types` spells
# the layout out; here it is drawn as one letter per block (G: GDN + dense SwiGLU, M: MLA + MoE).

# %%
big = load_config("hymo_750m").model
tiny = load_config("hymo_tiny").model
layout = "".join("M" if t == "mla" else "G" for t in big.layer_types)
print(" ".join(layout[i:i + 4] for i in range(0, len(layout), 4)))
test_eq([i for i, t in enumerate(big.layer_types) if t == "mla"], [3, 7, 11, 15, 19, 23, 27, 31])
test_eq(tiny.layer_types, ["gdn", "gdn", "gdn", "mla"])

# %% [markdown]
# Putting the attention block *last* in each group of four means the model ends on an attention
# block, and every attention block reads a residual stream that three recurrent blocks have
# already processed: the recurrent blocks summarise local context cheaply, the attention blocks
# retrieve exact tokens from anywhere in the window.
#
# ### Where the experts go
#
# Every block has a feed-forward network; what differs is its kind.
#
# * **GDN blocks: a dense SwiGLU** of width `ffn_inter_dim` (2560). The design document says in
#   one place that the GDN blocks are "recurrence-only"; that is not HyMo. A block without an FFN
#   would leave a quarter of the model's depth with no per-token non-linear capacity; every GDN
#   block has its SwiGLU, as the hybrid section and the FLOP table of the design assume.
# * **MLA blocks: the mixture of experts**, 1 shared + 16 routed SwiGLU experts of width
#   `moe_inter_dim` (2304), each token sent to the top 2 routed ones.
#
# Why not experts everywhere? An MoE layer multiplies *stored* parameters (16 routed experts) at a
# fixed *active* cost (2 of them), and each MoE layer is also a dispatch point: tokens are
# gathered per expert and, under expert parallelism, exchanged between GPUs. Eight MoE layers keep
# the stored size near a billion parameters and the dispatch points to eight per forward pass; 32
# MoE layers would quadruple the expert storage. This is a design choice made for a small model on
# one node, not a law: Jamba puts MoE on every other layer, Qwen3-Next and Kimi Linear throughout
# the stack.
#
# The design document also argues that the split gives "uniform" per-layer compute because every
# layer runs two experts. That is wrong on both counts: GDN blocks run no experts, and an MLA
# block's FFN (the shared expert plus two routed ones) costs about 2.7 times a GDN block's dense
# FFN. The numbers, from the 750M preset's shapes:

# %%
ffn_dense = 2 * 3 * big.dim * big.ffn_inter_dim  # SwiGLU: 3 matrices, 2 FLOPs per multiply-add
ffn_moe = 2 * 3 * big.dim * big.moe_inter_dim * (big.moe_n_shared + big.moe_top_k)
print(f"forward FLOPs per token: GDN block FFN {ffn_dense/1e6:.1f} M, MLA block MoE {ffn_moe/1e6:.1f} M")
assert ffn_moe > 2.5 * ffn_dense


# %% [markdown]
# ### HyMo among the hybrids
#
# | model | mixers | linear : attention | attention | FFN / MoE placement |
# |---|---|---|---|---|
# | Jamba (AI21, 2024) | Mamba (S6) + softmax attention | 7 : 1 (one attention layer per 8) | GQA, no positional encoding | MoE (16 experts, top-2) replaces the MLP in every other layer; 52 B stored, 12 B active |
# | Zamba-7B (Zyphra, 2024) | Mamba + **one shared** attention+MLP block | the shared block is applied after every 6 Mamba blocks | softmax attention, one set of weights reused at every application | dense (no MoE) |
# | StripedHyena-7B (Together, 2023) | Hyena (gated long convolutions) + attention | about 1 : 1 (the released config alternates them) | GQA with RoPE | dense MLP in every block |
# | Qwen3-Next-80B-A3B (Alibaba, 2025) | Gated DeltaNet + gated attention | 3 : 1 | softmax attention with an output gate, GQA, partial RoPE | high-sparsity MoE in every layer (512 experts, 10 routed + 1 shared); 80 B stored, ~3 B active; MTP |
# | Kimi Linear 48B-A3B (Moonshot, 2025) | Kimi Delta Attention (GDN with per-channel decay) + MLA | 3 : 1 | MLA without positional encoding (NoPE) | MoE FFNs throughout the stack (DeepSeek-V3 style); 48 B stored, ~3 B active |
# | **HyMo 750M** | Gated DeltaNet + MLA | 3 : 1 | MLA (latent KV cache), partial RoPE on 32 of 128 query/key dims | MoE (16 routed top-2 + 1 shared) on the 8 MLA blocks only; dense SwiGLU on the 24 GDN blocks; MTP depth 2 |
#
# Three corrections to the design document's version of this comparison: StripedHyena-7B is not a
# 1 : 7 hybrid (its public configuration interleaves attention and Hyena about one for one); Jamba
# puts its MoE on every other layer, not on every layer; and HyMo's closest relatives are not
# Jamba or Zamba but Qwen3-Next (same linear mixer, same 3 : 1 ratio) and Kimi Linear (a GDN-family
# mixer with MLA at 3 : 1). Both of those put experts throughout the stack; HyMo's placement of
# MoE on the attention blocks only is its own choice.

# %% [markdown]
# ## The model
#
# The forward pass reads as the architecture: embed, run the blocks, normalise, project onto the
# vocabulary with the embedding matrix itself (the *tied* head, $\text{logits} = h E^\top$ with
# $E \in \mathbb{R}^{|V| \times d}$ the embedding).
#
# `forward` is the single entry point the trainer calls: given `targets` it also runs the MTP heads
# and returns `(loss, parts)`, so that a wrapper such as FSDP-2, whose hooks run around the root
# module's `forward`, sees the whole step. Without targets it returns logits; with `mtp=False` the loss
# is the main one alone and the heads do not run (validation reports only that). With targets it never
# builds the logits: `lm_loss_fused` (from the MTP chapter) computes the three cross-entropies
# chunk by chunk from the hidden states; `model.loss_impl = "logits"` switches to the reference
# `lm_loss` on full logits, and a check below shows the two agree.
# `cu_seqlens` (document boundaries of a packed row, $B = 1$) goes to every block: the GDN state
# and convolution restart at each boundary, and MLA masks attention across documents.
#
# Under `torch.autocast` the residual stream is carried in the compute dtype (bf16): the embedding's
# output is cast once, and every block adds its bf16 branches to it. Left alone, autocast would keep
# it in fp32 (the embedding's weight is fp32, and fp32 plus bf16 is fp32), so every norm and every
# residual addition, forward and backward, would read and write twice the bytes. Under FSDP's mixed
# precision the stream is bf16 anyway (its parameters are bf16 copies), so both training paths now
# carry the same stream. Each norm still computes in fp32 inside. On one H200 the 750M step went
# from 6.74–6.78 s to 6.64–6.66 s (three alternating pairs in one process, results chapter).

# %%
#| export
def _need_tensor(name: str, x):
    "Refuse a list or a NumPy array where a tensor is read (it would fail later with a message that misnames it)."
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}: convert it with torch.as_tensor(...)")


class HyMo(nn.Module):
    "The HyMo language model: embedding, the 3:1 GDN/MLA stack, final RMSNorm, tied head, MTP heads."
    def __init__(self, config: ModelConfig):
        super().__init__()
        # `load_config`'s checks, also for a config changed in code; on a copy, whose values they normalise ('1e-6' -> 1e-06)
        self.config = c = validate_model(dataclasses.replace(config))
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(MLABlock(c, i) if c.is_mla(i) else GatedDeltaNetBlock(c) for i in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.mtp = MultiTokenPrediction(c)
        self.loss_impl = "fused"  # 'fused': `lm_loss_fused`, no [B, T, V] logits; 'logits': the reference `lm_loss`
        self.trained_len: Optional[int] = None  # the longest sequence it trained on, when known (`load_run` sets it): `generate`'s window
        self.init_weights()

    LOSS_IMPLS = ("fused", "logits")

    @property
    def loss_impl(self) -> str: return self._loss_impl

    @loss_impl.setter
    def loss_impl(self, value: str):  # refused where it is set, not after a whole forward
        if value not in self.LOSS_IMPLS: raise ValueError(f"loss_impl={value!r}: choose 'fused' or 'logits'")
        self._loss_impl = value

    def head(self, h: torch.Tensor) -> torch.Tensor:  # h [..., D] -> logits [..., V]
        "The output head, tied to the embedding: `h @ embed.weight.T`."
        return F.linear(h, self.embed.weight)

    def forward_with_hidden(self,
                            tokens: torch.Tensor,  # Token ids [B, T], long
                            cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        "Logits [B, T, V] and the hidden states after the final norm [B, T, D]."
        h = self.hidden_states(tokens, cu_seqlens)
        return self.head(h), h

    def hidden_states(self,
                      tokens: torch.Tensor,  # Token ids [B, T], long
                      cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
                     ) -> torch.Tensor:  # [B, T, D]
        "The trunk: embed, every block, the final norm."
        self._check_tokens(tokens, cu_seqlens)
        x = self.embed(tokens)                                    # (B, T, D)
        if torch.is_autocast_enabled(x.device.type):              # the residual stream in the compute dtype, as under FSDP
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for layer in self.layers: x = layer(x, cu_seqlens=cu_seqlens)
        return self.norm(x)

    def forward(self,
                tokens: torch.Tensor,  # Token ids [B, T], long
                targets: Optional[torch.Tensor] = None,  # Next-token ids [B, T] (`targets[:, t]` = x_{t+1}); None returns logits
                cu_seqlens: Optional[torch.Tensor] = None,  # [N+1] document boundaries of a packed row (B == 1)
                mtp: bool = True,  # Add the MTP heads' losses; False: the main loss alone, the heads not run (validation)
               ):
        "Logits [B, T, V] if `targets` is None, else `(loss, parts)`: main + weighted MTP losses (see `lm_loss`), or the main alone."
        if targets is not None: self._check_targets(targets, tokens)  # before the trunk runs
        h = self.hidden_states(tokens, cu_seqlens)
        if targets is None: return self.head(h)
        head = self.head if self.loss_impl == "logits" else None  # the fused loss projects the heads' states itself
        extra = self.mtp(h, targets, head, cu_seqlens) if mtp else []
        if head is not None: return lm_loss(self.head(h), targets, extra)
        return lm_loss_fused(h, self.embed.weight, targets, extra)

    def _check_ids(self, tokens):
        "Raise `ValueError` for ids outside the vocabulary (an embedding lookup would fail, on a GPU with a device-side assert)."
        V = self.config.vocab_size
        if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < V):
            raise ValueError(f"token ids must be in 0..{V - 1} (vocab_size={V}); got {int(tokens.min())}..{int(tokens.max())}")

    def _check_targets(self, targets, tokens):
        "Raise `ValueError` for targets the loss cannot take (on a GPU the fused loss would return NaN for a bad id)."
        _need_tensor("tokens", tokens); _need_tensor("targets", targets)
        if targets.shape != tokens.shape:
            raise ValueError(f"targets {tuple(targets.shape)} must have the shape of tokens {tuple(tokens.shape)}")
        if tokens.shape[1] <= self.config.mtp_depth:  # before the trunk runs, not after
            raise ValueError(f"sequence length {tokens.shape[1]} is too short for {self.config.mtp_depth} MTP heads: "
                             "use seq_len > mtp_depth")
        V = self.config.vocab_size
        if targets.dtype not in (torch.long, torch.int32):
            raise ValueError(f"targets must be integer ids (int64 or int32), got {targets.dtype}")
        check_target_ids(targets, V, f" (vocab_size={V})")  # on a CPU: the trainer's data is checked against vocab_size

    def _check_tokens(self, tokens, cu_seqlens):
        "Raise `ValueError` for token tensors the model cannot take (`TypeError` for what is no tensor)."
        _need_tensor("tokens", tokens)
        if cu_seqlens is not None: _need_tensor("cu_seqlens", cu_seqlens)
        if tokens.ndim != 2 or tokens.dtype not in (torch.long, torch.int32):
            raise ValueError(f"tokens must be integer ids of shape [B, T]; got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.shape[0] == 0: raise ValueError(f"tokens holds no sequence ({tuple(tokens.shape)}): give at least one row")
        if tokens.device.type == "cpu": self._check_ids(tokens)  # on a GPU this would wait for it: `generate` checks its prompt
        L = self.config.max_seq_len
        if cu_seqlens is None:
            if tokens.shape[1] > L:
                raise ValueError(f"sequence length {tokens.shape[1]} > max_seq_len={L}: crop the input or raise max_seq_len")
            return
        if tokens.shape[0] != 1:
            raise ValueError(f"cu_seqlens packs documents into one row: tokens must be [1, T], got {tuple(tokens.shape)}")
        if cu_seqlens.device != tokens.device:  # else a device mismatch deep in a layer (RoPE's positions, a kernel's read)
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but tokens on {tokens.device}: give both on one device "
                             f"(cu_seqlens.to(tokens.device))")
        # Packed, positions restart at every document: the row may be longer than max_seq_len, a document may not.
        # Boundaries on a GPU are not read back here (a wait for the GPU): MLA's layers check them as they read them.
        if cu_seqlens.device.type == "cpu":
            if cu_seqlens.ndim != 1 or len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != tokens.shape[1] or bool((cu_seqlens.diff() <= 0).any()):
                raise ValueError(f"cu_seqlens must rise strictly from 0 to T={tokens.shape[1]} (document boundaries of the row, "
                                 f"no empty document); got "
                                 f"{cu_seqlens.tolist()[:8]}{' ...' if len(cu_seqlens) > 8 else ''}")
            longest = int(cu_seqlens.diff().max())
            if longest > L:
                raise ValueError(f"a packed document has {longest} tokens > max_seq_len={L}: split long documents or raise max_seq_len")

    @torch.no_grad()
    def init_weights(self):
        """Set every parameter and buffer; works after `to_empty` from the meta device.

        | what | init |
        |---|---|
        | `embed.weight` (also the output head) | N(0, init_std²) |
        | hidden matrices: GDN q/k/v/a/b/g projections; MLA q_a, q_b (or q_proj without a query latent), kv_a, kv_b; SwiGLU w1, w3 (dense FFN, shared and routed experts); MTP proj_in | N(0, init_std²) |
        | output projections into the residual stream: GDN and MLA `o_proj`, every SwiGLU `w2` (dense, shared and routed experts); also MTP `proj_out`, which feeds an RMSNorm, at this scale for uniformity | N(0, (init_std / sqrt(2 n_layers))²) |
        | MoE router `gate.weight` | N(0, 0.006²), near-uniform first routing (`DeepSeekMoE.reset_parameters`) |
        | every RMSNorm weight | 1 |
        | GDN `A_log`, `dt_bias` | log U[1, 16]; softplus⁻¹ of logUniform[0.001, 0.1] (`GatedDeltaNet.reset_parameters`) |
        | GDN short convolutions | PyTorch's Conv1d default, U(±1/sqrt(conv_size)) |
        | MoE `gate_bias` and load counters (buffers) | 0 (`DeepSeekMoE.reset_parameters`) |

        Each block's `reset_parameters` sets its rows of this table; the experts' `w2` are then
        redrawn here at the residual scale. The embedding, the final norm and the MTP heads are set here.
        """
        c = self.config
        nn.init.normal_(self.embed.weight, std=c.init_std)
        out_std = c.init_std / math.sqrt(2 * c.n_layers)
        for layer in self.layers: layer.reset_parameters()
        for moe in self.moe_layers():  # the experts' down projections also write into the residual stream
            nn.init.normal_(moe.w2, std=out_std)
            if moe.shared is not None: nn.init.normal_(moe.shared.w2.weight, std=out_std)
        self.norm.reset_parameters()
        for blk in self.mtp.heads:
            blk.norm.reset_parameters(); blk.out_norm.reset_parameters()
            nn.init.normal_(blk.proj_in.weight, std=c.init_std)
            nn.init.normal_(blk.proj_out.weight, std=out_std)

    def moe_layers(self) -> list[DeepSeekMoE]:
        "The MoE modules, in depth order (the trainer calls `update_gate_bias()` on each after an optimiser step)."
        return [m for m in self.modules() if isinstance(m, DeepSeekMoE)]

    def num_params(self, active: bool = False) -> int:
        "Stored parameters (the tied embedding/head once, MTP heads included), or those one token uses if `active`."
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        return n - (_inactive_expert_params(self) if active else 0)

    def flops_per_token(self,
                        seq_len: int,  # Training window length T
                        keys: Optional[float] = None,  # Mean keys an MLA query attends to; None: T/2 (see `doc_keys_per_query`)
                       ) -> float:
        "Training FLOPs per token (forward + backward = 3 × forward, a multiply-add = 2 FLOPs); see `flops_breakdown`."
        return sum(flops_breakdown(self, seq_len, keys).values())

    def state_bytes(self, seq_len: int, dtype: torch.dtype = torch.bfloat16) -> int:
        "Bytes of decode state one sequence of `seq_len` tokens holds; see `state_breakdown`."
        return sum(state_breakdown(self, seq_len, dtype).values())

    def decode_state(self,
                     batch: int,  # Sequences decoded together
                     max_len: int,  # Most tokens they will hold, prompt included (at most max_seq_len)
                     dtype: Optional[torch.dtype] = None,  # Of the MLA caches: the residual stream's; None: the autocast dtype, else the weights'
                    ) -> list:  # per layer: None (a GDN block not yet run) or an `MLACache`
        "Empty decode state for `decode`: an `MLACache` per MLA block, a place for the `GDNState` of each GDN block."
        if not 0 < max_len <= self.config.max_seq_len:
            raise ValueError(f"max_len={max_len} must be in 1..max_seq_len={self.config.max_seq_len}")
        dev = self.embed.weight.device
        if dtype is None:
            dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else self.embed.weight.dtype
        return [MLACache.empty(self.config, batch, max_len, dev, dtype) if self.config.is_mla(i) else None
                for i in range(self.config.n_layers)]

    def decode(self,
               tokens: torch.Tensor,  # The new token ids [B, T]: a whole prompt, then one token per call
               state: list,  # From `decode_state`; updated in place
              ) -> torch.Tensor:  # logits of the new tokens [B, T, V]
        "The new tokens' logits given everything `state` has seen: `forward` on the whole sequence, restricted to them."
        if self.training:  # training routes with capacity and moves the MoE's load statistics: not inference
            raise RuntimeError("decode is for inference: call model.eval() first (generate does)")
        self._check_tokens(tokens, None)
        if tokens.shape[1] == 0: raise ValueError("decode needs at least one new token: tokens is [B, 0]")
        held = {c.c_kv.shape[0] if isinstance(c, MLACache) else c.recurrent.shape[0] for c in state if c is not None}
        if len(state) != self.config.n_layers or held - {tokens.shape[0]}:
            holding = f" made for batches of {'/'.join(map(str, sorted(held)))}" if held else ""  # a fresh GDN state holds none yet
            raise ValueError(f"tokens has {tokens.shape[0]} sequences, and the state has {len(state)} layers{holding} "
                             f"(the model has {self.config.n_layers}): give the state `decode_state` made for this batch")
        for c in state:  # before any layer moves: a refused call must leave the state as it was
            if isinstance(c, MLACache): c.check_room(tokens.shape[1], self.config.max_seq_len)
        x = self.embed(tokens)                                    # (B, T, D)
        if torch.is_autocast_enabled(x.device.type): x = x.to(torch.get_autocast_dtype(x.device.type))
        for i, layer in enumerate(self.layers):
            if self.config.is_mla(i): x = layer.forward_decode(x, state[i])  # appends to the latent cache
            else: x, state[i] = layer(x, initial_state=state[i], output_final_state=True)  # carries S and the conv window
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self,
                 tokens: torch.Tensor,  # Prompt ids [1, T]
                 max_new_tokens: int,  # Tokens to append
                 temperature: float = 1.0,  # Softmax temperature; 0 picks the most likely token
                 top_k: Optional[int] = None,  # Sample among the k most likely tokens only; None: all
                 top_p: Optional[float] = None,  # Then among the fewest most likely tokens whose probabilities add up to p (nucleus sampling); None: all
                 vocab: Optional[int] = None,  # Only ids below this: the tokenizer's size, when the model's vocabulary is larger
                 stop: Optional[int] = None,  # End early once this id (the end-of-text token) is drawn; it is kept
                 on_token: Optional[Callable[[int], None]] = None,  # Called with each new id as it is drawn (streaming)
                 cache: bool = True,  # Carry the GDN states and MLA caches (`decode`); False re-runs the whole forward per token
                 graph: bool = True,  # With `cache` on a GPU: replay each one-token step as a CUDA graph (`DecodeGraph`)
                 window: Optional[int] = None,  # Most tokens one forward reads: the length the model trained on (train.seq_len); None: `trained_len`, else max_seq_len
                ) -> torch.Tensor:  # [1, T + n], n <= max_new_tokens
        """Sample a continuation. With `cache`, the prompt runs once and each new token costs one token's work, until
        the text fills `window`; from there (and without `cache`) every token re-runs the last `window` tokens."""
        _need_tensor("tokens", tokens)
        if tokens.ndim != 2 or tokens.shape[0] != 1 or tokens.shape[1] == 0:
            raise ValueError(f"generate takes one prompt [1, T] of at least one token; got {tuple(tokens.shape)}")
        is_int = lambda n: isinstance(n, numbers.Integral) and not isinstance(n, bool)  # numpy's ints too
        if not (is_int(max_new_tokens) and max_new_tokens >= 0 and temperature >= 0 and math.isfinite(temperature)
                and (top_k is None or is_int(top_k) and top_k >= 1) and (top_p is None or 0 < top_p <= 1)):
            raise ValueError(f"generate needs an int max_new_tokens >= 0, a finite temperature >= 0, top_k None or an "
                             f"int >= 1 and top_p None or in (0, 1]; got max_new_tokens={max_new_tokens}, "
                             f"temperature={temperature}, top_k={top_k}, top_p={top_p}")
        V, L = self.config.vocab_size, self.config.max_seq_len
        if vocab is not None and not (is_int(vocab) and 1 <= vocab <= V):
            raise ValueError(f"vocab={vocab!r} must be an int in 1..{V} (the model's vocab_size): the tokenizer's size")
        name, window = ("window", window) if window is not None else ("trained_len", self.trained_len)  # None: max_seq_len
        if window is not None and not (is_int(window) and 1 <= window <= L):
            raise ValueError(f"{name}={window!r} must be an int in 1..max_seq_len={L}: the length the model was trained on")
        self._check_ids(tokens)  # once per call: a GPU waits for it here, not in every forward
        was_training = self.training
        self.eval()
        try: return self._sample(tokens, max_new_tokens, temperature, top_k, top_p, vocab, stop, on_token, cache, graph, window or L)
        finally: self.train(was_training)  # also after an error (or a stop from on_token): training routes differently

    def _sample(self, tokens, max_new_tokens, temperature, top_k, top_p, vocab, stop, on_token, cache, graph, L) -> torch.Tensor:
        "The loop of `generate`, in eval mode; `L` is its window."
        room = min(tokens.shape[1] + max_new_tokens, L) if cache else 0  # tokens the decode state will hold
        state, seen, step = None, 0, None  # the decode state, how many tokens of `tokens` it holds, a captured step
        if tokens.shape[1] < room and max_new_tokens > 0:
            state = self.decode_state(1, room)  # in the residual stream's dtype
        for _ in range(max_new_tokens):
            if state is not None and tokens.shape[1] <= room:
                if step is None and graph and tokens.is_cuda and seen > 0 and room - seen >= 8:  # the prompt is in: capture
                    step = DecodeGraph(self, state)
                logits = (step or self.decode)(tokens[:, seen:], state)[:, -1].float()  # (1, V)
                seen = tokens.shape[1]
            else:
                logits = self(tokens[:, -L:])[:, -1].float()                   # (1, V)
            if vocab is not None: logits[:, vocab:] = float("-inf")  # rows no token decodes to (never targets, but not -inf)
            if temperature == 0: nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = (logits.double() - logits.max(-1, keepdim=True).values) / temperature  # <= 0, in fp64: no tiny τ
                                                                                               # overflows or rounds to 0
                nxt = torch.multinomial(keep_likely(logits, top_k, top_p).softmax(-1), 1)  # (1, 1)
            tokens = torch.cat([tokens, nxt], 1)
            if on_token is not None: on_token(int(nxt))
            if stop is not None and int(nxt) == stop: break  # one host read per token; the forward dwarfs it
        return tokens


# %% [markdown]
# `build_hymo` is how the trainer makes a model: construct it on the meta device (no memory, no
# initialisation work, even for a model that would not fit on one device), allocate real storage
# with `to_empty`, then run `init_weights` once. The caller seeds the generator.

# %%
#| export
def build_hymo(config: ModelConfig,  # The architecture
               device: Optional[torch.device | str] = None,  # Where the weights live; None: the default device ('cpu')
              ) -> HyMo:
    "Build `HyMo(config)` on the meta device, materialise it on `device` and initialise it (`init_weights`)."
    with torch.device("meta"):
        model = HyMo(config)
    model.to_empty(device=device or "cpu")
    model.init_weights()
    return model


# %% [markdown]
# ### The tiny model, end to end
#
# One forward pass without targets gives logits; with targets, the loss and its parts. At
# initialisation the logits are small and every part of the loss is close to $\ln |V|$.

# %%
torch.manual_seed(0)
model = build_hymo(tiny)
print(model.layers)

# %%
B, T, V = 2, 64, tiny.vocab_size
tokens = torch.randint(0, V, (B, T))
targets = torch.randint(0, V, (B, T))
test_eq(model(tokens).shape, (B, T, V))
loss, parts = model(tokens, targets)
print({k: round(v.item(), 3) for k, v in parts.items()}, "ln V =", round(math.log(V), 3))
for v in parts.values(): test_close(v, math.log(V), eps=0.3)
test_close(loss, parts["main"] + 0.3 * parts["mtp_1"] + 0.1 * parts["mtp_2"], eps=1e-4)


# %% [markdown]
# Under autocast the blocks receive, and pass on, a bf16 residual stream; without it, fp32:

# %%
def stream_dtypes(**autocast):
    "The dtype of the residual stream entering every block, in one forward pass."
    seen = []
    hooks = [blk.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype)) for blk in model.layers]
    with torch.autocast("cpu", dtype=torch.bfloat16, **autocast): model(tokens)
    for h in hooks: h.remove()
    return set(seen)

test_eq(stream_dtypes(), {torch.bfloat16})
test_eq(stream_dtypes(enabled=False), {torch.float32})

# %% [markdown]
# The head is tied: there is one vocabulary matrix, and it is the embedding.

# %%
logits, h = model.forward_with_hidden(tokens)
assert_close(logits, h @ model.embed.weight.T)
assert not any(p.shape == model.embed.weight.shape for n, p in model.named_parameters() if n != "embed.weight")


# %% [markdown]
# The fused loss (the default) and the reference on full logits agree, loss and every gradient.
# (MoE capacity drops depend on the batch, not on the loss, so both runs route alike.)

# %%
def loss_and_grads(impl):
    model.loss_impl = impl
    model.zero_grad()
    loss, parts = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

(l_f, g_f), (l_r, g_r) = loss_and_grads("fused"), loss_and_grads("logits")
model.loss_impl = "fused"; model.zero_grad()
test_close(l_f, l_r, eps=1e-5)
test_eq(g_f.keys(), g_r.keys())
for n in g_r: assert_close(g_f[n], g_r[n], atol=1e-6, rtol=1e-4)
test_fail(lambda: setattr(model, "loss_impl", "chunked"), contains="choose 'fused' or 'logits'")  # refused where it is set
with torch.no_grad():  # int32 ids, which the data loader may hand over, are taken by both
    for impl in ("fused", "logits"):
        model.loss_impl = impl
        test_close(model(tokens.int(), targets.int())[0], l_f, eps=1e-5)
model.loss_impl = "fused"

# %% [markdown]
# Bad input is refused with a message that says what to do:

# %%
test_fail(lambda: model(tokens.float()), contains="integer ids of shape [B, T]")
test_fail(lambda: model(tokens[:0]), contains="holds no sequence")
test_fail(lambda: model(torch.zeros(1, tiny.max_seq_len + 1, dtype=torch.long)), contains="max_seq_len")
test_fail(lambda: model(tokens, cu_seqlens=torch.tensor([0, 32, 64])), contains="must be [1, T]")
long_doc = torch.tensor([0, 5, tiny.max_seq_len + 6])
test_fail(lambda: model(torch.zeros(1, tiny.max_seq_len + 6, dtype=torch.long), cu_seqlens=long_doc), contains="split long documents")
for cu in ([0, 5, 10], [0, 7, 5, 12], [2, 12], [12], [0, 5, 5, 12]):  # not ending at T = 12, falling, not at 0, none, empty
    test_fail(lambda: model(torch.zeros(1, 12, dtype=torch.long), cu_seqlens=torch.tensor(cu)), contains="(document boundaries of the row, no empty document)")
# Targets are ids of the vocabulary, or IGNORE_INDEX (-100) where a position has no loss; -1, a common slip, is refused
V = tiny.vocab_size
for bad in (-1, V):
    test_fail(lambda: model(tokens, targets.masked_fill(targets == targets[0, 0], bad)), contains=f"ids in 0..{V - 1}")
test_fail(lambda: model(tokens, targets.float()), contains="targets must be integer ids")
with torch.no_grad(): assert torch.isfinite(model(tokens, targets.masked_fill(targets % 2 == 0, IGNORE_INDEX))[0])

# %% [markdown]
# With `cu_seqlens` the positions restart at every document, so a packed row may be longer than
# `max_seq_len` as long as each document fits. The trainer packs a micro-batch of $B$ windows of
# $T$ tokens into one row of $BT$ (a window always starts a document), which is how
# `doc_masking=true` trains; the MTP heads take the same boundaries and skip targets in a later
# document (chapter 40). On one H200 the 750M step with documents of about 1 024 tokens costs
# 11 to 24 % more than without, depending on the machine (1.93 to 2.16 s per 8 micro-batches
# against 1.70 to 1.74 s; the latest pair, measured together, 2.11 against 1.70 s, 26.2 % MFU with attention counted
# within each document, as below; the results page): MLA attends through one varlen flash call, and what is left is the host reading
# document boundaries from the GPU.

# %%
rows = torch.randint(0, tiny.vocab_size, (3, tiny.max_seq_len))
with torch.no_grad():
    packed = model(rows.reshape(1, -1), cu_seqlens=torch.arange(4) * tiny.max_seq_len)
    assert_close(packed.reshape(rows.shape + packed.shape[-1:]), model(rows), atol=1e-4, rtol=1e-4)

# %% [markdown]
# **Causality.** Changing token $t$ must never change a logit before $t$: that holds for every
# block (the GDN recurrence and convolution only look back, MLA is masked) and so for the stack.
# One caveat belongs to the MoE: with a *capacity factor*, whether a token is dropped by its expert
# depends on how many other tokens of the batch, later ones included, chose that expert. Dropping
# is thus not causal (DeepSeek-V3 trains dropless, though the reason its paper gives is its good
# load balance; the leak is our argument for keeping drops out of inference). HyMo applies the capacity
# only in training mode: evaluation and generation route dropless, so inference is causal. The
# check below uses a dropless configuration so that it also holds in training mode.

# %%
causal_cfg = load_config("hymo_tiny", moe_capacity_factor=None).model
torch.manual_seed(0)
m_causal = build_hymo(causal_cfg)
x = torch.randint(0, V, (1, 48))
ref = m_causal(x)
for t in (0, 20, 47):
    x2 = x.clone(); x2[0, t] = (x2[0, t] + 1) % V
    out = m_causal(x2)
    test_eq((out[:, :t] - ref[:, :t]).abs().max().item() if t else 0.0, 0.0)
    assert (out[:, t] - ref[:, t]).abs().max() > 0

# %% [markdown]
# **Packed documents.** With `cu_seqlens`, a row holding several documents gives each document the
# logits it would get alone.
#
# (In a packed row the main head's target at a document's last position is the end-of-text token
# that opens the next document; chapter 40 keeps it, since predicting where a document ends is worth
# learning. MTP head $k$ at position $t$ predicts $x_{t+1+k}$, so at a document's last $k$ positions
# its target lies past that end-of-text token. Given `cu_seqlens`, `MultiTokenPrediction` sets those
# targets to $-100$ itself, which both losses ignore; the loader does nothing.)

# %%
docs = [torch.randint(0, V, (1, n)) for n in (5, 70, 21)]
cu = torch.tensor([0, 5, 75, 96])
packed = m_causal(torch.cat(docs, 1), cu_seqlens=cu)
for n, d in enumerate(docs):
    assert_close(packed[:, cu[n]:cu[n + 1]], m_causal(d), atol=1e-4, rtol=1e-4)


# %% [markdown]
# ### Generation: the state a hybrid carries
#
# `generate` samples one token at a time. The simple way runs the whole forward pass again for every
# new token (`cache=False`): each token pays for the whole prefix, quadratic in the length. The
# hybrid's point is that it need not. Each GDN block carries its `GDNState` (the delta-rule state
# $S$ and the last $W-1$ inputs of the short convolution, chapter 12) and each MLA block its latent
# cache (`MLACache`, with absorbed attention, chapter 21). `decode` runs new tokens through the
# stack with that state: the whole prompt in one call, then one token per call. Each call gives the
# logits `forward` would give those tokens at the end of the whole sequence.
#
# `generate` uses it by default. When the text grows past its `window` it falls back to re-running
# the last `window` tokens for each new one, as `cache=False` always does. The window is the length
# the model was trained on (`train.seq_len`; `python -m hymo.generate` and the trainer's samples pass
# it, and a model loaded from a run folder knows it as `trained_len`), so the model never sees a
# position it was not trained on; without one it is `max_seq_len`, the longest sequence the model accepts,
# which a run may train below (`hymo_tiny`: 256 against 128).
#
# The check needs weights at unit scale: at `init_std = 0.02` every logit is near zero, and any
# two functions would "agree". It uses eight blocks, so that two are MLA blocks and one of those
# skips RoPE (`nope_layers`), and a prompt of 70 tokens, longer than one GDN chunk of 64.

# %%
def unit_scale_(m: nn.Module, seed: int = 0) -> nn.Module:
    "Matrices N(0, 1/fan_in), norm gains 1 + N(0, 0.1²); GDN's decay parameters keep their initialisation."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim >= 2: p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name.split(".")[-2]: p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return m

dec_cfg = load_config("hymo_tiny", n_layers=8, nope_layers=[7]).model
torch.manual_seed(0)
dec = unit_scale_(build_hymo(dec_cfg)).eval()
print(dec_cfg.layer_types, "NoPE:", dec_cfg.nope_layers)
seq = torch.randint(0, V, (1, 78))
with torch.no_grad():
    full = dec(seq)                                               # (1, 78, V)
    state = dec.decode_state(1, 78)
    steps = [dec.decode(seq[:, :70], state)] + [dec.decode(seq[:, t:t + 1], state) for t in range(70, 78)]
err = (torch.cat(steps, 1) - full).abs().max().item()
print(f"logits of order {full.abs().max().item():.0f}; max |decode - forward| = {err:.1e}")
assert err < 1e-3 and full.abs().max() > 1
test_eq([c.length for c in state if isinstance(c, MLACache)], [78, 78])
test_eq(state[0].recurrent.shape, (1, dec_cfg.gdn_n_heads, dec_cfg.gdn_head_k_dim, dec_cfg.gdn_head_v_dim))

# %% [markdown]
# A call that does not fit the caches is refused before any layer runs, so the state is as it was
# and decoding can go on from it:

# %%
with torch.no_grad():
    state = dec.decode_state(1, 12)
    first = dec.decode(seq[:, :5], state)
    test_fail(lambda: dec.decode(seq[:, 5:13], state), contains="larger max_len")  # 5 + 8 tokens > 12
    rest = dec.decode(seq[:, 5:12], state)
assert (torch.cat([first, rest], 1) - full[:, :12]).abs().max() < 1e-3


# %% [markdown]
# ### Which tokens may be drawn
#
# A sampled token comes from the softmax of the logits divided by the temperature $\tau$ (below 1
# sharpens it, 0 is the argmax). Two common filters first cut the long tail of unlikely tokens, where
# most of a small model's nonsense comes from: **top-k** keeps the $k$ highest logits, and
# **top-p** (nucleus sampling, Holtzman et al., 2019) keeps the fewest most likely tokens whose
# probabilities add up to at least $p$: a short list where the model is sure, a long one where it is
# not, which a fixed $k$ cannot do. Sorted by probability, $p_{(1)} \ge p_{(2)} \ge \dots$, token
# $(i)$ is kept when the tokens before it hold less than $p$:
# $\sum_{j<i} p_{(j)} < p$. The most likely token is always kept, and $p = 1$ keeps all; a token as
# likely as the last one kept is kept too, so that which of two equal tokens survives does not depend
# on their ids (top-k keeps the ties of its $k$-th for the same reason). Both filters
# run in that order, as most libraries apply them: top-p measures its mass after top-k has cut the
# rest, on the renormalised probabilities.

# %%
#| export
def keep_likely(logits: torch.Tensor, # Scores of the next token [B, V], already divided by the temperature
                top_k: Optional[int] = None, # Keep the k highest; None: all
                top_p: Optional[float] = None, # Then the fewest most likely whose probabilities add up to at least p; None: all
               ) -> torch.Tensor: # `logits`, every other token at -inf
    "The tokens top-k and then top-p (nucleus) sampling draw from; the others' logits set to -inf."
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # (ties with the k-th stay)
    if top_p is not None and top_p < 1:
        probs = logits.softmax(-1)
        p = probs.sort(-1, descending=True).values  # (B, V), most likely first
        least = p.masked_fill(p.cumsum(-1) - p >= top_p, 2).amin(-1, keepdim=True)  # the nucleus's least likely
        logits = logits.masked_fill(probs < least, float("-inf"))  # (ties with it stay, as with the k-th)
    return logits


# %% [markdown]
# Checked against the definition, token by token in Python, on random logits and on a small example
# worked by hand: probabilities 0.5, 0.3, 0.15, 0.05 and $p = 0.7$ keep the first two (0.5 is not
# yet 0.7; 0.8 is), and $p = 0.85$ also the third. (At $p = 0.8$ exactly, the first two's 0.8 comes out of
# the softmax as 0.7999…, and the third is kept: a boundary that rounding decides.)

# %%
def keep_likely_naive(logits, top_k=None, top_p=None):
    "The same, one row and one token at a time."
    out = []
    for row in logits.tolist():
        kept = sorted(range(len(row)), key=lambda i: -row[i])[:top_k or len(row)]
        kept = [i for i in range(len(row)) if row[i] >= min(row[j] for j in kept)]  # the ties of the k-th too
        z = sum(math.exp(row[i]) for i in kept)
        if top_p is not None:
            mass, nucleus = 0.0, []
            for i in sorted(kept, key=lambda i: -row[i]):
                if mass >= top_p and row[i] < row[nucleus[-1]]: break  # (a tie with the last one kept stays)
                nucleus.append(i); mass += math.exp(row[i]) / z
            kept = nucleus
        out.append([x if i in kept else float("-inf") for i, x in enumerate(row)])
    return torch.tensor(out, dtype=logits.dtype)

hand = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64).log()
for p, n in ((0.7, 2), (0.85, 3), (1.0, 4), (1e-9, 1)):
    test_eq(keep_likely(hand, top_p=p).isfinite().sum().item(), n)
test_eq(keep_likely(torch.zeros(1, 4), top_p=0.5).isfinite().sum().item(), 4)  # four equal tokens: none is preferred
g = torch.Generator().manual_seed(0)
for k, p in ((None, 0.9), (5, 0.5), (20, 0.95), (3, None), (None, None)):
    x = torch.randn(6, 40, generator=g, dtype=torch.float64) * 2
    test_eq(keep_likely(x, k, p), keep_likely_naive(x, k, p))

# %% [markdown]
# So the cached and the uncached `generate` draw the same tokens, greedy or sampled with one seed,
# including a run that outgrows `max_seq_len` (here 24, for a prompt of 10 and 30 new tokens) or a
# smaller `window` (16) and continues on the window. (The same up to rounding: their logits differ in
# the last bits, so a near-tie between two tokens can go either way, as a 300-token greedy run in
# fp32 on a GPU showed at its 127th token.) The model's mode is restored, also when the loop stops with an error; a
# negative temperature (which would favour the least likely tokens), `top_k=0` and a `top_p` outside
# $(0, 1]$ are refused.

# %%
prompt = seq[:, :10]
test_eq(dec.generate(prompt, 30, temperature=0), dec.generate(prompt, 30, temperature=0, cache=False))
for cache in (True, False): torch.manual_seed(3); drawn = dec.generate(prompt, 30, temperature=0.8, top_k=50, cache=cache); print(drawn[0, 10:].tolist())
torch.manual_seed(3)
test_eq(drawn, dec.generate(prompt, 30, temperature=0.8, top_k=50))
short = load_config("hymo_tiny", n_layers=8, nope_layers=[7], max_seq_len=24, seq_len=16).model
dec_short = unit_scale_(build_hymo(short)).eval()
test_eq(dec_short.generate(prompt, 30, temperature=0), dec_short.generate(prompt, 30, temperature=0, cache=False))
test_eq(dec_short.generate(prompt, 30, temperature=0, window=16), dec_short.generate(prompt, 30, temperature=0, cache=False, window=16))
test_fail(lambda: dec_short.decode_state(1, 25), contains="max_seq_len=24")
out = model.generate(tokens[:1, :8], max_new_tokens=6, temperature=0.8, top_k=50)
test_eq((out.shape, out[:, :8]), ((1, 14), tokens[:1, :8]))
assert model.training  # generate restores the mode it found
for bad in (dict(temperature=-0.5), dict(temperature=float("nan")), dict(top_k=0), dict(top_p=0), dict(top_p=1.5),
            dict(top_p=float("nan")), dict(max_new_tokens=-1)):
    test_fail(lambda: model.generate(tokens[:1, :8], **{"max_new_tokens": 2, **bad}), contains="generate needs")
test_fail(lambda: model.generate(tokens[:1, :0], 2), contains="at least one token")
def interrupt(i): raise KeyboardInterrupt
test_fail(lambda: model.generate(tokens[:1, :8], 4, on_token=interrupt), exc=KeyboardInterrupt)
assert model.training  # also when the loop is interrupted

# %% [markdown]
# What it buys, on this CPU for the tiny eight-block model and 200 new tokens after a prompt of 10
# (printed, not asserted: a timing is a benchmark, not a test):

# %%
import time

# %%
for cache in (True, False):
    t0 = time.perf_counter(); dec.generate(prompt, 200, temperature=0, cache=cache)
    print(f"cache={cache}: {200 / (time.perf_counter() - t0):.0f} tokens/s")


# %% [markdown]
# ### A decoding step as one CUDA graph
#
# On a GPU, that step is bound by the host. One token through the 750M model is about 3 000 small
# kernels (about a hundred a block: the projections, norms, gates, the convolution's window, the
# routing), each a few microseconds of GPU work, and Python launches them one after another: in
# round 24 the H200 decoded 16 tokens/s with the state, no faster than re-running a 512-token
# context (chapter 80). A CUDA graph records the kernels of one call once, with their arguments'
# addresses, and replays them all with one launch. Capturing needs a step whose work does not
# depend on values the host would have to read, and whose tensors stay where they were:
#
# - shapes that do not change with the length: `MLACache.append` returns the whole buffers and the
#   causal mask hides what is not written yet (chapter 21);
# - no host reads: the new token's position comes from the cache's device counter `pos`, the
#   convolution's window is a concatenation (chapter 12), and a decoding step's experts are
#   gathered rather than sorted (`experts_gathered`, chapter 30);
# - fixed addresses: `decode` returns new `GDNState` tensors, so the captured step copies them back
#   into the state it started from, and reads its input token from a buffer of its own.
#
# Capturing does not run the kernels, but the warm-up calls before it do (Triton compiles, cuBLAS
# chooses its kernels), and they advance the state; `DecodeGraph` saves the state first and puts it
# back, also when capturing fails. Without `capture` (or on a CPU) it warms up and restores the same
# way, then runs the step eagerly, which is how the bookkeeping is checked here. Under autocast the
# step runs with autocast's cache of bf16 weight copies turned off, so the casts are recorded in the
# graph rather than read from copies that live only as long as the caller's autocast region. Once
# built, the graph is the only thing that may step its state: an eager `decode` in between would
# replace GDN states the graph never reads, so the next call refuses.

# %%
#| export
class DecodeGraph:
    """`decode` of one new token per sequence, captured once as a CUDA graph and replayed per token. Call it as
    `decode`: `step(tokens [B, 1], state)`, with the `state` it was built on, which it updates in place; once built,
    only it may step that state."""
    def __init__(self, model: HyMo,  # In eval mode, with the prompt already run through `decode(prompt, state)`
                 state: list,  # That decode state; its GDN states are replaced by copies the graph owns
                 capture: Optional[bool] = None,  # Record a CUDA graph; None: when the model is on a GPU. False runs eagerly
                 warmup: int = 2):  # Eager steps before capturing (compilation, kernel choices); the state is restored
        if any(s is None for s in state):
            raise ValueError("run the prompt through model.decode(prompt, state) first: the GDN blocks have no state yet")
        self.model, self.state = model, state
        for i, s in enumerate(state):  # addresses the graph owns (the prompt's state may be views of larger tensors)
            if isinstance(s, GDNState): state[i] = GDNState(s.recurrent.clone(), s.conv.clone())
        self.entries = list(state)  # an eager `decode` on `state` would replace these: see __call__
        self.caches = [s for s in state if isinstance(s, MLACache)]
        for c in self.caches: c.check_room(1)
        self.token = torch.zeros(self._batch(), 1, dtype=torch.long, device=model.embed.weight.device)  # (B, 1) the input
        self.graph = None
        if capture is None: capture = self.token.is_cuda
        dev = self.token.device.type  # the caller's autocast without its cache of cast weights: the casts are recorded
        self.autocast = (torch.autocast(dev, torch.get_autocast_dtype(dev), cache_enabled=False)  # too, rather than
                         if torch.is_autocast_enabled(dev) else contextlib.nullcontext())       # read from that cache
        saved = self._save()
        try:
            free = min((c.c_kv.shape[1] - c.length for c in self.caches), default=warmup)
            side = torch.cuda.Stream() if capture else None  # warm up off the stream that will record, as PyTorch advises
            if capture: side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side) if capture else contextlib.nullcontext():
                for _ in range(min(warmup, free)): self._step()
            if capture: torch.cuda.current_stream().wait_stream(side)
            self._restore(saved)
            if capture:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph): self.logits = self._step()  # recorded, not run
        finally:
            self._restore(saved)  # after the warm-up (or a failure), and the host-side lengths that moved while recording

    def _batch(self) -> int:
        s = self.state[0]
        return (s.c_kv if isinstance(s, MLACache) else s.recurrent).shape[0]

    def _tensors(self) -> list[torch.Tensor]:
        return [t for s in self.state for t in ((s.c_kv, s.k_rope, s.pos) if isinstance(s, MLACache) else s)]

    def _save(self): return [t.clone() for t in self._tensors()], [c.length for c in self.caches]

    def _restore(self, saved):
        for t, v in zip(self._tensors(), saved[0]): t.copy_(v)
        for c, n in zip(self.caches, saved[1]): c.length = n

    def _step(self) -> torch.Tensor:
        "One `decode` call on the input buffer, writing the new GDN states back where the old ones were."
        new = list(self.state)
        with self.autocast: logits = self.model.decode(self.token, new)  # rebinds new's GDN entries; appends to the caches
        for old, s in zip(self.state, new):
            if isinstance(old, GDNState):
                old.recurrent.copy_(s.recurrent); old.conv.copy_(s.conv)
        return logits

    def __call__(self, tokens: torch.Tensor,  # [B, 1] the new token of each sequence
                 state: list,  # The state this step was built on
                ) -> torch.Tensor:  # [B, 1, V] logits
        if state is not self.state: raise ValueError("a DecodeGraph steps the state it was built on; build one for this state")
        if any(s is not e for s, e in zip(state, self.entries)):
            raise ValueError("this state was stepped by something else (an eager model.decode) since the DecodeGraph was "
                             "built, which the graph would not see: build a new DecodeGraph")
        if tokens.shape != self.token.shape: raise ValueError(f"one token per sequence: [{self._batch()}, 1], got {tuple(tokens.shape)}")
        for c in self.caches: c.check_room(1)
        self.token.copy_(tokens)
        if self.graph is None: return self._step()
        self.graph.replay()
        for c in self.caches: c.length += 1
        return self.logits.clone()  # the graph's buffer is overwritten by the next replay


# %% [markdown]
# Checked on the CPU, eagerly: after a prompt, the steps through `DecodeGraph` (warm-up and
# restore included) give the logits `decode` gives, token by token. On a GPU, `generate` captures
# the graph after the prompt when at least eight tokens will go through it; the test suite checks
# there that it draws what the eager steps draw (`tests/test_model.py`). On the H200 the 750M model
# then decodes about 140–150 tokens/s in fp32 at batch 1, against 15–18 with eager steps (chapter 80).

# %%
with torch.no_grad():
    state = dec.decode_state(1, 78)
    dec.decode(seq[:, :70], state)
    g_step = DecodeGraph(dec, state, capture=False)  # two warm-up steps, then the state put back
    stepped = [g_step(seq[:, t:t + 1], state) for t in range(70, 78)]
assert_close(torch.cat(stepped, 1), full[:, 70:78], atol=1e-3, rtol=0)
test_eq([c.length for c in state if isinstance(c, MLACache)], [78, 78])
test_fail(lambda: g_step(seq[:, :1], state), contains="larger max_len")
test_fail(lambda: g_step(seq[:, :1], dec.decode_state(1, 78)), contains="the state it was built on")
test_fail(lambda: DecodeGraph(dec, dec.decode_state(1, 78)), contains="run the prompt through")
with torch.no_grad():  # room for one more token: the warm-up takes one step, and the state is put back
    state = dec.decode_state(1, 71)
    dec.decode(seq[:, :70], state)
    g_step = DecodeGraph(dec, state, capture=False)
    test_eq([c.length for c in state if isinstance(c, MLACache)], [70, 70])
    assert_close(g_step(seq[:, 70:71], state), full[:, 70:71], atol=1e-3, rtol=0)
    state = dec.decode_state(1, 78)
    dec.decode(seq[:, :70], state)
    g_step = DecodeGraph(dec, state, capture=False)
    dec.decode(seq[:, 70:71], state)  # an eager step the graph would not see
    test_fail(lambda: g_step(seq[:, 71:72], state), contains="stepped by something else")


# %% [markdown]
# ### The initialisation, checked
#
# Every matrix that writes into the residual stream (`o_proj`, `w2`; the MTP heads' `proj_out`, which
# feeds an RMSNorm, only for uniformity) is drawn with
# standard deviation $\sigma / \sqrt{2L}$, the other matrices with $\sigma$ (`init_std`, 0.02). Each
# block adds two residual branches, so after $L$ blocks $2L$ roughly independent terms have been
# summed; scaling their last matrix by $1/\sqrt{2L}$ keeps the residual stream's variance at
# initialisation independent of depth (GPT-2's rule). The empirical standard deviations of the
# built 750M model's weights (on CPU, a few blocks) follow the table:

# %%
def weight_stds(model):
    "Empirical std of every matrix but the convolutions and routers, grouped into residual outputs and the rest."
    out_names = ("o_proj", "w2", "proj_out")
    res, rest = {}, {}
    for n, p in model.named_parameters():
        if p.ndim < 2 or "conv" in n or n == "embed.weight" or n.endswith("gate.weight"): continue
        (res if n.split(".")[-1] in out_names or n.split(".")[-2] in out_names else rest)[n] = p.float().std().item()
    return res, rest

small_big = load_config("hymo_750m", n_layers=4, vocab_size=4096, moe_n_routed=4).model  # the 750M widths, 4 blocks
torch.manual_seed(0)
res, rest = weight_stds(build_hymo(small_big))
target = small_big.init_std / math.sqrt(2 * small_big.n_layers)
for n, s in res.items(): test_close(s, target, eps=0.1 * target)
for n, s in rest.items(): test_close(s, small_big.init_std, eps=0.1 * small_big.init_std)
print(f"{len(res)} output projections at std {target:.4f}; {len(rest)} other matrices at std {small_big.init_std}")

# %% [markdown]
# Building on the meta device and then `to_empty` + `init_weights` gives the same model as
# building directly, tensor for tensor, when both start from the same seed: every value set in
# `__init__` is set again by `init_weights`.

# %%
torch.manual_seed(3); a = build_hymo(tiny)
torch.manual_seed(3); b = HyMo(tiny); torch.manual_seed(3); b.init_weights()
for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()): assert_close(p, q, msg=n)


# %% [markdown]
# ## Accounting
#
# Everything below is read off a built model: parameter counts from its tensors, FLOPs from its
# matrices and the attention and recurrence shapes of its blocks. The 750M model is built on the
# meta device, so it costs no memory.
#
# ### Parameters
#
# *Stored* parameters are everything in a checkpoint, the tied embedding/head counted once and the
# MTP heads included. *Active* parameters are those one token touches in a forward pass: the same,
# minus the routed experts it is not sent to. Each MoE layer holds `moe_n_routed` routed experts of
# $3 \cdot d \cdot d_\text{moe}$ weights and a token uses `moe_top_k` of them, so
# $$N_\text{active} = N_\text{stored} - n_\text{MLA} \cdot (n_\text{routed} - k) \cdot 3\, d\, d_\text{moe}.$$

# %%
#| export
def _routed_expert_params(moe: DeepSeekMoE) -> int:
    "Parameters of the routed experts of one MoE layer (all `moe_n_routed` of them)."
    return moe.w1.numel() + moe.w2.numel() + moe.w3.numel()


def _inactive_expert_params(model: HyMo) -> int:
    "Routed-expert parameters a token does not use, over all MoE layers."
    c = model.config
    return sum(_routed_expert_params(m) * (c.moe_n_routed - c.moe_top_k) // c.moe_n_routed for m in model.moe_layers())


def _numel(module: nn.Module) -> int: return sum(p.numel() for p in module.parameters())


def param_breakdown(model: HyMo) -> dict[str, int]:
    "Stored parameters by part of the model; the parts add up to `model.num_params()`."
    gdn = [l for l in model.layers if isinstance(l, GatedDeltaNetBlock)]
    mla = [l for l in model.layers if isinstance(l, MLABlock)]
    moes = model.moe_layers()
    of_type = lambda blocks, cls: sum(_numel(m) for b in blocks for m in b.modules() if type(m) is cls)
    norms = sum(_numel(n) for b in model.layers for n in b.children() if isinstance(n, RMSNorm)) + _numel(model.norm)
    routed = sum(_routed_expert_params(m) for m in moes)
    return {"embedding (= tied head)": model.embed.weight.numel(),
            "GDN mixers": of_type(gdn, GatedDeltaNet),
            "GDN dense SwiGLU FFNs": sum(_numel(b.ffn) for b in gdn),
            "MLA attention": of_type(mla, MultiHeadLatentAttention),
            "MoE routed experts": routed,
            "MoE shared experts + routers": sum(_numel(m) for m in moes) - routed,
            "block norms + final norm": norms,
            "MTP heads": _numel(model.mtp)}


# %% [markdown]
# ### FLOPs per training token
#
# The convention: a multiply-add is 2 FLOPs, and a training step (forward + backward) costs
# 3 × the forward pass (the backward computes gradients with respect to both the activations and
# the weights, two matrix products for every one in the forward). Four terms:
#
# 1. **Matrices.** Every weight a token uses is one multiply-add: $2 N_\text{mat}$ forward, where
#    $N_\text{mat}$ counts the active matrices (projections, FFNs, the shared and the $k$ chosen
#    experts, routers, the depthwise convolutions) plus the output head $|V| \cdot d$, which is a
#    matrix product even though its weights are the embedding's. The embedding lookup costs
#    nothing. This is the familiar $6N$ per training token. (With a capacity factor, dropped
#    assignments still run through their experts with weight 0, chapter 30: the count is the work
#    done, a little more than the useful work when tokens are dropped.)
# 2. **MTP heads.** Each head runs its small MLP *and* the $|V| \times d$ vocabulary projection
#    again: $2\,(N_\text{mtp} + D \cdot |V| \cdot d)$ forward for $D$ heads.
# 3. **Attention** grows with the window $T$. A query at position $t$ scores $t+1$ keys with
#    $d_{qk} = d_\text{nope} + d_\text{rope}$ dimensions and sums as many values of $d_v$; over a
#    causal window the mean is about $T/2$ keys, so per token and MLA block the forward costs
#    $2 H (d_{qk} + d_v) \cdot T/2 = H (d_{qk} + d_v)\, T$.
#    (PaLM's formula counts the full $T$, twice this, which for `hymo_750m` at $T = 4096$ adds
#    9.1 % to the total and as much to every MFU; so did the Megatron-LM paper's of 2021. We count
#    the causal half, as Megatron-LM's code now does, which is what a FlashAttention-style kernel
#    computes.) Packed documents attend less: a query sees only its own
#    document, so documents of lengths $L_i$ give a mean of $\sum_i L_i^2 / (2 \sum_i L_i)$ keys, in the
#    same convention ($L/2$ a query in a document of $L$ tokens; the exact count, $(L+1)/2$, differs
#    by half a key, 0.1 % at $L = 1024$)
#    (`keys=`; `doc_keys_per_query` reads it off `cu_seqlens`), and the trainer counts each
#    micro-batch of packed documents so. Left at $T/2$, the count is that of the same tokens unmasked.
# 4. **The chunked gated delta rule**, per head and chunk of $C$ tokens (chapter 12's
#    `_chunk_rule`): $KK^\top$, $W = T(\ldots K)$, $QK^\top$ cost $2C^2K$ each; $U = T(\ldots V)$ and
#    the intra-chunk $(QK^\top \odot D) V_\text{new}$ cost $2C^2V$ each; $V_\text{new} = U - WS$,
#    $QS$ and the state update $K^\top V_\text{new}$ cost $2CKV$ each; the triangular inverse about
#    $C^3/3$. Per token: $6CK + 4CV + 6KV + C^2/3$ per head. The $C \times C$ products are counted
#    whole, as the kernels compute them, though half of each is masked (halving them would take
#    0.7 % off `hymo_750m`'s total). This is the work of the chunked form that the kernels run; the
#    recurrence would do only its $6KV$ a head and token, which would count 1.4 % less in all
#    (round 16's 37.0 % MFU on the results page would read 36.5 %).
#
# Element-wise work (norms, gates, softmax, SiLU) is left out, as usual; it is a few percent.

# %%
#| export
def _matrix_params(module: nn.Module, exclude: tuple = ()) -> int:
    "Weights of `module` that are used in one multiply-add per token: every tensor with ndim >= 2."
    ex = {id(p) for p in exclude}
    return sum(p.numel() for p in module.parameters() if p.ndim >= 2 and id(p) not in ex)


def flops_breakdown(model: HyMo,
                    seq_len: int,  # Training window T
                    keys: Optional[float] = None,  # Mean keys an MLA query attends to; None: T/2, a causal window
                   ) -> dict[str, float]:
    "Training FLOPs per token by term (3 × forward, multiply-add = 2 FLOPs); they sum to `model.flops_per_token`."
    c, T = model.config, seq_len
    if not (T >= 1 and (keys is None or keys >= 0)):  # a negative length would count negative attention FLOPs
        raise ValueError(f"seq_len must be at least 1 and keys at least 0; got seq_len={seq_len}, keys={keys}")
    keys = T / 2 if keys is None else keys
    n_mla = sum(c.is_mla(i) for i in range(c.n_layers))
    n_gdn = c.n_layers - n_mla
    trunk = _matrix_params(model.layers) - _inactive_expert_params(model)
    vocab = c.vocab_size * c.dim
    H, dqk, dv = c.mla_n_heads, c.mla_qk_nope_dim + c.mla_qk_rope_dim, c.mla_v_head_dim
    Hg, K, Vd, C = c.gdn_n_heads, c.gdn_head_k_dim, c.gdn_head_v_dim, c.gdn_chunk_size
    gdn_rule = 6 * C * K + 4 * C * Vd + 6 * K * Vd + C * C / 3
    return {"matrices (blocks)": 3 * 2 * trunk,
            "output head": 3 * 2 * vocab,
            "MTP heads (MLP + vocabulary projection)": 3 * 2 * (_matrix_params(model.mtp) + c.mtp_depth * vocab),
            "MLA attention scores + values": 3 * n_mla * 2 * H * (dqk + dv) * keys,
            "GDN chunked rule": 3 * n_gdn * Hg * gdn_rule}


def doc_keys_per_query(cu_seqlens: torch.Tensor,  # [N+1] document boundaries of a packed row, on the host
                      ) -> float:
    "Mean keys a query attends to in a packed row of documents of lengths L_i, counted as L/2 a query (the T/2 convention): Σ L_i² / (2 Σ L_i)."
    L = cu_seqlens.diff().double()
    return float((L * L).sum() / (2 * L.sum()))


# %% [markdown]
# ### Decode state per sequence
#
# What one sequence carries while generating, after $T$ tokens:
#
# * each GDN block: the delta-rule state $S \in \mathbb{R}^{H \times K \times V}$, kept in fp32
#   whatever the activation dtype (it accumulates over the whole sequence), and the last $W-1$
#   inputs of the short convolution on $q, k, v$: $(W-1)(2HK + HV)$ values. Neither grows with $T$.
# * each MLA block: the latent cache, $T \cdot (d_c + d_\text{rope})$ values: the compressed
#   key/value latent $c^{KV}$ (`mla_kv_lora_rank`) and the one RoPE key shared by all heads. With
#   the up-projections absorbed into the query and output sides, nothing else is cached.

# %%
#| export
def state_breakdown(model: HyMo,
                    seq_len: int,  # Tokens seen so far, T
                    dtype: torch.dtype = torch.bfloat16,  # Dtype of the convolution window and the latent cache
                   ) -> dict[str, int]:
    "Bytes of decode state per sequence by kind; the GDN recurrent state is counted in fp32."
    if not seq_len >= 0: raise ValueError(f"seq_len (tokens seen) must be at least 0; got {seq_len}")
    c = model.config
    es = torch.empty(0, dtype=dtype).element_size()
    n_mla = sum(c.is_mla(i) for i in range(c.n_layers))
    n_gdn = c.n_layers - n_mla
    H, K, Vd = c.gdn_n_heads, c.gdn_head_k_dim, c.gdn_head_v_dim
    return {"GDN recurrent state (fp32)": n_gdn * H * K * Vd * 4,
            "GDN convolution windows": n_gdn * (c.gdn_conv_size - 1) * (2 * H * K + H * Vd) * es,
            "MLA latent cache": n_mla * seq_len * (c.mla_kv_lora_rank + c.mla_qk_rope_dim) * es}


# %% [markdown]
# ### The numbers
#
# Both presets, the 750M one built on the meta device:

# %%
with torch.device("meta"):
    model_750m = HyMo(big)
models = {"hymo_tiny": model, "hymo_750m": model_750m}
for name, m in models.items():
    test_eq(m.num_params(), sum(p.numel() for p in m.parameters()))
    test_eq(sum(param_breakdown(m).values()), m.num_params())

bd = {name: param_breakdown(m) for name, m in models.items()}
rows = [(r, *(f"{bd[n][r]:,}" for n in models)) for r in bd["hymo_750m"]]
rows += [("**total stored**", *(f"**{m.num_params():,}**" for m in models.values())),
         ("**active per token**", *(f"**{m.num_params(active=True):,}**" for m in models.values()))]
display(Markdown("| stored parameters | hymo_tiny | hymo_750m |\n|---|---:|---:|\n" + "\n".join("| " + " | ".join(r) + " |" for r in rows)))

# %% [markdown]
# The difference between stored and active is exactly the unused routed experts:

# %%
for m in models.values():
    c = m.config
    n_mla = c.layer_types.count("mla")
    test_eq(m.num_params() - m.num_params(active=True), n_mla * (c.moe_n_routed - c.moe_top_k) * 3 * c.dim * c.moe_inter_dim)

# %% [markdown]
# Training FLOPs per token at each preset's window, and the decode state at $T = 4096$ in bf16:

# %%
for name, m in models.items():
    T = load_config(name).train.seq_len
    fb = flops_breakdown(m, T)
    print(f"{name}, T = {T}: {m.flops_per_token(T)/1e9:.3f} GFLOPs per training token")
    for k, v in fb.items(): print(f"    {k:42s}{v/1e6:12.1f} M  ({v / m.flops_per_token(T):5.1%})")
    sb = state_breakdown(m, 4096)
    print(f"  decode state at T = 4096 (bf16): {m.state_bytes(4096)/2**20:.2f} MiB per sequence")
    for k, v in sb.items(): print(f"    {k:42s}{v/2**20:12.3f} MiB")

# %% [markdown]
# Counted over the whole $T \times T$ square, as PaLM's formula does (`keys=T`),
# `hymo_750m`'s count is 9.1 % larger, and an MFU computed with it as much higher. The results
# chapter keeps the causal half:

# %%
T = 4096
square = model_750m.flops_per_token(T, T) / model_750m.flops_per_token(T) - 1
print(f"hymo_750m at T = {T}: {model_750m.flops_per_token(T, T)/1e9:.3f} GFLOPs per token over the whole square, {square:+.1%}")
test_close(square, 0.091, eps=5e-4)

# %% [markdown]
# The GDN term counts the chunked form's work. The recurrence does less arithmetic per token, $6KV$
# a head (read $k^\top S$, update $S$, read $q^\top S$), but runs one token at a time; counted so,
# the total would be 1.4 % smaller, and every MFU with it:

# %%
c = model_750m.config
recurrence = 3 * c.layer_types.count("gdn") * c.gdn_n_heads * 6 * c.gdn_head_k_dim * c.gdn_head_v_dim
less = (flops_breakdown(model_750m, T)["GDN chunked rule"] - recurrence) / model_750m.flops_per_token(T)
print(f"hymo_750m at T = {T}: the recurrence's GDN count would make the total {-less:+.2%}")
test_close(less, 0.014, eps=5e-4)

# %% [markdown]
# A window of $T$ tokens taken as one document attends to $T/2$ keys per query, the default; the
# same tokens as four documents of $T/4$ attend to a quarter of that, and the attention term shrinks
# by as much while the others stay:

# %%
T = 4096
one, four = torch.tensor([0, T]), torch.tensor([0, 1024, 2048, 3072, T])
test_eq(doc_keys_per_query(one), T / 2)
test_eq(doc_keys_per_query(four), T / 8)
att = "MLA attention scores + values"
test_close(flops_breakdown(model_750m, T, doc_keys_per_query(four))[att], flops_breakdown(model_750m, T)[att] / 4)
test_close(model_750m.flops_per_token(T) - model_750m.flops_per_token(T, T / 8), flops_breakdown(model_750m, T)[att] * 3 / 4)
print(f"750M, T = {T}: {model_750m.flops_per_token(T)/1e9:.3f} GFLOPs per token as one document, "
      f"{model_750m.flops_per_token(T, T / 8)/1e9:.3f} as four")

# %% [markdown]
# The matrices dominate; the MTP heads' two extra vocabulary projections are the next largest term
# at this vocabulary, larger than all the attention at $T = 4096$. How the two sequence-dependent
# terms grow with the window:

# %%
#| fig-alt: "Left: GFLOPs per training token against the window T for the block matrices, the MLA attention and the GDN chunked rule, on log scales. Right: the decode state in MiB per sequence against T for HyMo, for 32 MLA blocks and for 32 MHA blocks."
Ts = [512, 1024, 2048, 4096, 8192, 16384, 32768]
fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
for k in ("matrices (blocks)", "MLA attention scores + values", "GDN chunked rule"):
    ax[0].plot(Ts, [flops_breakdown(model_750m, T)[k] / 1e9 for T in Ts], marker="o", label=k)
ax[0].set(xscale="log", yscale="log", xlabel="window T", ylabel="GFLOPs / training token", title="750M: FLOPs by term")
ax[0].legend(fontsize=7)
hybrid = [model_750m.state_bytes(T) / 2**20 for T in Ts]
all_mla = [big.n_layers * T * (big.mla_kv_lora_rank + big.mla_qk_rope_dim) * 2 / 2**20 for T in Ts]
mha = [big.n_layers * T * 2 * big.mla_n_heads * big.mla_v_head_dim * 2 / 2**20 for T in Ts]
for y, lab in ((hybrid, "HyMo (24 GDN + 8 MLA)"), (all_mla, "32 MLA blocks"), (mha, "32 MHA blocks, 16 heads × 128")):
    ax[1].plot(Ts, y, marker="o", label=lab)
ax[1].set(xscale="log", yscale="log", xlabel="tokens T", ylabel="MiB per sequence (bf16)", title="decode state")
ax[1].legend(fontsize=7)
plt.tight_layout(); plt.show()

# %% [markdown]
# On the left: near $T = 30$k the MLA attention alone costs as much as all the blocks' matrices, while the
# GDN term does not grow at all. On the right: at $T = 4096$ HyMo carries about 14 MiB per sequence: about 4 MiB of GDN states and convolution
# windows, fixed in $T$, and 10 MiB of latent cache growing with it. A 32-layer multi-head-attention transformer with the same
# heads would cache $2 \cdot 16 \cdot 128$ values per token and layer, about 1 GiB.

# %%
test_eq(model_750m.state_bytes(4096), sum(state_breakdown(model_750m, 4096).values()))
assert model_750m.state_bytes(8192) - model_750m.state_bytes(4096) == state_breakdown(model_750m, 4096)["MLA latent cache"]
assert mha[Ts.index(4096)] / hybrid[Ts.index(4096)] > 50

# %% [markdown]
# ### The design document's figures, corrected
#
# The design document's numbers next to the model's (the right-hand column is computed here):

# %%
pb = param_breakdown(model_750m)
gdn_blocks = [l for l in model_750m.layers if isinstance(l, GatedDeltaNetBlock)]
fwd = model_750m.flops_per_token(4096) / 3
fwd_no_mtp = fwd - flops_breakdown(model_750m, 4096)["MTP heads (MLP + vocabulary projection)"] / 3
M = lambda x: f"{x/1e6:,.1f} M"
corrected = [
    ("stored parameters", "~1.13 B", M(model_750m.num_params()), "embedding once, MTP heads included"),
    ("active parameters per token", "~434 M", M(model_750m.num_params(active=True)), "shared + top-2 of 16 routed experts"),
    ("MoE parameters, 8 layers", "840 M", M(pb["MoE routed experts"] + pb["MoE shared experts + routers"]), "17 experts of 6.19 M per layer, plus routers"),
    ("new parameters per MTP head", "59.6 M", M(pb["MTP heads"] / big.mtp_depth), "the vocabulary matrix is the tied embedding, not new"),
    ("GDN recurrent state", "3.9 MB per token", f"{state_breakdown(model_750m, 4096)['GDN recurrent state (fp32)']/1e6:.2f} MB per sequence", "fixed in T"),
    ("24 dense FFNs, forward FLOPs per token", "149 M", M(2 * sum(_matrix_params(b.ffn) for b in gdn_blocks)), "each is 3 · 896 · 2560 = 6.9 M weights, not 6.2 M"),
    ("forward FLOPs per token, T = 4096, no MTP", "~340 M", M(fwd_no_mtp), "all matrices, head, attention, GDN"),
    ("training FLOPs per token, T = 4096", "", M(model_750m.flops_per_token(4096)), "3 × forward, MTP included"),
]
display(Markdown("| quantity | design document | as built | note |\n|---|---|---|---|\n" +
                 "\n".join(f"| {q} | {d} | {r} | {n} |" for q, d, r, n in corrected)))

# %% [markdown]
# So the 750M design stores about 1.24 B parameters and uses about 0.54 B per token; "750M" is a
# name, not a count. Over the planned run of about 30 B tokens, training costs the FLOPs per
# token times the tokens:

# %%
run = load_config("hymo_750m").train
tokens_run = run.max_steps * run.global_batch_size * run.seq_len
total = model_750m.flops_per_token(run.seq_len) * tokens_run
print(f"{tokens_run/1e9:.1f} B tokens × {model_750m.flops_per_token(run.seq_len)/1e9:.2f} GFLOPs = {total:.2e} FLOPs")
print(f"= {total / (8 * 989e12 * 0.4) / 3600:.0f} hours on 8 H100s at 40% of their 989 TFLOP/s dense bf16 peak")

# %% [markdown]
# ### Inference, estimated properly
#
# The design document's inference answer adds milliseconds to FLOPs and ends "3 µs per token,
# roughly 3× peak", which cannot be. At batch 1, decoding is bound by memory bandwidth, not
# compute: every step reads every active weight once (bf16: 2 bytes each) and the cache, and does
# two FLOPs per weight, plus the attention. A decoding step's attention is the absorbed one
# (chapter 21) over all $L$ cached tokens, not the training window's average of $T/2$: per MLA
# layer and head, $d_\text{nope} d_c + L (2 d_c + d_\text{rope}) + d_c d_v$ multiply-adds, whose
# first and last terms are $W^{UK}$ and $W^{UV}$ (so `kv_b_proj` leaves the matrices). Each GDN
# layer takes one recurrent step, about $4 d_k d_v$ multiply-adds a head (decay, read $k^\top S$,
# rank-one write, read $q^\top S$), instead of the chunked form. The MTP heads do not run. On an
# H100 (3.35 TB/s, 989 TFLOP/s dense bf16), at a context of $L = 4096$:

# %%
c750, L_ctx = model_750m.config, 4096
absorbed = 2 * c750.layer_types.count("mla") * c750.mla_n_heads * (c750.mla_qk_nope_dim * c750.mla_kv_lora_rank + c750.mla_v_head_dim * c750.mla_kv_lora_rank
                                                  + L_ctx * (2 * c750.mla_kv_lora_rank + c750.mla_qk_rope_dim))
fb = flops_breakdown(model_750m, L_ctx)
kv_b = sum(l.attn.kv_b_proj.weight.numel() for l in model_750m.layers if isinstance(l, MLABlock))  # absorbed above
gdn_step = 2 * 4 * len(gdn_blocks) * c750.gdn_n_heads * c750.gdn_head_k_dim * c750.gdn_head_v_dim  # one recurrent step per layer
mtp_params = sum(p.numel() for p in model_750m.mtp.parameters())  # the heads' own (the shared embedding is counted once)
bytes_step = (model_750m.num_params(active=True) - mtp_params) * 2 + model_750m.state_bytes(L_ctx)
flops_step = (fwd_no_mtp - fb["MLA attention scores + values"] / 3 - fb["GDN chunked rule"] / 3 - 2 * kv_b
              + absorbed + gdn_step)
t_mem, t_flop = bytes_step / 3.35e12, flops_step / 989e12
print(f"per token at T=4096, batch 1: {bytes_step/1e9:.2f} GB read -> {t_mem*1e3:.2f} ms; "
      f"{flops_step/1e9:.2f} GFLOPs -> {t_flop*1e6:.1f} µs")
print(f"bandwidth-bound: about {1/t_mem:,.0f} tokens/s per sequence at most")
assert t_mem > 50 * t_flop

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why does HyMo put the MoE on the MLA blocks and a dense SwiGLU on every GDN block?
# In HyMo every block has a per-token non-linear FFN (a choice: pure Mamba stacks have none); the
# question is which kind. An MoE layer adds
# stored capacity (16 routed experts) at a fixed active cost (2 of them) but is also a dispatch
# point (gathering tokens per expert, and an all-to-all under expert parallelism). Placing it on
# the 8 attention blocks gives the model about 0.8 B parameters of expert capacity with 8 dispatch
# points per forward; MoE on all 32 blocks would quadruple the expert storage. It is a choice for a
# small model, not a law: Qwen3-Next puts an MoE in every layer, and Kimi Linear throughout the stack. The GDN blocks are
# not "recurrence-only": each has a dense SwiGLU of width 2560.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Is the per-layer compute uniform across the stack?
# No. A GDN block's dense SwiGLU costs $2 \cdot 3 \cdot 896 \cdot 2560 \approx 13.8$ MFLOPs per token
# forward; an MLA block's MoE runs the shared expert and two routed ones,
# $3 \times 2 \cdot 3 \cdot 896 \cdot 2304 \approx 37.2$ MFLOPs, plus attention that grows with $T$.
# With the mixers (`flops_breakdown`): about 26.5 MFLOPs a token forward for a GDN block (11.6 in
# its projections, 1.1 in the chunked rule) against about 60 for an MLA block at $T = 4096$
# (5.5 in its projections, 16.8 in causal attention), some 2.2×.
# The design document's "every layer runs 2 of 16 experts" is false for the GDN blocks, which run
# no experts at all.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How many parameters does the 750M model have, stored and active, and why do they differ?
# About 1.24 B stored and 0.54 B active (computed from the built model above; the design
# document's 1.13 B and 434 M do not match its own shapes). The difference is the routed experts
# a token is not sent to: $8 \text{ layers} \times (16 - 2) \times 3 \cdot 896 \cdot 2304
# \approx 0.69$ B. The tied embedding/head ($64256 \times 896 \approx 57.6$ M) is counted once; the
# two MTP heads add only about 4.1 M each.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Is "6N" a good estimate of the training FLOPs per token here?
# Only for the matrices. Three more terms: the output head is a $|V| \times d$ matrix product even
# though its weights are the (free to look up) embedding; each MTP head runs that vocabulary
# projection again, about 0.35 GFLOPs per training token per head at $|V| = 64256$; and MLA's
# scores and values grow with the window, $3 H (d_{qk} + d_v) T$ per token per MLA block
# (causal). The chunked GDN rule adds a term that grows with the chunk size $C$ (it has a $C^2$
# part) but not with $T$. At $T = 4096$ the total is about 4.4 GFLOPs per token, training =
# 3 × forward with a multiply-add = 2 FLOPs.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What state does a HyMo sequence carry while decoding, and how does it compare with a transformer?
# Each GDN block keeps a fixed $H \times K \times V = 40 \times 32 \times 32$ fp32 state (160 KiB)
# plus a 3-token convolution window, whatever $T$; each MLA block caches $d_c + d_\text{rope} =
# 160$ values per token. At $T = 4096$ in bf16 that is about 4 MiB + 10 MiB ≈ 14 MiB per
# sequence, against about 1 GiB for a 32-layer MHA transformer with 16 heads of 128. The GDN
# state is per sequence, not per token as the design document claims.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why can a token-choice MoE with a capacity factor break causality in training?
# An expert accepts at most (capacity factor × mean load) tokens of the batch; which tokens are
# dropped depends on how many *other* tokens chose that expert, including tokens later in the same
# sequence. So a future token can change whether an earlier token gets its expert's output, a leak
# that does not exist at inference. Dropless routing avoids it (DeepSeek-V3 trains dropless, for its
# load balance, its paper says); HyMo keeps the 1.5 factor in training only, counts drops, and
# tests causality with dropless routing.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why are the output projections initialised with std $\sigma/\sqrt{2L}$?
# Each block adds two branches to the residual stream (mixer and FFN), so $2L$ terms are summed
# by the end of the stack. If each had variance $\sigma^2$ the stream's variance would grow with
# depth; scaling the last matrix of each branch by $1/\sqrt{2L}$ keeps the sum's variance at
# initialisation independent of $L$ (GPT-2). The input-side matrices keep $\sigma = 0.02$.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What is a realistic decoding speed for the 750M model?
# At batch 1, decoding is bandwidth-bound: each step reads the active weights (about 1.1 GB in
# bf16) plus the cache, about a third of a millisecond on an H100's 3.35 TB/s, while its
# ~1.4 GFLOPs at a context of 4096 would take about a microsecond and a half of compute. So about
# 3000 tokens/s per sequence is an upper bound; batching many sequences amortises the weight reads
# until compute or the cache becomes the limit (and at large batch nearly all experts are touched,
# so the full 1.24 B parameters are read). HyMo's own decoding step, replayed as a CUDA graph, reaches about 140–150
# tokens/s on an H200 with fp32 weights (119–124 under bf16 autocast) (chapter 80): thousands of small kernels, not bandwidth, still set its pace.
# :::
