# %% [markdown]
# # Multi-token prediction
#
# > Extra heads that predict two and three tokens ahead from the main hidden state, and the loss that combines them.

# %%
#| default_exp models.mtp

# %% [markdown]
# A language model is trained to predict the next token. Multi-token prediction (MTP) adds small
# heads that predict tokens further ahead from the same hidden state. The idea comes from
# Gloeckle et al. 2024, *Better & Faster Large Language Models via Multi-token Prediction*, and
# DeepSeek-V3 uses a sequential variant of it. The extra losses shape the hidden state so that it
# carries information about more than one step of the future, and then the heads are thrown away
# (or used to draft tokens) at inference. Gloeckle et al. weight every head equally; DeepSeek-V3
# and HyMo down-weight the extra losses so that next-token prediction stays the main objective.
#
# **HyMo's heads are parallel, not DeepSeek-V3's sequential modules.** DeepSeek-V3's module $k$
# combines RMSNorm of the previous depth's hidden state with RMSNorm of the *embedding of the true
# token* $x_{t+k}$ through a projection, runs a full transformer block on the result and shares the
# embedding and the output head; the loss is $\frac{\lambda}{D}\sum_k L_k$, each $L_k$ a sum over
# its $T - k$ positions divided by $T$. HyMo follows the design document instead:
# every head reads only the trunk's $h_t$, independently of the others, and is a small MLP rather
# than a transformer block. That costs far less (no attention and no chained dependency between
# heads, so the heads run in parallel and one forward pass drafts every lookahead token), and it
# keeps the extra losses' gradient in the trunk, which is what they are for. What it gives up:
# head $k$ must predict $x_{t+1+k}$ without being told the tokens in between, so its task is harder
# and its drafts should be accepted less often than the chained predictions of DeepSeek-V3 (HyMo does
# not measure this: it does not draft).

# %%
#| export
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hymo.config import ModelConfig, validate_part
from hymo.models.gdn import _check_cu_seqlens
from hymo.models.layers import RMSNorm

# %%
from fastcore.test import test_eq, test_close, test_fail
from hymo.config import load_config

# %% [markdown]
# ## The indexing, exactly
#
# The data loader reads $T+1$ tokens $x_0, \dots, x_T$ for a window and gives the model
# `tokens` $= x_{0..T-1}$ and `targets` $= x_{1..T}$, so `targets[t]` $= x_{t+1}$. The trunk
# turns `tokens` into hidden states $h_0, \dots, h_{T-1}$, where $h_t$ has seen $x_0 \dots x_t$.
#
# * The main head reads $h_t$ and predicts $x_{t+1}$ = `targets[t]`, for every $t = 0 \dots T-1$.
# * MTP head $k$ ($k = 1, \dots, D$) reads $h_t$ and predicts $x_{t+1+k}$ = `targets[t+k]`. That
#   token exists in the window only for $t + k \le T - 1$, so head $k$ is trained on positions
#   $t = 0 \dots T-1-k$: `logits_k = head_k(h[:, :T-k])` against `targets[:, k:]`.
#
# (If a window held only the $T$ tokens $x_0..x_{T-1}$, the last usable position would be
# $T-2-k$: one fewer, because the main target of the last position would be missing too.)
#
# A target that must not count is written as `IGNORE_INDEX` ($-100$, the value `F.cross_entropy`
# skips); the section on packed documents below needs it.
#
# The loss is
# $$L = L_\text{main} + \sum_{k=1}^{D} w_k L_k, \qquad w = (0.3, 0.1),$$
# each $L$ a mean cross-entropy over its valid positions.
#
# Here is that alignment on a toy sequence whose future is known: the tokens count up, so the
# target of head $k$ at position $t$ must be $t + 1 + k$.

# %%
#| export
IGNORE_INDEX = -100


# %%
def mtp_targets(targets: torch.Tensor, k: int) -> torch.Tensor:
    "Targets of MTP head `k`: `targets[:, k:]`, aligned with hidden positions `0 .. T-1-k`."
    return targets[:, k:]

x = torch.arange(11)[None]          # x_0 .. x_10, so T = 10
tokens, targets = x[:, :-1], x[:, 1:]
for k in (1, 2):
    t = torch.arange(tokens.shape[1] - k)  # valid positions for head k
    test_eq(mtp_targets(targets, k)[0], tokens[0, t] + 1 + k)
print("head 2 at position 0 must predict", mtp_targets(targets, 2)[0, 0].item())


