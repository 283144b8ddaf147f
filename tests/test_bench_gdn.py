"""The GDN benchmarks still drive the kernels they time: their launches, on CPU through Triton's interpreter.

`benchmarks/gdn_kernel.py` and `benchmarks/gdn_prep_solve.py` call the kernels directly, with the kernels' own
argument lists; a kernel that gains an argument breaks them only on the GPU, where they run. Here gdn_kernel.py's
breakdown runs each launch once (its `do_bench` replaced by one call), and every way gdn_prep_solve.py times is checked
against float64.
"""
import textwrap

from _interpret import run_child

CHILD = textwrap.dedent('''
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, "benchmarks")
    import gdn_kernel as gk
    import gdn_prep_solve as ps
    res = {}
    # gdn_kernel.py: every launch of the breakdown, each run once
    gk.do_bench = lambda f, **kw: (f(), 0.0)[1]
    xs = gk.inputs(1, 128, 2, 32, 32, dtype=torch.float32)
    res["launches"] = sorted(gk.kernel_breakdown(xs))
    # gdn_prep_solve.py: each way to solve for A, against float64, on keys sharing a direction
    k, g, beta = ps.inputs(1, 128, 2, 32, torch.float32, common=1.0, seed=1)
    res["errors"] = {name: ps.error(k, g, beta, v)["fp32"] for name, v in ps.VARIANTS.items()}
    print("RESULT" + json.dumps(res))
''')


def test_gdn_benchmarks_launch_the_kernels_as_they_are_now():
    res = run_child(CHILD)
    assert res["launches"] == sorted(["prep (gates, A)", "state pass + o", "S and dS passes", "state pass + o, saving S_0",
                                      "S pass alone", "dS pass alone (S_0 kept)", "local grads"])
    err = res["errors"]
    for name in ("landed", "blocked subst, tf32x3", "blocked subst carrying (D-I)^T, tf32 (round 12)", "tile substitution",
                 "blocked series ieee, tf32"):
        assert err[name] < 1e-5, (name, err[name])  # the interpreter's products are fp32: every sound way is exact
    assert err["no solve"] > 0.5  # storing L instead of its inverse is caught


VERIFY = textwrap.dedent('''
    import contextlib, io, json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, "benchmarks")
    import gdn_verify as gv
    real = gv.triton_gated_delta_rule
    if FACTOR != 1:  # a wrong kernel: every output of the chunked rule FACTOR times too large
        gv.triton_gated_delta_rule = lambda *a, **k: tuple(None if t is None else t * FACTOR for t in real(*a, **k))
    sys.argv = ["gdn_verify.py", "--decays", "strong"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try: gv.main(); status = 0
        except SystemExit as e: status = e.code
    print("RESULT" + json.dumps({"status": status, "stderr": err.getvalue()}))
''')


def test_gdn_verify_fails_a_kernel_a_few_percent_off():
    "The verifier's verdict, with the real kernels in the interpreter: they pass; the same kernels 3 % off fail, each case named."
    res = run_child(VERIFY.replace("FACTOR", "1"))
    assert res["status"] == 0 and "FAILED" not in res["stderr"], res
    res = run_child(VERIFY.replace("FACTOR", "1.03"))
    assert res["status"] == 1 and "FAILED: 4 of 6 cases" in res["stderr"], res  # the chunked and packed cases; not the fused recurrent
    assert "chunk strong float32 T=63 K=16 V=16: o 3.0e-02, ht 3.0e-02" in res["stderr"], res
