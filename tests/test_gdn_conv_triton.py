"""The fused GDN prelude (conv, SiLU, L2 norm) in Triton against the PyTorch prelude, on CPU through
Triton's interpreter, and the mixer that uses it against the mixer on the PyTorch path.

The kernels run in a fresh process (`_interpret.run_child`), which prints the relative error of every
output and gradient as JSON; the tests judge them.
"""
import textwrap

import pytest
import torch
from _interpret import run_child

CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hymo.config import load_config
    from hymo.models.gdn import GatedDeltaNet, conv_silu_norm
    from hymo.models.gdn_conv_triton import triton_conv_silu_norm

    def rel(a, b): return [((a.float() - b.float()).norm() / b.float().norm()).item(), b.float().norm().item()]

    def steps(a, b):  # the largest error of an element in bf16 steps of its reference (2^-7 of it; 1e-6 of the largest: ~0)
        a, b = a.float(), b.float()
        return [((a - b).abs() / (b.abs() * 2 ** -7 + 1e-6 * b.abs().max())).max().item(), b.norm().item()]

    def prelude(B, T, H, K, V, W=4, cu=None, dtype=torch.float32, seed=0, measure=rel):
        gen = torch.Generator().manual_seed(seed)
        C = 2 * H * K + H * V
        wide = torch.randn(B, T, C + 5, generator=gen).to(dtype)    # qkv is a column slice, as in the mixer
        w = torch.randn(C, W, generator=gen) * 0.5
        cots = [torch.randn(B, T, H, d, generator=gen).to(dtype).float() for d in (K, K, V)]  # what a bf16 output's gradient can hold
        outs = []
        for fn, xdt in ((conv_silu_norm, torch.float32), (triton_conv_silu_norm, dtype)):
            x = wide.detach().to(xdt).requires_grad_(); ww = w.detach().clone().requires_grad_()
            ys = fn(x[..., 2:2 + C], ww, H, K, cu_seqlens=cu)[:3]
            sum((y.float() * c).sum() for y, c in zip(ys, cots)).backward()
            outs.append([*ys, x.grad, ww.grad])
        return {n: measure(o, r) for n, r, o in zip("q k v dx dw".split(), *outs)}

    def mixer(cu=None, seed=0):
        torch.manual_seed(seed)
        m = GatedDeltaNet(load_config("hymo_tiny").model)
        x = torch.randn(1, 100, m.config.dim)
        res = []
        for kernel in ("torch", "triton"):
            m.kernel = kernel; m.zero_grad()
            xx = x.clone().requires_grad_()
            y = m(xx, cu_seqlens=cu)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            res.append([y, xx.grad] + [p.grad for p in m.parameters()])
        names = ["y", "dx"] + [n for n, _ in m.named_parameters()]
        return {n: rel(b, a) for n, a, b in zip(names, *res)}

    def small_tiles():  # several programs per sequence, a partial last one, RT not a multiple of BT, partial channel tiles
        import hymo.models.gdn_conv_triton as ct
        saved = {k: dict(v) for k, v in ct.LAUNCH.items()}
        ct.LAUNCH.update(fwd=dict(BT=8, num_warps=2), du=dict(BT=8, num_warps=2), dx=dict(BT=16, BC=64, num_warps=2),
                         dw=dict(BT=8, RT=20, BC=64, num_warps=2))
        assert set(ct.LAUNCH) == set(saved), "the test sets tiles the kernels do not read"
        try: return prelude(2, 70, 3, 32, 32, seed=4)
        finally: ct.LAUNCH.update(saved)

    res = {"odd_T": prelude(2, 70, 3, 32, 32),
           "small_tiles": small_tiles(),
           "padded_heads_W3": prelude(1, 45, 2, 12, 20, W=3, seed=1),
           "packed": prelude(1, 90, 2, 16, 16, cu=torch.tensor([0, 10, 80, 90]), seed=2),
           "short_docs": prelude(1, 40, 2, 16, 16, cu=torch.tensor([0, 1, 3, 4, 20, 40]), seed=5),  # shorter than W
           "two_dw_rows": prelude(1, 530, 1, 16, 16, seed=6),  # the default tiles: dw sums two RT=512 blocks, one partial
           "bf16": prelude(2, 70, 3, 32, 32, dtype=torch.bfloat16, seed=3, measure=lambda o, r: rel(o, r) + steps(o, r)),
           "mixer": mixer(),
           "mixer_packed": mixer(cu=torch.tensor([0, 37, 100]), seed=1)}
    def mixer_carried(seed=3):  # a second call continuing the first's state (conv and recurrent), as a prefill in parts does
        torch.manual_seed(seed)
        m = GatedDeltaNet(load_config("hymo_tiny").model)
        x, ys = torch.randn(1, 100, m.config.dim), []
        with torch.no_grad():
            for kernel in ("torch", "triton"):
                m.kernel = kernel
                _, state = m(x[:, :60], output_final_state=True)
                ys.append(m(x[:, 60:], initial_state=state))
        return {"y": rel(ys[1], ys[0])}
    res["mixer_carried"] = mixer_carried()
    res["bf16_steps"] = {n: e[2:] for n, e in res["bf16"].items()}  # one run, two measures: [rel, norm, steps, norm]
    res["bf16"] = {n: e[:2] for n, e in res["bf16"].items()}

    # the wrapper: qkv or weights in another layout, rows of a buffer past int32 offsets, T = 0 or B = 0
    def against_reference(qkv, w, H=2, K=16):
        with torch.no_grad():
            got, want = triton_conv_silu_norm(qkv, w, H, K), conv_silu_norm(qkv.float(), w.float(), H, K)[:3]
        return max((a.float() - b).abs().max().item() for a, b in zip(got, want))
    gen, C = torch.Generator().manual_seed(9), 2 * 2 * 16 + 2 * 16
    qkv, w = torch.randn(2, 20, C, generator=gen), torch.randn(C, 4, generator=gen)
    res["layouts"] = dict(channels_outer=against_reference(qkv.transpose(1, 2).contiguous().transpose(1, 2), w),
                          weight_transposed=against_reference(qkv, w.t().contiguous().t()))
    S = 2 ** 30 + C  # fp16 rows 2**30 elements apart: the last at an offset past 2**31
    base = torch.empty(2 * S + C, dtype=torch.float16)  # virtual memory: only three rows are written
    far = base.as_strided((3, 1, C), (S, C, 1)); far.copy_(torch.randn(3, 1, C, generator=gen).half())
    res["layouts"]["far_rows"] = against_reference(far, w)
    res["empty"] = {f"{B}x{T}": [list(t.shape) for t in triton_conv_silu_norm(torch.randn(B, T, C), w, 2, 16)]
                    for B, T in ((1, 0), (0, 5))}
    x, w = torch.randn(1, 20, 2 * 2 * 16 + 2 * 16, requires_grad=True), torch.randn(96, 4, requires_grad=True)
    res["opcheck"] = torch.library.opcheck(torch.ops.hymo.conv_silu_norm_fwd.default, (x, w, 2, 16, None))
    print("RESULT" + json.dumps(res))
