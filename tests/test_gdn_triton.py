"""The Triton gated delta rule against the fp32 loop, on CPU through Triton's interpreter.

The kernels run in a fresh process (`_interpret.run_child` says why). The child runs every case once
and prints the largest absolute error of each output and gradient as JSON; the tests below judge them.
"""
import json
import textwrap

import pytest
import torch
from _interpret import run_child

CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    from hymo.models.gdn import naive_gated_delta_rule
    from hymo.models.gdn_triton import fused_recurrent_gated_delta_rule, triton_gated_delta_rule

    def inputs(B, T, H, K, V, dtype, seed, g_mult=6):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=gen)
        q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
        g = F.logsigmoid(r(B, T, H) + 3) * g_mult                  # 6: mostly near 0, a few near -10
        return [q.to(dtype), k.to(dtype), r(B, T, H, V).to(dtype), g, torch.rand(B, T, H, generator=gen)]

    def run(rule, xs, h0, cu, seed):
        leaves = [x.detach().clone().requires_grad_() for x in (*xs, h0)]
        o, ht = rule(*leaves[:5], None, leaves[5], True, cu)
        gen = torch.Generator().manual_seed(seed)
        ((o.float() * torch.randn(o.shape, generator=gen)).sum() + (ht * torch.randn(ht.shape, generator=gen)).sum()).backward()
        return [o.float(), ht] + [x.grad.float() for x in leaves]

    def case(B, T, H, K, V, dtype=torch.float32, cu=None, seed=0, h0_transposed=False, g_mult=6):
        xs = inputs(B, T, H, K, V, dtype, seed, g_mult)
        h0 = torch.randn(B if cu is None else len(cu) - 1, H, K, V)
        if h0_transposed: h0 = h0.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, column-major
        ref = run(naive_gated_delta_rule, [x.float() for x in xs], h0, cu, seed)
        out = run(triton_gated_delta_rule, xs, h0, cu, seed)
        names = "o ht dq dk dv dg dbeta dh0".split()
        return {n: [(a - b).abs().max().item(), b.abs().max().item()] for n, a, b in zip(names, out, ref)}

    res = {}
    res["odd_T_padded_dims"] = case(2, 70, 1, 12, 20, seed=1)
    res["two_value_blocks"] = case(1, 40, 1, 16, 64, seed=2)
    res["packed"] = case(1, 90, 2, 16, 16, cu=torch.tensor([0, 10, 80, 90]), seed=3)
    res["packed_spare_slots"] = case(1, 192, 2, 16, 16, cu=torch.tensor([0, 64, 128, 130, 192]), seed=9)  # 4 chunks, 6 slots
    res["fp16"] = case(1, 70, 1, 16, 32, dtype=torch.float16, seed=4)
    res["fp16_keys_wider_than_values"] = case(1, 70, 1, 64, 16, dtype=torch.float16, seed=11)  # values padded to K
    # g_mult=6 decays so strongly that a chunk keeps ~1e-13 of its incoming state: this case carries ~0.4 of it
    res["weak_decay"] = case(1, 150, 2, 16, 16, seed=12, g_mult=0.2)
    res["h0_transposed"] = case(2, 70, 2, 16, 16, seed=10, h0_transposed=True)  # K, V already padded: no copy on the way in
    # the sequential kernels' grid has an axis for blocks of value columns, one block at every size HyMo runs (`_bv`):
    # split a head's values over two programs, as a GPU build that chose so would
    import hymo.models.gdn_triton as kernels
    whole, kernels._bv = kernels._bv, lambda V: V // 2
    res["split_value_blocks"] = case(1, 150, 2, 16, 32, seed=18, g_mult=0.2)
    kernels._bv = whole
    # a hard reset (g = -inf), a very strong gate and one past the floor: the kernels read gates as at least -110
    xs, h0 = inputs(1, 150, 2, 16, 16, torch.float32, 14, g_mult=0.2), torch.randn(1, 2, 16, 16)
    xs[3][0, 10, 0], xs[3][0, 75, 1], xs[3][0, 100, 0] = float("-inf"), -1e6, -200.0
    ref, out = (run(rule, xs, h0, None, 14) for rule in (naive_gated_delta_rule, triton_gated_delta_rule))
    res["hard_reset"] = {n: [(a - b).abs().max().item(), b.abs().max().item()] for n, a, b in zip("o ht dq dk dv dg dbeta dh0".split(), out, ref)}
    # a hard reset at a chunk's first token forgets exactly: other inputs before it change nothing after it, bit for bit
    # (the chunk's gate sums start there; a floor of -20 leaks e^-20 of the state; mid-chunk, the sums carry other rounding)
    xs = inputs(1, 150, 2, 16, 16, torch.float32, 16, g_mult=0.2)
    xs[3][0, 64] = float("-inf")
    ys = inputs(1, 150, 2, 16, 16, torch.float32, 17, g_mult=0.2)
    ys = [torch.cat([y[:, :64], x[:, 64:]], 1) for x, y in zip(xs, ys)]  # other q, k, v, g and beta before the reset
    with torch.no_grad(): oa, ob = (triton_gated_delta_rule(*x)[0] for x in (xs, ys))
    res["reset_forgets"] = {"after": (oa[:, 64:] - ob[:, 64:]).abs().max().item(), "before": (oa[:, :64] - ob[:, :64]).abs().max().item()}
    # a NaN gate: NaN from that token on in its head, as the loop's (the floor must not turn it into a reset)
    xs = inputs(1, 70, 2, 16, 16, torch.float32, 15)
    xs[3][0, 5, 0] = float("nan")
    with torch.no_grad(): o, o_ref = (rule(*xs)[0] for rule in (triton_gated_delta_rule, naive_gated_delta_rule))
    res["nan_gate"] = {"loop's NaN kept": bool(o.isnan()[o_ref.isnan()].all()), "loop": int(o_ref.isnan().sum()),
                       "this head": int(o[..., 0, :].isnan().sum()), "other head": int(o[..., 1, :].isnan().sum())}
    xs, h0, cu = inputs(1, 90, 2, 16, 16, torch.float32, 6), torch.randn(3, 2, 16, 16), torch.tensor([0, 10, 80, 90])
    kept, again = (run(lambda *a: triton_gated_delta_rule(*a, keep_prep=kp), xs, h0, cu, 6) for kp in (True, False))
    res["keep_prep_vs_recompute"] = max((a - b).abs().max().item() for a, b in zip(kept, again))

    # the local-gradient kernel's other order (P and K K^T * Gamma held across the value loop; fp32 wide heads take it)
    import hymo.models.gdn_triton as gt
    plain, gt._hold_local = gt._hold_local, lambda K, dtype: not plain(K, dtype)
    res["other_local_order"] = case(1, 90, 2, 16, 16, cu=torch.tensor([0, 10, 80, 90]), seed=3)
    gt._hold_local = plain

    # 16-bit values narrower than the keys are padded to the keys' width (Triton 3.6 on Hopper got them wrong)
    import hymo.models.gdn_triton as gt
    res["v_padded_to"] = {str(dt): gt._prepare_inputs(*inputs(1, 70, 1, 64, 16, dt, 7), None, None, None)[2].shape[-1]
                          for dt in (torch.float16, torch.float32)}

    # the operators as torch.compile sees them: schema, autograd registration, fake tensors, AOT dispatch
    q, k, v, g, beta, scale, _, _ = gt._prepare_inputs(*inputs(1, 70, 2, 12, 20, torch.float32, 7), None, None, None)
    res["opcheck"] = {str(kp): torch.library.opcheck(torch.ops.hymo.gdn_chunk_fwd.default,
                                                     (*(x.clone().requires_grad_() for x in (q, k, v, g, beta)),
                                                      scale, None, False, None, kp))
                      for kp in (False, True)}

    # decoding: prefill 66 tokens with the chunked kernel, then 2 tokens one at a time, against one loop
    q, k, v, g, beta = inputs(2, 68, 2, 12, 20, torch.float32, 5)
    o_ref, S_ref = naive_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    with torch.no_grad():
        o, S = triton_gated_delta_rule(q[:, :66], k[:, :66], v[:, :66], g[:, :66], beta[:, :66], output_final_state=True)
        outs = [o]
        for t in (66, 67):
            o_t, S = fused_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                      beta[:, t:t + 1], initial_state=S, output_final_state=True)
            outs.append(o_t)
    res["decode"] = {"o": [(torch.cat(outs, 1) - o_ref).abs().max().item(), o_ref.abs().max().item()],
                     "ht": [(S - S_ref).abs().max().item(), S_ref.abs().max().item()]}
    with torch.no_grad():  # the recurrent kernel on several tokens per call: from the state after 60, the last 8 at once
        _, S60 = naive_gated_delta_rule(q[:, :60], k[:, :60], v[:, :60], g[:, :60], beta[:, :60], output_final_state=True)
        o8, S = fused_recurrent_gated_delta_rule(q[:, 60:], k[:, 60:], v[:, 60:], g[:, 60:], beta[:, 60:],
                                                 initial_state=S60, output_final_state=True)
    res["decode_several"] = {"o": [(o8 - o_ref[:, 60:]).abs().max().item(), o_ref[:, 60:].abs().max().item()],
                             "ht": [(S - S_ref).abs().max().item(), S_ref.abs().max().item()]}
    xs, h0 = inputs(2, 8, 2, 16, 16, torch.float32, 11), torch.randn(2, 2, 16, 16)  # K, V already padded: no copy on the way in
    o_ref8, S_ref8 = naive_gated_delta_rule(*xs, initial_state=h0, output_final_state=True)
    with torch.no_grad():  # from a column-major copy of the state
        o8, S = fused_recurrent_gated_delta_rule(*xs, initial_state=h0.transpose(-1, -2).contiguous().transpose(-1, -2),
                                                 output_final_state=True)
    res["decode_h0_transposed"] = {"o": [(o8 - o_ref8).abs().max().item(), o_ref8.abs().max().item()],
                                   "ht": [(S - S_ref8).abs().max().item(), S_ref8.abs().max().item()]}
    q, k, v, g, beta = inputs(1, 30, 2, 12, 20, torch.float32, 6)  # and on a packed row of three documents
    cu, h0 = torch.tensor([0, 7, 8, 30]), torch.randn(3, 2, 12, 20)
    o_ref, S_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        o, S = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    res["decode_packed"] = {"o": [(o - o_ref).abs().max().item(), o_ref.abs().max().item()],
                            "ht": [(S - S_ref).abs().max().item(), S_ref.abs().max().item()]}

    # kernel 1's A = (I + L)^-1 on hard chunks: keys sharing a direction and beta near 1 put L's entries near beta, no decay
    gen = torch.Generator().manual_seed(8)
    k = F.normalize(3 * torch.randn(1, 1, 2, 32, generator=gen) + torch.randn(1, 128, 2, 32, generator=gen), dim=-1)
    beta, g = 0.5 + 0.5 * torch.rand(1, 128, 2, generator=gen), torch.zeros(1, 128, 2)
    _, A = gt._prepare(k, g, beta, None, gt._chunk_tables(None, 1, 128))
    eye = torch.eye(64, dtype=torch.float64)
    err = []
    for c in range(2):
        for h in range(2):
            kc, bc = k[0, 64 * c:64 * c + 64, h].double(), beta[0, 64 * c:64 * c + 64, h].double()
            ref = torch.linalg.inv(eye + (bc[:, None] * (kc @ kc.T)).tril(-1))
            err.append([(A[0, 64 * c:64 * c + 64, h].double() - ref).abs().max().item(), ref.abs().max().item()])
    res["solve_hard"] = {"A": max(err)}
    # a GPU without the shared memory for the local-gradient kernel (fp32 heads of 256 on an H200): a message that says what to do
    import triton.runtime.errors as te
    class TooBig:
        def __getitem__(self, grid):
            def launch(*a, **kw): raise te.OutOfResources(360448, 232448, "shared memory")
            return launch
    for name in ("_bwd_local_kernel", "_bwd_states_kernel", "_fwd_kernel", "_prep_kernel", "_fused_recurrent_kernel"):
        plain = getattr(gt, name)
        setattr(gt, name, TooBig())
        try:
            if name == "_fused_recurrent_kernel":
                with torch.no_grad(): fused_recurrent_gated_delta_rule(*inputs(1, 3, 1, 16, 16, torch.float32, 4))
            else: run(triton_gated_delta_rule, inputs(1, 70, 1, 16, 16, torch.float32, 4), torch.randn(1, 1, 16, 16), None, 4)
            res["too_big " + name] = "no error"
        except RuntimeError as e:
            res["too_big " + name] = str(e)
        setattr(gt, name, plain)

    # the wrapper around the kernels: strided inputs, bf16 gates or state, bf16 values, scale 0, T = 0, saved prep
    def plumbing(xs, h0, seed):
        "Errors of o, ht and every gradient against the loop on the same values in fp32, and the dtypes the wrapper returned."
        ref = run(naive_gated_delta_rule, [x.float() for x in xs], h0.float(), None, seed)
        leaves = [x.detach().clone().requires_grad_() for x in (*xs, h0)]  # clone keeps a transposed layout
        o, ht = triton_gated_delta_rule(*leaves[:5], None, leaves[5], True, None)
        gen = torch.Generator().manual_seed(seed)
        ((o.float() * torch.randn(o.shape, generator=gen)).sum() + (ht * torch.randn(ht.shape, generator=gen)).sum()).backward()
        names = "o ht dq dk dv dg dbeta dh0".split()
        out = [o, ht] + [x.grad for x in leaves]
        return {"err": {n: [(a.float() - b).abs().max().item(), b.abs().max().item()] for n, a, b in zip(names, out, ref)},
                "dtype": {n: str(a.dtype).replace("torch.", "") for n, a in zip(names, out)}}
    xs, h0 = inputs(1, 40, 2, 16, 16, torch.float32, 13), torch.randn(1, 2, 16, 16)
    t_major = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs[:3]]  # [B, T, H, 16] with T outside H: not contiguous
    assert not any(x.is_contiguous() for x in t_major)
    res["strided"] = plumbing(t_major + xs[3:], h0, 13)
    res["bf16_gates"] = plumbing(xs[:3] + [x.bfloat16() for x in xs[3:]], h0, 13)
    res["bf16_state"] = plumbing(xs, h0.bfloat16(), 13)
    res["bf16_values"] = plumbing([x.bfloat16() for x in xs[:3]] + xs[3:], h0, 13)
    with torch.no_grad():
        res["scale_0"] = triton_gated_delta_rule(*xs, scale=0.0)[0].abs().max().item()
        o0, S0 = triton_gated_delta_rule(*(x[:, :0] for x in xs), initial_state=h0, output_final_state=True)
        o1, S1 = triton_gated_delta_rule(*(x[:, :0] for x in xs), output_final_state=True)
        res["T_0"] = dict(o=list(o0.shape), carried=(S0 - h0).abs().max().item(), fresh=S1.abs().max().item(), fresh_shape=list(S1.shape))
    calls, real_prep = [], gt._prepare
    gt._prepare = lambda *a: calls.append(1) or real_prep(*a)
    res["prep_calls"] = {}
    for kp in (True, False):
        calls.clear()
        leaves = [x.clone().requires_grad_() for x in xs]
        o, _ = triton_gated_delta_rule(*leaves, keep_prep=kp)
        after_forward = len(calls)
        o.sum().backward()
        res["prep_calls"][str(kp)] = [after_forward, len(calls)]
    gt._prepare = real_prep
    q, k, v, g, beta, scale, h0p, _ = gt._prepare_inputs(*inputs(1, 70, 2, 16, 16, torch.float16, 7), None,
                                                         torch.randn(1, 2, 16, 16), None)
    res["opcheck_state"] = torch.library.opcheck(torch.ops.hymo.gdn_chunk_fwd.default,  # a state given without gradient
                                                 (*(x.clone().requires_grad_() for x in (q, k, v, g, beta)),
                                                  scale, h0p, True, None, False))
    print("RESULT" + json.dumps(res))
