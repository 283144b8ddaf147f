"""The gated delta rule: the chunked path equals the loop (outputs, states, gradients), documents stay apart,
and the Gated DeltaNet block is causal, learns, and builds on the meta device."""
import math

import pytest
import torch
import torch.nn.functional as F

from hymo.config import load_config
from hymo.models.gdn import (GatedDeltaNet, GatedDeltaNetBlock, GDNState, causal_conv1d, chunk_gated_delta_rule_torch,
                             conv_silu_norm, naive_gated_delta_rule, reference_mixer)

H, K, V = 3, 12, 20  # deliberately not powers of two


def inputs(B=2, T=100, seed=0, g_zero=False, beta_value=None, g_mult=6):
    "g_mult=6: strong decays (a chunk of 64 keeps ~4e-13 of its incoming state, hardly ever more than ~1e-7); 0.2: weak ones (about 0.4)."
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    g = torch.zeros(B, T, H) if g_zero else F.logsigmoid(r(B, T, H) + 3) * g_mult
    beta = torch.full((B, T, H), beta_value) if beta_value is not None else torch.rand(B, T, H, generator=gen)
    return q, k, r(B, T, H, V), g, beta


def run_with_grads(rule, args, h0, **kw):
    args = [x.clone().requires_grad_() for x in args]
    h0 = h0.clone().requires_grad_()
    o, S = rule(*args, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1)
    ((o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()).backward()
    return [o.detach(), S.detach()] + [x.grad for x in args] + [h0.grad]


@pytest.mark.parametrize("g_mult", [6, 0.2])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_matches_naive_values_and_grads(T, g_mult):
    args, h0 = inputs(T=T, seed=T, g_mult=g_mult), torch.randn(2, H, K, V)
    ref = run_with_grads(naive_gated_delta_rule, args, h0)
    got = run_with_grads(chunk_gated_delta_rule_torch, args, h0)
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
    for name, a, b in zip(names, ref, got):
        # 1e-5 absolute for O(1) tensors; gradients here reach ~15, so the bound scales with their size
        # (fp32 rounding of the chunked sums is ~1e-6 relative; in fp64 the two agree to 1e-14, see below)
        err, bound = (a - b).abs().max().item(), 1e-5 * max(1.0, a.abs().max().item())
        assert err <= bound, f"T={T}: {name} differs by {err:.2e} > {bound:.1e}"


def test_the_decay_matrix_is_the_one_c_by_c_tensor_kept_for_its_backward():
    """`exp().tril()` kept exp's output for the backward besides D itself, which the products that read D keep: two
    C x C matrices a chunk, 4 GB more at the 750M shape (out of memory on an 80 GB card). Masked before exp, D is exp's."""
    from hymo.models.gdn import _segment_decays
    g = (-torch.rand(3, 5, 64)).requires_grad_()
    g.data[0, 0, 7] = float("-inf")  # a hard reset stays finite
    big = []
    def keep(t):  # the pack hook: sees each tensor saved for the backward
        if t.numel() >= 3 * 5 * 64 * 64: big.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        D = _segment_decays(g)
    assert [t.data_ptr() for t in big] == [D.data_ptr()], [tuple(t.shape) for t in big]
    D.sum().backward()
    assert torch.isfinite(D).all() and torch.isfinite(g.grad).all() and (D.triu(1) == 0).all()


@pytest.mark.parametrize("g_mult", [6, 0.2])
def test_chunk_is_exact_in_fp64(g_mult):
    "The chunked form is an exact rearrangement: in fp64 it matches the loop to rounding, values and gradients."
    args, h0 = [x.double() for x in inputs(T=130, seed=7, g_mult=g_mult)], torch.randn(2, H, K, V, dtype=torch.float64)
    for a, b in zip(run_with_grads(naive_gated_delta_rule, args, h0), run_with_grads(chunk_gated_delta_rule_torch, args, h0)):
        assert a.dtype == torch.float64 and (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("case", ["no_decay", "no_write"])
def test_edge_cases(case):
    # no_write with weak gates: the decayed initial state stays large enough (0.2 to 0.3) that zeros could not pass
    args = inputs(T=90, g_zero=case == "no_decay", beta_value=1e-7 if case == "no_write" else None,
                  g_mult=0.2 if case == "no_write" else 6)
    h0 = torch.randn(2, H, K, V)
    ref = run_with_grads(naive_gated_delta_rule, args, h0)
    got = run_with_grads(chunk_gated_delta_rule_torch, args, h0)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=0)
    if case == "no_write":  # nothing written: the state is the initial one, only decayed
        decay = args[3].sum(1).exp()[..., None, None]  # (B, H, 1, 1)
        assert decay.min() > 0.1
        torch.testing.assert_close(got[1], h0 * decay, atol=1e-5, rtol=0)


def test_decay_only_forgets():
    "beta = 0 and a constant g: the state is exp(T g) times the initial state."
    q, k, v, g, beta = inputs(T=70)
    g, beta = torch.full_like(g, -0.05), torch.zeros_like(beta)
    h0 = torch.randn(2, H, K, V)
    _, S = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(S, h0 * math.exp(-0.05 * 70))


def test_chunk_size_does_not_change_the_result():
    args = inputs(T=77)
    a, _ = chunk_gated_delta_rule_torch(*args, chunk_size=64)
    b, _ = chunk_gated_delta_rule_torch(*args, chunk_size=16)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rule", [naive_gated_delta_rule, chunk_gated_delta_rule_torch])
def test_cu_seqlens_equals_separate_documents(rule):
    args = inputs(B=1, T=200, seed=5)
    cu = torch.tensor([0, 5, 69, 133, 133, 200])  # includes an empty document
    h0 = torch.randn(5, H, K, V)
    o, S = rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(5):
        s, e = cu[n].item(), cu[n + 1].item()
        o_n, S_n = naive_gated_delta_rule(*(x[:, s:e] for x in args), initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, s:e], o_n, atol=1e-5, rtol=0)
        torch.testing.assert_close(S[n:n + 1], S_n, atol=1e-5, rtol=0)


