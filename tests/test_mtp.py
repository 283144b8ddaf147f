"""Multi-token prediction: target alignment, loss composition, gradients into the trunk's hidden state."""
import pytest
import torch
import torch.nn.functional as F

from hymo.config import load_config
from hymo.models.mtp import (IGNORE_INDEX, MTPOutput, MultiTokenPrediction, ce_chunk, linear_cross_entropy, lm_loss,
                             lm_loss_fused)


@pytest.fixture
def cfg():
    return load_config("hymo_tiny", mtp_depth=3, mtp_loss_weights=[0.5, 0.3, 0.1]).model


def test_head_k_targets_token_t_plus_1_plus_k(cfg):
    T = 9
    x = torch.arange(T + 1)[None].repeat(2, 1)  # a counting sequence: x_i = i
    tokens, targets = x[:, :-1], x[:, 1:]
    mtp = MultiTokenPrediction(cfg)
    outs = mtp(torch.randn(2, T, cfg.dim), targets, lambda h: h @ torch.randn(cfg.vocab_size, cfg.dim).T)
    for o in outs:
        t = torch.arange(T - o.k)
        assert torch.equal(o.targets[0], t + 1 + o.k)       # x_{t+1+k}
        assert o.logits.shape == (2, T - o.k, cfg.vocab_size)
    assert [o.weight for o in outs] == [0.5, 0.3, 0.1]


def test_head_reads_only_its_positions(cfg):
    """Logits of head k at position t depend on h_t only: perturbing h at t changes only row t."""
    T, emb = 8, torch.randn(cfg.vocab_size, cfg.dim)
    mtp = MultiTokenPrediction(cfg).eval()
    h = torch.randn(1, T, cfg.dim)
    a = mtp(h, torch.zeros(1, T, dtype=torch.long), lambda z: z @ emb.T)
    h2 = h.clone(); h2[:, 3] += 1
    b = mtp(h2, torch.zeros(1, T, dtype=torch.long), lambda z: z @ emb.T)
    for oa, ob in zip(a, b):
        changed = (oa.logits - ob.logits).abs().amax(-1)[0] > 0
        assert changed.nonzero().flatten().tolist() == [3]


def test_loss_is_weighted_sum_and_trains_hidden(cfg):
    T = 10
    h = torch.randn(2, T, cfg.dim, requires_grad=True)
    emb = torch.randn(cfg.vocab_size, cfg.dim) * 0.05
    targets = torch.randint(0, cfg.vocab_size, (2, T))
    mtp = MultiTokenPrediction(cfg)
    outs = mtp(h, targets, lambda z: z @ emb.T)
    main_logits = h @ emb.T
    total, parts = lm_loss(main_logits, targets, outs)
    expect = parts["main"] + sum(w * parts[f"mtp_{k}"] for k, w in enumerate(cfg.mtp_loss_weights, 1))
    torch.testing.assert_close(total.detach(), expect)
    assert not any(v.requires_grad for v in parts.values())  # the trainer sums parts over micro-batches: no graphs kept
    _, fused_parts = lm_loss_fused(h, emb, targets, mtp(h, targets))
    assert fused_parts.keys() == parts.keys() and not any(v.requires_grad for v in fused_parts.values())
    # only MTP: the last k positions get no gradient from head k; position T-1 gets none from any head
    mtp_only = sum(o.weight * torch.nn.functional.cross_entropy(o.logits.flatten(0, 1), o.targets.flatten()) for o in outs)
    g, = torch.autograd.grad(mtp_only, h, retain_graph=True)
    assert g[:, : T - 1].abs().sum() > 0 and g[:, T - 1].abs().sum() == 0
    assert all(p.grad is None for p in mtp.parameters())
    total.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mtp.parameters())


