"""The optimiser step of hymo_750m on one GPU: NorMuon and AdamW timed alone, on random gradients.

    python benchmarks/optim_step.py [--out optim_step.json]

Builds the 750M model (fp32 weights), gives every parameter a random gradient, and times
`opt.step()` of each optimiser built by `build_optimizers` with `train_step.py`'s timer: the GPU span
between CUDA events around the call (median of --steps calls after --warmup, each started on an
idle GPU), and the host's time to issue it. A span close to the host time means the host is the
limit. NorMuon is timed twice, alternating: as it runs by default (the final update of each
parameter of `FUSED_MIN_NUMEL` entries or more compiled into one kernel) and with `fused=False`
(every final update in list-wide launches). Also checks, on the GPU, that the one-pass
`normuon_rownorm` on the bf16 Newton–Schulz output equals the three-pass form on its fp32 copy, and
that the compiled update gives the list-wide one's weights.
"""
import argparse
import json
from pathlib import Path

import torch

from hymo.config import load_config
from hymo.models.model import HyMo
from hymo.training.optim import NorMuon, build_optimizers, newton_schulz, normuon_rownorm
from need_gpu import check_out, need_gpu, provenance  # the scripts beside this one
from train_step import optimizer_ms, time_optimizers


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


def fused_parity() -> float:
    "Largest difference between the weights after three NorMuon steps, compiled against list-wide, relative to their change."
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(16, 2304, 896), (2560, 896), (896, 2560)]
    w0 = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g) for s in shapes] for _ in range(3)]
    out = []
    for fused in (True, False):
        ps = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = NorMuon(ps, weight_decay=0.1, fused=fused)
        for gs in grads:
            for p, gr in zip(ps, gs): p.grad = gr
            opt.step()
        out.append(ps)
    return max(((a - b).norm() / (b - w).norm()).item() for a, b, w in zip(*out, w0))


def step_listwide(muon: NorMuon):
    "One step of `muon` with every final update in list-wide launches (`fused=False`), then its default again."
    muon.fused = False
    try: muon.step()
    finally: muon.fused = None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each optimiser first (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.steps < 1: ap.error(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0: ap.error(f"--warmup must be at least 0, got {args.warmup}")
    check_out(ap, args.out)
    need_gpu("tests/test_optim.py checks NorMuon's fused update against the list-wide one")
    cfg = load_config("hymo_750m")
    torch.manual_seed(0)
    with torch.device("cuda"): model = HyMo(cfg.model)
    for p in model.parameters(): p.grad = torch.randn_like(p) * 1e-3
    res = dict(gpu=torch.cuda.get_device_name(), **provenance())
    opts = build_optimizers(model, cfg.train)
    for opt in opts:
        for _ in range(args.warmup): opt.step()
    muon = next(o for o in opts if isinstance(o, NorMuon))
    step_listwide(muon)  # the list-wide update's warm-up
    spans = time_optimizers(opts, name=lambda o: "NorMuon, fused=False" if getattr(o, "fused", None) is False else type(o).__name__)
    for _ in range(args.steps):  # NorMuon alternates: as by default, then fused=False
        for opt in opts:
            torch.cuda.synchronize()
            opt.step()
        torch.cuda.synchronize()
        step_listwide(muon)
    torch.cuda.synchronize()
    timings = optimizer_ms(spans)
    for opt in opts:
        res[type(opt).__name__] = dict(params=sum(p.numel() for g in opt.param_groups for p in g["params"]),
                                       tensors=sum(len(g["params"]) for g in opt.param_groups), **timings[type(opt).__name__])
    res["NorMuon, fused=False"] = timings["NorMuon, fused=False"]
    res["rownorm_one_pass_vs_three_pass"] = rownorm_parity()
    res["compiled_vs_listwide_update"] = fused_parity()
    print(json.dumps(res, indent=1))
    if args.out: Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