''')


@pytest.fixture(scope="module")
def errors():
    return run_child(CHILD)


def _check(case, tol):
    for name, (err, scale) in case.items():
        assert scale > 0, f"{name}: the reference is all zeros, the check would prove nothing"
        assert err <= tol, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("name", ["odd_T", "small_tiles", "padded_heads_W3", "packed", "short_docs", "two_dw_rows"])
def test_prelude_outputs_and_gradients_match_pytorch(errors, name):
    "fp32: q, k, v and the gradients of the input and the conv weights, to fp32 rounding."
    _check(errors[name], 1e-5)
    assert set(errors[name]) == {"q", "k", "v", "dx", "dw"}


def test_prelude_in_bf16_is_within_bf16_rounding(errors):
    "bf16 inputs against the fp32 prelude: within a few bf16 roundings (2^-8 relative)."
    _check(errors["bf16"], 1e-2)


def test_prelude_in_bf16_rounds_once(errors):
    """The kernels compute in fp32 and round each output once: every element of q, k, v and dx is within one bf16 step
    (2^-7 of its value) of the fp32 prelude on the same inputs. The interpreter rounds toward zero (up to one step), a
    GPU to nearest (half a step); a second rounding inside the kernels (of the conv's output, say) would exceed it."""
    _check(errors["bf16_steps"], 1.0)


@pytest.mark.parametrize("name", ["mixer", "mixer_packed", "mixer_carried"])
def test_mixer_on_the_triton_path_equals_the_pytorch_path(errors, name):
    "The whole mixer (stacked projections, fused prelude, Triton rule) against the PyTorch path: output and every gradient."
    if name != "mixer_carried":  # (that one is an inference call, no gradients)
        assert {"y", "dx", "q_proj.weight", "a_proj.weight", "q_conv1d.weight", "A_log", "dt_bias"} <= set(errors[name])
    _check(errors[name], 1e-4)


def test_prelude_reads_any_layout_and_empty_inputs(errors):
    """qkv with its channels outermost, transposed conv weights and rows of a buffer past int32 offsets (copied first)
    give what the PyTorch prelude gives; T = 0 or B = 0 give empty outputs of the right shapes, as the PyTorch path does."""
    for name, err in errors["layouts"].items():
        assert err < (1e-2 if name == "far_rows" else 1e-5), (name, err)  # far_rows: fp16 rows against fp32
    assert errors["empty"] == {"1x0": [[1, 0, 2, 16]] * 3, "0x5": [[0, 5, 2, 16]] * 3}, errors["empty"]


def test_bad_inputs_are_refused_with_a_clear_message():
    from hymo.models.gdn_conv_triton import triton_conv_silu_norm
    with pytest.raises(ValueError, match="2\\*H\\*K \\+ H\\*V"):
        triton_conv_silu_norm(torch.randn(1, 8, 101), torch.randn(101, 4), 2, 16)
    with pytest.raises(ValueError, match="weight must be"):
        triton_conv_silu_norm(torch.randn(1, 8, 96), torch.randn(90, 4), 2, 16)
    with pytest.raises(ValueError, match="and a whole V"):  # C == 2HK: no value channels
        triton_conv_silu_norm(torch.randn(1, 8, 64), torch.randn(64, 4), 2, 16)
    with pytest.raises(ValueError, match=r"expected 2\*H\*K \+ H\*V = 96 with H=2, K=16, V=16; check n_heads, head_k_dim and head_v_dim"):  # 2 heads of 16, 16, 16
        triton_conv_silu_norm(torch.randn(1, 8, 128), torch.randn(128, 4), 2, 16, head_v_dim=16)
    with pytest.raises(ValueError, match=r"weight must be \[C, W\] = \[96, W\]"):
        triton_conv_silu_norm(torch.randn(1, 8, 96), torch.randn(96), 2, 16)
    with pytest.raises(TypeError, match="qkv must be fp32, bf16 or fp16, got torch.int64"):
        triton_conv_silu_norm(torch.randint(0, 5, (1, 8, 96)), torch.randn(96, 4), 2, 16)
    with pytest.raises(TypeError, match="got torch.float64 \\(for float64, use conv_silu_norm\\)"):
        triton_conv_silu_norm(torch.randn(1, 8, 96, dtype=torch.float64), torch.randn(96, 4), 2, 16)
    with pytest.raises(ValueError, match=r"qkv must be \[B, T, C\]; got shape \(8, 96\)"):
        triton_conv_silu_norm(torch.randn(8, 96), torch.randn(96, 4), 2, 16)
    with pytest.raises(ValueError, match="n_heads=0 and head_k_dim=16 must be at least 1"):
        triton_conv_silu_norm(torch.randn(1, 8, 96), torch.randn(96, 4), 0, 16)
    with pytest.raises(ValueError, match="a window W of at least 1"):
        triton_conv_silu_norm(torch.randn(1, 8, 96), torch.randn(96, 0), 2, 16)
    with pytest.raises(ValueError, match="past the kernels' int32 offsets"):  # no memory: every row is the same one
        triton_conv_silu_norm(torch.zeros(1, 1, 96).expand(1, 2 ** 31 // 96 + 1, 96), torch.randn(96, 4), 2, 16)
    from hymo.models.gdn_conv_triton import INTERPRET, _tile_sizes
    if not INTERPRET:  # (this process runs no kernel in the interpreter)
        with pytest.raises(RuntimeError, match="Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 .* or use conv_silu_norm"):
            triton_conv_silu_norm(torch.randn(1, 8, 96), torch.randn(96, 4), 2, 16)
    with pytest.raises(ValueError, match="must be a power of two"): _tile_sizes(4, 16, 3)
    assert _tile_sizes(4, 16, 2) == (2, 16) and _tile_sizes(3, 20, None) == (4, 32)
    with pytest.raises(ValueError, match="B must be 1"):
        triton_conv_silu_norm(torch.randn(2, 8, 96), torch.randn(96, 4), 2, 16, cu_seqlens=torch.tensor([0, 8]))
    for cu, msg in [([0, 10, 80], "from 0 to T=90"), ([0, 50, 40, 90], "non-decreasing"), ([0.0, 90.0], "int32 or int64 tensor")]:
        with pytest.raises(ValueError, match=msg):  # on the CPU the values are read (on a GPU the rule reads them)
            triton_conv_silu_norm(torch.randn(1, 90, 96), torch.randn(96, 4), 2, 16, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match=r"weight is on meta and qkv on cpu: put both on one device"):  # the interpreter would skip the launch
        triton_conv_silu_norm(torch.randn(1, 8, 96), torch.randn(96, 4, device="meta"), 2, 16)


def test_operators_refuse_what_they_would_read_past():
    "The operators read x, w and starts unchecked by the kernels: a caller skipping triton_conv_silu_norm gets a message."
    from hymo.models.gdn_conv_triton import conv_silu_norm_bwd, conv_silu_norm_fwd
    x, w, int32 = torch.randn(1, 8, 96), torch.randn(96, 4), torch.int32
    with pytest.raises(ValueError, match=r"weight must be \[C, W\] = \[96, W\]"): conv_silu_norm_fwd(x, w[:50], 2, 16, None)
    with pytest.raises(ValueError, match="qkv has 101 channels"): conv_silu_norm_fwd(torch.randn(1, 8, 101), torch.randn(101, 4), 2, 16, None)
    for starts in (torch.zeros(8), torch.zeros(7, dtype=int32), torch.zeros(8, dtype=int32, device="meta")):
        with pytest.raises(ValueError, match=r"starts \(int32 \[T\], each token's document start\) must be on x's device"):
            conv_silu_norm_fwd(x, w, 2, 16, starts)
    dq, dv = torch.randn(1, 8, 32), torch.randn(1, 8, 32)
    with pytest.raises(ValueError, match=r"weight must be \[C, W\]"): conv_silu_norm_bwd(x, w[:50], 2, 16, None, dq, dq, dv)


def test_operator_passes_opcheck(errors):
    "torch.library.opcheck on `hymo::conv_silu_norm_fwd` (and through its autograd, the backward operator)."
    assert errors["opcheck"] and all(v == "SUCCESS" for v in errors["opcheck"].values()), errors["opcheck"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile traces the kernels only on a GPU (a triton_op)")
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_compiled_prelude_matches_eager_on_gpu(packed):
    "Under torch.compile inductor launches the prelude's kernels itself; outputs and gradients must not change."
    from hymo.models.gdn_conv_triton import triton_conv_silu_norm
    H, K, V, T = 4, 32, 32, 300
    C = 2 * H * K + H * V
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(1 if packed else 2, T, C + 6, generator=gen).cuda().to(torch.bfloat16)
    w = (torch.randn(C, 4, generator=gen) * 0.5).cuda()
    cu = torch.tensor([0, 70, 71, T]).cuda() if packed else None
    cots = [torch.randn(*wide.shape[:2], H, d, generator=gen).cuda() for d in (K, K, V)]
    outs = []
    for fn in (triton_conv_silu_norm, torch.compile(triton_conv_silu_norm)):
        x, ww = wide.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ys = fn(x[..., 3:3 + C], ww, H, K, cu_seqlens=cu)
        sum((y.float() * c).sum() for y, c in zip(ys, cots)).backward()
        outs.append([*ys, x.grad, ww.grad])
    for name, a, b in zip("q k v dx dw".split(), *outs):  # the same kernels; only dw's final sum is inductor's
        tol = dict(rtol=1e-5, atol=1e-6) if name == "dw" else dict(rtol=0, atol=0)
        torch.testing.assert_close(b, a, **tol, msg=lambda m: f"{name}: compiled differs from eager: {m}")


# From mutation testing of the wrapper.
ZERO_ROWS_CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hymo.models.gdn import conv_silu_norm
    from hymo.models.gdn_conv_triton import triton_conv_silu_norm
    gen = torch.Generator().manual_seed(0)
    H, K, V, T = 2, 16, 16, 12
    C = 2 * H * K + H * V
    x0 = torch.randn(1, T, C, generator=gen)
    x0[:, :4] = 0                      # zero rows (padding): silu(0) = 0, F.normalize gives 0, not 0/0
    x0[:, 8:] *= 1e-8                  # tiny rows: |silu(u)| < eps, where F.normalize divides by eps
    w0 = torch.randn(C, 4, generator=gen)
    cots = [torch.randn(1, T, H, d, generator=gen) for d in (K, K, V)]
    outs = []
    for fn in (conv_silu_norm, triton_conv_silu_norm):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ys = fn(x, w, H, K)[:3]
        sum((y * c).sum() for y, c in zip(ys, cots)).backward()
        outs.append([*ys, x.grad, w.grad])
    res = {"err": {n: ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).abs().max().item()
                   for n, a, b in zip("q k v dx dw".split(), outs[1], outs[0])},
           "finite": all(bool(t.isfinite().all()) for t in outs[1])}
    with torch.no_grad():
        res["dtypes"] = [str(t.dtype) for t in triton_conv_silu_norm(x0[:, :4].bfloat16(), w0, H, K)]
    print("RESULT" + json.dumps(res))
''')


