"""benchmarks/gdn_verify.py's decisions on CPU, with stand-ins for the Triton rules (the fp32 loop, made wrong in one
named tensor): which tensor each error is of, what the determinism, finiteness and keep_prep checks report, which cases
`main` runs, its summary and its verdict (exit 1 when a case fails). From mutation testing: none of these was tested."""
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import gdn_verify as gv  # noqa: E402
from hymo.models.gdn import naive_gated_delta_rule  # noqa: E402

GRAD_OF = {"dq": 0, "dk": 1, "dv": 2, "dg": 3, "dbeta": 4, "dh0": 5}


class GradScale(torch.autograd.Function):
    "Identity forward; the gradient scaled by `f` (NaN: one element made NaN)."
    @staticmethod
    def forward(ctx, x, f): ctx.f = f; return x.view_as(x)

    @staticmethod
    def backward(ctx, gr):
        gr = gr.clone()
        if ctx.f == "nan": gr.view(-1)[0] = float("nan")
        else: gr = gr * ctx.f
        return gr, None


def make_rule(bad=None, kept_bad=None, noisy_after=None):
    """A stand-in for the Triton rule: the fp32 loop on upcast inputs, output in v's dtype. `bad`/`kept_bad` (the call
    without / with keep_prep=True): {name: factor or 'nan'} for a forward output (o, ht: forward only) or a gradient
    (dq..dh0: backward only). `noisy_after`: calls after this many get o off by 1e-6 relative (nondeterminism)."""
    calls = [0]

    def rule(q, k, v, g, beta, scale=None, h0=None, final=False, cu=None, keep_prep=False):
        calls[0] += 1
        spec = (kept_bad if keep_prep else bad) or {}
        ins = [q, k, v, g, beta, h0]
        for n, f in spec.items():
            if n in GRAD_OF and ins[GRAD_OF[n]].requires_grad: ins[GRAD_OF[n]] = GradScale.apply(ins[GRAD_OF[n]], f)
        q, k, v2, g, beta, h0 = ins
        o, ht = naive_gated_delta_rule(q.float(), k.float(), v2.float(), g, beta, scale, h0, final, cu)
        for n, t in (("o", o), ("ht", ht)):
            if n in spec:
                f = spec[n]
                d = torch.full_like(t, float("nan")) if f == "nan" else (f - 1) * t.detach()
                if n == "o": o = o + d
                else: ht = ht + d
        if noisy_after is not None and calls[0] > noisy_after: o = o + 1e-6 * o.detach().abs().max()
        return o.to(v.dtype), ht
    return rule


def parity(monkeypatch, rule, dtype=torch.float32, cu=None):
    monkeypatch.setattr(gv, "triton_gated_delta_rule", rule)
    if cu is None: return gv.parity(1, 63, 2, 16, 16, dtype, seed=1)
    return gv.parity(1, int(cu[-1]), 1, 8, 8, dtype, cu=cu, seed=1)


def test_a_faithful_rule_passes_with_every_tensor_reported(monkeypatch):
    res = parity(monkeypatch, make_rule())
    assert set(gv.NAMES) <= set(res) and all(res[n] < 1e-6 for n in gv.NAMES), res
    assert res["deterministic"] is True and res["finite"] is True
    assert res["keep_prep_worst"] < 1e-6 and res["keep_prep_max_abs_vs_recompute"] == 0.0


@pytest.mark.parametrize("name", ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"])
def test_each_error_is_that_tensors_against_the_reference(monkeypatch, name):
    "A rule 10 % off in one tensor: that tensor's relative error is 0.1 (relative to the reference), the others ~0."
    res = parity(monkeypatch, make_rule(bad={name: 1.1}))
    assert res[name] == pytest.approx(0.1, rel=1e-3), (name, res)
    assert all(res[n] < 1e-6 for n in gv.NAMES if n != name), (name, res)


def test_a_wrong_backward_through_the_final_state_is_caught(monkeypatch):
    "The loss weights the final state too: a rule whose gradient from ht is wrong shows in the input gradients."
    class HtGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x): return x.view_as(x)
        @staticmethod
        def backward(ctx, gr): return gr * 1.5

    def rule(*a, **kw):
        o, ht = make_rule()(*a, **kw)
        return o, HtGrad.apply(ht)
    res = parity(monkeypatch, rule)
    assert res["o"] < 1e-6 and res["ht"] < 1e-6 and res["dk"] > 0.01 and res["dg"] > 0.01, res