# %% [markdown]
# ## One head
#
# Each MTP head is small: RMSNorm, a SwiGLU-free MLP (Linear → SiLU → Linear) back to the model
# width, a final RMSNorm, and the *tied* output head (the embedding matrix), so a head adds only
# $2 \cdot d \cdot d_\text{mtp}$ weights plus two norms; the $d \times |V|$ vocabulary projection is
# shared, not new.
#
# The design document lists the head as RMSNorm → Linear → Linear. Two linear maps with nothing
# between them compose into one matrix of rank at most $d$, so the factorisation would add
# parameters without adding anything a single $d \times d$ matrix could not do; HyMo puts a SiLU
# between them. The final RMSNorm matches what the main head sees (the trunk's final norm), so the
# shared vocabulary projection is fed inputs on one scale.

# %%
#| export
class MTPBlock(nn.Module):
    "One MTP head: `h -> norm -> Linear -> SiLU -> Linear -> norm`, then logits through the shared (tied) head if given."
    def __init__(self, dim: int, # Model width d
                 inter_dim: int, # Hidden width of the head's MLP
                 eps: float = 1e-6): # RMSNorm epsilon
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.proj_in = nn.Linear(dim, inter_dim, bias=False)
        self.proj_out = nn.Linear(inter_dim, dim, bias=False)
        self.out_norm = RMSNorm(dim, eps)

    def forward(self, h: torch.Tensor, # Hidden states [B, T', D]
                head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, # The tied vocabulary projection, [.., D] -> [.., V]
               ) -> torch.Tensor: # Logits [B, T', V], or without `head` the head's hidden states [B, T', D]
        z = self.out_norm(self.proj_out(F.silu(self.proj_in(self.norm(h)))))
        return z if head is None else head(z)


# %%
#| export
@dataclass
class MTPOutput:
    "What MTP head `k` produced for hidden positions `0..T-1-k`: its hidden states, logits if a head was given, targets."
    k: int  # Head index, 1-based: predicts token t+1+k
    hidden: torch.Tensor  # [B, T-k, D], the head's output before the vocabulary projection
    targets: torch.Tensor  # [B, T-k] token ids, `targets[:, k:]`
    weight: float  # Loss weight w_k
    logits: Optional[torch.Tensor] = None  # [B, T-k, V] when `forward` was given the vocabulary projection


class MultiTokenPrediction(nn.Module):
    "The `mtp_depth` MTP heads. `forward(hidden, targets, head)` returns one `MTPOutput` per head."
    def __init__(self, config: ModelConfig):
        super().__init__()
        config = validate_part(config, "mtp_")  # e.g. one weight per head (zip would drop a head without one)
        self.weights = tuple(config.mtp_loss_weights)
        self.heads = nn.ModuleList(MTPBlock(config.dim, config.mtp_inter_dim, config.norm_eps)
                                   for _ in range(config.mtp_depth))

    def forward(self, hidden: torch.Tensor, # Main hidden states h_0..h_{T-1} [B, T, D] (after the final norm)
                targets: torch.Tensor, # Main targets x_1..x_T [B, T]
                head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, # The tied vocabulary projection; None: no logits
                cu_seqlens: Optional[torch.Tensor] = None, # [N+1] document boundaries of a packed row (B == 1)
               ) -> list[MTPOutput]:
        B, T = hidden.shape[:2]
        if targets.shape != (B, T): raise ValueError(f"targets {tuple(targets.shape)} must be [B, T] = [{B}, {T}], one per hidden position")
        if cu_seqlens is not None: _check_cu_seqlens(cu_seqlens, B, T, read=None)  # B == 1, 0..T rising (read on a CPU)
        if T <= len(self.heads):
            raise ValueError(f"sequence length {T} is too short for {len(self.heads)} MTP heads: use seq_len > mtp_depth")
        doc = None if cu_seqlens is None else document_ids(cu_seqlens, T)  # (T,)
        outs = []
        for k, (blk, w) in enumerate(zip(self.heads, self.weights), start=1):
            hk = blk(hidden[:, :T - k])  # (B, T-k, D)
            tk = targets[:, k:]          # (B, T-k)
            if doc is not None: tk = tk.masked_fill(doc[k:] != doc[:T - k], IGNORE_INDEX)  # see "Packed documents"
            outs.append(MTPOutput(k, hk, tk, w, None if head is None else head(hk)))
        return outs


