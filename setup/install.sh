#!/usr/bin/env bash
# One-time set-up: system packages FFCV needs to build, a virtualenv, the pinned requirements, FFCV itself.
# Called by the Makefile when .venv/.installed is missing or older than requirements.txt.
# APT=always (CI): install the system packages even when present; APT=never: skip that step (you provide them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
FFCV_VERSION=1.0.2
APT_PACKAGES="pkg-config libopencv-core-dev libopencv-imgproc-dev libturbojpeg0-dev python3-venv"

START=$SECONDS
STEP=0
STEP_START=$SECONDS
# One line as each step starts and how long it took, so the minute of pip is not a minute of silence.
step() {
    if [ "$STEP" -gt 0 ]; then echo "setup:       ($((SECONDS - STEP_START)) s)"; fi
    STEP=$((STEP + 1))
    STEP_START=$SECONDS
    echo "setup: [$STEP/5] $*"
}

have_system_deps() {
    command -v pkg-config >/dev/null &&
        pkg-config --exists libturbojpeg &&
        [ -f /usr/include/opencv4/opencv2/imgproc.hpp ] &&
        [ -f /usr/include/opencv4/opencv2/core.hpp ]
}

# APT=always (CI) installs them even when present: apt-get is then a quick no-op, and the path is exercised.
if [ "${APT:-auto}" = never ]; then
    step "system packages: skipped (APT=never)"
elif [ "${APT:-auto}" = always ] || ! have_system_deps; then
    step "installing the system packages FFCV needs to build (apt-get): $APT_PACKAGES"
    if [ "$(id -u)" = 0 ]; then
        SUDO=""
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo"
    else
        echo "setup: FFCV needs system packages that are missing, and this user cannot install them." >&2
        echo "setup: run this once, then 'make' again:" >&2
        echo "    sudo apt-get update && sudo apt-get install -y --no-install-recommends $APT_PACKAGES" >&2
        exit 1
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $APT_PACKAGES
else
    step "system packages: already installed"
fi

step "creating $VENV with $($PYTHON --version 2>&1)"
$PYTHON -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
step "installing the pinned requirements (torch, numpy, ...; the longest step, about a minute)"
$PIP install -q -r requirements.txt
step "building FFCV $FFCV_VERSION and installing this project"
# setup/opencv-shim stands in for the opencv4.pc that only the full libopencv-dev ships (see the files there).
PKG_CONFIG_PATH="$PWD/setup/opencv-shim${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
    $PIP install -q --no-deps "ffcv==$FFCV_VERSION"
$PIP install -q --no-deps -e .
step "checking that FFCV and OpenCV load"

# Fail here, not in the first test, if FFCV cannot load or the desktop OpenCV crept in.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import cv2, ffcv, ffcv.loader, ffcv.writer  # noqa: F401  (the C extension and numba pipeline load)
try:
    md.version("opencv-python")
    raise SystemExit("setup: opencv-python (desktop build) is installed; only opencv-python-headless should be")
except md.PackageNotFoundError:
    pass
print(f"setup: ffcv {md.version('ffcv')}, opencv-python-headless {cv2.__version__}, "
      f"torch {md.version('torch')}, numpy {md.version('numpy')} - ok")
PY
touch "$VENV/.installed"
echo "setup:       ($((SECONDS - STEP_START)) s)"
echo "setup: done in $((SECONDS - START)) s"
