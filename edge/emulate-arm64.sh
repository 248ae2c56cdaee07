#!/usr/bin/env bash
# Install ortpipe on an emulated Debian arm64 (the base of Raspberry Pi OS 64-bit) and check that the demo model
# gives the tokens it gives on this x86 machine.
#
#   make emulate-arm64            (or: PYTHON=.venv/bin/python edge/emulate-arm64.sh)
#
# Stages, each timed: tools (qemu-user-static, debootstrap), wheel (built from this checkout), rootfs (debootstrap
# --variant=minbase, kept in $ORTPIPE_CACHE/arm64 and reused), pip (a fresh venv inside the root file system and
# "ortpipe[cpu]" from PyPI), run (greedy `ortpipe run` on arm64 with the raspberry-pi profile, as a Pi runs it,
# and on x86 with the model's own settings, compared).
# Needs root (debootstrap, chroot, mounts), Debian's packages and PyPI. Mounts live in a private mount namespace,
# so none outlives the script. The host's /sys is never mounted: onnxruntime's cpuinfo would read the x86 CPU
# topology there and crash; without it, it warns and carries on. /proc is needed (onnxruntime opens model files
# through /proc/self/fd).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/sbin:/sbin  # debootstrap, chroot
REPO=$PWD
PYTHON=${PYTHON:-.venv/bin/python}
CACHE=$(realpath -m "${ORTPIPE_CACHE:-build/cache}")/arm64
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOTFS=$CACHE/rootfs-$SUITE
QEMU_CPU=${QEMU_CPU:-cortex-a76}  # Raspberry Pi 5's core (Armv8.2-A: dot product, fp16); cortex-a72 is the Pi 4's
PROMPT_IDS=${PROMPT_IDS:-5,17,42,8,23}
PROMPT=${PROMPT:-def fib(n):}
NEW=${NEW:-32}
PROFILE=${PROFILE:-raspberry-pi}  # the arm64 runs' device profile (shipped in the wheel)

if [ -z "${ORTPIPE_PRIVATE_MOUNTS:-}" ]; then
    ORTPIPE_PRIVATE_MOUNTS=1 exec unshare --mount --propagation private bash "$0" "$@"
fi

TIMES=()
stage() {  # stage NAME COMMAND...: run it and record its wall time
    local name=$1 start=${EPOCHREALTIME/./}
    shift
    echo "== $name"
    "$@"
    local us=$(( ${EPOCHREALTIME/./} - start ))
    TIMES+=("$name=$((us / 1000000)).$((us / 100000 % 10))s")
}

tools() {
    local need=()
    command -v debootstrap >/dev/null || need+=(debootstrap)
    [ -x /usr/bin/qemu-aarch64-static ] || need+=(qemu-user-static)
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
    # Without systemd nobody registers qemu with the kernel: do what systemd-binfmt would
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || cat /usr/lib/binfmt.d/qemu-aarch64.conf \
        > /proc/sys/fs/binfmt_misc/register
}

wheel() {
    # built from a copy of what the wheel holds: building in place would write setuptools' build/ into ours
    rm -rf "$CACHE/src" "$CACHE/dist"
    mkdir -p "$CACHE/src"
    cp -rL pyproject.toml README.md py "$CACHE/src/"
    "$PYTHON" -m pip wheel --no-deps -q -w "$CACHE/dist" "$CACHE/src"
    ls "$CACHE"/dist/ortpipe-*.whl
}

