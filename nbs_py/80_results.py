# %% [markdown]
# # Results on one GPU
#
# > What the 750M training step and the GDN kernel measure on one H200 (and, in later rounds, on H100s), with the date, the versions and the formulas.

# %% [markdown]
# **In short.** The 750M training step (micro-batches of 4 × 4096 tokens, 32 of them an optimiser
# step, one GPU) was timed over many *rounds* (a round is one session's GPU calls: the code as it
# then stood, and what it measured), on one H200 in rounds 2 to 30 and 44 and on H100s in rounds 31
# to 43 and 45, when only those could be had; torch 2.11 and Triton 3.6 throughout.
#
# * MFU ≥ 40 %: **not met**. At best 37.0 % (H200, round 16), 35.6–36.9 % on the H200s of rounds
#   18 to 30, 36.0–36.1 % on round 44's; 33.8–35.0 % on the H100s (whose dense bf16 peak is the same 989
#   TFLOP/s).
# * Peak memory ≤ 80 GB: **met**, 50.6 GB allocated (GB = 10⁹ bytes; 52.8 GB reserved).
# * The Triton GDN path ≥ 5× the PyTorch chunked path per step: **not met**: 2.6–5.6× with both timed
#   on one machine, 5× or more in 5 of 21 rounds and in none since round 32 (4.63× on round 44's
#   H200, 4.95× on round 45's H100).
# * The GDN kernels against the fp32 loop on the GPU, outputs and gradients: within 6.3e-3 in bf16
#   at every shape checked (HyMo's heads of 32, heads of 128, keys of 64).
#
# The numbers on this page were measured on one NVIDIA H200 (torch 2.11, Triton 3.6) on
# 2026-12-02 to 2026-12-05 (rounds 2 to 30 of work on the step) and 2026-12-07 (round 44), and in rounds 31 to 43 and 45 on H100s (2026-12-05 to 2026-12-07)
# (their rows say which, the bar chart marks them `[H100]`, and the chart of rounds colours them), by the scripts in `benchmarks/`,
# which write JSON into `benchmarks/results/`; this page only reads those files, so it renders
# anywhere. Re-run them on your GPU with
#
# ```sh
# python benchmarks/train_step.py --compile --accum 32           # the preset's real step on one GPU (+ --timeline: each micro-batch)
# python benchmarks/train_step.py --compile --profile micro      # also what the host ran in the longest GPU gaps; + --ac, --gdn torch, ...
# python benchmarks/train_step.py --compile --profile cuda       # the GPU's waits on its host, barely disturbed
# python benchmarks/train_step.py --compile --doc-masking 1024   # packed documents of about 1 024 tokens (cu_seqlens)
# python benchmarks/train_step.py --compile --fsdp --accum 32    # through FSDP on a group of one GPU, as torchrun runs each GPU
# python benchmarks/host_launch.py                               # the host's time to launch a kernel or an operator
# python benchmarks/block_step.py [--block mla]                  # one compiled block, forward + backward
# python benchmarks/gdn_verify.py && python benchmarks/gdn_kernel.py   # GDN parity with the loop (exit 1 past tolerance), the rule's times
# python benchmarks/gdn_prep_solve.py                            # ways to solve for the GDN's A (kernel 1): time and accuracy
# python benchmarks/gdn_registers.py                             # registers and spills of the GDN kernels (no GPU needed)
# python benchmarks/optim_step.py                                # NorMuon and AdamW alone, on random gradients
# python benchmarks/gdn_conv_kernel.py --sweep && python benchmarks/ce_kernel.py --sweep
# python benchmarks/generate_speed.py --prompt 3840               # decoding with the state against re-running the context
# ```
#
# (Each prints its numbers; `--out FILE` also writes them as JSON. `OUT=/tmp/bench bash benchmarks/h200_train_step.sh PART` runs the set, one process per
# variant, in four parts, one call each: `main`, `variants`, `kernels`, `host`. It writes to a scratch folder: the
# files here are the page's record, and a row worth keeping is copied over by hand, newest first,
# with its `code` (`--code`, what was measured) and a `note`. On a machine without a GPU each script
# says so in one line and names what a CPU can run instead, such as the tests that run the kernels
# through Triton's interpreter.)
#
# **MFU** is tokens per second × `HyMo.flops_per_token(4096)` ÷ 989 TFLOP/s (the dense bf16 peak
# of the H200, and of the H100 SXM). A row's step time is the median of its timed steps (of two,
# the slower), each after untimed warm-up steps; its memory is the allocator's peak of allocated
# memory (`peak_mem_gb`, GB = 10⁹ bytes; the H100 rows also record the reserved peak). The model's own accounting gives 4.42 GFLOPs per training token for `hymo_750m` at
# $T = 4096$ (3 × forward, a multiply-add is two FLOPs, attention over the causal half, the
# chunked GDN rule as the kernels compute it (the recurrence's own work would count 1.4 % less) and the MTP heads' vocabulary projections included; see the model chapter). PaLM's
# formula counts attention over the whole $T \times T$ square, 9.1 % more at this shape: by it,
# round 16's 37.0 % would read 40.3 %. The targets here are judged by the model's
# own count, the work the kernels do. With
# packed documents (`--doc-masking`) a query attends only within its document, and the attention
# term is counted that way: 4.17 GFLOPs per token for the benchmark's documents of about 1 024
# tokens (the rows measured before round 26 were recomputed so; each note gives the old figure).
#
# ## Against the targets
#
# The targets of the 750M step on one H200, and where round 44 (2026-12-07) leaves them. Every
# number is in a row of the tables below, or in its note. Rounds 31 to 43 and 45 (2026-12-05 to 07) could
# get only an H100 for the step (round 35 ran the tests on an H200): their numbers are in the round log, not in the "measured" column here, except
# the ratio, which compares two steps on one machine.
#
# | target | measured | met |
# |---|---|---|
# | ≥ 40 % MFU at the preset step (4 × 4096 tokens a micro-batch, 32 a step) | best 37.0 % (6.343 s a step, round 16); 36.1–36.4 % in round 18 (two machines), 35.7–36.2 % in round 19 (three machines), 36.1 % in round 20 (one), 36.2 % in round 22 (one), 36.6 % in round 23 (one), 35.6–36.2 % in round 24 (two), 36.9 % in round 25 (one), 36.7–36.9 % in round 28 (one), 36.2 % in round 29 (one), 36.3 % in round 30 (one), 36.0–36.1 % in round 44 (one) | no |
# | ≤ 80 GB peak memory, same step | 50.6 GB allocated | yes |
# | Triton GDN path ≥ 5× faster per step than the PyTorch chunked path | 4.95× (round 45, paired, on an H100), 4.63× (round 44, paired, on an H200), 2.99× (round 42, paired, on an H100), 3.87× (round 40, paired, on another H100), 2.93× (round 38, paired, on another H100), 3.69× (round 37, paired, on an H100), 4.61× (round 36, paired, on an H100), 4.81× (round 33, paired, on another H100), 5.58× (round 32, paired, on another H100), 4.54× (round 31, paired, on another H100), 5.01× (round 29, paired; 5.51× against the Triton step of the call after the PyTorch one's), 2.56× (28, paired), 4.46× (24), 4.20× (23), 5.36× (19), 5.29× (18), 4.3–4.6× (16), 5.3–5.5× (15), 3.6× (13), 4.98× (11), 4.4× (9) | no: met in 5 of the 21 rounds that timed both paths on one machine (rounds 2 to 6 timed the PyTorch path too, but not beside the Triton step on the same machine), none since round 32: the newest six are 2.9–4.95×, as the PyTorch path's host and code changed |
#
# The PyTorch path's step is set by its host's launch speed (round 29's timeline of that path, in
# the bullet on it below, shows the host taking as long to issue a micro-batch as the GPU to run
# it, and the GPU running dry), so the ratio moves by machine; the Triton path's step moves by 2–3 % between machines running the same
# code, more than most single changes of the last rounds. What 40 % would still need is in the
# bullet "What is left" below.

# %%
import json
import math
import re
from pathlib import Path
import matplotlib.pyplot as plt

# %%
RESULTS = Path("../benchmarks/results")
steps = json.loads((RESULTS / "train_step.json").read_text())
assert all(a["date"] >= b["date"] for a, b in zip(steps, steps[1:])), "rows are kept newest first: this page reads them so"

# %%
PRESET = "hybrid gdn=triton ac=False compile=True accum=32 loss=fused"  # the preset step's variant
preset = [r for r in steps if r["variant"] == PRESET
          and not r["code"].startswith("experiment") and r["gpu"] == "NVIDIA H200"]  # the targets are for one H200
best = max(preset, key=lambda r: r["mfu"] or 0)  # a GPU missing from the peak table has no MFU (None)
print(f"best preset step: {best['mfu']:.1%} MFU, {best['step_s']:.3f} s, {best['peak_mem_gb']:.1f} GB ({best['code']})")
print(f"newest on an H200: {preset[0]['mfu']:.1%} MFU, {preset[0]['step_s']:.3f} s ({preset[0]['code']})")
print(f"peak memory of every preset row: {min(r['peak_mem_gb'] for r in preset):.1f}-{max(r['peak_mem_gb'] for r in preset):.1f} GB")
assert round(100 * best["mfu"], 1) == 37.0 and max(r["peak_mem_gb"] for r in preset) < 80  # the table above


# %% [markdown]
# The ratios of the last row come from pairs of rows: each PyTorch-path step against the preset
# step of the same round in the row next to it (rows are newest first, so "after" is the row
# above). Not every such pair was timed on one machine: the table's number is the pairing the
# round's log names as such, and a few older rounds compared with a step further away, as their
# notes say, so some printed below (round 11's 4.89×, round 9's row against round 8's) are not the
# table's.

# %%
def round_of(r):  # "round 38b" of a row's code, or None for a row not named by its round
    m = re.match(r"round \d+\w?", r["code"])
    return m and m.group(0)

ratios = {}
for i, r in enumerate(steps):
    if r["variant"] != PRESET.replace("triton", "torch") or not round_of(r): continue
    for where, j in (("after", i - 1), ("before", i + 1)):
        s = steps[j] if 0 <= j < len(steps) else None
        if s and s["variant"] == PRESET and s["gpu"] == r["gpu"] and (round_of(s) or "").rstrip("bc") == round_of(r).rstrip("bc"):
            ratios[(round_of(r), where)] = ratio = r["step_s"] / s["step_s"]
            print(f"{round_of(r):10s} PyTorch {r['step_s']:6.2f} s / preset {s['step_s']:.3f} s ({where}, {round_of(s)}): {ratio:.2f}x")
for name, want in (("round 45b", "4.95"), ("round 44b", "4.63"), ("round 42b", "2.99"), ("round 40b", "3.87")):  # the table's newest four
    assert f"{ratios[(name, 'after')]:.2f}" == want, (name, ratios[(name, "after")])


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
        mfu = f"{r['mfu']:6.1%}" if r["mfu"] is not None else "     -"
        print(f"{label(r):40s} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} {mfu} {r['peak_mem_gb']:8.1f}"
              + (f"   {r['note']}" if r.get("note") else ""))
for gpu in dict.fromkeys(r["gpu"] for r in steps):
    mine = [r for r in steps if r["gpu"] == gpu]
    print(f"{gpu}: {len(mine)} rows, torch {' '.join(sorted({r['torch'] for r in mine}))}, {mine[-1]['date']} to {mine[0]['date']}")


