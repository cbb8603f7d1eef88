#!/bin/bash
# Second GPU run for #35: the parts run 1 lost to one crash (each part now in its own process), the rest of parity.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/transformers-*.whl .device/whl/gguf-*.whl > $OUT/pip.txt 2>&1 || { cat $OUT/pip.txt; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/liger .device/whl/liger_kernel-*.whl >> $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 320 python3 -m retrofit bench gpu --model .device/smollm2-135m --random-init --out $OUT/gpu \
  --parts attention,finetune,long,parity --budgets attention=80,finetune=60,long=50,parity=55 \
  --backends cuda_flash,cuda_cudnn,flex,cuda_efficient,decode,blockwise \
  --impls sdpa,psoftmax@triton,psoftmax@cuda_flash,softmax1@cuda_flash,ssmax@cuda_flash,softmax1@triton,psoftmax@flex,softmax1@cuda_cudnn,softmax1@cuda_efficient \
  > $OUT/bench.log 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "bench gpu: [a-z]+ (ok|failed)" $OUT/bench.log
left=$(( 375 - ($(date +%s) - t0) ))
if [ $left -gt 15 ]; then
  timeout $left env PYTHONPATH=/tmp/site:/tmp/liger:$PWD python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py tests/test_memory.py tests/test_chunked_loss.py -k "triton_low or cuda_allocator or liger" > $OUT/pytest.txt 2>&1
  tail -3 $OUT/pytest.txt
fi
echo "total $(( $(date +%s) - t0 )) s"
ls $OUT $OUT/* | head
