#!/usr/bin/env bash
# The benchmark on one GPU, ours vs TRL, bfloat16, with model FLOPs utilisation (MFU); < 5 minutes
# on an H100/H200. Needs a CUDA JAX (pip install -U "jax[cuda12]") and a CUDA torch 2.13 in the
# environment instead of the CPU wheel. PEAK_TFLOPS: the GPU's dense bfloat16 peak (H100/H200: 989).
# The Tunix side measures float32 only and is left out here; ATTENTION (default auto: cuDNN flash
# attention where the layer allows, else the XLA formulation) sets our --attention. First the
# cuDNN attention path against float32 (tools.bench.check_gpu): no benchmark of a path that is wrong.
set -euo pipefail
PEAK_TFLOPS="${PEAK_TFLOPS:-989}"
python -m tools.bench.check_gpu
python -m tools.bench --device gpu --dtype bfloat16 --sizes "${SIZES:-medium,gemma_2b}" \
    --cases "${CASES:-sft,dpo}" --sides ours,trl --attention "${ATTENTION:-auto}" \
    --steps 10 --warmup 2 --peak-tflops "$PEAK_TFLOPS" \
    --timeout 240 --json "${JSON:-runs/bench/gpu.json}" "$@"
