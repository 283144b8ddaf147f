"""Optimisers: Newton–Schulz, NorMuon against a from-scratch loop, AdamW against PyTorch's, cautious decay,
parameter groups, the WSD schedule, and NorMuon on FSDP-2 shards in two processes."""
import copy
import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import hymo.training.optim as optim
from hymo.config import TrainingConfig, load_config
from hymo.training.optim import (CautiousAdamW, NorMuon, build_optimizers, newton_schulz, param_group, param_table,
                                 weight_decay_term, wsd_lambda, wsd_schedule)


# ---------------------------------------------------------------- Newton–Schulz

@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96 * 3), (3, 80, 24)])
def test_newton_schulz_singular_values_in_band(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    sv = torch.linalg.svdvals(newton_schulz(G).float())
    assert sv.min() > 0.65 and sv.max() < 1.2, (sv.min().item(), sv.max().item())


def test_newton_schulz_keeps_singular_vectors():
    torch.manual_seed(0)
    G = torch.randn(48, 12) @ torch.diag(torch.logspace(0, -1, 12)) @ torch.randn(12, 100) + 0.01 * torch.randn(48, 100)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    D = U.T @ newton_schulz(G).float() @ Vh.T  # diagonal when the singular vectors are kept
    strong = D[:12]  # the 12 well-separated directions (the noise directions are nearly degenerate, so their vectors are not unique)
    off = strong.clone()
    off[range(12), range(12)] = 0.0
    assert off.abs().max() < 0.05
    assert 0.65 < torch.diag(D)[:12].min() and torch.diag(D)[:12].max() < 1.25


def test_newton_schulz_takes_five_steps_by_default():
    G = torch.randn(24, 16)
    assert torch.equal(newton_schulz(G), newton_schulz(G, steps=5)) and not torch.equal(newton_schulz(G), newton_schulz(G, steps=4))


def test_newton_schulz_rejects_vectors():
    with pytest.raises(ValueError, match="needs a matrix"):
        newton_schulz(torch.randn(4))


# ---------------------------------------------------------------- NorMuon

def ns_from_scratch(M, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = M.bfloat16() if M.is_cuda else M.float()  # bf16 on GPU; CPUs run NS in fp32 (see ns_dtype)
    tall = M.shape[0] > M.shape[1]
    if tall: X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if tall else X).float()


def normuon_from_scratch(W, grads, lr, beta=0.95, beta2=0.95, wd=0.1, cautious=True, nesterov=True, ns_steps=5):
    m, n = W.shape
    W, M, v = W.clone(), torch.zeros_like(W), torch.zeros(m, 1)
    for G in grads:
        M = beta * M + (1 - beta) * G
        if not G.any():  # no gradient: no update from the stale momentum; the decay (its mask is all ones for U = 0)
            W = W - lr * wd * W; continue
        N = (1 - beta) * G + beta * M if nesterov else M
        O = ns_from_scratch(N, ns_steps)
        v = beta2 * v + (1 - beta2) * (O * O).mean(dim=1, keepdim=True)
        Oh = O / v.sqrt()
        U = Oh * (O.norm() / Oh.norm()) * math.sqrt(max(1.0, m / n))
        mask = (U * W >= 0).float() if cautious else torch.ones_like(W)
        W = W - lr * (U + wd * mask * W)
    return W


@pytest.mark.parametrize("shape, cautious, nesterov", [((40, 16), True, True), ((16, 40), True, True),
                                                       ((24, 24), False, True), ((30, 10), True, False)])
def test_normuon_equals_from_scratch_loop(shape, cautious, nesterov):
    torch.manual_seed(0)
    W0 = 0.1 * torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(6)]
    grads[3].zero_()  # a step without gradient: the stale momentum must not move the matrix
    p = nn.Parameter(W0.clone())
    opt = NorMuon([p], lr=0.03, momentum=0.95, nesterov=nesterov, beta2=0.95, weight_decay=0.1, cautious=cautious)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.data, normuon_from_scratch(W0, grads, lr=0.03, cautious=cautious, nesterov=nesterov))
    assert opt.state[p]["second_moment"].shape == (shape[0], 1)


def test_normuon_uses_its_own_momentum_beta2_and_ns_steps():
    "The defaults share 0.95 for both betas and 5 steps: other values tell which setting drives which part."
    torch.manual_seed(0)
    W0, grads = 0.1 * torch.randn(24, 16), [torch.randn(24, 16) for _ in range(5)]
    p = nn.Parameter(W0.clone())
    opt = NorMuon([p], lr=0.03, momentum=0.8, beta2=0.99, ns_steps=3, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.data, normuon_from_scratch(W0, grads, lr=0.03, beta=0.8, beta2=0.99, ns_steps=3))


def test_normuon_row_without_gradient_stays_finite():
    "A row that never gets a gradient has v = 0 for ever: its factor must not be 0 · ∞."
    torch.manual_seed(0)
    W0 = torch.randn(8, 16)
    p = nn.Parameter(W0.clone())
    opt = NorMuon([p], lr=0.03, weight_decay=0.1)
    for _ in range(3):
        p.grad = torch.randn(8, 16)
        p.grad[2] = 0
        opt.step()
    assert torch.isfinite(p).all()
    moved = (p.data - W0 * (1 - 0.03 * 0.1) ** 3).abs().amax(-1)  # beyond what the decay alone would do
    assert (moved[torch.arange(8) != 2] > 1e-3).all(), "the rows with a gradient must be updated (the matrix has one)"
    assert opt.state[p]["second_moment"][2].item() == 0 and (opt.state[p]["second_moment"][torch.arange(8) != 2] > 0).all()


