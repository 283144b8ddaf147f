#!/usr/bin/env bash
# The train-step rows of the results page, one process each (clean peak-memory numbers).
# On the GPU machine: OUT=/some/dir bash benchmarks/h200_train_step.sh kernels|main|variants|host   (each fits 10 minutes; kernels took 137 s on an H100 in round 43, its Triton cache filled)
# kernels: also the optimiser step alone (optim_step.py); host: the host time per launch, and one compiled block of each kind
# OUT is a scratch folder: benchmarks/results/ is the results page's curated record (rows labelled, newest first);
# copy the rows worth keeping there by hand, with their `code` and `note`. The train-step rows are added to OUT's
# train_step.json; the other scripts refuse a file that exists, so a part run again needs a new OUT (or its files removed).
# Sized for an H200 (141 GB): main's `--loss logits` (91.8 GB) and variants' `--all-mla` (88.7 GB) do not fit an
# H100's 80 GB and fail there. A run that fails or times out is named at the end, and the part exits with status 1.
set -u -o pipefail
case "${1:-main}" in kernels|main|variants|host) ;; *) echo "usage: OUT=dir bash $0 kernels|main|variants|host" >&2; exit 2 ;; esac
: "${OUT:?set OUT to a scratch folder, e.g. OUT=/tmp/bench bash $0 main}"
OUT=$(realpath -m "$OUT")  # as given, before the cd below
cd "$(dirname "$0")/.." || exit 2  # the repository's root, wherever this is run from
if [ "$OUT" = "$(realpath -m benchmarks/results)" ]; then
  echo "OUT=$OUT is benchmarks/results, the results page's record: give a scratch folder" >&2; exit 2; fi
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" ||
  { echo "these benchmarks need a CUDA GPU (each script says what a CPU can run instead)" >&2; exit 1; }
mkdir -p "$OUT" || { echo "OUT=$OUT: cannot make that folder; give another" >&2; exit 2; }
failed=()
trap 'failed+=("line $LINENO: $BASH_COMMAND")' ERR
keep() { grep -v Warning || true; }  # (no line left is not a failure)
export PYTHONPATH=$PWD
J=$OUT/train_step.json
# the last 70 lines of each run (its JSON row); KEEP=all keeps every line (a profile's table comes before its row)
run() { echo "== $*"; timeout 300 python benchmarks/train_step.py --out "$J" --code "${CODE:-}" "$@" 2>&1 | keep |
        if [ "${KEEP:-}" = all ]; then cat; else tail -70; fi; }
case "${1:-main}" in
  kernels)  # parity and speed of the Triton kernels: GDN prelude (chapter 14), cross-entropy chunk (42), GDN rule (13) and its solve for A
    timeout 150 python benchmarks/gdn_conv_kernel.py --out "$OUT/gdn_conv_kernel.json" 2>&1 | keep | tail -40
    timeout 100 python benchmarks/ce_kernel.py --out "$OUT/ce_kernel.json" 2>&1 | keep | tail -12
    timeout 300 python benchmarks/gdn_verify.py --quick --out "$OUT/gdn_verify.json" 2>&1 | keep | tail -25
    timeout 200 python benchmarks/gdn_kernel.py --shapes hymo_750m --out "$OUT/gdn_kernel.json" 2>&1 | keep | tail -25
    timeout 300 python benchmarks/gdn_prep_solve.py --out "$OUT/gdn_prep_solve.json" 2>&1 | keep | cut -c1-400
    timeout 100 python benchmarks/optim_step.py --out "$OUT/optim_step.json" 2>&1 | keep | tail -20 ;;
  host)  # the GPU's waits on its host (a profile of GPU activity only), the host's cost per launch, one compiled block of each kind
    KEEP=all run --compile --profile cuda > "$OUT/train_step_profile_cuda.txt"; { grep -A12 '^{' "$OUT/train_step_profile_cuda.txt" || true; } | head -14
    timeout 100 python benchmarks/host_launch.py --out "$OUT/host_launch.json" 2>&1 | keep | tail -8
    timeout 120 python benchmarks/block_step.py --out "$OUT/block_step_gdn.json" 2>&1 | keep | tail -4
    timeout 120 python benchmarks/block_step.py --block mla --out "$OUT/block_step_mla.json" 2>&1 | keep | tail -4 ;;
  main)  # the preset's step compiled and eager, and the one-micro-batch step with its profile
    run --compile --accum 32 --warmup 1 --steps 2
    KEEP=all run --compile --profile micro > "$OUT/train_step_profile.txt"; { grep -A12 '^{' "$OUT/train_step_profile.txt" || true; } | head -14
    run --accum 32 --warmup 1 --steps 2
    run
    run --loss logits ;;
  variants)  # activation checkpointing, all-MLA, and the PyTorch GDN path, at the preset's 32 micro-batches a step
    run --compile --ac --accum 32 --warmup 1 --steps 2
    run --compile --all-mla --accum 32 --warmup 1 --steps 2
    run --compile --gdn torch --accum 32 --warmup 1 --steps 2
    run --compile --gdn torch --warmup 2 --steps 3
    run --gdn torch --warmup 2 --steps 3 ;;
esac
if [ ${#failed[@]} -gt 0 ]; then echo "failed or timed out: ${failed[*]} of $0" >&2; exit 1; fi
