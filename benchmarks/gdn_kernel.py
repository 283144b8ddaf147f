"""Time the gated delta rule on one GPU: Triton kernels, the PyTorch chunked path, the naive loop.

    python benchmarks/gdn_kernel.py --out /tmp/gdn_kernel.json [--sweep]   # a scratch file; copy what you keep

Shapes: HyMo 750M's GDN layer (B=4, T=4096, H=40, K=V=32) and a wide-head one (B=4, T=4096, H=16,
K=V=128), bf16. Median times from `triton.testing.do_bench`; forward alone, and forward + backward
(`o.backward(do)`). The naive loop is timed at a short T and scaled linearly to T=4096 (its cost is
linear in T), and says so. Also: the time of each Triton launch, the peak memory of a forward +
backward, and with --sweep a few launch configurations.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from need_gpu import check_out, need_gpu, need_triton, provenance  # the script beside this one

need_triton()
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hymo.models.gdn_triton as gt  # noqa: E402
from hymo.models.gdn import chunk_gated_delta_rule_torch, naive_gated_delta_rule  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: only a smoke run of this script (TRITON_INTERPRET=1, tiny shapes)
SHAPES = {"hymo_750m": (4, 4096, 40, 32, 32), "wide_heads": (4, 4096, 16, 128, 128)}


def inputs(B, T, H, K, V, dtype=torch.bfloat16, grad=False):
    q = F.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=DEV, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device=DEV) + 3)
    beta = torch.rand(B, T, H, device=DEV)
    xs = [q, k, v, g, beta]
    return [x.requires_grad_(grad) for x in xs]


def t_fwd(rule, xs, **kw):
    with torch.no_grad():
        return do_bench(lambda: rule(*xs), return_mode="median", **kw)


def t_fwd_bwd(rule, xs, **kw):
    do = torch.randn_like(xs[2])
    def step():
        o, _ = rule(*xs)
        o.backward(do)
    return do_bench(step, grad_to_none=xs, return_mode="median", **kw)


def peak_memory(rule, xs):
    "Peak bytes allocated above the inputs and dO during one forward + backward, and the inputs + outputs bytes."
    do = torch.randn_like(xs[2])
    for x in xs: x.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, _ = rule(*xs)
    o.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    io = sum(x.numel() * x.element_size() for x in xs) + o.numel() * o.element_size()
    return peak, io


def kernel_breakdown(xs):
    "Median time of each launch of a forward + backward (ms)."
    q, k, v, g, beta = [x.detach() for x in xs]
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5
    tables = gt._chunk_tables(None, B, T)
    gc, A = gt._prepare(k, g, beta, None, tables)
    do = torch.randn_like(v)
    hs, dh = q.new_empty(B * triton.cdiv(T, gt.BT), H, K, V), q.new_empty(B * triton.cdiv(T, gt.BT), H, K, V)
    BV = gt._bv(V)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)

    def states(n_d, only_ds=0):
        gt._bwd_states_kernel[(triton.cdiv(V, BV), B * H, n_d)](q, k, v, gc, beta, A, None, hs, do, None, None, dh, None, None, scale, T,
                                                               H, K, V, gt.BT, BV, False, False, False, False, only_ds,
                                                               **gt._state_launch("states", K, V))

    def local():
        gt._bwd_local_kernel[(triton.cdiv(T, gt.BT), B * H)](q, k, v, gc, beta, A, hs, dh, do, dq, dk, dv, dg, dbeta, None, None,
                                                            None, scale, T, H, K, V, gt.BT, gt._bv_local(K, V), False, gt._hold_local(K, q.dtype),
                                                            **gt.LAUNCH["local"])
    states(2)
    return {
        "prep (gates, A)": do_bench(lambda: gt._prepare(k, g, beta, None, tables), return_mode="median"),
        "state pass + o": do_bench(lambda: gt._chunk_fwd(q, k, v, gc, beta, A, scale, None, False, None, None), return_mode="median"),
        "S and dS passes": do_bench(lambda: states(2), return_mode="median"),
        "state pass + o, saving S_0": do_bench(lambda: gt._chunk_fwd(q, k, v, gc, beta, A, scale, None, False, None, None, True),
                                               return_mode="median"),
        "S pass alone": do_bench(lambda: states(1), return_mode="median"),
        "dS pass alone (S_0 kept)": do_bench(lambda: states(1, 1), return_mode="median"),
        "local grads": do_bench(local, return_mode="median"),
    }


def full_timings(r: dict, xs, xg, T, nT):
    "Forward and forward + backward of the Triton rule, the PyTorch chunked path and the loop (at nT, scaled); peak memory; the launches."
    r["triton_fwd_ms"] = t_fwd(gt.triton_gated_delta_rule, xs)
    r["triton_fwd_bwd_ms"] = t_fwd_bwd(gt.triton_gated_delta_rule, xg)
    r["torch_chunk_fwd_ms"] = t_fwd(chunk_gated_delta_rule_torch, xs)
    r["torch_chunk_fwd_bwd_ms"] = t_fwd_bwd(chunk_gated_delta_rule_torch, xg)
    xn, xng = [x[:, :nT].contiguous() for x in xs], [x[:, :nT].detach().contiguous().requires_grad_() for x in xg]
    r["naive_T_measured"] = nT  # (1 <= nT <= T, checked in main)
    r["naive_fwd_ms_extrapolated"] = t_fwd(naive_gated_delta_rule, xn, warmup=5, rep=50) * T / nT
    r["naive_fwd_bwd_ms_extrapolated"] = t_fwd_bwd(naive_gated_delta_rule, xng, warmup=5, rep=50) * T / nT
    peak, io = peak_memory(gt.triton_gated_delta_rule, xg)
    r.update(triton_fwd_bwd_peak_MB=peak / 2**20, inputs_outputs_MB=io / 2**20, peak_over_io=peak / io)  # MiB, as named since 2026-12-02
    tpeak, _ = peak_memory(chunk_gated_delta_rule_torch, xg)
    r["torch_chunk_fwd_bwd_peak_MB"] = tpeak / 2**20
    r["triton_kernels_ms"] = kernel_breakdown(xs)


def safe(f):
    "Run a sweep point; a configuration that does not compile or fit is recorded, not fatal."
    try: return f()
    except Exception as e: return {"error": repr(e)[:200]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time a few launch configurations of each kernel")
    ap.add_argument("--kernels-only", action="store_true", help="only the Triton launches (and --sweep): no PyTorch path, loop or memory")
    ap.add_argument("--naive-T", type=int, default=256, help="tokens the loop is timed on (its time is scaled to T; default 256)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(
        f"{n} (B, T, H, K, V = {', '.join(map(str, s))})" for n, s in SHAPES.items()))
    args = ap.parse_args()
    bad = set(args.shapes.split(",")) - set(SHAPES)
    if bad: ap.error(f"--shapes: unknown {sorted(bad)}; choose from {', '.join(SHAPES)} (comma-separated)")
    T_min = min(SHAPES[n][1] for n in args.shapes.split(","))
    if not 1 <= args.naive_T <= T_min: ap.error(f"--naive-T {args.naive_T}: give 1 to {T_min} (the shapes' T), the tokens the loop is timed on")
    check_out(ap, args.out)
    need_gpu("tests/test_bench_gdn.py runs its launches through Triton's interpreter")
    results = dict(meta=dict(**provenance(), device=torch.cuda.get_device_name(), dtype="bfloat16",
                             timer="triton.testing.do_bench, median, ms"),
                   shapes={})
    for name in args.shapes.split(","):
        B, T, H, K, V = SHAPES[name]
        r = dict(B=B, T=T, H=H, K=K, V=V)
        xs = inputs(B, T, H, K, V)
        xg = inputs(B, T, H, K, V, grad=True)
        if args.kernels_only: r["triton_kernels_ms"] = kernel_breakdown(xs)
        else: full_timings(r, xs, xg, T, args.naive_T)
        if args.sweep:
            sweep = {}
            saved_launch, saved_bv = {k: dict(v) for k, v in gt.LAUNCH.items()}, gt._bv
            # BV=16 < V, and 8 warps at K = V = 32, end in an illegal memory access on the H200 under Triton 3.6 (chapter 13),
            # which breaks the CUDA context for the rest of the sweep: left out
            for bv, w in ((32, 2), (32, 4), (64, 4), (128, 8)):
                if bv > V: continue
                gt._bv = lambda V, bv=bv: min(V, bv)
                for kname in ("fwd", "states"): gt.LAUNCH[kname] = dict(num_warps=w)
                sweep[f"BV={bv},warps={w}"] = safe(lambda: {n: t for n, t in kernel_breakdown(xs).items() if n in ("state pass + o", "S and dS passes")})
            gt._bv = saved_bv
            for kname, v in saved_launch.items(): gt.LAUNCH[kname] = v
            for w in (2, 4, 8):
                for st in ((None, 1, 2, 3) if w >= 4 else (None,)):
                    for kname in ("prep", "local"): gt.LAUNCH[kname] = dict(num_warps=w, **({} if st is None else dict(num_stages=st)))
                    sweep[f"prep/local warps={w}" + (f" stages={st}" if st else "")] = safe(
                        lambda: {n: t for n, t in kernel_breakdown(xs).items() if n in ("prep (gates, A)", "local grads")})
            for kname, v in saved_launch.items(): gt.LAUNCH[kname] = v
            gt.LAUNCH["fwd"] = dict(num_warps=4, num_stages=1)
            sweep["fwd num_stages=1"] = safe(lambda: {"state pass + o": kernel_breakdown(xs)["state pass + o"]})
            for kname, v in saved_launch.items(): gt.LAUNCH[kname] = v
            r["sweep"] = sweep
        results["shapes"][name] = r
        print(json.dumps({name: r}), flush=True)
        del xs, xg
        torch.cuda.empty_cache()
    if args.out: Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'shape':12s} {'path':14s} {'fwd ms':>9s} {'fwd+bwd ms':>11s}")
    for name, r in results["shapes"].items():
        for path, a, b in () if args.kernels_only else (("triton", "triton_fwd_ms", "triton_fwd_bwd_ms"), ("torch chunked", "torch_chunk_fwd_ms", "torch_chunk_fwd_bwd_ms"),
                           (f"naive (x{r['T'] / r['naive_T_measured']:g})", "naive_fwd_ms_extrapolated", "naive_fwd_bwd_ms_extrapolated")):
            print(f"{name:12s} {path:14s} {r[a]:9.3f} {r[b]:11.3f}")
        if not args.kernels_only: print(f"{name:12s} triton fwd+bwd peak {r['triton_fwd_bwd_peak_MB']:.0f} MiB = {r['peak_over_io']:.2f} x inputs+outputs "
              f"({r['inputs_outputs_MB']:.0f} MiB); torch chunked peak {r['torch_chunk_fwd_bwd_peak_MB']:.0f} MiB")
        print(f"{name:12s} " + ", ".join(f"{k} {v:.3f}" for k, v in r["triton_kernels_ms"].items()))
        for k, v in r.get("sweep", {}).items(): print(f"   {k}: " + ", ".join(f"{a} {b:.3f}" if isinstance(b, float) else f"{a} {b}" for a, b in v.items()))


if __name__ == "__main__":
    main()