def test_normuon_second_moment_is_the_mean_square_of_each_row():
    "After one step v = (1 - beta2) · mean over a row's n columns of O², O the orthogonalised look-ahead."
    torch.manual_seed(0)
    G = torch.randn(12, 20)
    p = nn.Parameter(torch.randn(12, 20))
    opt = NorMuon([p], lr=0.03, momentum=0.9, beta2=0.8, weight_decay=0.0)
    p.grad = G.clone()
    opt.step()
    O = ns_from_scratch((1 - 0.9) * G + 0.9 * (1 - 0.9) * G, 5)  # Nesterov: the gradient, then the momentum after it
    torch.testing.assert_close(opt.state[p]["second_moment"], (1 - 0.8) * (O * O).mean(1, keepdim=True), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_normuon_resumes_from_its_state_dict_exactly(dtype):
    "`Optimizer.load_state_dict` casts state to each parameter's dtype; the second moment must come back in fp32."
    torch.manual_seed(0)
    W0, grads = torch.randn(12, 8).to(dtype), [torch.randn(12, 8).to(dtype) for _ in range(6)]
    def run(ps, opt, gs):
        for g in gs:
            ps[0].grad = g.clone()
            opt.step()
    straight = [nn.Parameter(W0.clone())]
    run(straight, NorMuon(straight, weight_decay=0.1), grads)
    first = [nn.Parameter(W0.clone())]
    o = NorMuon(first, weight_decay=0.1)
    run(first, o, grads[:3])
    sd = copy.deepcopy(o.state_dict())
    resumed = [nn.Parameter(first[0].detach().clone())]
    o2 = NorMuon(resumed, weight_decay=0.1)
    o2.load_state_dict(sd)
    assert o2.state[resumed[0]]["second_moment"].dtype == torch.float32
    run(resumed, o2, grads[3:])
    assert torch.equal(resumed[0], straight[0])


def test_normuon_steps_fp64_parameters_and_leaves_one_without_gradient():
    p, q = nn.Parameter(torch.randn(6, 4, dtype=torch.float64)), nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    opt = NorMuon([p, q], weight_decay=0.0)
    p0, q0 = p.detach().clone(), q.detach().clone()
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    opt.step()
    p1, q1 = p.detach().clone(), q.detach().clone()
    p.grad, q.grad = torch.randn_like(p), torch.zeros_like(q)
    opt.step()
    assert not torch.equal(p1, p0) and not torch.equal(p.detach(), p1) and not torch.equal(q1, q0)
    assert torch.equal(q.detach(), q1)  # no gradient, no decay: unchanged


def test_normuon_stacked_experts_are_separate_matrices():
    torch.manual_seed(0)
    W0, grads = torch.randn(4, 20, 8), [torch.randn(4, 20, 8) for _ in range(4)]
    grads[2][1] = 0; grads[3][1] = 0  # expert 1 gets no token in the last two steps
    stacked = nn.Parameter(W0.clone())
    single = [nn.Parameter(W0[e].clone()) for e in range(4)]
    o1, o2 = NorMuon([stacked], weight_decay=0.1), NorMuon(single, weight_decay=0.1)
    for i, g in enumerate(grads):
        before = stacked.detach().clone()
        stacked.grad = g.clone(); o1.step()
        for e in range(4): single[e].grad = g[e].clone()
        o2.step()
        if i >= 2:  # expert 1 only decays (lr 0.02, weight decay 0.1); the others take a full step
            torch.testing.assert_close(stacked[1].detach(), before[1] * (1 - 0.02 * 0.1))
            assert (stacked[0] - before[0]).norm() > 0.05
    torch.testing.assert_close(stacked.data, torch.stack([s.data for s in single]))


@pytest.mark.parametrize("cautious", [True, False])
def test_normuon_fused_update_equals_eager(cautious, monkeypatch):
    "The compiled final update (a GPU's default for large parameters; inductor's CPU backend here) gives the list-wide path's weights."
    calls = []
    compiled = optim.normuon_apply_fused()
    monkeypatch.setattr(optim, "normuon_apply_fused", lambda: lambda *a: calls.append(1) or compiled(*a))
    torch.manual_seed(0)
    shapes = [(24, 10), (10, 24), (3, 20, 8)]  # tall, wide, stacked experts
    W0 = [0.1 * torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    grads[1][0].zero_()  # a step without gradient for one matrix: no update, the decay (all its signs agree with U = 0)
    runs = []
    for fused in (True, False, None):  # None on a CPU: list-wide, as False
        ps = [nn.Parameter(w.clone()) for w in W0]
        opt = NorMuon(ps, lr=0.03, weight_decay=0.1, cautious=cautious, fused=fused)
        for step, gs in enumerate(grads):
            opt.param_groups[0]["lr"] = 0.03 * (1 - 0.2 * step)  # a schedule: the compiled update takes η as a tensor
            for p, g in zip(ps, gs): p.grad = g.clone()
            opt.step()
        runs.append([p.data for p in ps])
        assert len(calls) == (9 if fused else 0)  # 3 steps x 3 parameters, all through the compiled update
        calls.clear()
    for a, b, c, w in zip(*runs, W0):
        assert not torch.equal(a, w)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert torch.equal(b, c)


@pytest.mark.parametrize("x_dtype, wd", [(torch.float32, 0.1), (torch.bfloat16, 0.0)])
def test_normuon_apply_compiled_takes_bf16_updates(x_dtype, wd):
    "As on a GPU: O in bf16 from Newton–Schulz, the row factor in fp32; bf16 weights too, and no decay."
    torch.manual_seed(0)
    x = (0.1 * torch.randn(2, 12, 40)).to(x_dtype)
    o, f = torch.randn(2, 12, 40).to(torch.bfloat16), torch.rand(2, 12, 1)
    a, b = x.clone(), x.clone()
    optim.normuon_apply(a, o, f, 0.02, wd, True)
    optim.normuon_apply_fused()(b, o, f, torch.tensor(0.02), torch.tensor(wd), True)
    assert not torch.equal(a, x)
    tol = dict(rtol=1e-6, atol=1e-7) if x_dtype == torch.float32 else {}  # bf16 weights: the default bf16 tolerance
    torch.testing.assert_close(b, a, **tol)


def test_normuon_rejects_vectors_and_bad_hyperparameters():
    with pytest.raises(ValueError, match="AdamW"):
        NorMuon([nn.Parameter(torch.ones(5))])
    with pytest.raises(ValueError, match="momentum"):
        NorMuon([nn.Parameter(torch.ones(2, 2))], momentum=1.0)
    w = nn.Parameter(torch.ones(2, 2))
    for group in ({"lr": float("nan")}, {"beta2": 1.0}, {"ns_steps": 0}, {"weight_decay": -0.1}):  # a group's own values too
        with pytest.raises(ValueError, match="NorMuon: need"): NorMuon([{"params": [w], **group}])
    with pytest.raises(ValueError, match="CautiousAdamW: need"): CautiousAdamW([{"params": [w], "lr": float("nan")}])
    with pytest.raises(ValueError, match="CautiousAdamW: need"): CautiousAdamW([w], betas=(0.9, 1.0))
    opt = NorMuon([w])
    with pytest.raises(ValueError, match="AdamW"): opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    assert len(opt.param_groups) == 1  # the refused group is not left behind


# ---------------------------------------------------------------- cautious weight decay

def test_weight_decay_term_masks_disagreeing_signs():
    x = torch.tensor([2.0, 2.0, -2.0, -2.0, 0.0, 1.0])
    u = torch.tensor([1.0, -1.0, -1.0, 1.0, 5.0, 0.0])
    assert torch.equal(weight_decay_term(x, u, cautious=True), torch.tensor([2.0, 0.0, -2.0, 0.0, 0.0, 1.0]))
    assert torch.equal(weight_decay_term(x, u, cautious=False), x)


def test_normuon_decays_exactly_where_update_and_weight_agree():
    torch.manual_seed(0)
    W0, g, lr, wd = torch.randn(12, 20), torch.randn(12, 20), 0.05, 0.2
    a, b = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    a.grad, b.grad = g.clone(), g.clone()
    NorMuon([a], lr=lr, weight_decay=0.0).step()
    NorMuon([b], lr=lr, weight_decay=wd, cautious=True).step()
    u = (W0 - a.data) / lr  # the update without decay
    mask = u * W0 >= 0
    assert 0 < mask.sum() < mask.numel()  # some coordinates are decayed, some are not
    torch.testing.assert_close(a.data - b.data, lr * wd * W0 * mask)


# ---------------------------------------------------------------- AdamW

@pytest.mark.parametrize("grad_scale", [1.0, 1e-8])  # 1e-8: gradients on eps's scale, where eps changes the step
def test_adamw_equals_torch_adamw(grad_scale):
    torch.manual_seed(0)
    shapes = [(8, 5), (7,), (3, 4, 2)]
    x0 = [torch.randn(s) for s in shapes]
    ours, ref = [nn.Parameter(x.clone()) for x in x0], [nn.Parameter(x.clone()) for x in x0]
    o1 = CautiousAdamW([dict(params=ours[:2]), dict(params=ours[2:], weight_decay=0.0)], lr=0.02, betas=(0.9, 0.95),
                       eps=1e-8, weight_decay=0.1, cautious=False)
    o2 = torch.optim.AdamW([dict(params=ref[:2]), dict(params=ref[2:], weight_decay=0.0)], lr=0.02, betas=(0.9, 0.95),
                           eps=1e-8, weight_decay=0.1)
    for _ in range(8):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape) * grad_scale
            p.grad.view(-1)[0] = 0  # and one coordinate without gradient
            q.grad = p.grad.clone()
        o1.step(); o2.step()
    for p, q, x in zip(ours, ref, x0):
        assert (p.data - x).abs().max() > 1e-3  # the steps are large enough to compare
        torch.testing.assert_close(p.data, q.data, rtol=0, atol=1e-7)


def test_adamw_updates_parameters_at_different_steps_like_torch_adamw():
    """Parameters that skip steps (no gradient) reach the foreach update at different step counts, so at
    different bias corrections: each must still match torch.optim.AdamW, which counts steps per parameter."""
    torch.manual_seed(1)
    x0 = [torch.randn(6, 3), torch.randn(5), torch.randn(4)]
    ours, ref = [nn.Parameter(x.clone()) for x in x0], [nn.Parameter(x.clone()) for x in x0]
    o1 = CautiousAdamW(ours, lr=0.02, weight_decay=0.1, cautious=False)
    o2 = torch.optim.AdamW(ref, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(6):
        for i, (p, q) in enumerate(zip(ours, ref)):
            live = not (i == 1 and step < 2) and not (i == 2 and step % 2)  # p1 starts late, p2 skips every other step
            p.grad = torch.randn(p.shape) if live else None
            q.grad = None if p.grad is None else p.grad.clone()
        o1.step(); o2.step()
    assert [o1.state[p]["step"].item() for p in ours] == [6.0, 4.0, 3.0]
    for p, q in zip(ours, ref): torch.testing.assert_close(p.data, q.data, rtol=0, atol=1e-7)


def test_cautious_adamw_equals_formula():
    torch.manual_seed(1)
    x0, grads, lr, wd, (b1, b2), eps = torch.randn(50), [torch.randn(50) for _ in range(6)], 0.05, 0.3, (0.9, 0.95), 1e-8
    p = nn.Parameter(x0.clone())
    opt = CautiousAdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, cautious=True)
    x, m, v, masked = x0.clone(), torch.zeros(50), torch.zeros(50), 0
    for t, g in enumerate(grads, 1):
        p.grad = g.clone(); opt.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        keep = u * x >= 0
        masked += int((~keep).sum())
        x = x - lr * (u + wd * keep * x)
    assert masked > 0
    torch.testing.assert_close(p.data, x)


# ---------------------------------------------------------------- parameter groups

@pytest.mark.parametrize("name, shape, group", [
    ("embed.weight", (100, 16), "adamw"),
    ("head.weight", (100, 16), "adamw"),
    ("layers.0.mixer.A_log", (4,), "adamw_no_decay"),
    ("layers.0.mixer.dt_bias", (4,), "adamw_no_decay"),
    ("layers.0.norm1.weight", (16,), "adamw_no_decay"),
    ("layers.3.attn.kv_a_layernorm.weight", (8,), "adamw_no_decay"),
    ("layers.0.mixer.o_proj.bias", (16,), "adamw_no_decay"),
    ("layers.0.mixer.q_conv1d.weight", (64, 1, 4), "adamw"),
    ("layers.0.mixer.conv1d.weight", (64, 4), "adamw"),
    ("layers.3.ffn.gate.weight", (4, 16), "adamw"),
    ("layers.3.moe.gate.weight", (4, 16), "adamw"),
    ("layers.0.mixer.q_proj.weight", (64, 16), "normuon"),
    ("layers.0.ffn.w1.weight", (48, 16), "normuon"),
    ("layers.3.ffn.w1", (4, 48, 16), "normuon"),
    ("layers.3.moe.experts.w2", (4, 16, 48), "normuon"),
    ("layers.3.ffn.shared.w3.weight", (48, 16), "normuon"),
    ("layers.0.mixer.gate_proj.weight", (64, 16), "normuon"),
    ("mtp.heads.0.proj_in.weight", (32, 16), "normuon"),
    ("embed_tokens.weight", (100, 16), "adamw"),  # any embedding, by the start of its name
    ("layers.0.mixer.A_log", (4, 1), "adamw_no_decay"),  # GDN's decay parameters by name, whatever their shape
    ("layers.0.mixer.dt_bias", (4, 1), "adamw_no_decay"),
])
def test_param_group_rules(name, shape, group):
    assert param_group(name, torch.empty(shape)) == group


def test_param_group_refuses_unknown_shapes():
    with pytest.raises(ValueError, match="no rule"):
        param_group("layers.0.odd", torch.empty(2, 2, 2, 2))


class TinyNamed(nn.Module):
    "Stand-in with HyMo's names: tied head, GDN bits, a dense FFN, a router and stacked experts."
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.layers = nn.ModuleDict({"0": nn.ModuleDict({"mixer": nn.ModuleDict({"q_proj": nn.Linear(8, 8, bias=False),
                                                                                  "conv1d": nn.Conv1d(8, 8, 4, groups=8, bias=False)}),
                                                         "norm1": nn.LayerNorm(8)})})
        self.layers["0"].mixer.A_log = nn.Parameter(torch.zeros(2))
        self.gate = nn.Linear(8, 3, bias=False)
        self.w1 = nn.Parameter(torch.randn(3, 12, 8))
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)


