#!/usr/bin/env bash
# Builds one llama.cpp program for the benchmarks beside hf2q on a CUDA machine:
#
#   bench/llama-build.sh TARGET LLAMA_SRC_TARBALL WORK     # TARGET: llama-bench, llama-server
#
# Unpacks a llama.cpp source tree (a tarball made elsewhere: the GPU machine reaches no network;
# one top-level folder or the tree itself) into WORK/llama and builds only TARGET (CUDA for
# sm_90, no curl, no OpenSSL, static) with CMake and ninja into WORK/llama/build/bin; prints the
# build time. Logs: WORK/llama-cmake.log, WORK/llama-build.log. Used by peer-gpu.sh and
# serve-gpu.sh (`build`).
set -uo pipefail
TARGET=${1:?usage: llama-build.sh TARGET LLAMA_SRC_TARBALL WORK}
SRC=${2:?usage: llama-build.sh TARGET LLAMA_SRC_TARBALL WORK}
WORK=${3:?usage: llama-build.sh TARGET LLAMA_SRC_TARBALL WORK}
rm -rf "$WORK/llama" && mkdir -p "$WORK/llama"
tar xzf "$SRC" -C "$WORK/llama" || exit 1
# A tarball holding one top-level folder: build in it.
if [ ! -f "$WORK/llama/CMakeLists.txt" ] && [ "$(ls "$WORK/llama" | wc -l)" = 1 ]; then
    d=$(ls "$WORK/llama")
    mv "$WORK/llama/$d" "$WORK/llama-src.tmp" && rmdir "$WORK/llama" && mv "$WORK/llama-src.tmp" "$WORK/llama"
fi
start=$(date +%s)
cmake -S "$WORK/llama" -B "$WORK/llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF \
    >"$WORK/llama-cmake.log" 2>&1 || { tail -30 "$WORK/llama-cmake.log"; exit 1; }
cmake --build "$WORK/llama/build" --target "$TARGET" -j "$(nproc)" \
    >"$WORK/llama-build.log" 2>&1 || { tail -30 "$WORK/llama-build.log"; exit 1; }
echo "$TARGET built in $(($(date +%s) - start)) s: $WORK/llama/build/bin/$TARGET"
