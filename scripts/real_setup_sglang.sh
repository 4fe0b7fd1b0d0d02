#!/usr/bin/env bash
# Idempotent, cached set-up of the SGLang part of the real-engine tier (see docs/real-engine.md):
#   .venv-sglang/   SGLang 0.5.23 from PyPI on the local CPU torch wheel (never in .venv or .venv-vllm),
#                   plus the two local adjustments below; ~2.8 GB
# It serves the tiny model scripts/real_setup.sh built in .tools/tiny-model (called at its end).
# Without the local torch wheel or the tiny model it prints why and exits 0: the SGLang tier then skips.
#
# Upstream has no pip-only CPU install (its CPU path is Docker or a source build of a CPU sgl-kernel for
# Xeons with AMX). On a CPU without AMX SGLang takes its plain PyTorch paths, which is what runs here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-sglang
MODEL=.tools/tiny-model
WHEEL_DIR=${VLLM_WHEEL_DIR:-/opt/wheels}
TORCH_WHEEL=$WHEEL_DIR/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
SGLANG_VERSION=0.5.23
STUB_DIR=$VENV/sgl-kernel-stub  # put on PYTHONPATH by testbed/router_testbed/real_engine.py (SglangReplica)

if [ ! -f "$TORCH_WHEEL" ]; then
  echo "real-setup (sglang): skipped: $TORCH_WHEEL is absent (SGLang's CPU path needs torch 2.13.0+cpu, which" \
    "PyPI does not carry); the SGLang real_engine tier will skip"
  exit 0
fi
if [ ! -f "$MODEL/config.json" ]; then
  echo "real-setup (sglang): skipped: $MODEL is missing (scripts/real_setup.sh builds it first);" \
    "the SGLang real_engine tier will skip"
  exit 0
fi

want=$(sha256sum scripts/real_setup_sglang.sh | cut -c1-16)
stamp=$VENV/.real-setup-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "real-setup (sglang): $VENV up to date"
  exit 0
fi

echo "real-setup (sglang): installing sglang==$SGLANG_VERSION into $VENV (~2.8 GB)"
t0=$(date +%s)
rm -f "$stamp"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# Every version pinned, as verified together (2026-12-01): a new release of any of them must not change
# what CI builds.
constraints=$VENV/.constraints.txt
tr ' ' '\n' > "$constraints" <<'PINS'
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 asttokens==3.0.2 attrs==26.1.0 blobfile==3.0.0
certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 click==8.5.1 compressed-tensors==0.18.0
dill==0.4.1 distro==1.9.0 einops==0.8.2 executing==2.3.0 fastapi==0.165.0 filelock==4.3.1 frozenlist==1.8.0
fsspec==2026.9.0 gguf==0.19.0 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 httpx==0.28.1
huggingface_hub==1.33.0 idna==3.20 interegular==0.3.3 ipython==9.18.1 ipython_pygments_lexers==1.1.1
jedi==0.20.1 Jinja2==3.1.6 jiter==0.19.0 jsonschema-specifications==2025.9.1 jsonschema==4.26.0
llguidance==1.9.1 loguru==0.7.3 lxml==6.1.3 markdown-it-py==4.3.0 MarkupSafe==3.0.4
matplotlib-inline==0.2.2 mdurl==0.1.2 mpmath==1.3.0 msgspec==0.23.0 multidict==7.2.1 networkx==3.6.1
numpy==2.4.6 openai==2.8.0 openai-harmony==0.0.4 opentelemetry-api==1.45.2 orjson==3.13.0 packaging==26.4 parso==0.8.7
partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 pillow==13.0.0 prometheus_client==0.26.0
prompt_toolkit==3.0.53 propcache==0.5.4 psutil==7.2.2 ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1
pycparser==3.12 pycryptodomex==3.24.2 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0
python-dateutil==2.9.0.post0 python-multipart==0.0.34 PyYAML==6.0.4 pyzmq==27.3.0 referencing==0.37.0
regex==2026.11.19 requests==2.34.2 rich==15.0.0 rpds-py==2026.9.1 safetensors==0.8.0 scipy==1.17.1
sentencepiece==0.2.1 setproctitle==1.3.8 shellingham==1.5.4 six==1.17.0 sniffio==1.3.1 soundfile==0.14.0
stack-data==0.6.3 starlette==1.10.0 sympy==1.14.0 tiktoken==0.14.0 tokenizers==0.23.2 torchvision==0.28.0
tqdm==4.70.1 traitlets==5.16.1 transformers==5.19.0 triton==3.9.0 typer==0.29.2 typing-inspection==0.4.5
typing_extensions==4.16.0 urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 watchfiles==1.3.0 wcwidth==0.9.4
xgrammar==0.2.7 xxhash==4.1.0 yarl==1.25.1 zstandard==0.25.0
PINS
# pip's notes that are expected here: local index folders without the package, and sglang's own
# requirements that are left out on purpose (below).
quiet() {
  grep -v -e "is ignored: it is neither" -e "^sglang [0-9.]* requires " \
    -e "pip's dependency resolver does not currently" >&2 || true
}
pip=("$VENV/bin/pip" install -q --disable-pip-version-check -c "$constraints")
"${pip[@]}" --no-deps "$TORCH_WHEEL" 2> >(quiet)
# sglang's requirements pull CUDA builds (sglang-kernel, flashinfer, torch 2.14 from PyPI, ...): install it
# without them, then what its HTTP server, tokenizer manager, scheduler and detokenizer import on the CPU
# path (triton, 1 GB, among them: sglang imports it unconditionally, even on the CPU).
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" 2> >(quiet)
"${pip[@]}" transformers tokenizers openai sentencepiece xgrammar blobfile llguidance uvicorn pyzmq \
  prometheus-client python-dateutil fastapi uvloop orjson msgspec pydantic psutil setproctitle requests \
  aiohttp partial_json_parser interegular python-multipart pybase64 xxhash einops packaging numpy scipy \
  pillow tqdm tiktoken safetensors jinja2 sympy networkx filelock fsspec typing_extensions watchfiles \
  regex distro IPython zstandard dill gguf jsonschema soundfile loguru 2> >(quiet)