# %%
#| fig-alt: "Horizontal bars, one per benchmark variant and GPU: MFU in percent against the 40 percent target (dashed), and peak memory in GB against the 80 GB target (dashed)."
def when(code):
    "A bar's suffix: the round whose code the row measured (rounds are numbered from the first GPU round, 2)."
    m = re.match(r"(experiment.*?)?round (\d+)", code)
    if not m: return " (experiment)" if code.startswith("experiment") else ""
    return f" ({'experiment, ' if m.group(1) else ''}round {m.group(2)})"

def gpu_tag(r): return "" if r["gpu"] == "NVIDIA H200" else f" [{r['gpu'].replace('NVIDIA ', '')[:4]}]"

newest = {}  # one bar per variant and GPU: its newest row (the table above has them all)
for r in steps: newest.setdefault((r["variant"], r["gpu"]), r)
bars = list(newest.values())
names = [label(r) + when(r["code"]) + gpu_tag(r) for r in bars]
fig, ax = plt.subplots(1, 2, figsize=(10, 1 + 0.3 * len(bars)))
ax[0].barh(names, [100 * (r["mfu"] or 0) for r in bars], color="tab:blue")
ax[0].axvline(40, ls="--", c="k", lw=1); ax[0].set_xlabel("MFU, % (target 40)"); ax[0].invert_yaxis()
ax[1].barh(names, [r["peak_mem_gb"] for r in bars], color="tab:orange")
ax[1].axvline(80, ls="--", c="k", lw=1); ax[1].set_xlabel("peak memory, GB (target 80)"); ax[1].invert_yaxis()
ax[1].set_yticklabels([])
fig.tight_layout(); plt.show()

# %% [markdown]
# The preset's step (compiled, 32 micro-batches) round by round, every row measured of it:

# %%
#| fig-alt: "MFU in percent of the preset's training step, round by round, one colour per GPU, with the 40 percent target dashed."
fig, ax = plt.subplots(figsize=(8, 3))
rounds = [(r["gpu"], int(m.group(1)), 100 * r["mfu"]) for r in steps  # every GPU with rows, yours included
          if r["variant"] == preset[0]["variant"] and r["mfu"] and (m := re.match(r"round (\d+)", r["code"]))]
for gpu in dict.fromkeys(g for g, _, _ in rounds):
    ax.scatter(*zip(*[(n, mfu) for g, n, mfu in rounds if g == gpu]), s=14, label=gpu.replace("NVIDIA ", ""))
ax.axhline(40, ls="--", c="k", lw=1); ax.set_xlabel("round"); ax.set_ylabel("MFU, %"); ax.legend(loc="lower right")
fig.tight_layout(); plt.show()

# %% [markdown]
# ### Where a micro-batch's time goes
#
# The profiler's self CUDA time of every kernel over three compiled forward + backward passes,
# summed by kind, and the time the GPU ran nothing (`gpu_idle` in `train_step.py`: gaps under 10 µs
# are the launch latency between back-to-back kernels, longer ones mean the GPU waited for the
# host). The three passes run inside one step's `accumulation`, so a third of the once-per-step
# work (the refresh of the bf16 copies; under FSDP the step's first all-gathers and its last
# reduction) lands in each micro-batch's numbers, where a 32-micro-batch step spreads it over 32
# (`--profile-micro-batches 32` profiles a whole step's worth).
# Round 19's profile (of round 18's final code; see its note in the table) records only the GPU's
# activity (`--profile cuda`), which slows the host far less than recording its operators, though
# not to nothing. On its machine the GPU waited on the host for almost nothing: 0.07 ms per
# micro-batch in gaps of 10 µs or more, where round 15's profile, on another machine, showed 8.1 ms
# (its longest between blocks; round 17's unprofiled timeline found the GPU busy at 836 of 837
# micro-batch boundaries). Its table of the top kernels is
# `benchmarks/results/train_step_profile_cuda.txt`, round 15's is
# `train_step_profile_cuda_round15.txt`. Tables with the host's operators too
# (`--profile micro`) are `train_step_profile_micro.txt` (round 15) and `train_step_profile.txt`
# (round 6); recording the host's operators slows the host about twofold, so the waits they show
# are not those of an unprofiled run, but they name what the host was doing in each long gap.

# %%
prof = next((r for r in steps if "profile_ms_per_micro_batch" in r and not r.get("profile_host_recorded")
             and "gdn=triton" in r["variant"] and "docs~" not in r["variant"] and "fsdp" not in r["variant"]
             and r["gpu"] == "NVIDIA H200"), None)  # the preset's, under autocast, with the host undisturbed, on an H200
if prof:
    total = sum(prof["profile_ms_per_micro_batch"].values())
    for k, v in prof["profile_ms_per_micro_batch"].items(): print(f"{k:40s} {v:6.1f} ms  {v / total:5.1%}")
    print(f"{'total':40s} {total:6.1f} ms")
    assert round(total, 1) == 191.3, "the prose below reads round 19's profile: update it for a new one"
    idle = prof.get("gpu_idle")
    if idle:
        print(f"\nGPU idle between the first and last kernel: {idle['idle_ms']:.1f} of {idle['span_ms']:.1f} ms per micro-batch, "
              f"{idle['gaps_per_micro_batch']:.0f} gaps; by gap length", {k: round(v, 1) for k, v in idle["idle_ms_by_gap"].items()})

# %% [markdown]
# ### A step's timeline, unprofiled
#
# `train_step.py --timeline` puts CUDA events around every micro-batch of the timed steps (no
# profiler) and records how long the host took to issue it, and whether the GPU had already run
# out of work when the host began the next one. The preset step's newest row on an H200 with a timeline:

# %%
tl_row = next((r for r in preset if r.get("timeline")), None)  # the preset step's, on an H200
if tl_row:
    print(f"{label(tl_row)}, {tl_row['code']}")
    for i, t in enumerate(tl_row["timeline"]):
        print(f"step {i}: {t['micro_batches']} micro-batches, GPU span {t['gpu_span_ms_mean']:.1f} ms each "
              f"({t['gpu_span_ms_min']:.1f}-{t['gpu_span_ms_max']:.1f}), host {t['host_ms_mean']:.1f} ms to issue one; "
              f"GPU ran dry at {t['boundaries_gpu_drained']} of {t['boundaries']} boundaries; "
              f"{t['before_first_ms']:.1f} ms before the first, {t['after_last_ms']:.1f} ms after the last")