def test_dtype_and_state_dtype():
    q, k, v, g, beta = inputs(T=40)
    o, S = chunk_gated_delta_rule_torch(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, _ = naive_gated_delta_rule(q, k, v, g, beta)
    assert (o.float() - o_ref).abs().max() < 1e-2 * o_ref.abs().max()  # bf16 inputs: ~4e-3 of the largest output
    q, k, v, g, beta = (x.bfloat16() for x in inputs(T=500, g_mult=0.2))  # weak decays: the state sums hundreds of writes
    _, S_ref = naive_gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(), output_final_state=True)
    for rule in (naive_gated_delta_rule, chunk_gated_delta_rule_torch):  # both keep it in fp32 (the loop decodes tokens)
        o, S = rule(q, k, v, g, beta, output_final_state=True)
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32, rule.__name__
        assert (S - S_ref).norm() / S_ref.norm() < 1e-4, rule.__name__  # in bf16 the state would be ~6e-2 off


def test_bad_shapes_have_clear_errors():
    q, k, v, g, beta = inputs(T=10)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_gated_delta_rule_torch(q, k, v, g, beta[:, :5])
    with pytest.raises(ValueError, match="B must be 1"):
        chunk_gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="initial_state must be"):
        naive_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, H, K, K))
    with pytest.raises(TypeError, match="must be floating point"):
        chunk_gated_delta_rule_torch(q, k, v.long(), g, beta)
    for rule in (naive_gated_delta_rule, chunk_gated_delta_rule_torch):  # an integer state would be used as it is
        for h0 in (torch.zeros(2, H, K, V, dtype=torch.long), torch.zeros(2, H, K, V, device="meta")):
            with pytest.raises(TypeError, match=r"initial_state must be a floating-point tensor on v's device \(cpu\)"):
                rule(q, k, v, g, beta, initial_state=h0)
        with pytest.raises(ValueError, match=r"cu_seqlens must be a non-decreasing \[N\+1\] tensor"):
            rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([], dtype=torch.long))
    for size in (0, True):
        with pytest.raises(ValueError, match=f"chunk_size={size} must be a positive int"):
            chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=size)
    with pytest.raises(ValueError, match="chunk_size=64.0 must be a positive int"):
        chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=64.0)
    import numpy as np
    torch.testing.assert_close(chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=np.int64(16))[0],
                               chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=16)[0])


@pytest.mark.parametrize("cu", [None, [0], [0, 0], [0, 0, 40, 40, 90]], ids=["T0", "no_document", "one_empty", "empty_among"])
def test_empty_sequences_and_documents(cu):
    "T = 0, or empty documents in a packed row: no output there, and each state (and conv cache) as it came in."
    T = 0 if cu is None or cu[-1] == 0 else cu[-1]
    q, k, v, g, beta = inputs(T=T, seed=3)
    n = 2
    if cu is not None: (q, k, v, g, beta), n, cu = [x[:1] for x in (q, k, v, g, beta)], len(cu) - 1, torch.tensor(cu)
    h0 = torch.randn(n, H, K, V)
    o, S = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o2, S2 = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == o2.shape == v.shape and S.shape == S2.shape == h0.shape
    torch.testing.assert_close(o2, o, atol=1e-5, rtol=1e-5); torch.testing.assert_close(S2, S, atol=1e-5, rtol=1e-5)
    empty = [i for i in range(n) if cu is None or cu[i] == cu[i + 1]]
    assert torch.equal(S[empty], h0[empty]) and torch.equal(S2[empty], h0[empty])
    x, cache = torch.randn(v.shape[0], T, 5), torch.randn(n, 3, 5)
    y, c = causal_conv1d(x, torch.randn(5, 4), cu_seqlens=cu, cache=cache, output_final_state=True)
    assert y.shape == x.shape and torch.equal(c[empty], cache[empty])


