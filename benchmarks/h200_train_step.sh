#!/usr/bin/env bash
# The train-step variants of the results page, one process each (clean peak-memory numbers).
# On the GPU machine: OUT=/some/dir bash benchmarks/h200_train_step.sh main|variants
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-benchmarks/results}
J=$OUT/train_step.json
run() { echo "== $*"; timeout 300 python benchmarks/train_step.py --out "$J" "$@" 2>&1 | grep -v Warning | tail -70; }
case "${1:-main}" in
  main)
    run --compile --profile > "$OUT/train_step_profile.txt"; tail -22 "$OUT/train_step_profile.txt"
    run --profile > "$OUT/train_step_profile_eager.txt"; tail -22 "$OUT/train_step_profile_eager.txt"
    run --loss logits
    run --compile --accum 32 --warmup 1 --steps 2 ;;
  second)
    run --compile --accum 32 --warmup 1 --steps 2
    run --compile --profile micro --steps 3 > "$OUT/train_step_profile_micro.txt"; tail -45 "$OUT/train_step_profile_micro.txt" | cut -c1-100,180-290
    run --compile --ac
    run --compile --all-mla
    run --compile --gdn torch --warmup 2 --steps 3
    run --gdn torch --warmup 2 --steps 3 ;;
  final)
    run --compile --accum 32 --warmup 1 --steps 2
    run --compile --profile micro > "$OUT/train_step_profile.txt"; grep -A12 '^{' "$OUT/train_step_profile.txt" | head -14
    run --accum 32 --warmup 1 --steps 2
    run --compile --gdn torch --accum 32 --warmup 1 --steps 2 ;;
  variants)
    run --compile --ac
    run --compile --all-mla
    run --compile --gdn torch --warmup 2 --steps 3
    run --gdn torch --warmup 2 --steps 3 ;;
esac
