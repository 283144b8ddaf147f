"""One optimiser step of hymo_750m on one GPU: tokens/s, step time, MFU and peak memory.

    python benchmarks/train_step.py                          # Triton GDN, bf16 autocast, micro-batch 4 x 4096
    python benchmarks/train_step.py --gdn torch              # GDN through the PyTorch chunked path
    python benchmarks/train_step.py --all-mla                # 32 MLA + MoE blocks (dense-attention comparison)
    python benchmarks/train_step.py --ac                     # activation checkpointing on
    python benchmarks/train_step.py --profile [micro]        # also a torch.profiler table of the top kernels (a step, or 3 micro-batches)
    python benchmarks/train_step.py --profile cuda           # 3 micro-batches with only CUDA activity recorded: the host is slowed
                                                             # less than by --profile micro, but enough to show waits --timeline does not
    python benchmarks/train_step.py --accum 32               # the preset's global batch on one GPU: 32 micro-batches per step
    python benchmarks/train_step.py --accum 32 --timeline    # also each micro-batch's GPU span and host time (CUDA events, no profiler)
    python benchmarks/train_step.py --compile                # torch.compile each block
    python benchmarks/train_step.py --loss logits            # the reference loss on full [B, T, V] logits
    python benchmarks/train_step.py --doc-masking 1024       # packed documents of ~1024 tokens: cu_seqlens for GDN and MLA
    python benchmarks/train_step.py --fsdp                   # FSDP-2 mixed precision on a process group of one GPU, as each
                                                             # GPU of a torchrun launch computes (instead of autocast)
    python benchmarks/train_step.py --out results.json --code "what this measures"   # add the result, newest first

The step is `Trainer.train_step` itself (forward with main + MTP losses, backward, clipping, NorMuon +
AdamW, MoE bias update) on synthetic tokens, so what is measured is what training runs.
MFU = tokens/s x FLOPs per token / the GPU's dense bf16 peak (989e12 for an H100/H200; the trainer's table).
FLOPs per token are HyMo.flops_per_token(seq_len), except with --doc-masking: the trainer's own count for
the timed steps, whose attention is counted within each document (`doc_keys_per_query`).
step_s is the median of the timed steps (the upper one of an even count), each after `--warmup` untimed steps
(at least 1: the first step compiles the Triton kernels and NorMuon's update, and with --compile the blocks); a
timed step that skipped its optimiser step (a non-finite loss or gradient) stops the run, since it is no training step.
Peak memory is the allocator's peak of allocated memory (peak_mem_gb, GB = 1e9 bytes), warm-up and compilation
included: a lower bound of what a training run must fit; peak_reserved_gb adds what the allocator held unused.
The rows of benchmarks/results/ are the results page's record, newest first, each labelled by --code;
run into a scratch file and copy over the rows worth keeping.
"""
import argparse
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from hymo.config import ConfigError, load_config
from hymo.training.data import doc_cu_seqlens
from hymo.training.trainer import Trainer, peak_flops
from need_gpu import add_row, check_out, need_gpu, provenance  # the script beside this one

MARK_STEPS = False  # set by --compile-mode reduce-overhead
DOC_LEN = 0  # set by --doc-masking: mean document length of the synthetic batches (0: no document boundaries)


class SyntheticTrainer(Trainer):
    "A `Trainer` whose batches are random tokens (no corpus, no tokenizer)."
    def setup_data(self):
        V, T, B = self.mcfg.vocab_size, self.cfg.seq_len, self.cfg.micro_batch_size
        g = torch.Generator().manual_seed(0)

        def batches():
            while True:
                if MARK_STEPS: torch.compiler.cudagraph_mark_step_begin()  # a new micro-batch: CUDA graphs may reuse buffers
                x = torch.randint(1, V, (B, T + 1), generator=g)
                if DOC_LEN: x[torch.rand(B, T + 1, generator=g) < 1 / DOC_LEN] = 0  # token 0 opens a document
                tokens, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # contiguous, as the real loader's
                yield (tokens, targets, doc_cu_seqlens(tokens, 0)) if DOC_LEN else (tokens, targets)
        self.data_dir, self.train_loader, self.val_loader = None, batches(), None