def document_ids(cu_seqlens: torch.Tensor, # [N+1] document boundaries of a packed row
                 T: int, # Packed row length
                ) -> torch.Tensor: # [T] long: the document each position belongs to
    "Which document each position of a packed row belongs to (on the boundaries' device, no host sync)."
    pos = torch.arange(T, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:-1].to(torch.long).contiguous(), pos, right=True)


# %% [markdown]
# With a stand-in head (a random vocabulary matrix), the shapes follow the indexing above:

# %%
torch.manual_seed(0)
cfg = load_config("hymo_tiny").model
B, T, D, V = 2, 12, cfg.dim, cfg.vocab_size
emb = torch.randn(V, D) * 0.02
mtp = MultiTokenPrediction(cfg)
hidden, targets = torch.randn(B, T, D), torch.randint(0, V, (B, T))
outs = mtp(hidden, targets, lambda h: h @ emb.T)
for o in outs: print(o.k, tuple(o.logits.shape), tuple(o.targets.shape), o.weight)
test_eq([o.logits.shape[1] for o in outs], [T - 1, T - 2])
test_eq(outs[1].targets, targets[:, 2:])

# %% [markdown]
# ## Packed documents
#
# With `doc_masking` the trainer packs a micro-batch of $B$ windows into one row of $B \cdot T$
# tokens and passes the document boundaries `cu_seqlens` (chapter 60): every window start and
# every end-of-text token opens a new document, and the GDN and MLA layers restart there, so
# $h_t$ has seen only its own document. A document's tokens are followed by the end-of-text token,
# which belongs to the *next* document.
#
# The main head is unaffected: its target `targets[t]` is the token right after $t$, which is
# either in $t$'s document or the end-of-text token that closes it ("this document ends here" is a
# fair thing to predict). Each window's targets come from that window, so the packing does not
# change them either.
#
# Head $k$ is different: its target `targets[t+k]` is the token after position $t+k$. If a
# boundary lies between $t$ and $t+k$, that token belongs to a document that $h_t$ has never seen (or,
# at the end of a packed window, to the next window, which is not even the same stretch of text).
# Nothing in $h_t$ can predict it, and training on it only adds noise. The rule is therefore:
# **head $k$ counts position $t$ only if position $t+k$ is in $t$'s document.** Then its target is
# in the same document or is the end-of-text token that closes it, just as for the main head. The
# other targets become `IGNORE_INDEX`.
#
# A packed toy batch shows it. Two windows of 6 tokens; the first holds the end of one document,
# an end-of-text token (id 0) and the start of another:

# %%
eot = 0
rows = torch.tensor([[5, 6, 7, eot, 8, 9, 10],     # T + 1 = 7 tokens per window
                     [11, 12, 13, 14, 15, 16, 17]])
tok, tgt = rows[:, :-1].reshape(1, -1), rows[:, 1:].reshape(1, -1)   # packed: [1, 12]
cu = torch.tensor([0, 3, 6, 12], dtype=torch.int32)                # windows start at 0 and 6, end-of-text at 3
test_eq(document_ids(cu, 12), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2]))

packed = mtp(torch.randn(1, 12, D), tgt, cu_seqlens=cu)
I = IGNORE_INDEX
test_eq(packed[0].targets[0], torch.tensor([7, eot, I, 9, 10, I, 13, 14, 15, 16, 17]))   # head 1: x_{t+2}
test_eq(packed[1].targets[0], torch.tensor([eot, I, I, 10, I, I, 14, 15, 16, 17]))        # head 2: x_{t+3}
test_eq(mtp(torch.randn(1, 12, D), tgt)[1].targets, tgt[:, 2:])                          # unpacked: no mask
print(packed[1].targets[0].tolist())


# %% [markdown]
# Read head 2's row. Position 0 (token 5) may predict the end-of-text token three steps on; position
# 1 (token 6) would have to predict token 8 of the next document, so it is ignored. Position 3 is the
# end-of-text token opening document 1, and predicts 10, still inside its own document. Positions 4
# and 5 would need tokens past the end of window 1 (not in the batch; unpacked, they simply have no head-2
# targets) and, packed, would read window 2's first tokens instead, so both are ignored. Without `cu_seqlens`
# the targets are the plain `targets[:, k:]` of the section above. Positions whose targets are all
# ignored contribute nothing to the loss; a head whose targets are all ignored has loss 0, in both
# losses below.

# %% [markdown]
# ## The loss
#
# `lm_loss` returns the weighted total and every part, so each can be logged. Cross-entropy runs in
# fp32 whatever the logits' dtype. It is the reference: it takes logits, which the next section
# learns to avoid.

