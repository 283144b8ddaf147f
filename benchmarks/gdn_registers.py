"""Registers and spills of the GDN rule's Triton kernels at HyMo's head shape, compiled for the H200 on any machine.

    python benchmarks/gdn_registers.py [--out gdn_registers.json]

No GPU is needed: Triton compiles each kernel to PTX for compute capability 9.0 (`triton.compile` with a
GPUTarget), specialised as a launch at HyMo's shape specialises it (arguments passed as None become
constants; aligned pointers and T = 4096 get Triton's divisibility hint), and `ptxas -v` (the ptxas Triton
itself uses) reports the registers per thread and the bytes spilled to local memory. A thread has at most 255 registers; a kernel at that limit that spills keeps
part of its tiles in (cached) local memory, and the stores and loads cost time on the GPU. Each kernel's
shared memory per block is reported too: the H200 gives a block at most 227 KiB (232 448 bytes), and a kernel
asking for more does not launch. The launch options are the ones `hymo.models.gdn_triton` uses. Compare with `gdn_kernel.py`'s times on a GPU.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from need_gpu import check_out, need_triton, provenance  # the script beside this one

need_triton()
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hymo.models.gdn_triton as gt  # noqa: E402

H, K, V = 40, 32, 32  # hymo_750m's GDN heads


def registers(kernel, args: dict, options: dict) -> dict:
    """Compile `kernel` for sm_90 as a launch at HyMo's shape specialises it, and return ptxas's registers per thread
    and spill bytes. `args` maps every argument to a type ("*bf16", "i32", ...), to None (an argument passed as None,
    which Triton makes a constant) or to ("constexpr", value). Like a launch, pointers (16-byte aligned by PyTorch) and
    integers divisible by 16 (T = 4096) are marked `tt.divisibility` 16: without those hints the code differs and
    spills more."""
    sig, consts, attrs = {}, {}, {}
    for i, (name, a) in enumerate(args.items()):
        if a is None or isinstance(a, tuple):
            sig[name], consts[name] = "constexpr", None if a is None else a[1]
        else:
            sig[name] = a
            if a.startswith("*") or a == "i32": attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs: raise RuntimeError(f"ptxas said:\n{log[-2000:]}")
    return dict(registers=int(regs.group(1)), spill_store_bytes=int(spill.group(1)) if spill else 0,
                spill_load_bytes=int(spill.group(2)) if spill else 0, num_warps=options.get("num_warps", 4),
                shared_bytes=compiled.metadata.shared)


def kernels() -> dict:
    """Each launch of a forward + backward at K = V = 32, bf16 tensors and fp32 gates, plain rows (no cu_seqlens), no
    initial or final state, with the module's launch options: `(kernel, arguments in order, options)`."""
    bf, f32, c = "*bf16", "*fp32", lambda v: ("constexpr", v)
    BT, BV = gt.BT, gt._bv(V)
    shape = dict(H=c(H), K=c(K), V=c(V), BT=c(BT), BV=c(BV))
    return {
        "prep (gates, A)": (gt._prep_kernel, dict(k=bf, g=f32, beta=f32, gc=f32, A=bf, cu_seqlens=None, chunk_indices=None,
                            chunk_offsets=None, T="i32", H=c(H), K=c(K), BT=c(BT), IS_VARLEN=c(False)), gt.LAUNCH["prep"]),
        "state pass + o, saving S_0": (gt._fwd_kernel, dict(q=bf, k=bf, v=bf, gc=f32, beta=f32, A=bf, h0=None, ht=None, o=bf, h=bf,
                                       cu_seqlens=None, chunk_offsets=None, scale="fp32", T="i32", **shape, USE_H0=c(False),
                                       STORE_HT=c(False), SAVE_H=c(True), IS_VARLEN=c(False)), gt._state_launch("fwd", K, V)),
        "dS pass (S_0 kept)": (gt._bwd_states_kernel, dict(q=bf, k=bf, v=bf, gc=f32, beta=f32, A=bf, h0=None, h=bf, do=bf, dht=None,
                               dh0=None, dh=bf, cu_seqlens=None, chunk_offsets=None, scale="fp32", T="i32", **shape,
                               USE_H0=c(False), USE_DHT=c(False), STORE_DH0=c(False), IS_VARLEN=c(False), ONLY_DS=c(1)),
                               gt._state_launch("states", K, V)),
        "local grads": (gt._bwd_local_kernel, dict(q=bf, k=bf, v=bf, gc=f32, beta=f32, A=bf, h=bf, dh=bf, do=bf, dq=bf, dk=bf, dv=bf,
                        dg=f32, dbeta=f32, cu_seqlens=None, chunk_indices=None, chunk_offsets=None, scale="fp32", T="i32",
                        **{**shape, "BV": c(gt._bv_local(K, V))}, IS_VARLEN=c(False),
                        HOLD=c(gt._hold_local(K, torch.bfloat16))), gt.LAUNCH["local"]),
        # not HyMo's shape: wide heads in fp32 must still fit the H200's 227 KiB of shared memory per block
        "local grads, fp32 at K = V = 128": (gt._bwd_local_kernel, dict(
            **{n: f32 for n in ("q", "k", "v", "gc", "beta", "A", "h", "dh", "do", "dq", "dk", "dv", "dg", "dbeta")},
            cu_seqlens=None, chunk_indices=None, chunk_offsets=None, scale="fp32", T="i32", H=c(16), K=c(128), V=c(128),
            BT=c(BT), BV=c(gt._bv_local(128, 128)), IS_VARLEN=c(False), HOLD=c(gt._hold_local(128, torch.float32))),
            gt.LAUNCH["local"]),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file: the table is stored under this Triton's version, beside others")
    args = ap.parse_args()
    old = {}
    if args.out:  # a file that cannot take the table fails now, not after compiling
        check_out(ap, args.out, adds=dict)
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    res = dict(meta=dict(**provenance(), target="sm_90a", H=H, K=K, V=V), kernels={})
    print(f"{'kernel':34s} {'registers':>9s} {'spill stores':>13s} {'spill loads':>12s} {'shared':>8s}  "
          f"(bytes per thread, shared bytes per block; Triton {triton.__version__})")
    for name, (kern, kernel_args, opts) in kernels().items():
        r = res["kernels"][name] = registers(kern, kernel_args, dict(opts))
        print(f"{name:34s} {r['registers']:9d} {r['spill_store_bytes']:13d} {r['spill_load_bytes']:12d} {r['shared_bytes']:8d}")
    if args.out: Path(args.out).write_text(json.dumps({**old, f"triton {triton.__version__}": res}, indent=1))
