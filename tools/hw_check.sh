#!/usr/bin/env bash
# The checks that need a CPU this project's development machine lacks (AVX-512 VNNI, AMX, many cores),
# as one script for a borrowed machine: build in place, run the kernel tests (the real AMX ones run only
# where CPUID and the OS grant AMX), then the kernel benchmarks that decide the open questions:
#   - decode's weight stream against a plain read, per table and thread count (the 90% roofline), with
#     decode's software prefetch as the table sets it and switched the other way (CORELM_DECODE_PREFETCH:
#     Zen 3 needs it, Zen 4 runs faster without it; which does this core want?), and the order the
#     AVX-512 q4/q8 decode reads a block row's groups in (CORELM_DECODE_GROUP_MAJOR; unmeasured on AMD);
#   - the quantized GEMV/GEMM with int8 and int16 activations (what "auto"'s int16 for q8 costs);
#   - bf16 prefill and decode on the best AVX-512 table against CORELM_ISA=amx (the default where AMX runs);
#   - the sparse bf16 weight stream against dense bf16 (does expanding non-zeros pay on this core?);
#   - the AMX GEMMs against the kernel table's.
# Needs python3 with numpy, pybind11 and pytest, cmake and ninja; no network, no model files (the
# benchmarks use random weights in qwen2.5-0.5B's shapes). Builds in build/hw and links python/corelm/_core*.so
# to it. Logs go to $OUT (default ./hw_check_out).
#     bash tools/hw_check.sh [threads, default: all CPUs]
# It took 4 minutes on 2 cores. Every step has a time limit (together about 12 minutes) and the summary is
# written as it goes, so a run stopped early still leaves what it measured.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/hw_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NT=${1:-$(nproc)}
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

log "build ($(date -u +%FT%TZ))"
timeout 60 cmake -S . -B build/hw -G Ninja -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)" \
  > "$OUT/build.log" 2>&1 && timeout 120 ninja -C build/hw >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
so=$(ls build/hw/_core*.so)
ln -sf "../../$so" python/corelm/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

log "machine"
{ lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)|L2|L3"
  $PY -c "from corelm import _core; import json; i = _core.cpu_info(); print(json.dumps({k: i[k] for k in ('features', 'kernel_tables', 'kernels')}, indent=1)); print('AMX:', _core.amx_info())"
} 2>&1 | tee -a "$OUT/summary.txt"
best=$($PY -c "from corelm import _core; print(next(t for t in _core.kernel_tables() if t != 'amx'))")

log "kernel tests"
(cd python && timeout 90 $PY -m pytest ../tests/test_amx.py ../tests/test_kernels.py ../tests/test_bf16_kernels.py \
  ../tests/test_quant.py ../tests/test_sparse_kernels.py -q -p no:cacheprovider -x > "$OUT/tests.log" 2>&1)
tail -3 "$OUT/tests.log" | tee -a "$OUT/summary.txt"

threads="1,$NT"
for pf in 0 1; do
  log "decode's weight stream vs a plain read (kernel/read), threads $threads, CORELM_DECODE_PREFETCH=$pf"
  CORELM_DECODE_PREFETCH=$pf timeout 75 $PY tools/bench/bench_quant.py --stream --dtypes q4,q8,bf16 --activations int8,int16 \
    --threads "$threads" --rounds 2 2>&1 | tee -a "$OUT/summary.txt"
done

for gm in 0 1; do
  log "the AVX-512 q4/q8 decode's block rows side by side (0) or group after group (1): CORELM_DECODE_GROUP_MAJOR=$gm"
  CORELM_DECODE_GROUP_MAJOR=$gm timeout 40 $PY tools/bench/bench_quant.py --stream --dtypes q4,q8 --activations int16 \
    --threads "$threads" --rounds 2 2>&1 | tee -a "$OUT/summary.txt"
done

log "quantized kernels alone, 1 thread, int8 vs int16 activations (m=1: GB/s of weights from cache)"
for m in 1 128; do
  timeout 35 $PY tools/bench/bench_quant.py --gemm --m $m --dtypes q8,q4 --activations int8,int16 --threads 1 \
    --rounds 3 2>&1 | tee -a "$OUT/summary.txt"
done

log "bf16 model (random weights, qwen2.5-0.5B shapes): $best vs amx"
for isa in "$best" amx; do
  if [ "$isa" = amx ] && ! $PY -c "from corelm import _core; exit(0 if _core.amx_available() else 1)"; then
    echo "amx: not available here" | tee -a "$OUT/summary.txt"; continue
  fi
  CORELM_ISA=$isa timeout 40 $PY tools/bench/bench_quant.py --dtypes bf16 --threads "1,$NT" --rounds 3 --tokens 16 2>&1 |
    sed "s/^/$isa: /" | tee -a "$OUT/summary.txt"
done

log "sparse bf16 (sbf16) weight stream against dense bf16, ms per pass (expanding non-zeros: where it pays)"
timeout 60 $PY tools/bench/bench_sparse.py --stream --threads "$threads" --rounds 2 2>&1 | tee -a "$OUT/summary.txt"

if $PY -c "from corelm import _core; exit(0 if _core.amx_available() else 1)"; then
  log "AMX GEMMs vs the kernel table"
  timeout 150 $PY tools/bench/bench_amx.py --ms 1 16 128 --threads 1 "$NT" --rounds 2 --seconds 0.3 2>&1 | tee -a "$OUT/summary.txt"
fi
log "done ($(date -u +%FT%TZ)); logs in $OUT"
