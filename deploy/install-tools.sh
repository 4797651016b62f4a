#!/bin/sh
# Installs the Debian packages the local cluster needs, each only when its command is missing:
#   deploy/install-tools.sh haproxy prometheus
# As root (or through sudo), with Debian's (or Ubuntu's) package registry reachable. `make cluster`
# and tests/test_cluster.py run it; it prints nothing when everything is there.
set -eu

missing=""
for package in "$@"; do
    command -v "$package" >/dev/null 2>&1 || [ -x "/usr/sbin/$package" ] || [ -x "/usr/bin/$package" ] \
        || missing="$missing $package"
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1; then
    as_root="sudo"
else
    echo "deploy/install-tools.sh: needs root to install:$missing (apt-get install -y$missing)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "deploy/install-tools.sh: no apt-get; install$missing with this system's package manager" >&2
    exit 1
fi
echo "installing$missing (apt-get)" >&2
# No recommended packages (prometheus would bring node-exporter and more), no questions, and no
# services started for them (a Prometheus service would hold port 9090): deploy/cluster.py runs
# both binaries itself. A policy-rc.d that denies starts is put in place for the install only.
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $as_root tee "$policy" >/dev/null
    $as_root chmod +x "$policy"
    trap '$as_root rm -f "$policy"' EXIT
fi
$as_root apt-get update -qq
$as_root apt-get install -y -qq --no-install-recommends $missing >/dev/null
