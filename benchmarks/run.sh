#!/usr/bin/env bash
# Every CPU benchmark in one go (about 30 minutes on 2 cores), side by side
# with torch.distributed.pipelining where it runs the same job. Writes
# $OUT/results.json, $OUT/table.md and $OUT/timeline.png (default OUT:
# out/benchmarks) and prints the table. Run on a quiet machine: every figure
# is a ratio of runs taken in turns, but two ranks need both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/benchmarks}"
mkdir -p "$OUT"
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
export OMP_NUM_THREADS=1
quiet() { grep -v -e "Warning" -e "^W[0-9]" -e "^\*\*\*" -e "OMP_NUM_THREADS" || true; }

echo "== schedules: every built-in schedule on the bundled GPT (2 ranks)"
python benchmarks/schedules.py --json "$OUT/schedules.json" --plot "$OUT/timeline.png" 2>&1 | quiet
echo "== torchmpmd vs torch.distributed.pipelining (2 ranks)"
python benchmarks/compare_pipelining.py --json "$OUT/pipelining.json" 2>&1 | quiet
python benchmarks/compare_pipelining.py --layers 4 --dim 192 --json "$OUT/pipelining_gpt.json" 2>&1 | quiet
echo "== automatic balancing vs every split (2 ranks)"
python benchmarks/balance.py --rounds 9 --json "$OUT/balance.json" 2>&1 | quiet
echo "== mpmd.plan against every built-in schedule, four models (2 ranks)"
# 25 rounds: at 7-9, two runners of one configuration came out 2-10% apart;
# at 25, most pairs within 1% (one U-Net pair still 9%).
python benchmarks/planner.py --rounds 25 --json "$OUT/planner.json" 2>&1 | quiet
echo "== expert parallelism against replicated experts (4 ranks)"
python benchmarks/expert_parallel.py --rounds 9 --json "$OUT/expert_parallel.json" 2>&1 | quiet
echo "== fused F&B tasks, sides at once against parts in order (4 ranks)"
python benchmarks/overlap.py --rounds 9 --json "$OUT/overlap.json" 2>&1 | quiet
python benchmarks/overlap.py --rounds 9 --recompute --json "$OUT/overlap_recompute.json" 2>&1 | quiet
echo "== torchmpmd against torch's DDP, FSDP2 and TP, three models (2 and 4 ranks)"
python benchmarks/mpmd_vs_spmd.py --nproc 2 --rounds 9 --json "$OUT/mpmd_vs_spmd_2.json" 2>&1 | quiet
python benchmarks/mpmd_vs_spmd.py --nproc 4 --rounds 9 --json "$OUT/mpmd_vs_spmd_4.json" 2>&1 | quiet
echo "== 4 ranks on 2 cores: predictions with the shared cores and with every rank busy"
python benchmarks/shared_cores.py --model pipeline-wins --rounds 7 --json "$OUT/shared_cores.json" 2>&1 | quiet
echo "== I + W against B, one stage"
python benchmarks/split_backward.py 2>&1 | quiet | tee "$OUT/split_backward.txt"
python benchmarks/report.py "$OUT"
