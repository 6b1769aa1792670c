# Sourced by the launch scripts: pick the interpreter and make this checkout importable.
# Order: $GPUHERD_PYTHON, the repo's .venv (made by install.sh, which installs this checkout
# into it, editable), python3. The checkout also goes first on PYTHONPATH, so an interpreter
# without the install imports this checkout's packages; GPUHERD_WRAPPER_PYTHONPATH names the
# entry added, and the supervisor hands a user's script its own PYTHONPATH back without it
# (supervisor/processes/worker_env.py: script_env). Sourced twice (train_auto_gpu.sh ->
# train_gpu.sh), it adds the entry once.
GPUHERD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${GPUHERD_PYTHON:-}" ]]; then
  GPUHERD_PY="$GPUHERD_PYTHON"
elif [[ -x "$GPUHERD_ROOT/.venv/bin/python" ]]; then
  GPUHERD_PY="$GPUHERD_ROOT/.venv/bin/python"
else
  GPUHERD_PY="python3"
fi
if [[ "${GPUHERD_WRAPPER_PYTHONPATH:-}" != "$GPUHERD_ROOT" ]]; then
  export PYTHONPATH="$GPUHERD_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export GPUHERD_WRAPPER_PYTHONPATH="$GPUHERD_ROOT"
fi
export PYTHONUNBUFFERED=1