# %% [markdown]
# What the numbers say:
#
# * **Memory: 50.6 GB at the preset's step (every round since 11), inside the 80 GB target.** The loss
#   used to build three fp32 logit tensors of 4 × 4096 × 64 256 (main and two MTP heads) with
#   their gradients: 92 GB peak. `linear_cross_entropy` (MTP chapter) computes the same losses and
#   gradients chunk by chunk. The Triton prelude (chapter 14) saves no activation of its own
#   (52.0 → 48.8 GB compiled in round 3). The GDN forward keeps its triangular inverses $A$ (in
#   round 5, +2 GB) and, since round 6, its chunk states (+0.5 GB, 21 MB per layer) for the
#   backward. Activation checkpointing brought the peak to 25 GB (in round 2), at 0.521 against
#   0.427 s a step of one micro-batch, 18 % fewer tokens per second. That step holds a whole
#   optimiser step too, so round 27 estimated about 25 % fewer tokens per second at the preset's
#   32 micro-batches. Round 28 measured it: **21.9 GB peak and 9.04 s a step (58.0 k tokens/s,
#   25.9 % MFU), 29.8 % fewer tokens per second** than the same machine's 6.35 s without it.
# * **What is left** (the breakdown above, round 19's profile of round 18's code: 191.3 ms of
#   kernels per micro-batch). Matrix multiplies are about 52 % (98.6 ms, about 65 TFLOP at some 650
#   TFLOP/s, near what the H200 gives at these widths; the loss's vocabulary products, about 17
#   TFLOP, are among them, and the routed experts' grouped products, 17.2 ms at about 570 TFLOP/s,
#   are the slowest). The GDN rule kernels are 13 % (25.5 ms; the local-gradient kernel alone
#   0.50 ms per layer, 12.1 ms per micro-batch). Inductor's fused elementwise kernels are 12 %
#   (23.2 ms: RMSNorms, the output gate, SwiGLU, the MoE's routing, and since round 11
#   `add_into`'s additions of the copies' gradients), cuDNN attention 8 % (15.6 ms), the prelude
#   7.8 % (15.0 ms), eager kernels 3 % (5.7 ms), the loss's softmax 2.6 % (5.0 ms). A profiled
#   micro-batch spans 196.5 ms: 191.3 ms of kernels and 5.1 ms of launch latency between some
#   3 500 kernels; the GPU hardly waits for its host (rounds 17 and 19). On round 16's fastest
#   machine a step took 6.343 s, about 195 ms per micro-batch besides some 0.12 s once per step
#   (the optimisers and clipping; about 0.10 s since round 18). 40 % MFU needs 5.86 s per step,
#   about 180 ms per micro-batch. The matrix multiplies and attention already run in the fastest
#   kernels available at their shapes (rounds 15 and 16; the experts' grouped products trail the
#   dense ones by some 4 ms, a gap of the grouped kernel that round 19 found no way around), so
#   everything else would have to give up the rest. On round 19's profiled machine, whose
#   unprofiled micro-batches spanned 199.3 ms, with 114 ms of matrix multiplies and attention,
#   that is about 85 ms of other kernels and launch gaps falling to about 66 ms: 23 % less.
# * **CUDA graphs** (`--compile-mode reduce-overhead`, an experiment in `train_step.py`) would
#   remove the launch latency (5–6 ms per micro-batch; 5.1 ms in round 19's profile). They failed
#   here (in round 5): a later replay overwrote outputs that the backward still needed (first an MTP
#   head's, then, with the heads left out, an MLA block's). Round 10 captured whole micro-batches
#   instead (its entry in the round log, below): it works, and with the bf16 copies it gains nothing.
# * **Round 29: the PyTorch path is host-bound, measured.** With `--timeline` (CUDA events, no
#   profiler) on one machine, that path's host took 1 112 ms to issue a micro-batch and the GPU
#   spanned 1 112 ms, running dry at 25 of the 31 boundaries between micro-batches (a step of
#   35.71 s); in a second call, after the Triton step, 1 010 ms against 1 011 ms, dry at 16 of 31
#   (32.46 s). The Triton path's host took 197 ms for a GPU span of 199 ms, and its GPU never ran
#   dry: the GPU sets its pace. The paired ratio was 5.01× (32.46 s against 6.486 s); with the first
#   call's step, 5.51×. Round 28's 2.56× came from a machine whose host ran that path twice as fast.
# * **Round 28: the PyTorch path ran far faster than ever before, and the ratio fell to 2.56×.** On the
#   round's first machine, three steps in one call, PyTorch, Triton, PyTorch, took 16.34, 6.389 and
#   16.34 s; an earlier call there took 16.58 s against 6.348 s (2.61×). No change since round 24
#   touched the PyTorch path's code, and the Triton path's step is as usual. The PyTorch path's steps
#   were 23.3–35.5 s on every earlier machine, which fits the explanation below (the host sets that
#   path's speed) with a much faster host; this round did not profile it to confirm.
# * **Triton GDN path against the PyTorch chunked path: 4.46× faster per preset step in round 24
#   (28.87 s against 6.473 s), 4.20× in round 23 (26.87 s against 6.400 s), 5.36× in round 19, 5.29× in round 18, 4.3–4.6× in round 16 and 5.3–5.5× in round 15, both paths compiled, each
#   round on one machine (round 19's fifth: one timed step of 35.14 s against 6.559 s; round 18's
#   first: one timed step of 34.38 s against 6.498 s; round 16's third: the
#   PyTorch path's two timed steps took 29.30 and 27.58 s, the Triton path's 6.343 s; round 15's
#   second: 34.35 and 35.51 s against 6.489 s); the target is 5×. The same comparison read 3.6×
#   in round 13 (23.25 s against 6.431 s) and 4.98× in round 11 (32.2 s against 6.473 s).** The
#   ratio moves with the machine most likely because the PyTorch path's step is
#   set by the host, not the GPU: its profile on round 15's second machine
#   (`train_step_profile_cuda_torch_gdn.txt`) shows 430 ms of kernels in a 1 549 ms micro-batch,
#   the GPU idle 72 % of the time between some 45 000 kernels, among them about 18 000 small
#   products averaging 3–5 µs from the chunk loop. Its steps took 23.3–35.5 s from round 5 to round
#   16 (the changes in between, such as the bf16 residual stream, could only speed it up), while
#   the Triton path's, which keeps the GPU busy (idle 7 %), differed by about 2–3 % between machines
#   running the same code. So 5× held on round 15's, 18's and 19's machines and not on round 13's
#   or 16's; this page reports each measurement as it came (the hosts' launch speeds were not compared). Earlier
#   rounds: 4.4× in round 9 (29.4 s against 6.71–6.74 s); rounds 5 and 6 timed the two paths on
#   different machines (28.3 and 24.8 s, 3.6–4.1× against each round's own Triton steps). With one
#   micro-batch per step, in round 2: 2.3× compiled, 3.6× eager. The rule kernel itself is 51×
#   faster (1.44 ms against 73 ms per layer, forward + backward; see the Triton chapter), but GDN
#   is only part of the step.
# * **All-MLA** (32 MLA + MoE blocks, in round 2): 0.75 s per one-micro-batch step at 6.8
#   GFLOPs per token, 15.0 % MFU but 43 % fewer tokens per second than the hybrid, 81 GB, 3.5 B
#   stored parameters, and a KV cache in every layer. A step of one micro-batch includes a whole
#   optimiser step, here over 2.85× the hybrid's parameters, so that 43 % mixes the optimisers'
#   cost into what is meant to compare attention. **At the preset's 32 micro-batches (round 28):
#   9.16 s a step, 57.2 k tokens per second, 30.7 % fewer than the hybrid's 82.6 k that session, at
#   6.79 GFLOPs per token (1.54× the hybrid's), so 39.3 % MFU, and 88.7 GB.** Dense attention keeps
#   the GPU busier (the matrix products are larger) but each token costs more, and the MoE in every
#   block stores 3.52 B parameters: the hybrid trains more tokens per second in less memory.
#
# ::: {.callout-note collapse="true"}
# ## The round log: what each round changed and measured (rounds 6 to 45)
# * **Round 45 (2026-12-07): an H100 80GB HBM3 (torch 2.11, Triton 3.6), given when an H200 was
#   asked for; commit 4e854e8 with the trainer's background check of the dataset's bytes added
#   (chapter 60's `ContentsCheck`, off the step's path: the benchmark trains on synthetic tokens), so
#   the step is round 44's.** The trainer's tests of an FSDP step cut short (one CPU rank, torch 2.11)
#   passed but one: the test of a reset cut by a second Ctrl-C also patched FSDP's own
#   `reset_iter_state`, which this torch lacks; it now tests the resets the torch has, and passed there
#   with HyMo's reset (two tests, 46 s, with the two-rank test of the data check). **The preset step
#   6.752 s (34.7 % MFU, 77.6 k tokens/s, 50.6 GB allocated, 52.8 GB reserved; five timed steps
#   6.736–6.766 s)**, inside the H100s' earlier 33.8–35.0 %; with `--timeline` the host took 205 ms to
#   issue a micro-batch and the GPU spanned 207 ms, never running dry. The PyTorch GDN path in the
#   next call took 33.28 s (one timed step, 78.8 GB allocated, 80.5 GB reserved), 61 % slower than
#   round 42's on another H100, and the Triton step just after it 6.711 and 6.717 s (34.9 %): **4.95×
#   paired** (4.93× against the call before), the highest since round 32, still under 5×.
# * **Round 44 (2026-12-07): an H100 80GB HBM3 (torch 2.11, Triton 3.6), given when an H200 was
#   asked for; commit 470b5bc, whose step is round 42's.** `benchmarks/gdn_verify.py
#   --quick --shapes k64,k64v16` (`gdn_verify_k64_h100_round44.json`): passed, all 28 cases, with
#   keys 64 wide and values 64 or 16 wide (16-bit values narrower than the keys run padded to
#   them): outputs and states within 4.24e-3 and gradients within 6.04e-3 of the fp32 loop in bf16,
#   1.62e-3 and 2.21e-3 in fp32, as at HyMo's $K = 32$. The wrong gradients of
#   flash-linear-attention's issue 640 (Hopper, Triton before 3.7.1, keys 64 wide) do not show in
#   HyMo's kernels under Triton 3.6, and the wrapper no longer warns at that shape. The trainer's
#   tests of an FSDP step cut short (one CPU rank, torch 2.11) passed; this torch's FSDP has no
#   `reset_iter_state`, which led to HyMo's own reset after a step cut in backward (chapter 70);
#   with it, the new test's 32 cuts in backward passed there too (7 tests, 103 s). Then an H200
#   came (commit d2530a1, the same step): **the preset step 6.489 s (36.1 % MFU, 80.8 k tokens/s,
#   50.6 GB allocated, 52.8 GB reserved; five timed steps 6.483–6.502 s)**, the H200's first timing
#   since round 30 (6.455 s there); with `--timeline` the host took 197 ms to issue a micro-batch and
#   the GPU spanned 199 ms, never running dry. The PyTorch GDN path in the next call took 30.13 s
#   (one timed step, 78.8 GB allocated, 80.5 GB reserved) and the Triton step just after it 6.461
#   and 6.514 s (36.0 %): **4.63× paired** (4.64× against the call before), the first pair on an
#   H200 since round 29's 5.01×.
# * **Round 43 (2026-12-07): an H100 80GB HBM3 (torch 2.11, Triton 3.6), given when an H200 was
#   asked for; commit bae8a61, whose step is round 42's (the GDN verifier's verdict, the trainer's
#   wandb runs and evaluation, and streamed generation changed, off the step's path).** No preset
#   step (round 42 timed this step on this kind of card). The CUDA tests of generation, the model's
#   compiled and decoding paths and the trainer's GPU evaluation (11 passed). `benchmarks/gdn_verify.py
#   --quick` with its verdict (`gdn_verify_quick_h100_round43.json`): passed, all 30 cases within
#   tolerance, deterministic and finite; every output and state within 4.8e-3 and every gradient
#   within 6.1e-3 in bf16 (1.8e-3 and 2.4e-3 in fp32), the kept-prep path equal to the recomputing
#   one bit for bit; the command took 52.5 s with Triton's cache filled (its cases' own timings add
#   to 23.1 s). On the machine's first call, the cache
#   empty, compiling took the verifier past the 150 s that `h200_train_step.sh kernels` gave it
#   (killed in its 22nd case of 30), and `gdn_prep_solve.py` past its 120 s: both limits are now 300 s,
#   and the `kernels` part then passed in 137 s (exit 0). The rule alone at the 750M shape: Triton
#   0.337 ms forward and 1.279 ms forward and backward, PyTorch chunked 20.98 and 83.36 ms (printed
#   by `gdn_kernel.py`, not kept in a file). Later calls to check 16-bit keys 64 wide
#   (`gdn_verify.py --shapes k64,k64v16`, the width flash-linear-attention's issue 640 saw fail on
#   Hopper before Triton 3.7.1) got no machine, and the session's device time ran out: round 44
#   checked that shape.
# * **Round 42 (2026-12-07): an H100 80GB HBM3 (torch 2.11, Triton 3.6), given when an H200 was
#   asked for; commit 411837c, whose step is round 41's.** One call: the preset step 6.892 and
#   6.909 s (33.9 % MFU, 75.9 k tokens/s, 50.6 GB allocated, 52.8 GB reserved), 2.5 % slower than
#   round 41's on another H100 with the same step; the PyTorch GDN path 20.67 s (one timed step,
#   78.8 GB allocated, 80.5 GB reserved); the Triton step just after it 6.898 and 6.905 s:
#   **2.99× paired**. This machine's PyTorch path was 21 % faster than round 40's while its Triton
#   step was 2 % slower, so the ratio fell: the PyTorch path's speed is its host's.
# * **Round 41 (2026-12-07): an H100 80GB HBM3 (torch 2.11, Triton 3.6); commit c2e4329, whose
#   step is round 40's (validation no longer runs the MTP heads; checks of the data's install and of
#   hand-made MLA caches).** One call: the CUDA tests of MLA, the model, generation, MoE, MTP and the
#   trainer's evaluation (24 passed), then the preset step: 6.724 and 6.758 s (34.7 % MFU, 77.6 k
#   tokens/s, 50.6 GB allocated, 52.8 GB reserved), within 0.4 % of round 40's.
# * **Round 40 (2026-12-07): two H100 80GB HBM3 machines (torch 2.11, Triton 3.6); commit b464d5c,
#   whose step is round 39's (the trainer's loading, wandb runs and file writing changed, off the
#   step's path).** The first machine (rows `round 40a`) ran the CUDA tests of the trainer's random state and load
#   errors and the compiled, flash and decoding checks (20 passed), then the preset step: 6.731 and
#   6.733 s (34.8 % MFU, 77.9 k tokens/s, 50.6 GB allocated, 52.8 GB reserved).
#   `benchmarks/gdn_verify.py --quick` (`gdn_verify_quick_h100_round40.json`): against the fp32
#   loop, every output and state within 4.81e-3 and every gradient within 6.12e-3 in bf16 (1.8e-3 and
#   2.4e-3 in fp32), 30 cases over the three decay regimes, the packed rows and the fused recurrent
#   kernel; every run deterministic and finite, and the path that keeps the forward's gates, $A$ and
#   states equal to the recomputing one bit for bit. At the 750M shape (B 4, T 4096, 40 heads of
#   32) the Triton rule took 0.337 ms forward and 1.289 ms forward and backward, the PyTorch chunked
#   rule 20.8 and 67.1 ms (printed by `gdn_kernel.py`, not kept in a file; 52× for the rule alone; the step's ratio is smaller, as the rule is a
#   small part of the step). On a second machine (rows `round 40b` and `40c`) the PyTorch GDN path took 26.29 s a step (one
#   timed step, 78.8 GB allocated, 80.5 GB reserved, no `expandable_segments`) and the Triton step
#   just after it 6.766 and 6.784 s: **3.87× paired**, between round 38's 2.93× and round 36's
#   4.61× (round 37: 3.69×) on other H100s, as the PyTorch path's host speed varies.
# * **Round 39 (2026-12-06): an H100 80GB HBM3 (torch 2.11, Triton 3.6); commit ddd660e, whose step
#   differs from round 38's by the MoE's routed scaling factor (`moe_route_scale`, 1 in the preset:
#   one multiply of the [N, k] routing weights) and host-side shape checks.** One call, after the
#   CUDA tests of the MoE, MLA, GDN, model decoding and trainer (153 passed). The preset step took
#   6.733 and 6.750 s (34.7 % MFU, 77.7 k tokens/s, 50.6 GB allocated, 52.8 GB reserved), as
#   round 37's on an H100; the PyTorch path was not timed (no device time left for it).
# * **Round 38 (2026-12-06): an H100 80GB HBM3 again, perhaps another (torch 2.11, Triton 3.6);
#   commit 16e2562: the PyTorch path's decay matrix is masked before `exp` (chapter 12), so autograd
#   keeps one $C \times C$ matrix a chunk, not two.** One machine, one call. The preset step took
#   6.825 and 6.845 s (34.3 % MFU, 76.6 k tokens/s, 50.6 GB allocated, 52.8 GB reserved). The
#   PyTorch GDN path now fits the 80 GB card without `expandable_segments`: 78.8 GB allocated
#   (82.6 GB in round 37), 80.5 GB reserved, and took 20.13 s a step (one timed step); the Triton
#   step just after it took 6.855 and 6.869 s: **2.93× paired**. The PyTorch path's step is again
#   faster than the round before's (24.8 s), as its host issues launches faster and it now
#   allocates less, so the ratio falls further from the 5× target; the Triton step stayed within
#   2 % of round 37's on another machine.
# * **Round 37 (2026-12-06): an H100 80GB HBM3 (torch 2.11, Triton 3.6); commit 1d94cc1, whose
#   step differs from round 36's only by checks: of the Triton wrappers' inputs, of a NaN gate (kept
#   NaN), and of the configuration `HyMo` is built from.** One machine, two calls. The preset step
#   took 6.736 and 6.750 s (34.7 % MFU, 77.7 k tokens/s, 50.6 GB allocated, 52.8 GB reserved). The
#   PyTorch GDN path ran out of memory (78.96 GiB in use, 512 MiB more asked for), where round 36
#   measured 74.8 GB; most likely (not measured apart) its decay matrices, built since then from
#   segment sums (`where(...).cumsum().exp()`, chapter 12, so that a hard reset stays finite), keep
#   more for the backward at this shape. With `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` it
#   fit: 24.79 s a step (the upper of 24.79 and 23.74), 82.6 GB allocated; the Triton step just after
#   it took 6.705 and 6.712 s: **3.69× paired**. The ratio fell because this host issued the PyTorch
#   path's launches faster than round 36's (24.8 s against 30.9 s; the segment sums cost the rule
#   itself about 1 %); the Triton step's time did not move. So on an 80 GB card the PyTorch path
#   needs `expandable_segments` at the 750M shape; the preset's own path, Triton's, uses 50.6 GB.
# * **Round 36 (2026-12-06): an H100 80GB HBM3 again; no change to the step since round 33 (commit
#   b2d23ae).** One machine, three calls. The preset step took 6.706 and 6.718 s (the row's: 34.9 %
#   MFU, 78.0 k tokens/s, 50.6 GB allocated, 52.8 GB reserved); with `--timeline` the host took
#   204 ms to issue a micro-batch and the GPU spanned 206 ms, never running dry. The PyTorch GDN
#   path just after it took 30.89 s (74.8 GB), and the Triton step once more 6.708 s: **4.61×
#   paired**. `benchmarks/gdn_verify.py --quick` under Triton 3.6
#   (`gdn_verify_quick_h100_round36.json`): against the fp32 loop, every output and state within
#   4.81e-3 and every gradient within 6.2e-3 in bf16 (2.4e-3 in fp32), for the three decay regimes,
#   the packed rows and the fused recurrent kernel (30 cases); every run deterministic and finite, and
#   the path that keeps the forward's gates, $A$ and states equal to the recomputing path bit for bit.
# * **Round 35 (2026-12-06): an H100 80GB HBM3 for the step, an H200 for the tests; no change to the
#   step since round 33 (commit 68ac275).** The preset step took 6.766 and 6.771 s (the slower of
#   the two is the row's: 34.6 % MFU, 77.4 k tokens/s, 50.6 GB allocated, 52.8 GB reserved); with
#   `--timeline` the host took 206 ms to issue a micro-batch and the GPU spanned 208 ms, never
#   running dry. The whole test suite ran under torch 2.11 and Triton 3.6 for the first time. On the
#   H100 (cut at 330 s) it found five tests that assumed a CPU or PyYAML 6.0.3, not faults of the
#   package; once they were fixed, on an H200 (commit fa82180), 835 passed and none failed, in 237 s
#   on 15 workers, among them the fused NorMuon update on CUDA and the two-rank FSDP tests (on the
#   CPU, gloo). The 38 skipped are mostly the kernels through Triton 3.6's interpreter, which NumPy
#   2.5 breaks there (`gdn_verify.py` checks them on the GPU instead); the rest need what that
#   machine lacks (wandb) or a machine without a GPU.
# * **Round 34 (2026-12-05): an H100 80GB HBM3 came for the H200 asked; no change to the step since round 33
#   (commit b6765c4).** The preset step took 6.794 and 6.805 s (34.5 % MFU, 77.0 k
#   tokens/s, 50.6 GB), as round 33's; with `--timeline` the host took 207 ms to issue a micro-batch
#   and the GPU spanned 209 ms, never running dry. `benchmarks/gdn_verify.py --quick` kept every
#   relative error under 6.1e-3 (bf16) and 2.4e-3 (fp32) for the outputs and all six gradients (30
#   cases), and the CUDA tests of MLA, the model, the trainer, the MoE and MTP passed (38), two of
#   them on a GPU for the first time: varlen flash refused for values narrower than the queries,
#   and the fused loss scaling its bf16 gradients in fp32 on CUDA.
# * **Round 33 (2026-12-05): no H200 could be started; on an H100 80GB HBM3, the trainer now runs each backward
#   inside `stats_paused` (chapter 30: activation checkpointing's second forward no longer adds the MoE
#   counts again) over a list of the MoE layers made once.** The preset step took 6.785 and 6.803 s
#   (34.5 % MFU, 77.1 k tokens/s, 50.6 GB), within 1 % of round 32's H100; with `--timeline` the host took 207
#   ms to issue a micro-batch and the GPU spanned 209 ms, never running dry. The CUDA tests of MLA
#   (packed documents longer than `max_seq_len` now refused where MLA reads the boundaries), the
#   model, the MoE and the trainer passed (29), among them the counts under activation checkpointing
#   with compiled blocks. Later, on another H100, the step took 6.793 and 6.809 s (34.4 %) and the
#   PyTorch GDN path just after it 32.73 s (74.8 GB): **4.81× paired**, where round 32's H100 gave 5.58×.
# * **Round 32 (2026-12-05): no H200 was lent; on an H100 80GB HBM3, commit 116bc89, with the model's new
#   target checks (no change to the step's kernels since round 29).** The preset step took 6.843 s
#   and 6.824 s (34.3 % MFU, 76.6 k tokens/s, 50.6 GB), 1 % slower than round 31's H100; with
#   `--timeline`, the host took 208 ms to issue a micro-batch and the GPU spanned 210 ms, never running
#   dry. The PyTorch GDN path, timed just after it on the same machine, took 38.19 s (74.8 GB):
#   **5.58× paired**, against round 31's 4.54× on another H100 with the same step code. The ratio moves
#   with the machine's host far more than the Triton step does. The one-GPU tests that need CUDA passed
#   there (28, among them the packed-document attention through one varlen flash call against the
#   per-document loop, whose boundaries are now read by `check_cu_seqlens`). Later the same day, on
#   another H100, the code with the GDN prelude's new layout checks (a copy only for a `qkv` whose
#   rows lie past int32 offsets, never the mixer's) took 6.889, 6.941 and 6.950 s (33.8 %; a call
#   before it, 6.957 and 7.441 s, had one slow step), and the prelude's, the loss kernel's, MLA's and
#   the model's CUDA tests passed (12, the compiled prelude among them).
# * **Round 31 (2026-12-05): no H200 was lent; on an H100 80GB HBM3 (torch 2.11, Triton 3.6), the
#   code of commit a8f91a1 (no change to the step since round 29).** The preset step took 6.785 s and, in a second
#   call, 6.771 s (34.6 % MFU against the 989 TFLOP/s dense bf16 peak the H100 SXM shares with the
#   H200; 50.6 GB, as on the H200s); with `--timeline`, the host took 206 ms to issue a micro-batch
#   and the GPU spanned 208 ms, never running dry. The PyTorch GDN path took 30.74 s, just before the
#   second Triton step: **4.54× paired**, and its host again as slow as its GPU (956 against 957 ms a
#   micro-batch). Eager (no `torch.compile`), the preset step took 10.63 s and 66.8 GB: compiling
#   gives 1.57× its tokens per second at the preset's 32 micro-batches (the remark on `compile` in
#   `hymo_750m.yaml` quotes this). The one-GPU tests that need CUDA passed there (22 in the model,
#   generation, MLA, MTP, prelude, cross-entropy and trainer suites; generation's graph replay among
#   them), and `benchmarks/gdn_verify.py --quick` kept every relative error under 6.1e-3 (bf16) and
#   2.4e-3 (fp32) for the outputs and all six gradients.
# * **Round 30: no change to the step; 6.455 s (36.3 %, 81.2 k tokens/s, 50.6 GB) on the round's
#   one machine, with `--timeline`** (host 196 ms to issue a micro-batch, GPU span 198 ms, the GPU
#   never dry). The machine was lent for one call only, so the PyTorch GDN path was not timed. The
#   round's code changes (NorMuon's `load_state_dict`, configuration checks, empty sequences in the
#   GDN rules' PyTorch paths, data warnings) touch nothing the step runs.
# * **Round 29: no change to the step; 6.486 s (36.2 %, 80.8 k tokens/s, 50.6 GB) on the round's
#   one machine, with `--timeline`.** The round timed the PyTorch GDN path with `--timeline` twice
#   (35.71 and 32.46 s: host-bound, see the bullet above; 5.01× paired) and ran the GDN kernels'
#   parity at $T$ up to 4 096 under the mixer's initial and weak decays (below). Its code changes
#   were to generation and MLA's decoding, the trainer's stops and the MoE's configuration
#   (chapters 00, 21, 41, 70, 72; chapter 30's prose), none on the step's path.
# * **Round 28: 6.348 s (36.9 %, 82.6 k tokens/s, 50.6 GB), and 6.389 s (36.7 %) in a second call on
#   the round's first machine** (a second ran the all-MLA variant). Rounds 26 and 27 had no GPU.
#   The step's one change since round 25:
#   NorMuon leaves a matrix with no gradient this step (an expert that got no token) where it is
#   (chapter 50); its step took 88.1 ms of GPU time (85.3–86.0 ms in round 18, on another machine;
#   `optim_step.json`). Measured too: activation checkpointing and all-MLA at the preset's 32
#   micro-batches (above), the PyTorch GDN path (above: 2.56×) and the GDN kernels' parity under
#   three decay regimes (below). A profile of the PyTorch path on that machine did not finish
#   inside its time limit. The one-GPU tests of the layers, optimisers, MLA's flash path, the compiled
#   prelude, the CUDA cross-entropy, decoding and its CUDA graph, and the one-GPU trainer passed
#   there (64).
# * **Round 25: no change to the step; 6.353 s (36.9 %, 82.5 k tokens/s, 50.6 GB) on the round's
#   one machine for it.** The round made generation on a GPU replay each decoding step as a CUDA
#   graph (chapter 41; the section on generation below) and moved the MoE's sorted dispatch into a
#   method of its own, the same operations; the one-GPU trainer and model tests (96) passed there.
#   The PyTorch GDN path was not timed.
# * **Round 24: no change to the step; 6.473 s (36.2 %, 81.0 k tokens/s, 50.6 GB) on the machine
#   where the PyTorch GDN path took 28.87 s (4.46×), and 6.587 s (35.6 %) on the round's first
#   machine.** The round added generation with the decode state (chapter 41, and the section on
#   generation below) and checked it on the GPU against the whole-sequence forward; the one-GPU
#   trainer tests (51) passed there.
# * **Round 23: no change to the step; 6.405 and 6.400 s (36.6 %, 81.9 k tokens/s, 50.6 GB) in two
#   calls on the round's one machine, and the PyTorch GDN path 4.20× slower there (26.87 s).** The
#   round made the trainer's checkpoints and run folders safer on several ranks (chapter 70) and
#   checked on the GPU that the one-GPU trainer, model, MLA, MTP and cross-entropy tests pass there
#   (102 passed; one CPU-only refusal test now forces the CPU). This machine's PyTorch path was
#   faster than most (26.9 s against 29.3 s in round 16 and 34–35.5 s in rounds 15, 18 and 19), so the ratio fell below 5× with no
#   change to either path: the host sets that path's speed.
# * **Round 22: no change to the step; 6.477 s (36.2 %, 50.6 GB) on the round's one machine.** The
#   round masked the MTP targets per document and added the trainer's stop signals and run-folder
#   lock (chapters 40 and 70). With documents of about 1 024 tokens masked (8 micro-batches a
#   step), the step took 2.108 s (26.2 % MFU, attention counted per document), 24 % over the
#   unmasked 1.703 s measured next on the same machine; earlier rounds measured 1.93–2.16 s.
# * **Round 20: no change to the step; 6.500 s (36.1 %, 50.6 GB) on the round's one machine.** The
#   round fixed the trainer's resume and command line (chapters 70 and 71: damaged checkpoints,
#   `--no-resume` on a folder with checkpoints, refusals that used to end in tracebacks) and
#   checked on the GPU that the step is unchanged and that the one-GPU trainer tests pass there.
# * **Round 19: a fresh profile, three more ideas measured, none kept; the step 6.485 s (36.2 %)
#   with round 18's code and 6.498 and 6.559 s (36.1 and 35.7 %) with the round's change, on three
#   machines; the PyTorch GDN path 5.36× slower on the 6.559 s step's machine (35.14 s).** The
#   round's only change to the code refuses a `gdn_chunk_size` the Triton kernels cannot run
#   (below). The profile (above): a micro-batch spans 196.5 ms, 191.3 ms of it kernels and 5.1 ms
#   the launch latency between some 3 500 of them; the GPU waited on its host for 0.07 ms. Each
#   kind of kernel took within 3 % of its time in round 15's profile (another machine). Tried and
#   not kept (`experiments.json`):
#   - **chunks of 32 or 16 tokens in the GDN kernels** instead of 64 (the Triton chapter's new
#     callout). At 32 the solve is cheaper (0.096 against 0.150 ms a layer) and the forward's state
#     pass slower (0.223 against 0.195 ms); the backward is faster only with its local-gradient
#     kernel at 2 warps (0.630 against 0.647 ms). Summed from these separately timed parts, the
#     rule is then about 4 % faster (0.95 against 0.99 ms), some 1 ms of a micro-batch, for a
#     second solve to maintain; at 16 it is slower (1.44 against 0.98 ms, timed whole). The
#     kernels stay at 64, and they now refuse a `gdn_chunk_size` other than 64, which they used to
#     ignore;
#   - **the routed experts' $W_1$ and $W_3$ stacked into one grouped product** ($[E, 2h, d]$):
#     2.63 and 2.76 ms forward + backward (compiled: the three products and SwiGLU) against 2.59 and
#     2.62 ms;
#   - **the experts' weights in the layout the grouped product reads** (a contiguous $[E, d, h]$
#     instead of a transposed view of the stored $[E, h, d]$): one product 0.249 against 0.252 ms,
#     about 540 TFLOP/s either way. In the step the grouped products take 17.2 ms of a micro-batch
#     at about 570 TFLOP/s, where the dense products of the FFNs, of similar widths, run at about
#     730–760 (round 16's autotuning tables, which timed each product alone, had the grouped ones
#     at about 630); neither stacking nor layout moves that gap of some 4 ms, which is the grouped
#     kernel's own.
# * **Round 18: NorMuon 15 % faster (100–101 → 85–86 ms), the step unchanged within the machine's
#   noise; the PyTorch GDN path 5.29× slower.** A profile of NorMuon alone (three steps on random
#   gradients) put about 40 ms per step in Newton–Schulz's largest products (its top 30 kernels)
#   and about 58 ms in elementwise kernels, copies and list-wide launches. Other layouts of the
#   three products gained at most 0.6 % on the expert stacks (the five iterations run at 410–495
#   TFLOP/s in every layout; `experiments.json`). The final update of a parameter, seven passes
#   over its weights as list-wide launches, is now one
#   compiled kernel for the 24 expert stacks (chapter 50): NorMuon alone 85.95 and 85.29 ms against
#   101.17 and 99.91 ms with `fused=False`, alternating in two processes, with the same fp32 weights
#   bit for bit. Compiling every parameter was slower (93 ms), the host's 70 µs a call outrunning the
#   small matrices' kernels. In the preset step (`--timeline`, one machine, processes alternating)
#   the time from the last micro-batch's end to the step's end fell from 111–114 ms (6 steps) to
#   96–101 ms (12 steps), but the steps took 6.434–6.451 s against 6.410 and 6.447 s for round 17's
#   code: the micro-batches' GPU spans differ by up to 1 ms between processes (32 ms a step), more
#   than the 13 ms saved. On the round's first machine round 17's code took 6.498 s (36.1 %) and
#   the PyTorch GDN path 34.38 s, 5.29×.
# * **Round 17: the step is bound by the GPU, not by its host; four changes measured, none kept.**
#   The new `--timeline` (above) timed 27 steps on two machines (six of them by its prototype): a
#   micro-batch spans about 195–200 ms of GPU time, the host takes 2 ms less than that to issue it,
#   and at only 1 of 837 boundaries between micro-batches had the GPU finished the previous
#   micro-batch when the host began the next. The host is held back by the GPU (its queue of
#   launches is full). So at the boundaries, where the profiles show the GPU's longest waits, an
#   unprofiled GPU does not wait: even `--profile cuda` records every launch, and slows the host
#   enough to matter there. Inside a micro-batch the check sees nothing, but round 10's CUDA graph
#   of whole micro-batches, which removes every wait on the host, gained nothing either. Besides
#   the 32 micro-batches, a step spends about 5 ms before the first (the bf16 copies' refresh) and
#   111–117 ms from the end of the last to the step's end (clipping, the host's reads of the loss
#   and the gradient norm, NorMuon, AdamW, the MoE bias). The step itself: 6.412 s on the round's
#   second machine and 6.479–6.516 s on a slower third. Tried and not kept (`experiments.json`,
#   chapter 14):
#   - **skipping dynamo's guards** (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), where
#     round 15's profile had found the host in the longest gaps: 6.384 s against 6.372 s
#     (medians of three, alternating in one process). With the host ahead, its time is not the step's;
#   - **more heads per program in the prelude's kernels** (now a `LAUNCH` option, `G`): the default
#     4 is the fastest of 2 to 16, and the step with the sweep's best tiles took 6.401 s against
#     6.412 s, 0.2 % faster, less than a machine drifts between processes;
#   - **inductor's combo kernels** (independent small kernels launched as one): 0.1–0.6 % faster in
#     three pairs of processes on one machine, while that machine drifted 0.5 % between pairs, and
#     always in the favourable slot (after a slow first process, then first in each pair as the
#     machine slowed); paired the other way, 0.3 % slower. **Aggressive fusion**: 0.3 % faster,
#     once. Neither can be told from drift, so the defaults stay.
# * **Round 16: the preset step 6.343 s (37.0 % MFU, 82.7 k tokens/s, 50.6 GB) on the round's third
#   machine, with round 14's code unchanged, and 6.414 and 6.524 s (36.6 and 35.9 %) on its other two;
#   the PyTorch GDN path 4.3–4.6× slower on the third (the comparison above).** 6.343 s is the fastest step measured
#   so far; the round's three machines, running the same code, span 2.9 %. Tried and not measured
#   (`experiments.json`): inductor's **max-autotune** mode (its Triton matrix-multiply templates
#   benchmarked against cuBLAS for every shape, and coordinate-descent tuning of its own kernels) had
#   not finished compiling after 486 s, and coordinate-descent tuning alone not after 330 s, against
#   about a minute for the usual compile. The tables max-autotune printed before the timeout answer
#   what it was run for: at every large product of the step (the projections, the FFNs, the shared
#   expert) cuBLAS is the fastest kernel, Triton's best 4–19 % slower; the routed experts' grouped
#   products tie within 1 % in the forward (Triton's 1–10 % faster in the backward); Triton wins only
#   the small products (16 to 224 columns, or an inner width of 128 or 224; 17–55 µs each), about
#   0.5 ms per micro-batch in all among the products reached before the timeout. So
#   the matrix multiplies, half the step, already run in the fastest kernels available at these
#   shapes (the forward's largest at 680–706 TFLOP/s, the experts' grouped products at about 630), as
#   round 15 found for attention.
# * **Round 15: the preset step 6.365 s (36.8 % MFU, 82.4 k tokens/s, 50.6 GB) and 6.489 s (36.1 %)
#   on the round's two machines, with round 14's code unchanged; the PyTorch GDN path 5.3–5.5× slower
#   on the second (the comparison above).** 6.365 s was the fastest step measured until round 16's, and it ran the code that
#   took 6.505 and 6.543 s on round 14's machines: the 2–3 % between machines is larger than any
#   change of rounds 12–14. The round's fresh profile (above; the previous one was round 11's)
#   confirms kernel 1's two rewrites inside the model: 0.150 ms per layer, against 0.249 ms in round
#   6's profile (`train_step_profile.txt`). Tried and not kept (`experiments.json`): **every fused attention kernel PyTorch
#   offers, at MLA's shape** (4 × 4096 tokens, 16 query heads over 4 key groups, width 128, bf16,
#   causal). cuDNN, which SDPA already picks, is the fastest: 0.49–0.51 ms forward and 2.04–2.08 ms
#   forward + backward (463–472 TFLOP/s), against 2.95 ms for FlexAttention (compiled), 3.56–3.57 ms
#   for the flash kernels (FA2) and 7.7 ms for the memory-efficient kernel (timed with the keys and
#   values repeated); repeating them for cuDNN instead of `enable_gqa` costs 12–13 % forward +
#   backward. Their outputs and gradients agree with cuDNN's within 0.6 % of each tensor's largest
#   value. Where the GPU still waits (8.1 ms per micro-batch in gaps of 10 µs or more, round 15's
#   profile): a `--profile micro` of the same code on a later machine (`train_step_profile_micro.txt`)
#   names what the host ran in the longest gaps. Besides the benchmark's making of a synthetic batch
#   and the embedding at the start of a micro-batch, they are the host entering compiled code: a
#   block, where dynamo's cache lookup (checking its guards) took about 190 µs and the compiled
#   function's wrapper 170–240 µs; and, after a backward, the compiled `add_into` over the copies'
#   gradients, whose cache lookup alone took 690 µs and the whole call 1.5 ms, while the GPU waited
#   2.8 ms (all with the host slowed by the profiler). Fewer or cheaper entries into compiled code is
#   where that time is; nothing was changed this round.
# * **Round 14: the preset step 6.543 s and 6.505 s (35.8 % and 36.0 % MFU, 50.6 GB) on the
#   round's two machines, with round 13's final code (kernel 1 carrying $D^\top$); nothing faster
#   was found.** Round 13 had timed round 12's kernels at 6.431 s on a third machine: the 0.3 %
#   expected from kernel 1 is far below the 1–2 % between machines. The whole rule's GPU parity
#   on this code (`gdn_verify.py --quick`, `gdn_verify_quick_h200_round14.json`): bf16 within
#   3.7e-3 and fp32 within 1.8e-3 of the fp32 loop, deterministic, a packed row included, and
#   `keep_prep` equal to recomputing. Tried and not kept (`experiments.json`):
#   - the local-gradient kernel with its registers capped (Triton's `maxnreg`), for three or four
#     blocks per SM instead of two: 0.49 ms at 168 registers, 0.57 at 200, 0.85 at 128, against
#     0.458 ms; the spills cost more than the occupancy gained;
#   - the prelude's forward and $\bar u$ kernels over q, k and v in one launch each instead of one
#     per segment: 0.154 ms (no faster than the three forward kernels' GPU time in the model) and
#     0.223 against 0.215 ms; the preset step 6.522 s against 6.505 s, one process each on one
#     machine;
#   - $\bar x$ and $\bar w$ in one kernel, reading $\bar u$ once: 0.337 ms at best against
#     0.251 ms for the two kernels.
#
#   The PyTorch GDN path was not timed again; the device time ran out first. So the ratio
#   stays round 13's 3.6×.
# * **Round 13: the preset step 6.431 s (36.5 % MFU, 81.5 k tokens/s, 50.6 GB) with round 12's
#   kernels on the round's machine; the PyTorch GDN path 23.25 s on the same machine, 3.6×, short
#   of the 5× target.** Round 11 had measured the PyTorch path at 32.23 s (4.98×). That path's
#   step is timed once, after one warm-up step, because it takes half a minute; from round 5 to
#   round 11 those times ranged from 24.8 to 32.2 s, and this round's is 23.3 s. So the ratio is
#   not pinned down, and this round's measurement says 3.6×. Landed after the run, so not
#   in the step's row: kernel 1 now carries $D^\top$ through the diagonal blocks' substitution, which
#   removes the layout conversions from its steps: 0.178 → 0.151 ms per layer (the new body timed
#   as a copy in `gdn_prep_solve.py`'s harness, beside the old kernel), with $A$'s errors
#   against float64 unchanged in every case (`gdn_prep_solve.json`, all variants from one run). At
#   24 layers and 32 micro-batches that is about 21 ms per step, below what a step's timing can
#   resolve. Tried and not kept (`experiments.json`; chapter 14): the prelude's backward as one
#   kernel per segment instead of three launches, in two designs. Both were correct and slower:
#   0.70 and 1.02 ms against the three kernels' 0.47 ms. The step timings of those A/Bs, in pairs
#   of processes, most likely ran the same compiled code twice: inductor's on-disk caches key on
#   the graph around the prelude's operators, not on the tiles they read. `train_step.py` now
#   gives each `--conv-launch` its own cache directory.
# * **Round 12: the GDN rule's kernel 1 (the gates and the UT matrix $A$) 0.241 → 0.177 ms per
#   layer; the preset step measured 6.493 s (36.1 % MFU, 80.8 k tokens/s, 50.6 GB) on the round's
#   machine.** Kernel 1 now builds every $16\times16$ block of $L$ as its own tile from its own
#   loads, solves the diagonal blocks by substitution with one warp (its sums are shuffles inside
#   the warp) and the blocks below by block substitution in sixteen $16\times16$ products
#   (chapter 13; `gdn_prep_solve.json` compares seven other ways). $A$'s errors are those of the
#   previous kernel, and the whole rule's GPU parity is too (`gdn_verify.py --quick` on this code,
#   `gdn_verify_quick_h200_round12.json`: bf16 within 3.6e-3, fp32 within 1.7e-3 of the fp32 loop,
#   deterministic, a packed row included; round 9's run gave 3.65e-3 and 1.75e-3). At 24 layers and 32 micro-batches
#   that is about 49 ms per step (0.8 %) expected. The step took 6.485–6.499 s. Round 11's final
#   code took 6.473 s on its last machine and 6.59–6.61 s on another: the gain is smaller than
#   the spread between machines, and round 11's code was not re-timed on this one (the device
#   time ran out). The PyTorch GDN path's step, for the 5× comparison, did not finish inside its
#   160 s limit (compilation and two steps of about 32 s), so that ratio stays round 11's 4.98×.
#   Tried again and not kept (`experiments.json`): Python's garbage collector paused for a step's
#   micro-batches (6.61–6.62 s against 6.60–6.63 s, as round 9 found); and a faster add of the
#   copies' gradients, which runs at 4.2 TB/s already (2.83 ms for the 11.8 GB it moves; a single
#   Triton launch over a table of pointers took 2.98 ms).
# * **Round 11: MFU 36.2 % at the preset's step (6.473 s, 81.0 k tokens/s, 50.6 GB), and FSDP
#   on one GPU nearly as fast as autocast (6.649 s, 35.3 %; it took 7.50 s at the round's start),
#   both on the round's last machine.** The target is still 40 %. The round's first machine ran
#   the same code (as a prototype of its last change) in 6.59–6.61 s, 35.6 %: machines differ by
#   about 2 %. Three changes, each timed against the code before it on one machine:
#   - **The residual stream is bf16 under autocast** (chapter 41), as it already was under FSDP's
#     mixed precision. Autocast had kept it in fp32 (fp32 embedding plus bf16 branches), so every
#     norm and residual addition moved twice the bytes. 6.74–6.78 s → 6.64–6.66 s (three
#     alternating pairs in one process); inductor's kernels 23.5 → 20.3 ms per micro-batch in the
#     same process's profiles (`ab_profile_ms_per_micro_batch` in those rows); peak
#     53.8 → 50.6 GB. A bf16 stream is what FSDP's mixed precision (and Megatron-LM by default)
#     trains with; the multi-GPU path already ran it.
#   - **The copies' gradients are added by a compiled `_foreach_add_`** (`add_into`, chapter 70).
#     For fp32 += bf16, eager PyTorch has no fused path and launched one unvectorised kernel per
#     matrix, about 330 per micro-batch (6.9 ms); compiled, 5.4 ms (in profiles not kept). 6.655–6.680 s → 6.594–6.612 s
#     (three alternating pairs), gradients identical.
#   - **FSDP: NorMuon's step took 907 ms on one GPU**, all of it host time: it updated the
#     332 sharded matrices one at a time, every elementwise step a DTensor operation (each costs
#     the host tens of µs to dispatch), with one all-gather per matrix. It now stacks same-shaped
#     shards as it stacks plain matrices, gathers each stack once and works on the local tensors
#     (chapter 50): 114 ms, and the FSDP step 7.50 → 6.70 s. With several GPUs it also issues one
#     all-gather per shape group instead of per matrix: 28 instead of 664 per step (332 matrices
#     in 14 shapes, each gathered twice: update and row statistics; not measured, only one GPU was
#     lent). From their step times (6.702 s through FSDP, 6.665 s without) the two paths now differ by about 1.2 ms per micro-batch; their
#     3-micro-batch profiles differ more (36.5 against 10.5 ms idle), since FSDP's once-per-step
#     gathers weigh a third there.
#   The round's profile (above, before `add_into`): 206.9 ms per micro-batch, 196.4 ms of kernels
#   and 10.5 ms idle.
# * **Round 10: MFU 34.9 % at the preset's step on this round's machine (6.716 s, 78.1 k tokens/s,
#   53.8 GB), with the matrices cast once per step instead of at every use; the target is 40 %.**
#   The same trainer with autocast's casts took 6.792 s (34.5 %), alternating in one process;
#   round 8's machines ran the step before this change in 6.675–6.692 s (35.0–35.1 %): machines
#   differ by 1–2 %, so rows from different machines compare only roughly. Details in the round-10
#   bullets below.
# * **MFU: 35.0–35.1 % at the preset's step in round 8 (32 micro-batches per optimiser step,
#   6.675–6.692 s, about 78.5 k tokens/s).** Timed in turn on one machine with the same
#   script, round 7's final code (731eef1) took 6.676 and 6.680 s: round 8's kernel
#   change (below; about 0.3 % expected) is below what two pairs of runs resolve. Round 8's
#   machines were faster than round 7's: round 7 measured 6.84–6.88 s, before its
#   output-gate change (an estimated 0.7 %), and its final code measured 6.68–6.73 s in round 8, so about
#   1–2 % of the difference between rounds is the machine. Earlier rounds: 6.84–6.88 s (34.1–34.3 %,
#   rounds 7 and 6), 6.93 s (33.8 %), 7.57 s (31.0 %), 8.37 s
#   (28.0 %), 8.74 s (26.8 %). `torch.compile` was worth 1.8× at the preset's step (15.9 s eager,
#   in round 2).
# * **Round 10: the matrices cast to bf16 once per optimiser step on one GPU** (`BF16Matrices`,
#   chapter 70). Under autocast, every micro-batch cast each weight to bf16 at every use, cast each
#   weight gradient back to fp32 and added it to `.grad` (about 380 additions): some 8 ms of
#   kernels per micro-batch in round 8's profile. The trainer now makes bf16 copies of the 1.18 B
#   matrix entries once per step, runs forward and backward on them and adds their gradients to
#   the fp32 masters in one `_foreach_add_`. The arithmetic is autocast's: on the CPU every
#   gradient is equal bit for bit (chapter 70's check). On the GPU, after two micro-batches, the
#   gradients of the copies' path and autocast's differed by 1.5 % (global relative norm), and two
#   autocast runs of the same micro-batches by 0.6 %, since some kernels add with atomics; the
#   losses were equal. The extra difference is not explained (other GEMM kernels for bf16 weights
#   is a guess, not checked). A CUDA-only test trains three steps both ways and compares losses,
#   gradient norms and weights. (A review then found that the landed trainer ran the backward
#   inside autocast, which changes the backward's dtypes; it now runs outside, as before. The
#   timing and the test below ran that version; the prototype ran the backward outside.) Step: 6.716 s against 6.792 s
#   (1.1 %), peak 53.8 GB (the copies are 2.4 GB, computed); a prototype on another machine gave 6.57–6.61
#   against 6.67 s.
# * **Round 10: one CUDA graph per micro-batch works, and gains nothing once the casts are
#   gone.** Round 5's `reduce-overhead` mode failed (replays overwrote outputs the backward still
#   needed). Capturing a whole micro-batch, forward and backward, with `torch.cuda.graph` around
#   the compiled blocks works: the unpacked path reads nothing from the GPU, and the gradients are
#   accumulated in place, so no gradient moved during capture. It took the step from 6.81–6.82 to
#   6.72–6.73 s (1.3 %) with autocast's casts; with the bf16 copies it measured 6.58–6.59 s
#   against 6.57–6.61 s without it. So the 6 ms per micro-batch of gaps between kernels
#   (about 4 100 launches) cost little once the 380 gradient additions went. Not kept.
# * **Round 10: FSDP reduced the gradients after every micro-batch.** Measured through FSDP on a
#   group of one GPU (`--fsdp`, the path each GPU of a torchrun launch takes): 9.09 s per preset
#   step when every micro-batch's backward reduce-scattered all gradients, 7.85 s (29.8 %) now
#   that they accumulate locally, in fp32, and are reduced after the last micro-batch (chapter 70;
#   one process, one after the other). Keeping each block's gathered weights for the whole step
#   then measured 7.88 s (another machine; 51.1 GB against 48.7 GB): with one GPU an all-gather is
#   a local copy. Both changes cut traffic between GPUs, which matters in a multi-GPU run, but
#   none was lent this round. The FSDP path was 17 % slower than the autocast path on one GPU
#   (round 11 found why: NorMuon's step on sharded matrices, above). The same run found a bug: **with torch 2.11 the
#   first FSDP optimiser step failed**, since 2.11's DTensor has no rule for `_foreach_sign_`,
#   which the cautious weight decay used. Torch 2.13's CPU tests had passed. Fixed in chapter 50
#   (the mask is computed on the local shards), checked under torch 2.11 on CPU (the FSDP
#   optimiser test and the trainer's two-process test) and, on the H200, by the FSDP runs above.
# * **Round 10, not kept:** the prelude's backward with its $\bar u$ in bf16 instead of fp32: 0.412
#   against 0.455 ms per layer (about 1 ms per micro-batch, 0.5 %), for a 1.4× larger $\bar x$
#   error and $\bar w$ error from 1e-7 to 1.6e-3 (`experiments.json`).
# * **Round 9: packed documents train at 29 % MFU instead of 3.2 %.** The first H200 timing of
#   `--doc-masking 1024` (documents of about 1 024 tokens, some 17 per packed row of 16 384) took
#   17.2 s per step of 8 micro-batches, against 1.74 s for the same step without documents. MLA ran
#   causal SDPA once per document, SDPA chose cuDNN, and cuDNN builds an execution plan for every
#   sequence length it has not seen: one packed row's attention, forward and backward, took 1.6–4.2 s
#   with new document lengths and 6 ms with lengths seen before (`experiments.json`). MLA now calls
#   the flash kernel's variable-length form once per row (chapter 21): 2.5–2.8 ms for that row, its
#   outputs and gradients within 4e-3 of the loop's (relative to their largest value), and the step
#   took 2.16 s. The profile of that step still showed the GPU idle 118 of 320 ms per micro-batch:
#   every read of a GPU value (the checks of the document boundaries, the GDN kernels' chunk
#   tables) makes the host wait for the GPU, and there were some 200 per micro-batch. The checks
#   now read the GPU once instead of three times (chapters 12 and 20), and the chunk tables once
#   instead of twice (chapter 13): 1.93 s per step, 28.7 % MFU (30.4 % as first recorded, before
#   attention was counted within documents), 51.5 GB, the GPU idle 31 of 234 ms
#   per micro-batch, 11 % over the plain step. The chunk tables now need no read at all (the
#   kernels take a bound on the chunk count that the shapes give). That final code measured 2.06 s
#   on another machine, whose host was slower in the longest gaps (kernel launches overlapping
#   them by 23–56 µs against 9 µs), with no device time left to time both versions on one machine:
#   its effect is not measured. What still reads the GPU, per micro-batch: the GDN boundary check
#   in each of 24 layers, and MLA's position check and longest document in each of 8.
# * **Round 9: the PyTorch GDN path re-timed on the machine of the Triton path's steps.** 29.4 s
#   per preset step (one timed step after one warm-up step), against 6.71–6.74 s for the Triton
#   path: 4.4×. See the comparison above.
# * **Round 9: the garbage collector is not what the GPU waits on.** During a preset step Python
#   ran 59–60 young-generation and 5–6 middle-generation collections, 11 ms in all, the longest
#   0.57 ms. With the collector frozen and off the steps took 6.741, 6.748 and 6.731 s, against
#   6.714, 6.737 and 6.731 s with it on, alternating in one process (`experiments.json`). Not
#   adopted. A profile with the host's operators recorded (one micro-batch per step) showed the GPU
#   idle 6.9 ms per micro-batch, 6.3 ms of it in gaps under 10 µs: on this machine the host kept
#   ahead, and round 8's gaps of 500–640 µs between blocks did not come back (the longest, 453 µs, came
#   at the start of a micro-batch). Of the some 4 100 kernels
#   of a micro-batch, about 700 are memsets (about 310 launched by cuBLAS with matrix products, 130
#   by the MoE's sort, 70 by reductions) and 380 are AccumulateGrad's fp32 additions of weight
#   gradients: fewer launches is where the rest of the launch latency is.
# * **Round 9, too: a regression fixed.** `gdn_verify.py` at $K = V = 128$ in fp32 found that round
#   8's local-gradient kernel asked the H200 for 256 KiB of shared memory per block (227 KiB is
#   the limit) and did not launch. fp32 inputs with heads wider than 64 now take the kernel's
#   earlier order (192 KiB); HyMo's bf16 kernel is the same PTX as before (chapter 13).
# * **Round 8: the GDN local-gradient kernel spills less** (chapter 13).
#   `benchmarks/gdn_registers.py` (new) compiles the GDN kernels for the H200 on any machine and
#   reads `ptxas -v`, the kernels specialised as a launch at HyMo's shape specialises them: the
#   local-gradient kernel used all 255 registers a thread has and spilled 264 bytes per thread
#   to local memory (Triton 3.6; 460 under 3.9; `benchmarks/results/gdn_registers.json`).
#   Recomputing $\Gamma$ and $P$ where they are used, instead of holding them and $KK^\top\odot\Gamma$
#   across the value loop, left 148 bytes, and the kernel went from 0.489 to 0.459 ms per layer
#   (bit-identical gradients), about 0.7 ms per micro-batch. Round 8's profile (its code then
#   had a variant of this change and kernel 1's doubling solve, below; it also has round 7's
#   output-gate change, which round 7's profile predates) shows inductor's kernels at
#   26.3 ms against 29.7 ms and the GDN rule's at 27.7 against 28.7 ms per micro-batch, but the GPU
#   idle 10.5 ms against 6.1 ms, 2.2 ms of it in gaps of 100 µs or more. The two profiles come
#   from different machines, so this only suggests that the kernels' gain went into waiting for
#   the host; the step did not move measurably. Launching fewer kernels, or launching them from
#   CUDA graphs, is what can turn kernel time into step time then.
# * **Round 8, too: `doc_masking=true` trains again.** The trainer packs a micro-batch of $B$
#   windows into one row of $BT$ tokens with document boundaries, and the model refused any row
#   longer than `max_seq_len`, so the first step failed on every preset (`python -m hymo.train
#   doc_masking=true` included). Positions restart at every document, so the model now checks the
#   documents, not the row (chapter 41; a trainer test packs 512 tokens past a `max_seq_len` of 256).
#   A first document-masked run on the H200 then showed `torch.compile` compiling MLA's
#   per-document attention loop again for every new number of documents in a row, until it hit
#   its limit of eight. That loop and the packed positions now run outside the compiled graphs
#   (chapters 20 and 21; a test counts the graphs compiled on CPU). The document-masked step was
#   not timed in round 8 (the device time ran out); round 9 timed it, above.
# * **Tried in round 8 and not kept** (H200, `benchmarks/results/experiments.json`):
#   - kernel 1's solve with no serial steps, by doubling on $4\times4$ blocks and merging: ten
#     tensor-core products, 0.253 ms against 0.240 ms for the row-by-row solve of the
#     $16\times16$ blocks (chapter 13 says why the doubling must start from blocks that small);
#   - the sequential passes without their register prefetch of the next chunk: 0.216 against
#     0.195 ms (state pass) and 0.205 against 0.194 ms ($dS$ pass). (This was tried on spill counts
#     taken without the launch's specialisation, which overstated them; as launched, these passes
#     spill 16 bytes or none.);
#   - other orders of the local-gradient kernel's tail: 0.463 and 0.522 ms;
#   - the prelude's backward keeping its $du$ in bf16: inconclusive, the standalone timing was
#     bound by the host's launches.
# * **Round 7: the GPU hardly waited on its host any more.** A profile that records host
#   operators slows the host, and hosts differ between machines, so the waits of round 6 (12 ms per
#   micro-batch on one machine, under 1 ms on another, in a profile not kept) could not tell how much was real. Recording
#   only the GPU's activity (`--profile cuda`) showed that the GPU, running round 6's code, waited 4.9 ms per
#   micro-batch in gaps of 10 µs or more, most of them just before the first kernel of a GDN block
#   in the forward (`benchmarks/results/host_waits.json`). There the host was only just ahead of
#   the GPU. A Triton launch from Python cost the host 20.5 µs on one machine and 31.9 µs on
#   another (`benchmarks/host_launch.py`; an eager `torch.add` costs 8–9 µs), and the prelude's
#   forward operator made three of them. The prelude's operators are now `torch.library.triton_op`s, whose
#   kernels inductor launches from its generated code (chapter 14). The waits of 10 µs or more fell
#   to 1.0 ms (same machine, one run after the other), and to 0.5 ms (another machine) once the
#   benchmark's synthetic batches were made contiguous like the real loader's: a strided slice had
#   been copied through pageable memory, which made the host wait for the GPU at every
#   micro-batch. What is left of them is mostly one wait of about 0.6 ms at the start of each
#   micro-batch. The rest of the idle time, about 5.6 ms, is the launch latency between some 3 960
#   back-to-back kernels, which only fewer kernels or CUDA graphs can remove. On the machine of round 7's
#   paired timings (6.839/6.872 s against 6.869/6.884 s for the code before), whose host
#   launches a Triton kernel in 20.5 µs, the gain was small; a slower host should gain more (not
#   measured).
# * **Round 7, too: the output gate's projection apart from $a$ and $b$** (chapter 12). The
#   compiled backward had built the gradient of the stacked $[g, a, b]$ projection in one kernel that
#   mixed three elementwise formulas with a concatenation: about 140 µs per layer
#   (`train_step_profile.txt`), about four times what it moves. With $g$ in its own product, a
#   compiled GDN block (forward and backward) went from 4.51 to 4.45 ms, in two alternating pairs
#   in one process (`benchmarks/results/block_step.json`).
#   Over 24 GDN blocks that is about 1.5 ms per micro-batch, some 50 ms (0.7 %) per preset step;
#   the preset step was not re-timed with this change in that round; round 8's rows of
#   round 7's code include it.
# * **Tried in round 7 and not kept** (measured on the H200):
#   - $W_1$ and $W_3$ of every SwiGLU as one stacked product: compiled, inductor's kernels around it
#     took 2.3 ms more per micro-batch, and the step 6.94 s against 6.91 s
#     (`benchmarks/results/experiments.json`). Reverted;
#   - inductor's coordinate-descent tuning of its own kernels (`TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1`):
#     those kernels took 28.6 ms per micro-batch against 29.7 ms in round 7's profile (its row in the table), measured on
#     another machine (`experiments.json`), at the cost of about two minutes more compilation per
#     run. Not adopted.
# * **Gains in round 6:** the optimiser step (chapter 50; `benchmarks/optim_step.py`): NorMuon
#   124.6 → 101.1 ms of GPU time and AdamW 22.9 → 4.4 ms, through list-wide `_foreach` launches
#   and a row normalisation that reads the update once; the GDN forward keeping every chunk's state
#   for the backward (chapter 13, `keep_prep`): GDN rule kernels per micro-batch 30.0 → 28.4 ms.
#   Tried then and not kept: a scratch buffer for the diagonal blocks of the solve for $A$ (kernel
#   1: 0.24 → 0.41 ms, not kept in `experiments.json`), $KK^\top$ formed after the value loop of the local-gradient kernel (within
#   noise), pipelining stages 1–3 (within 1 %).
# :::

