#!/usr/bin/env bash
# The TPU battery, on a TPU VM with the project's dependencies and Tunix installed (a Cloud TPU VM:
# pip install -e ".[tpu,test]" and, for the Tunix side, ".[bench-tunix]" plus qwix; the lent v5e
# machine: ../shared/tpu/README.md). Each part writes its logs and JSON under $OUT (default
# runs/tpu); run the parts that fit the time you have:
#
#   bash tools/bench/tpu.sh tests      # python -m pytest -m tpu (the TPU test tier)
#   bash tools/bench/tpu.sh small      # ours vs Tunix, tiny and medium, SFT and DPO, bfloat16
#   bash tools/bench/tpu.sh large      # the ~1 B full fine-tune (2,048-token rows) and gemma_2b LoRA
#   bash tools/bench/tpu.sh sampler    # decoding at gemma_2b's size, batch 16 / 64, 256 new tokens
#   bash tools/bench/tpu.sh profile    # where the ~1 B SFT step's time goes, and variants of it
#   bash tools/bench/tpu.sh compile    # the steps' compile time cold, then warm from JAX's cache
#   bash tools/bench/tpu.sh headline   # the README's SimPO command on a LIKE-shaped preset (default
#                                      # gemma_2b): start-up cold / warm, steps after saves, HBM
#
# Then, here: python -m tools.bench.record_tpu $OUT (results/bench_tpu*.json, the docs' tables).
set -uo pipefail
OUT=${OUT:-runs/tpu}
mkdir -p "$OUT"
PY=$(command -v python3)
bench() { python -m tools.bench --device tpu --dtype bfloat16-params --tunix-python "$PY" "$@"; }
for part in "$@"; do
  start=$(date +%s)
  case "$part" in
    tests)
      python -m pytest -m tpu -q -p no:cacheprovider -o addopts="" tests/test_tpu.py \
        --junitxml "$OUT/pytest_tpu.xml" 2>&1 | tee "$OUT/pytest_tpu.log" ;;
    small)
      bench --sizes tiny,medium --cases sft,dpo --steps 10 --warmup 2 \
        --json "$OUT/bench_small.json" 2>&1 | tee "$OUT/bench_small.log" ;;
    large)
      bench --sizes gemma_1b --cases sft,dpo --steps 6 --warmup 1 --checkpoint-probe 3 \
        --json "$OUT/bench_1b.json" 2>&1 | tee "$OUT/bench_1b.log"
      bench --sizes gemma_2b --cases sft_lora,dpo_lora --steps 6 --warmup 1 --checkpoint-probe 3 \
        --json "$OUT/bench_2b_lora.json" 2>&1 | tee "$OUT/bench_2b_lora.log" ;;
    sampler)
      for t in 0 1.0; do for b in 16 64; do
        python -m tools.bench.sampler --spec gemma_2b --device tpu --tunix-python "$PY" \
          --batch $b --new-tokens 256 --prompt-len 64 --repeats 3 --temperature $t \
          --json "$OUT/sampler_b${b}_t${t}.json" 2>&1 | tee "$OUT/sampler_b${b}_t${t}.log"
      done; done ;;
    profile)  # VARIANTS: name=ours.py's options;... (each: its log with the breakdown, a .tgz)
      spec=$(python -c 'import json; from tools.bench.run import spec_of; print(json.dumps(spec_of("gemma_1b")))')
      IFS=';' read -ra variants <<< "${VARIANTS:-default=}"
      for v in "${variants[@]}"; do
        name=${v%%=*}; read -ra extra <<< "${v#*=}"
        python -m tools.bench.ours --spec "$spec" --case "${CASE:-sft}" --device tpu \
          --dtype bfloat16-params --steps 4 --warmup 1 --profile 2 --trace-out "$OUT/prof_$name" \
          "${extra[@]}" 2>&1 | tee "$OUT/prof_$name.log"
        tar czf "$OUT/prof_$name.tgz" -C "$OUT" "prof_$name.log" "prof_$name.trace.json.gz" \
          "prof_$name.hlo.txt" 2>/dev/null && rm -f "$OUT/prof_$name".{log,trace.json.gz,hlo.txt}
      done ;;
    compile)  # each case twice in a fresh process over one new persistent cache: cold, warm
      cache=$(mktemp -d)
      for c in ${COMPILE_CASES:-gemma_1b:sft gemma_2b:dpo_lora}; do
        spec=$(python -c "import json, sys; from tools.bench.run import spec_of; print(json.dumps(spec_of(sys.argv[1])))" "${c%%:*}")
        for t in cold warm; do
          log="$OUT/compile_${c%%:*}--${c#*:}_$t.log"  # JAX_LOG_COMPILES: cache hits named
          JAX_LOG_COMPILES=1 JAX_COMPILATION_CACHE_DIR=$cache python -m tools.bench.ours \
            --spec "$spec" --case "${c#*:}" --device tpu --dtype bfloat16-params --steps 2 \
            --warmup 1 > "$log" 2>&1
          grep "^BENCH_RESULT" "$log" | sed "s/^BENCH_RESULT //" \
            > "$OUT/compile_${c%%:*}--${c#*:}_$t.json"
        done
      done ;;
    headline)
      for like in ${LIKE:-gemma_2b}; do
        python -m tools.bench.headline --like "$like" --out "$OUT" \
          --work "${TMPDIR:-/tmp}/headline" ${HEADLINE_ARGS:-} 2>&1 \
          | tee "$OUT/headline_$like.out"
      done ;;
    *) echo "unknown part $part (tests, small, large, sampler, profile, compile, headline)"; exit 2 ;;
  esac
  echo "tpu.sh: $part took $(( $(date +%s) - start )) s" | tee -a "$OUT/parts.log"
done
