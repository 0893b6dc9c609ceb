#!/usr/bin/env bash
# A Janus-Pro-1B-shaped model with random weights, end to end on this machine: a fake official
# checkpoint (tools/fake_janus.py: the real key names, config.json and sizes, bf16), converted
# (tools/convert_janus.py), loaded by the daemon and asked for images by prompt token ids.
# Reports the sizes, the conversion and load times, the daemon's memory (VmRSS, VmHWM) and
# each image's statistics. The image side is reduced to 128x128 (8x8 tokens) so that a full
# image takes seconds on a CPU; the language model is the full 1B shape.
#
#   bench/janus_1b_probe.sh [WORKDIR (default /tmp/janus-1b)] [BUILD (default build/ci)]
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/janus-1b}
B=${2:-build/ci}
PY=${IMAGEGEN_PYTHON:-/opt/imagegen/venv/bin/python}
mkdir -p "$W"
now() { date +%s.%N; }
t0=$(now)
[ -f "$W/hf/model.safetensors" ] || $PY tools/fake_janus.py --preset pro-1b --out "$W/hf" --image-size 128
t1=$(now)
rm -rf "$W/models"
$PY tools/convert_janus.py "$W/hf" "$W/models/janus-pro-1b-random" "$W/models/janus-pro-1b-vq" \
  --image-size 128 --max-prompt-len 256 --pad-id 100002  # the fake has no tokenizer.json
t2=$(now)
du -sh "$W/hf" "$W/models/janus-pro-1b-random" "$W/models/janus-pro-1b-vq"
rm -f "$W/ports"
"$B/server/imagegen-server" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --port-file "$W/ports" \
  --models-dir "$W/models" --models janus-pro-1b-random --window-policy budget --kv-cache-mb 1024 \
  >"$W/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1200); do [ -s "$W/ports" ] && break; sleep 0.1; done
port=$(cut -d' ' -f1 "$W/ports")
t3=$(now)
until "$B/client/imagegen" health --target "127.0.0.1:$port" >/dev/null 2>&1; do
  kill -0 $pid || { cat "$W/server.log"; exit 1; }
  sleep 0.2
done
t4=$(now)
rss() { grep -E "^(VmRSS|VmHWM)" /proc/$pid/status | tr -s ' \t' ' ' | tr '\n' ' '; }
echo "fake checkpoint $(echo "$t1 - $t0" | bc) s, conversion $(echo "$t2 - $t1" | bc) s, daemon load $(echo "$t4 - $t3" | bc) s; after load: $(rss)"
"$B/client/imagegen" models --target "127.0.0.1:$port"
# "<|User|>: a red bag\n\n<|Assistant|>:<begin_of_image>" as ids: any 12 ids below 102400.
ids=100000,9,111,222,333,444,555,666,777,888,100003,100016
for m in ar sjd; do
  "$B/client/imagegen" generate --target "127.0.0.1:$port" --model janus-pro-1b-random \
    --prompt-ids "$ids" --seed 1 --method "$m" --out "$W/$m.png"
  echo "after $m: $(rss)"
done
tail -n 3 "$W/server.log"
