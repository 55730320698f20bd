#!/usr/bin/env bash
# GPU checks and benchmarks in one call: `bash benchmarks/gpu.sh STAGE...`
# Stages: tests (CUDA tests), train (training throughput at 8x2048), long (T=8192/16384),
# decode (greedy and beam decoding), train-gla (attnlab and fla GLA only), fsdp (2 GPUs). Logs go to $OUT (or ./gpu-out) as they are written;
# Triton's compile and autotune cache is kept in .tcache so later calls skip the autotuning.
set -u -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache} PYTHONUNBUFFERED=1
mkdir -p "$TRITON_CACHE_DIR"
# A cache carried from another machine, as split parts (tcache.tar.xz.part-aa, -ab, ...) in .tcache-in/
ls .tcache-in/tcache.tar.xz.part-* >/dev/null 2>&1 && cat .tcache-in/tcache.tar.xz.part-* | tar xJf - -C "$TRITON_CACHE_DIR" && echo "triton cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) restored"
run() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; local rc=$?; echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; }
AL="python -m attnlab.cli"
for stage in "$@"; do case $stage in
  tests) run tests "${TESTS_LIMIT:-330}" python -m pytest -q -p no:cacheprovider --tb=short -rfs -m cuda tests/test_kernels_cuda.py tests/test_train.py tests/test_convert.py ;;
  train) run train "${TRAIN_LIMIT:-240}" $AL bench train --shape 8x2048 --steps 6 --warmup 2 --profile --out "$OUT/train-8x2048.json" ;;
  train-gla) run train-gla "${TRAIN_LIMIT:-240}" $AL bench train --model attnlab-gla --model attnlab-gla-eager --model fla-gla --shape 8x2048 --steps 6 --warmup 2 --profile --saved --out "$OUT/train-gla-8x2048.json" ;;
  fsdp) run fsdp "${FSDP_LIMIT:-400}" python -m pytest -q -p no:cacheprovider --tb=short -rfs -m cuda tests/test_distributed.py ;;
  long) run long "${LONG_LIMIT:-240}" $AL bench train --model attnlab-gla --model hf-llama --shape 2x8192 --shape 1x16384 --steps 5 --warmup 2 --out "$OUT/train-long.json" ;;
  decode) run decode "${DECODE_LIMIT:-240}" $AL bench decode --arch attnlab-gla --hf-arch fla-gla --batch-size 8 --prompt-len 2048 --new-tokens 256 --repeats 2 --hf-repeats 1 --beams 4 --profile --out "$OUT/decode-8x2048.json" ;;
  *) echo "unknown stage $stage" ;;
esac; done
tar cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 15M - "$OUT/tcache.tar.xz.part-" && ls -la "$OUT"
cat "$OUT/summary.txt"
