# Sourced by run1.sh and run2.sh on the device machine: the repository root, the carried wheels installed into
# /tmp/site (transformers 5.24.0, gguf, liger-kernel: the image has an older transformers and no gguf), t0 set.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  > /tmp/pip.txt 2>&1 || { cat /tmp/pip.txt; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
