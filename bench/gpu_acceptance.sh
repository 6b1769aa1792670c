#!/usr/bin/env bash
# gpuherd's GPU acceptance, one command on a lent one-GPU machine (bench/acceptance/__init__.py):
#
#   bash bench/gpu_acceptance.sh [--only PART]... [--budget S] [--plan] [--rehearse] [--no-record]
#   bash bench/gpu_acceptance.sh --prepare NANOGPT_SRC      # here, before the lease
#
# A lent machine reaches no registry: the packages its image lacks travel as wheels in .whl/
# (installed here with --no-index into /tmp/gpuherd-site), karpathy/nanoGPT's files in .nanogpt/;
# `--prepare` fills both (NANOGPT_SRC: a nanoGPT checkout, or its git directory), and the call
# carries them: carry [".whl", ".nanogpt"]. Without a GPU the same command rehearses on the CPU.
set -u
cd "$(dirname "$0")/.."
PY=${GPUHERD_PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
WHEELS=(loguru==0.7.3 orjson==3.13.0 zstandard==0.25.0)

prepare() {
  local src=${1:?"--prepare NANOGPT_SRC: a karpathy/nanoGPT checkout or git directory"}
  mkdir -p .nanogpt .whl
  for f in train.py model.py configurator.py LICENSE; do
    if [[ -f "$src/$f" ]]; then cp "$src/$f" .nanogpt/
    else git --git-dir "$src" show "HEAD:$f" > ".nanogpt/$f" || { echo "gpu_acceptance.sh: $f not found in $src" >&2; return 2; }
    fi
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${WHEELS[@]}" || return 2
  echo "gpu_acceptance.sh: .nanogpt/ and .whl/ ready ($(ls .whl | wc -l) wheels); carry both: [\".whl\", \".nanogpt\"]"
}

if [[ "${1:-}" == "--prepare" ]]; then
  prepare "${2:-}"
  exit $?
fi
shopt -s nullglob
wheels=(.whl/*.whl)
# only where gpuherd's packages are missing (a lent machine's image): never shadow a working install
if (( ${#wheels[@]} )) && ! "$PY" -c "import loguru, orjson" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpuherd-site \
    "${wheels[@]}" || { echo "gpu_acceptance.sh: the carried wheels did not install" >&2; exit 2; }
  export PYTHONPATH=/tmp/gpuherd-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec "$PY" -m bench.acceptance "$@"
