"""One cross-entropy chunk at the 750M shape on a GPU (4 177 rows x 64 256 classes, bf16 logits): parity of
the Triton kernel (chapter 42) against the fp32 `ce_chunk`, and its time against `torch.compile(ce_chunk)`,
with a small sweep of block width and warps.

    python benchmarks/ce_kernel.py --out /tmp/ce_kernel.json [--sweep]   # a scratch file; copy what you keep to benchmarks/results/
"""
import argparse
import json

import torch

from need_gpu import check_out, need_gpu, need_triton, provenance  # the script beside this one

need_triton()
from triton.testing import do_bench  # noqa: E402

import hymo.models.ce_triton as ce  # noqa: E402
from hymo.models.mtp import _compiled_ce_chunk, ce_chunk  # noqa: E402

V = 64256
ROWS = 2 ** 28 // V  # linear_cross_entropy's default chunk: about 1 GB of fp32 logits


def inputs(seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    z = (torch.randn(ROWS, V, device="cuda", generator=gen) * 2).bfloat16()
    y = torch.randint(0, V, (ROWS,), device="cuda", generator=gen)
    w = torch.full((ROWS,), 1 / ROWS, device="cuda")
    return z, y, w


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sweep", action="store_true", help="also time block widths 1024-8192 x 4, 8, 16 warps, then time the fastest")
    args = ap.parse_args()
    check_out(ap, args.out)
    need_gpu("tests/test_ce_triton.py checks the kernel through Triton's interpreter")
    z, y, w = inputs()
    res = dict(meta=dict(**provenance(), device=torch.cuda.get_device_name(), rows=ROWS, classes=V,
                         timer="triton.testing.do_bench, median, ms"))
    lr, gr = ce_chunk(z.float(), y, w, True)
    for key, fn in (("parity", ce.triton_ce_chunk), ("parity_compiled", _compiled_ce_chunk())):
        lo, go = fn(z, y, w, True)
        res[key] = dict(loss=abs(lo.item() - lr.item()) / abs(lr.item()), dz=((go.float() - gr).norm() / gr.norm()).item())
    print(json.dumps(res, indent=1), flush=True)
    if args.sweep:
        times, configs = {}, {f"BV={bv} num_warps={nw}": dict(BV=bv, num_warps=nw) for bv in (1024, 2048, 4096, 8192)
                                                                                  for nw in (4, 8, 16)}
        for name, cfg in configs.items():
            ce.LAUNCH.update(cfg)
            try: times[name] = do_bench(lambda: ce.triton_ce_chunk(z, y, w, True), return_mode="median")
            except Exception as e: times[name] = repr(e)[:120]
        ok = [n for n, t in times.items() if isinstance(t, float)]
        if not ok: raise SystemExit("every sweep setting failed on this GPU:\n" + "\n".join(f"  {n}: {t}" for n, t in times.items()))
        best = min(ok, key=times.get)
        res["sweep"] = dict(times, best=best)
        ce.LAUNCH.update(configs[best])
        print("sweep:", json.dumps(res["sweep"], indent=1), flush=True)
    res["launch_timed"] = dict(ce.LAUNCH)
    mb = 2 * ROWS * V * 2 / 1e6  # one read of z, one write of dz (bf16)
    for name, fn in (("triton", ce.triton_ce_chunk), ("compiled", _compiled_ce_chunk())):
        res[f"{name}_ms"] = do_bench(lambda: fn(z, y, w, True), return_mode="median")
        res[f"{name}_TBps"] = mb / 1e6 / (res[f"{name}_ms"] / 1e3)
    print(json.dumps({k: v for k, v in res.items() if k.endswith(("_ms", "_TBps"))}, indent=1))
    if args.out:
        with open(args.out, "w") as f: json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