def test_build_optimizers_groups_and_hyperparameters():
    cfg = load_config("hymo_tiny", muon_lr=0.03, adamw_lr=1e-3, weight_decay=0.05, cautious_weight_decay=False).train
    model = TinyNamed()
    normuon, adamw = build_optimizers(model, cfg)
    ids = lambda ps: {id(p) for p in ps}
    assert ids(normuon.param_groups[0]["params"]) == ids([model.layers["0"].mixer.q_proj.weight, model.w1])
    decay, no_decay = adamw.param_groups
    assert (decay["name"], no_decay["name"]) == ("decay", "no_decay")
    assert ids(decay["params"]) == ids([model.embed.weight, model.layers["0"].mixer.conv1d.weight, model.gate.weight])
    assert ids(no_decay["params"]) == ids([model.layers["0"].norm1.weight, model.layers["0"].norm1.bias, model.layers["0"].mixer.A_log])
    assert (normuon.defaults["lr"], normuon.defaults["momentum"], normuon.defaults["beta2"], normuon.defaults["ns_steps"]) == \
           (0.03, cfg.muon_momentum, cfg.normuon_beta2, cfg.ns_steps)
    assert (decay["lr"], decay["weight_decay"], no_decay["weight_decay"], decay["betas"]) == (1e-3, 0.05, 0.0, tuple(cfg.adamw_betas))
    assert normuon.defaults["cautious"] is False and adamw.defaults["cautious"] is False
    assert id(model.frozen) not in ids(normuon.param_groups[0]["params"]) | ids(decay["params"]) | ids(no_decay["params"])