# The Responses API (/v1/responses): serving_responses.py imports openai_harmony at module level for every
# model (only gpt-oss uses it); without it SGLang logs "OpenAI Responses API (/v1/responses) disabled:
# OpenAIServingResponses init failed (ModuleNotFoundError: No module named 'openai_harmony')" and answers
# every /v1/responses with 500. 0.0.4 is the version sglang 0.5.23 declares.
"${pip[@]}" openai-harmony 2> >(quiet)
# Imported unconditionally by sglang's model loader / transformers' image utilities; without their deps.
"${pip[@]}" --no-deps torchvision compressed-tensors 2> >(quiet)

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# Adjustment 1: PyPI's torchvision 0.28 is a CUDA build. Its _meta_registrations.py registers fake
# (meta) kernels for torchvision::nms and torchvision::qnms unconditionally; against the CPU torch wheel
# those operators are not registered (the C++ extension does not load), register_fake raises, and
# `import torchvision` - hence `import transformers`' image utilities and sglang - fails. Register them only
# when the extension's ops exist (torchvision.extension._has_ops()), as its other optional ops already do.
"$VENV/bin/python" - "$SITE/torchvision/_meta_registrations.py" <<'EOF'
import re
import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
if "router-sidecar: guarded" not in text:
    pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)\n', re.M)
    found = pattern.findall(text)
    if sorted(found) != ["nms", "qnms"]:
        sys.exit(f"real-setup (sglang): torchvision's fake-op registrations changed ({found}); adjust the patch")
    text = pattern.sub(
        lambda m: f"# router-sidecar: guarded (the CPU torch wheel has no torchvision::{m[1]} op)\n"
        f"@(torch.library.register_fake(\"torchvision::{m[1]}\") if torchvision.extension._has_ops()"
        " else (lambda fn: fn))\n",
        text,
    )
    if "import torchvision.extension" not in text:  # what binds the name the guard uses
        sys.exit("real-setup (sglang): torchvision's _meta_registrations.py changed; adjust the patch")
    path.write_text(text)
EOF

# Adjustment 2: with SGLANG_USE_CPU_ENGINE=1 sglang imports `sgl_kernel` (its CUDA/AMX kernel package)
# unconditionally, and there is no CPU build of it on PyPI. The model served here (a plain Llama, no
# quantisation, no MoE, torch_native attention, pytorch sampling) never calls into it, so a stand-in module
# satisfies the import; any call fails loudly (stderr line and NotImplementedError) instead of computing
# something wrong. Other models, quantisation or MoE may need the real kernels.
mkdir -p "$STUB_DIR/sgl_kernel"
cat > "$STUB_DIR/sgl_kernel/__init__.py" <<'EOF'
"""Stand-in for sgl_kernel (written by scripts/real_setup_sglang.sh): importable, never callable."""

import sys

__version__ = "0+router-sidecar-stand-in"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing_kernel(*args, **kwargs):
        sys.stderr.write(f"sgl_kernel stand-in: {name} was called; this model needs the real kernels\n")
        sys.stderr.flush()
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this CPU build")

    missing_kernel.__name__ = name
    return missing_kernel
EOF

# What the server imports must import (its CPU-support warnings are shown only if it does not).
if ! out=$(PYTHONPATH=$STUB_DIR SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
  'import torchvision, transformers, sglang.srt.entrypoints.http_server, openai_harmony' 2>&1); then
  echo "$out" >&2
  echo "real-setup (sglang): $VENV does not import; see above" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "real-setup (sglang): $VENV installed in $(($(date +%s) - t0)) s, $(du -sh "$VENV" | cut -f1)"
