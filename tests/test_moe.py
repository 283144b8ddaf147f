"""DeepSeekMoE: dispatch paths equal a dense reference, the bias steers selection only, capacity drops
exactly the over-capacity assignments, the balancing rules move the right way, resume is exact."""
import copy
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hymo.config import load_config
from hymo.models.moe import DeepSeekMoE, experts_grouped, experts_loop, sort_assignments


def make(seed=0, **overrides):
    torch.manual_seed(seed)
    return DeepSeekMoE(load_config("hymo_tiny", **overrides).model)


def dense_reference(moe, x):
    "Every routed expert on every token, masked by a dense [N, E] weight matrix built from first principles."
    B, T, d = x.shape
    xf = x.reshape(B * T, d)
    logits = xf.double() @ moe.gate.weight.double().T
    s = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()  # (N, E)
    idx = (s + moe.gate_bias.double()).topk(moe.top_k).indices
    w = s.gather(1, idx)
    if moe.score_func == "sigmoid": w = w / w.sum(-1, keepdim=True)
    W = moe.route_scale * torch.zeros_like(s).scatter(1, idx, w)  # (N, E), times the routed scaling factor
    cf = moe.capacity_factor if moe.training else None  # capacity applies in training only
    C = None if cf is None else math.ceil(cf * B * T * moe.top_k / moe.n_routed)  # slots per expert, from the formula
    if C is not None:  # per expert keep the C highest scores, ties to the earlier token
        for e in range(moe.n_routed):
            rows = [n for n in range(B * T) if e in idx[n].tolist()]
            rows.sort(key=lambda n: (-s[n, e].item(), n))
            for n in rows[C:]: W[n, e] = 0
    Y = torch.stack([F.linear(F.silu(F.linear(xf, moe.w1[e])) * F.linear(xf, moe.w3[e]), moe.w2[e])
                     for e in range(moe.n_routed)], 1)  # (N, E, d)
    sh = moe.shared  # the shared expert, SwiGLU written out (none with moe_n_shared=0)
    y = (W.unsqueeze(-1).to(Y.dtype) * Y).sum(1) + (sh.w2(F.silu(sh.w1(xf)) * sh.w3(xf)) if sh is not None else 0)
    return y.view(B, T, d)


def grouped_available():
    xs, c = torch.randn(3, 8), torch.tensor([1, 2])
    w = torch.randn(2, 8, 8)
    try: experts_grouped(xs, c, w, w, w)
    except (RuntimeError, NotImplementedError, AttributeError): return False
    return True


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@torch.no_grad()
def test_an_fp64_moe_is_computed_in_fp64(score_func):
    "fp64 in, fp64 throughout: the router and the weighted sum were taken in fp32 (4e-10 off the fp64 reference)."
    moe = make(moe_score_func=score_func, moe_capacity_factor=1.5).double().train()
    moe.gate.weight.normal_(0, 0.1)
    x = torch.randn(2, 24, moe.dim, dtype=torch.float64)
    y = moe(x)
    assert y.dtype == torch.float64 and (y - dense_reference(moe, x)).abs().max() < 1e-14


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("cf", [None, 1.5, 0.6])
def test_dispatch_matches_dense_reference(score_func, cf):
    moe = make(moe_score_func=score_func, moe_capacity_factor=cf).train()  # train: capacity applies
    with torch.no_grad(): moe.gate.weight.normal_(0, 0.1)  # decisive routing: no near-ties vs the fp64 reference
    moe.gate_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.01]))
    x = torch.randn(2, 24, moe.dim)
    ref = dense_reference(moe, x)
    impls = ["loop"] + (["grouped"] if grouped_available() else [])
    params = [moe.w1, moe.w2, moe.w3, moe.gate.weight, *moe.shared.parameters()]
    g = torch.randn_like(ref)
    def grads(f):  # of x and every parameter, for the same upstream gradient
        xg = x.clone().requires_grad_()
        return torch.autograd.grad((f(xg) * g).sum(), [xg, *params])
    ref_grads = grads(lambda xg: dense_reference(moe, xg))
    for impl in impls:
        moe.impl = impl
        torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-4, msg=impl)
        for a, b in zip(grads(moe), ref_grads): torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=impl)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@torch.no_grad()