def test_conv_refuses_bad_document_boundaries():
    x, w = torch.randn(1, 5, 7), torch.randn(7, 4)
    for bad, msg in [(torch.tensor([0.0, 5.0]), "int32 or int64 tensor"), ([0, 5], "int32 or int64 tensor"), (torch.tensor([0, 3]), "from 0 to T=5"),
                     (torch.tensor([0, 4, 2, 5]), "non-decreasing")]:
        with pytest.raises(ValueError, match=msg): causal_conv1d(x, w, cu_seqlens=bad)
    with pytest.raises(ValueError, match="B must be 1"): causal_conv1d(torch.randn(2, 5, 7), w, cu_seqlens=torch.tensor([0, 5]))


def test_conv_respects_documents_and_cache():
    x, w = torch.randn(1, 30, 7), torch.randn(7, 4)
    cu = torch.tensor([0, 2, 20, 30])
    y, cache = causal_conv1d(x, w, cu_seqlens=cu, output_final_state=True)
    for n in range(3):
        s, e = cu[n].item(), cu[n + 1].item()
        y_n, c_n = causal_conv1d(x[:, s:e], w, output_final_state=True)
        torch.testing.assert_close(y[:, s:e], y_n)
        torch.testing.assert_close(cache[n:n + 1], c_n)
    assert cache[0, 0].abs().sum() == 0  # a 2-token document: the oldest cache slot is still the zero start


# ---------------------------------------------------------------- the block

@pytest.fixture(scope="module")
def cfg():
    return load_config("hymo_tiny", gdn_head_k_dim=12, gdn_head_v_dim=20, gdn_n_heads=3).model


def test_block_shape_and_causality(cfg):
    torch.manual_seed(0)
    block = GatedDeltaNetBlock(cfg)
    x = torch.randn(2, 90, cfg.dim)
    y = block(x)
    assert y.shape == x.shape
    for t in (1, 40, 89):
        x2 = x.clone(); x2[:, t] += 1
        y2 = block(x2)
        assert (y2[:, :t] - y[:, :t]).abs().max() == 0, f"changing token {t} changed earlier outputs"
        assert (y2[:, t] - y[:, t]).abs().max() > 1e-4
        if t < 89:  # and later outputs: only the mixer carries token t forward (the FFN works token by token)
            assert (y2[:, t + 1:] - y[:, t + 1:]).abs().max() > 1e-4


def test_mixer_kernels_agree_and_state_carries(cfg):
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg)
    x = torch.randn(2, 70, cfg.dim)
    mixer.kernel = "naive"; y_naive = mixer(x)
    mixer.kernel = "torch"; y = mixer(x)
    torch.testing.assert_close(y, y_naive, atol=1e-5, rtol=1e-5)
    y1, st = mixer(x[:, :65], output_final_state=True)
    y2, _ = mixer(x[:, 65:], initial_state=st, output_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["torch", "naive"])
def test_mixer_packed_documents_do_not_leak(cfg, kernel):
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg)
    mixer.kernel = kernel
    docs = [torch.randn(1, n, cfg.dim) for n in (2, 66, 30)]
    cu = torch.tensor([0, 2, 68, 98])
    y = mixer(torch.cat(docs, 1), cu_seqlens=cu)
    for n, d in enumerate(docs):
        torch.testing.assert_close(y[:, cu[n]:cu[n + 1]], mixer(d), atol=1e-5, rtol=1e-5)


def test_decay_parameters_init(cfg):
    cfg = load_config("hymo_tiny", gdn_n_heads=64).model
    m = GatedDeltaNet(cfg)
    A, dt = m.A_log.exp(), F.softplus(m.dt_bias)
    assert ((A >= 1) & (A <= 16)).all() and A.std() > 1
    assert ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
    assert m.A_log.dtype == m.dt_bias.dtype == torch.float32


