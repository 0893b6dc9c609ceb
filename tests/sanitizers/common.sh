# Shared by tests/sanitizers.sh and tests/tsan.sh (sourced, not run).

# ccache: share hits between checkouts beside this one, and let it cache the translation units
# that use CMake's precompiled headers (without pch_defines,time_macros it refuses them all).
sanitizer_ccache() {
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(dirname "$1")}"
  export CCACHE_SLOPPINESS="pch_defines,time_macros${CCACHE_SLOPPINESS:+,$CCACHE_SLOPPINESS}"
}

# Prints every report a sanitizer wrote to folder $2 under the heading "== $1: reports";
# returns 1 when there was one.
sanitizer_reports() {
  compgen -G "$2/*" > /dev/null || return 0
  echo "== $1: reports"
  for f in "$2"/*; do
    echo "--- $f"
    cat "$f"
  done
  return 1
}
