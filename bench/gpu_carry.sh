#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh needs on the device machine, which reaches no network:
# Debian's libfabric (runtime, headers, fi_info), the libraries it links (ldd of
# libfabric.so.1 on Debian 12) and pkg-config, as .deb files in .whl/debs/ (about 3 MB).
# gpu_check.sh unpacks them into build/debroot (never into /) and points pkg-config, the
# loader and PATH there. .whl/ is git-ignored, so name it in the device tool's `carry`:
#     bash bench/gpu_carry.sh      # here, with the package mirror reachable
#     run(command="bash bench/gpu_check.sh", carry=[".whl"])
# Debian's libfabric has no CUDA support: with it the engine steps run and CUDA registration
# is refused cleanly (a SKIP), which still checks everything but FI_HMEM itself.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/debs
cd .whl/debs
PKGS=(libfabric1 libfabric-dev libfabric-bin
      librdmacm1 libibverbs1 ibverbs-providers libpsm-infinipath1 libpsm2-2
      libnl-3-200 libnl-route-3-200 libnuma1
      pkgconf pkgconf-bin libpkgconf3 pkg-config)
# apt-get download writes as the _apt user where it can; a root-owned folder is fine too
chmod 0777 . 2>/dev/null || true
apt-get download "${PKGS[@]}"
ls -la
du -sh .
