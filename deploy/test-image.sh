#!/usr/bin/env bash
# Builds the imagegen image and smoke-tests it, the way a user would run it:
#   1. build (timed), size and what dominates it;
#   2. the daemon becomes SERVING through the image's own HEALTHCHECK (grpc.health.v1);
#   3. `imagegen generate` (from a second container of the image) returns a PNG of the requested
#      class (checked with the bundled classifier, tools/classify_png.py);
#   4. /metrics answers with imagegen's counters; the HTTP port (IMAGEGEN_HTTP_PORT) serves the
#      playground page and draws an image through the OpenAI Images API; SIGHUP (API key reload)
#      sent with exec reaches the daemon and leaves it running;
#   5. SIGTERM (`stop` with a timeout above --grace-seconds) drains a streaming request in flight:
#      the client gets its image, the daemon exits 0; the drain time is reported.
#
#   deploy/test-image.sh [--target cpu|gpu] [--keep] [--quick]
#
# Docker where a Docker engine answers, else Podman. What it adapts to, and says when it does:
#   - no registry (this project's development machines): the Debian base is made with
#     debootstrap from Debian's mirror and imported (IMAGEGEN_BASE overrides the base image);
#   - a sandbox that refuses the default rlimits or cgroup v1 for crun: runc and explicit
#     --ulimit values (IMAGEGEN_ENGINE_FLAGS overrides);
#   - a TLS-intercepting proxy: the host's CA bundle goes to pip as a build secret (pip_ca).
# --quick skips the build and tests an image already built (imagegen:test).
set -euo pipefail
cd "$(dirname "$0")/.."

target=cpu keep=0 quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    --quick) quick=1; shift ;;
    *) echo "usage: $0 [--target cpu|gpu] [--keep] [--quick]" >&2; exit 2 ;;
  esac
done
tag="imagegen:test-$target"
say() { echo "== test-image: $*"; }
fail() { echo "FAIL test-image: $*" >&2; exit 1; }

# --- the container engine ---------------------------------------------------------------------
if docker info > /dev/null 2>&1; then
  engine=docker
elif command -v podman > /dev/null; then
  engine=podman
else
  fail "neither a Docker engine nor podman (apt-get install podman runc debootstrap)"
fi
flags=()
if [ -n "${IMAGEGEN_ENGINE_FLAGS:-}" ]; then
  read -r -a flags <<< "$IMAGEGEN_ENGINE_FLAGS"
fi

# --- the base image ---------------------------------------------------------------------------
base="${IMAGEGEN_BASE:-$(sed -n 's/^ARG DEBIAN_BASE=//p' Dockerfile)}"
if ! $engine image exists "$base" 2> /dev/null && ! $engine image inspect "$base" > /dev/null 2>&1; then
  if ! $engine pull -q "$base" > /dev/null 2>&1; then
    base=localhost/imagegen-base:bookworm
    if ! $engine image inspect "$base" > /dev/null 2>&1; then
      command -v debootstrap > /dev/null || fail "no registry and no debootstrap for the base image"
      say "no registry: making $base with debootstrap (minbase, bookworm, deb.debian.org)"
      root="$(mktemp -d)"
      bash deploy/debian-root.sh "$root"
      rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
      tar -C "$root" -c . | $engine import -q - "$base" > /dev/null
      rm -rf "$root"
    fi
  fi
fi
say "engine $engine $($engine --version | head -n 1 | sed 's/.*version //'), base $base"

