"""RoPE and Multi-Head Latent Attention: relative positions, the DeepSeek formula, grouping, packing, NoPE, cached decoding."""
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from hymo.config import load_config
from hymo.models.mla import MLABlock, MLACache, MultiHeadLatentAttention
from hymo.models.rope import apply_rope, positions_from_cu_seqlens, rope_cos_sin

CFG = load_config("hymo_tiny", moe_capacity_factor=None).model  # dropless: expert capacity depends on the tokens per call
CFG_MHA = load_config("hymo_tiny", mla_n_kv_groups=CFG.mla_n_heads).model  # G = H: DeepSeek-V3's MLA


def randomize_(m: nn.Module, seed: int = 0) -> nn.Module:
    "Unit-scale weights (matrices N(0, 1/fan_in), gains 1 + N(0, 0.1²)) so outputs are O(1) and tolerances mean something."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) if p.dim() >= 2
                    else 1 + 0.1 * torch.randn(p.shape, generator=g))
    return m


def x_(B, T, seed=1):
    return torch.randn(B, T, CFG.dim, generator=torch.Generator().manual_seed(seed))


# --- RoPE -------------------------------------------------------------------------------------------

def test_rope_scores_depend_on_relative_position_only():
    T, d = 12, 32
    q, k = torch.randn(1, T, 1, d), torch.randn(1, T, 1, d)
    def scores(pos):
        cos, sin = rope_cos_sin(pos, d)
        return apply_rope(q, cos, sin)[0, :, 0] @ apply_rope(k, cos, sin)[0, :, 0].T  # (T, T)
    base = scores(torch.arange(T))
    torch.testing.assert_close(scores(torch.arange(T) + 37), base, atol=1e-4, rtol=1e-4)
    assert (scores(2 * torch.arange(T)) - base).abs().max() > 1e-2  # distances changed: scores change
    assert (base - q[0, :, 0] @ k[0, :, 0].T).abs().max() > 1e-2  # the rotation did something


def test_rope_of_bf16_inputs_is_computed_in_fp32():
    "bf16 in, bf16 out, rounded once: within one bf16 ulp of the fp64 rotation (by the same angles) at every position up to 4096."
    T, d = 4096, 32
    x = torch.randn(1, T, 4, d).bfloat16()
    cos, sin = rope_cos_sin(torch.arange(T), d)
    ref_cos, ref_sin = rope_cos_sin(torch.arange(T, dtype=torch.float64), d)
    out = apply_rope(x, cos, sin)
    ref = apply_rope(x.double(), ref_cos.double(), ref_sin.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-6)


def rotation(m: int, d: int) -> torch.Tensor:
    "RoFormer's block-diagonal R_m in fp64: pairs (2i, 2i+1) turned by m θ_i, θ_i = 10000^(-2i/d)."
    R = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        a = m * 10000.0 ** (-2 * i / d)
        R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
    return R


def test_rope_of_fp64_inputs_is_computed_in_fp64():
    "fp64 vectors and tables are rotated in fp64 (through fp32 they were ~1e-7 off)."
    T, d = 6, 16
    x = torch.randn(1, T, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    y = apply_rope(x, angles.cos(), angles.sin())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, torch.stack([x[:, m] @ rotation(m, d).T for m in range(T)], 1), atol=1e-13, rtol=0)


