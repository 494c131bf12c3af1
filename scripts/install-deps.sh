#!/usr/bin/env bash
# Installs everything memtune needs to build, test and run, from Debian's packages only.
# Quick and silent when everything is already there.
set -euo pipefail
# chromium renders the run report in the headless-browser test; Open MPI runs data-parallel training;
# clang with its libFuzzer runtime and OpenMP builds the fuzzers (scripts/fuzz.sh); cpp-httplib
# serves HTTP (memtune serve); the Vulkan loader, glslc and Mesa's drivers (lavapipe, a Vulkan
# device on the CPU, for the tests) build and test the vulkan backend; python3-venv makes the Hugging Face
# environment of the hf_* tests (scripts/prepare-hf-env.sh) and python3-dev the Python package's headers; patchelf makes the GPU check's bundle
# (scripts/device-check.sh --bundle); oneDNN (libdnnl-dev) runs the cpu backend's 16-bit products, and
# its CMake config asks for OpenCL's (ocl-icd-opencl-dev, a Recommends that --no-install-recommends
# skips); debootstrap makes the fresh Debian root in which scripts/fresh-root-check.sh proves this list;
# ccache keeps compiled objects between builds (scripts/build.sh).
packages=(build-essential cmake ninja-build pkg-config libopenblas-openmp-dev libdnnl-dev nlohmann-json3-dev libcli11-dev libfmt-dev libpcre2-dev libutf8proc-dev
          libgtest-dev libyaml-cpp-dev libcpp-httplib-dev python3 python3-dev python3-numpy python3-torch chromium
          libopenmpi-dev openmpi-bin clang libclang-rt-14-dev libomp-dev
          libvulkan-dev glslc mesa-vulkan-drivers vulkan-tools python3-venv patchelf libglvnd0
          ocl-icd-opencl-dev debootstrap ccache)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm run the JavaScript tokenizer reference (any recent Node.js will do).
command -v npm > /dev/null || missing+=(nodejs npm)
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