def test_real_hymo_parameters_are_all_grouped():
    build_hymo = pytest.importorskip("hymo.models.model").build_hymo
    with torch.device("meta"):
        model = build_hymo(load_config("hymo_tiny").model)
    table = param_table(model)
    assert {g for _, _, g in table} == {"normuon", "adamw", "adamw_no_decay"}
    for name, shape, group in table:
        if len(shape) == 1: assert group == "adamw_no_decay", name
        if len(shape) == 3 and "conv" not in name: assert group == "normuon", name
        if name.startswith("embed") or "conv" in name or name.endswith("gate.weight"): assert group == "adamw", name
        if name.endswith(("q_proj.weight", "o_proj.weight", "w1.weight", "w2.weight", "w3.weight")): assert group == "normuon", name


def test_stacked_experts_are_out_by_in_so_normuon_rows_are_neurons():
    "NorMuon's rows (its v) and its shape factor read a matrix as [fan-out, fan-in]: each expert's matrix must be so."
    build_hymo = pytest.importorskip("hymo.models.model").build_hymo
    cfg = load_config("hymo_tiny").model
    with torch.device("meta"):
        model = build_hymo(cfg)
    table = {name: (shape, group) for name, shape, group in param_table(model)}
    E, h, d = cfg.moe_n_routed, cfg.moe_inter_dim, cfg.dim
    stacked = sorted(n for n, (s, _) in table.items() if len(s) == 3 and "conv" not in n)
    assert stacked and h != d
    for name in stacked:
        want = (E, d, h) if name.endswith("w2") else (E, h, d)  # w1, w3: d -> h; w2: h -> d
        assert table[name] == (want, "normuon"), name
    assert not any("gate_bias" in n for n in table)  # a buffer the balance rule moves, not a gradient


# ---------------------------------------------------------------- WSD

def test_wsd_values_by_hand():
    c = load_config("hymo_tiny", max_steps=1000, warmup_steps=100, decay_fraction=0.199, min_lr_ratio=0.0).train
    # W = 100, D = 199, decay starts at S = 801; p = (t - S + 1) / (D + 1) = (t - 800) / 200
    assert wsd_schedule(0, c) == pytest.approx(0.01)
    assert wsd_schedule(49, c) == pytest.approx(0.5)
    assert wsd_schedule(99, c) == pytest.approx(1.0)
    assert wsd_schedule(500, c) == 1.0 and wsd_schedule(800, c) == 1.0
    for shape, want in [("linear", 1 - 0.25), ("1-sqrt", 1 - 0.5), ("cosine", 0.5 * (1 + math.cos(math.pi / 4)))]:
        assert wsd_schedule(850, dataclasses.replace(c, decay_shape=shape)) == pytest.approx(want)  # p = 50/200
    assert wsd_schedule(801, c) < 1.0 and wsd_schedule(999, c) > 0.0  # every decay step decays, none trains at r = 0
    c2 = dataclasses.replace(c, decay_shape="linear", min_lr_ratio=0.1)
    assert wsd_schedule(900, c2) == pytest.approx(0.1 + 0.9 * 0.5)
    assert wsd_schedule(1000, c2) == pytest.approx(0.1) and wsd_schedule(5000, c2) == pytest.approx(0.1)
    assert wsd_schedule(999, dataclasses.replace(c, decay_fraction=0.0)) == 1.0
    tiny = dataclasses.replace(c, max_steps=4, warmup_steps=1, decay_fraction=0.2, decay_shape="linear")  # D = 1
    assert [wsd_schedule(t, tiny) for t in range(5)] == [1.0, 1.0, 1.0, 0.5, 0.0]  # the one decay step decays