def test_decoding_path_matches_the_dense_reference(score_func):
    "A few tokens in eval (N·k <= E) take the gathered path, with its own weights: they must be route's, sigmoid's renormalised."
    moe = make(moe_score_func=score_func).eval()
    moe.gate.weight.normal_(0, 0.1)
    moe.gate_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.01]))
    x = torch.randn(1, 2, moe.dim)  # 2 tokens · top_k 2 = 4 assignments <= 4 experts
    assert moe.impl == "auto" and x.shape[1] * moe.top_k <= moe.n_routed
    torch.testing.assert_close(moe(x), dense_reference(moe, x), atol=1e-5, rtol=1e-4)


def test_loop_and_grouped_kernels_agree_with_empty_experts():
    if not grouped_available(): pytest.skip("this torch has no CPU torch._grouped_mm")
    w1, w3 = torch.randn(2, 5, 24, 16)
    w2 = torch.randn(5, 16, 24)
    counts = torch.tensor([3, 0, 7, 0, 1])
    xs = torch.randn(11, 16, requires_grad=True)
    g = torch.randn(11, 16)
    grads = []
    for f in (experts_loop, experts_grouped):
        ws = [w.clone().requires_grad_() for w in (w1, w2, w3)]
        xs.grad = None
        y = f(xs, counts, *ws)
        y.backward(g)
        grads.append((y.detach(), xs.grad.clone(), *[w.grad for w in ws]))
    for a, b in zip(*grads): torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_sigmoid_weights_stay_finite_when_every_chosen_score_underflows():
    """sigmoid(-200) is 0 in fp32: the renormalised weights are 0 (no routed expert's output), not 0/0 = NaN. Scores near
    1.5e-8 (logits near -18) still sum to the routed scale: the epsilon against 0/0 is not large beside them (1e-6 gave 0.03)."""
    moe = make(moe_score_func="sigmoid")
    moe.gate.weight.fill_(-1.0)
    for logit in (200, 18):  # every logit -200, then -18
        _, w, score = moe.route(x := torch.full((3, moe.dim), logit / moe.dim))
        if logit == 200: assert (score == 0).all() and (w == 0).all() and torch.isfinite(moe(x[None])).all()
        else:
            assert (score > 0).all() and score.max() < 1e-7
            torch.testing.assert_close(w.sum(-1), torch.full((3,), float(moe.route_scale)), rtol=1e-5, atol=0)


def test_a_forward_inside_stats_paused_counts_nothing():
    "Activation checkpointing's second forward runs inside `stats_paused`: it must add no assignments and no drops."
    from hymo.models.moe import stats_paused
    moe = make(moe_capacity_factor=0.5).train()
    x = torch.randn(2, 16, moe.dim)
    with stats_paused([moe]): moe(x)
    assert moe.expert_counts.sum() == 0 and moe.dropped_tokens == 0 and moe.record_stats
    moe(x)  # outside: counted (with drops, at this capacity)
    assert moe.expert_counts.sum() == 2 * 16 * moe.top_k and moe.dropped_tokens > 0


def test_bias_changes_selection_not_weights():
    moe = make(moe_score_func="sigmoid")
    x = torch.randn(64, moe.dim)
    idx0, w0, _ = moe.route(x)
    moe.gate_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))  # expert 0 now always selected
    idx1, w1, score1 = moe.route(x)
    assert (idx1 == 0).any(-1).all() and not torch.equal(idx0, idx1)
    s = moe.gate_forward(x)
    torch.testing.assert_close(score1, s.gather(1, idx1))  # unbiased scores
    torch.testing.assert_close(w1, score1 / score1.sum(-1, keepdim=True))
    moe.gate_bias.fill_(0.3)  # a uniform shift changes nothing
    idx2, w2, _ = moe.route(x)
    assert torch.equal(idx2, idx0) and torch.equal(w2, w0)


def test_gate_scores_are_fp32_under_bf16_input():
    "Under bf16 autocast too (as the model trains): the router's product runs in fp32, on the fp32 weight."
    moe = make()
    x = torch.randn(8, moe.dim).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16): s = moe.gate_forward(x)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, (x.float() @ moe.gate.weight.T).softmax(-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s.sum(-1), torch.ones(8))


