#!/usr/bin/env bash
# GPU checks and benchmarks in one call: `bash benchmarks/gpu.sh STAGE...`
# Stages: tests (every CUDA test in tests/, TEST_WORKERS processes at once; TEST_FILES picks files), accuracy (the bf16
# decode step against fp32 arithmetic, projections separate and fused), train (training throughput at 8x2048), long (T=8192/16384),
# decode (greedy and beam decoding), train-gla (attnlab and fla GLA only), train-run (`attnlab train` with and
# without CUDA graphs), zoo (every mixer family beside its peers: training and ops at 16x1024, 4x4096, 1x16384; ZOO_ARGS adds options),
# zoo-nsa (NSA at 12 layers, block 64, 16 blocks, window 512 beside fla's NSA and HF Llama; NSA_SHAPES="2x2048 1x8192" picks the shapes),
# zoo-mamba2 (Mamba-2 beside GLA), prof-mamba2 (one eager step of each profiled, at 4x4096), sweep-mamba2 (Mamba-2's SSD and conv kernels under several block choices), zoo-nsa-stats (NSA with and without its health statistics),
# eager (where an eager step's host time goes, per mixer, beside its captured step: EAGER_MODELS, EAGER_SHAPE; EAGER_COMPILED=1 adds
# each model with its blocks under torch.compile; EAGER_STACK=1 each with its blocks in turn under one torch.compile; EAGER_STACK_CPP=1 so with Inductor's C++ wrapper; EAGER_STACK_WITH="OPTS OPTS" so with Inductor's options OPTS, key=value,key=value, one variant each; EAGER_TRACED=1 each with its blocks compiled and the mixers' kernels traced too; EAGER_WHOLE=1 each with the whole model compiled, kernels traced), compile-breaks (benchmarks/compile_breaks.py: what graph breaks at the mixer cost an
# eager step, on stand-in blocks: eager, blocks compiled with the mixer a break or a custom op, the model compiled, captured;
# BREAKS_ARGS adds options), traced-blocks (benchmarks/traced_blocks.py: which mixers' blocks compile whole with their kernels
# traced, and whether that step's loss and gradients match eager's: TRACED_MODELS, TRACED_ARGS, e.g. "--both --shape 9x1024 --lift
# causal_conv1d"; TRACED_CODE=1 keeps Inductor's generated code), prof-eager (the
# eager steps of PROF_EAGER_MODELS under torch's profiler: the host's own time per aten op and the top kernels),
# decode-zoo (every mixer's decoding at B=8, prompt 2048, 256 new, 20 layers x 1024 x 16 heads, HF Llama beside; DECODE_ARCHS picks),
# zoo-long (the long-context table of issue 36: 2mamba, linear__output_norm, linear_elu at 16x1024, 4x4096 and 1x16384-65536 beside
# mamba2 and HF Llama, and the paper's medium model, hidden 1536 x 27 layers x 24 heads, at 2x8192; then the targets checked;
# ZOO_LONG_MODELS picks the family's presets, ZOO_LONG_MEDIUM=0 skips the medium model),
# chunk-crossover (the linearizable presets' token mixing, tiled against chunked under several chunk sizes, 16x1024 to 1x65536;
# CROSSOVER_ARGS adds options, e.g. "--preset linear_elu --shape 4x4096"),
# chunk-profile (2mamba's chunked mixing under torch's profiler at PROFILE_SHAPE, default 1x65536: its kernels by GPU time),
# prefill (a prompt's prefill through the engine against its length, 1K to 64K, PREFILL_ARCHS: issue 36's linear-time prefill),
# memory (where a training step's peak memory goes, by allocation site, and its tokens/s: MEMORY_MODELS, default 2mamba
# tiled, chunked captured and eager, and chunked with its forward recomputed in the backward, at MEMORY_SHAPE, default 1x32768;
# MEMORY_SEPARATE=1: each of MEMORY_MODELS in a process of its own, so that none runs in memory an earlier one still holds;
# MEMORY_ARGS adds options, e.g. the paper's medium model: "--hidden 1536 --layers 27 --heads 24 --intermediate 3072"), chunk-blocks (power2's state kernels under several block choices and chunk sizes, 2mamba's mixing at BLOCKS_SHAPE, default 1x65536;
# BLOCKS_ARGS adds options, e.g. "--heads 24" for the paper's medium model), medium-profile (the paper's medium model at 2x8192,
# 2mamba eager and HF Llama, one step of each under torch's profiler: GPU time by kernel category and the top kernels),
# chunk-ncu (Nsight Compute's sections for each kernel of 2mamba's chunked mixing, forward and backward, at NCU_SHAPE, default
# 2x8192 with NCU_HEADS 24: throughput, occupancy, and what the warps wait on),
# fsdp (the CUDA tests of tests/test_distributed.py on 2 GPUs; FSDP_K selects by name), fsdp-capture (the step under FSDP2 captured
# apart from the trainer, benchmarks/fsdp_capture.py: FSDP_CAPTURE_MODELS, FSDP_CAPTURE_ARGS), ddp-ctas (benchmarks/ddp_capture.py on
# DDP_GPUS GPUs, default 2: the captured DDP step of 2mamba-e and GLA with NCCL's collectives capped at each of DDP_CTAS CTAs in turn,
# default "2 4 8 16", beside NCCL's own choice; NCCL's INIT log, the channels each communicator got, in $OUT/ddp-ctas-nccl.*), scale (`attnlab train` over 1, 2, 4, ... GPUs: SCALE_MODELS="2mamba hf-llama", SCALE_GPUS="1 2 4" (default: up to
# every visible GPU), SCALE_ARGS (default --no-ckpt) adds options of `attnlab bench scale`; scale2 .. scale9 are more benches in
# one call, each from SCALE2_MODELS, SCALE2_GPUS, SCALE2_ARGS, SCALE2_LIMIT ... where set, else from scale's),
# before-after (a compact zoo at 4x4096 and 2mamba's decode on this tree and on BASE_TREE, an export of an earlier commit),
# recall (issue 37: the suite `recall` on every visible GPU (RECALL_GPUS=0,1 picks), RECALL_PER_GPU jobs at a time on each (default 21),
# or with RECALL_SPLIT=1 its 128- and 256-token jobs on GPU 0 beside its 512-token ones on GPU 1, stopped at RECALL_LIMIT seconds
# (default 330; what finished is reported), its report into $OUT/recall-report.*, then `attnlab eval --task niah` timed on a
# random ~300M softmax model (1024 x 24 layers x 16 heads, 8K positions) at 1k-8k; RECALL_DECAY_BIAS=1 runs 2mamba and 2mamba-e
# with mixer_options.decay_bias beside the suite, RECALL_BIAS_PER_GPU at a time on each GPU (default 3); RECALL_TINY=1 runs the same commands
# on CPU at toy size, to check them; RECALL_SUITE=0 times needle-in-a-haystack alone, RECALL_NIAH=0 skips it). Results go to $OUT (or ./gpu-out), bundled as each stage ends (below);
# Triton's compile and autotune cache is kept in .tcache and returned after every stage, so later calls skip the autotuning.
set -u -o pipefail
# Results: with RESULTS_TAR=1 (the default) every stage writes into a folder of its own and, as each stage ends,
# everything so far is bundled into $OUT/results.tar.gz beside $OUT/summary.txt, so a call stopped at its time limit
# still returns what finished, in few files (tar xzf results.tar.gz); RESULTS_TAR=0 writes into $OUT directly.
RESULTS=${OUT:-gpu-out}; mkdir -p "$RESULTS"
if [ "${RESULTS_TAR:-1}" = 1 ]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-out.XXXXXX"); else OUT=$RESULTS; fi
bundle() { [ "$OUT" = "$RESULTS" ] && return 0
  cp "$OUT/summary.txt" "$RESULTS/summary.txt" 2>/dev/null
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt -printf '%P\0' | tar czf "$RESULTS/results.tar.gz.part" --null -T -) \
    && mv "$RESULTS/results.tar.gz.part" "$RESULTS/results.tar.gz"; }
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache} PYTHONUNBUFFERED=1
mkdir -p "$TRITON_CACHE_DIR"
# A machine without network: the Python packages it lacks (fla, attnlab's own dependencies) as wheels in .whl/, into a
# fresh folder each call (a warm machine keeps /tmp: packages of an earlier call's wheels would stay importable)
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python -c "import attnlab" 2>/dev/null || export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# A cache carried from another machine, as split parts (tcache.tar.xz.part-aa, -ab, ...) in .tcache-in/
ls .tcache-in/tcache.tar.xz.part-* >/dev/null 2>&1 && cat .tcache-in/tcache.tar.xz.part-* | tar xJf - -C "$TRITON_CACHE_DIR" && echo "triton cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) restored"
# the versions these results come from (pyproject.toml gives the range attnlab supports: carry wheels for others)
python - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
print("versions:", ", ".join(f"{n} {version(n)}" for n in ("torch", "triton", "transformers", "peft", "accelerate", "flash-linear-attention")))
PY
# `limited LIMIT CMD...`: CMD in a session of its own, interrupted after LIMIT seconds and killed 20 s later together with
# everything it started (torchrun's workers, a test's subprocesses): `timeout` signals its own child only, and a worker
# left running keeps the pipe to tee open until the call's own limit. Exit status 124 where the limit stopped it.
limited() { local limit=$1; shift; local mark; mark=$(mktemp)
  setsid "$@" & local pid=$!  # a background job of this shell leads no group, so setsid runs CMD itself, as $pid
  ( sleep "$limit"; echo stopped > "$mark"; kill -INT -- -"$pid"; sleep 20; kill -KILL -- -"$pid" ) >/dev/null 2>&1 & local watch=$!
  wait "$pid"; local rc=$?
  kill "$watch" 2>/dev/null; pkill -P "$watch" 2>/dev/null
  [ -s "$mark" ] && rc=124; rm -f "$mark"; return $rc; }
