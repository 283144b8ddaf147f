"""The optimiser step of hymo_750m on one GPU: NorMuon and AdamW timed alone, on random gradients.

    python benchmarks/optim_step.py [--out optim_step.json]

Builds the 750M model (fp32 weights), gives every parameter a random gradient, and times
`opt.step()` of each optimiser built by `build_optimizers`: the GPU span between CUDA events
around the call (median of --steps calls after --warmup), and the host's time to issue it. A span
close to the host time means the host is the limit. Also checks, on the GPU, that the one-pass
`normuon_rownorm` on the bf16 Newton–Schulz output equals the three-pass form on its fp32 copy.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from hymo.config import load_config
from hymo.models.model import HyMo
from hymo.training.optim import build_optimizers, newton_schulz, normuon_rownorm


def time_step(opt, warmup: int, steps: int) -> dict:
    "Median GPU span and host time (ms) of `opt.step()`."
    spans, host = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter(); e0.record()
        opt.step()
        e1.record(); h1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup: spans.append(e0.elapsed_time(e1)); host.append((h1 - h0) * 1e3)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return dict(gpu_span_ms=med(spans), host_ms=med(host))


def rownorm_parity() -> float:
    "Largest relative difference of the one-pass rownorm (bf16 input) from the three-pass form (fp32), on expert-shaped updates."
    g = torch.Generator(device="cuda").manual_seed(0)
    O = newton_schulz(torch.randn(16, 2304, 896, device="cuda", generator=g) * torch.rand(16, 2304, 1, device="cuda", generator=g))
    v0 = torch.rand(16, 2304, 1, device="cuda", generator=g)
    U, v = normuon_rownorm(O, v0, 0.95, gain=1.6)
    Of = O.float()
    v_ref = v0.lerp(Of.square().mean(-1, keepdim=True), 0.05)
    Oh = Of / v_ref.clamp_min(1e-10).sqrt()
    U_ref = Oh * (Of.norm(dim=(-2, -1), keepdim=True) / Oh.norm(dim=(-2, -1), keepdim=True)) * 1.6
    return max(((U - U_ref).norm() / U_ref.norm()).item(), ((v - v_ref).norm() / v_ref.norm()).item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = load_config("hymo_750m")
    torch.manual_seed(0)
    with torch.device("cuda"): model = HyMo(cfg.model)
    for p in model.parameters(): p.grad = torch.randn_like(p) * 1e-3
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    for opt in build_optimizers(model, cfg.train):
        n = sum(p.numel() for g in opt.param_groups for p in g["params"])
        res[type(opt).__name__] = dict(params=n, tensors=sum(len(g["params"]) for g in opt.param_groups),
                                       **time_step(opt, args.warmup, args.steps))
    try: res["rownorm_one_pass_vs_three_pass"] = rownorm_parity()
    except TypeError as e: res["rownorm_one_pass_vs_three_pass"] = f"not run: {e}"  # an older normuon_rownorm (no gain)
    print(json.dumps(res, indent=1))
    if args.out: Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