# %%
#| export
def _weighted_total(main: torch.Tensor, mtp_outputs, loss_of: Callable[[MTPOutput], torch.Tensor]):
    "`main + Σ_k w_k loss_of(o_k)` and the detached parts {'main', 'mtp_1', ...}."
    total, parts = main, {"main": main.detach()}
    for o in mtp_outputs:
        lk = loss_of(o)
        total = total + o.weight * lk
        parts[f"mtp_{o.k}"] = lk.detach()
    return total, parts


def lm_loss(logits: torch.Tensor, # Main logits [B, T, V]
            targets: torch.Tensor, # Main targets [B, T]
            mtp_outputs: list[MTPOutput] = (), # From `MultiTokenPrediction`, called with the head
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    "Total loss `L_main + Σ_k w_k L_k` and its parts: {'main': .., 'mtp_1': .., ...} (detached)."
    if any(o.logits is None for o in mtp_outputs):
        raise ValueError("lm_loss needs MTP logits: call MultiTokenPrediction with the head, or use lm_loss_fused")
    return _weighted_total(_mean_ce(logits, targets), mtp_outputs, lambda o: _mean_ce(o.logits, o.targets))


def _mean_ce(logits, targets):  # fp32 (fp64: fp64) mean over the counted targets; 0, not NaN, when none counts
    n = (targets != IGNORE_INDEX).sum().clamp_min(1)
    acc = torch.promote_types(logits.dtype, torch.float32)  # fp64 stays fp64
    return F.cross_entropy(logits.to(acc).flatten(0, -2), targets.flatten().long(), reduction="sum") / n  # int32 ids too


# %%
logits = torch.randn(B, T, V)
total, parts = lm_loss(logits, targets, outs)
test_close(total, parts["main"] + 0.3 * parts["mtp_1"] + 0.1 * parts["mtp_2"], eps=1e-5)
print({k: round(v.item(), 3) for k, v in parts.items()})

# %% [markdown]
# A freshly initialised model has small logits and so predicts nearly uniformly: every part starts
# near $\ln |V|$.

# %%
small = lm_loss(logits * 1e-3, targets, [MTPOutput(o.k, o.hidden, o.targets, o.weight, o.logits * 1e-3) for o in outs])[1]
for v in small.values(): test_close(v, torch.tensor(float(V)).log(), eps=1e-2)

# %% [markdown]
# Ignored targets drop out of the mean. Head 2 of the packed batch above counts six of its ten
# positions, and its loss is the mean over those six; a head with nothing to count gives 0.

# %%
lg, tg2 = torch.randn(1, 10, V), packed[1].targets
counted = tg2[0] != IGNORE_INDEX
test_eq(int(counted.sum()), 6)
test_close(_mean_ce(lg, tg2), F.cross_entropy(lg[0, counted], tg2[0, counted]), eps=1e-5)
test_eq(_mean_ce(lg, torch.full_like(tg2, IGNORE_INDEX)), torch.tensor(0.))


# %% [markdown]
# ## The loss without the logits
#
# At the 750M shape one batch is $N = 4 \times 4096 = 16384$ positions and $|V| = 64256$, so one
# head's logits are $N |V| \approx 1.05$ G numbers: 2.1 GB in bf16, 4.2 GB once cast to fp32 for
# the cross-entropy, and autograd keeps the softmax for the backward. Three heads (main, MTP 1, MTP
# 2) hold well over 20 GB of logits at the peak, more than all the weights and optimiser state
# together.
#
# None of it has to exist at once. For one row with hidden state $h$, logits $z = W h$ and target
# $y$, the loss and its gradient are
# $$\ell = \operatorname{logsumexp}(z) - z_y, \qquad \frac{\partial \ell}{\partial z} = \operatorname{softmax}(z) - e_y,$$
# and the chain rule through $z = W h$ gives
# $$\frac{\partial \ell}{\partial h} = W^\top (\operatorname{softmax}(z) - e_y), \qquad
# \frac{\partial \ell}{\partial W} = (\operatorname{softmax}(z) - e_y)\, h^\top.$$
# Everything a row needs is its own logits. So `linear_cross_entropy` walks the rows in chunks:
# per chunk it computes the logits, the loss, and (because the loss is the end of the graph, its
# gradient is known up to the scalar that will arrive in the backward) the gradients for $h$ and
# $W$, then frees the logits. The backward only multiplies the stored gradients by that scalar.
# Peak memory for the loss is one chunk's logits (about 1 GB by default, with the fused kernel on a GPU; the eager
# `ce_chunk` on a CPU holds three or four fp32 temporaries of that size) instead of three
# full sets, the matrix FLOPs are the same ($2N|V|d$ forward, $4N|V|d$ for the two gradients), and
# the passes over the $N \times |V|$ tensor shrink to a few per chunk.
#
# Under autocast the matrix products run in the autocast dtype (bf16) and the softmax in fp32,
# exactly as in `lm_loss`; the gradient of $W$ is summed over chunks in fp32 and handed to
# autograd in the compute dtype, like the reference's. Targets equal to $-100$ are ignored, as in
# `F.cross_entropy`; a head whose targets are all ignored has loss 0 and zero gradients (where
# `F.cross_entropy` returns NaN). Without grad mode (evaluation) only the loss is computed. fp16 is
# refused: the gradient is rounded to the compute dtype before any loss scale could reach it, and
# entries near $1/(N|V|) \approx 10^{-9}$ would flush to zero.
#
# `ce_chunk` is the per-chunk arithmetic, written as plain tensor operations. Run eagerly, each
# operation is a pass over the $c \times |V|$ chunk (a cast, a max, a sum, a subtraction, an
# exponential, the one-hot, a scale, a cast back): at the 750M shape those passes took about 60 ms
# of a 320 ms micro-batch on the H200. `torch.compile` fuses them into one reduction kernel per
# chunk that reads the bf16 logits, writes the bf16 gradient, and never builds the one-hot; on
# CUDA a hand-written Triton kernel with the same contract (chapter 42) is faster still, and is
# what runs there. The gradient of $W$ is accumulated by one matrix product per chunk that adds
# into the fp32 sum directly (`addmm` with an fp32 output), instead of a bf16 product, a cast and
# an add: three passes over a $|V| \times d$ matrix that cost about 4 ms per 750M micro-batch.

# %%
#| export
def ce_chunk(z: torch.Tensor, # Logits of one chunk [c, V], in the compute dtype
             y: torch.Tensor, # Targets [c], ignored rows clamped to a valid id
             w: torch.Tensor, # Row weights [c]: 1/n_valid for a counted row, 0 for an ignored one
             want_grad: bool, # Also return d(loss)/dz
            ):
    "`(Σ_rows w · (logsumexp(z) - z_y), (softmax(z) - e_y) · w or None)`, softmax in fp32 (fp64 stays fp64)."
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    lse = zf.logsumexp(-1)                                                 # (c,)
    loss = ((lse - zf.gather(1, y[:, None])[:, 0]) * w).sum()
    if not want_grad: return loss, None
    onehot = torch.arange(z.shape[1], device=z.device) == y[:, None]      # (c, V), never stored when compiled
    return loss, ((zf - lse[:, None]).exp() - onehot.to(zf.dtype)).mul(w[:, None]).to(z.dtype)


_ce_chunk_compiled = None


def _compiled_ce_chunk():
    "`ce_chunk` through `torch.compile` (built once): one pass over the chunk's logits instead of a pass per operation."
    global _ce_chunk_compiled
    if _ce_chunk_compiled is None: _ce_chunk_compiled = torch.compile(ce_chunk, dynamic=True)
    return _ce_chunk_compiled


def _ce_chunk_for(z_like: torch.Tensor):
    "The chunk function for logits like `z_like`: on CUDA the Triton kernel (chapter 42) for bf16/fp32, else `ce_chunk` compiled; `ce_chunk` on CPU."
    if z_like.device.type != "cuda": return ce_chunk
    if z_like.dtype in (torch.bfloat16, torch.float32):
        try:  # a plain import; Triton is missing only on unusual installs
            from hymo.models.ce_triton import triton_ce_chunk
            return triton_ce_chunk
        except ModuleNotFoundError as e:
            if e.name not in ("triton", "hymo.models.ce_triton"): raise
    return _compiled_ce_chunk()


def _add_wgrad(dw: torch.Tensor, dz: torch.Tensor, hc: torch.Tensor):
    "`dw += dz.T @ hc` with dw in fp32: on CUDA one product accumulated in fp32 straight into dw, else a product and an add."
    if dw.is_cuda and dz.dtype == torch.bfloat16 and dw.dtype == torch.float32:
        torch.addmm(dw, dz.T, hc, out_dtype=torch.float32, out=dw)  # no bf16 [V, D] product, no separate cast and add
    else: dw += (dz.T @ hc).to(dw.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    "Mean cross-entropy of `h @ w.T` against `targets`, chunk by chunk, gradients computed in the forward."

    @staticmethod
    def forward(ctx, h, w, targets, chunk_rows, grad_enabled):  # h [N, D], w [V, D], targets [N]
        want_h, want_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        acc = torch.promote_types(h.dtype, torch.float32)                 # fp32 (fp64 stays fp64, for checks)
        valid = targets != IGNORE_INDEX                                   # (N,)
        row_w = valid.to(acc) / valid.sum().clamp_min(1).to(acc)          # (N,) 1/n_valid or 0
        safe = torch.where(valid, targets, 0)                             # ignored rows read class 0, weighted 0
        step = _ce_chunk_for(h)
        loss = torch.zeros((), dtype=acc, device=h.device)
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(w.shape, dtype=acc, device=w.device) if want_w else None
        for s in range(0, h.shape[0], chunk_rows):
            hc = h[s:s + chunk_rows]                                       # (c, D)
            lc, dz = step(hc @ w.T, safe[s:s + chunk_rows], row_w[s:s + chunk_rows], want_h or want_w)  # dz (c, V)
            loss += lc
            if want_h: dh[s:s + chunk_rows] = dz @ w
            if want_w: _add_wgrad(dw, dz, hc)
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad: () the scalar that multiplies the loss downstream, fp32
        dh, dw = ctx.saved_tensors
        acc = torch.promote_types(grad.dtype, torch.float32)  # scale in fp32 (fp64 stays fp64): w_k/accum is no bf16 number
        return (None if dh is None else (dh.to(acc) * grad).to(dh.dtype),
                None if dw is None else (dw * grad).to(ctx.w_dtype), None, None, None)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    "The matrix products' dtype: autocast's where it is on (as `F.linear` would), else the inputs' common dtype."
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(h.dtype, weight.dtype)


def check_target_ids(targets: torch.Tensor, # Token ids, or IGNORE_INDEX where a position has no loss
                     V: int, # Vocabulary size
                     named: str = "", # Said after the range, e.g. " (vocab_size=V)"
                    ):
    "Raise `ValueError` for a target that is neither an id in 0..V-1 nor IGNORE_INDEX; read on a CPU only (a GPU would be waited for)."
    if targets.device.type != "cpu": return
    bad = ~(((targets >= 0) & (targets < V)) | (targets == IGNORE_INDEX))
    if bool(bad.any()):
        raise ValueError(f"targets must be ids in 0..{V - 1}{named}, or IGNORE_INDEX={IGNORE_INDEX} to skip a position; "
                         f"got {targets[bad].unique().tolist()[:5]}")


def linear_cross_entropy(h: torch.Tensor, # Hidden states [..., D]
                         weight: torch.Tensor, # Vocabulary projection [V, D] (the tied embedding)
                         targets: torch.Tensor, # Token ids [...], IGNORE_INDEX (-100) to skip a position
                         chunk_rows: Optional[int] = None, # Rows per chunk; None keeps one chunk's fp32 logits near 1 GB
                        ) -> torch.Tensor: # Mean cross-entropy, fp32 scalar
    "`F.cross_entropy(h @ weight.T, targets)` without materialising the [N, V] logits."
    if h.shape[:-1] != targets.shape or h.shape[-1] != weight.shape[-1]:
        raise ValueError(f"h {tuple(h.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}: "
                         "need h [..., D], weight [V, D] and targets of h's leading shape")
    if targets.dtype not in (torch.long, torch.int32):
        raise TypeError(f"targets must be integer token ids (int64 or int32), got {targets.dtype}")
    check_target_ids(targets, weight.shape[0])
    dev, cdt = h.device.type, _compute_dtype(h, weight)
    if cdt == torch.float16:
        raise TypeError("linear_cross_entropy does not support fp16 (small gradients would underflow before loss "
                        "scaling); use bf16 autocast or fp32")
    if chunk_rows is not None and not (isinstance(chunk_rows, numbers.Integral) and not isinstance(chunk_rows, bool)
                                       and chunk_rows > 0):  # 0 or less: no chunk ran, dh unset
        raise ValueError(f"chunk_rows={chunk_rows!r} must be a positive int, or None for about 1 GB of fp32 logits a chunk")
    chunk_rows = None if chunk_rows is None else int(chunk_rows)
    chunk = chunk_rows or max(1, 2 ** 28 // weight.shape[0])
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]).to(cdt), weight.to(cdt), targets.reshape(-1), chunk,
                                         torch.is_grad_enabled())