CATEGORIES = [  # first match wins; names of the CUDA kernels in the profile
    ("cross-entropy softmax pass", r"^_ce_kernel|logsumexp"),
    ("GDN Triton kernels", r"^_(prep|fwd|bwd_states|bwd_local)_kernel"),
    ("GDN prelude kernels (conv, SiLU, norm)", r"^_conv_(fwd|bwd|du|dx|dw)_kernel"),
    ("attention (cuDNN SDPA)", r"sdpa|flash|fmha|attention"),
    ("matrix multiplies", r"nvjet|cutlass|gemm|xmma|cublas|splitK|grouped"),
    ("compiled elementwise (inductor)", r"^triton_"),
    ("eager elementwise, copies, reductions", r"elementwise|copy|reduce|index|scatter|gather|sort|fill|cat|embedding"),
]


def breakdown(prof, n_micro: int) -> dict:
    "Self CUDA time of every kernel, summed by category, in ms per micro-batch."
    out = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA: continue
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        cat = next((c for c, rx in CATEGORIES if re.search(rx, e.key)), "other")
        out[cat] = out.get(cat, 0.0) + t / 1e3 / n_micro
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def idle_gaps(kernels: list) -> tuple[list, float, float]:
    """`(gaps, first start, last end)` of `(start, end, name)` intervals of GPU activity, in µs: every stretch with
    nothing running, as `(length, start, end, activity before, activity after)`."""
    acts = sorted(kernels)
    gaps, end, prev = [], acts[0][1], acts[0][2]
    for s, e, name in acts[1:]:
        if s > end: gaps.append((s - end, end, s, prev, name))
        if e > end: end, prev = e, name
    return gaps, acts[0][0], end


def host_during(ops: list, lo: float, hi: float, top: int = 3) -> list:
    "The host operators `(start, end, name)` that overlap [lo, hi] longest, as `'name (µs of overlap)'`, longest first."
    over = sorted(((min(e, hi) - max(s, lo), name) for s, e, name in ops if s < hi and e > lo), reverse=True)
    return [f"{name[:60]} ({us:.0f} us)" for us, name in over[:top]]


RUNTIME = ("cuda", "cu", "Command Buffer")  # CUDA runtime and driver calls: the profiler links each to its kernels too