def test_block_learns_to_add_the_previous_token():
    "Only the time axis can bring x_{t-1} to position t: the trained block beats the best per-token block (about 1)."
    cfg = load_config("hymo_tiny").model
    def held_out_loss(block, steps=200):
        opt = torch.optim.Adam([p for p in block.parameters() if p.requires_grad], lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        task = lambda x: F.mse_loss(block(x), x + F.pad(x[:, :-1], (0, 0, 1, 0)))
        for _ in range(steps):
            loss = task(torch.randn(8, 64, cfg.dim, generator=gen))
            opt.zero_grad(); loss.backward(); opt.step()
        with torch.no_grad(): return task(torch.randn(16, 64, cfg.dim, generator=torch.Generator().manual_seed(99))).item()
    torch.manual_seed(0)
    assert held_out_loss(GatedDeltaNetBlock(cfg)) < 0.85
    torch.manual_seed(0)
    per_token = GatedDeltaNetBlock(cfg)
    per_token.mixer.o_proj.weight.data.zero_(); per_token.mixer.o_proj.weight.requires_grad_(False)
    assert held_out_loss(per_token) > 0.95


def test_meta_device_build(cfg):
    with torch.device("meta"):
        block = GatedDeltaNetBlock(cfg)
    assert all(p.is_meta for p in block.parameters())
    block.to_empty(device="cpu")
    block.reset_parameters()
    m = block.mixer
    assert all(p.isfinite().all() for p in block.parameters())
    assert ((m.A_log.exp() >= 1) & (m.A_log.exp() <= 16)).all()
    assert abs(m.q_proj.weight.std().item() - cfg.init_std) < 2e-3
    assert abs(m.o_proj.weight.std().item() - cfg.init_std / math.sqrt(2 * cfg.n_layers)) < 2e-3
    assert (block.norm1.weight == 1).all() and (m.o_norm.weight == 1).all()
    x = torch.randn(1, 10, cfg.dim)
    assert block(x).shape == x.shape


def test_unknown_kernel_is_refused(cfg):
    m = GatedDeltaNet(cfg)
    m.kernel = "cuda"
    with pytest.raises(ValueError, match="choose"):
        m(torch.randn(1, 4, cfg.dim))


def test_mixer_equals_the_paper_written_out(cfg):
    "The whole mixer (projections, conv, SiLU, norms, gates, decay, write strength, output gate) against `reference_mixer`."
    torch.manual_seed(0)
    m = GatedDeltaNet(cfg)
    with torch.no_grad():  # unit-scale weights and varied gains: outputs of order one, every term visible
        for name, p in m.named_parameters():
            if p.ndim >= 2: p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        m.o_norm.weight.copy_(1 + 0.3 * torch.randn_like(m.o_norm.weight))
        m.dt_bias.copy_(torch.randn_like(m.dt_bias))
    x = torch.randn(2, 70, cfg.dim)
    ref = reference_mixer(m, x)
    assert ref.abs().mean() > 0.05
    for kernel in ("naive", "torch"):
        m.kernel = kernel
        torch.testing.assert_close(m(x), ref, atol=1e-4, rtol=1e-4)


def _conv_by_conv1d(x, w):
    "Causal depthwise convolution by F.conv1d, in x's dtype: x [B, T, C], w [C, W]."
    return F.conv1d(F.pad(x.transpose(1, 2), (w.shape[-1] - 1, 0)), w[:, None], groups=x.shape[-1]).transpose(1, 2)


def test_conv_and_qk_norm_keep_fp64():
    "fp64 in, fp64 out to rounding: the conv (both paths) and the q/k norm compute in fp32 at least, not in fp32 (1e-8, 1e-7 off)."
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 50, 7, generator=gen, dtype=torch.float64), torch.randn(7, 4, generator=gen, dtype=torch.float64)
    ref = _conv_by_conv1d(x, w)
    y_rows, _ = causal_conv1d(x, w)
    y_packed, _ = causal_conv1d(x.reshape(1, 100, 7), w, cu_seqlens=torch.tensor([0, 50, 100]))
    assert y_rows.dtype == y_packed.dtype == torch.float64
    assert (y_rows - ref).abs().max() < 1e-13 and (y_packed.view(2, 50, 7) - ref).abs().max() < 1e-13
    h, k, v, W = 2, 5, 3, 4
    C = h * (2 * k + v)
    qkv, w = torch.randn(1, 20, C, generator=gen, dtype=torch.float64), torch.randn(C, W, generator=gen, dtype=torch.float64)
    q, _, _, _ = conv_silu_norm(qkv, w, h, k, head_v_dim=v)
    q_ref = F.normalize(F.silu(_conv_by_conv1d(qkv, w))[..., :h * k].view(1, 20, h, k), dim=-1)
    assert q.dtype == torch.float64 and (q - q_ref).abs().max() < 1e-13