def test_wsd_is_monotone_and_rejects_overlap():
    c = load_config("hymo_tiny").train
    m = [wsd_schedule(t, c) for t in range(c.max_steps + 1)]
    W = c.warmup_steps
    assert all(a < b for a, b in zip(m[:W], m[1:W])) and all(a >= b for a, b in zip(m[W:], m[W + 1:]))
    with pytest.raises(ValueError, match="lower warmup_steps"):
        wsd_schedule(0, dataclasses.replace(c, warmup_steps=c.max_steps))


def test_wsd_lambda_drives_lambdalr():
    c = load_config("hymo_tiny").train
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, wsd_lambda(c))
    for t in range(c.max_steps):
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * wsd_schedule(t, c))
        opt.step(); sched.step()


# ---------------------------------------------------------------- FSDP-2, two processes

FSDP_SCRIPT = r'''
import json, os, socket, sys, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from hymo.training.optim import CautiousAdamW, NorMuon

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 9, bias=True)                     # weight [9, 6]: rows split 5 + 4; bias -> AdamW
        self.experts = nn.Parameter(0.3 * torch.randn(3, 5, 9))  # [E, 5, 9]: experts split 2 + 1
        self.wide = nn.Linear(5, 11, bias=False)                 # [11, 5]
        self.gate = nn.Linear(5, 11, bias=False)                 # [11, 5] too: stacked with wide, one gather for both
        self.down = nn.Linear(11, 4, bias=False)                 # [4, 11]: 2 + 2
        self.row = nn.Parameter(0.3 * torch.randn(1, 4))         # [1, 4]: 1 + 0, rank 1 holds an empty shard
        self.register_buffer("rows", torch.ones(9))              # 0: that row of `up` gets no gradient
        self.register_buffer("used", torch.ones(3, 1, 1))        # 0: that expert gets no gradient
    def forward(self, x):                                        # (B, 6) -> (B, 4)
        h = torch.tanh(self.up(x) * self.rows)
        h = torch.tanh(torch.einsum("bi,eoi->bo", h, self.experts * self.used))
        return self.down(torch.tanh(self.wide(h)) * torch.sigmoid(self.gate(h))) * (1 + self.row)

GATHERS = []  # whole tensors made from DTensor shards inside NorMuon's steps
_full_tensor = DTensor.full_tensor
def _counted(self, *a, **kw):
    GATHERS.append(tuple(self.shape)); return _full_tensor(self, *a, **kw)

def train(model, steps):
    mats = [p for p in model.parameters() if p.ndim >= 2 and p is not model.row]
    groups = [{"params": mats}, {"params": [model.row], "nesterov": False, "cautious": False}]
    opts = (NorMuon(groups, lr=0.05, weight_decay=0.1), CautiousAdamW([model.up.bias], lr=0.01, weight_decay=0.1))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == 2:  # rank 1's rows of `up` and its expert lose their gradient: the expert must be left alone (it is
            model.rows[5:] = 0; model.used[2] = 0  # whole on rank 1), `up` must not be (rank 0's rows still have one)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)  # the same batch on every rank
        (model(x) - y).pow(2).mean().backward()
        DTensor.full_tensor = _counted
        try: opts[0].step()
        finally: DTensor.full_tensor = _full_tensor
        opts[1].step()
        for o in opts: o.zero_grad()
    return opts[0]

_sign = torch._foreach_sign_
def _sign_without_dtensor(ts):  # torch 2.11's DTensor has no sharding rule for it: fail here as 2.11 does
    if any(isinstance(t, DTensor) for t in ts): raise NotImplementedError("aten._foreach_sign_ on DTensor (torch 2.11)")
    return _sign(ts)
torch._foreach_sign_ = _sign_without_dtensor

def worker(rank, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0); ref = Net()
    torch.manual_seed(0); net = fully_shard(Net())
    train(ref, 5); GATHERS.clear(); opt = train(net, 5)
    diffs = {n: (p.full_tensor() - r).abs().max().item() for (n, p), r in zip(net.named_parameters(), ref.parameters())}
    layout = all(isinstance(s, DTensor) and s.placements == p.placements and s.device_mesh == p.device_mesh
                 for p in opt.state for s in opt.state[p].values())
    local_rows = {n: p.to_local().shape[0] for n, p in net.named_parameters()}
    # the state goes through the distributed-checkpoint state-dict API and back into a fresh optimiser unchanged
    sd = get_optimizer_state_dict(net, opt)
    fresh = NorMuon([{"params": [p for p in net.parameters() if p.ndim >= 2 and p is not net.row]},
                     {"params": [net.row], "nesterov": False, "cautious": False}], lr=0.05, weight_decay=0.1)
    set_optimizer_state_dict(net, fresh, sd)
    dcp_ok = all(torch.equal(fresh.state[p][k].full_tensor(), opt.state[p][k].full_tensor()) for p in opt.state for k in opt.state[p])
    # a layout NorMuon cannot stack (sharded along the last dimension) gets a message, not a wrong update
    bad = nn.Parameter(distribute_tensor(torch.randn(4, 6), net.up.weight.device_mesh, [Shard(1)]))
    bad.grad = distribute_tensor(torch.randn(4, 6), net.up.weight.device_mesh, [Shard(1)])
    refusing = NorMuon([bad])
    try: refusing.step(); refused = ""
    except NotImplementedError as e: refused = str(e)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(diffs=diffs, layout=layout, n_state=len(opt.state), local_rows=local_rows, dcp_ok=dcp_ok,
                           sd_keys=sorted(sd["state"]), gathers=GATHERS[:len(GATHERS) // 5], refused=refused,
                           refused_state=len(refusing.state)), f)
    dist.barrier()  # leave together, results written
    os._exit(0)  # no teardown: gloo's threads, destroyed with the process group or at exit, aborted a rank once under load

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(port, sys.argv[1]), nprocs=2)
'''


