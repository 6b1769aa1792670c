#!/usr/bin/env bash
# Install gpuherd into ./.venv (or into $GPUHERD_PYTHON's environment): its dependencies,
# then this checkout itself, editable, so `gpuherd` and `python -m supervisor` work anywhere.
#   bash install.sh               runtime dependencies: the launcher's core and every extra (requirements.txt)
#   bash install.sh --test        + test dependencies
#   bash install.sh --gpu-extras  + flash-attn (GPU machines only)
# torch comes first and is chosen for the machine: an existing torch is kept when
# it is new enough for the trainer (>= the floor in gpuherd/torch_floor.py; the venv
# sees system packages, so a CUDA build already installed is reused), replaced if older;
# otherwise a CUDA build where `nvidia-smi` sees a GPU, else the CPU build
# torch==2.13.0 (a few hundred MB instead of several GB of CUDA wheels).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
want_test=0 want_gpu=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --gpu-extras) want_gpu=1 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: error: unknown option '$arg' (see install.sh --help)" >&2; exit 2 ;;
  esac
done

if [[ -n "${GPUHERD_PYTHON:-}" ]]; then
  PY="$GPUHERD_PYTHON"
else
  if [[ ! -x "$ROOT/.venv/bin/python" ]]; then
    echo "install.sh: creating $ROOT/.venv"
    python3 -m venv --system-site-packages "$ROOT/.venv"
  fi
  PY="$ROOT/.venv/bin/python"
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then has_gpu=1; fi

# The oldest torch gpuherd's trainer runs on (gpuherd/torch_floor.py says which APIs set it).
TORCH_FLOOR="$(PYTHONPATH="$ROOT" "$PY" -c 'from gpuherd.torch_floor import FLOOR_TEXT; print(FLOOR_TEXT)')"
have_torch=""
if "$PY" -c 'import torch' >/dev/null 2>&1; then
  have_torch="$("$PY" -c 'import torch; print(torch.__version__)')"
  if ! why="$(PYTHONPATH="$ROOT" "$PY" -m gpuherd.torch_floor "$have_torch")"; then
    # Never keep a torch the trainer would crash on at step 0: install a newer one over it.
    echo "install.sh: $why" >&2
    echo "install.sh: replacing torch $have_torch with torch>=$TORCH_FLOOR" >&2
    have_torch=""
  fi
fi

if [[ -n "$have_torch" ]]; then
  echo "install.sh: keeping torch $have_torch"
  if [[ $has_gpu == 1 ]] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)'; then
    echo "install.sh: warning: this machine has an NVIDIA GPU but the installed torch is a CPU build;" \
         "workers will run on CPU. Reinstall torch with CUDA to use the GPU." >&2
  fi
elif [[ -n "${GPUHERD_TORCH_SPEC:-}" ]]; then
  echo "install.sh: installing ${GPUHERD_TORCH_SPEC} (GPUHERD_TORCH_SPEC)"
  pip_install "${GPUHERD_TORCH_SPEC}"
elif [[ $has_gpu == 1 ]]; then
  echo "install.sh: NVIDIA GPU found: installing a CUDA build of torch>=$TORCH_FLOOR"
  pip_install "torch>=$TORCH_FLOOR"
else
  echo "install.sh: no NVIDIA GPU: installing the CPU build torch==2.13.0"
  pip_install "torch==2.13.0"
fi

pip_install -r "$ROOT/requirements.txt"
# --no-deps: the requirements are in already, and a resolver run could swap torch's build.
pip_install --no-deps -e "$ROOT"
[[ $want_test == 1 ]] && pip_install -r "$ROOT/requirements-dev.txt"
if [[ $want_gpu == 1 ]]; then
  if [[ $has_gpu == 1 ]]; then pip_install --no-build-isolation -r "$ROOT/requirements-gpu.txt"
  else echo "install.sh: --gpu-extras skipped: no NVIDIA GPU on this machine" >&2; fi
fi
echo "install.sh: done ($PY)"
