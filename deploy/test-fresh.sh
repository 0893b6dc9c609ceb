#!/usr/bin/env bash
# The README's two commands on a fresh Debian bookworm, the way a new user runs them: a
# debootstrap'd root (minbase: no compiler, no CUDA toolkit, no Python) in a chroot, with the
# committed tree (git archive HEAD) in /src. A development or CI machine has things a user's does
# not (a system CUDA toolkit's headers in /usr/local/include hid that install-deps left out
# CCCL's, 2026-12-03), so a green CI proves nothing about a fresh machine; this does.
#
#   deploy/test-fresh.sh [--tests] [--serve] [--root DIR] [--keep]
#
#   --tests  command 2: install-deps, the ci preset's build, then ctest (the whole suite)
#   --serve  command 1: install-deps, the release build, the daemon with --http-listen, then the
#            README's "Talk to it" calls: models, a class image (checked by the bundled
#            classifier), a streamed one, a text prompt, health, /metrics, the HTTP API
#   (neither: both, tests first)
#   --root   where the root goes (default /tmp/imagegen-fresh); an existing one is reused (its
#            /src replaced), which saves the debootstrap and, for --serve after --tests, the
#            install; say so when reporting
#   --keep   leave the root (default: unmounted, kept only with --keep)
#
# Needs root, debootstrap, unshare and ip (iproute2), and network access to Debian's mirror and
# PyPI. The tests and the daemon run in a network namespace of their own with only loopback
# (their ports cannot meet the host's); the install and the builds use the host's network.
# PIP_CERT, when set (a TLS-intercepting proxy), is copied in and handed to pip. About 45-60
# minutes on 2 cores for both. Logs: $root.log/. The chroot's processes are the host's too: a
# `pkill -f imagegen-server` on the host meanwhile ends the tests' daemons (it did once).
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0 serve=0 root=/tmp/imagegen-fresh keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests=1; shift ;;
    --serve) serve=1; shift ;;
    --root) root="$2"; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "usage: $0 [--tests] [--serve] [--root DIR] [--keep]" >&2; exit 2 ;;
  esac
done
[ $tests -eq 0 ] && [ $serve -eq 0 ] && tests=1 && serve=1
say() { echo "== test-fresh: $*"; }
fail() { echo "FAIL test-fresh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (chroot, mounts)"
for c in debootstrap unshare ip git; do command -v $c > /dev/null || fail "no $c"; done
logs="$root.log"
mkdir -p "$logs"

mounts=(proc sys dev dev/pts dev/shm)
unmount() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    mountpoint -q "$root/${mounts[$i]}" && umount "$root/${mounts[$i]}" || true
  done
}
cleanup() {
  unmount
  if [ $keep -eq 0 ]; then rm -rf "$root"; fi
}
trap cleanup EXIT

if [ ! -x "$root/bin/bash" ]; then
  say "debootstrap --variant=minbase bookworm $root"
  bash deploy/debian-root.sh "$root" > "$logs/debootstrap.log" 2>&1 ||
    fail "debootstrap ($logs/debootstrap.log)"
else
  say "reusing $root"
fi
# The host's resolver, and the proxy's CA bundle if there is one.
cp /etc/resolv.conf "$root/etc/resolv.conf"
# What a container runtime writes and debootstrap does not: without it "localhost" is looked up
# in DNS, which the tests' network namespace has not (Selenium reaches chromedriver by name).
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$root/etc/hosts"
pip_cert=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  cp "$PIP_CERT" "$root/root/pip-ca.crt"
  pip_cert=(PIP_CERT=/root/pip-ca.crt)
fi
rm -rf "$root/src" && mkdir -p "$root/src"
git archive HEAD | tar x -C "$root/src"
say "tree: $(git rev-parse --short HEAD) (committed files only)"
for m in "${mounts[@]}"; do mountpoint -q "$root/$m" || mount --bind "/$m" "$root/$m"; done