''')


@pytest.fixture(scope="module")
def errors():
    return run_child(CHILD)


def _check(case, tol):
    for name, (err, scale) in case.items():
        assert scale > 0, f"{name}: the reference is all zeros, the check would prove nothing"
        assert err <= tol * max(scale, 1.0), f"{name}: max error {err:.3g} (reference max {scale:.3g})"


@pytest.mark.parametrize("name", ["odd_T_padded_dims", "two_value_blocks", "packed", "packed_spare_slots", "other_local_order",
                                  "h0_transposed", "weak_decay", "split_value_blocks"])
def test_outputs_state_and_all_gradients_match_the_loop(errors, name):
    "fp32: o, the final state and the gradients of q, k, v, g, beta and the initial state, to fp32 rounding."
    _check(errors[name], 1e-4)
    assert set(errors[name]) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}


def test_a_hard_reset_and_huge_gates_match_the_loop(errors):
    "g = -inf (forget everything), -1e6 and -200 in a sequence of weak gates: finite, and equal to the loop to fp32 rounding."
    _check(errors["hard_reset"], 1e-4)


def test_a_hard_reset_forgets_exactly_and_a_nan_gate_stays_nan(errors):
    """Past a gate of -inf at a chunk's start the output does not depend on anything before it, bit for bit (the floor's
    e^-110 is 0 in fp32; so on an H100 in bf16 and fp32);
    a NaN gate is not read as the floor: the output is NaN wherever the loop's is (and in the earlier tokens of its chunk),
    so a broken gate reaches the loss."""
    r = errors["reset_forgets"]
    assert r["before"] > 0.1 and r["after"] == 0.0, r
    assert errors["nan_gate"] == {"loop's NaN kept": True, "loop": 65 * 16, "this head": 70 * 16, "other head": 0}, errors["nan_gate"]


def test_half_precision_inputs(errors):
    "fp16 inputs (products in fp16, accumulation and state in fp32) stay within fp16 rounding of the fp32 loop."
    _check(errors["fp16"], 1e-2)
    _check(errors["fp16_keys_wider_than_values"], 1e-2)


def test_shapes_triton_3_6_got_wrong_on_hopper_are_avoided(errors):
    "16-bit K=64, V=16 returned o off by 0.89 on an H100; K=32, V=256 at 8 warps made illegal accesses."
    from hymo.models.gdn_triton import _state_launch
    assert errors["v_padded_to"] == {"torch.float16": 64, "torch.float32": 16}
    assert _state_launch("states", 32, 256)["num_warps"] == 4 and _state_launch("states", 16, 512)["num_warps"] == 4
    assert _state_launch("states", 128, 128)["num_warps"] == 8 and _state_launch("states", 32, 32)["num_warps"] == 4


def test_kernel_1_inverts_ill_conditioned_chunks(errors):
    "A = (I + L)^-1 of chunks whose keys share a direction (entries of L near beta), against float64, to fp32 rounding."
    _check(errors["solve_hard"], 1e-5)


def test_decoding_continues_a_prefill(errors):
    "Chunked prefill, then the recurrent kernel token by token from the carried state, equals one pass of the loop."
    _check(errors["decode"], 1e-4)


@pytest.mark.parametrize("name", ["decode_several", "decode_packed", "decode_h0_transposed"])
def test_recurrent_kernel_on_several_tokens_and_packed_documents(errors, name):
    "The recurrent kernel given several tokens per call, and a packed row (the state restarts per document), equals the loop."
    _check(errors[name], 1e-4)


def test_bad_inputs_are_refused_with_a_clear_message():
    from hymo.models.gdn_triton import fused_recurrent_gated_delta_rule, triton_gated_delta_rule
    q = k = torch.randn(1, 8, 2, 16)
    v, g, beta = torch.randn(1, 8, 2, 16), -torch.rand(1, 8, 2), torch.rand(1, 8, 2)
    with pytest.raises(ValueError, match="v must be"):
        triton_gated_delta_rule(q, k, v[:, :4], g, beta)
    with pytest.raises(TypeError, match="must share one dtype"):
        triton_gated_delta_rule(q, k, v.half(), g, beta)
    with pytest.raises(TypeError, match="for float64, use chunk_gated_delta_rule_torch"):
        triton_gated_delta_rule(q.double(), k.double(), v.double(), g, beta)
    with pytest.raises(RuntimeError, match="no backward"):
        fused_recurrent_gated_delta_rule(q.clone().requires_grad_(), k, v, g, beta)
    for rule in (triton_gated_delta_rule, fused_recurrent_gated_delta_rule):  # chapter 12's message, not an unpacking error
        with pytest.raises(ValueError, match=r"q and k must both be \[B, T, H, K\]; got q \(8, 2, 16\)"):
            rule(q[0], k[0], v[0], g[0], beta[0])
        with pytest.raises(ValueError, match="q and k must both be"):
            rule(q[None], k[None], v[None], g, beta)
    big = lambda *s: torch.zeros(1, 1, 1, *s[3:]).expand(*s) if len(s) == 4 else torch.zeros(1, 1, 1).expand(*s)  # no memory
    with pytest.raises(ValueError, match="2048 sequences x 40 heads: more programs than a CUDA grid's second axis"):
        fused_recurrent_gated_delta_rule(big(2048, 1, 40, 32), big(2048, 1, 40, 32), big(2048, 1, 40, 32), big(2048, 1, 40), big(2048, 1, 40))
    B, T, H = 1, 2 ** 20, 40  # a 1M-token prefill: [B, T, H, 64] buffers past 2**31 elements
    with pytest.raises(ValueError, match="int32 offsets; split the batch or the sequence"):
        triton_gated_delta_rule(big(B, T, H, 32), big(B, T, H, 32), big(B, T, H, 32), big(B, T, H), big(B, T, H))


def test_the_operators_refuse_inputs_the_wrapper_would_have_prepared():
    "Called directly, the operators refuse unpadded heads, strided tensors and 16-bit gates (they read them wrong, silently)."
    import hymo.models.gdn_triton  # registers the operators
    q, v, g, beta = torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16), -torch.rand(1, 64, 2), torch.rand(1, 64, 2)
    op = torch.ops.hymo.gdn_chunk_fwd
    with pytest.raises(ValueError, match="powers of two of at least 16.*K=12, V=16"):
        op(q[..., :12].contiguous(), q[..., :12].contiguous(), v, g, beta, 1.0, None, False, None, False)
    t_major = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="q, k not contiguous"):
        op(t_major, t_major, v, g, beta, 1.0, None, False, None, False)
    with pytest.raises(ValueError, match="g torch.bfloat16.*call triton_gated_delta_rule"):
        op(q, q, v, g.bfloat16(), beta, 1.0, None, False, None, False)
    with pytest.raises(ValueError, match="initial_state not contiguous"):
        op(q, q, v, g, beta, 1.0, torch.randn(1, 2, 16, 16).transpose(-1, -2), False, None, False)
    from hymo.models.gdn_conv_triton import conv_silu_norm_fwd  # the prelude's: w column-major, x with channels apart
    x, w = torch.randn(1, 8, 2 * (16 + 16 + 16)), torch.randn(96, 4)
    with pytest.raises(ValueError, match="w torch.float32 strides \\(1, 96\\).*call triton_conv_silu_norm"):
        conv_silu_norm_fwd(x, w.t().contiguous().t(), 2, 16, None)
    with pytest.raises(ValueError, match="channel stride 1"):
        conv_silu_norm_fwd(x.transpose(1, 2).contiguous().transpose(1, 2), w, 2, 16, None)
    with pytest.raises(ValueError, match="w torch.bfloat16"):
        conv_silu_norm_fwd(x, w.bfloat16(), 2, 16, None)


def test_strided_values_and_bf16_gates_or_state_match_the_loop(errors):
    """q, k, v with T outside H (heads of 16 need no padding, so only the wrapper's copy makes them row-major), bf16 gates
    and a bf16 initial state: every gradient comes back in its input's dtype, within that dtype's rounding of the loop."""
    _check(errors["strided"]["err"], 1e-4)
    for name, tol, low in (("bf16_gates", 1e-2, {"dg", "dbeta"}), ("bf16_state", 1e-2, {"dh0"}), ("bf16_values", 3e-2, {"o", "dq", "dk", "dv"})):
        r = errors[name]
        _check(r["err"], tol)
        assert {n for n, d in r["dtype"].items() if d == "bfloat16"} == low, (name, r["dtype"])
    assert errors["bf16_state"]["dtype"]["ht"] == "float32"  # the final state is fp32 whatever the initial one


def test_scale_zero_and_empty_sequences(errors):
    "scale=0.0 is a scale (the output is zero), not 'use the default'; T = 0 returns no output and the state it was given."
    assert errors["scale_0"] == 0.0
    t0 = errors["T_0"]
    assert t0["o"] == [1, 0, 2, 16] and t0["carried"] == 0.0 and t0["fresh"] == 0.0 and t0["fresh_shape"] == [1, 2, 16, 16]


def test_keep_prep_saves_kernel_1_for_the_backward(errors):
    "With keep_prep the backward reuses the forward's gates and A (kernel 1 runs once); without, it runs them again."
    assert errors["prep_calls"] == {"True": [1, 1], "False": [1, 2]}, errors["prep_calls"]


def test_operator_passes_opcheck_with_a_state_and_a_final_state(errors):
    checks = errors["opcheck_state"]
    assert checks and all(v == "SUCCESS" for v in checks.values()), checks


def test_offsets_of_the_chunk_states_and_a_cpu_without_the_interpreter_are_refused():
    import hymo.models.gdn_triton as gt
    from hymo.models.gdn_triton import triton_gated_delta_rule
    big = lambda *s: torch.zeros(1, 1, 1, *s[3:]).expand(*s) if len(s) == 4 else torch.zeros(1, 1, 1).expand(*s)  # no memory
    B, T, H, D = 1, 2 ** 23, 1, 128  # [B, T, H, 128] fits int32; the chunk states, T/64 of [128, 128], reach 2**31
    with pytest.raises(ValueError, match="the per-chunk states .* int32 offsets"):
        triton_gated_delta_rule(big(B, T, H, D), big(B, T, H, D), big(B, T, H, D), big(B, T, H), big(B, T, H))
    if gt.INTERPRET: pytest.skip("this process runs kernels in the interpreter")
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1"):
        triton_gated_delta_rule(q, q, q, -torch.rand(1, 8, 2), torch.rand(1, 8, 2))


def test_keeping_gates_and_A_changes_nothing(errors):
    """`keep_prep=True` saves kernel 1's results for the backward instead of recomputing them: the same numbers, bit for bit
    (so the loop comparisons above, made with the default, cover it)."""
    assert errors["keep_prep_vs_recompute"] == 0.0


def test_operators_pass_opcheck(errors):
    "torch.library.opcheck on `hymo::gdn_chunk_fwd` (and through its autograd, `gdn_chunk_bwd`), keeping gc and A or not."
    for kp, checks in errors["opcheck"].items():
        assert checks and all(v == "SUCCESS" for v in checks.values()), (kp, checks)


def test_kernel_1_compiles_for_the_h200_without_spilling(tmp_path):
    """benchmarks/gdn_registers.py compiles the kernels for sm_90 here, without a GPU, and reads ptxas's report.
    Kernel 1 (the row-by-row block solve) fits its registers; a variant that doubled in tf32x3 spilled."""
    import os, subprocess, sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "gdn_registers.py"), "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    (table,) = json.loads((tmp_path / "r.json").read_text()).values()
    k = table["kernels"]
    assert set(k) == {"prep (gates, A)", "state pass + o, saving S_0", "dS pass (S_0 kept)", "local grads",
                      "local grads, fp32 at K = V = 128"}
    assert all(0 < r["registers"] <= 255 for r in k.values())
    assert k["prep (gates, A)"]["spill_store_bytes"] == 0, k["prep (gates, A)"]
    # fp32 heads of 128 (not HyMo's) take the local kernel's other order: the default asked the H200 for 256 KiB of shared memory
    assert all(r["shared_bytes"] <= 232448 for r in k.values()), {n: r["shared_bytes"] for n, r in k.items()}


@pytest.mark.parametrize("kernel, part", [("_bwd_local_kernel", "backward"), ("_bwd_states_kernel", "backward"),
                                          ("_fwd_kernel", "forward"), ("_prep_kernel", "forward"),
                                          ("_fused_recurrent_kernel", "decoding kernel")])
def test_a_kernel_too_big_for_the_gpu_says_what_to_do(errors, kernel, part):
    msg = errors["too_big " + kernel]
    assert f"the GDN {part} does not fit this GPU for torch.float32 heads of K=16, V=16" in msg, msg
    assert "Heads of 128 or less fit" in msg and "gdn_kernel='torch'" in msg, msg


# From mutation testing of the wrappers: chunk tables, grid and int32 bounds of packed rows, no_grad decoding,
# the final state's dtype, the fake shapes of packed rows, heads narrower than tl.dot's 16.


def _big(*s):  # no memory: every element is the same one (the checks refuse before any launch)
    return torch.zeros(1, 1, 1, *s[3:]).expand(*s) if len(s) == 4 else torch.zeros(1, 1, 1).expand(*s)


def test_packed_rows_are_bounded_by_their_documents():
    "With cu_seqlens the grids' second axis is documents x heads, and each document may add a part-chunk of states."
    from hymo.models.gdn_triton import triton_gated_delta_rule
    T, H = 4096, 16  # 4096 one-token documents x 16 heads = 65 536 programs
    with pytest.raises(ValueError, match="4096 sequences x 16 heads"):
        triton_gated_delta_rule(_big(1, T, H, 16), _big(1, T, H, 16), _big(1, T, H, 16), _big(1, T, H), _big(1, T, H),
                                cu_seqlens=torch.arange(T + 1))
    T, D = 2 ** 23 - 64, 128  # 131 071 chunks of [128, 128] states fit int32; two documents' part-chunks do not
    with pytest.raises(ValueError, match="per-chunk states"):
        triton_gated_delta_rule(_big(1, T, 1, D), _big(1, T, 1, D), _big(1, T, 1, D), _big(1, T, 1), _big(1, T, 1),
                                cu_seqlens=torch.tensor([0, 1, T]))


def test_chunk_tables_of_documents_that_fill_whole_chunks():
    "(document, chunk) per slot: a 64-token document is one chunk; spare slots point at the last document."
    from hymo.models.gdn_triton import _chunk_tables
    idx, off, nc = _chunk_tables(torch.tensor([0, 64, 128, 130]), 1, 130)
    assert off.tolist() == [0, 1, 2, 3] and nc == 4
    assert idx.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]]


def test_fused_recurrent_refuses_a_state_that_wants_gradients_but_runs_under_no_grad():
    from hymo.models.gdn_triton import fused_recurrent_gated_delta_rule
    q = torch.randn(1, 1, 1, 16)
    g, beta, h0 = -torch.rand(1, 1, 1), torch.rand(1, 1, 1), torch.randn(1, 1, 16, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        fused_recurrent_gated_delta_rule(q, q, q, g, beta, initial_state=h0)


GAPS_CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, torch.nn.functional as F
    import hymo.models.gdn_triton as gt
    res = {}
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, 3, 1, 16, generator=gen), dim=-1)
    with torch.no_grad():  # decoding with leaves that require grad, under no_grad, as the message advises
        o, _ = gt.fused_recurrent_gated_delta_rule(q.requires_grad_(), q, q, -torch.rand(1, 3, 1), torch.rand(1, 3, 1))
    res["no_grad_decode"] = list(o.shape)
    # fp16 inputs: the final state stays fp32
    x = torch.randn(1, 20, 1, 16, generator=gen).half()
    _, ht = gt.triton_gated_delta_rule(x, x, x, -torch.rand(1, 20, 1), torch.rand(1, 20, 1), output_final_state=True)
    res["ht_fp16"] = str(ht.dtype)
    x = torch.zeros(1, 0, 2, 16)  # T = 0: the final state is fp32 whatever the initial state's dtype, as for T > 0
    _, S = gt.triton_gated_delta_rule(x, x, x, torch.zeros(1, 0, 2), torch.zeros(1, 0, 2),
                                      initial_state=torch.randn(1, 2, 16, 16).bfloat16(), output_final_state=True)
    res["ht_T0_bf16_state"] = str(S.dtype)
    h0 = torch.randn(1, 2, 16, 16)  # T = 0 with an fp32 state that needs no padding: still a new tensor, not the caller's
    _, S = gt.triton_gated_delta_rule(x, x, x, torch.zeros(1, 0, 2), torch.zeros(1, 0, 2), initial_state=h0,
                                      output_final_state=True)
    res["ht_T0_is_new"] = S.data_ptr() != h0.data_ptr() and torch.equal(S, h0)
    # the operator's fake shapes on a packed row with saved prep (N != B, chunk slots from the documents)
    cu = torch.tensor([0, 10, 20]).int()
    args = gt._prepare_inputs(*(torch.randn(1, 20, 1, 16, generator=gen) for _ in range(3)), -torch.rand(1, 20, 1),
                              torch.rand(1, 20, 1), None, torch.randn(2, 1, 16, 16), cu)
    res["opcheck_packed"] = torch.library.opcheck(torch.ops.hymo.gdn_chunk_fwd.default,
        (*args[:6], args[6], True, args[7], True), test_utils=("test_schema", "test_faketensor"))
    x8 = torch.randn(1, 4, 1, 8)  # heads narrower than tl.dot's 16 are padded to 16 (the interpreter would not notice 8)
    res["padded_8"] = [t.shape[-1] for t in gt._prepare_inputs(x8, x8, x8, -torch.rand(1, 4, 1), torch.rand(1, 4, 1),
                                                               None, torch.randn(1, 1, 8, 8), None)[:3]]
    print("RESULT" + json.dumps(res))
''')


def test_decode_under_no_grad_final_state_dtype_and_packed_fake_shapes():
    r = run_child(GAPS_CHILD)
    assert r["no_grad_decode"] == [1, 3, 1, 16]
    assert r["ht_fp16"] == r["ht_T0_bf16_state"] == "torch.float32" and r["ht_T0_is_new"]
    assert all(v == "SUCCESS" for v in r["opcheck_packed"].values()), r["opcheck_packed"]
    assert r["padded_8"] == [16, 16, 16], r["padded_8"]