def launched_by(rows: list, pattern: str, top: int = 6) -> list:
    """Which host operators launch the kernels whose names match `pattern`: `rows` are `(ancestry, kernels)` of every
    host event, its name first and then its callers', and the names of the kernels it launched. CUDA runtime calls
    are left out (the operator that made them is counted). Returns `'op < caller < ...: count'`, most kernels first."""
    counts = {}
    for ancestry, kernels in rows:
        if ancestry[0].startswith(RUNTIME): continue
        n = sum(bool(re.search(pattern, k)) for k in kernels)
        if n: counts[" < ".join(ancestry)] = counts.get(" < ".join(ancestry), 0) + n
    return [f"{k}: {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]


def _ancestry(e, depth: int = 3) -> list:
    "The names of a profiled host operator and of its first callers."
    out = []
    while e is not None and len(out) < depth: out.append(e.name[:50]); e = e.cpu_parent
    return out


def gpu_idle(prof, n_micro: int, top: int = 8) -> dict:
    """Time between the profile's first and last GPU activity when none ran, in ms per micro-batch: in total, by gap
    length (short gaps are launch latency; long ones mean the GPU waited on the host), and the longest gaps with the
    activity on either side and, when the profile recorded the host, the host operators that ran during the gap.
    The profiler slows the host, so these are upper bounds."""
    events = list(prof.events())
    gaps, first, end = idle_gaps([(e.time_range.start, e.time_range.end, e.name) for e in events
                                  if e.device_type == torch.autograd.DeviceType.CUDA])
    ops = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    per = lambda us: us / 1e3 / n_micro
    bins = {"< 10 us": (0, 10), "10-100 us": (10, 100), ">= 100 us": (100, float("inf"))}
    longest = []
    for g, lo, hi, a, b in sorted(gaps, reverse=True)[:top]:
        longest.append(dict(us=round(g, 1), after=a[:70], before=b[:70], **({"host": host_during(ops, lo, hi)} if ops else {})))
    return dict(span_ms=per(end - first), idle_ms=per(sum(g[0] for g in gaps)),
                idle_ms_by_gap={k: per(sum(g[0] for g in gaps if lo <= g[0] < hi)) for k, (lo, hi) in bins.items()},
                gaps_per_micro_batch=len(gaps) / n_micro, longest=longest)


def _conv_launch():
    "The prelude kernels' tiles this run used (None where the module was never imported)."
    import sys
    m = sys.modules.get("hymo.models.gdn_conv_triton")
    return None if m is None else {k: dict(v) for k, v in m.LAUNCH.items()}


def time_optimizers(optimizers, name=lambda opt: type(opt).__name__) -> dict:
    """Wrap each optimiser's `step` to record, per call, its GPU span (CUDA events) and the host's time to issue it,
    under `name(opt)` as it is at the call."""
    spans = {}
    for opt in optimizers:
        def timed(*a, plain=opt.step, opt=opt, **kw):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter(); e0.record()
            out = plain(*a, **kw)
            e1.record(); spans.setdefault(name(opt), []).append((e0, e1, (time.perf_counter() - h0) * 1e3))
            return out
        opt.step = timed
    return spans


def optimizer_ms(spans: dict) -> dict:
    "Median GPU span and host time (ms) of each optimiser's step; the span is the larger of the two when the host is the limit."
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {name: {"gpu_span_ms": med([e0.elapsed_time(e1) for e0, e1, _ in rows]), "host_ms": med([h for _, _, h in rows])}
            for name, rows in spans.items()}


def time_micro_batches():
    """Record, for every micro-batch a step runs, CUDA events around it (its GPU span) and the host's time to issue it,
    and whether the GPU had already finished the previous micro-batch when the host began this one (`drained`: then
    the GPU had nothing of that micro-batch left, and little else queued, so it likely waited on the host). Only the
    boundaries are checked; waits inside a micro-batch do not show here."""
    import hymo.training.trainer as tr
    rows, plain = [], tr.forward_backward

    def timed(self, last):
        e0 = torch.cuda.Event(enable_timing=True); e0.record()
        drained = rows[-1]["e1"].query() if rows else None  # non-blocking: True if the GPU has no earlier work left
        h0 = time.perf_counter()
        out = plain(self, last=last)
        host_ms = (time.perf_counter() - h0) * 1e3
        e1 = torch.cuda.Event(enable_timing=True); e1.record()
        rows.append(dict(e0=e0, e1=e1, host_ms=host_ms, drained=drained))
        return out
    tr.forward_backward = timed
    return rows, lambda: setattr(tr, "forward_backward", plain)


def timeline(rows: list, s0, s1) -> dict:
    """One step's micro-batches: mean GPU span and host time (ms), drained boundaries, and the time from the step's start
    to the first micro-batch and from the last to the step's end (GPU work and any wait on the host's syncs alike)."""
    spans = [r["e0"].elapsed_time(r["e1"]) for r in rows]
    return dict(micro_batches=len(rows), gpu_span_ms_mean=sum(spans) / len(spans), gpu_span_ms_min=min(spans),
                gpu_span_ms_max=max(spans), host_ms_mean=sum(r["host_ms"] for r in rows) / len(rows),
                boundaries_gpu_drained=sum(bool(r["drained"]) for r in rows[1:]), boundaries=len(rows) - 1,
                before_first_ms=s0.elapsed_time(rows[0]["e0"]), after_last_ms=rows[-1]["e1"].elapsed_time(s1))


def overrides(args) -> dict:
    "The settings of hymo_750m this measurement changes."
    over = dict(seq_len=args.seq_len, micro_batch_size=args.micro_batch, global_batch_size=args.micro_batch * args.accum,
                activation_checkpointing=args.ac, compile=args.compile, gdn_kernel=args.gdn, max_steps=10_000,
                warmup_steps=10, eval_every=0, ckpt_every=0, precision="bf16")
    if args.all_mla: over["mla_every"] = 1
    return over


def conv_tiles(path) -> dict:
    "The prelude kernels' tiles in the JSON at `path` (gdn_conv_kernel.py --best-out); ValueError says what is wrong with it."
    import hymo.models.gdn_conv_triton as ct
    how = "write the file with gdn_conv_kernel.py --sweep --best-out"
    try: tiles = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e: raise ValueError(f"--conv-launch {path} cannot be read as JSON ({e}); {how}") from None
    if not isinstance(tiles, dict) or not all(isinstance(v, dict) for v in tiles.values()):
        raise ValueError(f"--conv-launch {path} is not tiles by kernel ({{kernel: {{tile: size}}}}); {how}")
    if set(tiles) - set(ct.LAUNCH):
        raise ValueError(f"--conv-launch {path}: unknown kernels {sorted(set(tiles) - set(ct.LAUNCH))}; the prelude's are "
                         f"{sorted(ct.LAUNCH)} ({how})")
    return tiles


def run(args) -> dict:
    if args.conv_launch:
        import hymo.models.gdn_conv_triton as ct
        try: ct.LAUNCH.update(conv_tiles(args.conv_launch))
        except ValueError as e: raise SystemExit(str(e)) from None
        # Compiled, the prelude's operators are traced into and their tiles read once; inductor's on-disk caches key
        # on the graph around the operators, which does not change with the tiles. Without a directory of its own, a
        # process with other tiles could reuse the compiled code of an earlier one.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        key = hashlib.sha1(json.dumps(ct.LAUNCH, sort_keys=True).encode()).hexdigest()[:12]
        base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"conv_launch_{key}")
    if args.doc_masking:
        global DOC_LEN
        DOC_LEN = args.doc_masking
    if args.compile_mode:  # an experiment: the trainer compiles each block with torch.compile's default mode
        global MARK_STEPS
        MARK_STEPS = args.compile_mode == "reduce-overhead"
        from hymo.models.mtp import MTPBlock  # (the MTP heads stay in the default mode: CUDA graphs reused their outputs)
        plain = torch.nn.Module.compile
        torch.nn.Module.compile = lambda self, *a, **kw: plain(self, *a, **kw) if isinstance(self, MTPBlock) else \
            plain(self, *a, **{"mode": args.compile_mode, **kw})
    cfg = load_config("hymo_750m", **overrides(args))
    if args.fsdp and not torch.distributed.is_initialized():  # the trainer then shards (one shard) instead of autocasting
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.reset_peak_memory_stats()
    t = SyntheticTrainer(cfg.model, cfg.train, run_dir=tempfile.mkdtemp(prefix="hymo_bench_"), resume=False, quiet=True)  # one each: run folders are locked
    t.model.loss_impl = args.loss
    for _ in range(args.warmup): t.train_step()
    torch.cuda.synchronize()
    spans = time_optimizers(t.optimizers)
    mb_rows, restore = time_micro_batches() if args.timeline else (None, lambda: None)
    times, lines, flops = [], [], []
    try:
        for _ in range(args.steps):
            if mb_rows is not None:
                mb_rows.clear(); s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); s0.record()
            t0 = time.perf_counter()
            m = t.train_step()
            if m.get("skipped"):
                raise SystemExit("a timed step skipped its optimiser step (a non-finite loss or gradient): its time is not "
                                 "a training step's, so no row is written; find out why before timing (python -m hymo.train)")
            if mb_rows is not None: s1.record()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            flops.append(m["flops"] / (m["tokens"] / t.d.world_size))  # the trainer's count: per document with --doc-masking
            if mb_rows is not None: lines.append(timeline(mb_rows, s0, s1))
    finally: restore()
    step = sorted(times)[len(times) // 2]
    tok_s = args.micro_batch * args.accum * args.seq_len / step
    fpt = sum(flops) / len(flops)
    peak = peak_flops(t.d.device)
    if peak is None: print(f"no MFU: {torch.cuda.get_device_name()} has no dense bf16 peak in the trainer's PEAK_BF16_FLOPS table")
    res = dict(code=args.code or _unlabelled(), conv_launch=_conv_launch(), variant=variant(args),
               seq_len=args.seq_len, micro_batch=args.micro_batch, accum=args.accum, warmup=args.warmup, steps=args.steps,
               step_s=step, step_stat="median", step_times_s=[round(x, 4) for x in times], tokens_per_s=tok_s, flops_per_token=fpt,
               mfu=tok_s * fpt / peak if peak else None,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
               loss=m["loss"],
               params_stored=t.model.num_params(), params_active=t.model.num_params(active=True),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__, table_peak=peak,
               date=time.strftime("%Y-%m-%d"), mfu_formula=f"tokens/s * flops_per_token / {peak:.3g}" if peak else None,
               optimizer=optimizer_ms(spans))
    if lines: res["timeline"] = lines
    try:
        import triton; res["triton"] = triton.__version__
    except ImportError: pass
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CUDA] if args.profile == "cuda" else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts) as prof:
            if args.profile == "step": t.train_step()
            else:  # forward + backward of micro-batches only, as train_step runs them: what an accumulation step repeats
                n = args.profile_micro_batches
                with t.accumulation():
                    for i in range(n): t.forward_backward(last=i == n - 1)
            torch.cuda.synchronize()
        try:
            n_micro = args.accum if args.profile == "step" else args.profile_micro_batches
            res["profile_ms_per_micro_batch"] = breakdown(prof, n_micro)
            print(json.dumps(res["profile_ms_per_micro_batch"], indent=1))
            res["gpu_idle"] = gpu_idle(prof, n_micro)
            res["profile_host_recorded"] = args.profile != "cuda"
            print(json.dumps(res["gpu_idle"], indent=1))
            if args.profile != "cuda":  # where the many small kernels come from (the host's operators were recorded)
                rows = [(_ancestry(e), [k.name for k in e.kernels]) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CPU and e.kernels]
                res["launched_by"] = {kind: launched_by(rows, rx) for kind, rx in
                                      [("memsets", r"^Memset"), ("fp32 adds", r"CUDAFunctor_add<float>"), ("copies", r"copy|Memcpy")]}
                print(json.dumps(res["launched_by"], indent=1))
        except Exception as e: print("breakdown failed:", repr(e))
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.profile_rows, max_name_column_width=90)
        print(table)
        res["profile_top"] = table
    del t
    torch.cuda.empty_cache()
    return res


