# %% [markdown]
# # Results on one H200
#
# > What the 750M training step and the GDN kernel measure on one GPU, with the date, the versions and the formulas.

# %% [markdown]
# The numbers on this page were measured on one NVIDIA H200 (torch 2.11, Triton 3.6) on
# 2026-12-02 by the scripts in `benchmarks/`, which write JSON into `benchmarks/results/`; this
# page only reads those files, so it renders anywhere. Re-run them on your GPU with
#
# ```sh
# python benchmarks/train_step.py --compile --accum 32           # the preset's real step on one GPU
# python benchmarks/train_step.py --compile --profile micro      # + --ac, --gdn torch, --all-mla, --loss logits
# python benchmarks/gdn_verify.py && python benchmarks/gdn_kernel.py
# python benchmarks/gdn_conv_kernel.py --sweep && python benchmarks/ce_kernel.py --sweep
# ```
#
# (`benchmarks/h200_train_step.sh` runs the whole set, one process per variant.)
#
# **MFU** is tokens per second × `HyMo.flops_per_token(4096)` ÷ 989 TFLOP/s (the H200's dense bf16
# peak). The model's own accounting gives 4.42 GFLOPs per training token for `hymo_750m` at
# $T = 4096$ (3 × forward, a multiply-add is two FLOPs, attention over the causal half, the GDN
# recurrence and the MTP heads' vocabulary projections included; see the model chapter).

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

RESULTS = Path("../benchmarks/results")
steps = json.loads((RESULTS / "train_step.json").read_text())


# %% [markdown]
# ## The 750M training step
#
# Micro-batch 4 × 4096 tokens, bf16 autocast with fp32 master weights, the full `Trainer.train_step`
# (main + MTP losses, backward, clipping, NorMuon + AdamW, MoE bias update) on synthetic tokens.
# `accum` is the number of micro-batches per optimiser step: 1 measures one micro-batch plus a
# whole optimiser step; 32 is what `hymo_750m` (global batch 128 sequences) really does on one GPU.

# %%
def label(r):
    v = r["variant"].replace("hybrid ", "").replace(" loss=fused", "").replace("gdn=triton ", "")
    return v.replace("ac=False ", "").replace("ac=True", "AC").replace("compile=True", "compiled").replace("compile=False", "eager")

print(f"{'variant':40s} {'step s':>7s} {'tokens/s':>9s} {'MFU':>6s} {'peak GB':>8s}")
for code in dict.fromkeys(r["code"] for r in steps):  # rows grouped by the code they measured, newest first
    print(f"-- {code}")
    for r in (r for r in steps if r["code"] == code):
        print(f"{label(r):40s} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} {r['mfu']:6.1%} {r['peak_mem_gb']:8.1f}"
              + (f"   {r['note']}" if r.get("note") else ""))
print(f"\n{steps[0]['gpu']}, torch {steps[0]['torch']}, Triton {steps[0].get('triton')}, {steps[0]['date']}")


# %%
def when(code):
    return {"previous": " (previous round)", "two": " (two rounds ago)", "three": " (three rounds ago)",
            "experiment": " (experiment)"}.get(code.split()[0].strip(":,"), "")

names = []
for r in steps:  # one bar per row: a repeated measurement gets a prime
    n = label(r) + when(r["code"])
    while n in names: n += "'"
    names.append(n)
fig, ax = plt.subplots(1, 2, figsize=(10, 1 + 0.3 * len(steps)))
ax[0].barh(names, [100 * r["mfu"] for r in steps], color="tab:blue")
ax[0].axvline(40, ls="--", c="k", lw=1); ax[0].set_xlabel("MFU, % (target 40)"); ax[0].invert_yaxis()
ax[1].barh(names, [r["peak_mem_gb"] for r in steps], color="tab:orange")
ax[1].axvline(80, ls="--", c="k", lw=1); ax[1].set_xlabel("peak memory, GB (target 80)"); ax[1].invert_yaxis()
ax[1].set_yticklabels([])
fig.tight_layout(); plt.show()

