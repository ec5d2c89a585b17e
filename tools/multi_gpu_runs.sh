#!/usr/bin/env bash
# The measurements that need 2 or 4 GPUs, as named slices of under 10 minutes each, so that a
# short session on a multi-GPU machine runs them without composing commands. Each slice writes
# its log and JSON under $OUT (default ./multi_gpu_out); megatron-core comes from .whl/ where it
# is not installed (tools/mcore_path.sh, as for tools/gpu_tests.sh).
#
#   tools/multi_gpu_runs.sh list            # the slices, their GPUs and what each answers
#   tools/multi_gpu_runs.sh 4x-ntp 4x-swap  # run slices in order (each bounded by `timeout`)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
OUT=${OUT:-$PWD/multi_gpu_out}
LIMIT=${SLICE_LIMIT_S:-570}

# name | GPUs | command (run from the repo root; $OUT expanded at run time) | what it answers
SLICES=(
  "2x-refit|2|$py benchmarks/refit.py --preset 3b --out \$OUT/refit_3b_2x.json && $py benchmarks/refit.py --preset 3b --no-naive --no-check-finite --out \$OUT/refit_3b_2x_nocheck.json|export hook colocated ipc-direct/ipc-push and cross-GPU broadcast, re-measured on the final code, with and without the NaN/Inf check (issue 12)"
  "2x-step|2|$py benchmarks/train_step.py --world 2 --variants plain,auto,on --param-gather sync,overlap --symm-mem-bands probe --out \$OUT/train_step_2x.json|symm-mem end to end at 2 ranks: auto (the step A/B) vs on vs plain, DDP (param gather sync/overlapped) + FSDP, 9 jobs, about 7 min (issue 31)"
  "2x-swap|2|$py benchmarks/refit_vs_swap.py --preset 3b --world 2 --timeout-s 270 --out \$OUT/refit_vs_swap_3b_2x.json && $py benchmarks/refit_vs_swap.py --preset 3b --world 2 --methods swap:nccl,ours:stream,ours:atomic --no-check-finite --timeout-s 270 --out \$OUT/refit_vs_swap_3b_2x_nocheck.json|ours vs swap_model_weights on 2 GPUs, at the default auto budget (512 MiB of staging per rank), with and without our NaN/Inf check (137 s for both on 2 of 4xH200) (issues 15, 30, 32)"
  "2x-swap-modes|2|M=swap:nccl,ours:stream,ours:stream-zero-copy,ours:atomic,ours:atomic-zero-copy; $py benchmarks/refit_vs_swap.py --preset 3b --world 2 --methods \$M --timeout-s 250 --out \$OUT/refit_vs_swap_3b_2x_modes.json && $py benchmarks/refit_vs_swap.py --preset moe-3b --world 2 --methods \$M --timeout-s 250 --out \$OUT/refit_vs_swap_moe3b_2x_modes.json|streaming and atomic, staged and zero-copy, vs swap_model_weights at the default budget, dense and MoE on 2 GPUs (about 80 s each on 2 of 4xH200): what decides zero-copy's default (issue 30)"
  "2x-first-refit|2|$py benchmarks/refit_vs_swap.py --preset 3b --world 2 --methods swap:nccl,ours:stream,ours:atomic --first-repeats 5 --iters 3 --timeout-s 300 --out \$OUT/refit_vs_swap_3b_2x_first.json|the first refit against swap's (five cold ones per row, interleaved across the methods) and its set-up's parts, the three dense 2-GPU layouts (two of them took 75 s on 2xH200) (issue 30)"
  "2x-tests-symm|2|tools/gpu_tests.sh -v --durations=0 -k 'fsdp_symm'|gpus(1)/gpus(2) tests, part 1: symmetric memory (DDP, FSDP, policy, train_step benchmark)"
  "2x-tests-training|2|tools/gpu_tests.sh -v --durations=0 -k 'testing or copy_batch or pretrain_torchrun'|gpus(1)/gpus(2) tests, part 2: Megatron training on NCCL, CopyBatch, the training script on 1 GPU"
  "2x-tests-adapters|2|tools/gpu_tests.sh -v --durations=0 -k 'test_engine_adapters'|gpus(1)/gpus(2) tests, part 3: vLLM/SGLang adapters over NCCL and same-GPU (about 1 min on 2xH200)"
  "2x-tests-export|2|tools/gpu_tests.sh -v --durations=0 -k 'test_transports or test_export_multirank or test_fp8_export or test_fp8_refit'|gpus(1)/gpus(2) tests, part 4: export transports, FP8 kernels (about 4 min on 2xH200)"
  "2x-tests-refit|2|tools/gpu_tests.sh -v --durations=0 -k 'refit_processes or megatron_engine or moe_export'|gpus(1)/gpus(2) tests, part 5: refit processes (same-GPU engine over ipc / ipc-direct / ipc-push), the megatron-core engines, MoE export"
  "2x-tests-reshard|2|tools/gpu_tests.sh -v --durations=0 -k 'reshard_exec or reshard_refit or reshard_remote or refit_reshard_benchmark'|gpus(1)/gpus(2) tests, part 6: the reshard refit on NCCL (exact tensors, versions and gate, remote jobs, the benchmark)"
  "4x-ntp|4|$py benchmarks/ntp.py --preset 2b --backend nccl --out \$OUT/ntp_2b_4x.json|NTP (partner design) vs uniform vs drop tokens/s, the partner's transfers %, memory per role, the cost model checked (issue 27)"
  "4x-symm|4|$py benchmarks/symm_mem.py --world 4 --parts collectives --out \$OUT/symm_mem_4x.json|symmetric vs plain collectives at 4 ranks (issue 14 bands)"
  "4x-step|4|$py benchmarks/train_step.py --world 4 --variants plain,auto,on --param-gather sync,overlap --symm-mem-bands probe --out \$OUT/train_step_4x.json|symm-mem end to end at 4 ranks: auto (the step A/B) vs on vs plain and the verdicts (FSDP auto >= +12%, DDP >= +3% or explained), 9 jobs, about 7 min (issue 31)"
  "4x-swap|4|$py benchmarks/refit_vs_swap.py --preset 3b --world 4 --timeout-s 540 --out \$OUT/refit_vs_swap_3b_4x.json|ours vs swap_model_weights, dense, at the default auto budget (issue 15 target >= 1.5x)"
  "4x-swap-moe|4|$py benchmarks/refit_vs_swap.py --preset moe-3b --world 4 --timeout-s 540 --out \$OUT/refit_vs_swap_moe3b_4x.json|ours vs swap_model_weights, MoE EP changes, at the default auto budget (issue 15)"
  "4x-swap-budget|4|$py benchmarks/refit_vs_swap.py --preset 3b --world 4 --methods swap:nccl,ours:stream,ours:stream-zero-copy,ours:atomic-host --memory-budget-mb 512 --timeout-s 540 --out \$OUT/refit_vs_swap_3b_4x_budget.json|ours within a strict 512 MiB staging budget (streaming staged and zero-copy, atomic staged on the host) vs swap_model_weights: extra memory and speed per layout, the targets printed (issue 30)"
  "4x-swap-budget-inflight1|4|$py benchmarks/refit_vs_swap.py --preset 3b --world 4 --methods swap:nccl,ours:stream,ours:stream-zero-copy --memory-budget-mb 512 --max-inflight 1 --timeout-s 540 --out \$OUT/refit_vs_swap_3b_4x_budget_inflight1.json|the same at --refit-max-inflight 1: twice the bytes per op within the budget (faster for TP2 -> TP2 on other GPUs before small pairs had a bucket of their own, not for colocated layouts) (issue 30)"
  "4x-swap-moe-budget|4|$py benchmarks/refit_vs_swap.py --preset moe-3b --world 4 --methods swap:nccl,ours:stream,ours:stream-zero-copy --memory-budget-mb 512 --timeout-s 540 --out \$OUT/refit_vs_swap_moe3b_4x_budget.json|MoE within the 512 MiB budget: streaming staged vs zero-copy vs swap_model_weights (issue 30)"
  "4x-swap-modes|4|M=swap:nccl,ours:stream,ours:stream-zero-copy,ours:atomic,ours:atomic-zero-copy; $py benchmarks/refit_vs_swap.py --preset 3b --world 4 --methods \$M --timeout-s 270 --out \$OUT/refit_vs_swap_3b_4x_modes.json && $py benchmarks/refit_vs_swap.py --preset moe-3b --world 4 --methods \$M --timeout-s 270 --out \$OUT/refit_vs_swap_moe3b_4x_modes.json|the same on 4 GPUs (about 110 s each on 4xH200) (issue 30)"
  "4x-first-refit|4|$py benchmarks/refit_vs_swap.py --preset 3b --world 4 --layouts nc:tp2:tp2,co:tp2pp2:tp1dp4,co:tp4:tp2dp2 --methods swap:nccl,ours:stream,ours:atomic --first-repeats 5 --iters 3 --timeout-s 300 --out \$OUT/refit_vs_swap_3b_4x_first.json|the first refit against swap's (five cold ones per row, interleaved across the methods) and its set-up's parts, three dense layouts (about 100 s on 4xH200) (issue 30)"
  "4x-p2p|4|$py benchmarks/p2p_rounds.py --world 4 --out \$OUT/p2p_rounds_4x.json|NCCL point-to-point GB/s per receiver against the bytes per op (one peer, every peer, ops cut in 16): what bucket and zero-copy op sizes reach the link (issue 30)"
  "4x-reshard|4|$py benchmarks/refit.py --reshard --preset 3b --out \$OUT/refit_reshard_3b_4x.json && $py benchmarks/refit.py --reshard --preset 3b --layout colocated --out \$OUT/refit_reshard_3b_colocated_4x.json|reshard refit cross and colocated re-measured (issue 12)"
  "4x-tests-ntp|4|tools/gpu_tests.sh -v --durations=0 --min-gpus 3 -k 'nonuniform_tp and test_ntp_balance' && tools/gpu_tests.sh -v --durations=0 -k 'test_local_norm and nccl'|gpus(3)/gpus(4) tests, part 1a: NTP NCCL parity with balanced shares (+ SP, distributed optimizer + overlap; 174 s on 4xH200) and the gpus(2) sequence-parallel norm (78 s) (issues 27, 28)"
  "4x-tests-ntp2|4|tools/gpu_tests.sh -v --durations=0 --min-gpus 3 -k 'nonuniform_tp and not test_ntp_balance'|gpus(3)/gpus(4) tests, part 1b: NTP NCCL parity (packed, simulated + distributed optimizer, symmetric staging, the pair exchange; 140 s of tests on 4xH200; the 6-/7-GPU cases skip) (issues 27, 28)"
  "4x-tests-refit|4|tools/gpu_tests.sh -v --durations=0 --min-gpus 3 -k weight_export|gpus(3)/gpus(4) tests, part 2: reshard exec, versions + gate, NTP trainer refit, megatron engine TP2xPP2 -> TP1xDP4 (issues 13, 15)"
  "4x-tests-script|4|tools/gpu_tests.sh -v --durations=0 --min-gpus 3 -k examples|gpus(3)/gpus(4) tests, part 3: the torchrun script, NTP + symmetric memory + export + resume (issue 11)"
)

