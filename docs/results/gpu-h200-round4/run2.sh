#!/bin/bash
# Round 4 (issue #50), device call 2 of 2: the longest sequence that trains on one GPU per norm beside the planner
# (retrofit bench gpu --parts longest, SmolLM2-135M's architecture with random weights), then the CUDA tests that
# check this round's fixes (the memory-efficient backward's `out` layout, SSMax's d s on Triton).
. "$(dirname "$0")/setup.sh"
R=/tmp/run2 && mkdir -p $R
timeout 260 python3 -m retrofit bench gpu --parts longest --model .device/smollm2-135m --random-init \
  --budgets longest=210 --out $R/longest > $R/longest.log 2>&1
echo "longest rc=$? at $(( $(date +%s) - t0 )) s"
for f in /tmp/tmp*/part.json; do [ -f "$f" ] && cp "$f" $R/partial-$(basename $(dirname $f)).json; done
left=$(( 330 - ($(date +%s) - t0) ))
if [ $left -gt 20 ]; then
  timeout $left python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_fused.py \
    -k "crashed or on_triton or layout" > $R/pytest.txt 2>&1
  tail -5 $R/pytest.txt
fi
tar czf $OUT/run2.tgz -C /tmp run2
sed -n '/## longest/,$p' $R/longest/report.md
echo "total $(( $(date +%s) - t0 )) s"