def variant(args) -> str:
    "The row's label of what ran: the flags that change the step (a batch other than the preset's 4 x 4096 included)."
    shape = "" if (args.micro_batch, args.seq_len) == (4, 4096) else f" batch={args.micro_batch}x{args.seq_len}"
    return (("all-MLA" if args.all_mla else "hybrid") + f" gdn={args.gdn} ac={args.ac} compile={args.compile}"
            + (f" mode={args.compile_mode}" if args.compile_mode else "") + (f" docs~{args.doc_masking}" if args.doc_masking else "")
            + (" fsdp" if args.fsdp else "") + shape
            + f" accum={args.accum} loss={args.loss}")


def _unlabelled() -> str:
    "The row's `code` when --code is not given: the commit measured, marked when the checkout has changes."
    return f"unlabelled: {provenance()['code']}"


def check_args(p: argparse.ArgumentParser, args):
    "Refuse what would run something else than the row says, before the model is built."
    if args.profile_rows is not None and not args.profile: p.error("--profile-rows sets the profiler table's rows: it needs --profile")
    if args.profile_micro_batches is not None and args.profile in (None, "step"):
        p.error("--profile-micro-batches sets the 'micro' and 'cuda' profiles' passes: give --profile micro or --profile cuda")
    args.profile_rows = 30 if args.profile_rows is None else args.profile_rows
    args.profile_micro_batches = 3 if args.profile_micro_batches is None else args.profile_micro_batches
    for name in ("steps", "accum", "micro_batch", "seq_len", "profile_micro_batches", "profile_rows"):
        if getattr(args, name) < 1: p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup", "doc_masking"):
        if getattr(args, name) < 0: p.error(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if args.compile_mode and not args.compile:
        p.error(f"--compile-mode {args.compile_mode} needs --compile: without it nothing is compiled")
    if args.conv_launch and (args.gdn == "torch" or args.all_mla):
        p.error(f"--conv-launch sets the Triton prelude's tiles, which {'--all-mla' if args.all_mla else '--gdn torch'} does not run")
    if args.conv_launch and not Path(args.conv_launch).is_file():
        p.error(f"--conv-launch {args.conv_launch}: no such file (write one with gdn_conv_kernel.py --sweep --best-out)")
    if args.conv_launch:
        try: conv_tiles(args.conv_launch)
        except ValueError as e: p.error(str(e))
    try: load_config("hymo_750m", **overrides(args))  # e.g. a --seq-len past max_seq_len fails here, not after the GPU check
    except ConfigError as e: p.error(f"these arguments make a config hymo_750m cannot run: {e}")
    if args.warmup == 0:  # the first step compiles the Triton kernels and NorMuon's update (and, with --compile, the blocks)
        p.error("--warmup 0 would time the compilation of the first step: give --warmup 1 or more")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would count the global batch at one GPU's peak, and write
        p.error("this measures one GPU: run it with python, not torchrun (--fsdp runs FSDP-2 on a group of one)")
    check_out(p, args.out, adds=list)  # a bad --out fails now, not after minutes of measuring


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gdn", default="triton", choices=["triton", "torch", "auto"])
    p.add_argument("--all-mla", action="store_true")
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--compile-mode", default=None, choices=["reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="experiment: compile the blocks in this torch.compile mode instead of the default")
    p.add_argument("--doc-masking", type=int, default=0, metavar="MEAN_LEN",
                   help="synthetic batches of packed documents of about MEAN_LEN tokens, kept apart by cu_seqlens (the loader's doc_masking)")
    p.add_argument("--fsdp", action="store_true", help="FSDP-2 mixed precision (bf16 parameters, fp32 reduction) on a "
                   "process group of one GPU instead of autocast: what each GPU of a torchrun launch computes")
    p.add_argument("--loss", default="fused", choices=["fused", "logits"], help="HyMo.loss_impl")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimiser step (the 750M run uses 32 on one GPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile", nargs="?", const="step", choices=["step", "micro", "cuda"],
                   help="torch.profiler table of one optimiser step, or ('micro') of 3 forward+backward passes, "
                        "or ('cuda') of 3 passes recording only GPU activity (the host slowed less); see --profile-micro-batches")
    p.add_argument("--profile-micro-batches", type=int, default=None, metavar="N",
                   help="micro-batches in the 'micro' and 'cuda' profiles (default 3), run as one step's accumulation: the once-per-step "
                        "work (the bf16 copies' refresh; FSDP's first gathers and last reduction) is 1/N of each micro-batch's "
                        "numbers, so N = --accum gives a real step's share")
    p.add_argument("--timeline", action="store_true",
                   help="also time every micro-batch of the timed steps with CUDA events: the GPU's span, the host's time to "
                        "issue it, and whether the GPU had run dry at each micro-batch boundary (it then likely waited on the host)")
    p.add_argument("--conv-launch", default=None, help="JSON of tiles for the GDN prelude kernels (gdn_conv_kernel.py --best-out)")
    p.add_argument("--profile-rows", type=int, default=None, help="rows of the profiler table (default 30)")
    p.add_argument("--out", default=None, help="add the result to this JSON list, first (the results page reads newest first)")
    p.add_argument("--code", default=None, help="the row's label: what code it measured and why (default: 'unlabelled: <commit>')")
    return p


if __name__ == "__main__":
    p = build_parser()
    args = p.parse_args()
    check_args(p, args)
    need_gpu("python -m hymo.train trains hymo_tiny, and block_step.py --device cpu --config hymo_tiny times one block")
    r = run(args)
    print(json.dumps({k: v for k, v in r.items() if k != "profile_top"}, indent=1))
    if args.out: add_row(args.out, r)  # read again (checked before the run), written whole and renamed: a crash leaves the old list
