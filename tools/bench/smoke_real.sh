#!/usr/bin/env bash
# The README headline command, DPO and GRPO on real-size presets with random weights, offline.
# Not in CI: minutes per run and ~15 GB of memory for gemma_2b (run one configuration at a time;
# check `free -g` first). Writes results/smoke_real_<like>.json; `python -m tools.results` then
# renders the README's table.
#
#   bash tools/bench/smoke_real.sh                       # gemma_2b, float32 / bfloat16 / bfloat16-params
#   LIKE="llama3.2_1b qwen2.5_0.5b" bash tools/bench/smoke_real.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for like in ${LIKE:-gemma_2b}; do
  python -m tools.bench.smoke_real --like "$like" --record "smoke_real_${like//./_}" "$@"
done
python -m tools.results
