"""The GDN prelude (short conv, SiLU, L2 norm of q and k) at the 750M shape on a GPU: parity of the Triton
kernels against the fp32 PyTorch prelude, and forward / forward+backward times against PyTorch eager and
`torch.compile`, with a small sweep of the kernels' tiles.

    python benchmarks/gdn_conv_kernel.py --out /tmp/gdn_conv_kernel.json [--sweep]   # a scratch file; copy what you keep
"""
import argparse
import json

import torch

from need_gpu import check_out, need_gpu, need_triton, provenance  # the script beside this one

need_triton()
from triton.testing import do_bench  # noqa: E402

import hymo.models.gdn_conv_triton as ct  # noqa: E402
from hymo.models.gdn import conv_silu_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: parity only, under TRITON_INTERPRET=1 (a smoke run)
B, T, H, K, V, W = 4, 4096, 40, 32, 32, 4  # hymo_750m: micro-batch 4 x 4096, 40 heads of 32
C = 2 * H * K + H * V
EXTRA = H * V + 2 * H  # the mixer's projection also holds g (HV), a and b (H each)


def inputs(seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    wide = torch.randn(B, T, C + EXTRA, device=DEV, generator=gen).bfloat16()   # qkv is a column slice of it
    w = torch.randn(C, W, device=DEV, generator=gen) * 0.5
    cots = [torch.randn(B, T, H, d, device=DEV, generator=gen).bfloat16() for d in (K, K, V)]
    return wide, w, cots


def fwd_bwd(fn, wide, w, cots):
    x, ww = wide.detach().requires_grad_(), w.detach().requires_grad_()
    ys = fn(x[..., :C], ww, H, K)[:3]
    torch.autograd.backward(ys, cots)
    return [*ys, x.grad[..., :C], ww.grad]


def parity() -> dict:
    "Relative RMSE of q, k, v, dx, dw: the kernels on bf16 inputs against the fp32 prelude on the same inputs."
    wide, w, cots = inputs()
    ref = fwd_bwd(conv_silu_norm, wide.float(), w, [c.float() for c in cots])
    out = fwd_bwd(ct.triton_conv_silu_norm, wide, w, cots)
    eager = fwd_bwd(conv_silu_norm, wide, w, cots)  # PyTorch in bf16, for scale
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    return {"triton_vs_fp32": {n: rel(o, r) for n, o, r in zip("q k v dx dw".split(), out, ref)},
            "pytorch_bf16_vs_fp32": {n: rel(o, r) for n, o, r in zip("q k v dx dw".split(), eager, ref)}}


def timings() -> dict:
    wide, w, cots = inputs()
    compiled = torch.compile(conv_silu_norm)
    res = {}
    for name, fn in (("triton", ct.triton_conv_silu_norm), ("pytorch_eager", conv_silu_norm), ("pytorch_compiled", compiled)):
        res[f"{name}_fwd_ms"] = do_bench(lambda: fn(wide[..., :C], w, H, K), return_mode="median")
        res[f"{name}_fwd_bwd_ms"] = do_bench(lambda: fwd_bwd(fn, wide, w, cots), return_mode="median")
    # what a layer must move at least: read x, write q k v; backward read x and dq dk dv, write dx (bf16)
    mb = B * T * C * 2 / 1e6
    res.update(bytes_fwd_MB=2 * mb, bytes_bwd_MB=3 * mb)
    res["triton_fwd_TBps"] = 2 * mb / 1e6 / (res["triton_fwd_ms"] / 1e3)
    dys = [c.reshape(B, T, -1) for c in cots]
    res["triton_bwd_ms"] = do_bench(lambda: ct.conv_silu_norm_bwd(wide[..., :C], w, H, K, None, *dys), return_mode="median")
    return res


def sweep() -> dict:
    """Median ms of the forward and of the backward operator for each tile and warp count, and the best of each.
    The backward's kernels are swept one after the other (du, then dx, then dw), each with the best of those before it."""
    wide, w, cots = inputs()
    out, saved = {}, {k: dict(v) for k, v in ct.LAUNCH.items()}
    dys = [c.reshape(B, T, -1) for c in cots]
    # G: heads per program of the forward and du kernels (their tile is [BT, G, head size]); 4 heads of 32 is the default
    grid = {"fwd": [dict(BT=bt, G=g, num_warps=nw) for bt in (4, 8, 16, 32) for g in (2, 4, 8, 16) for nw in (2, 4, 8)
                    if 2 <= bt * g // nw <= 64],
            "du": [dict(BT=bt, G=g, num_warps=nw) for bt in (4, 8, 16, 32) for g in (2, 4, 8, 16) for nw in (2, 4, 8)
                   if 2 <= bt * g // nw <= 64],
            "dx": [dict(BT=bt, BC=bc, num_warps=nw) for bt, bc, nw in ((32, 128, 4), (16, 128, 4), (32, 64, 4), (64, 128, 8),
                                                                        (16, 256, 4), (32, 256, 8), (8, 256, 4))],
            "dw": [dict(BT=bt, RT=rt, BC=bc, num_warps=nw) for bt in (8, 16) for rt in (128, 256, 512)
                   for bc in (64, 128) for nw in (4, 8)]}
    for kind, configs in grid.items():
        f = (lambda: ct.triton_conv_silu_norm(wide[..., :C], w, H, K)) if kind == "fwd" else \
            (lambda: ct.conv_silu_norm_bwd(wide[..., :C], w, H, K, None, *dys))
        times, by_name = {}, {}
        for cfg in configs:
            ct.LAUNCH[kind] = cfg
            name = f"{kind} " + " ".join(f"{k}={v}" for k, v in cfg.items())
            by_name[name] = cfg
            try: out[name] = times[name] = do_bench(f, return_mode="median")
            except Exception as e: out[name] = repr(e)[:120]
        out[f"best_{kind}"] = by_name[min(times, key=times.get)] if times else saved[kind]
        ct.LAUNCH[kind] = dict(out[f"best_{kind}"])   # the next kind is swept with this one's best
    ct.LAUNCH.update(saved)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time a few tile sizes of each kernel, then time the fastest")
    ap.add_argument("--best-out", default=None, help="with --sweep: write the fastest tiles here (train_step.py --conv-launch reads them)")
    args = ap.parse_args()
    if args.best_out and not args.sweep: ap.error("--best-out writes the sweep's fastest tiles: it needs --sweep")
    check_out(ap, args.out); check_out(ap, args.best_out, "--best-out")
    need_gpu("tests/test_gdn_conv_triton.py checks the kernels through Triton's interpreter")
    res = dict(meta=dict(**provenance(), device=torch.cuda.get_device_name(), shape=dict(B=B, T=T, H=H, K=K, V=V, W=W), launch={k: dict(v) for k, v in ct.LAUNCH.items()},
                         timer="triton.testing.do_bench, median, ms"))
    res["parity"] = parity()
    print(json.dumps(res["parity"], indent=1), flush=True)
    if args.sweep:
        res["sweep"] = sweep()
        best = {k: res["sweep"][f"best_{k}"] for k in ct.LAUNCH}
        print("fastest tiles:", best, flush=True)
        ct.LAUNCH.update(best)
        if args.best_out:
            with open(args.best_out, "w") as f: json.dump(best, f)
    res["launch_timed"] = {k: dict(v) for k, v in ct.LAUNCH.items()}
    res.update(timings())
    print(json.dumps({k: v for k, v in res.items() if k != "parity"}, indent=1))
    if args.out:
        with open(args.out, "w") as f: json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