# %% [markdown]
# ### Where a micro-batch's time goes
#
# The profiler's self CUDA time of every kernel over three compiled forward + backward passes,
# summed by kind (`--profile micro`; the full table is `benchmarks/results/train_step_profile.txt`),
# and the time the GPU ran nothing (`gpu_idle` in `train_step.py`: gaps under 10 µs are the launch
# latency between back-to-back kernels, longer ones mean the GPU waited for the host; the
# profiler slows the host, so these are upper bounds):

# %%
prof = next((r for r in steps if "profile_ms_per_micro_batch" in r), None)
if prof:
    total = sum(prof["profile_ms_per_micro_batch"].values())
    for k, v in prof["profile_ms_per_micro_batch"].items(): print(f"{k:40s} {v:6.1f} ms  {v / total:5.1%}")
    print(f"{'total':40s} {total:6.1f} ms")
    idle = prof.get("gpu_idle")
    if idle:
        print(f"\nGPU idle between the first and last kernel: {idle['idle_ms']:.1f} of {idle['span_ms']:.1f} ms per micro-batch, "
              f"{idle['gaps_per_micro_batch']:.0f} gaps; by gap length", {k: round(v, 1) for k, v in idle["idle_ms_by_gap"].items()})

# %% [markdown]
# What the numbers say:
#
# * **Memory: 50.9 GB at the preset's step, inside the 80 GB target.** The loss used to build three
#   fp32 logit tensors of 4 × 4096 × 64 256 (main and two MTP heads) with their gradients: 92 GB
#   peak. `linear_cross_entropy` (MTP chapter) computes the same losses and gradients chunk by
#   chunk. The Triton prelude (chapter 14) saves no activation of its own (52.0 → 48.8 GB compiled
#   two rounds ago). This round the GDN forward keeps its triangular inverses $A$ for the backward:
#   +2 GB (84 MB per layer), for one kernel launch fewer per layer. Activation checkpointing brought
#   the peak to 25 GB for 18 % fewer tokens per second (three rounds ago).
# * **MFU: 33.8 % at the preset's step (32 micro-batches per optimiser step, 6.93 s, 75.7 k
#   tokens/s); the target was 40 %.** The same step measured 6.98 s (33.6 %) on another machine
#   earlier this round, before the Newton–Schulz change, which only touches the optimiser step.
#   Earlier rounds: 7.57 s (31.0 %), 8.37 s (28.0 %), 8.75 s (26.8 %). `torch.compile` was worth 1.8×
#   at the preset's step (15.9 s eager, three rounds ago). The optimiser step (NorMuon's batched
#   Newton–Schulz plus AdamW) takes about 0.18 s, which 32 micro-batches amortise.
# * **This round's gains**, per compiled micro-batch (218 → 199 ms of kernel time), and the GPU's
#   waits:
#   - the prelude's weight gradient in a kernel of its own (chapter 14): prelude 21.0 → 14.6 ms;
#   - the GDN backward reuses the forward's $A$ and cumulative gates instead of running the
#     preparation kernel again (chapter 13): GDN rule 36.5 → 30.0 ms;
#   - MoE routing without scatter-adds (chapter 30): the expert counts as a reduction (compiled,
#     `index_add_` had fallen back to a sorting scatter of 0.23 ms per layer; eager kernels
#     10.1 → 7.8 ms), and the rows moved to and from the experts by gathers in both directions
#     (not timed on its own);
#   - batches copied from pinned memory without blocking (chapter 70): a copy from ordinary memory
#     made the host wait for the previous backward at every micro-batch, after which the GPU waited
#     for the host. GPU idle in the profile fell from 21.4 to 10.4 ms per micro-batch;
#   - Newton–Schulz as three batched products per iteration (chapter 50): on the stacked expert
#     matrices 43 → 28 ms in isolation. At the step it is lost in the spread between machines: the
#     optimiser phase is partly limited by the host (one-micro-batch steps took 0.370 and 0.389 s
#     before the change on two machines and 0.403 s after it on a third, whose profile shows the GPU
#     idle for 79 ms of the 510 ms step).
# * **What is left** (the breakdown above, 199 ms of kernels per micro-batch). Matrix multiplies are
#   48 % (96 ms for about 65 TFLOP, some 680 TFLOP/s, near what the H200 gives at these widths; the
#   loss's vocabulary products, about 17 TFLOP, are among them). The GDN rule kernels are 15 %: the
#   local-gradient kernel alone is 0.51 ms per layer. Inductor's fused elementwise kernels are 14 %:
#   RMSNorms with the fp32 residual stream, the output gate, SwiGLU, the MoE's routing and weight
#   casts. cuDNN attention is 7.5 %, the prelude 7.4 %, eager kernels 4 % (mostly adding each
#   micro-batch's gradients into the accumulated ones), the loss's softmax 2.4 %. A micro-batch of
#   the accumulated step takes about 211 ms, so the GPU still waits on the host for about 12 ms
#   of it, and about 6 ms of that is the launch latency of some 4 000 kernels. 40 % MFU needs
#   5.86 s per step, about 177 ms per micro-batch: with the matrix multiplies as they are,
#   everything else would have to fall from about 115 ms (kernels and waits) to 80 ms.
# * **CUDA graphs** (`--compile-mode reduce-overhead`, an experiment in `train_step.py`) would
#   remove the launch latency and the host's share. They failed here: a later replay overwrote
#   outputs that the backward still needed (first an MTP head's, then, with the heads left out, an
#   MLA block's). Not pursued this round.
# * **Triton GDN path against the PyTorch chunked path: 4.1× faster per preset step, both compiled
#   (6.93 s against 28.3 s, this round). The target was 5×.** The MoE changes sped up both paths,
#   so the ratio moved little (4.0× last round, 7.57 against 30.3 s). With one micro-batch per step,
#   three rounds ago: 2.3× compiled, 4.97× eager. The rule kernel itself is 51× faster (1.44 ms
#   against 73 ms per layer, forward + backward; see the Triton chapter), but GDN is only part of
#   the step. 5× needs 5.66 s per step.
# * **All-MLA** (32 MLA + MoE blocks, three rounds ago): 0.75 s per one-micro-batch step at 6.8
#   GFLOPs per token, 15.0 % MFU but 43 % fewer tokens per second than the hybrid, 81 GB, 3.5 B
#   stored parameters, and a KV cache in every layer.