# `return_cache`: Triton's cache into $RESULTS as split parts (tcache.tar.xz.part-aa, ...; carry them back as .tcache-in/),
# after every stage, so that a call stopped at its own limit still returns the autotuning its finished stages paid for.
# Only the binaries and their metadata are needed to reuse a kernel: the IR (ttir, ttgir, llir, ptx, source), three
# quarters of the cache, is left out, and so are Inductor's own kernels (triton_poi_*, triton_per_*, triton_red_*), which
# come back with the graphs it compiles again on another machine; the cache itself keeps both for the later stages.
# RETURN_CACHE=0 returns none: for all but the last of several gpu.sh runs in one call (each into an OUT of its own), as
# the device returns a limited number of files and every copy of the cache is several.
return_cache() { [ "${RETURN_CACHE:-1}" = 1 ] || return 0; local skip=() d parts; parts=$(mktemp -d "${TMPDIR:-/tmp}/tcache-parts.XXXXXX")
  for d in "$TRITON_CACHE_DIR"/*/; do
    [ -d "$d" ] && ls "$d" | grep -q '^triton_\(poi\|per\|red\|tem\)_' && skip+=(--exclude="./$(basename "$d")")
  done
  tar cf - -C "$TRITON_CACHE_DIR" --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' \
      --exclude='*.source' "${skip[@]}" . | xz -T0 -6 | split -b 15M - "$parts/tcache.tar.xz.part-" \
    && rm -f "$RESULTS"/tcache.tar.xz.part-* && mv "$parts"/tcache.tar.xz.part-* "$RESULTS"/
  rm -rf "$parts"; }
run() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$SECONDS
  limited "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; local rc=$?; echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  return_cache; bundle; }
AL="python -m attnlab.cli"
for stage in "$@"; do case $stage in
  tests) run tests "${TESTS_LIMIT:-570}" python -m pytest -v -p no:cacheprovider --tb=short -rfs --durations=15 -m cuda -n "${TEST_WORKERS:-6}" ${TEST_FILES:-tests}
    grep -E "passed|failed" "$OUT/tests.log" | tail -1 | sed 's/^/CUDA tests: /' | tee -a "$OUT/summary.txt" ;;
  accuracy) run accuracy 300 python benchmarks/fused_projection_accuracy.py ;;
  train) run train "${TRAIN_LIMIT:-240}" $AL bench train --shape 8x2048 --steps 6 --warmup 2 --profile --out "$OUT/train-8x2048.json" ;;
  train-gla) run train-gla "${TRAIN_LIMIT:-240}" $AL bench train --model attnlab-gla --model attnlab-gla-eager --model fla-gla --shape 8x2048 --steps 6 --warmup 2 --profile --saved --out "$OUT/train-gla-8x2048.json" ;;
  zoo) run zoo "${ZOO_LIMIT:-580}" $AL bench zoo ${ZOO_ARGS:-} --out "$OUT/zoo.json"
    # the plot of the rows measured, also when the limit stopped the run before its end
    [ -f "$OUT/zoo.json" ] && python -c "import json,sys; from pathlib import Path; from attnlab.bench.plot import plot_zoo; p=Path(sys.argv[1]); print('wrote', plot_zoo(json.loads(p.read_text()), p.with_suffix('.png')))" "$OUT/zoo.json" ;;
  zoo-long) LONG_ZOO="$AL bench zoo --skip-ops --steps 3 --warmup 1"
    run zoo-long-family "${ZOO_LONG_LIMIT:-300}" $LONG_ZOO $(printf -- '--model %s ' ${ZOO_LONG_MODELS:-2mamba linear__output_norm linear_elu}) \
      --shape 1x16384 --shape 1x32768 --shape 1x65536 --shape 4x4096 --shape 16x1024 --out "$OUT/zoo-long-family.json"
    run zoo-long-peers "${ZOO_PEERS_LIMIT:-150}" $LONG_ZOO --model mamba2 --model hf-llama --shape 1x16384 --shape 1x32768 \
      --shape 1x65536 --out "$OUT/zoo-long-peers.json"
    [ "${ZOO_LONG_MEDIUM:-1}" = 1 ] && run zoo-long-medium "${ZOO_MEDIUM_LIMIT:-100}" $LONG_ZOO --hidden 1536 --layers 27 --heads 24 --intermediate 3072 \
      --model 2mamba --model hf-llama --shape 2x8192 --out "$OUT/zoo-long-medium.json"
    python benchmarks/long_context_targets.py "$OUT"/zoo-long-*.json | tee -a "$OUT/summary.txt" ;;
  medium-profile)  # the paper's medium model at 2 x 8192, as zoo-long's medium row builds it: one step of each under the profiler
    run medium-profile "${MEDIUM_PROFILE_LIMIT:-240}" $AL bench train $(printf -- '--model %s ' ${MEDIUM_PROFILE_MODELS:-attnlab-2mamba-eager hf-llama}) \
      --hidden 1536 --layers 27 --heads 24 --intermediate 3072 --shape 2x8192 --steps 3 --warmup 1 --profile --out "$OUT/medium-profile.json" ;;
  chunk-ncu)  # Nsight Compute on one forward and backward of 2mamba's chunked mixing (the second of two): where each kernel waits
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    run chunk-ncu "${NCU_LIMIT:-240}" "$NCU" --clock-control none \
      --kernel-name regex:'^(_chunk_kernel|_pass_kernel|_output_kernel|_dq_kernel|_dkdv_kernel)$' \
      --launch-skip "${NCU_PER_STEP:-11}" --launch-count "${NCU_PER_STEP:-11}" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --metrics "$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard short_scoreboard \
        barrier mio_throttle math_pipe_throttle wait not_selected selected lg_throttle dispatch_stall no_instruction \
        membar branch_resolving sleeping drain tex_throttle misc | sed 's/,$//')" python benchmarks/attention_family_chunk.py --bare --shape "${NCU_SHAPE:-2x8192}" --heads "${NCU_HEADS:-24}" ;;
  chunk-crossover) run chunk-crossover "${CROSSOVER_LIMIT:-480}" python benchmarks/attention_family_chunk.py ${CROSSOVER_ARGS:-} ;;
  memory) if [ "${MEMORY_SEPARATE:-0}" = 1 ] && [ -n "${MEMORY_MODELS:-}" ]; then  # each model in a process of its own
      run memory "${MEMORY_LIMIT:-300}" bash -c 'for m in $1; do python benchmarks/memory_peak.py --model "$m" --shape "$2" "${@:3}"; done' _ \
        "$MEMORY_MODELS" "${MEMORY_SHAPE:-1x32768}" ${MEMORY_ARGS:-}
    else
      run memory "${MEMORY_LIMIT:-300}" python benchmarks/memory_peak.py \
        ${MEMORY_MODELS:+$(printf -- '--model %s ' $MEMORY_MODELS)} --shape "${MEMORY_SHAPE:-1x32768}" ${MEMORY_ARGS:-}
    fi ;;
  chunk-profile) run chunk-profile "${PROFILE_LIMIT:-120}" python benchmarks/attention_family_chunk.py --profile --shape "${PROFILE_SHAPE:-1x65536}" ;;
  prefill) run prefill "${PREFILL_LIMIT:-240}" python benchmarks/prefill_scaling.py \
      $(printf -- '--arch %s ' ${PREFILL_ARCHS:-attnlab-2mamba attnlab-linear__output_norm attnlab-linear_elu attnlab-mamba2})
    grep -E "proportional" "$OUT/prefill.log" | tee -a "$OUT/summary.txt" ;;
  chunk-blocks) run chunk-blocks "${BLOCKS_LIMIT:-240}" python benchmarks/attention_family_chunk.py --sweep --shape "${BLOCKS_SHAPE:-1x65536}" ${BLOCKS_ARGS:-} ;;
  zoo-nsa) run zoo-nsa "${ZOO_LIMIT:-580}" $AL bench zoo --skip-ops --layers 12 --model nsa --model fla-nsa --model hf-llama \
    --mixer-option nsa.block_size=64 --mixer-option nsa.block_counts=16 --mixer-option nsa.window_size=512 \
    $(printf -- '--shape %s ' ${NSA_SHAPES:-2x2048 1x8192}) --out "$OUT/zoo-nsa.json" ;;
  zoo-nsa-stats) run zoo-nsa-stats "${ZOO_LIMIT:-580}" $AL bench zoo --skip-ops --layers 12 --model nsa --model nsa-stats \
    --mixer-option nsa.block_size=64 --mixer-option nsa.block_counts=16 --mixer-option nsa.window_size=512 \
    --shape 2x2048 --shape 1x8192 --steps 10 --out "$OUT/zoo-nsa-stats.json" ;;
  prof-mamba2|prof-eager)  # eager steps under torch's profiler: Mamba-2 and GLA at 4x4096, or PROF_EAGER_MODELS at EAGER_SHAPE
    if [ $stage = prof-mamba2 ]; then models="attnlab-mamba2-eager attnlab-gla-eager" shape=4x4096
    else models=${PROF_EAGER_MODELS:-attnlab-2mamba-eager attnlab-gla-eager hf-llama} shape=${EAGER_SHAPE:-9x1024}; fi
    run $stage "${TRAIN_LIMIT:-300}" $AL bench train $(printf -- '--model %s ' $models) --layers 20 --heads 16 \
      --shape "$shape" --steps 4 --warmup 2 --profile --out "$OUT/$stage.json" ;;
  sweep-mamba2) run sweep-mamba2 "${SWEEP_LIMIT:-300}" python benchmarks/mamba2_kernels.py --shape 4x4096 --shape 16x1024 ;;
  zoo-mamba2) run zoo-mamba2 "${ZOO_LIMIT:-580}" $AL bench zoo --skip-ops --model mamba2 --model gla --shape 16x1024 --shape 4x4096 --out "$OUT/zoo-mamba2.json" ;;
  eager) run eager "${EAGER_LIMIT:-450}" python benchmarks/eager_host.py --shape "${EAGER_SHAPE:-9x1024}" ${EAGER_COMPILED:+--compiled} ${EAGER_STACK:+--stack} ${EAGER_STACK_CPP:+--stack-cpp} ${EAGER_STACK_WITH:+$(printf -- '--stack-with %s ' $EAGER_STACK_WITH)} ${EAGER_TRACED:+--traced} ${EAGER_WHOLE:+--whole} \
    $(printf -- '--model %s ' ${EAGER_MODELS:-2mamba softmax mamba2 nsa 2mamba-e gated_softmax linear__output_norm gla hf-llama}) --out "$OUT/eager.json" ;;
  traced-blocks) run traced-blocks "${TRACED_LIMIT:-300}" python benchmarks/traced_blocks.py ${TRACED_ARGS:-} ${TRACED_CODE:+--code-dir "$OUT/inductor-code"} \
    $(printf -- '--model %s ' ${TRACED_MODELS:-2mamba softmax mamba2 nsa 2mamba-e gated_softmax linear__output_norm gla}) --out "$OUT/traced-blocks${TRACED_TAG:-}.json" ;;
  compile-breaks) run compile-breaks "${BREAKS_LIMIT:-420}" python benchmarks/compile_breaks.py ${BREAKS_ARGS:-} --out "$OUT/compile-breaks.json" ;;
  fsdp-capture)  # benchmarks/fsdp_capture.py on FSDP_CAPTURE_GPUS GPUs (default 2) for each of FSDP_CAPTURE_MODELS
    for model in ${FSDP_CAPTURE_MODELS:-attnlab-2mamba hf-llama}; do
      run "fsdp-capture-$model" "${FSDP_CAPTURE_LIMIT:-150}" torchrun --standalone --nproc_per_node "${FSDP_CAPTURE_GPUS:-2}" \
        benchmarks/fsdp_capture.py --model "$model" --deadline "$(( ${FSDP_CAPTURE_LIMIT:-150} - 20 ))" ${FSDP_CAPTURE_ARGS:-}
      grep -E "^\[rank 0\].*(captured;|FAILED)|deadline" "$OUT/fsdp-capture-$model.log" | tee -a "$OUT/summary.txt"
    done ;;
  fsdp) run fsdp "${FSDP_LIMIT:-400}" python -m pytest -q -p no:cacheprovider --tb=short -rfs -m cuda ${FSDP_K:+-k "$FSDP_K"} tests/test_distributed.py ;;
  ddp-ctas)  # NCCL_DEBUG_FILE: NCCL's log apart from the table, one file per process
    run ddp-ctas "${DDP_CTAS_LIMIT:-480}" env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV NCCL_DEBUG_FILE="$OUT/ddp-ctas-nccl.%h.%p.log" \
      torchrun --standalone --nproc_per_node "${DDP_GPUS:-2}" benchmarks/ddp_capture.py $(printf -- "--model %s " ${DDP_MODELS:-attnlab-2mamba-e attnlab-gla}) \
      $(printf -- '--nccl-max-ctas %s ' ${DDP_CTAS:-2 4 8 16})
    sed -n '/^model .*max CTAs/,$p' "$OUT/ddp-ctas.log" | tee -a "$OUT/summary.txt"
    # the communicators in the order they were made: the default group's, then one per cap
    for f in "$OUT"/ddp-ctas-nccl.*.log; do [ -f "$f" ] || continue
      echo "ddp-ctas: NCCL coll channels per communicator, ${f##*/} (NCCL's own choice, then ${DDP_CTAS:-2 4 8 16}):" \
        $(grep -o '[0-9]* coll channels' "$f" | cut -d' ' -f1)
    done | tee -a "$OUT/summary.txt" ;;
  scale|scale[2-9])  # scaleN: SCALEN_MODELS, SCALEN_GPUS, SCALEN_ARGS and SCALEN_LIMIT where set, else scale's own
    name=$stage; n=${stage#scale}; m=SCALE${n}_MODELS g=SCALE${n}_GPUS a=SCALE${n}_ARGS l=SCALE${n}_LIMIT
    models=${!m:-${SCALE_MODELS:-2mamba hf-llama}}; gpus=${!g:-${SCALE_GPUS:-}}; if [ -n "${!a+set}" ]; then args=${!a}; else args=${SCALE_ARGS---no-ckpt}; fi
    run $name "${!l:-${SCALE_LIMIT:-580}}" $AL bench scale $(printf -- '--model %s ' $models) \
    ${gpus:+$(printf -- '--gpus %s ' $gpus)} $args --out "$OUT/$name.json"
    # the table and plot of the runs measured, when the limit stopped the bench before it wrote them
    [ "$OUT/$name.json" -nt "$OUT/$name.png" ] && python -c "import json,sys; from pathlib import Path; from rich.console import Console; from attnlab.bench.scale import results_table; from attnlab.bench.plot import plot_scale; p=Path(sys.argv[1]); r=json.loads(p.read_text()); Console(width=200).print(results_table(r)[0]); print('wrote', plot_scale(r, p.with_suffix('.png')))" "$OUT/$name.json" ;;
  long) run long "${LONG_LIMIT:-240}" $AL bench train --model attnlab-gla --model hf-llama --shape 2x8192 --shape 1x16384 --steps 5 --warmup 2 --out "$OUT/train-long.json" ;;
  decode-zoo)
    for arch in ${DECODE_ARCHS:-attnlab-softmax hf-llama attnlab-nsa attnlab-2mamba-e attnlab-gated_softmax attnlab-mamba2 attnlab-2mamba attnlab-linear__output_norm attnlab-linear_elu attnlab-gla}; do
      case $arch in attnlab-softmax) hf="--hf-arch hf-llama";; hf-llama) hf="";; *) hf="--no-hf";; esac
      run "decode-$arch" "${DECODE_LIMIT:-240}" $AL bench decode --arch "$arch" $hf --hidden 1024 --layers 20 --heads 16 --batch-size 8 \
        --prompt-len 2048 --new-tokens 256 --repeats 2 --hf-repeats 1 --beams 4 --profile --out "$OUT/decode-$arch.json"
    done
    python - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