def test_packed_documents_compare_every_tensor(monkeypatch):
    cu = torch.tensor([0, 1, 20, 40])
    res = parity(monkeypatch, make_rule(bad={"dh0": 1.1}), cu=cu)
    assert res["dh0"] == pytest.approx(0.1, rel=1e-3) and res["o"] < 1e-6, res


def test_the_reference_is_the_fp32_loop_on_the_rounded_inputs(monkeypatch):
    "In fp16 a faithful rule differs from the fp32 loop by the output's rounding only (~1e-4), not by the inputs'."
    res = parity(monkeypatch, make_rule(), dtype=torch.float16)
    assert 0 < res["o"] < 1e-3 and all(res[n] < 1e-3 for n in gv.NAMES), res


def test_nondeterminism_is_reported(monkeypatch):
    res = parity(monkeypatch, make_rule(noisy_after=1))
    assert res["deterministic"] is False, res


def test_a_non_finite_gradient_is_reported(monkeypatch):
    res = parity(monkeypatch, make_rule(bad={"dq": "nan"}))
    assert res["finite"] is False and math.isnan(res["dq"]), res


def test_keep_prep_is_the_worst_tensor_of_the_kept_path(monkeypatch):
    res = parity(monkeypatch, make_rule(kept_bad={"dk": 1.1}))
    assert all(res[n] < 1e-6 for n in gv.NAMES)
    assert res["keep_prep_worst"] == pytest.approx(0.1, rel=1e-3), res
    assert res["keep_prep_max_abs_vs_recompute"] > 0


def test_keep_prep_difference_is_absolute(monkeypatch):
    "A kept final state lower than the recomputed one everywhere: the largest |difference| is positive."
    def rule(*a, keep_prep=False, **kw):
        o, ht = make_rule()(*a, **kw)
        return o, (ht - 1.0 if keep_prep else ht)
    res = parity(monkeypatch, rule)
    assert res["keep_prep_max_abs_vs_recompute"] == pytest.approx(1.0, rel=1e-5), res


def test_a_nan_in_the_kept_path_is_reported(monkeypatch):
    "keep_prep=True is the model's path; a NaN in one of its gradients must not vanish in Python's max."
    res = parity(monkeypatch, make_rule(kept_bad={"dk": "nan"}))
    assert math.isnan(res["keep_prep_worst"]) and res["finite"] is False, res
    assert gv.failures([dict(res, kind="chunk", dtype="float32", T=63, K=16)])


def test_decay_regimes():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    weak = gv.decay("weak", 1, 64, 4, r, gen)
    assert 0.9 < weak.sum(1).exp().mean() < 0.97  # "a chunk keeps 0.94 of its state"
    strong = gv.decay("strong", 1, 64, 4, r, gen)
    assert strong.sum(1).exp().max() < 1e-6  # a chunk keeps almost nothing
    init = gv.decay("init", 1, 64, 4, r, gen)
    assert (init <= 0).all() and init.min() > -16 * 0.1 * 1.5


def run_main(monkeypatch, tmp_path, capsys, argv=(), rule=None, fused=None):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # need_gpu's CPU smoke-run switch; the rules here are stand-ins
    monkeypatch.setattr(gv, "triton_gated_delta_rule", rule or make_rule())
    monkeypatch.setattr(gv, "fused_recurrent_gated_delta_rule", fused or make_rule())
    out = tmp_path / "v.json"
    monkeypatch.setattr(sys, "argv", ["gdn_verify.py", "--out", str(out), *argv])
    try: gv.main(); status = 0
    except SystemExit as e: status = e.code
    captured = capsys.readouterr()
    assert (status == 1) == ("FAILED" in captured.err), (status, captured.err)
    return json.loads(out.read_text())["rows"], captured.out, status