# %% [markdown]
# ## Generation on the H200
#
# `benchmarks/generate_speed.py`: the 750M model at its initial weights, batch 1, greedy, a random
# prompt and 256 new tokens, drawn three ways: with the decode state and each one-token step
# replayed as a CUDA graph (`HyMo.generate`'s default on a GPU: the GDN blocks carry their state,
# the MLA blocks their latent cache, chapter 41), with the state but eager steps (`graph=False`),
# and by re-running the whole context for every token (`cache=False`). Each rate is of the whole
# `generate` call, the prompt's prefill and the graph's capture included, as a user waits for it.
# Round 25, torch 2.11, Triton 3.6:

# %%
gens = json.loads((RESULTS / "generate_speed.json").read_text())
print("precision                    prompt  state+graph  state, eager  forward per token  (tokens/s)")
for g in gens:
    print(f"{g['precision']:28s} {g['prompt_tokens']:6d}  {g['with_state']['tokens_per_s']:11.1f}  "
          f"{g['with_state_eager']['tokens_per_s']:12.1f}  {g['forward_per_token']['tokens_per_s']:17.1f}")
fp32 = {g["prompt_tokens"]: g for g in gens if g["precision"] == "fp32"}
assert all(g["graph_speedup"] > 5 for g in gens) and fp32[3840]["speedup"] > 20  # the reading below