def test_losses_with_ignored_targets_are_the_mean_over_the_counted_ones(cfg):
    "IGNORE_INDEX targets (document ends, padding) count neither in the sum nor in the number it is divided by."
    torch.manual_seed(0)
    T = 12
    h = torch.randn(2, T, cfg.dim)
    emb = torch.randn(cfg.vocab_size, cfg.dim) * 0.05
    targets = torch.randint(0, cfg.vocab_size, (2, T))
    targets[0, :7] = IGNORE_INDEX; targets[1, 3] = IGNORE_INDEX
    outs = MultiTokenPrediction(cfg)(h, targets, lambda z: z @ emb.T)
    _, parts = lm_loss(h @ emb.T, targets, outs)
    counted = targets != IGNORE_INDEX
    want = F.cross_entropy((h @ emb.T)[counted], targets[counted])  # over the counted targets alone
    torch.testing.assert_close(parts["main"], want)
    _, fused = lm_loss_fused(h, emb, targets, MultiTokenPrediction(cfg)(h, targets))
    torch.testing.assert_close(fused["main"], want)
    assert abs(float(want) - float(F.cross_entropy((h @ emb.T).flatten(0, 1), targets.flatten().clamp_min(0)))) > 1e-3


def test_too_short_sequence_is_a_clear_error(cfg):
    mtp = MultiTokenPrediction(cfg)
    with pytest.raises(ValueError, match="too short"):
        mtp(torch.randn(1, 3, cfg.dim), torch.zeros(1, 3, dtype=torch.long), lambda z: z)


def test_no_mtp_heads():
    cfg = load_config("hymo_tiny", mtp_depth=0, mtp_loss_weights=[]).model
    mtp = MultiTokenPrediction(cfg)
    assert mtp(torch.randn(1, 4, cfg.dim), torch.zeros(1, 4, dtype=torch.long), lambda z: z) == []
    logits, targets = torch.randn(1, 4, 7), torch.randint(0, 7, (1, 4))
    total, parts = lm_loss(logits, targets, [])
    assert list(parts) == ["main"] and torch.equal(total.detach(), parts["main"])


@pytest.mark.parametrize("chunk", [1, 5, 64, None])
def test_linear_cross_entropy_matches_full_logits(chunk):
    torch.manual_seed(0)
    h = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (3, 7)); t[0, 2] = t[2, 6] = IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy((h @ w.T).flatten(0, 1), t.flatten())
    got = linear_cross_entropy(h, w, t, chunk_rows=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got * 0.7, (h, w)), torch.autograd.grad(ref * 0.7, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_linear_cross_entropy_under_bf16_autocast_matches_reference():
    """Under autocast both paths project in bf16 and take the softmax in fp32: they agree to bf16 rounding."""
    torch.manual_seed(0)
    h = torch.randn(64, 32, requires_grad=True)
    w = (torch.randn(300, 32) * 0.3).requires_grad_()
    t = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.cross_entropy((h @ w.T).float(), t)
        got = linear_cross_entropy(h, w, t, chunk_rows=16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    ga, gb = torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))
    for a, b in zip(ga, gb):
        assert a.dtype == torch.float32  # gradients reach the fp32 leaves
        assert (a - b).norm() / b.norm() < 2e-2


def test_linear_cross_entropy_sums_the_weight_gradient_over_chunks_in_fp32():
    "dW adds up one term per chunk (64 here): summed in bf16, its error was 3.7x that of one bf16 rounding."
    torch.manual_seed(0)
    h = torch.randn(512, 16, dtype=torch.bfloat16)
    w = (0.3 * torch.randn(64, 16)).bfloat16().requires_grad_()
    t = torch.randint(0, 64, (512,))
    dw, = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk_rows=8), w)
    wd = w.detach().double().requires_grad_()
    ref, = torch.autograd.grad(torch.nn.functional.cross_entropy(h.double() @ wd.T, t), wd)
    assert dw.dtype == torch.bfloat16 and ((dw.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_linear_cross_entropy_without_grad_and_bad_shapes():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with torch.no_grad(): loss = linear_cross_entropy(h, w, t)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h @ w.T, t))
    with pytest.raises(ValueError, match="targets of h's leading shape"):
        linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, torch.randn(10, 9), t)