def test_an_fp64_mixer_equals_the_paper_written_out_to_fp64(cfg):
    "A .double() mixer computes in fp64 end to end, the gates included (they were taken in fp32: 1e-7 off)."
    torch.manual_seed(0)
    m = GatedDeltaNet(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2: p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        m.dt_bias.copy_(torch.randn_like(m.dt_bias))
    x = torch.randn(2, 70, cfg.dim, dtype=torch.float64)
    ref = reference_mixer(m, x)
    for kernel in ("naive", "torch"):
        m.kernel = kernel
        y = m(x)
        assert y.dtype == torch.float64 and (y - ref).abs().max() < 1e-12 * ref.abs().max(), kernel


def _rule_inputs(B=1, T=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    return q, k, r(B, T, H, V), -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)


@pytest.mark.parametrize("rule", [naive_gated_delta_rule, chunk_gated_delta_rule_torch])
@pytest.mark.parametrize("cu", [[1, 10], [0, 4, 3, 10], [0, 4, 9]], ids=["not_from_0", "step_back_by_1", "not_to_T"])
def test_rules_refuse_bad_document_boundaries(rule, cu):
    q, k, v, g, beta = _rule_inputs()
    with pytest.raises(ValueError, match="non-decreasing"):
        rule(q, k, v, g, beta, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match="non-decreasing"):
        causal_conv1d(torch.randn(1, 10, 7), torch.randn(7, 4), cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("rule", [naive_gated_delta_rule, chunk_gated_delta_rule_torch])
def test_rules_refuse_values_and_gates_with_the_wrong_head_count(rule):
    q, k, v, g, beta = _rule_inputs(B=2)
    with pytest.raises(ValueError, match="v must be"):
        rule(q, k, v[:, :, :1], g, beta)  # one value head would broadcast over the 3 heads
    with pytest.raises(ValueError, match="g must be"):
        rule(q, k, v, g[..., :1], beta)


@pytest.mark.parametrize("scale", [1e-3, 1e-5])  # 1e-5: |q| ~ 1e-5, where an eps of 1e-4 inside the norm would show
def test_prelude_q_k_have_unit_norm_even_when_small(scale):
    "L2 norm of q and k per head: exact unit vectors for activations of any scale (eps only guards 0)."
    torch.manual_seed(0)
    qkv, w = scale * torch.randn(2, 9, 2 * H * K + H * V), torch.randn(2 * H * K + H * V, 4)
    q, k, v, _ = conv_silu_norm(qkv, w, H, K)
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(2, 9, H))
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(2, 9, H))


def test_output_norm_uses_the_configured_eps():
    cfg = load_config("hymo_tiny", norm_eps=1e-3).model  # not RMSNorm's default
    assert GatedDeltaNet(cfg).o_norm.eps == 1e-3


@pytest.mark.parametrize("cu", [None, [0, 3, 10]], ids=["rows", "packed"])
@pytest.mark.parametrize("rule", [naive_gated_delta_rule, chunk_gated_delta_rule_torch])
def test_an_explicit_scale_is_used(rule, cu):
    "o_t = S_t^T (scale q_t) and S does not depend on q: the output is linear in the scale."
    q, k, v, g, beta = _rule_inputs()
    cu = None if cu is None else torch.tensor(cu)
    o_default, _ = rule(q, k, v, g, beta, cu_seqlens=cu)
    o_scaled, _ = rule(q, k, v, g, beta, 0.37, cu_seqlens=cu)
    torch.testing.assert_close(o_scaled, o_default * 0.37 * K ** 0.5, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_hard_reset_and_huge_gates_match_the_loop(dtype):
    "g = -inf (forget everything) and -1e6 among weak gates: differences of cumulative sums gave nan and lost the gaps."
    q, k, v, g, beta = (x.to(dtype) for x in inputs(T=150, seed=4, g_mult=0.2))
    g[0, 10, 0], g[1, 75, 2], g[0, 100, 1] = float("-inf"), -1e6, -200.0
    h0 = torch.randn(2, H, K, V, dtype=dtype)
    ref = run_with_grads(naive_gated_delta_rule, (q, k, v, g, beta), h0)
    got = run_with_grads(chunk_gated_delta_rule_torch, (q, k, v, g, beta), h0)
    for name, a, b in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], ref, got):
        assert b.isfinite().all(), name
        torch.testing.assert_close(b, a, atol=(1e-5 if dtype == torch.float32 else 1e-12) * max(1.0, a.abs().max().item()),
                                   rtol=0, msg=lambda m: f"{name}: {m}")


def test_a_hard_reset_in_a_packed_row_stays_in_its_document():
    "Padding a packed row to documents multiplied the slots past each end by 0: a g = -inf there made NaN everywhere."
    q, k, v, g, beta = (x[:1] for x in inputs(B=1, T=150, seed=6, g_mult=0.2))
    cu = torch.tensor([0, 40, 64, 65, 150])
    for at in (3, 40, 64, 100):  # inside a document, at a document's start, a one-token document, a long one
        g2 = g.clone(); g2[0, at, 1] = float("-inf")
        h0 = torch.randn(4, H, K, V)
        ref = run_with_grads(naive_gated_delta_rule, (q, k, v, g2, beta), h0, cu_seqlens=cu)
        got = run_with_grads(chunk_gated_delta_rule_torch, (q, k, v, g2, beta), h0, cu_seqlens=cu)
        for name, a, b in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], ref, got):
            assert b.isfinite().all(), (at, name)
            torch.testing.assert_close(b, a, atol=1e-5 * max(1.0, a.abs().max().item()), rtol=0, msg=lambda m: f"{at} {name}: {m}")