def test_rope_matches_rotation_matrix_and_keeps_norms():
    d, m = 8, 5
    x = torch.randn(1, 1, 2, d, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.tensor([m]), d)
    torch.testing.assert_close(apply_rope(x, cos, sin), x @ rotation(m, d).T, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    with pytest.raises(ValueError, match="rotated slice"):
        apply_rope(torch.randn(1, 1, 2, d + 2), cos, sin)


def test_positions_restart_per_document():
    assert positions_from_cu_seqlens(torch.tensor([0, 2, 3, 7]), 7).tolist() == [0, 1, 0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="from 0 to T=7"):
        positions_from_cu_seqlens(torch.tensor([0, 3, 6]), 7)
    with pytest.raises(ValueError, match="from 0 to T=7"):
        positions_from_cu_seqlens(torch.tensor([0, 3, 3, 7]), 7)
    with pytest.raises(ValueError, match="from 0 to T=7"):  # not from 0: the first tokens in no document
        positions_from_cu_seqlens(torch.tensor([2, 4, 7]), 7)
    assert positions_from_cu_seqlens(torch.tensor([0, 2, 3, 7]), 7, max_len=4).tolist() == [0, 1, 0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="4 tokens > max_seq_len=3"):  # RoPE would go on past the positions trained
        positions_from_cu_seqlens(torch.tensor([0, 2, 3, 7]), 7, max_len=3)
    for dtype in (torch.float32, torch.bool, torch.uint8):  # floats index nothing; bools and bytes' differences wrap
        with pytest.raises(ValueError, match="int32 or int64"):
            positions_from_cu_seqlens(torch.tensor([0, 4, 7]).to(dtype), 7)
    assert positions_from_cu_seqlens(torch.tensor([0, 4, 7], dtype=torch.int32), 7).tolist() == [0, 1, 2, 3, 0, 1, 2]


@pytest.mark.parametrize("bounds", [[0, 0, 7], [0, -1, 7], [0, 7, 7], [0, 5, 3, 7]])
def test_boundaries_that_do_not_rise_are_refused_at_either_end(bounds):
    "An empty or backward first (or last) document: [0, -1, 7] would give positions t + 1 and an attention slice 0:-1."
    with pytest.raises(ValueError, match="rise strictly from 0 to T=7"):
        positions_from_cu_seqlens(torch.tensor(bounds), 7)


def test_the_longest_document_is_found_wherever_it_is():
    for bounds, longest in (([0, 5, 7], 5), ([0, 1, 6, 7], 5), ([0, 2, 7], 5)):  # first, middle, last
        with pytest.raises(ValueError, match=f"{longest} tokens > max_seq_len=4"):
            positions_from_cu_seqlens(torch.tensor(bounds), 7, max_len=4)


@pytest.mark.parametrize("cu", [torch.tensor([], dtype=torch.long), torch.tensor([0]), torch.tensor(0), torch.zeros(2, 2, dtype=torch.long)])
def test_boundaries_of_the_wrong_shape_are_one_clear_error(cu):
    from hymo.models.rope import check_cu_seqlens
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D int32 or int64 tensor \[0, \.\.\., T\]"):
        check_cu_seqlens(cu, 7)


def test_rope_refuses_an_odd_width():
    from hymo.models.rope import rope_inv_freq
    with pytest.raises(ValueError, match="dim=7 must be even"): rope_inv_freq(7)


def test_rope_frequencies_follow_theta_at_large_positions():
    "cos(m θ^(-2i/d)) against math at positions near 4096 and theta 5e5: the base is used, and positions stay exact in fp32."
    d, theta, pos = 16, 5e5, torch.tensor([0, 257, 2049, 4095])
    cos, sin = rope_cos_sin(pos, d, theta)
    want = torch.tensor([[m * theta ** (-2 * i / d) for i in range(d // 2)] for m in pos.tolist()], dtype=torch.float64)
    torch.testing.assert_close(cos.double(), want.cos(), atol=2e-4, rtol=0)
    torch.testing.assert_close(sin.double(), want.sin(), atol=2e-4, rtol=0)
    with pytest.raises(ValueError, match=r"must be \[B, T, H, d\]"):  # [B, T, d] with B == T: rotated by the batch index
        apply_rope(torch.randn(5, 5, d), *rope_cos_sin(torch.arange(5), d))


# --- MLA, full forward ------------------------------------------------------------------------------

def naive_deepseek_mla(m: MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    "DeepSeek-V2/V3 MLA from the paper, head by head, for one sequence x [T, D], with m's weights sliced per head (G == H)."
    T, H, dn, dr, dv, dc = x.shape[0], m.n_heads, m.d_nope, m.d_rope, m.d_v, m.d_c
    rms = lambda v, g: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + CFG.norm_eps) * g
    cos, sin = rope_cos_sin(torch.arange(T), dr, m.config.rope_theta)
    rope = lambda v: apply_rope(v[None, :, None], cos, sin)[0, :, 0]
    q_low_rank = m.config.mla_q_lora_rank > 0  # else one full projection, as DeepSeek-V2-Lite's
    q_b = (m.q_b_proj if q_low_rank else m.q_proj).weight.view(H, dn + dr, -1)
    kv_b = m.kv_b_proj.weight.view(H, dn + dv, dc)
    W_DKV, W_KR = m.kv_a_proj_with_mqa.weight.split([dc, dr])
    c_Q = rms(x @ m.q_a_proj.weight.T, m.q_a_layernorm.weight) if q_low_rank else x
    c_KV = rms(x @ W_DKV.T, m.kv_a_layernorm.weight)
    k_R = rope(x @ W_KR.T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    outs = []
    for h in range(H):
        q = torch.cat([c_Q @ q_b[h, :dn].T, rope(c_Q @ q_b[h, dn:].T)], -1)
        k = torch.cat([c_KV @ kv_b[h, :dn].T, k_R], -1)
        s = (q @ k.T / math.sqrt(dn + dr)).masked_fill(~mask, float("-inf"))
        outs.append(s.softmax(-1) @ (c_KV @ kv_b[h, dn:].T))
    return torch.cat(outs, -1) @ m.o_proj.weight.T


WIDTHS = [{"mla_v_head_dim": 24}, {"mla_kv_lora_rank": 48}, {"mla_q_lora_rank": 0}]  # d_v, d_c != d_nope + d_rope; no query LoRA


@pytest.mark.parametrize("over", [{}, {"rope_theta": 500000.0}, *WIDTHS])
@torch.no_grad()
def test_equals_deepseek_formula_when_groups_equal_heads(over):
    "Also with the config's RoPE base reaching the tables, with d_v or d_c unlike d_nope + d_rope (the softmax scale is the latter's), without the query's LoRA."
    m = randomize_(MultiHeadLatentAttention(load_config("hymo_tiny", mla_n_kv_groups=CFG.mla_n_heads, **over).model))
    x = x_(2, 20)
    y = m(x)
    assert y.std() > 0.1
    torch.testing.assert_close(y, torch.stack([naive_deepseek_mla(m, xb) for xb in x]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_causal():
    m = randomize_(MultiHeadLatentAttention(CFG))
    x = x_(2, 16)
    x2 = x.clone(); x2[:, 9:] += 1.0
    y, y2 = m(x), m(x2)
    assert torch.equal(y[:, :9], y2[:, :9])
    assert (y[:, 9:] - y2[:, 9:]).abs().max() > 1e-2


@torch.no_grad()
def test_grouped_equals_repeated_kv():
    "Grouped MLA == the G = H MLA whose kv_b_proj repeats each group's block for its H/G heads."
    m = randomize_(MultiHeadLatentAttention(CFG))
    assert m.n_kv_groups < m.n_heads
    full = MultiHeadLatentAttention(CFG_MHA)
    sd = dict(m.state_dict())
    kv_b = sd["kv_b_proj.weight"].view(m.n_kv_groups, m.d_nope + m.d_v, m.d_c)
    sd["kv_b_proj.weight"] = kv_b.repeat_interleave(m.n_rep, 0).flatten(0, 1)
    full.load_state_dict(sd)
    x = x_(2, 16)
    torch.testing.assert_close(m(x), full(x), atol=1e-5, rtol=1e-5)
    # the pairing matters: tiling (instead of repeat_interleave) gives a different model
    sd["kv_b_proj.weight"] = kv_b.repeat(m.n_rep, 1, 1).flatten(0, 1)
    full.load_state_dict(sd)
    assert (m(x) - full(x)).abs().max() > 1e-3


def test_an_odd_rope_width_is_refused_by_the_module_itself():
    "RoPE rotates pairs: the module checks it too, for a config that skipped load_config's checks (dataclasses.replace)."
    with pytest.raises(ValueError, match="mla_qk_rope_dim=3 must be even"):
        MultiHeadLatentAttention(dataclasses.replace(CFG, mla_qk_rope_dim=3))


@pytest.mark.parametrize("v_dim", [None, 24])  # 24: d_v != d_nope + d_rope, so the two paths' softmax scales could differ
@torch.no_grad()
def test_cu_seqlens_equals_separate_documents(v_dim):
    m = randomize_(MultiHeadLatentAttention(load_config("hymo_tiny", moe_capacity_factor=None, mla_v_head_dim=v_dim).model
                                           if v_dim else CFG))
    lens = [7, 1, 12]
    x = x_(1, sum(lens))
    cu = torch.tensor([0, 7, 8, 20])
    y = m(x, cu_seqlens=cu)
    torch.testing.assert_close(y, torch.cat([m(d) for d in x.split(lens, 1)], 1), atol=1e-5, rtol=1e-5)
    assert (y - m(x)).abs().max() > 1e-2
    with pytest.raises(ValueError, match="one row"):
        m(x_(2, 20), cu_seqlens=cu)
    for bad in ([0, 4, 8], [2, 4, 20], [0, 8, 8, 20]):  # not reaching T (8 of 20 tokens out), not from 0, an empty document
        with pytest.raises(ValueError, match="from 0 to T=20"):
            m(x, cu_seqlens=torch.tensor(bad))
    short = MultiHeadLatentAttention(dataclasses.replace(m.config, max_seq_len=12))
    short.load_state_dict(m.state_dict())
    torch.testing.assert_close(short(x, cu_seqlens=cu), y)  # the row is longer than max_seq_len, no document is
    with pytest.raises(ValueError, match="13 tokens > max_seq_len=12"):  # checked where the boundaries are read, on any device
        short(x, cu_seqlens=torch.tensor([0, 7, 20]))


@pytest.mark.parametrize("attend", ["attend_documents", "attend_documents_loop", "varlen_flash_attention"])
def test_the_document_attention_functions_check_their_inputs(attend):
    "Exported on their own: boundaries not covering T, or several rows (of which one would be kept), are refused."
    import hymo.models.mla as M
    q, k, v = torch.randn(1, 10, 4, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    fn = getattr(M, attend)  # the flash path's checks come before any GPU work: they run here too
    with pytest.raises(ValueError, match="from 0 to T=10"): fn(q, k, v, torch.tensor([0, 4, 7]), 0.1)
    with pytest.raises(ValueError, match="one row"): fn(q.expand(2, -1, -1, -1), k, v, torch.tensor([0, 4, 10]), 0.1)
    with pytest.raises(ValueError, match="one row"): fn(q, k[:, :9], v[:, :9], torch.tensor([0, 4, 10]), 0.1)
    if attend == "varlen_flash_attention": return  # its output: test_varlen_flash_equals_the_per_document_loop, on a GPU
    y = fn(q, k, v, torch.tensor([0, 4, 10]), 0.1)
    assert y.shape == (1, 10, 4, 8)
    ref = torch.cat([M.causal_sdpa(*(t[:, s:e].transpose(1, 2) for t in (q, k, v)), scale=0.1).transpose(1, 2)
                     for s, e in ((0, 4), (4, 10))], 1)
    torch.testing.assert_close(y, ref)  # the scale given is the scale used


def test_causal_sdpa_is_softmax_attention_written_out():
    "Against the formula, not against itself: the scale given (not SDPA's default 1/sqrt(d)), causal, head h reads group h // 2."
    from hymo.models.mla import causal_sdpa
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # (B, H, T, d): groups [0, 0, 1, 1]
    scores = 0.1 * q @ k4.transpose(-1, -2) + torch.full((6, 6), float("-inf")).triu(1)
    torch.testing.assert_close(causal_sdpa(q, k, v, 0.1), scores.softmax(-1) @ v4)


def test_compiled_attention_is_not_recompiled_for_each_document_count():
    """Under torch.compile the per-document attention of a packed row and its positions run outside the graph: traced,
    they were compiled again for every new number of documents (8 times, then dynamo gave up, on the 750M preset)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    blk = torch.compile(randomize_(MultiHeadLatentAttention(CFG)), backend=counter)
    T = 24
    compiled = []
    with torch.no_grad():
        for n_docs in range(1, 7):
            cu = torch.linspace(0, T, n_docs + 1).round().long()
            y = blk(x_(1, T), cu_seqlens=cu)
            assert y.shape == (1, T, CFG.dim)
            compiled.append(counter.frame_count)
    torch._dynamo.reset()
    # the first two calls compile the graphs around the eager parts (the second with a dynamic number of boundaries)
    assert compiled[1] == compiled[-1], f"graphs compiled after each call, for 1..6 documents: {compiled}"


@torch.no_grad()
def test_nope_layer_ignores_positions():
    cfg = load_config("hymo_tiny", nope_layers=[3]).model
    nope = randomize_(MultiHeadLatentAttention(cfg, layer_idx=3))
    rope = randomize_(MultiHeadLatentAttention(cfg, layer_idx=0))
    assert not nope.use_rope and rope.use_rope
    x, p = x_(2, 16), torch.arange(16)
    assert torch.equal(nope(x, positions=p + 11), nope(x))
    assert torch.equal(nope(x, positions=3 * p), nope(x))
    torch.testing.assert_close(rope(x, positions=p + 11), rope(x), atol=1e-4, rtol=1e-4)  # relative only
    assert (rope(x, positions=3 * p) - rope(x)).abs().max() > 1e-2


def test_bad_config_is_refused():
    cfg = load_config("hymo_tiny").model
    cfg.mla_n_kv_groups = 3  # bypassing load_config's validation
    with pytest.raises(ValueError, match="not divisible by mla_n_kv_groups=3"):
        MultiHeadLatentAttention(cfg)


# --- decoding ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [1, 17, 64])
@torch.no_grad()
def test_cached_decoding_equals_forward(prompt):
    m = randomize_(MultiHeadLatentAttention(CFG))
    extra = 6
    x = x_(2, prompt + extra, seed=prompt)
    y_full = m(x)
    cache = MLACache.empty(CFG, batch=2, max_len=prompt + extra)
    ys = [m.forward_decode(x[:, :prompt], cache)] + [m.forward_decode(x[:, t:t + 1], cache) for t in range(prompt, prompt + extra)]
    assert (torch.cat(ys, 1) - y_full).abs().max() <= 1e-5
    assert cache.length == prompt + extra
    # the cache holds exactly the normalised latent and the rotated shared key
    c_kv, k_rope = m.latents(x, m.rope_tables(torch.arange(prompt + extra)))
    torch.testing.assert_close(cache.c_kv, c_kv)
    torch.testing.assert_close(cache.k_rope, k_rope[:, :, 0])


@pytest.mark.parametrize("over", WIDTHS)
@torch.no_grad()
def test_cached_decoding_equals_forward_at_other_widths(over):
    "The absorbed decode dots d_c-wide latents but scales by d_nope + d_rope, as the forward does; q_lora_rank=0 decodes too."
    cfg = load_config("hymo_tiny", **over).model
    m = randomize_(MultiHeadLatentAttention(cfg))
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(3))
    cache = MLACache.empty(cfg, batch=2, max_len=12)
    ys = [m.forward_decode(x[:, :7], cache)] + [m.forward_decode(x[:, t:t + 1], cache) for t in range(7, 12)]
    assert (torch.cat(ys, 1) - m(x)).abs().max() <= 1e-5


@torch.no_grad()
def test_positions_by_row_and_by_default():
    "[B, T] positions rotate each row by its own; no positions are 0..T-1, the positions the decode cache counts."
    m = randomize_(MultiHeadLatentAttention(CFG))
    x = x_(2, 9)
    rows = torch.tensor([list(range(9)), [0, 1, 2, 3, 20, 21, 22, 23, 24]])  # not a shift of the first: RoPE sees only differences
    y = m(x, positions=rows)
    for b in range(2): torch.testing.assert_close(y[b:b + 1], m(x[b:b + 1], positions=rows[b]), atol=1e-6, rtol=1e-6)
    assert torch.equal(m(x), m(x, positions=torch.arange(9)))


@torch.no_grad()
def test_mla_refuses_what_it_would_misread():
    "A [T, D] input, positions outside 0..max_seq_len-1, decoding past max_seq_len, an integer cache, a pos unlike length."
    m = MultiHeadLatentAttention(CFG)
    x = x_(1, 8)
    for call in (lambda: m(x[0]), lambda: m.forward_decode(x[0], MLACache.empty(CFG, 1, 8))):
        with pytest.raises(ValueError, match=rf"expects \[B, T, {CFG.dim}\], got \[8, {CFG.dim}\]"): call()
    for bad, says in ((-torch.arange(8), "from -7 to 0"), (torch.arange(8) + CFG.max_seq_len - 4, f"from {CFG.max_seq_len - 4} to {CFG.max_seq_len + 3}")):
        with pytest.raises(ValueError, match=f"positions run {says}; this model's are 0..{CFG.max_seq_len - 1}"): m(x, positions=bad)
    cache = MLACache.empty(CFG, 1, CFG.max_seq_len + 8)
    cache.length, cache.pos = CFG.max_seq_len - 4, torch.tensor([CFG.max_seq_len - 4])
    with pytest.raises(ValueError, match=f"decoding to position {CFG.max_seq_len + 3}, beyond"): m.forward_decode(x, cache)
    assert cache.length == CFG.max_seq_len - 4  # refused before anything was written
    with pytest.raises(TypeError, match="not torch.int64/torch.int64: give floating-point buffers"):
        MLACache.empty(CFG, 1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"MLACache\(length=5, pos=\[2\]\): pos is the same count as length"):
        MLACache(torch.zeros(1, 8, 3), torch.zeros(1, 8, 2), length=5, pos=torch.tensor([2]))
    for c_kv, k_rope, length in ((torch.zeros(1, 8, 3), torch.zeros(1, 6, 2), 0), (torch.zeros(1, 8, 3), torch.zeros(2, 8, 2), 0),
                                 (torch.zeros(1, 8, 3), torch.zeros(1, 8, 2, device="meta"), 0),
                                 (torch.zeros(1, 8, 3), torch.zeros(1, 8, 2).double(), 0), (torch.zeros(1, 8, 3), torch.zeros(1, 8, 2), -3)):
        with pytest.raises(ValueError, match=r"MLACache holds c_kv \[B, max_len, d_c\] and k_rope \[B, max_len, d_rope\] of one dtype"):
            MLACache(c_kv, k_rope, length=length)


@torch.no_grad()
def test_mla_refuses_batched_positions_widths_and_hand_made_caches_it_would_misread():
    "Positions per row ([B, T]) are range-checked too; a width other than dim, a cache of other counts or types: said so."
    m, L = MultiHeadLatentAttention(CFG).eval(), CFG.max_seq_len
    x = x_(2, 8)
    for bad, says in (((torch.arange(8) + L - 4).expand(2, 8), f"from {L - 4} to {L + 3}"),
                      (torch.stack([torch.arange(8), torch.arange(8) - 20]), "from -20 to 7")):
        with pytest.raises(ValueError, match=f"positions run {says}; this model's are 0..{L - 1}"): m(x, positions=bad)
    m(x, positions=torch.stack([torch.arange(8), torch.arange(8) + L - 8]))  # in range: taken
    wide = torch.randn(1, 4, CFG.dim + 1)
    for call in (lambda: m(wide), lambda: m.forward_decode(wide, MLACache.empty(CFG, 1, 8))):
        with pytest.raises(ValueError, match=rf"expects \[B, T, {CFG.dim}\], got \[1, 4, {CFG.dim + 1}\]"): call()
    with pytest.raises(ValueError, match=r"cu_seqlens packs documents into one row: got batch 2, reshape to \[1, B\*T, D\]"):
        m(x, cu_seqlens=torch.tensor([0, 3, 8]))
    with pytest.raises(TypeError, match="MLACache holds latents and keys, not torch.float32/torch.int64"):
        MLACache(torch.zeros(1, 4, 32), torch.zeros(1, 4, 16, dtype=torch.long))
    c = MLACache.empty(CFG, 1, 16)
    for length in (2.0, True, "2"):
        with pytest.raises(TypeError, match=f"MLACache length counts the tokens cached: give an int, got {length!r}"):
            MLACache(c.c_kv, c.k_rope, length)
    for pos in (torch.tensor([0.0]), torch.tensor([0], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"pos is the same count as length, on the buffers' device, \[1\] int64"):
            MLACache(c.c_kv, c.k_rope, 0, pos)
    import numpy as np
    assert MLACache(c.c_kv, c.k_rope, np.int64(3)).length == 3 and type(MLACache(c.c_kv, c.k_rope, np.int64(3)).length) is int
    cache = MLACache.empty(CFG, 1, 8)
    with pytest.raises(ValueError, match="MLACache holds"):  # rows of k_rope unlike c_kv's: nothing written
        cache.append(torch.ones(1, 3, CFG.mla_kv_lora_rank), torch.ones(1, 2, CFG.mla_qk_rope_dim))
    assert cache.length == 0 and not cache.c_kv.any() and not cache.k_rope.any()


@torch.no_grad()
def test_mla_positions_and_decoding_end_exactly_at_max_seq_len():
    "Positions up to max_seq_len - 1 are taken, max_seq_len is not: by hand, by default (T), and when decoding."
    m, L = MultiHeadLatentAttention(CFG), CFG.max_seq_len
    x = x_(1, 8)
    m(x, positions=torch.arange(8) + L - 8)
    with pytest.raises(ValueError, match=f"positions run from {L - 7} to {L}"): m(x, positions=torch.arange(8) + L - 7)
    m(x_(1, L))
    with pytest.raises(ValueError, match=f"sequence length {L + 1} > max_seq_len={L}"): m(x_(1, L + 1))
    cache = MLACache.empty(CFG, 1, L + 8)
    cache.length, cache.pos = L - 1, torch.tensor([L - 1])
    with pytest.raises(ValueError, match=f"decoding to position {L}, beyond"): m.forward_decode(x[:, :2], cache)
    m.forward_decode(x[:, :1], cache)
    assert cache.length == L
    assert MLACache.empty(CFG, 1, 4).bytes_per_token() == (CFG.mla_kv_lora_rank + CFG.mla_qk_rope_dim) * 4


@torch.no_grad()
def test_bf16_cached_decoding_is_as_close_to_fp32_as_the_bf16_forward():
    "Under autocast the decoder's scores are fp32: rounded to bf16 first (scores of tens), its error was 1.6x the forward's."
    sharp = randomize_(MultiHeadLatentAttention(CFG), seed=3)
    for p in sharp.parameters():
        if p.dim() == 2: p.mul_(2)  # sharp heads: scores of a few tens
    P, E = 256, 16
    xs = torch.randn(1, P, CFG.dim, generator=torch.Generator().manual_seed(4))
    ref = sharp(xs)[:, -E:]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_fwd = sharp(xs.bfloat16()).float()[:, -E:]
        cache = MLACache.empty(CFG, 1, P, dtype=torch.bfloat16)
        sharp.forward_decode(xs[:, :P - E].bfloat16(), cache)
        y_dec = torch.cat([sharp.forward_decode(xs[:, t:t + 1].bfloat16(), cache) for t in range(P - E, P)], 1).float()
    rel = lambda y: ((y - ref).norm() / ref.norm()).item()
    assert rel(y_dec) <= 1.03 * rel(y_fwd), (rel(y_dec), rel(y_fwd))  # 0.99 here; half the scores in bf16 gave 1.05


@torch.no_grad()
def test_token_by_token_from_empty_and_absorbed_equals_naive():
    m = randomize_(MultiHeadLatentAttention(CFG_MHA), seed=3)
    x = x_(1, 17)
    cache = MLACache.empty(CFG_MHA, 1, 17)
    y = torch.cat([m.forward_decode(x[:, t:t + 1], cache) for t in range(17)], 1)
    y_naive = naive_deepseek_mla(m, x[0])[None]
    assert (y - y_naive).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="larger max_len"):
        m.forward_decode(x[:, :1], cache)


@torch.no_grad()
def test_absorbed_decode_in_fp64_is_the_forward():
    """In fp64 the absorbed decode (W_UK folded into the query, W_UV after the latent average) is the uncached forward
    to rounding: a prompt, a chunk after a non-empty cache, one token, a long chunk; rope width != nope width, G < H.
    (Its scores were taken in fp32 whatever the dtype: 2e-7 off.)"""
    cfg = load_config("hymo_tiny", mla_qk_rope_dim=8, mla_qk_nope_dim=24).model
    assert cfg.mla_n_kv_groups < cfg.mla_n_heads
    m = randomize_(MultiHeadLatentAttention(cfg, layer_idx=3)).double()
    x = torch.randn(2, 30, cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cache = MLACache.empty(cfg, 2, 40, dtype=torch.float64)
    y = torch.cat([m.forward_decode(x[:, a:b], cache) for a, b in ((0, 5), (5, 9), (9, 10), (10, 30))], 1)
    assert y.dtype == torch.float64 and (y - m(x)).abs().max().item() < 1e-12


@torch.no_grad()
def test_block_decode_and_packing():
    blk = randomize_(MLABlock(CFG, layer_idx=3)).eval()
    x = x_(1, 12)
    cache = MLACache.empty(CFG, 1, 12)
    y = torch.cat([blk.forward_decode(x[:, :5], cache), blk.forward_decode(x[:, 5:], cache)], 1)
    assert (y - blk(x)).abs().max() <= 1e-5
    torch.testing.assert_close(blk(x, torch.tensor([0, 5, 12]))[:, 5:], blk(x[:, 5:]), atol=1e-5, rtol=1e-5)


def test_decode_into_a_cache_of_another_dtype():
    "bf16 weights with an fp32 cache (and the other way round) decode as with a cache of the weights' dtype."
    blk = randomize_(MLABlock(CFG, layer_idx=3)).bfloat16().eval()
    x = x_(1, 9).bfloat16()
    with torch.no_grad():
        outs = {}
        for dt in (torch.bfloat16, torch.float32):
            cache = MLACache.empty(CFG, 1, 9, dtype=dt)
            outs[dt] = torch.cat([blk.forward_decode(x[:, :6], cache), blk.forward_decode(x[:, 6:], cache)], 1)
        assert outs[torch.float32].dtype == torch.bfloat16
        torch.testing.assert_close(outs[torch.float32], outs[torch.bfloat16], atol=0.05, rtol=0.05)
        cache = MLACache.empty(CFG, 1, 9, dtype=torch.bfloat16)
        blk32 = randomize_(MLABlock(CFG, layer_idx=3)).eval()
        ref = blk32(x.float())
        got = torch.cat([blk32.forward_decode(x[:, :6].float(), cache), blk32.forward_decode(x[:, 6:].float(), cache)], 1)
        assert got.dtype == torch.float32 and ((got - ref).norm() / ref.norm()) < 0.02


def test_a_cache_made_with_tokens_in_it_appends_after_them():
    "MLACache(..., length=5): the device's count starts at 5, so new rows go to 5.. and positions continue from 5."
    c, r = torch.zeros(1, 8, 3), torch.zeros(1, 8, 2)
    cache = MLACache(c, r, length=5)
    assert cache.positions(2).tolist() == [5, 6]
    cache.append(torch.ones(1, 2, 3), torch.ones(1, 2, 2))
    assert c[0, :, 0].tolist() == [0, 0, 0, 0, 0, 1, 1, 0] and cache.length == 7 and cache.pos.tolist() == [7]


def test_cache_size_is_latent_plus_rope_key():
    c = load_config("hymo_750m").model
    assert MLACache.empty(c, 1, 4, dtype=torch.bfloat16).bytes_per_token() == (128 + 32) * 2


# --- meta device ------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_lora_rank", [CFG.mla_q_lora_rank, 0])
def test_meta_build_then_reset_equals_eager(q_lora_rank):
    cfg = load_config("hymo_tiny", mla_q_lora_rank=q_lora_rank).model
    def build(meta):
        with torch.device("meta" if meta else "cpu"): blk = MLABlock(cfg, layer_idx=3)
        if meta: blk.to_empty(device="cpu")
        torch.manual_seed(0); blk.reset_parameters()
        return blk
    a, b = build(False), build(True)
    assert hasattr(a.attn, "q_proj") == (q_lora_rank == 0)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    q_w = a.attn.q_b_proj.weight if q_lora_rank else a.attn.q_proj.weight
    assert abs(q_w.std().item() - cfg.init_std) < 3e-3
    o_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert abs(a.attn.o_proj.weight.std().item() - o_std) < 0.05 * o_std  # (sampling error of the std: ~0.6 %)


def test_750m_shapes_on_meta():
    c = load_config("hymo_750m").model
    with torch.device("meta"):
        m = MultiHeadLatentAttention(c, layer_idx=3)
        y = m(torch.empty(1, 4096, c.dim))
    assert y.shape == (1, 4096, 896) and y.is_meta
    assert m.kv_b_proj.weight.shape == (4 * (96 + 128), 128)
    assert m.kv_a_proj_with_mqa.weight.shape == (128 + 32, 896)
    assert m.q_b_proj.weight.shape == (16 * 128, 224)
    assert m.softmax_scale == 128 ** -0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernels run on CUDA")
def test_varlen_flash_equals_the_per_document_loop():
    from hymo.models.mla import attend_documents_loop, varlen_flash_attention, varlen_flash_ok
    g = torch.Generator("cuda").manual_seed(0)
    cu = torch.tensor([0, 100, 101, 700, 1024])
    qkv = [torch.randn(1, 1024, h, 128, device="cuda", generator=g).bfloat16().requires_grad_() for h in (16, 4, 4)]
    assert varlen_flash_ok(*qkv) and not varlen_flash_ok(qkv[0], qkv[1].float(), qkv[2])
    assert not varlen_flash_ok(qkv[0], qkv[1], qkv[2][..., :64])  # values narrower than the queries: flash needs them equal
    do = torch.randn(1, 1024, 16, 128, device="cuda", generator=g).bfloat16()
    res = []
    for f in (varlen_flash_attention, attend_documents_loop):
        o = f(*qkv, cu, 0.1)
        res.append([o.detach().float(), *(t.float() for t in torch.autograd.grad(o, qkv, do))])
    for name, a, b in zip(["o", "dq", "dk", "dv"], *res):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, f"{name}: max |varlen - loop| / max |loop| = {err:.3g}"
    # the documents stay apart: new values in the first document change it and nothing after it
    q, k, v = (t.detach().clone() for t in qkv)
    v[:, :100] = torch.randn(1, 100, 4, 128, device="cuda", generator=g).bfloat16()
    moved = varlen_flash_attention(q, k, v, cu, 0.1).float()
    assert torch.equal(moved[:, 100:], res[0][0][:, 100:]), (moved[:, 100:] - res[0][0][:, 100:]).abs().max()
    assert (moved[:, :100] - res[0][0][:, :100]).abs().max() > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernels run on CUDA")
def test_mla_module_takes_the_varlen_path_with_its_own_layouts(monkeypatch):
    "The module's queries, keys and values are views with their own strides: the varlen call must read them right, under autocast."
    import hymo.models.mla as mla
    cfg = load_config("hymo_750m").model
    m = randomize_(MultiHeadLatentAttention(cfg, layer_idx=3)).cuda()
    cu = torch.tensor([0, 300, 301, 1500, 2048], device="cuda")
    x = torch.randn(1, 2048, cfg.dim, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    calls, res = [], []
    plain = mla.varlen_flash_attention
    monkeypatch.setattr(mla, "varlen_flash_attention", lambda *a: calls.append(1) or plain(*a))
    for use_varlen in (True, False):
        monkeypatch.setattr(mla, "varlen_flash_ok", lambda q, k, v: use_varlen)
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(xi, cu_seqlens=cu)
        y.float().pow(2).mean().backward()
        res.append([y.detach().float(), xi.grad])
    assert calls == [1]
    for a, b in zip(*res):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2


@torch.no_grad()
def test_a_nope_layer_decodes_as_its_forward():
    "A NoPE layer's decoding must skip RoPE too: prompt then single tokens equal the whole forward."
    cfg = load_config("hymo_tiny", nope_layers=[3], moe_capacity_factor=None).model
    m, x = randomize_(MultiHeadLatentAttention(cfg, layer_idx=3)), x_(2, 9)
    cache = MLACache.empty(cfg, 2, 9)
    y = torch.cat([m.forward_decode(x[:, :5], cache)] + [m.forward_decode(x[:, t:t + 1], cache) for t in range(5, 9)], 1)
    assert (y - m(x)).abs().max() <= 1e-5


def test_positions_with_document_boundaries_are_refused():
    m = MultiHeadLatentAttention(load_config("hymo_tiny").model)
    with pytest.raises(ValueError, match="not both"):
        m(x_(1, 20), cu_seqlens=torch.tensor([0, 7, 20]), positions=torch.arange(20))
    with pytest.raises(ValueError, match="one position per token"):
        apply_rope(torch.randn(1, 4, 1, 8), *rope_cos_sin(torch.tensor([0]), 8))


def test_rope_default_base_is_10000():
    from hymo.models.rope import rope_inv_freq
    torch.testing.assert_close(rope_inv_freq(8), 10000.0 ** (-torch.arange(0, 8, 2) / 8))
    cos, _ = rope_cos_sin(torch.arange(3), 8)
    torch.testing.assert_close(cos, rope_cos_sin(torch.arange(3), 8, 10000.0)[0])


# From a review of the RoPE and MLA chapters: inputs that broadcast or ran silently.
def test_rope_tables_that_do_not_fit_are_refused():
    cos, sin = rope_cos_sin(torch.arange(6), 8)
    x = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="cos and sin must both be"): apply_rope(x, cos, sin[:1])  # used to broadcast
    cb, sb = rope_cos_sin(torch.arange(6).expand(3, 6), 8)
    with pytest.raises(ValueError, match=r"with B = 1 \(or 1\)"): apply_rope(x, cb, sb)  # used to give a batch of 3
    assert apply_rope(x.expand(3, 6, 2, 8), cb, sb).shape == (3, 6, 2, 8)
    with pytest.raises(TypeError, match="positions must be whole numbers"): rope_cos_sin(torch.arange(6) + 0.5, 8)
    from hymo.models.rope import rope_inv_freq
    with pytest.raises(ValueError, match="even and positive"): rope_inv_freq(0)


def test_block_decoding_is_refused_in_training_mode_and_a_cache_of_another_shape_named():
    "Decoding in training mode let the MoE cap experts by the call's tokens and count them for its balancing."
    c = load_config("hymo_tiny").model
    blk = MLABlock(c, layer_idx=3)
    with pytest.raises(RuntimeError, match=r"call \.eval\(\) first"): blk.forward_decode(x_(1, 2), MLACache.empty(c, 1, 4))
    assert int(blk.ffn.expert_counts.sum()) == 0
    blk.eval()
    attn = randomize_(MultiHeadLatentAttention(CFG))
    with torch.no_grad(), pytest.raises(ValueError, match=r"MLACache holds \[B=2, L, d_c=.*make the cache with MLACache.empty"):
        attn.forward_decode(x_(1, 2), MLACache.empty(CFG, 2, 4))
    other = dataclasses.replace(CFG, mla_kv_lora_rank=CFG.mla_kv_lora_rank * 2)
    with torch.no_grad(), pytest.raises(ValueError, match="MLACache holds"):
        attn.forward_decode(x_(1, 2), MLACache.empty(other, 1, 4))


# --- RoPE input checks (from mutation testing) ----------------------------------------------------

def test_positions_with_only_some_fractional_values_are_refused():
    "One half-position among whole ones is no token's place either (not only all-fractional positions)."
    with pytest.raises(TypeError, match="positions must be whole numbers"):
        rope_cos_sin(torch.tensor([0.0, 1.5, 2.0]), 8)
    rope_cos_sin(torch.tensor([0.0, 1.0, 2.0]), 8)  # whole floats are fine


def test_complex_positions_are_refused():
    "A complex position would lose its imaginary part in positions.float()."
    with pytest.raises(TypeError, match="positions must be whole numbers"):
        rope_cos_sin(torch.arange(4).to(torch.complex64), 8)


def test_tables_of_four_dimensions_are_refused():
    "A [1, B, T, d/2] table would broadcast x [B, T, H, d] into a 5-D result without an error."
    cos, sin = rope_cos_sin(torch.arange(6).expand(2, 6), 8)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        apply_rope(torch.randn(2, 6, 2, 8), cos[None], sin[None])


def test_a_batch_of_one_table_serves_every_row():
    "Tables [1, T, d/2] (positions [1, T]) rotate every row of a batch, as the [T, d/2] tables do."
    x = torch.randn(3, 6, 2, 8)
    c1, s1 = rope_cos_sin(torch.arange(6)[None], 8)
    c, s = rope_cos_sin(torch.arange(6), 8)
    torch.testing.assert_close(apply_rope(x, c1, s1), apply_rope(x, c, s), rtol=0, atol=0)