def test_fused_lm_loss_equals_lm_loss(cfg):
    T = 10
    h = torch.randn(2, T, cfg.dim, requires_grad=True)
    emb = (torch.randn(cfg.vocab_size, cfg.dim) * 0.05).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (2, T))
    mtp = MultiTokenPrediction(cfg)
    outs = mtp(h, targets, lambda z: z @ emb.T)
    ref, ref_parts = lm_loss(h @ emb.T, targets, outs)
    got, got_parts = lm_loss_fused(h, emb, targets, outs)
    assert ref_parts.keys() == got_parts.keys()
    torch.testing.assert_close(got, ref)
    leaves = [h, emb, *mtp.parameters()]
    for a, b in zip(torch.autograd.grad(got, leaves, retain_graph=True), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_compiled_ce_chunk_matches_eager():
    """The chunk arithmetic that CUDA runs through torch.compile where Triton is missing (compiled here for CPU) equals the eager one."""
    from hymo.models import mtp
    compiled = mtp._compiled_ce_chunk()
    assert mtp._ce_chunk_for(torch.zeros(1, 2)) is mtp.ce_chunk  # what CPU runs
    torch.manual_seed(0)
    for c in (7, 5):  # two chunk sizes: the last chunk of a head is shorter
        z, y = torch.randn(c, 97), torch.randint(0, 97, (c,))
        w = torch.full((c,), 1 / 9); w[1] = 0
        for want in (True, False):
            (la, ga), (lb, gb) = compiled(z, y, w, want), mtp.ce_chunk(z, y, w, want)
            torch.testing.assert_close(la, lb)
            assert (ga is None) == (gb is None) == (not want)
            if want: torch.testing.assert_close(ga, gb)


def test_linear_cross_entropy_edge_cases():
    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    # a head whose targets are all ignored: loss 0 and zero gradients (not NaN)
    t = torch.full((6,), IGNORE_INDEX)
    loss = linear_cross_entropy(h, w, t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0 and gh.abs().sum() == 0 and gw.abs().sum() == 0
    # fp16 is refused with a way out
    with pytest.raises(TypeError, match="bf16"):
        linear_cross_entropy(h.half(), w.half(), torch.zeros(6, dtype=torch.long))
    # lm_loss needs logits: a clear error when the MTP heads ran without the vocabulary projection
    mtp_out = [MTPOutput(1, h[None, :5], torch.zeros(1, 5, dtype=torch.long), 0.3)]
    with pytest.raises(ValueError, match="lm_loss_fused"):
        lm_loss(torch.randn(1, 6, 11), torch.zeros(1, 6, dtype=torch.long), mtp_out)
    # a negative target other than IGNORE_INDEX is an error, as in F.cross_entropy, not class 0
    for bad in (-1, 11):
        with pytest.raises(ValueError, match=rf"targets must be ids in 0\.\.10, or IGNORE_INDEX=-100.*\[{bad}\]"):
            linear_cross_entropy(h, w, torch.tensor([bad, 2, 3, 4, 5, 6]))


def test_linear_cross_entropy_skips_gradients_without_grad_mode(monkeypatch):
    """Evaluation (no grad mode) computes only the loss, even for a weight that requires grad."""
    from hymo.models import mtp
    seen = []
    real = mtp.ce_chunk
    monkeypatch.setattr(mtp, "ce_chunk", lambda *a: seen.append(a[3]) or real(*a))
    h, w = torch.randn(6, 8), torch.randn(11, 8, requires_grad=True)
    with torch.no_grad(): linear_cross_entropy(h, w, torch.zeros(6, dtype=torch.long), chunk_rows=4)
    assert seen == [False, False]


def test_fused_loss_scales_bf16_gradients_in_fp32():
    """The incoming scale (an MTP weight over the accumulation steps) is not a bf16 number: dh is scaled in fp32."""
    torch.manual_seed(0)
    h = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(20, 8, dtype=torch.bfloat16)
    t = torch.randint(0, 20, (16,))
    g1, = torch.autograd.grad(linear_cross_entropy(h, w, t), h)
    g2, = torch.autograd.grad(linear_cross_entropy(h, w, t) * (0.3 / 32), h)
    torch.testing.assert_close(g2, (g1.float() * (0.3 / 32)).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton chunk kernel and the fp32-output addmm run on CUDA")
def test_linear_cross_entropy_on_cuda_matches_cross_entropy():
    """What CUDA runs (chapter 42's kernel, the fp32 accumulation of the vocabulary gradient) in bf16, several
    chunks and ignored rows, against F.cross_entropy on the same bf16 numbers in fp32."""
    torch.manual_seed(0)
    h = torch.randn(300, 64, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(1000, 64, device="cuda") * 0.1).bfloat16().requires_grad_()
    y = torch.randint(0, 1000, (300,), device="cuda"); y[::7] = -100
    got = linear_cross_entropy(h, w, y, chunk_rows=128)
    ref = F.cross_entropy(h.float() @ w.float().T, y)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert abs(got.item() - ref.item()) < 1e-3 * ref.item()
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert rel(a, b) < 1e-2


def test_head_is_norm_linear_silu_linear_norm(cfg):
    "Each head's formula written out from its parameters: a missing SiLU or norm changes the output by order one."
    from hymo.models.mtp import MTPBlock
    torch.manual_seed(0)
    blk = MTPBlock(cfg.dim, cfg.mtp_inter_dim)
    with torch.no_grad():
        for m in (blk.proj_in, blk.proj_out): m.weight.copy_(torch.randn_like(m.weight) / m.weight.shape[1] ** 0.5)
        for n in (blk.norm, blk.out_norm): n.weight.copy_(1 + 0.3 * torch.randn_like(n.weight))
    h = 3 * torch.randn(2, 5, cfg.dim)
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ref = rms(F.silu(rms(h, blk.norm.weight) @ blk.proj_in.weight.T) @ blk.proj_out.weight.T, blk.out_norm.weight)
    torch.testing.assert_close(blk(h), ref, atol=1e-5, rtol=1e-5)


def test_packed_row_masks_targets_across_documents(cfg):
    "Head k's target at t counts only inside t's document: t and t+k in one document."
    T, cu = 10, torch.tensor([0, 4, 5, 10])  # documents 0-3, 4, 5-9
    targets = torch.arange(100, 100 + T)[None]
    outs = MultiTokenPrediction(cfg)(torch.randn(1, T, cfg.dim), targets, cu_seqlens=cu)
    doc = [0, 0, 0, 0, 1, 2, 2, 2, 2, 2]
    for o in outs:
        want = [100 + t + o.k if doc[t] == doc[t + o.k] else IGNORE_INDEX for t in range(T - o.k)]
        assert o.targets[0].tolist() == want, o.k


def test_mtp_refuses_inputs_it_would_misread(cfg):
    from hymo.config import ModelConfig
    mtp = MultiTokenPrediction(cfg)
    with pytest.raises(ValueError, match=r"targets \(1, 8\) must be \[B, T\] = \[1, 6\]"):
        mtp(torch.randn(1, 6, cfg.dim), torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="B must be 1"):
        mtp(torch.randn(2, 6, cfg.dim), torch.zeros(2, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="mtp_loss_weights has 2 entries but model.mtp_depth=3"):
        MultiTokenPrediction(ModelConfig(dim=16, mtp_inter_dim=8, mtp_depth=3))  # a config not through load_config
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    import numpy as np
    torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk_rows=np.int64(3)), F.cross_entropy(h @ w.T, t))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_rows=.* must be a positive int"): linear_cross_entropy(h, w, t, chunk_rows=bad)


def test_linear_cross_entropy_is_stable_for_logits_in_the_hundreds():
    "exp() of a logit in the hundreds overflows fp32: each chunk subtracts its rows' maximum (log-sum-exp)."
    torch.manual_seed(0)
    h, w = torch.randn(12, 16) * 40, torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (12,)); t[3] = IGNORE_INDEX
    assert (h @ w.detach().T).abs().max() > 100
    ref = F.cross_entropy(h @ w.T, t)
    got = linear_cross_entropy(h, w, t, chunk_rows=5)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.autograd.grad(got, w)[0], torch.autograd.grad(ref, w)[0], rtol=1e-4, atol=1e-5)