# %% [markdown]
# Eager, a decoding step is bound by the host: it launches a few thousand small kernels (about
# 100 per block: projections, norms, gates, the convolution's window, the routing), each a few
# microseconds of GPU work, and the GPU waits between them; that gave 15–18 tokens/s, whatever the
# context. Replayed as one CUDA graph (`DecodeGraph`, chapter 41), the same step gives 119–147
# tokens/s, 7.6–9.7× faster, and a token still costs the same at a context of 512 or 3 840.
# Re-running the context costs more the longer it is (12.3 → 5.3 tokens/s in fp32), so the state
# with the graph is 11× faster at 512 tokens and 27× at 3 840. In round 24, before the graph and
# before a single token's experts were gathered instead of sorted (chapter 30), the state gave about
# 16 tokens/s, no faster than re-running a 512-token context. All four rows are from one machine;
# an earlier machine of the round, with a faster host, gave 152–153 tokens/s with the graph and
# 18–26 eager (an earlier version of the graph, which read autocast's cached weight copies; rows not kept). bf16
# autocast is slower than fp32 here: at batch 1 the step is still a few thousand kernels, the graph
# records the weights' casts among them, and the saving in bytes is small. 147 tokens/s is 6.8 ms
# a token, against the 0.45 ms that reading the 0.54 B active weights once in fp32 at the H200's
# 4.8 TB/s would take (chapter 41's bound, there for bf16 weights on an H100's 3.35 TB/s: 0.32 ms): the kernels are still many and small,
# and fusing them (`torch.compile` on the decoding step) is the next step, which this code does
# not take. The tokens the state and the re-run draw part early: at initial weights the logits are
# nearly equal, so rounding decides; the parity checks are `tests/test_model.py`'s, on unit-scale
# weights (the decoding step against the whole-sequence forward, and the graph against the eager
# step), which on the GPU passed in fp32 and bf16.