def lm_loss_fused(h: torch.Tensor, # Main hidden states after the final norm [B, T, D]
                  weight: torch.Tensor, # The tied vocabulary projection [V, D]
                  targets: torch.Tensor, # Main targets [B, T]
                  mtp_outputs: list[MTPOutput] = (), # From `MultiTokenPrediction` (no head needed)
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    "`lm_loss` from hidden states: the same total and parts, with `linear_cross_entropy` for every head."
    weight = weight.to(_compute_dtype(h, weight))  # cast once for the three heads (a no-op for each call below)
    return _weighted_total(linear_cross_entropy(h, weight, targets), mtp_outputs,
                           lambda o: linear_cross_entropy(o.hidden, weight, o.targets))


# %% [markdown]
# The check: the chunked loss and both gradients against `F.cross_entropy` on materialised logits,
# with chunks that do not divide the rows and a few ignored targets.

# %%
hh = torch.randn(37, D, dtype=torch.float64, requires_grad=True)
W = (torch.randn(V, D, dtype=torch.float64) * 0.1).requires_grad_()
tt = torch.randint(0, V, (37,)); tt[[3, 20]] = IGNORE_INDEX
ref = F.cross_entropy(hh @ W.T, tt)
got = linear_cross_entropy(hh, W, tt, chunk_rows=8)
test_close(got, ref, eps=1e-12)
for a, b in zip(torch.autograd.grad(3 * got, (hh, W)), torch.autograd.grad(3 * ref, (hh, W))): test_close(a, b, eps=1e-12)

# %% [markdown]
# And `lm_loss_fused` against `lm_loss` on the MTP heads from above:

# %%
outs = mtp(hidden, targets, lambda h: h @ emb.T)
want, want_parts = lm_loss(hidden @ emb.T, targets, outs)
got, got_parts = lm_loss_fused(hidden, emb, targets, outs)
test_close(got, want, eps=1e-5)
for k in want_parts: test_close(got_parts[k], want_parts[k], eps=1e-5)

# And on the packed toy batch, whose MTP targets are partly ignored, and with every MTP target ignored
# (documents shorter than the heads reach), where both give 0:
for cu_case in (cu, torch.arange(13, dtype=torch.int32)):
    hp = torch.randn(1, 12, D)
    outs_p = mtp(hp, tgt, lambda h: h @ emb.T, cu_seqlens=cu_case)
    want, want_parts = lm_loss(hp @ emb.T, tgt, outs_p)
    got, got_parts = lm_loss_fused(hp, emb, tgt, outs_p)
    for k in want_parts: test_close(got_parts[k], want_parts[k], eps=1e-5)
test_eq(got_parts["mtp_2"], torch.tensor(0.))

# %% [markdown]
# ## What MTP costs
#
# A head adds `norm + 2·d·d_mtp + norm` parameters. For the 750M design,
# $2 \cdot 896 \cdot 2304 \approx 4.13$ M per head, about 8.3 M for both. The vocabulary projection
# ($896 \times 64256 \approx 57.6$ M) is the tied embedding, already counted once: the design
# document's "59.6 M per head" counts it again. The FLOPs are not small, though: each head runs
# the $d \times |V|$ projection again, $2 \cdot 896 \cdot 64256 \approx 115$ MFLOPs per token
# forward per head, more than the head's own MLP (≈ 8.3 MFLOPs). The model chapter counts both.

# %%
big = load_config("hymo_750m").model
with torch.device("meta"): m = MultiTokenPrediction(big)
new = sum(p.numel() for p in m.parameters())
print(f"new parameters in {big.mtp_depth} heads: {new/1e6:.2f} M")
test_eq(new, big.mtp_depth * (2 * big.dim * big.mtp_inter_dim + 2 * big.dim))

# %% [markdown]
# ## At inference
#
# The heads are not needed to generate text: the main head alone gives next-token logits, and the
# model's `forward` skips them. They can, however, *draft*: at step $t$ the main head proposes
# $x_{t+1}$ and heads 1 and 2 propose $x_{t+2}, x_{t+3}$; one forward pass over the drafted tokens
# then verifies them (self-speculative decoding), accepting the longest prefix the main head
# agrees with. Every accepted draft token saves a sequential forward step.

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Which token does MTP head k predict, and on which positions is its loss computed?
# With hidden state $h_t$ at position $t$ (having seen $x_0..x_t$), the main head predicts
# $x_{t+1}$ and head $k$ predicts $x_{t+1+k}$. Given a window of inputs $x_{0..T-1}$ and targets
# $x_{1..T}$, head $k$'s target exists only for $t \le T-1-k$, so its loss uses positions
# $0..T-1-k$: `logits_k`, computed from `h[:, :T-k]`, against `targets[:, k:]`. (Counted as a
# window of $T$ tokens in all, inputs and targets together, the last position is $T-2-k$.)
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why are the MTP heads small, and fed only the main hidden state?
# The point is to change what the shared trunk represents: gradients from the $t+2$ and $t+3$
# losses flow into the same $h_t$ the main head uses, pushing it to carry information about the
# nearer future beyond one token. A head with much capacity of its own (several layers, or its own
# view of the tokens) could do more of the lookahead itself and push less of it into $h_t$, at
# more compute. DeepSeek-V3 chooses differently: each of its MTP modules is a transformer block
# that also sees the embedding of the true intermediate token, so its predictions are better
# drafts, and its depths run one after another.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why are the weights 0.3 and 0.1 rather than equal?
# Tokens further ahead are less predictable, so their losses are larger and noisier. Down-weighting
# keeps the main next-token objective dominant (the total auxiliary weight is 0.4) while still
# passing a planning signal into the trunk. The values are a tuning choice, not a law. They are
# weights per depth, fixed for the run; DeepSeek-V3's 0.3 then 0.1 is something else, a schedule
# over training for its single MTP module (0.3 for the first 10 T tokens, 0.1 after).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Is MTP almost free in compute?
# In parameters, nearly: about 4 M new weights per head at the 750M shape, because the vocabulary
# projection is tied. In FLOPs, no: each head runs the $d \times |V|$ projection again, about
# 115 MFLOPs per token forward per head at $|V| = 64256$. With its small MLP and the backward, a
# head is about 370 MFLOPs of the 4.42 GFLOPs a training token costs (8.4 %), and the two heads
# 16.7 % (chapter 41's breakdown).
# The design document's "0.2 % overhead" leaves out the projection.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How can a loss be computed without its logits, and why compute the gradient in the forward?
# Each row's cross-entropy needs only that row's logits, so the rows can be processed in chunks,
# each chunk's logits freed before the next. The gradient with respect to the logits,
# $\operatorname{softmax}(z) - e_y$, is known as soon as the loss is, because the loss is the end
# of the graph; only the scalar that multiplies it downstream (the MTP weight, $1/\text{accum}$)
# arrives later. So `linear_cross_entropy` forms $\partial L/\partial h$ and
# $\partial L/\partial W$ chunk by chunk in the forward and its backward just scales them. At the
# 750M shape this removed three 1 G-entry logit tensors and took the peak of a one-micro-batch step
# from 92 GB to 73 GB (47 GB compiled; round 2, `train_step.json`), at the same matrix FLOPs.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What happens to the MTP heads at inference?
# Plain generation ignores them: only the main head is needed (HyMo's `generate` uses it alone).
# They can draft the next few tokens for self-speculative decoding, where one forward pass verifies
# the drafts and every accepted one saves a sequential step. In a hybrid that has a catch a
# transformer does not: a KV cache is simply cut back past a rejected draft, but each GDN layer's
# state and convolution window have already absorbed it, so the state from before the verification
# (or one per drafted position) must be kept and the accepted tokens stepped in again.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Who proposed multi-token prediction?
# The idea of predicting several future tokens with extra heads is older: Stern et al. (2018,
# blockwise parallel decoding) drafted with them, and ProphetNet (Qi et al., 2020) trained with a
# future n-gram objective. Gloeckle et al., 2024, *Better & Faster Large Language Models via
# Multi-token Prediction* (Meta), showed it helps as an auxiliary loss in LLM pretraining, with
# independent output heads (one transformer layer each) on a shared trunk, equally weighted; the
# gain grew with model size, and their smallest models (a few hundred million parameters) did worse
# on code benchmarks with it, a caution at HyMo's 750M.
# DeepSeek-V3 (2024) chains its MTP modules sequentially, each fed the previous depth's state and the
# next true token's embedding, so that each prediction depth keeps a causal chain. HyMo's heads are
# independent, like Gloeckle's, but small MLPs, and down-weighted like DeepSeek-V3's.
# :::
