"""Host time to issue one call, in microseconds: a raw Triton launch, the GDN operators, and PyTorch for scale.

    python benchmarks/host_launch.py [--out results.json]

The GPU is first kept busy by a sleep of 200 M GPU cycles (about 0.1 s on an H200), so each loop of 60 calls only queues work and the
time measured is the host's alone (median of 5 loops). Shapes are the 750M model's
(B=4, T=4096, 40 heads of 32). Why it matters: a GPU waits whenever its host issues work more slowly
than the GPU does it, and chapter 14 moved the prelude's launches into inductor's generated code
because of this measurement.
"""
import argparse
import json
import time

import torch

from need_gpu import check_out, need_gpu, need_triton, provenance  # the script beside this one

need_triton()
import triton  # noqa: E402

import hymo.models.gdn_conv_triton as ct  # noqa: E402
import hymo.models.gdn_triton as gt  # noqa: E402


def host_us(fn, loops: int = 5, calls: int = 60) -> float:
    "Median over `loops` of the host's time per call, the GPU kept busy meanwhile."
    for _ in range(5): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(loops):
        torch.cuda._sleep(200_000_000)  # GPU cycles
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        ts.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(ts)[len(ts) // 2]


def main(args):
    need_gpu("nothing: it times the host launching kernels onto a GPU, which a CPU has no equivalent of")
    dev, (B, T, H, K, V) = "cuda", (4, 4096, 40, 32, 32)
    C = 2 * H * K + H * V
    qkv = torch.randn(B, T, C, device=dev, dtype=torch.bfloat16)
    w = torch.randn(C, 4, device=dev)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    g, beta = -torch.rand(B, T, H, device=dev) * 0.1, torch.rand(B, T, H, device=dev)
    y = qkv.new_empty(B, T, H * K)
    G, DP = ct._tile_sizes(H, K)
    BT = ct.LAUNCH["fwd"]["BT"]
    a = torch.randn(1024, device=dev)
    m1, m2 = torch.randn(16384, 896, device=dev, dtype=torch.bfloat16), torch.randn(896, 3840, device=dev, dtype=torch.bfloat16)
    prelude = torch.compile(lambda: ct.triton_conv_silu_norm(qkv, w, H, K))
    cases = {
        "one Triton launch (_conv_fwd_kernel)": lambda: ct._conv_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(H, G), B)](
            qkv, w, y, w, T, qkv.stride(0), qkv.stride(1), 0, H, K, 4, True, False, BT, G, DP, num_warps=2),
        "prelude forward operator, eager (3 launches)": lambda: ct.conv_silu_norm_fwd(qkv, w, H, K, None),
        "prelude forward, compiled (inductor launches)": prelude,
        "GDN rule forward operator, eager (2 launches)": lambda: gt.gdn_chunk_fwd(q, q, v, g, beta, K ** -0.5, None, False, None, True),
        "torch.add on 1024 floats": lambda: torch.add(a, 1.0),
        "torch.mm 16384x896 @ 896x3840": lambda: torch.mm(m1, m2),
    }
    res = {"meta": {**provenance(), "device": torch.cuda.get_device_name(), "unit": "host microseconds per call, median of 5 loops of 60"}}
    for name, fn in cases.items():
        res[name] = round(host_us(fn), 1)
        print(f"{res[name]:8.1f} us  {name}")
    if args.out:
        with open(args.out, "w") as f: json.dump(res, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the numbers as JSON")
    args = p.parse_args()
    check_out(p, args.out)
    main(args)