# A clean environment: what a login shell of a new machine has, nothing of this one's.
env_=(env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      LANG=C.UTF-8 TERM=dumb "${pip_cert[@]}")
in_root() { chroot "$root" "${env_[@]}" bash -c "cd /src && $1"; }
# Loopback only: a network namespace of its own.
offline() { unshare -n bash -c "ip link set lo up && chroot $root ${env_[*]} bash -c 'cd /src && $1'"; }
timed() {  # name, function, command
  local t0=$SECONDS
  if "$2" "$3" > "$logs/$1.log" 2>&1; then
    say "$1: ok in $((SECONDS - t0)) s"
  else
    tail -n 30 "$logs/$1.log" >&2
    fail "$1 after $((SECONDS - t0)) s ($logs/$1.log)"
  fi
}

if [ $tests -eq 1 ]; then
  say "command 2: ./deploy/install-deps.sh && cmake --preset ci && cmake --build --preset ci && ctest --preset ci"
  timed install-ci in_root "./deploy/install-deps.sh && cmake --preset ci && cmake --build --preset ci"
  timed ctest offline "ctest --preset ci"
  grep -E "tests passed|tests failed" "$logs/ctest.log" | sed 's/^/    /'
fi

if [ $serve -eq 1 ]; then
  say "command 1: ./deploy/install-deps.sh && cmake --preset release && cmake --build --preset release && build/release/server/imagegen-server --http-listen 127.0.0.1:8000"
  timed install-release in_root "./deploy/install-deps.sh && cmake --preset release && cmake --build --preset release"
  # The daemon as the README starts it, then the README's calls from "Talk to it" (its curl lines,
  # whose answers the venv's Python then checks).
  cat > "$root/src/.fresh-serve.sh" << 'EOF'
set -euo pipefail
build/release/server/imagegen-server --http-listen 127.0.0.1:8000 > /tmp/daemon.log 2>&1 &
daemon=$!
C=build/release/client/imagegen
PY=/opt/imagegen/venv/bin/python
for _ in $(seq 1 300); do $C health > /dev/null 2>&1 && break; sleep 1; done
$C health
grep -E "step cost of|ready:" /tmp/daemon.log
$C models | head -n 5
$C generate --class sneaker --seed 7 --out /tmp/sneaker.png
$PY tools/classify_png.py --expect sneaker /tmp/sneaker.png
$C generate --class bag --method sjd-pac --stream --preview-every 50 --preview-dir /tmp/frames --out /tmp/bag.png | tail -n 3
$C generate --model fmnist-t2i --prompt "a small dark bag" --seed 3 --out /tmp/t2i.png
$PY tools/classify_png.py --expect bag /tmp/t2i.png
curl -s 127.0.0.1:9464/metrics -o /tmp/metrics.txt
grep -E 'imagegen_(accepted|draft)_tokens_total|nfe_per_image_(sum|count)' /tmp/metrics.txt
curl -s 127.0.0.1:8000/v1/images/generations -d '{"prompt": "sneaker", "n": 2, "seed": 7}' -o /tmp/http.json
head -c 120 /tmp/http.json && echo
$PY - << 'PY'
import base64, json, urllib.request
m = open("/tmp/metrics.txt").read()
print("metrics:", sum(1 for l in m.splitlines() if l.startswith("imagegen_")), "imagegen samples")
r = json.load(open("/tmp/http.json"))
print("HTTP:", len(r["data"]), "images,", [len(base64.b64decode(d["b64_json"])) for d in r["data"]], "PNG bytes")
page = urllib.request.urlopen("http://127.0.0.1:8000/").read()
print("playground page:", len(page), "bytes")
PY
kill -TERM $daemon
wait $daemon && echo "daemon: exit 0 after SIGTERM"
EOF
  timed serve offline "bash .fresh-serve.sh"
  sed 's/^/    /' "$logs/serve.log"
fi
say "passed"