def test_prelude_zero_and_tiny_rows_and_output_dtype():
    r = run_child(ZERO_ROWS_CHILD)
    assert r["finite"], r
    assert all(e < 1e-5 for e in r["err"].values()), r["err"]
    assert r["dtypes"] == ["torch.bfloat16"] * 3, r["dtypes"]


# --- the host-side logic (from mutation testing) ------------------------------------------------------

def test_tile_sizes_refuse_zero_heads_per_program_and_never_exceed_the_heads():
    from hymo.models.gdn_conv_triton import _tile_sizes
    with pytest.raises(ValueError, match="must be a power of two, 1 or more; got 0"): _tile_sizes(4, 16, 0)
    assert _tile_sizes(1, 16) == (1, 16)   # one head: one head per program, not 8 (7 of them masked away)
    assert _tile_sizes(2, 128) == (1, 128) and _tile_sizes(2, 8) == (2, 8) and _tile_sizes(5, 16) == (8, 16)


def test_operator_refuses_weights_on_another_device():
    "Called directly, conv_silu_norm_fwd refuses a w off x's device (the interpreter skips a meta launch: garbage out)."
    from hymo.models.gdn_conv_triton import conv_silu_norm_fwd
    with pytest.raises(ValueError, match=r"must be on x's device \(cpu\); got w on meta"):
        conv_silu_norm_fwd(torch.randn(1, 8, 96), torch.randn(96, 4, device="meta"), 2, 16, None)