def test_linear_cross_entropy_under_autocast_computes_what_bf16_inputs_do():
    "Under bf16 autocast the products run in bf16 (not fp32): the same number as bf16 inputs without autocast, bit for bit."
    torch.manual_seed(0)
    h, w, t = torch.randn(64, 32), torch.randn(300, 32) * 0.3, torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t, chunk_rows=16)
    assert torch.equal(got, linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, chunk_rows=16))
    assert not torch.equal(got, linear_cross_entropy(h, w, t, chunk_rows=16))


def test_ce_chunk_takes_the_softmax_of_bf16_logits_in_fp32():
    "bf16 logits: the loss and softmax in fp32, only the returned gradient rounded to bf16."
    torch.manual_seed(0)
    z, y, w = (torch.randn(8, 5000) * 3).bfloat16(), torch.randint(0, 5000, (8,)), torch.full((8,), 1 / 8)
    (l, g), (lr, gr) = ce_chunk(z, y, w, True), ce_chunk(z.float(), y, w, True)
    assert l.dtype == torch.float32 and g.dtype == torch.bfloat16
    torch.testing.assert_close(l, lr, rtol=1e-6, atol=1e-6)
    assert torch.equal(g, gr.bfloat16())


def test_lm_loss_of_bf16_logits_is_computed_in_fp32():
    torch.manual_seed(0)
    logits, t = (torch.randn(2, 6, 3000) * 3).bfloat16(), torch.randint(0, 3000, (2, 6))
    total, _ = lm_loss(logits, t)
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, F.cross_entropy(logits.float().flatten(0, 1), t.flatten()), rtol=1e-6, atol=1e-6)


