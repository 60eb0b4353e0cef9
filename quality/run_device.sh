#!/usr/bin/env bash
# Train both quality-study models at once, one per GPU if there are two (else sharing one), resumable
# across calls of this workplace's device machine (a call is capped at 10 minutes).
# Usage (repo root, with .whl/fla_core-0.6.0-py3-none-any.whl and .data/corpus/ present):
#   BUDGET_S=585 TOTAL_S=800 bash quality/run_device.sh     # first call: trains, saves state in $KEEP
#   BUDGET_S=420 TOTAL_S=800 bash quality/run_device.sh     # next call on the same (warm) machine: resumes
# ARCHS="kimi" trains one model (on GPU 0); PACK=0 skips packing the checkpoint (a first call).
# Carry .data/triton_autotune.tar (the previous call's $OUT/triton_autotune.tar) to skip fla's autotuning.
# TRAIN_ARGS adds train.py arguments (e.g. "--init checkpoints/kimi-kda-16m --lr 1e-3" for continued training).
# Each call ends with both checkpoints + logs packed in $OUT as one tar split in 15 MB parts
# (returned files are capped at 16 MiB each, 8 files). Elsewhere with fla installed,
# `python quality/train.py --arch qwen35 --minutes 13 --out out/qwen35` (and --arch kimi) is all it takes.
set -u
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-585}))
TOTAL_S=${TOTAL_S:-800}
EVAL_N=${EVAL_N:-500}
KEEP=${KEEP:-/tmp/keep}
ARCHS=${ARCHS:-"qwen35 kimi"}
PACK=${PACK:-1}
OUT=${OUT:-out/device}
mkdir -p "$KEEP" "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -z "${SKIP_INSTALL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv
python3 -c "import fla, transformers, torch, triton; print('fla', fla.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" || exit 1
NGPU=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_CACHE_AUTOTUNING=1
# Triton's autotuning results (fla's kernels keep them on disk: FLA_CACHE_RESULTS) from an earlier call, carried as
# .data/triton_autotune.tar: a fresh machine then compiles only each kernel's chosen configuration instead of timing
# every one (run 8's start-up, data to first step, was 237 s of a 547 s call). Brought back in $OUT each call.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$KEEP/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .data/triton_autotune.tar ] && tar -xf .data/triton_autotune.tar -C "$TRITON_CACHE_DIR" \
  && echo "restored $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l) autotuning results"
I=0; PIDS=""
for A in $ARCHS; do
  mkdir -p $KEEP/$A
  CUDA_VISIBLE_DEVICES=$(( I % NGPU )) python3 quality/train.py --arch $A --minutes 60 --total-train-s $TOTAL_S \
    --state $KEEP/$A.state --out $KEEP/$A --deadline $DEADLINE --eval-n $EVAL_N --require-fla \
    --workers ${WORKERS:-6} ${TRAIN_ARGS:-} >> $KEEP/$A.log 2>&1 &
  PIDS="$PIDS $!"; I=$((I + 1))
done
for P in $PIDS; do wait $P; done
echo "training + eval done at $(( $(date +%s) - START )) s"
rm -f $OUT/*
for A in $ARCHS; do
  cp $KEEP/$A.log $KEEP/$A/stdout.log
  [ -f $KEEP/$A/eval.json ] || echo '{}' > $KEEP/$A/eval.json
done
[ "$PACK" = 1 ] && tar -cf - -C $KEEP $ARCHS | split -b 15000000 -d -a 1 - $OUT/models.tar.part
[ "$PACK" = 1 ] || cp $KEEP/*.log $OUT/
for A in $ARCHS; do
  echo "== $A"
  grep -E '"event": "(start|gradcheck|fla_guard_patched|resumed|train_done|eval|final_eval|saved)"' $KEEP/$A.log | cut -c1-700
  grep '"step"' $KEEP/$A.log | grep -v event | tail -n 1
  grep -E "Error|Traceback" $KEEP/$A.log | head -n 3 && tail -n 25 $KEEP/$A.log
done
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -cf "$OUT/triton_autotune.tar" -T -) \
  && echo "saved $(tar -tf $OUT/triton_autotune.tar | wc -l) autotuning results to $OUT/triton_autotune.tar"
ls -la $OUT
echo "total $(( $(date +%s) - START )) s"