def test_capacity_is_the_exact_ceiling():
    "C = ceil(c·N·k/E) in exact arithmetic: 1.1·400·2/8 is 110 (in floats 110.00000000000001, whose ceiling is 111)."
    from fractions import Fraction
    for cf in (1.0, 1.1, 1.25, 1.5, 2.0, 1.3, 1.05, 0.33, 1.125):  # 1.05, 0.33: denominators of 20 and 100
        moe = make(moe_capacity_factor=cf)
        for n in (1, 7, 64, 400, 4096, 16384):
            want = -(-Fraction(str(cf)) * n * moe.top_k // moe.n_routed)
            assert moe.capacity(n) == want, (cf, n, moe.capacity(n), want)


def test_capacity_drops_lowest_scores_and_counts_them():
    moe = make(moe_capacity_factor=1.0).train()
    with torch.no_grad(): moe.gate.weight[0] += 0.5 * torch.randn(moe.dim)  # skew
    x = torch.randn(1, 64, moe.dim)
    xf = x.view(64, -1)
    idx, _, score = moe.route(xf)
    C = moe.capacity(64)
    assert C == 64 * moe.top_k // moe.n_routed
    counts = torch.bincount(idx.flatten(), minlength=moe.n_routed)
    assert counts.max() > C, "the test needs an over-full expert"
    moe.expert_counts.zero_(); moe.dropped_tokens.zero_()
    moe(x)
    expected = int((counts - C).clamp_min(0).sum())
    assert int(moe.dropped_tokens) == expected
    assert moe.expert_counts.tolist() == counts.tolist()
    _, _, keep = sort_assignments(idx, score, moe.n_routed, C)
    for e in range(moe.n_routed):  # the kept ones of an over-full expert outscore every dropped one
        mine = idx == e
        if counts[e] > C: assert score[mine & keep].min() >= score[mine & ~keep].max()
        else: assert keep[mine].all()
    m = moe.update_gate_bias()
    torch.testing.assert_close(m["moe_drop_frac"], torch.tensor(expected / (64 * moe.top_k)))
    assert int(moe.dropped_tokens) == 0 and int(moe.expert_counts.sum()) == 0


def test_eval_is_dropless_so_inference_is_causal():
    moe = make(moe_capacity_factor=0.5)
    with torch.no_grad(): moe.gate.weight[0] += 0.5 * torch.randn(moe.dim)  # skew: drops in training
    x = torch.randn(1, 48, moe.dim)
    dropless = copy.deepcopy(moe); dropless.capacity_factor = None
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x), dropless.eval()(x))
        assert not torch.allclose(moe.train()(x), dropless.train()(x))
        moe.eval()
        x2 = x.clone(); x2[0, 40:] = torch.randn(8, moe.dim)  # the future changes; the past must not
        torch.testing.assert_close(moe(x2)[0, :40], moe(x)[0, :40])


def test_eval_does_not_accumulate():
    moe = make().eval()
    moe(torch.randn(1, 16, moe.dim))
    assert int(moe.expert_counts.sum()) == 0


def test_training_counts_and_caps_even_a_single_token():
    "A training batch as small as decoding's (N·k <= E) still counts its assignments and applies the capacity."
    import hymo.models.moe as moe_mod
    moe = make().train()
    assert moe.top_k <= moe.n_routed and moe.capacity(1) == 1
    moe(torch.randn(1, 1, moe.dim))
    assert int(moe.expert_counts.sum()) == moe.top_k  # one token, top_k assignments counted for the bias update
    moe2 = make(moe_capacity_factor=0.01).train()  # C = ceil(0.01 · 2 · k / E) = 1: of two tokens on one expert, one is dropped
    x = torch.randn(1, 1, moe2.dim).expand(1, 2, moe2.dim).contiguous()  # the same token twice: the same experts
    moe2(x)
    assert int(moe2.dropped_tokens) == moe2.top_k, "training must apply the capacity, whatever the batch size"


def test_ema_rule_direction_and_dead_band():
    moe = make(moe_balance="ema")
    moe.ema_counts.copy_(torch.tensor([150.0, 104.0, 50.0, 96.0]))  # mean 100: ±5 % band is [95, 105]
    moe.expert_counts.copy_(torch.tensor([150, 104, 50, 96]))
    for _ in range(3):
        moe.expert_counts.copy_(torch.tensor([150, 104, 50, 96]))
        moe.update_gate_bias()
    torch.testing.assert_close(moe.gate_bias, torch.tensor([-3.0, 0.0, 3.0, 0.0]) * moe.bias_speed)
    # the EMA follows the counts with decay 0.98
    moe.expert_counts.copy_(torch.tensor([200, 104, 50, 96]))
    moe.update_gate_bias()
    torch.testing.assert_close(moe.ema_counts[0], torch.tensor(0.98 * 150 + 0.02 * 200))


