"""Registers and spills of the GDN rule's Triton kernels at HyMo's head shape, compiled for the H200 on any machine.

    python benchmarks/gdn_registers.py [--out gdn_registers.json]

No GPU is needed: Triton compiles each kernel to PTX for compute capability 9.0 (`triton.compile` with a
GPUTarget), and `ptxas -v` (the ptxas Triton itself uses) reports the registers per thread and the bytes
spilled to local memory. A thread has at most 255 registers; a kernel at that limit that spills keeps
part of its tiles in (cached) local memory, and the stores and loads cost time on the GPU. The launch
options are the ones `hymo.models.gdn_triton` uses. Compare with `gdn_kernel.py`'s times on a GPU.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hymo.models.gdn_triton as gt  # noqa: E402

H, K, V = 40, 32, 32  # hymo_750m's GDN heads


def registers(kernel, types: dict, constants: dict, options: dict) -> dict:
    "Compile `kernel` for sm_90 and return ptxas's registers per thread and spill bytes."
    sig = {**types, **{n: "constexpr" for n in constants}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constants),
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
                spill_load_bytes=int(spill.group(2)) if spill else 0, num_warps=options.get("num_warps", 4))


def kernels() -> dict:
    "Each launch of a forward + backward at K = V = 32 (bf16 tensors, fp32 gates), with the module's launch options."
    t = lambda names, ty: {n: ty for n in names.split()}
    tables = dict(cu_seqlens="*i32", chunk_indices="*i32", chunk_offsets="*i32")
    BT, BV = gt.BT, gt._bv(V)
    state = {**t("q k v A o h", "*bf16"), **t("gc beta h0 ht", "*fp32"), "cu_seqlens": "*i32", "chunk_offsets": "*i32",
             "scale": "fp32", "T": "i32"}
    dstate = {**t("q k v A h do dh", "*bf16"), **t("gc beta h0 dht dh0", "*fp32"), "cu_seqlens": "*i32",
              "chunk_offsets": "*i32", "scale": "fp32", "T": "i32"}
    return {
        "prep (gates, A)": (gt._prep_kernel, {**t("k A", "*bf16"), **t("g beta gc", "*fp32"), **tables, "T": "i32"},
                            dict(H=H, K=K, BT=BT, IS_VARLEN=False), gt.LAUNCH["prep"]),
        "state pass + o, saving S_0": (gt._fwd_kernel, state, dict(H=H, K=K, V=V, BT=BT, BV=BV, USE_H0=False, STORE_HT=False,
                                                                    SAVE_H=True, IS_VARLEN=False), gt._state_launch("fwd", K, V)),
        "dS pass (S_0 kept)": (gt._bwd_states_kernel, dstate, dict(H=H, K=K, V=V, BT=BT, BV=BV, USE_H0=False, USE_DHT=False,
                                                                   STORE_DH0=False, IS_VARLEN=False, ONLY_DS=1),
                               gt._state_launch("states", K, V)),
        "local grads": (gt._bwd_local_kernel, {**t("q k v A h dh do dq dk dv", "*bf16"), **t("gc beta dg dbeta", "*fp32"),
                                               **tables, "scale": "fp32", "T": "i32"},
                        dict(H=H, K=K, V=V, BT=BT, BV=gt._bv_local(K, V), IS_VARLEN=False), gt.LAUNCH["local"]),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file: the table is stored under this Triton's version, beside others")
    args = ap.parse_args()
    res = dict(meta=dict(date=time.strftime("%Y-%m-%d"), triton=triton.__version__, target="sm_90a", H=H, K=K, V=V), kernels={})
    print(f"{'kernel':28s} {'registers':>9s} {'spill stores':>13s} {'spill loads':>12s}  (bytes per thread; Triton {triton.__version__})")
    for name, (kern, types, consts, opts) in kernels().items():
        r = res["kernels"][name] = registers(kern, types, consts, dict(opts))
        print(f"{name:28s} {r['registers']:9d} {r['spill_store_bytes']:13d} {r['spill_load_bytes']:12d}")
    if args.out:
        path = Path(args.out)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, f"triton {triton.__version__}": res}, indent=1))