def test_empty_batches_and_heads_and_zero_width_heads():
    "B = 0 or H = 0: empty outputs of the right shape from both rules; K = 0 or V = 0 is refused (K**-0.5 would divide by 0)."
    q, k, v, g, beta = inputs(T=70)
    for sl in (slice(0, 0), slice(None)):
        hs = slice(0, 0) if sl == slice(None) else slice(None)
        xs = [x[sl][:, :, hs] for x in (q, k, v, g, beta)]
        for rule in (naive_gated_delta_rule, chunk_gated_delta_rule_torch):
            o, S = rule(*xs, output_final_state=True)
            assert o.shape == xs[2].shape and S.shape == (xs[0].shape[0], xs[0].shape[2], K, V)
    for rule in (naive_gated_delta_rule, chunk_gated_delta_rule_torch):
        with pytest.raises(ValueError, match="K=0 and V=20 must be at least 1"):
            rule(q[..., :0], k[..., :0], v, g, beta)
        with pytest.raises(ValueError, match="K=12 and V=0 must be at least 1"):
            rule(q, k, v[..., :0], g, beta)


def test_prelude_refuses_heads_that_do_not_fit_the_channels():
    "qkv made with H=3, K=12, V=20 (132 channels): another head count or key size would split it silently."
    qkv, w = torch.randn(1, 5, 2 * H * K + H * V), torch.randn(2 * H * K + H * V, 4)
    assert [t.shape[-1] for t in conv_silu_norm(qkv, w, 4, 12)[:3]] == [12, 12, 9]  # 4 heads of 12, 12, 9 fit too
    for h, kd in ((4, 12), (3, 13), (3, 22), (0, 12)):
        with pytest.raises(ValueError, match="check n_heads, head_k_dim and head_v_dim|must be at least 1"):
            conv_silu_norm(qkv, w, h, kd, head_v_dim=V)
    for h, kd in ((3, 22), (5, 12)):  # no value channels; 132 - 120 = 12 does not split into 5 heads
        with pytest.raises(ValueError, match="a whole V >= 1; check n_heads and head_k_dim$"):
            conv_silu_norm(qkv, w, h, kd)
    assert [t.shape[-1] for t in conv_silu_norm(qkv, w, H, K, head_v_dim=V)[:3]] == [K, K, V]
    for bad in (torch.randn(1, 4), torch.randn(qkv.shape[-1], 1, 4), torch.randn(qkv.shape[-1], 0)):
        with pytest.raises(ValueError, match=r"weight must be \[C, W\]"):
            causal_conv1d(qkv, bad)
        with pytest.raises(ValueError, match=r"weight must be \[C, W\]"):
            causal_conv1d(qkv, bad, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"qkv must be \[B, T, C\]"):
        conv_silu_norm(qkv[0], w, H, K)


def test_mixer_refuses_a_bare_state_and_flat_input(cfg):
    mixer = GatedDeltaNet(cfg)
    x = torch.randn(2, 10, cfg.dim)
    _, st = mixer(x, output_final_state=True)
    with pytest.raises(TypeError, match="must be the GDNState .* not a Tensor"):
        mixer(x, initial_state=st.recurrent)
    with pytest.raises(ValueError, match=rf"x must be \[B, T, dim={cfg.dim}\]; got shape \(10, {cfg.dim}\)"):
        mixer(x[0])
    with pytest.raises(ValueError, match=rf"x must be \[B, T, dim={cfg.dim}\]; got shape \(2, 10, {cfg.dim + 1}\)"):
        mixer(torch.randn(2, 10, cfg.dim + 1))  # (a bare matmul error before)
    for part in (0, 1):  # the conv window left out read as zeros: a continuation silently 5e6 times further off
        with pytest.raises(ValueError, match="initial_state needs both parts"):
            mixer(x, initial_state=st._replace(**{st._fields[part]: None}))