def test_normuon_on_fsdp2_shards_matches_one_process(tmp_path):
    script, out = tmp_path / "fsdp_normuon.py", tmp_path / "result.json"
    script.write_text(FSDP_SCRIPT)
    for attempt in range(2):  # a second try only if the free port was taken between choosing and binding it
        r = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                           env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # gloo on CPU, GPU or not
        if r.returncode == 0 or "Address already in use" not in r.stderr: break
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["local_rows"] == {"up.weight": 5, "up.bias": 5, "experts": 2, "wide.weight": 6, "gate.weight": 6,
                                 "down.weight": 2, "row": 1}  # really sharded (rank 1's piece of `row` is empty)
    assert max(res["diffs"].values()) <= 1e-6, res["diffs"]
    assert res["layout"] and res["n_state"] == 6  # momentum and second moment stay sharded like the parameters
    assert res["dcp_ok"] and res["sd_keys"] == ["down.weight", "experts", "gate.weight", "row", "up.weight", "wide.weight"]
    assert "by rows" in res["refused"], res["refused"]
    assert res["refused_state"] == 0  # refused before any state was made: the optimiser is as it was
    # one step gathers each shape group once, updates and row statistics: wide and gate share one stack
    # (row statistics: the second moment and whether the row has a gradient, side by side)
    assert sorted(map(tuple, res["gathers"])) == sorted([(1, 9, 6), (1, 9, 2), (1, 3, 5, 9), (1, 3, 5, 2), (2, 11, 5), (2, 11, 2),
                                                         (1, 4, 11), (1, 4, 2), (1, 1, 4), (1, 1, 2)]), res["gathers"]


def test_same_shape_matrices_batched_equal_one_at_a_time():
    """NorMuon stacks plain parameters of one shape into one Newton–Schulz; each must still get its own update."""
    torch.manual_seed(0)
    W0 = [torch.randn(24, 16) * 0.1 for _ in range(3)] + [torch.randn(16, 24) * 0.1]
    grads = [[torch.randn_like(w) for w in W0] for _ in range(4)]
    together = [nn.Parameter(w.clone()) for w in W0]
    alone = [nn.Parameter(w.clone()) for w in W0]
    opt = NorMuon(together, weight_decay=0.1)
    opts = [NorMuon([p], weight_decay=0.1) for p in alone]
    for gs in grads:
        for p, q, g in zip(together, alone, gs): p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        for o in opts: o.step()
    for p, q in zip(together, alone): torch.testing.assert_close(p.data, q.data, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(together[0].data, together[1].data)


def test_build_optimizers_passes_every_hyperparameter_from_the_config():
    "Values unlike each other and unlike the defaults, so a swapped or dropped argument shows."
    cfg = load_config("hymo_tiny", muon_momentum=0.9, normuon_beta2=0.99, ns_steps=3, adamw_eps=1e-6,
                      adamw_betas=[0.8, 0.97], muon_lr=0.03, adamw_lr=0.002, weight_decay=0.07,
                      cautious_weight_decay=False).train
    model = nn.Sequential(nn.Linear(4, 6, bias=True), nn.LayerNorm(6))
    normuon, adamw = build_optimizers(model, cfg)
    d = normuon.defaults
    assert (d["lr"], d["momentum"], d["beta2"], d["ns_steps"], d["weight_decay"], d["cautious"]) == (0.03, 0.9, 0.99, 3, 0.07, False)
    assert all(g["lr"] == 0.002 and g["eps"] == 1e-6 and g["betas"] == (0.8, 0.97) and g["cautious"] is False
               for g in adamw.param_groups)
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.07, 0.0]  # matrices decay, vectors do not


def test_normuon_refuses_4d_parameters():
    with pytest.raises(ValueError, match="2-D .* or stacked 3-D"):
        NorMuon([nn.Parameter(torch.ones(2, 3, 4, 5))])


def test_adamw_refuses_negative_eps():
    with pytest.raises(ValueError, match="CautiousAdamW: need"):
        CautiousAdamW([nn.Parameter(torch.ones(3))], eps=-1e-8)


def test_newton_schulz_of_zero_is_zero():
    "eps guards the Frobenius normalisation (it goes in the denominator), it is not added to the result."
    assert torch.equal(newton_schulz(torch.zeros(6, 4)), torch.zeros(6, 4))


def test_wsd_warmup_may_end_exactly_where_the_decay_starts():
    c = load_config("hymo_tiny", max_steps=10, warmup_steps=7, decay_fraction=0.3, decay_shape="linear").train
    assert [wsd_schedule(t, c) for t in range(7)] == pytest.approx([(t + 1) / 7 for t in range(7)])
    assert wsd_schedule(7, c) == pytest.approx(0.75)  # S = 7: decay straight after warmup, no stable phase


def test_wsd_names_the_valid_shapes():
    c = dataclasses.replace(load_config("hymo_tiny").train, decay_shape="exp")  # not validated: built directly
    for step in (0, c.max_steps - 1):  # refused from the first step, not only once the decay begins
        with pytest.raises(ValueError, match="decay_shape='exp': choose one of 'linear', '1-sqrt', 'cosine'"):
            wsd_schedule(step, c)


def test_adamw_refuses_a_cautious_that_is_not_a_bool():
    with pytest.raises(ValueError, match="cautious True or False; got .*cautious='no'"):
        CautiousAdamW([nn.Parameter(torch.randn(4, 4))], cautious="no")


def test_wsd_and_build_optimizers_check_a_config_changed_in_code():
    "`load_config` refuses these; a TrainingConfig changed with dataclasses.replace is checked where it is used."
    c = load_config("hymo_tiny").train
    for name, value in (("decay_fraction", 1.5), ("min_lr_ratio", -0.1)):
        with pytest.raises(ValueError, match=rf"{name}={value} must be in \[0, 1\]"):
            wsd_schedule(0, dataclasses.replace(c, **{name: value}))
    with pytest.raises(ValueError, match="weight_decay=100.0 .* flipping them"):
        build_optimizers(nn.Linear(4, 4), dataclasses.replace(c, weight_decay=100.0))