# %% [markdown]
# ## What a checkpoint costs
#
# `benchmarks/ckpt_save.py` times the trainer's own `save` and `load` (chapter 70) for the 750M
# preset in one process, after one step so that every optimiser moment exists, and times the
# CRC-32 sums inside each: the save reads back the files it wrote, the resume checks them before it
# reads. It ran on an H100 machine, writing to its local disk:

# %%
for c in json.loads((RESULTS / "ckpt_save.json").read_text()):
    print(f"{c['config']} on {c['device']} (torch {c['torch']}, {c['date']}): {c['files']} files, "
          f"{c['checkpoint_bytes'] / 1e9:.2f} GB")
    print("  save: " + ", ".join(f"{s:.1f} s" for s in c["save_s"]) + "; of which the sums "
          + ", ".join(f"{x:.1f} s" for x in c["save_crc_s"]))
    print(f"  load: {c['load_s']:.1f} s; of which the check {c['load_crc_s']:.1f} s, "
          f"{c['load_checked_bytes'] / 1e9:.2f} GB read")
    assert c["load_checked_bytes"] > 0.99 * c["checkpoint_bytes"]  # every file but meta.json was checked
    assert max(x / s for s, x in zip(c["save_s"], c["save_crc_s"])) < 0.3  # the reading below