@torch.no_grad()
def test_the_mixer_gates_are_the_documented_formulas(cfg, monkeypatch):
    "g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), written out from the parameters (reference_mixer shares the code)."
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg)
    mixer.A_log.copy_(torch.tensor([-1.0, 0.0, 1.5])); mixer.dt_bias.copy_(torch.tensor([0.5, -2.0, 0.0]))
    x = torch.randn(2, 6, cfg.dim)
    seen = {}
    def rule(q, k, v, g, beta, *rest):
        seen.update(g=g, beta=beta)
        return naive_gated_delta_rule(q, k, v, g, beta, *rest)
    monkeypatch.setattr(mixer, "_rule", lambda kernel: rule)
    mixer(x)
    a, b = x @ mixer.a_proj.weight.T, x @ mixer.b_proj.weight.T  # (B, T, H) each
    A = torch.tensor([math.exp(-1.0), 1.0, math.exp(1.5)])
    torch.testing.assert_close(seen["g"], -A * torch.log1p(torch.exp(a + torch.tensor([0.5, -2.0, 0.0]))))
    torch.testing.assert_close(seen["beta"], 1 / (1 + torch.exp(-b)))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the projections in bf16, the gates still in fp32
        mixer(x)
    assert seen["g"].dtype == seen["beta"].dtype == torch.float32, (seen["g"].dtype, seen["beta"].dtype)


def test_block_adds_the_mixer_then_the_ffn_of_the_new_stream(cfg):
    "x1 = x + mixer(norm1(x)); out = x1 + ffn(norm2(x1)), with the two norms made different so a swap shows."
    torch.manual_seed(0)
    block = GatedDeltaNetBlock(cfg)
    with torch.no_grad(): block.norm1.weight.uniform_(0.5, 1.5); block.norm2.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 30, cfg.dim)
    x1 = x + block.mixer(block.norm1(x))
    torch.testing.assert_close(block(x), x1 + block.ffn(block.norm2(x1)))


@torch.no_grad()
def test_mixer_decodes_token_by_token_as_its_forward(cfg):
    "One token at a time with the state (the recurrent step, no chunks) continues a prefix exactly as the whole forward."
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg)
    mixer.kernel = "torch"
    x = torch.randn(2, 12, cfg.dim)
    y, st = mixer(x[:, :5], output_final_state=True)
    ys = [y]
    for t in range(5, 12):
        y_t, st = mixer(x[:, t:t + 1], initial_state=st, output_final_state=True)
        ys.append(y_t)
    torch.testing.assert_close(torch.cat(ys, 1), mixer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["torch", "naive"])
@torch.no_grad()
def test_packed_documents_continue_each_from_its_own_state(cfg, kernel):
    "A packed call with one carried state per document (recurrent and conv) equals each document continued alone."
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg)
    mixer.kernel = kernel
    heads, tails = [torch.randn(1, n, cfg.dim) for n in (7, 3, 5)], [torch.randn(1, n, cfg.dim) for n in (4, 70, 1)]
    states = [mixer(h, output_final_state=True)[1] for h in heads]
    alone = [mixer(t, initial_state=s, output_final_state=True) for t, s in zip(tails, states)]
    cu = torch.tensor([0, 4, 74, 75])
    packed = GDNState(*(torch.cat(parts) for parts in zip(*states)))  # [N, ...] each
    y, st = mixer(torch.cat(tails, 1), cu_seqlens=cu, initial_state=packed, output_final_state=True)
    for n, (y_n, s_n) in enumerate(alone):
        torch.testing.assert_close(y[:, cu[n]:cu[n + 1]], y_n, atol=1e-5, rtol=1e-5)
        for a, b in zip(st, s_n): torch.testing.assert_close(a[n:n + 1], b, atol=1e-5, rtol=1e-5)


def test_conv_packed_with_a_cache_per_document():
    "Each document's first taps read its own cache, N >= 2 (a cache read from the next document passed every other test)."
    x, w = torch.randn(1, 9, 5), torch.randn(5, 4)
    cu, cache = torch.tensor([0, 1, 3, 9]), torch.randn(3, 3, 5)
    y, new = causal_conv1d(x, w, cu_seqlens=cu, cache=cache, output_final_state=True)
    for n in range(3):
        s, e = cu[n].item(), cu[n + 1].item()
        y_n, c_n = causal_conv1d(x[:, s:e], w, cache=cache[n:n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, s:e], y_n)
        torch.testing.assert_close(new[n:n + 1], c_n)


def test_strong_gates_give_finite_gradients():
    "g = -2 per token: e^{-gamma} would reach e^{128} in a chunk of 64; masking before exp keeps every factor in [0, 1]."
    q, k, v, g, beta = _rule_inputs(B=1, T=64)
    g = torch.full_like(g, -2.0).requires_grad_()
    o, S = chunk_gated_delta_rule_torch(q, k, v, g, beta, output_final_state=True)
    (o.sum() + S.sum()).backward()
    assert o.isfinite().all() and g.grad.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.bool, torch.float32])