# %% [markdown]
# ## GDN kernel parity on the H200
#
# Relative RMSE $\lVert \text{ref} - \text{out} \rVert_2 / \lVert \text{ref} \rVert_2$ of the
# Triton kernel against the fp32 naive recurrence, for outputs, final state and all six gradients.
# Targets: outputs and state ≤ 0.005, gradients ≤ 0.01.

# %%
ver = json.loads((RESULTS / "gdn_verify_h200.json").read_text())
names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
print(ver["meta"])
print(f"{'kind':16s}{'dtype':9s}{'T':>5s}{'K':>5s}  " + " ".join(f"{n:>7s}" for n in names))
for r in ver["rows"]:
    print(f"{r['kind']:16s}{r['dtype']:9s}{r['T']:5d}{r['K']:5d}  " + " ".join(f"{r[n]:7.1e}" if n in r else "      -" for n in names))
worst_o = max(max(r["o"], r["ht"]) for r in ver["rows"])
worst_g = max(r[n] for r in ver["rows"] for n in names[2:] if n in r)
print(f"worst output/state {worst_o:.1e} (target 5e-3), worst gradient {worst_g:.1e} (target 1e-2)")
assert worst_o <= 5e-3 and worst_g <= 1e-2

# %% [markdown]
# This round the backward started reusing the forward's $A$ and cumulative gates (chapter 13).
# `gdn_verify.py --quick` re-checked the chunk kernel on the H200 afterwards, at both head sizes,
# $T$ = 63 and 256, bf16 and fp32: worst output or state 3.3e-3 and worst gradient 3.6e-3 in bf16,
# 1.7e-3 in fp32, all runs deterministic. (The table above is the earlier full run, which also
# covers the packed and recurrent kernels.)
