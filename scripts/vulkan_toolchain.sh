#!/usr/bin/env bash
# The toolchain for `moe-offload native build --backend vulkan` on Debian 12, and lavapipe (Mesa's
# Vulkan driver on the CPU) as a real non-host device for tests/native/test_vulkan.py:
#   1. apt: glslc, the Vulkan loader and its dev files, mesa-vulkan-drivers (lavapipe),
#      spirv-headers (root only; skipped when they are there);
#   2. this llama.cpp needs Vulkan headers 1.3.261+ (VK_EXT_layer_settings) and Debian 12 has
#      1.3.239: the headers-only packages libvulkan-dev and spirv-headers of Debian 13 are
#      downloaded (apt, from a private package list) and unpacked into
#      ${MOE_OFFLOAD_CACHE:-${XDG_CACHE_HOME:-~/.cache}/moe-offload}/vulkan-sdk, which
#      runtime/native/vulkan_sdk.py puts first on the build's include and CMake paths. Nothing is
#      installed into the system from Debian 13.
# Safe to run again: each step is skipped when its result is there. Exit 0 when the toolchain is
# ready, 1 (with the reason on stderr) when it cannot be made here.
set -euo pipefail
SDK=${MOE_OFFLOAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-offload}/vulkan-sdk
say() { echo "vulkan_toolchain: $*" >&2; }
fail() { say "$*"; exit 1; }

have_system() {
  command -v glslc >/dev/null && [[ -e /usr/include/vulkan/vulkan.h ]] \
    && ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 \
    && [[ -f /usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake ]]
}
if ! have_system; then
  command -v apt-get >/dev/null || fail "no apt-get: install glslc, the Vulkan headers, lavapipe and SPIRV-Headers by hand"
  [[ $(id -u) == 0 ]] || fail "not root: cannot apt-get install"
  say "apt-get install glslc libvulkan-dev mesa-vulkan-drivers spirv-headers"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    glslc libvulkan1 libvulkan-dev mesa-vulkan-drivers spirv-headers >/dev/null
  have_system || fail "the packages installed but the toolchain is still incomplete"
fi

if grep -q LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp 2>/dev/null; then
  say "the system's Vulkan headers are new enough"; exit 0
fi
if grep -q LayerSettingEXT "$SDK/usr/include/vulkan/vulkan_structs.hpp" 2>/dev/null; then
  say "headers ready in $SDK"; exit 0
fi
command -v dpkg-deb >/dev/null || fail "no dpkg-deb to unpack the newer headers"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/lists/partial" "$TMP/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  > "$TMP/sources.list"
APT=(-o "Dir::Etc::SourceList=$TMP/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
     -o "Dir::State::Lists=$TMP/lists" -o "Dir::Cache::Archives=$TMP/debs"
     -o "APT::Sandbox::User=root")
say "downloading Debian 13's libvulkan-dev and spirv-headers (headers only) into $SDK"
apt-get "${APT[@]}" update -qq >/dev/null || fail "cannot read Debian 13's package list"
(cd "$TMP/debs" && apt-get "${APT[@]}" download libvulkan-dev spirv-headers >/dev/null) \
  || fail "cannot download the header packages"
rm -rf "$SDK.tmp" && mkdir -p "$SDK.tmp"
for deb in "$TMP"/debs/*.deb; do dpkg-deb -x "$deb" "$SDK.tmp"; done
grep -q LayerSettingEXT "$SDK.tmp/usr/include/vulkan/vulkan_structs.hpp" \
  || fail "the downloaded headers lack VK_EXT_layer_settings"
rm -rf "$SDK.tmp/usr/lib"      # headers only: the loader is the system's
rm -rf "$SDK" && mv "$SDK.tmp" "$SDK"
say "headers ready in $SDK"