field() { echo "$1" | cut -d'|' -f"$2"; }

if [ $# -eq 0 ] || [ "$1" = list ]; then
  for s in "${SLICES[@]}"; do printf '%-18s %s GPUs  %s\n' "$(field "$s" 1)" "$(field "$s" 2)" "$(field "$s" 4)"; done
  exit 0
fi

for name in "$@"; do  # every name checked before anything runs
  printf '%s\n' "${SLICES[@]}" | cut -d'|' -f1 | grep -qx "$name" \
    || { echo "error: unknown slice '$name'; '$0 list' shows them." >&2; exit 2; }
done
"$py" -c 'import torch' 2>/dev/null || { echo "error: $py cannot import torch; set PYTHON=" >&2; exit 1; }
source tools/mcore_path.sh
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} OUT
mkdir -p "$OUT"
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
status=0
for name in "$@"; do
  for s in "${SLICES[@]}"; do [ "$(field "$s" 1)" = "$name" ] && slice=$s; done
  need=$(field "$slice" 2)
  if [ "$gpus" -lt "$need" ]; then
    echo "== $name: skipped, needs $need GPUs, this machine has $gpus"; status=1; continue
  fi
  cmd=$(field "$slice" 3)
  echo "== $name ($(date -u +%FT%TZ)): $cmd"
  start=$(date +%s)
  timeout "$LIMIT" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - start )) s (log $OUT/$name.log)"
  tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
done
exit $status