def worst_of(stdout):
    return float(re.search(r"^worst: \(([^,]+),", stdout, re.M).group(1))


def test_main_runs_every_case(monkeypatch, tmp_path, capsys):
    rows, out, status = run_main(monkeypatch, tmp_path, capsys)
    cases = sorted((r["kind"], r["dtype"], r.get("decays")) for r in rows)
    assert cases == sorted([("chunk", d, k) for d in ("float16", "float32") for k in ("strong", "init", "weak")]
                           + [("chunk_varlen", d, None) for d in ("float16", "float32")]
                           + [("fused_recurrent", d, None) for d in ("float16", "float32")]), cases
    assert worst_of(out) < 1e-3 and status == 0 and "passed: all 10 cases" in out


def test_main_reports_the_worst_error(monkeypatch, tmp_path, capsys):
    rows, out, status = run_main(monkeypatch, tmp_path, capsys, rule=make_rule(bad={"dv": 1.1}))
    assert worst_of(out) == pytest.approx(0.1, rel=1e-2) and status == 1, out[-600:]


def test_main_checks_the_fused_recurrent_kernel(monkeypatch, tmp_path, capsys):
    rows, out, status = run_main(monkeypatch, tmp_path, capsys, fused=make_rule(bad={"o": 1.1}))
    fr = [r for r in rows if r["kind"] == "fused_recurrent"]
    assert fr and all(r["o"] == pytest.approx(0.1, rel=1e-2) for r in fr) and worst_of(out) == pytest.approx(0.1, rel=1e-2)
    assert status == 1


def test_main_worst_sees_a_nan(monkeypatch, tmp_path, capsys):
    rows, out, status = run_main(monkeypatch, tmp_path, capsys, argv=["--decays", "strong"], rule=make_rule(bad={"dg": "nan"}))
    assert worst_of(out) == math.inf and status == 1, out[-600:]


def test_main_marks_a_nondeterministic_row(monkeypatch, tmp_path, capsys):
    # each parity calls the rule 3 times; noisy after call 1 makes every case's second run differ from its first
    rows, out, status = run_main(monkeypatch, tmp_path, capsys, argv=["--decays", "strong"], rule=make_rule(noisy_after=1))
    assert "NONDETERMINISTIC/NONFINITE" in out and status == 1


def test_main_refuses_an_unknown_shape(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["gdn_verify.py", "--shapes", "hymo,wdie"])
    with pytest.raises(SystemExit) as e: gv.main()
    assert e.value.code == 2


def test_main_fails_when_a_case_is_far_off(monkeypatch, tmp_path, capsys):
    "A verifier must not exit 0 for a kernel 10 % off (h200_train_step.sh's `kernels` part only sees the exit status)."
    rows, out, status = run_main(monkeypatch, tmp_path, capsys, argv=["--decays", "strong"], rule=make_rule(bad={"o": 1.1}))
    assert status == 1 and rows  # the rows are written all the same


def test_gdn_verify_names_each_way_a_case_fails():
    "Over the tolerance (NaN too), not bit-for-bit repeatable, not finite, the kept-prep path differing: each is a failure."
    ok = dict(kind="chunk", decays="strong", dtype="bfloat16", T=63, K=32, deterministic=True, finite=True,
              keep_prep_worst=5e-3, keep_prep_max_abs_vs_recompute=0.0, **{n: 5e-3 for n in gv.NAMES})
    assert gv.failures([ok, {**ok, "dtype": "float32", "dk": 9e-3}]) == []
    for change, says in ((dict(dg=0.021), "dg 2.1e-02"), (dict(dtype="float32", o=0.011), "o 1.1e-02"),
                         (dict(dbeta=float("nan")), "dbeta nan"), (dict(keep_prep_worst=0.03), "keep_prep_worst 3.0e-02"),
                         (dict(deterministic=False), "not deterministic"), (dict(finite=False), "not finite"),
                         (dict(keep_prep_max_abs_vs_recompute=1e-7), "keep_prep differs from recomputing")):
        bad = gv.failures([ok, {**ok, **change}])
        assert len(bad) == 1 and says in bad[0], (change, bad)
