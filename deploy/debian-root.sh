#!/usr/bin/env bash
# A fresh Debian bookworm root filesystem in DIR, as the official debian:bookworm image has it:
# debootstrap's minbase variant from deb.debian.org with the image's apt sources (bookworm,
# bookworm-updates, bookworm-security; deb822). Needs root and debootstrap (its callers check for
# it). Used where no registry gives the official image: deploy/test-image.sh imports it as the
# image's base, deploy/test-fresh.sh chroots into it.
#
#   deploy/debian-root.sh DIR
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
root="$1"
debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > /dev/null
rm -f "$root/etc/apt/sources.list"
cat > "$root/etc/apt/sources.list.d/debian.sources" << 'SOURCES'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