def test_sign_rule_direction():
    moe = make(moe_balance="sign")
    moe.expert_counts.copy_(torch.tensor([10, 30, 20, 20]))  # mean 20
    moe.update_gate_bias()
    torch.testing.assert_close(moe.gate_bias, torch.tensor([1.0, -1.0, 0.0, 0.0]) * moe.bias_speed)
    assert torch.equal(moe.ema_counts, torch.zeros(4))


def test_none_rule_keeps_bias():
    moe = make(moe_balance="none")
    moe.expert_counts.copy_(torch.tensor([100, 0, 0, 0]))
    m = moe.update_gate_bias()
    assert torch.equal(moe.gate_bias, torch.zeros(4)) and float(m["moe_load_max_mean"]) == 4.0


@pytest.mark.parametrize("balance", ["sign", "ema"])
def test_bias_rule_rebalances_a_skewed_router(balance):
    def run(balance):
        moe = make(moe_balance=balance, moe_capacity_factor=None, moe_bias_speed=0.005)
        g = torch.Generator().manual_seed(0)
        mu = torch.randn(moe.dim, generator=g)
        mu = 2 * mu / mu.norm()
        with torch.no_grad(): moe.gate.weight.normal_(0, 0.05, generator=g); moe.gate.weight[0] += 0.3 * mu
        loads = []
        for _ in range(150):
            x = torch.randn(512, moe.dim, generator=g) + mu
            idx, _, score = moe.route(x)
            moe.expert_counts += sort_assignments(idx, score, moe.n_routed, None)[1]
            loads.append(float(moe.update_gate_bias()["moe_load_max_mean"]))
        return sum(loads[-20:]) / 20
    assert run("none") > 1.6 and run(balance) < 1.2


