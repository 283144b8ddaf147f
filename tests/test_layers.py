"""RMSNorm and SwiGLU against fp64 references."""
import pytest
import torch

from hymo.models.layers import RMSNorm, SwiGLU


def _ulps(y, ref):  # largest error in units of bf16's spacing at ref
    spacing = 2.0 ** torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) * 2**-7
    return ((y.double() - ref) / spacing).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rmsnorm_is_the_fp64_result_rounded_once(dtype):
    "Computed in fp32 with its learned gain, rounded to the input's dtype only at the end."
    torch.manual_seed(0)
    norm = RMSNorm(896, eps=1e-6)
    with torch.no_grad(): norm.weight.copy_(1 + 0.5 * torch.randn(896))
    x = (3 * torch.randn(64, 896)).to(dtype)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    y = norm(x)
    assert y.dtype == dtype
    if dtype == torch.bfloat16: assert _ulps(y, ref) <= 0.51  # half an ulp: one rounding
    else:  # half an ulp relative (fp16: 2^-11); fp16's subnormals below 6e-5 have an absolute spacing of 6e-8
        rtol, atol = {torch.float16: (2**-11, 3e-8), torch.float32: (1e-6, 0)}[dtype]
        torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)


def test_rmsnorm_gradient_matches_the_formula_in_fp64():
    "fp32 gradients against autograd of the written-out formula in fp64; and an fp64 norm computes in fp64 (gradcheck)."
    torch.manual_seed(1)
    norm, w = RMSNorm(24), torch.randn(24, dtype=torch.float64)
    with torch.no_grad(): norm.weight.copy_(w)
    x = torch.randn(5, 24, requires_grad=True)
    xd, wd = x.detach().double().requires_grad_(), w.clone().requires_grad_()
    g = torch.randn(5, 24)
    (norm(x) * g).sum().backward()
    (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad.double(), wd.grad, rtol=1e-5, atol=1e-6)
    assert torch.autograd.gradcheck(RMSNorm(6).double(), (torch.randn(3, 6, dtype=torch.float64, requires_grad=True),))


def test_rmsnorm_epsilon_is_inside_the_root():
    "A zero row gives zeros, not NaN; a large eps is visible in the output (it must be added before the root)."
    norm = RMSNorm(4, eps=1.0)
    assert torch.equal(norm(torch.zeros(2, 4)), torch.zeros(2, 4))
    x = torch.tensor([[0.5, -0.5, 0.5, -0.5]])
    torch.testing.assert_close(norm(x), x / (0.25 + 1.0) ** 0.5)


def test_swiglu_is_w2_of_silu_w1_times_w3():
    torch.manual_seed(2)
    ffn = SwiGLU(16, 40)
    x = torch.randn(3, 7, 16)
    w1, w2, w3 = (m.weight.double() for m in (ffn.w1, ffn.w2, ffn.w3))
    h = x.double() @ w1.T
    ref = (h * torch.sigmoid(h) * (x.double() @ w3.T)) @ w2.T
    torch.testing.assert_close(ffn(x).double(), ref, rtol=1e-5, atol=1e-6)
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 16 * 40


def test_rmsnorm_reset_parameters_sets_unit_gain_after_meta_init():
    "Models are built on the meta device and initialised by reset_parameters: the gain must come back as exactly 1."
    with torch.device("meta"):
        norm = RMSNorm(8)
    norm.to_empty(device="cpu")
    with torch.no_grad(): norm.weight.fill_(3.0)  # whatever to_empty left behind
    norm.reset_parameters()
    assert torch.equal(norm.weight.detach(), torch.ones(8))
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rmsnorm_gradient_against_the_written_out_formula():
    "x·rsqrt(mean(x²) + eps)·w in fp64 by hand: a mean square left out of the graph (detached) would still match RMSNorm in fp64."
    torch.manual_seed(1)
    norm, x, g = RMSNorm(24), torch.randn(5, 24, requires_grad=True), torch.randn(5, 24)
    with torch.no_grad(): norm.weight.copy_(torch.randn(24))
    (norm(x) * g).sum().backward()
    xd, wd = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    ((xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps) * wd) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad.double(), wd.grad, rtol=1e-5, atol=1e-6)


def test_rmsnorm_default_eps_is_1e_6():
    "RMSNorm(dim) without eps adds 1e-6, as documented: visible on a row whose mean square is of that order."
    x = torch.full((1, 4), 1e-3)  # mean square 1e-6: eps=1e-6 halves it under the root, 1e-8 barely shows
    torch.testing.assert_close(RMSNorm(4)(x), x / (1e-6 + 1e-6) ** 0.5)
    assert RMSNorm(4).eps == 1e-6
