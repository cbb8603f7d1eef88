#!/bin/bash
# The one prepared GPU run for issue #35: install, facts, retrofit bench gpu (all parts), the CUDA tests.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/transformers-*.whl .device/whl/gguf-*.whl > $OUT/pip.txt 2>&1 || { cat $OUT/pip.txt; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/liger .device/whl/liger_kernel-*.whl >> $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv | tee $OUT/smi.txt
timeout 60 python3 .device/probe.py 2>&1 | tee $OUT/probe.txt
echo "setup+probe $(( $(date +%s) - t0 )) s"
timeout 430 python3 -m retrofit bench gpu --model .device/smollm2-135m --random-init --out $OUT/gpu 2>&1 | tee $OUT/bench.log | grep -E "bench gpu: [a-z]+ (ok|failed)|Error|error" | head -40
echo "bench rc=$? at $(( $(date +%s) - t0 )) s"
ls -la $OUT $OUT/* | head -20
left=$(( 540 - ($(date +%s) - t0) ))
if [ $left -gt 20 ]; then
  timeout $left env PYTHONPATH=/tmp/site:/tmp/liger:$PWD python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_memory.py tests/test_chunked_loss.py tests/test_cuda_fused.py -k "triton_matches or triton_low or cuda or liger" 2>&1 | tail -25 | tee $OUT/pytest.txt
fi
echo "total $(( $(date +%s) - t0 )) s"
cat $OUT/gpu/report.md 2>/dev/null | head -60