def train_steps(moe, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(steps):
        for _ in range(2):  # two micro-batches per optimiser step
            loss = moe(torch.randn(2, 16, moe.dim, generator=g)).pow(2).mean()
            loss.backward()
        opt.step(); opt.zero_grad()
        moe.update_gate_bias()
        outs.append(loss.detach())
    return torch.stack(outs)


def test_resume_is_bit_identical():
    moe = make(moe_balance="ema", moe_bias_speed=0.05)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    train_steps(moe, opt, 3, seed=1)
    assert moe.gate_bias.abs().sum() > 0 and moe.ema_counts.sum() > 0
    sd, osd = copy.deepcopy(moe.state_dict()), copy.deepcopy(opt.state_dict())
    assert {"gate_bias", "ema_counts"} <= set(sd)
    a = train_steps(moe, opt, 3, seed=2)
    resumed = make(seed=123, moe_balance="ema", moe_bias_speed=0.05)
    resumed.load_state_dict(sd)
    ropt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ropt.load_state_dict(osd)
    b = train_steps(resumed, ropt, 3, seed=2)
    assert torch.equal(a, b)
    for (n, p), q in zip(moe.state_dict().items(), resumed.state_dict().values()): assert torch.equal(p, q), n


def test_gradients_reach_the_gate():
    moe = make()
    x = torch.randn(2, 16, moe.dim)
    moe(x).pow(2).mean().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    g = moe.gate.weight.grad.clone()
    moe.zero_grad()
    with torch.no_grad(): moe.gate_bias.fill_(0.7)  # a uniform shift of the bias: the same choices, the same gradient
    moe(x).pow(2).mean().backward()
    assert torch.equal(moe.gate.weight.grad, g)


def test_meta_build_and_reset():
    cfg = load_config("hymo_tiny").model
    with torch.device("meta"): moe = DeepSeekMoE(cfg)
    moe = moe.to_empty(device="cpu")
    moe.gate_bias.fill_(float("nan")); moe.expert_counts.fill_(7)
    torch.manual_seed(0); moe.reset_parameters()
    assert torch.equal(moe.gate_bias, torch.zeros(cfg.moe_n_routed)) and int(moe.expert_counts.sum()) == 0
    assert abs(moe.gate.weight.std().item() - 0.006) < 0.001
    assert abs(moe.w1.std().item() - cfg.init_std) < 0.002
    assert all(torch.isfinite(p).all() for p in moe.parameters())


def test_bf16_cast_module_refuses_bias_update():
    moe = make().bfloat16()
    with pytest.raises(TypeError, match="fp32"): moe.update_gate_bias()


@pytest.mark.parametrize("balance", ["sign", "ema"])
def test_activation_checkpointing_counts_twice_but_steers_the_same(balance):
    """The recompute of a checkpointed MoE routes the tokens again and adds its counts a second time (chapter 70).
    Every use of the counts is a ratio, so the bias and the logged metrics equal the plain run's; only the EMA doubles."""
    from torch.utils.checkpoint import checkpoint
    def run(ac):
        moe = make(moe_balance=balance, moe_bias_speed=0.01)
        g = torch.Generator().manual_seed(1)
        logs = []
        for _ in range(4):
            x = torch.randn(2, 32, moe.dim, generator=g) + 0.5  # a shared offset skews the router
            y = checkpoint(moe, x, use_reentrant=False) if ac else moe(x)
            y.pow(2).mean().backward()
            counts = moe.expert_counts.clone()
            logs.append({k: float(v) for k, v in moe.update_gate_bias().items()})
        return moe, counts, logs
    plain, ckpt = run(False), run(True)
    assert torch.equal(ckpt[1], 2 * plain[1])  # the recompute counted the micro-batch again
    assert torch.equal(ckpt[0].gate_bias, plain[0].gate_bias) and plain[0].gate_bias.abs().sum() > 0
    assert ckpt[2] == plain[2]
    torch.testing.assert_close(ckpt[0].ema_counts, 2 * plain[0].ema_counts)


def test_drops_are_counted_per_assignment_not_per_token():
    "Every token picks experts 0 and 1 and most lose both: the count is of (token, expert) pairs dropped."
    moe = make(moe_capacity_factor=0.5).train()
    mu = F.normalize(torch.randn(moe.dim), dim=0)
    with torch.no_grad(): moe.gate.weight.zero_(); moe.gate.weight[0] += 5 * mu; moe.gate.weight[1] += 4 * mu
    x = torch.randn(1, 64, moe.dim) * 0.1 + mu
    idx, _, _ = moe.route(x.view(64, -1))
    assert set(idx.flatten().tolist()) == {0, 1}
    C = moe.capacity(64)  # each of experts 0 and 1 keeps C of its 64 assignments
    moe(x)
    assert int(moe.dropped_tokens) == 2 * (64 - C)
    torch.testing.assert_close(moe.update_gate_bias()["moe_drop_frac"], torch.tensor(2 * (64 - C) / 128))


@torch.no_grad()
def test_decoding_takes_the_gathered_path_up_to_one_assignment_per_expert(monkeypatch):
    "At N·k == E (the boundary) eval runs the gathered path (the one a CUDA graph records), and equals the reference."
    import hymo.models.moe as moe_mod
    moe, calls, real = make().eval(), [], moe_mod.experts_gathered
    monkeypatch.setattr(moe_mod, "experts_gathered", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, moe.n_routed // moe.top_k, moe.dim)
    torch.testing.assert_close(moe(x), dense_reference(moe, x), atol=1e-5, rtol=1e-4)
    assert calls == [1]


def test_ema_rule_steers_by_the_average_not_this_steps_counts():
    "The EMA says expert 0 is over-loaded and 2 under-loaded; this step's counts say the opposite: the EMA decides."
    moe = make(moe_balance="ema")
    moe.ema_counts.copy_(torch.tensor([150.0, 100.0, 50.0, 100.0]))
    moe.expert_counts.copy_(torch.tensor([50, 100, 150, 100]))
    moe.update_gate_bias()  # EMA: [148, 100, 52, 100], mean 100
    torch.testing.assert_close(moe.gate_bias, torch.tensor([-1.0, 0.0, 1.0, 0.0]) * moe.bias_speed)


def test_ema_rule_leaves_a_load_exactly_at_the_band_edge():
    "A load exactly at (1 ± band) × mean is inside the band (decay 0: the EMA is this step's counts)."
    moe = make(moe_balance="ema", moe_ema_decay=0.0, moe_dead_band=0.25)  # edges 75 and 125, exact in floats
    moe.expert_counts.copy_(torch.tensor([75, 125, 100, 100]))
    moe.update_gate_bias()
    assert torch.equal(moe.gate_bias, torch.zeros(4))


@pytest.mark.parametrize("shape", [(8, 0), (2, 3, 5, 0), (2, 3, 7)])  # 0: the model width
def test_forward_refuses_what_is_not_b_t_d(shape):
    moe = make()
    with pytest.raises(ValueError, match=r"DeepSeekMoE expects \[B, T"):
        moe(torch.randn(*(moe.dim if s == 0 else s for s in shape)))


def test_capacity_ties_go_to_the_earlier_token():
    "Identical scores: an over-full expert keeps its first C tokens (a stable sort), as chapter 30 says."
    N, E, k, C = 64, 4, 2, 20  # CPU argsort is unstable from 64 elements on
    idx, score = torch.tensor([[0, 1]]).repeat(N, 1), torch.full((N, k), 0.3)
    _, counts, keep = sort_assignments(idx, score, E, C)
    assert counts.tolist() == [N, N, 0, 0]
    assert torch.equal(keep, torch.arange(N)[:, None].expand(N, k) < C)


def test_an_unknown_impl_is_refused():
    moe = make()
    with pytest.raises(ValueError, match="impl"):
        moe.impl = "gruoped"
    assert moe.impl == "auto" and moe(torch.randn(1, 4, moe.dim)).shape == (1, 4, moe.dim)


def test_capacity_reads_a_factor_with_a_fine_denominator_exactly():
    "1.001 · 1000 · 2 / 4 = 500.5: the ceiling is 501 (a factor rounded to a coarse fraction, 1, would give 500)."
    assert make(moe_capacity_factor=1.001).capacity(1000) == 501


@pytest.mark.parametrize("cf, n, want", [(1.0000001, 400, 101), (1.5000001, 4096, 1537), (1e-7, 400, 1)])
def test_capacity_reads_a_factor_of_seven_decimals_as_written(cf, n, want):
    "1.0000001 · 400 · 2 / 8 is just over 100: 101 (the factor read as a fraction of denominator <= 1e6, 1, gave 100)."
    moe = make(moe_capacity_factor=cf, moe_n_routed=8)
    assert (moe.top_k, moe.n_routed) == (2, 8)
    assert moe.capacity(n) == want


@torch.no_grad()
def test_a_chosen_impl_is_kept_when_decoding(monkeypatch):
    "`impl='loop'` (or 'grouped') is the caller's choice: only 'auto' switches to the gathered path for one token."
    import hymo.models.moe as moe_mod
    moe = make().eval()
    moe.impl = "loop"
    monkeypatch.setattr(moe_mod, "experts_gathered", lambda *a: pytest.fail("the gathered path ran with impl='loop'"))
    x = torch.randn(1, 1, moe.dim)
    torch.testing.assert_close(moe(x), dense_reference(moe, x), atol=1e-5, rtol=1e-4)


def test_stats_paused_restores_what_was_there_even_after_an_error():
    from hymo.models.moe import stats_paused
    a, b = make(), make()
    b.record_stats = False  # a caller's own pause
    with stats_paused([a, b]):
        with stats_paused([a, b]): assert not a.record_stats and not b.record_stats
        assert not a.record_stats  # the inner pause gives back the outer one's state, not True
    assert a.record_stats and not b.record_stats
    with pytest.raises(RuntimeError, match="boom"):
        with stats_paused([a]): raise RuntimeError("boom")
    assert a.record_stats  # counting resumes: the bias would stop steering otherwise


def test_top_k_may_equal_the_number_of_experts():
    moe = make(moe_top_k=4, moe_n_routed=4).train()
    x = torch.randn(2, 8, moe.dim)
    assert moe(x).shape == x.shape and int(moe.expert_counts.sum()) == 2 * 8 * 4


def test_balancing_metrics_of_a_step_without_tokens_are_zero_not_nan():
    metrics = make().update_gate_bias()
    assert all(float(v) == 0.0 for v in metrics.values()), metrics


def test_eval_past_one_assignment_per_expert_takes_the_sorted_path(monkeypatch):
    "Past N·k == E an eval forward sorts (the gathered path copies k expert matrices per token: [N, k, h, d] of weights)."
    import hymo.models.moe as moe_mod
    moe = make().eval()
    monkeypatch.setattr(moe_mod, "experts_gathered", lambda *a: pytest.fail("gathered path ran for N·k > E"))
    x = torch.randn(1, moe.n_routed // moe.top_k + 1, moe.dim)  # one token past the boundary
    assert moe(x).shape == x.shape


@pytest.mark.parametrize("score_func,scale,n_shared", [("sigmoid", 2.5, 1), ("softmax", 16.0, 0), ("sigmoid", 1.0, 0)])
def test_routed_scaling_and_no_shared_expert_match_the_dense_reference(score_func, scale, n_shared):
    "γ_r (moe_route_scale) multiplies the routed experts' weights, as DeepSeek-V3's 2.5; moe_n_shared=0 leaves the routed part alone."
    moe = make(moe_score_func=score_func, moe_route_scale=scale, moe_n_shared=n_shared, moe_capacity_factor=None)
    assert (moe.shared is None) == (n_shared == 0)
    with torch.no_grad(): moe.gate.weight.normal_(0, 0.1)
    x = torch.randn(2, 12, moe.dim)
    for mode in (moe.train, moe.eval):
        mode()
        torch.testing.assert_close(moe(x), dense_reference(moe, x), rtol=1e-4, atol=1e-5)
    idx, weight, _ = moe.route(x.reshape(-1, moe.dim))
    if score_func == "sigmoid": torch.testing.assert_close(weight.sum(-1), torch.full((24,), scale, dtype=weight.dtype))  # normalised, then scaled


def test_a_hand_made_config_or_setting_is_checked_by_the_module():
    "Built from a config load_config never saw (dataclasses.replace), a typo turned balancing off or left sigmoid scores unnormalised."
    import dataclasses
    c = load_config("hymo_tiny").model
    for bad, says in ((dict(moe_score_func="sigmoi"), "model.moe_score_func"), (dict(moe_balance="EMA"), "model.moe_balance"),
                      (dict(moe_route_scale=0.0), "model.moe_route_scale=0.0 must be positive"),
                      (dict(moe_capacity_factor=0.0), "model.moe_capacity_factor")):
        with pytest.raises(ValueError, match=says): DeepSeekMoE(dataclasses.replace(c, **bad))
    moe = DeepSeekMoE(c)
    for bad in (0, -1.5, True, float("inf"), "1.5"):  # 0 dropped every assignment without a word
        with pytest.raises(ValueError, match="capacity_factor=.*give a positive number, or None"): moe.capacity_factor = bad
    moe.capacity_factor = None; moe.capacity_factor = 2
    assert moe.capacity(8) == math.ceil(2 * 8 * moe.top_k / moe.n_routed)
    import numpy as np
    moe.capacity_factor = np.float32(1.25)  # as the config accepts numpy's numbers
    assert moe.capacity(8) == 5


def test_a_module_alone_is_checked_on_its_own_keys_only():
    "A config that builds one MoE or MTP module but no model (2 layers, no MLA block; a Triton chunk of 32) is fine for the module."
    from hymo.config import ModelConfig
    from hymo.models.mtp import MultiTokenPrediction
    alone = ModelConfig(dim=32, n_layers=2, moe_n_routed=4, moe_top_k=2, moe_inter_dim=16, mtp_inter_dim=8,
                        gdn_kernel="triton", gdn_chunk_size=32)
    assert DeepSeekMoE(alone).n_routed == 4 and len(MultiTokenPrediction(alone).heads) == alone.mtp_depth
    import dataclasses
    with pytest.raises(ValueError, match="model.moe_top_k=5 > model.moe_n_routed=4"): DeepSeekMoE(dataclasses.replace(alone, moe_top_k=5))


BIAS_SYNC_SCRIPT = r"""
import json, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from hymo.config import load_config
from hymo.models.moe import DeepSeekMoE

def worker(rank, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for balance in ("ema", "sign"):
        moe = DeepSeekMoE(load_config("hymo_tiny", moe_balance=balance).model)
        moe.expert_counts.copy_(torch.tensor([[9, 0, 3, 4], [0, 9, 3, 4]][rank]))  # alone, each rank sees another expert overloaded
        moe.dropped_tokens.fill_(rank + 1)
        stats = moe.update_gate_bias()
        res[balance] = dict(bias=moe.gate_bias.tolist(), ema=moe.ema_counts.tolist(), **{k: float(v) for k, v in stats.items()})
    with open(f"{out}.{rank}", "w") as f: json.dump(res, f)
    dist.barrier()
    os._exit(0)  # no teardown (as in test_optim's FSDP script)

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(port, sys.argv[1]), nprocs=2)
"""


def test_every_rank_updates_the_bias_from_the_counts_of_all_ranks(tmp_path):
    "Two gloo ranks, each with its own counts: both end with the bias one process gets from the summed counts."
    import json, os, subprocess, sys
    script, out = tmp_path / "bias_sync.py", tmp_path / "result"
    script.write_text(BIAS_SYNC_SCRIPT)
    for attempt in range(2):  # a second try only if the free port was taken between choosing and binding it
        r = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        if r.returncode == 0 or "Address already in use" not in r.stderr: break
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{i}").read_text()) for i in (0, 1)]
    for balance in ("ema", "sign"):
        one = make(moe_balance=balance)
        one.expert_counts.copy_(torch.tensor([9, 9, 6, 8])); one.dropped_tokens.fill_(3)  # the two ranks' counts, summed
        stats = one.update_gate_bias()
        want = dict(bias=one.gate_bias.tolist(), ema=one.ema_counts.tolist(), **{k: float(v) for k, v in stats.items()})
        assert any(b != 0 for b in want["bias"])
        for got in ranks: assert got[balance] == want, (balance, got[balance], want)  # the same integer counts: exact


def test_top_k_above_the_number_of_experts_is_refused_at_construction():
    import dataclasses
    c = load_config("hymo_tiny").model
    with pytest.raises(ValueError, match="moe_top_k"):
        DeepSeekMoE(dataclasses.replace(c, moe_top_k=c.moe_n_routed + 1))  # replace skips load_config's checks


def test_shared_experts_are_one_swiglu_of_n_shared_times_the_expert_width():
    moe = make(moe_n_shared=2)
    assert moe.shared.w1.weight.shape == (2 * moe.inter_dim, moe.dim)
    assert moe.shared.w2.weight.shape == (moe.dim, 2 * moe.inter_dim)


def test_a_tiny_capacity_factor_still_gives_each_expert_a_slot():
    "Fraction.limit_denominator rounded factors below 5e-7 to 0: capacity 0, every assignment dropped."
    moe = make(moe_capacity_factor=1e-7)
    assert moe.capacity(4096) == 1  # ceil(1e-7 · 4096 · k / E)
    assert make(moe_capacity_factor=1.1).capacity(400) == -(-11 * 400 * moe.top_k // (10 * moe.n_routed))


def test_capacity_traces_with_dynamic_shapes():
    "capacity() in integers for a traced n_tokens too: the factor's fraction is made where it is set, not traced (str() of a SymFloat)."
    moe = make(moe_capacity_factor=1.1, moe_n_routed=8)
    f = torch.compile(lambda x: x.new_zeros(moe.capacity(x.shape[0])), fullgraph=True, dynamic=True, backend="eager")
    for n in (400, 401, 1000):
        assert f(torch.randn(n)).shape[0] == moe.capacity(n)


def test_a_numpy_float32_factor_is_read_as_the_decimal_it_prints_as():
    "np.float32(1.1) prints as 1.1 (as a float it is 1.100000023841858: 111 slots where 1.1 gives 110); np.float64 too."
    np = pytest.importorskip("numpy")
    moe = make(moe_n_routed=8)
    assert (moe.top_k, moe.n_routed) == (2, 8)
    moe.capacity_factor = np.float32(1.1)
    assert moe.capacity(400) == make(moe_capacity_factor=1.1, moe_n_routed=8).capacity(400) == 110
    moe.capacity_factor = np.float64(1.1)
    assert moe.capacity(400) == 110  # 11/10, not the float's 110.00000000000001


def test_a_fraction_factor_is_kept_exact():
    "A Fraction is kept exact (stored as a float it was 0.3333333333333333: off at a large enough N)."
    moe = make(moe_n_routed=8)
    moe.capacity_factor = Fraction(1, 3)
    n = 3 * 8 * 10**16 + 4  # 1/3 * n * 2 / 8 = 2e16 + 1/3 exactly: ceil 2e16 + 1
    assert moe.capacity(n) == 2 * 10**16 + 1
    assert moe.capacity(24) == 2 and moe.capacity(25) == 3  # 1/3 · 24 · 2 / 8 = 2 exactly; 25 tokens: 2.08