def test_wsd_without_decay_stays_at_peak_past_max_steps():
    c = load_config("hymo_tiny", decay_fraction=0.0, min_lr_ratio=0.1).train
    assert [wsd_schedule(t, c) for t in (c.max_steps - 1, c.max_steps, c.max_steps + 5)] == [1.0, 1.0, 1.0]




def test_any_vector_or_scalar_goes_to_adamw_without_decay():
    "The rule is by shape, not only by name: a gain or scalar with an unforeseen name must not be decayed or refused."
    assert param_group("layers.0.mixer.scale", torch.empty(16)) == "adamw_no_decay"
    assert param_group("temperature", torch.empty(())) == "adamw_no_decay"


@pytest.mark.parametrize("bad", [dict(ns_steps=2.5), dict(ns_steps=True), dict(momentum=None), dict(lr="0.02"),
                                 dict(nesterov="no"), dict(cautious=None)])  # 'no' as text is true: Nesterov on
def test_normuon_refuses_values_of_the_wrong_type_with_its_message(bad):
    "Not a TypeError from deep inside `step`: the constructor names every setting it needs."
    with pytest.raises(ValueError, match="NorMuon: need lr ≥ 0, 0 ≤ momentum < 1, 0 ≤ beta2 < 1, a whole number ns_steps"):
        NorMuon([nn.Parameter(torch.randn(4, 4))], **bad)


@pytest.mark.parametrize("betas", [0.9, (0.9,), None, (0.9, "0.95")])
def test_adamw_refuses_betas_that_are_not_two_numbers(betas):
    with pytest.raises(ValueError, match=r"CautiousAdamW: need lr, weight_decay ≥ 0, eps > 0 .*, two betas in \[0, 1\)"):
        CautiousAdamW([nn.Parameter(torch.randn(3))], betas=betas)
    assert CautiousAdamW([nn.Parameter(torch.randn(3))], betas=[0.9, 0.95]).defaults["betas"] == (0.9, 0.95)  # a YAML list


def test_every_decay_shape_the_config_accepts_has_a_schedule():
    "DECAY_SHAPES is what the config and the schedule check against: each name must also have a curve."
    from hymo.config import DECAY_SHAPES
    base = load_config("hymo_tiny", max_steps=10, warmup_steps=1, decay_fraction=0.5).train
    for shape in DECAY_SHAPES:
        c = dataclasses.replace(base, decay_shape=shape)
        mults = [wsd_schedule(t, c) for t in range(10)]
        assert mults[4] == 1.0 and all(b < a for a, b in zip(mults[4:], mults[5:])) and mults[-1] > c.min_lr_ratio


def test_normuon_takes_numpy_ints_and_adamw_takes_betas_as_lists_in_groups():
    import numpy as np
    assert NorMuon([nn.Parameter(torch.randn(4, 4))], ns_steps=np.int64(3)).defaults["ns_steps"] == 3
    opt = CautiousAdamW([dict(params=[nn.Parameter(torch.randn(3))], betas=[0.8, 0.9])])
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    opt.add_param_group(dict(params=[nn.Parameter(torch.randn(2))], betas=[0.7, 0.8]))
    assert opt.param_groups[1]["betas"] == (0.7, 0.8)


# From mutation testing of optim.py: behaviour no earlier test pinned.

def test_build_optimizers_gives_normuon_nesterov():
    normuon, _ = build_optimizers(nn.Sequential(nn.Linear(4, 6, bias=False)), load_config("hymo_tiny").train)
    assert normuon.param_groups[0]["nesterov"] is True


def test_normuon_rows_without_gradient_move_when_the_matrix_has_one():
    torch.manual_seed(0)
    W0, grads = 0.1 * torch.randn(24, 16), [torch.randn(24, 16) for _ in range(4)]
    grads[2][:5] = 0; grads[3][:5] = 0  # rows 0-4 lose their gradient; their momentum still moves them
    p = nn.Parameter(W0.clone())
    opt = NorMuon([p], lr=0.03, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone(); opt.step()
    torch.testing.assert_close(p.data, normuon_from_scratch(W0, grads, lr=0.03))


def test_normuon_gradient_rows_summing_to_zero_are_gradients():
    torch.manual_seed(0)
    W0 = 0.1 * torch.randn(6, 4)
    g = torch.tensor([[1.0, -1.0, 2.0, -2.0]]).repeat(6, 1) * torch.arange(1.0, 7.0)[:, None]  # every row sums to 0 exactly
    p = nn.Parameter(W0.clone())
    p.grad = g.clone(); NorMuon([p], lr=0.03, weight_decay=0.1).step()
    torch.testing.assert_close(p.data, normuon_from_scratch(W0, [g], lr=0.03))


@pytest.mark.parametrize("shape", [(8, 6), (3, 8, 6)])
def test_normuon_matrix_without_gradient_on_its_first_step_only_decays(shape):
    torch.manual_seed(0)
    W0, g = torch.randn(shape), torch.randn(shape)
    g[0] = 0 if len(shape) == 3 else g[0]
    if len(shape) == 2: g.zero_()
    p = nn.Parameter(W0.clone()); p.grad = g
    NorMuon([p], lr=0.02, weight_decay=0.1).step()
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.data[0], W0[0] * (1 - 0.02 * 0.1))


def test_normuon_step_skips_parameters_without_grad():
    p, q = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5, 3))
    q0 = q.detach().clone()
    p.grad = torch.randn(6, 4)
    opt = NorMuon([p, q], weight_decay=0.1)
    opt.step()
    assert torch.equal(q.data, q0) and q not in opt.state


@pytest.mark.parametrize("cls, shape", [(NorMuon, (4, 3)), (CautiousAdamW, (3,))])
def test_step_runs_the_closure_with_grad_and_returns_its_loss(cls, shape):
    p = nn.Parameter(torch.randn(shape))
    opt = cls([p])
    def closure():
        opt.zero_grad(); loss = (p ** 2).sum(); loss.backward(); return loss
    loss = opt.step(closure)
    assert loss is not None and loss.requires_grad


