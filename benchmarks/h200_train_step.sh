#!/usr/bin/env bash
# The train-step variants of the results page, one process each (clean peak-memory numbers).
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/h200_train_step.sh [quick]
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-benchmarks/results}
J=$OUT/train_step.json
run() { echo "== $*"; timeout 300 python benchmarks/train_step.py --out "$J" "$@" 2>&1 | grep -v Warning | tail -60; }
run --compile --profile                          > "$OUT/train_step_profile.txt"
tail -25 "$OUT/train_step_profile.txt"
run --profile                                    > "$OUT/train_step_profile_eager.txt"
tail -25 "$OUT/train_step_profile_eager.txt"
run --loss logits
run --compile --accum 32 --warmup 1 --steps 2
run --compile --ac
run --compile --all-mla
run --compile --gdn torch --warmup 2 --steps 3
