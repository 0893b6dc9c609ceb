#!/usr/bin/env bash
# Test certificates, made with openssl: in DIR a CA (ca.key, ca.pem; CN=imagegen-test-ca-<DIR's
# name>, valid 3 days) and, for each NAME, a key and a certificate that CA signed (NAME.key,
# NAME.pem; CN=NAME, subjectAltName IP:127.0.0.1 and DNS:localhost, valid 2 days: its notAfter
# differs from the CA's). The TLS unit tests, the e2e tests and the soak make theirs with it.
#
#   tests/make_test_pki.sh DIR NAME...
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 DIR NAME..." >&2; exit 2; }
dir=$1
shift
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 3 \
  -subj "/CN=imagegen-test-ca-$(basename "$dir")" 2> /dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > leaf.ext
for name in "$@"; do
  openssl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "/CN=$name" \
    2> /dev/null
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$name.pem" \
    -days 2 -extfile leaf.ext 2> /dev/null
  rm -f "$name.csr"
done