rootfs() {
    if [ ! -e "$ROOTFS/.ortpipe-rootfs" ]; then
        rm -rf "$ROOTFS"
        mkdir -p "$CACHE/apt"
        debootstrap --arch=arm64 --variant=minbase --include=python3,python3-pip-whl --cache-dir="$CACHE/apt" \
            "$SUITE" "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
        rm -rf "$ROOTFS"/var/lib/apt/lists/*
        touch "$ROOTFS/.ortpipe-rootfs"
    fi
    cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
    # the host's CA bundle: where the network needs a local CA, Debian's own bundle would not do
    cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
    mountpoint -q "$ROOTFS/proc" || mount -t proc proc "$ROOTFS/proc"
    mkdir -p "$CACHE/pip" "$ROOTFS/root/.cache/pip"
    mountpoint -q "$ROOTFS/root/.cache/pip" || mount --bind "$CACHE/pip" "$ROOTFS/root/.cache/pip"
}

in_root() {  # the host's PIP_* settings and pip.conf point at mirrors the root file system cannot see
    env -i HOME=/root LANG=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin QEMU_CPU="$QEMU_CPU" \
        PIP_CONFIG_FILE=/dev/null PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        chroot "$ROOTFS" "$@"
}

pip_install() {
    # What a user does (a venv, then pip install "ortpipe[cpu]"), minus what only costs time under emulation: pip
    # runs from Debian's pip wheel instead of being installed into the venv (11 s), and compiles no .pyc (18 s)
    local whl ort pip
    whl=$(basename "$CACHE"/dist/ortpipe-*.whl)
    pip=$(basename "$ROOTFS"/usr/share/python-wheels/pip-*.whl)
    ort=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('onnxruntime'))")  # the x86 run's
    rm -rf "$ROOTFS/opt/ortpipe"
    mkdir -p "$ROOTFS/opt/ortpipe/models"
    cp "$CACHE/dist/$whl" "$ROOTFS/opt/ortpipe/"
    cp -r models/demo "$ROOTFS/opt/ortpipe/models/demo"
    in_root python3 -m venv --without-pip /opt/ortpipe/venv
    in_root /opt/ortpipe/venv/bin/python "/usr/share/python-wheels/$pip/pip" \
        install -q --no-compile "/opt/ortpipe/${whl}[cpu]" "onnxruntime==$ort"
    in_root /opt/ortpipe/venv/bin/python -c 2>/dev/null "import platform, onnxruntime as o; \
print(platform.machine(), 'Python', platform.python_version(), 'onnxruntime', o.__version__)"
}

run() {  # writes run-{arm64,x86}-{ids,text}.json; the arm64 runs' stderr (cpuinfo's warnings) goes to a log
    local args=(--max-new-tokens "$NEW" --temperature 0 --logprobs 5 --json) arm=(--profile "$PROFILE")
    : >"$CACHE/run-arm64.log"
    in_root /opt/ortpipe/venv/bin/ortpipe run /opt/ortpipe/models/demo --prompt-ids "$PROMPT_IDS" "${args[@]}" \
        "${arm[@]}" >"$CACHE/run-arm64-ids.json" 2>>"$CACHE/run-arm64.log" \
        || { tail -20 "$CACHE/run-arm64.log"; exit 1; }
    in_root /opt/ortpipe/venv/bin/ortpipe run /opt/ortpipe/models/demo --prompt "$PROMPT" "${args[@]}" "${arm[@]}" \
        >"$CACHE/run-arm64-text.json" 2>>"$CACHE/run-arm64.log" || { tail -20 "$CACHE/run-arm64.log"; exit 1; }
    PYTHONPATH="$REPO/py" "$PYTHON" -m ortpipe.cli run models/demo --prompt-ids "$PROMPT_IDS" "${args[@]}" \
        >"$CACHE/run-x86-ids.json"
    PYTHONPATH="$REPO/py" "$PYTHON" -m ortpipe.cli run models/demo --prompt "$PROMPT" "${args[@]}" \
        >"$CACHE/run-x86-text.json"
}

stage tools tools
stage wheel wheel
stage rootfs rootfs
stage pip pip_install
stage run run

echo "stage seconds: ${TIMES[*]}" | tee "$CACHE/report.txt"
"$PYTHON" - "$CACHE" <<'EOF' | tee -a "$CACHE/report.txt"
import json, sys
from pathlib import Path

cache = Path(sys.argv[1])
# Greedy tokens must match up to a near tie: the two machines' int4 kernels (MatMulNBits, activations quantized
# per block) round differently, so where the two best logits are within TIE of each other either may win
TIE = 0.3
same = True
for prompt in ("ids", "text"):
    arm, x86 = (json.loads((cache / f"run-{arch}-{prompt}.json").read_text()) for arch in ("arm64", "x86"))
    print(f"prompt {prompt}: arm64 {arm['tokens']}")
    print(f"             x86   {x86['tokens']}")
    print(f"             decode tokens/s: arm64 (emulated) {arm['timings']['decode_tokens_per_s']}, "
          f"x86 {x86['timings']['decode_tokens_per_s']}")
    apart = next((i for i, (a, b) in enumerate(zip(arm["tokens"], x86["tokens"])) if a != b), None)
    if apart is None:
        same = same and arm["tokens"] == x86["tokens"]
        continue
    gaps = []
    for mine, other in ((arm, x86), (x86, arm)):
        top = dict(mine["logprobs"][apart]["top_logprobs"])
        chosen, theirs = mine["tokens"][apart], other["tokens"][apart]
        gaps.append(top[chosen] - top[theirs] if theirs in top else float("inf"))
    tie = max(gaps) < TIE
    same = same and tie
    print(f"             apart at token {apart}: the other's choice {gaps[0]:.3f} below on arm64, "
          f"{gaps[1]:.3f} on x86: " + ("a near tie" if tie else f"NOT a near tie (over {TIE})"))
print("same tokens on arm64 and x86 (up to a near tie)" if same else "arm64 and x86 tokens DIFFER")
sys.exit(0 if same else 1)
EOF
