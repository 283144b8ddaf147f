"""One block of a HyMo preset, forward + backward, compiled, under bf16 autocast: ms per call.

    python benchmarks/block_step.py [--block gdn|mla] [--iters 20] [--out results.json]
    python benchmarks/block_step.py --config hymo_tiny --batch 2 --seq-len 256 --device cpu --iters 2   # a smoke run

A quicker A/B than the whole train step (train_step.py) when a change touches one block: run it on
both versions, on the same machine. The default is hymo_750m's shape, micro-batch 4 x 4096; the loss
is a plain sum of the output; `iters` timed calls follow 3 warm-up calls (CUDA events on a GPU).
The block runs as in a one-GPU training step: its input is the residual stream in bf16 (as the model
casts it under autocast) and its matrices are the trainer's bf16 copies (`BF16Matrices`), whose
gradients are added to the fp32 masters after each backward.
"""
import argparse
import json
import time

import torch

from hymo.config import ConfigError, load_config
from hymo.models.gdn import GatedDeltaNetBlock
from hymo.models.mla import MLABlock
from hymo.training.trainer import BF16Matrices
from need_gpu import check_out, device_arg, need_gpu, provenance  # the script beside this one


def block_ms(block: torch.nn.Module, x: torch.Tensor, iters: int) -> float:
    "Mean ms of a compiled forward + backward, on the trainer's bf16 copies of the block's matrices."
    f, dev = torch.compile(block), x.device.type
    mats = BF16Matrices(block, torch.bfloat16, compiled=True)
    mats.refresh()
    def step():
        with mats.swapped():
            with torch.autocast(dev, torch.bfloat16): y = f(x)
            y.float().sum().backward()
        mats.collect()
    for _ in range(3): step()
    if dev == "cuda":
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters): step()
        e1.record(); torch.cuda.synchronize()
        return e0.elapsed_time(e1) / iters
    t0 = time.perf_counter()
    for _ in range(iters): step()
    return (time.perf_counter() - t0) * 1e3 / iters


def check_args(p: argparse.ArgumentParser, args):
    "Refuse sizes that would time nothing, or crash after the block is compiled."
    for name in ("batch", "seq_len", "iters"):
        if getattr(args, name) < 1: p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try: L = load_config(args.config).model.max_seq_len
    except ConfigError as e: p.error(str(e))
    if args.seq_len > L: p.error(f"--seq-len {args.seq_len} is longer than {args.config}'s max_seq_len={L}")
    check_out(p, args.out)


def main(args):
    if torch.device(args.device).type == "cuda":  # cuda:1 too
        need_gpu("time a small block there: block_step.py --device cpu --config hymo_tiny --batch 2 --seq-len 256 --iters 2")
    cfg = load_config(args.config).model  # (checked in check_args)
    torch.manual_seed(0)
    block = GatedDeltaNetBlock(cfg) if args.block == "gdn" else MLABlock(cfg, layer_idx=cfg.mla_every - 1)
    block = block.to(args.device)
    x = torch.randn(args.batch, args.seq_len, cfg.dim, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    ms = block_ms(block, x, args.iters)
    res = dict(config=args.config, block=args.block, ms_fwd_bwd=ms, iters=args.iters, shape=list(x.shape),
               device=torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else "cpu", **provenance())
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f: json.dump(res, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", default="gdn", choices=["gdn", "mla"])
    p.add_argument("--config", default="hymo_750m", help="preset whose model config builds the block")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--device", default="cuda", type=device_arg)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args()
    check_args(p, args)
    main(args)