def test_rules_refuse_cu_seqlens_that_are_not_int32_or_int64(dtype):
    "uint8's diff() wraps round: decreasing boundaries would pass the check and a rule return another number of tokens."
    q, k, v, g, beta = _rule_inputs()
    for rule in (naive_gated_delta_rule, chunk_gated_delta_rule_torch):
        with pytest.raises(ValueError, match="cu_seqlens must be an int32 or int64 tensor"):
            rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6, 5, 10]).to(dtype))


def test_conv_packed_path_rounds_as_the_rows_path_does():
    "bf16 inputs with an fp32 cache: one document packed gives the rows' output bit for bit (summed in fp32, cache in x's dtype)."
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 9, 7, generator=gen).bfloat16(), torch.randn(7, 4, generator=gen).bfloat16()
    cache = torch.randn(1, 3, 7, generator=gen)  # fp32
    y_rows, c_rows = causal_conv1d(x, w, cache=cache, output_final_state=True)
    y_packed, c_packed = causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 9]), cache=cache, output_final_state=True)
    assert y_packed.dtype == c_packed.dtype == torch.bfloat16
    assert torch.equal(y_packed, y_rows) and torch.equal(c_packed, c_rows)


@pytest.mark.parametrize("rule", [naive_gated_delta_rule, chunk_gated_delta_rule_torch])
def test_packed_documents_start_from_zero_without_an_initial_state(rule):
    "cu_seqlens and no initial_state: every document (an empty one too) starts from S = 0, not from the one before."
    gen = torch.Generator().manual_seed(0); r = lambda *s: torch.randn(*s, generator=gen)
    T = 90
    q, k = F.normalize(r(1, T, H, K), dim=-1), F.normalize(r(1, T, H, K), dim=-1)
    args = (q, k, r(1, T, H, V), -0.05 * torch.rand(1, T, H, generator=gen), torch.rand(1, T, H, generator=gen))
    cu = torch.tensor([0, 7, 7, 70, 90])
    o, S = rule(*args, output_final_state=True, cu_seqlens=cu)
    for n in range(4):
        s, e = cu[n].item(), cu[n + 1].item()
        o_n, S_n = naive_gated_delta_rule(*(x[:, s:e] for x in args), output_final_state=True)
        torch.testing.assert_close(o[:, s:e], o_n, atol=1e-5, rtol=0)
        torch.testing.assert_close(S[n:n + 1], S_n, atol=1e-5, rtol=0)


def test_decay_init_spans_its_ranges():
    "A ~ U[1, 16] and dt log-uniform in [1e-3, 0.1]: with 64 heads both ends are reached, not only the bounds kept."
    torch.manual_seed(0)
    m = GatedDeltaNet(load_config("hymo_tiny", gdn_n_heads=64).model)
    A, dt = m.A_log.exp(), F.softplus(m.dt_bias)
    assert A.min() < 3 and A.max() > 12
    assert dt.min() < 2e-3 and dt.max() > 0.05


def test_mixer_gradients_equal_the_reference_mixer_s():
    "The mixer and `reference_mixer` (the paper written out) agree in every parameter's gradient, not only in the output."
    cfg = load_config("hymo_tiny", gdn_head_k_dim=12, gdn_head_v_dim=20, gdn_n_heads=3).model
    torch.manual_seed(0)
    m = GatedDeltaNet(cfg)
    m.kernel = "torch"
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2: p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        m.dt_bias.copy_(torch.randn_like(m.dt_bias))
    x, gy = torch.randn(2, 70, cfg.dim), torch.randn(2, 70, cfg.dim)
    grads = []
    for f in (lambda: m(x), lambda: reference_mixer(m, x)):
        m.zero_grad()
        (f() * gy).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]: torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-4, rtol=1e-3, msg=n)


def test_conv_refuses_a_rows_cache_of_the_wrong_length():
    "A [B, W, C] cache (one input too many) would shift every tap by one token, silently."
    B, T, C, W = 2, 5, 6, 4
    x, w = torch.randn(B, T, C), torch.randn(C, W)
    for bad in (torch.zeros(B, W, C), torch.zeros(B, W - 2, C)):
        with pytest.raises(ValueError, match="conv cache"):
            causal_conv1d(x, w, cache=bad)


def test_a_multi_token_step_with_a_state_runs_the_chunked_rule(monkeypatch):
    "Only a one-token decode step under no_grad runs the recurrence; a chunk of a long text keeps the chunked rule."
    import hymo.models.gdn as gdn_mod
    c = load_config("hymo_tiny", gdn_kernel="torch").model
    torch.manual_seed(0)
    m = GatedDeltaNet(c).eval()
    x = torch.randn(1, 6, c.dim)
    with torch.no_grad():
        _, st = m(x[:, :3], output_final_state=True)
        monkeypatch.setattr(gdn_mod, "naive_gated_delta_rule", lambda *a: pytest.fail("recurrence ran for T > 1"))
        m(x[:, 3:], initial_state=st)