# --- what this machine's engine needs to run a container ---------------------------------------
if [ ${#flags[@]} -eq 0 ] && [ "$engine" = podman ] && ! podman run --rm "$base" true > /dev/null 2>&1; then
  ul=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
  if podman run --rm "${ul[@]}" "$base" true > /dev/null 2>&1; then
    flags=("${ul[@]}")
  elif podman --runtime runc run --rm "${ul[@]}" "$base" true > /dev/null 2>&1; then
    flags=(--runtime runc "${ul[@]}")
  else
    fail "podman cannot run $base here (set IMAGEGEN_ENGINE_FLAGS)"
  fi
  say "podman needs: ${flags[*]} (its default rlimits, or crun with cgroup v1, are refused here)"
fi
global=() local_flags=()
if [ "${flags[0]:-}" = --runtime ]; then
  global=("${flags[@]:0:2}")
  local_flags=("${flags[@]:2}")
else
  local_flags=("${flags[@]}")
fi
# Podman without systemd runs no healthcheck timers and says so on every run and rm; the check
# runs by hand below, so those lines are dropped.
E() { $engine "${global[@]}" "$@" 2> >(grep -v 'systemd connection' >&2); }

# --- 1. build ---------------------------------------------------------------------------------
if [ "$quick" = 0 ]; then
  secret=()
  for ca in "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do
    if [ -n "$ca" ] && [ -s "$ca" ]; then
      secret=(--secret "id=pip_ca,src=$ca")
      break
    fi
  done
  say "building $tag (target $target)"
  t0=$(date +%s)
  # Podman writes OCI images by default, and OCI images have no HEALTHCHECK: ask for Docker's.
  format=()
  [ "$engine" = podman ] && format=(--format docker)
  E build "${local_flags[@]}" "${format[@]}" "${secret[@]}" --network host \
    --build-arg "DEBIAN_BASE=$base" \
    --target "$target" -t "$tag" . > "/tmp/imagegen-image-build.log" 2>&1 ||
    { tail -n 40 /tmp/imagegen-image-build.log; fail "build failed (log /tmp/imagegen-image-build.log)"; }
  say "build: $(( $(date +%s) - t0 )) s (log /tmp/imagegen-image-build.log)"
fi
size=$(E image inspect --format '{{.Size}}' "$tag")
say "image size: $(( size / 1000000 )) MB"
say "layers:"
E history --format '{{.Size}}\t{{.CreatedBy}}' "$tag" | grep -v '^0 B' | cut -c 1-110 |
  sed 's/^/    /'
E run --rm "${local_flags[@]}" --entrypoint /bin/sh "$tag" -c \
  'du -sh /opt/imagegen/venv/lib/python3.11/site-packages/torch/lib \
          /opt/imagegen/venv/lib/python3.11/site-packages/nvidia /usr/lib/x86_64-linux-gnu \
          /usr/local/bin /models 2>/dev/null; true' | sed 's/^/    /'
E image inspect --format 'user {{.Config.User}}; stop signal {{.Config.StopSignal}}' "$tag" |
  sed 's/^/    /'
[ "$engine" = docker ] || [ -n "$(podman image inspect --format '{{.HealthCheck}}' "$tag" |
  grep -v '^<nil>$')" ] || fail "the image has no HEALTHCHECK (built in OCI format?)"

# --- 2. run: SERVING through the HEALTHCHECK ----------------------------------------------------
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
hport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
name="imagegen-test-$$"
work="$(mktemp -d)"
cleanup() {
  if [ "$keep" = 0 ]; then E rm -f "$name" "$name-client" > /dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
E run -d --name "$name" "${local_flags[@]}" --network host -e "IMAGEGEN_PORT=$port" \
  -e "IMAGEGEN_METRICS_PORT=$mport" -e "IMAGEGEN_HTTP_PORT=$hport" "$tag" --grace-seconds 30 \
  > /dev/null
t0=$(date +%s.%N)
healthy=0
for _ in $(seq 1 240); do
  if [ "$engine" = podman ]; then
    # Podman runs HEALTHCHECKs from systemd timers, absent in a container host without systemd:
    # run the image's own check the way the timer would.
    E healthcheck run "$name" > /dev/null 2>&1 && healthy=1
  else
    [ "$(docker inspect --format '{{.State.Health.Status}}' "$name")" = healthy ] && healthy=1
  fi
  [ "$healthy" = 1 ] && break
  [ "$(E inspect --format '{{.State.Running}}' "$name")" = true ] ||
    { E logs "$name" | tail -n 20; fail "the daemon exited"; }
  sleep 0.5
done
[ "$healthy" = 1 ] || { E logs "$name" | tail -n 20; fail "not healthy after 120 s"; }
say "SERVING (HEALTHCHECK passed) $(python3 -c "import time; print(round(time.time() - $t0, 1))") s after start"

# --- 3. generate: a PNG of the requested class ----------------------------------------------
client() {
  E run --rm "${local_flags[@]}" --network host -v "$work:/out" --user "$(id -u):$(id -g)" \
    --entrypoint imagegen "$tag" --target "127.0.0.1:$port" "$@"
}
client generate --class sneaker --seed 7 --out /out/sneaker.png | sed 's/^/    /'
[ -s "$work/sneaker.png" ] || fail "no PNG"
py="${IMAGEGEN_VENV:-/opt/imagegen/venv}/bin/python"
if [ -x "$py" ]; then
  "$py" tools/classify_png.py --expect sneaker "$work/sneaker.png" | sed 's/^/    /' ||
    fail "the PNG is not a sneaker"
  say "generate: a PNG of class sneaker (bundled classifier)"
else
  say "generate: a PNG ($(stat -c %s "$work/sneaker.png") bytes); no $py to classify it"
fi

# --- 4. metrics ---------------------------------------------------------------------------
metrics="$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$mport/metrics', timeout=10).read().decode())")"
echo "$metrics" | grep -q '^imagegen_requests_total{.*} 1' || { echo "$metrics" | head; fail "/metrics"; }
say "/metrics: $(echo "$metrics" | grep -c '^imagegen_') imagegen samples, requests_total counted"
http="$(python3 - "$hport" << 'EOF'
import base64, json, sys, urllib.request
base = "http://127.0.0.1:%s" % sys.argv[1]
page = urllib.request.urlopen(base + "/", timeout=30).read().decode()
assert "imagegen playground" in page, page[:200]
req = urllib.request.Request(base + "/v1/images/generations", method="POST",
                             data=json.dumps({"prompt": "trouser", "seed": 3}).encode(),
                             headers={"Content-Type": "application/json",
                                      "X-Request-Id": "image-test-1"})
resp = urllib.request.urlopen(req, timeout=120)
assert resp.headers.get("x-request-id") == "image-test-1", dict(resp.headers)
body = json.load(resp)
png = base64.b64decode(body["data"][0]["b64_json"])
assert png[:8] == b"\x89PNG\r\n\x1a\n"
print("the playground page (%d bytes); POST /v1/images/generations: a %s PNG, NFE %d"
      % (len(page), body["size"], body["data"][0]["imagegen"]["nfe"]))
EOF
)" || fail "the HTTP port"
say "HTTP: $http"
# The daemon's log lines matching $1, waited for up to 10 s (written by the log's own thread, so
# a line may land a moment after what it reports).
log_lines() {
  local found=""
  for _ in $(seq 1 100); do
    found="$(E logs "$name" 2>&1 | grep "$1" || true)"
    [ -n "$found" ] && break
    sleep 0.1
  done
  echo "$found"
}
# A line for that call, named by the id the client sent.
logged="$(log_lines 'request request_id=image-test-1 ')"
[ -n "$logged" ] || { E logs "$name" 2>&1 | tail -n 5; fail "no log line for request image-test-1"; }
echo "$logged" | grep -q 'api=http .*outcome=ok status=200' || fail "the log line: $logged"
say "log: ${logged#imagegen-server: }"
# SIGHUP (which reads the API keys again) sent with exec (`kubectl exec ... sh -c 'kill -HUP 1'`)
# reaches the daemon as the container's PID 1 and does not stop it (this daemon has no
# --token-file, so it says there is nothing to read again).
E exec "$name" sh -c 'kill -HUP 1'
hup="$(log_lines 'SIGHUP')"
[ -n "$hup" ] || fail "no log line for SIGHUP"
[ "$(E inspect --format '{{.State.Running}}' "$name")" = true ] || fail "SIGHUP stopped the daemon"
say "SIGHUP through exec as PID 1: ${hup#imagegen-server: }; still running"

# --- 5. SIGTERM drains a request in flight -------------------------------------------------
# Sixteen ar images in one streaming call: 16 x 196 steps, about 2 s on an idle 2-core machine
# (one image alone, 0.2 s, could end before `logs` shows its first step).
E run -d --name "$name-client" "${local_flags[@]}" --network host -v "$work:/out" \
  --user "$(id -u):$(id -g)" --entrypoint imagegen "$tag" --target "127.0.0.1:$port" \
  generate --class bag --seed 3 --method ar --n 16 --stream --out /out/bag.png > /dev/null
steps() { E logs "$name-client" 2>&1 | grep -c "step " || true; }
for _ in $(seq 1 3000); do  # until the request is running (a step of it streamed)
  [ "$(steps)" -gt 0 ] && break
  sleep 0.1
done
at_term=$(steps)
[ "$at_term" -gt 0 ] || { E logs "$name-client" | tail -n 5; fail "the streaming client did not start"; }
t0=$(date +%s.%N)
E stop -t 40 "$name" > /dev/null
drain=$(python3 -c "import time; print(round(time.time() - $t0, 2))")
code=$(E inspect --format '{{.State.ExitCode}}' "$name")
client_code=$(E wait "$name-client")
E logs "$name" 2>&1 | tail -n 3 | sed 's/^/    /'
[ "$code" = 0 ] || fail "the daemon exited $code on SIGTERM"
[ "$client_code" = 0 ] && [ -s "$work/bag_0.png" ] && [ -s "$work/bag_15.png" ] ||
  fail "the request in flight was lost (client $client_code)"
at_end=$(steps)
[ "$at_end" -gt "$at_term" ] || fail "the stream was not in flight at SIGTERM ($at_term steps then)"
say "SIGTERM at step message $at_term of $at_end (16 images): the stream went on to its 16 PNGs (client exit 0), daemon exit 0 after $drain s"
say "passed"