print(f"{'model':34s} {'new tok/s':>10s} {'step ms':>8s} {'kernels':>8s} {'peak GiB':>9s} {'HF tok/s':>9s} {'speed-up':>9s} {'beam/greedy':>12s}")
for path in sorted(Path(sys.argv[1]).glob("decode-*.json")):
    data = json.loads(path.read_text())
    for r in data["results"]:
        print(f"{path.stem.removeprefix('decode-'):34s} {r['attnlab_new_tok_per_s']:>10,.0f} {r.get('graph_step_ms', float('nan')):>8.3f} "
              f"{r.get('step_kernels', 0):>8d} {r.get('peak_gib', float('nan')):>9.2f} {r.get('hf_generate_new_tok_per_s', float('nan')):>9.1f} {r.get('speedup', float('nan')):>9.2f} "
              f"{r.get('beam_cost_ratio', float('nan')):>12.2f}")
PY
    ;;
  decode) run decode "${DECODE_LIMIT:-240}" $AL bench decode --arch attnlab-gla --hf-arch fla-gla --batch-size 8 --prompt-len 2048 --new-tokens 256 --repeats 2 --hf-repeats 1 --beams 4 --profile --out "$OUT/decode-8x2048.json" ;;
  train-run)  # `attnlab train` itself, the bench model's shape on the built-in corpus, with and without CUDA graphs
    for graphs in true false; do
      run "train-run-graphs-$graphs" "${RUN_LIMIT:-200}" $AL train --run-dir "$OUT/run-graphs-$graphs" --set model.hidden_size=1024 \
        --set model.num_layers=24 --set model.num_heads=4 --set model.intermediate_size=2816 --set model.tie_word_embeddings=false \
        --set data.seq_len=2048 --set train.batch_size=8 --set train.max_steps=40 --set train.log_every=5 --set train.eval_every=0 \
        --set train.save_every=0 --set train.sample_tokens=0 --set train.lr=1e-3 --set train.warmup_steps=10 --set "train.cuda_graphs=$graphs"
      python -c "import csv,statistics,sys; r=[float(x['tokens_per_s']) for x in csv.DictReader(open(sys.argv[1])) if x.get('tokens_per_s')][1:]; print('attnlab train, cuda_graphs=$graphs: median tokens/s', round(statistics.median(r)), 'over', len(r), 'logs')" "$OUT/run-graphs-$graphs/metrics.csv" | tee -a "$OUT/summary.txt"
    done ;;
  recall) R=$OUT/recall
    if [ "${RECALL_TINY:-0}" = 1 ]; then  # the same commands on CPU at toy size
      where=(--parallel 2); toy=(--set model.hidden_size=32 --set model.num_heads=2 --set train.max_steps=6 --set train.batch_size=4
        --set train.warmup_steps=0 --set train.save_every=3 --set train.device=cpu --set data.mqar.vocab_size=256 --set eval.every=0
        --set "eval.tasks=[{task: mqar, limit: 8}]")
      niah_model=(--set model.hidden_size=64 --set model.num_layers=2 --set model.num_heads=2 --set model.max_position_embeddings=2048
        --set train.device=cpu); niah=(--lengths 1k,2k --depths 0,1 --samples 1)
    else
      where=(--gpus "${RECALL_GPUS:-$(nvidia-smi -L | awk '{print NR - 1}' | paste -sd,)}" --per-gpu "${RECALL_PER_GPU:-21}"); toy=()
      niah_model=(--set model.hidden_size=1024 --set model.num_layers=24 --set model.num_heads=16 --set model.max_position_embeddings=8192
        --set train.cuda_graphs=false); niah=(--lengths 1k,2k,4k,6k,8k --depths 0,0.25,0.5,0.75,1 --samples 20)
    fi
    suite_s=0; if [ "${RECALL_SUITE:-1}" = 1 ]; then
      t0=$SECONDS
      if [ "${RECALL_DECAY_BIAS:-0}" = 1 ]; then  # beside the suite: 2mamba and 2mamba-e with mixer_options.decay_bias
        only=(); for l in 128 256 512; do for m in 2mamba 2mamba-e; do only+=(--only "len$l-$m"); done; done
        bias_where=("${where[@]}"); [ "${RECALL_TINY:-0}" = 1 ] || bias_where[3]=${RECALL_BIAS_PER_GPU:-3}
        run recall-decay-bias "${RECALL_LIMIT:-330}" $AL sweep recall "${bias_where[@]}" ${toy[@]+"${toy[@]}"} "${only[@]}" \
          --set "model.mixer_options={decay_bias: true}" --out-dir "$R/decay-bias" &
      fi
      if [ "${RECALL_SPLIT:-0}" = 1 ]; then  # GPU 0 the 128- and 256-token jobs, GPU 1 the 512-token ones, side by side:
        # what one GPU takes for the suite is the sum of the two walls (each GPU with half of a two-GPU host's cores)
        short=(); long=(); for m in softmax 2mamba 2mamba-e mamba2 gla nsa linear__output_norm; do
          short+=(--only "len128-$m" --only "len256-$m"); long+=(--only "len512-$m"); done
        ( t1=$SECONDS; run recall-suite-short "${RECALL_LIMIT:-330}" $AL sweep recall --gpus 0 --per-gpu 14 ${toy[@]+"${toy[@]}"} "${short[@]}" --out-dir "$R/runs"
          echo $((SECONDS - t1)) > "$R/runs.wall" ) &
        ( t1=$SECONDS; run recall-suite-512 "${RECALL_LIMIT:-330}" $AL sweep recall --gpus 1 --per-gpu 7 ${toy[@]+"${toy[@]}"} "${long[@]}" --out-dir "$R/runs-512"
          echo $((SECONDS - t1)) > "$R/runs-512.wall" ) &
      else
        run recall-suite "${RECALL_LIMIT:-330}" $AL sweep recall "${where[@]}" ${toy[@]+"${toy[@]}"} --out-dir "$R/runs"
      fi
      wait; suite_s=$((SECONDS - t0))
      [ -d "$R/runs-512" ] && run recall-report-suite 120 $AL report "$R/runs" "$R/runs-512" --out "$OUT/recall-report-suite.html"
      for d in runs runs-512 decay-bias; do
        [ -d "$R/$d" ] || continue
        [ -d "$R/runs-512" ] && [ $d != decay-bias ] || run "recall-report-$d" 120 $AL report "$R/$d" --out "$OUT/recall-report-$d.html"
        find "$R/$d" -mindepth 2 -maxdepth 2 -type d \( -name checkpoints -o -name final \) -exec rm -rf {} +  # weights: not brought back
      done
    fi
    niah_s=0; if [ "${RECALL_NIAH:-1}" = 1 ]; then
    # the model is saved as attnlab saves every model: one step at lr 1e-9 leaves its random initialisation as it was
    run recall-niah-model 240 $AL train --run-dir "$R/niah-model" --set model.mixer=softmax "${niah_model[@]}" --set data.seq_len=128 \
      --set train.batch_size=1 --set train.max_steps=1 --set train.lr=1e-9 --set train.warmup_steps=0 --set train.eval_every=0 \
      --set train.save_every=0 --set train.sample_tokens=0
    t0=$SECONDS; run recall-niah "${NIAH_LIMIT:-240}" $AL eval "$R/niah-model" --task niah "${niah[@]}" -o "$R/niah"; niah_s=$((SECONDS - t0))
    rm -rf "$R/niah-model"  # a random initialisation of 300M parameters
    fi
    python - "$R" "$suite_s" "$niah_s" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
