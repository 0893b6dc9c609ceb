#!/usr/bin/env bash
# Downloads, on a Debian machine (the dev VM), the Debian packages that bench/gpu/run_all.sh needs
# on a GPU host that has none: GoogleTest (the tests), libpng and zlib (the benches' PNG output),
# nlohmann-json (the engine's config parser). They land in .deps/debs (git-ignored, about 2 MB);
# the device tool carries them (`carry: [".deps"]`) and run_all.sh unpacks them with dpkg -x.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .deps/debs
cd .deps/debs
# apt-get download writes as the _apt user where it can; a root-owned folder is fine too.
apt-get download libgtest-dev libgmock-dev libpng-dev libpng16-16 zlib1g-dev nlohmann-json3-dev \
  2>&1 | grep -v "^W: Download is performed unsandboxed" || true
ls -1 ./*.deb
