#!/usr/bin/env bash
# What speculation does on a CPU for a model of a realistic size: the bundled model's twins
# (tools/grow_model.py: its weights padded with zeros to GPT-B's and GPT-L's weight bytes, so
# they draw the bundled model's images at a larger model's cost), then
#   1. check: the twins draw the source's images bit for bit (ar and scd-mc, PNG bytes);
#   2. step: one forward's time at 1-32 tokens for one request (imagegen-step-cost), the twins
#      beside the bundled model and the random GPT-B and GPT-L shapes they stand for;
#   3. spec: every window of scd-mc and sjd at batch 1 against AR (imagegen-spec-bench);
#   4. load: one client, paired (bench/paired_load.sh): AR against scd-mc and sjd under the
#      goodput controller, which picks each step's window from its start-up calibration.
#
#   bench/model_size_twins.sh BUILD_DIR OUT [PHASES] [ROUNDS]
#   PHASES: a comma list of check,step,spec,load (default all); ROUNDS of the load phase (3).
#   bench/model_size_twins.sh build/ci /tmp/twins check      # the ctest's short form: seconds
#
# Long: on the 2-core VM an AR image of the GPT-L twin takes about 25 s, so the whole run takes
# about an hour (step 6 min, spec 20, load 35). TWINS (default "b l") picks the twins.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,17p "$0"; exit 2; }
BUILD=$1 OUT=$2 PHASES=${3:-check,step,spec,load} ROUNDS=${4:-3}
PY=${PYTHON:-/opt/imagegen/venv/bin/python}
TWINS=${TWINS:-b l}
has() { [[ ",$PHASES," == *",$1,"* ]]; }
mkdir -p "$OUT/models"
OUT=$(cd "$OUT" && pwd)
M=$OUT/models
for m in fmnist-gpt fmnist-vq fmnist-draft fmnist-classifier; do
  ln -sfn "$PWD/models/$m" "$M/$m"
done
# GPT-B: 390 MB in 73 blocks of LlamaGen's FFN at 4x (2,048 hidden units, as GPT-B's 768-wide
# blocks have; wider ones give the few-row kernel weight panels larger than a core's L2).
# GPT-L: 1.3 GB in 20 blocks of 28,160 hidden units (over 512 MB, so the few-row kernel is off
# and the BLAS takes 16 rows or more, as for GPT-L itself).
grow() {  # twin name, then grow_model.py's flags
  local name=$1
  shift
  [ -f "$M/$name/model.safetensors" ] || "$PY" tools/grow_model.py models/fmnist-gpt "$M/$name" "$@"
}
twin_names=()
for t in $TWINS; do
  case $t in
    b) grow fmnist-gpt-twin-b --ffn-multiplier 4 --extra-layers 67 ;;
    l) grow fmnist-gpt-twin-l --ffn-multiplier 55 --extra-layers 14 ;;
    small) grow fmnist-gpt-twin-small --ffn-multiplier 2 --extra-layers 2 ;;  # the ctest's
    *) echo "unknown twin $t (b, l, small)" >&2; exit 2 ;;
  esac
  twin_names+=("fmnist-gpt-twin-$t")
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

if has check; then
  for twin in "${twin_names[@]}"; do
    for method in ar scd-mc; do
      window=()
      [ "$method" = ar ] || window=(--window 8)
      for m in fmnist-gpt "$twin"; do
        log=$OUT/check-$m-$method.log
        "$BUILD/bench/imagegen-generate" --models-dir "$M" --model "$m" --method "$method" \
          "${window[@]}" --class 7 --seed 11 --count 2 --out "$OUT/check-$m-$method.png" \
          > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
      done
      if cmp -s "$OUT/check-fmnist-gpt-$method.png" "$OUT/check-$twin-$method.png"; then
        echo "check: $twin draws fmnist-gpt's images with $method (the same PNG bytes)"
      else
        echo "check: $twin and fmnist-gpt draw different images with $method" >&2
        exit 1
      fi
    done
  done
fi

if has step; then
  for m in fmnist-gpt "${twin_names[@]}"; do
    "$BUILD/bench/imagegen-step-cost" --models-dir "$M" --model "$m" --requests 1 \
      --tokens 1,2,4,8,16,32 --reps 8 --csv "$OUT/step-$m.csv" 2>&1 | grep -v gpuGetDeviceCount
  done
  "$BUILD/bench/imagegen-step-cost" --shapes gpt-b,gpt-l --requests 1 --tokens 1,2,4,8,16,32 \
    --reps 6 --csv "$OUT/step-random-shapes.csv" 2>&1 | grep -v gpuGetDeviceCount
fi

if has spec; then
  for twin in "${twin_names[@]}"; do
    "$BUILD/bench/imagegen-spec-bench" --models-dir "$M" --model "$twin" --methods scd-mc,sjd \
      --windows 2,4,8,16 --per-class 1 --out-dir "$OUT/spec-$twin" 2>&1 |
      grep -v gpuGetDeviceCount | tee "$OUT/spec-$twin.log" | grep -E '^(method|ar|sjd|scd-mc) '
  done
fi

if has load; then
  for twin in "${twin_names[@]}"; do
    # An AR image of the GPT-L twin takes about 25 s alone: cells long enough for a few each.
    seconds=20
    [ "$twin" = fmnist-gpt-twin-l ] && seconds=60
    PYTHON=$PY bash bench/paired_load.sh "$BUILD" "$OUT/load-$twin" "$ROUNDS" 1 ar/none \
      scd-mc/goodput sjd/goodput -- --models-dir "$M" --model "$twin" --seconds "$seconds" \
      --seconds-per-client 0
    sed -n 1,6p "$OUT/load-$twin/summary.txt"
  done
fi