HOST_CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hymo.models.gdn import conv_silu_norm
    from hymo.models.gdn_conv_triton import triton_conv_silu_norm
    out = {}
    gen = torch.Generator().manual_seed(0)
    H, K, V, T = 2, 16, 16, 10
    C = 2 * H * K + H * V
    qkv, w = torch.randn(1, T, C, generator=gen), torch.randn(C, 4, generator=gen) * 0.5
    for name, wdt in (("bf16_weight", torch.bfloat16), ("fp16_weight", torch.float16)):
        try:
            ww = w.to(wdt).requires_grad_()
            ys = triton_conv_silu_norm(qkv, ww, H, K)
            ref = conv_silu_norm(qkv, w.to(wdt).float(), H, K)[:3]
            sum(y.sum() for y in ys).backward()
            out[name] = dict(err=max((a - b).abs().max().item() for a, b in zip(ys, ref)), grad_dtype=str(ww.grad.dtype))
        except Exception as e: out[name] = f"{type(e).__name__}: {e}"[:300]
    try:  # shapes only, on the meta device (what a model built there runs)
        out["meta"] = [list(t.shape) for t in triton_conv_silu_norm(qkv.to("meta"), w.to("meta"), H, K)]
    except Exception as e: out["meta"] = f"{type(e).__name__}: {e}"[:300]
    try:  # a gradient that is one value broadcast (q.sum()): stride 0
        x = qkv.clone().requires_grad_(); ww = w.clone().requires_grad_()
        q, k, v = triton_conv_silu_norm(x, ww, H, K); (q.sum() + k.sum() + v.sum()).backward()
        xr = qkv.clone().requires_grad_(); wr = w.clone().requires_grad_()
        q, k, v = conv_silu_norm(xr, wr, H, K)[:3]; (q.sum() + k.sum() + v.sum()).backward()
        out["sum_grads"] = max((x.grad - xr.grad).abs().max().item(), (ww.grad - wr.grad).abs().max().item())
    except Exception as e: out["sum_grads"] = f"{type(e).__name__}: {e}"[:300]
    print("RESULT" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def host_child():
    return run_child(HOST_CHILD)


@pytest.mark.parametrize("name", ["bf16_weight", "fp16_weight"])
def test_half_precision_conv_weights_are_taken(host_child, name):
    "A model cast to bf16 hands the wrapper bf16 conv weights: it converts them, as it promises, and the gradient comes back in their dtype."
    r = host_child[name]
    assert isinstance(r, dict), r
    assert r["err"] < 1e-5 and r["grad_dtype"] == ("torch.bfloat16" if name == "bf16_weight" else "torch.float16"), r


def test_meta_inputs_give_shapes_without_a_launch(host_child):
    assert host_child["meta"] == [[1, 10, 2, 16]] * 3, host_child["meta"]


def test_broadcast_output_gradients(host_child):
    "q.sum() gives q a stride-0 gradient: the backward reads it as a dense one."
    assert isinstance(host_child["sum_grads"], float) and host_child["sum_grads"] < 1e-5, host_child["sum_grads"]