from attnlab.report.load import load_runs
from attnlab.report.recall import mqar_rows, mqar_series
root, suite_s, niah_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for dirs, what in ((("runs", "runs-512"), "the suite"), (("decay-bias",), "mixer_options.decay_bias=true")):
    dirs = [root / d for d in dirs if (root / d).is_dir()]
    header, rows = mqar_rows(mqar_series(load_runs(dirs))) if dirs else ([], [])
    if not rows:
        continue
    print(f"MQAR accuracy (per query, held-out sequences) by mixer and sequence length: {what}")
    print(" ".join(f"{h:>20s}" if i == 0 else f"{h:>7s}" for i, h in enumerate(header)))
    for row in rows:
        print(" ".join(f"{c:>20s}" if i == 0 else f"{c:>7s}" for i, c in enumerate(row)))
    for d in dirs:
        sweep = json.loads((d / "sweep.json").read_text()) if (d / "sweep.json").is_file() else {}
        done = sum(j.get("state") == "finished" for j in sweep.get("jobs", []))
        wall = (root / f"{d.name}.wall").read_text().strip() if (root / f"{d.name}.wall").is_file() else suite_s
        print(f"{what}, {d.name}: {done}/{len(sweep.get('jobs', []))} runs finished in {wall} s wall")
metrics = root / "niah" / "metrics.json"
niah = json.loads(metrics.read_text()).get("metrics", {}) if metrics.is_file() else {}
if niah: print(f"niah: {niah.get('examples', '?')} prompts, 1k-8k tokens, in {niah_s} s wall (generation {niah.get('generation_s', float('nan')):.1f} s), "
      f"accuracy {niah.get('accuracy', float('nan')):.3f} (a random model: only the time means anything)")