def test_lm_loss_of_fp64_logits_is_computed_in_fp64():
    "fp64 logits (the chapters' exact checks): the cross-entropy in fp64, not rounded through fp32."
    torch.manual_seed(0)
    logits, t = torch.randn(2, 6, 3000, dtype=torch.float64) * 3, torch.randint(0, 3000, (2, 6))
    total, _ = lm_loss(logits, t)
    want = (logits.logsumexp(-1) - logits.gather(-1, t[..., None])[..., 0]).mean()
    assert total.dtype == torch.float64 and abs(total - want) < 1e-13


def test_a_loss_with_every_target_ignored_is_zero_with_zero_gradients():
    logits = torch.randn(1, 6, 11, requires_grad=True)
    loss = lm_loss(logits, torch.full((1, 6), IGNORE_INDEX), [])[0]
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_the_loss_takes_int32_targets():
    logits, t = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    assert torch.equal(lm_loss(logits, t.int(), [])[0], lm_loss(logits, t, [])[0])


def test_fused_loss_scales_the_weight_gradient_in_fp32_before_casting():
    "The weight's gradient is accumulated in fp32; the incoming scale multiplies it there, and only then is it cast."
    from types import SimpleNamespace
    from hymo.models.mtp import _LinearCrossEntropy
    dw, grad = torch.randn(20, 8), torch.tensor(0.3 / 32)
    ctx = SimpleNamespace(saved_tensors=(None, dw), w_dtype=torch.bfloat16)
    _, got, *_ = _LinearCrossEntropy.backward.__wrapped__(ctx, grad)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (dw * grad).bfloat16())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 0-dim CUDA scale is where bf16 would round it")
