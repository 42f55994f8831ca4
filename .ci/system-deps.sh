#!/usr/bin/env bash
# Debian packages the test suites need beyond Python: installed when missing, as root, with
# apt-get (CI machines start without them). Elsewhere (no root / no apt) it only says what is
# missing; suites that need a missing tool then skip and print why — except in CI (CI=true),
# where a missing package is an error.
set -euo pipefail

# One line per package: "package  command-or-file-that-proves-it-is-installed"
PACKAGES=(
  "gcc  gcc"
  "g++  g++"
  "elixir  mix"
  "erlang-dialyzer  dialyzer"
  "make  make"
  "libzmq3-dev  /usr/include/zmq.h"
  "libmsgpack-dev  /usr/include/msgpack.h"
  "clang  clang++"
  "libclang-rt-14-dev  /usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.asan_static-x86_64.a"
)
# The CPU kernels' aarch64 compile check (tests/test_kernels_cpu.py) on x86-64 hosts.
if [[ "$(uname -m)" == "x86_64" ]]; then
  PACKAGES+=("g++-aarch64-linux-gnu  aarch64-linux-gnu-g++")
fi

missing=()
for entry in "${PACKAGES[@]}"; do
  read -r pkg probe <<<"$entry"
  if [[ "$probe" == /* ]]; then [[ -e "$probe" ]] || missing+=("$pkg")
  else command -v "$probe" >/dev/null 2>&1 || missing+=("$pkg"); fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "system-deps: missing ${missing[*]} (not root or no apt-get): the suites that need them will skip" >&2
  [[ "${CI:-}" == "true" ]] && exit 1
fi
exit 0
