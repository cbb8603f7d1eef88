#!/bin/bash
# Round 4 (issue #50), device call 1 of 2: the standalone repro of the memory-efficient backward's crash and the
# parity of flex / cuda_efficient / decode + blockwise / triton + dispatch on CUDA, in parallel processes (none of
# them timed: they are compile-bound), then the attention timing table alone on the GPU.
. "$(dirname "$0")/setup.sh"
R=/tmp/run1 && mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,temperature.gpu --format=csv > $R/smi.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__,
transformers.__version__, torch.cuda.get_device_name(0))" | tee $R/versions.txt
timeout 140 python3 docs/results/gpu-h200-round4/efficient_repro.py > $R/efficient_repro.txt 2>&1 &
for b in flex cuda_efficient decode,blockwise triton,dispatch; do
  timeout 140 python3 -m retrofit bench gpu --parts parity --backends $b --budgets parity=110 \
    --out $R/parity-${b/,/-} > $R/parity-${b/,/-}.log 2>&1 &
done
wait
echo "phase 1 (repro + parity) done at $(( $(date +%s) - t0 )) s"
cat $R/efficient_repro.txt
grep -h "passed, " $R/parity-*/report.md | cut -c1-200
timeout 290 python3 -m retrofit bench gpu --parts attention --budgets attention=200 --out $R/attention \
  > $R/attention.log 2>&1
echo "attention rc=$? at $(( $(date +%s) - t0 )) s"
for f in /tmp/tmp*/part.json; do [ -f "$f" ] && cp "$f" $R/partial-$(basename $(dirname $f)).json; done
tar czf $OUT/run1.tgz -C /tmp run1
sed -n '/## attention/,$p' $R/attention/report.md
tail -3 $R/attention.log
echo "total $(( $(date +%s) - t0 )) s"