def test_fused_loss_scales_bf16_gradients_in_fp32_on_cuda():
    torch.manual_seed(0)
    h = torch.randn(16, 8, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(20, 8, dtype=torch.bfloat16, device="cuda")
    t = torch.randint(0, 20, (16,), device="cuda")
    g1, = torch.autograd.grad(linear_cross_entropy(h, w, t), h)
    g2, = torch.autograd.grad(linear_cross_entropy(h, w, t) * (0.3 / 32), h)
    torch.testing.assert_close(g2, (g1.float() * (0.3 / 32)).to(torch.bfloat16), rtol=0, atol=0)


def test_more_loss_weights_than_heads_is_refused():
    import dataclasses
    c = load_config("hymo_tiny").model
    with pytest.raises(ValueError, match="mtp_loss_weights"):
        MultiTokenPrediction(dataclasses.replace(c, mtp_depth=1))  # two weights, one head
    with pytest.raises(ValueError, match=r"mtp_loss_weights=\[-0.3, 0.1\] must be 0 or more"):
        MultiTokenPrediction(dataclasses.replace(c, mtp_loss_weights=(-0.3, 0.1)))  # replace skips load_config's checks


def test_mtp_block_with_a_head_projects_its_output_not_its_input():
    from hymo.models.mtp import MTPBlock
    torch.manual_seed(0)
    blk, emb = MTPBlock(16, 32), torch.randn(50, 16)
    h = torch.randn(2, 5, 16)
    torch.testing.assert_close(blk(h, lambda z: z @ emb.T), blk(h) @ emb.T)


def test_mtp_heads_use_the_configured_norm_eps():
    mtp = MultiTokenPrediction(load_config("hymo_tiny", norm_eps=1e-3).model)
    assert all(n.eps == 1e-3 for blk in mtp.heads for n in (blk.norm, blk.out_norm))


def test_default_chunk_keeps_one_chunk_of_fp32_logits_near_1gb(monkeypatch):
    "chunk_rows=None: 2**28 // V rows a chunk (V the vocabulary), whatever the hidden width D."
    import hymo.models.mtp as mtp_mod
    seen, real = [], mtp_mod._LinearCrossEntropy
    class Spy(real):
        @staticmethod
        def forward(ctx, h, w, t, chunk, g):  # record the chunk the caller picked, then run the real one
            seen.append(chunk)
            return real.forward(ctx, h, w, t, chunk, g)
    monkeypatch.setattr(mtp_mod, "_LinearCrossEntropy", Spy)
    V, D = 2 ** 12, 8
    linear_cross_entropy(torch.randn(4, D), torch.randn(V, D), torch.randint(0, V, (4,)))
    assert seen == [2 ** 28 // V]


def test_malformed_document_boundaries_and_targets_are_refused(cfg):
    "MTP built masks from cu_seqlens that did not end at T (a boundary lost) or start at 0 (no masking), silently."
    torch.manual_seed(0)
    mtp = MultiTokenPrediction(cfg)
    h, tgt = torch.randn(1, 12, cfg.dim), torch.arange(100, 112)[None]
    for cu in ([0, 3, 6], [3, 12], [0, 6, 3, 12]):
        with pytest.raises(ValueError, match="cu_seqlens must be a non-decreasing"):
            mtp(h, tgt, cu_seqlens=torch.tensor(cu))
    assert len(mtp(h, tgt, cu_seqlens=torch.tensor([0, 3, 6, 12]))) == cfg.mtp_depth
    W = torch.randn(50, cfg.dim)
    with pytest.raises(ValueError, match=r"targets must be ids in 0\.\.49, or IGNORE_INDEX=-100.*\[-1\]"):
        linear_cross_entropy(torch.randn(4, cfg.dim), W, torch.tensor([1, 2, 3, -1]))
    with pytest.raises(TypeError, match="targets must be integer token ids"):
        linear_cross_entropy(torch.randn(4, cfg.dim), W, torch.tensor([1., 2., 3., 4.]))