PY
    ;;
  before-after)  # the same compact zoo and decode runs on this tree and on BASE_TREE (an export of an earlier commit:
    # git archive REV | tar -x -C DIR), one after the other on one machine; a table of both and their ratio
    for side in base head; do
      if [ "$side" = base ]; then
        [ -d "${BASE_TREE:-}/src/attnlab" ] || { echo "before-after: BASE_TREE=${BASE_TREE:-} holds no src/attnlab"; continue; }
        pp=/tmp/site:$(cd "$BASE_TREE" && pwd)/src
      else
        pp=${PYTHONPATH:-}:$PWD/src
      fi
      run "ba-zoo-$side" "${BA_ZOO_LIMIT:-240}" env PYTHONPATH="$pp" python -m attnlab.cli bench zoo --skip-ops --steps 4 --warmup 2 \
        --model gla --model mamba2 --model softmax --model nsa --model 2mamba --shape 4x4096 --out "$OUT/ba-zoo-$side.json"
      run "ba-decode-$side" "${BA_DECODE_LIMIT:-120}" env PYTHONPATH="$pp" python -m attnlab.cli bench decode --arch attnlab-2mamba --no-hf \
        --hidden 1024 --layers 20 --heads 16 --batch-size 8 --prompt-len 2048 --new-tokens 256 --repeats 2 --out "$OUT/ba-decode-$side.json"
    done
    python - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def read(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else {}
base, head = read("ba-zoo-base.json").get("train", {}), read("ba-zoo-head.json").get("train", {})
print(f"{'training tokens/s, 4x4096':34s} {'base':>9s} {'head':>9s} {'head/base':>9s}")
for key in sorted(set(base) | set(head)):
    b, h = base.get(key, {}).get("tokens_per_s"), head.get(key, {}).get("tokens_per_s")
    ratio = f"{h / b:.3f}" if b and h else ""
    print(f"{key:34s} {b or '':>9} {h or '':>9} {ratio:>9s}")
dec = {side: (read(f"ba-decode-{side}.json").get("results") or [{}])[0].get("attnlab_new_tok_per_s") for side in ("base", "head")}
if dec["base"] and dec["head"]:
    print(f"{'decode attnlab-2mamba, new tok/s':34s} {dec['base']:>9} {dec['head']:>9} {dec['head'] / dec['base']:>9.3f}")
PY
    ;;
  *) echo "unknown stage $stage" ;;
esac; done
ls "$RESULTS"/tcache.tar.xz.part-* >/dev/null 2>&1 || return_cache  # each stage returned it as it ended
echo "triton cache returned: $(cat "$RESULTS"/tcache.tar.xz.part-* | wc -c) bytes compressed"
bundle
ls -la "$RESULTS"
cat "$OUT/summary.txt"