def test_normuon_rownorm_is_the_three_pass_form():
    torch.manual_seed(0)
    O, v = torch.randn(2, 12, 20), torch.rand(2, 12, 1)
    U, v1 = optim.normuon_rownorm(O, v, 0.9, gain=1.5)
    v_ref = 0.9 * v + 0.1 * (O * O).mean(-1, keepdim=True)
    Oh = O / v_ref.sqrt()
    U_ref = Oh * O.norm(dim=(-2, -1), keepdim=True) / Oh.norm(dim=(-2, -1), keepdim=True) * 1.5
    torch.testing.assert_close(v1, v_ref); torch.testing.assert_close(U, U_ref)


@pytest.mark.parametrize("shape", [(40, 16), (16, 40)])
def test_newton_schulz_gram_matrix_is_on_the_short_side(shape, monkeypatch):
    seen, bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, **kw: seen.append(tuple(a.shape[-2:]) + tuple(b.shape[-1:])) or bmm(a, b, **kw))
    newton_schulz(torch.randn(shape))
    assert seen and all(s == (16, 40, 16) for s in seen), seen  # A = X Xᵀ is 16×16


def test_newton_schulz_dtype():
    G = torch.randn(8, 5)
    assert newton_schulz(G, dtype=torch.float64).dtype == torch.float64 and newton_schulz(G.double()).dtype == torch.float32
    assert optim.ns_dtype(torch.empty(0, device="meta")) is torch.float32 and optim.ns_dtype(type("Cuda", (), {"is_cuda": True})()) is torch.bfloat16


def test_normuon_normalises_rows_of_a_wide_matrix():  # rf_clamp_big: v ~ 3e-6 at step 1
    torch.manual_seed(0)
    W0, grads = 0.01 * torch.randn(16, 16384), [torch.randn(16, 16384) * torch.rand(16, 1) for _ in range(2)]
    p = nn.Parameter(W0.clone()); opt = NorMuon([p], lr=0.03, weight_decay=0.1)
    for g in grads: p.grad = g.clone(); opt.step()
    torch.testing.assert_close(p.data, normuon_from_scratch(W0, grads, lr=0.03))


@pytest.mark.parametrize("cls, kw", [(NorMuon, dict(momentum=-0.1)), (NorMuon, dict(beta2=-0.1)),
                                     (CautiousAdamW, dict(weight_decay=-0.1)), (CautiousAdamW, dict(lr=-1e-3)),
                                     (CautiousAdamW, dict(betas=(-0.1, 0.9)))])
def test_negative_settings_are_refused(cls, kw):
    with pytest.raises(ValueError, match="need"):
        cls([nn.Parameter(torch.randn(3, 3))], **kw)


def test_adamw_refuses_eps_zero_as_the_config_does():
    "At eps=0 a coordinate whose gradient is 0 on the first step gets 0/0: NaN in the weights for good."
    with pytest.raises(ValueError, match=r"eps > 0 \(at 0 a coordinate without gradient"):
        CautiousAdamW([nn.Parameter(torch.randn(3))], eps=0.0)


def test_zero_settings_are_accepted_and_a_refused_adamw_group_is_not_kept():
    w, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    NorMuon([w], lr=0.0, momentum=0.0, beta2=0.0, weight_decay=0.0)
    opt = CautiousAdamW([b], lr=0.0, betas=(0.0, 0.0), weight_decay=0.0)
    with pytest.raises(ValueError): opt.add_param_group({"params": [nn.Parameter(torch.randn(2))], "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_documented_defaults():
    d = NorMuon([nn.Parameter(torch.randn(3, 3))]).defaults
    assert {k: d[k] for k in ("lr", "momentum", "nesterov", "beta2", "ns_steps", "weight_decay", "cautious")} == \
        dict(lr=0.02, momentum=0.95, nesterov=True, beta2=0.95, ns_steps=5, weight_decay=0.0, cautious=True)
    d = CautiousAdamW([nn.Parameter(torch.randn(3))]).defaults
    assert {k: d[k] for k in ("lr", "betas", "eps", "weight_decay", "cautious")} == \
        dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, cautious=True)


def test_param_table_lists_only_trainable_parameters():
    assert "frozen" not in [n for n, _, _ in param_table(TinyNamed())]


def test_build_optimizers_names_a_model_without_matrices():
    with pytest.raises(ValueError, match="no parameter goes to NorMuon"):
        build_optimizers(nn.LayerNorm(4), load_config("hymo_tiny").train)


def test_normuon_compiles_the_update_where_it_should(monkeypatch):
    "fused=True always, False never, None on a GPU for FUSED_MIN_NUMEL entries or more (the compiled kernel is recorded, not run)."
    calls = []
    monkeypatch.setattr(optim, "normuon_apply_fused", lambda: (lambda x, *args: calls.append(tuple(x.shape))))
    def step(shape, fused, device):
        p = nn.Parameter(torch.zeros(shape, device=device))
        p.grad = torch.randn(shape, device=device)
        NorMuon([p], fused=fused).step()
    step((8, 6), True, "cpu"); step((8, 6), None, "cpu"); step((8, 6), False, "cpu")
    assert calls == [(8, 6)]
    if torch.cuda.is_available():
        calls.clear()
        assert optim.FUSED_MIN_NUMEL == 2048 * 2048
        step((2048, 2048), None, "cuda"); step((2048, 2047), None, "cuda"); step((2048, 2048), False, "cuda")
        assert calls == [(2048, 2048)]


def test_wsd_refuses_warmup_one_step_past_the_decay_start():
    "decay starts at step 5 (10 steps, half decay): warmup_steps=5 is the limit, 6 is refused (even unvalidated)."
    cfg = TrainingConfig(max_steps=10, decay_fraction=0.5, warmup_steps=5, decay_shape="linear")
    assert wsd_schedule(4, cfg) == 1.0
    with pytest.raises(ValueError, match="warmup_steps=6 runs into the decay"):
        wsd_schedule(0, dataclasses.replace(cfg, warmup_steps=6))


def test_normuon_leaves_empty_matrices_alone():
    "A zero-size 2-D parameter reached Newton–Schulz's reshape and failed there (and (5, 0) would divide by zero)."
    ps = [torch.nn.Parameter(torch.randn(*s)) for s in ((0, 5), (5, 0), (3, 0, 4), (4, 6))]
    for p in ps: p.grad = torch.ones_like(p)
    before = ps[3].detach().clone()
    NorMuon(ps, lr=0.02).step()
    assert not torch.equal(ps[3], before) and all(p.numel() == 0 for p in ps[:3])