# %% [markdown]
# The 10.1 GB are the fp32 weights and the optimisers' moments. A save takes 17 to 22 s, a
# fifth of it the sums; a resume 10 s, 4 s of it the check. The preset saves every 1000 steps,
# about 1.9 hours of 6.7 s steps, so a save costs about 0.3 % of the run. With more ranks each
# writes and sums only its own shard. A network file system writes slower than this local
# disk, and a resume after a reboot reads the files from the disk rather than the page cache.

# %% [markdown]
# ## GDN kernel parity on the H200
#
# Relative RMSE $\lVert \text{ref} - \text{out} \rVert_2 / \lVert \text{ref} \rVert_2$ of the
# Triton kernel against the fp32 naive recurrence, for outputs, final state and all six gradients.
# Targets: outputs and state ≤ 0.005, gradients ≤ 0.01.

# %%
names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]

def parity_runs(name):
    "A `gdn_verify.py` file, refused if a run was not finite or not deterministic (`max` below would pass over a NaN)."
    d = json.loads((RESULTS / name).read_text())
    bad = [r for r in d["rows"] if r.get("finite") is False or r.get("deterministic") is False
           or not all(math.isfinite(r[n]) for n in names if n in r)]
    assert not bad, bad
    return d

ver = parity_runs("gdn_verify_h200.json")
print(ver["meta"])
print(f"{'kind':16s}{'dtype':9s}{'T':>5s}{'K':>5s}  " + " ".join(f"{n:>7s}" for n in names))
for r in ver["rows"]:
    print(f"{r['kind']:16s}{r['dtype']:9s}{r['T']:5d}{r['K']:5d}  " + " ".join(f"{r[n]:7.1e}" if n in r else "      -" for n in names))
