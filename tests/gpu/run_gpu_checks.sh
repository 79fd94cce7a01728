#!/usr/bin/env bash
# The GPU checks, bounded to ~9 minutes: tests/gpu/run_gpu_checks.sh RESULTS_DIR
#
# Writes to RESULTS_DIR: nvidia-smi.txt, tensorflow.txt (version and GPUs TF
# sees), pytest.log (with [gpu] throughput lines), junit.xml, one JSON per
# check, the launch runs' task logs, and rc.txt (pytest's exit status; 3 when
# every test was skipped, e.g. TensorFlow sees no GPU).
# Needs: pip install -e ".[test,examples,gpu]" (tensorflow[and-cuda]).
set -u
out="${1:?usage: tests/gpu/run_gpu_checks.sh RESULTS_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ASYNCPS_GPU_RESULTS="$out" TF_CPP_MIN_LOG_LEVEL=1
unset CUDA_VISIBLE_DEVICES TF_ASYNCPS_LOGICAL_GPUS  # the tests hand out the GPUs

{ timeout 30 nvidia-smi -L; timeout 30 nvidia-smi; } > "$out/nvidia-smi.txt" 2>&1
timeout 180 python -c "import tensorflow as tf, tf_keras; print('tensorflow', tf.__version__, \
'tf_keras', tf_keras.__version__); print('GPUs', tf.config.list_physical_devices('GPU')); \
print('built with CUDA', tf.test.is_built_with_cuda())" > "$out/tensorflow.txt" 2>&1
cat "$out/tensorflow.txt"

# pytest-timeout bounds each test (300 s); timeout bounds the whole group.
timeout -k 10 540 python -m pytest -q -s -rA tests/gpu --junitxml="$out/junit.xml" \
    2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ] && ! grep -qE "[0-9]+ passed" "$out/pytest.log"; then
    echo "run_gpu_checks: every GPU test was skipped (see tensorflow.txt)" | tee -a "$out/pytest.log"
    rc=3
fi
echo "$rc" > "$out/rc.txt"
grep -h "^\[gpu\] throughput" "$out/pytest.log" || true
exit "$rc"
