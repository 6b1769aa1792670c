# Sourced by the launch scripts: pick the interpreter and make the repo importable.
# Order: $GPUHERD_PYTHON, the repo's .venv (made by install.sh), python3.
# The packages are imported from the repo root via PYTHONPATH, never installed
# into site-packages under their generic names (a `supervisor` exists on PyPI).
GPUHERD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${GPUHERD_PYTHON:-}" ]]; then
  GPUHERD_PY="$GPUHERD_PYTHON"
elif [[ -x "$GPUHERD_ROOT/.venv/bin/python" ]]; then
  GPUHERD_PY="$GPUHERD_ROOT/.venv/bin/python"
else
  GPUHERD_PY="python3"
fi
export PYTHONPATH="$GPUHERD_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