worst_o = max(max(r["o"], r["ht"]) for r in ver["rows"])
worst_g = max(r[n] for r in ver["rows"] for n in names[2:] if n in r)
print(f"worst output/state {worst_o:.1e} (target 5e-3), worst gradient {worst_g:.1e} (target 1e-2)")
assert worst_o <= 5e-3 and worst_g <= 1e-2

# %% [markdown]
# The table above is the full run of an earlier round. Since then the backward reuses the
# forward's $A$ and cumulative gates (in round 5) and its chunk states (in round 6; chapter
# 13); round 8 changed the local-gradient kernel, and round 9 gave it back its earlier order for
# fp32 heads wider than 64 and made the packed path's chunk tables from a bound instead of the
# count read from the GPU (chapter 13). `gdn_verify.py --quick` re-checked round 9's final code on
# the H200 (`benchmarks/results/gdn_verify_quick_h200.json`): the chunk kernel at $T$ = 63 and 256
# for heads of 32 and of 128, and a packed row of five documents (two spare chunk slots), bf16
# and fp32: worst output or state 3.3e-3 and worst gradient 3.65e-3 in bf16, 1.75e-3 in fp32 (the
# fp32 heads of 128, which round 8's kernel could not launch, 1.5e-3), every run deterministic, and
# the path that keeps $A$, the gates and the states (`keep_prep=True`, what the model uses) equal
# to the recomputing path bit for bit.

# %% [markdown]
# Every run above drew its decays as `logsigmoid(x + 3) · 6`, so strong that a chunk of 64 keeps
# about $10^{-13}$ of its incoming state: the rounding of the state carried between chunks hardly
# reaches the outputs. Round 28 ran the quick check at HyMo's heads under three regimes
# (`gdn_verify.py --decays`): those strong decays; the mixer's initialisation ($-A\,\Delta t$ per
# head); and weak ones, $g = -10^{-3}$, with which a chunk keeps 0.94 of its state. The weaker the
# decay, the larger the bf16 error. The carried state is held in fp32, but every product reads it
# rounded to bf16, and the backward stores it per chunk in bf16 (chapter 13):

# %%
dec = parity_runs("gdn_verify_decays_h200.json")
print(dec["meta"]["date"], dec["meta"]["code"])
for kind in dec["meta"]["decays"]:
    for dtype in ("bfloat16", "float32"):
        rs = [r for r in dec["rows"] if r["kind"] == "chunk" and r["decays"] == kind and r["dtype"] == dtype]
        print(f"{kind:7s}{dtype:9s} T={[r['T'] for r in rs]}: worst output/state {max(max(r['o'], r['ht']) for r in rs):.1e}, "
              f"worst gradient {max(r[n] for r in rs for n in names[2:]):.1e}")
worst = lambda kind, ns: max(r[n] for r in dec["rows"] if r.get("decays") == kind and r["dtype"] == "bfloat16" for n in ns)
assert worst("weak", names) > worst("strong", names)  # the effect the strong decays hide
assert all(max(r["o"], r["ht"]) <= 5e-3 and max(r.get(n, 0) for n in names[2:]) <= 1e-2 for r in dec["rows"])

# %% [markdown]
# At $T \le 256$ every regime stays inside the targets, the weak one by little: $o$ and the state
# at most 4.8e-3 off (target 5e-3), the gradients at most 6.0e-3 (round 28's run; round 29's, below,
# measured 6.1e-3 at $T$ = 256). Round 29 ran the longer sequences
# ($T$ = 1 000 and 4 096, at the model's heads, `gdn_verify_decays_long_h200.json`):

# %%
long = parity_runs("gdn_verify_decays_long_h200.json")
print(long["meta"]["date"], long["meta"]["code"])
for kind in long["meta"]["decays"]:
    for r in (r for r in long["rows"] if r["kind"] == "chunk" and r["decays"] == kind and r["dtype"] == "bfloat16"):
        print(f"{kind:5s} bf16 T={r['T']:5d}: o {r['o']:.1e}, state {r['ht']:.1e}, worst gradient {max(r[n] for n in names[2:]):.1e}")
weak = {r["T"]: r for r in long["rows"] if r["kind"] == "chunk" and r.get("decays") == "weak" and r["dtype"] == "bfloat16"}
init = [r for r in long["rows"] if r["kind"] == "chunk" and r.get("decays") == "init" and r["dtype"] == "bfloat16"]
assert (round(max(r["o"] for r in init), 4), round(max(r[n] for r in init for n in names[2:]), 4)) == (0.0043, 0.0054)  # the prose
assert weak[4096]["o"] > 5e-3 > weak[256]["o"]  # the weak decays' o crosses the target past T = 256 (the prose below)
assert all(max((r[n] for n in names[2:] if n in r), default=0) <= 1e-2 for r in long["rows"])  # every gradient inside its target

# %% [markdown]
# With weak decays the error grows with $T$ and levels off: $o$ reaches 5.1e-3 at $T$ = 1 000 and
# 5.2e-3 at 4 096, just above the 5e-3 target, while every gradient stays inside 1e-2 (6.3e-3 at
# worst); with the mixer's initial decays everything stays inside (4.3e-3 and 5.4e-3 at worst, at
# $T$ = 1 000). In fp32 the
# kernel is within 2.0e-3 and 2.7e-3 in every regime, so the excess is bf16's rounding of the
# carried state, not the algorithm. Keeping that state in fp32 for the products that read it would
# lower it, at the cost of fp32 matrix products in the state pass; it is not done. The target of
# 5e-3 was set against strong decays; for a relative error of bf16 arithmetic (whose unit roundoff
# is 3.9e-3) a 5.2e-3 is the same order, and training is what it affects, not a single output.
