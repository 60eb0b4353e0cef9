#!/usr/bin/env bash
# One device call of the quality study: a PIC tune (quality/pic_train.py), then its evaluation on the device
# (quality/eval_pic.py, fp32, several processes sharing the GPU), results and logs in $OUT.
#   MODEL=.data/ckpt_dev/kimi-kda-16m-run12-pic TUNE="--minutes 8 --batch 96 ..." SETS="needle8 twohop8 kc8" \
#     bash quality/device_tune.sh
# MODEL     the checkpoint to start from (carried under .data/, which git ignores)
# TUNE      pic_train.py arguments besides --model/--out/--data/--device; empty: no tune, evaluate MODEL itself
# KEEP      where the tuned weights go ($KEEP/model; default /tmp/kp): a later call on the same warm machine
#           can start from them (MODEL=/tmp/kp/model)
# SETS      evaluation sets (eval_<set>.jsonl under $EVAL_DATA); empty: no evaluation
# SHARDS    processes per set (default 3); N questions per set (default 500); MODES as eval_pic.py's --modes
# TAG       prefix of the result files ($OUT/<TAG>_<set>.jsonl: the set's shards joined)
# DEADLINE  seconds after the start at which the evaluation is stopped (what it wrote comes back)
# DEVICE    cuda (default), or cpu for a dry run of the script
# PACK=1    also bring the weights back (tuned, else MODEL): one tar in 15 MB parts (a returned file is capped at 16 MiB)
# The data: .data/corpus_train (train.bin.xz, meta.json, tokenizer.json of .data/corpus) and .data/corpus_eval
# (eval_<set>.jsonl, tokenizer.json, meta.json), each under the 64 MiB the working tree may carry.
set -u
START=$(date +%s)
OUT=${OUT:-/tmp/out}
KEEP=${KEEP:-/tmp/kp}
TRAIN_DATA=${TRAIN_DATA:-.data/corpus_train}
EVAL_DATA=${EVAL_DATA:-.data/corpus_eval}
SHARDS=${SHARDS:-3}
N=${N:-500}
MODES=${MODES:-full,pic:8,naive:8}
TAG=${TAG:-eval}
DEADLINE=${DEADLINE:-570}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT" "$KEEP"
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ "$DEVICE" != cuda ] || nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
EVAL_MODEL=$MODEL
if [ -n "${TUNE:-}" ]; then
  # shellcheck disable=SC2086
  python3 quality/pic_train.py --model "$MODEL" --out "$KEEP" --data "$TRAIN_DATA" --device "$DEVICE" $TUNE \
    > "$OUT/pic_train.log" 2>&1
  rc=$?
  cp "$KEEP/pic_train_log.jsonl" "$OUT/pic_train_log.jsonl" 2>/dev/null
  grep -E '"event"' "$OUT/pic_train.log" | tail -n 3
  tail -n 4 "$OUT/pic_train.log"
  [ $rc = 0 ] || { echo "pic_train failed: rc $rc"; exit $rc; }
  EVAL_MODEL=$KEEP/model
  echo "tune done at $(( $(date +%s) - START )) s"
fi
if [ -n "${SETS:-}" ]; then
  left=$(( DEADLINE - ($(date +%s) - START) ))
  PIDS=""
  for S in $SETS; do
    for ((i = 0; i < SHARDS; i++)); do
      timeout "$left" python3 quality/eval_pic.py --model "$EVAL_MODEL" --data "$EVAL_DATA" --set "$S" --n "$N" \
        --modes "$MODES" --device "$DEVICE" --threads 1 --shard "$i/$SHARDS" --out "$OUT/${TAG}_${S}_s$i.jsonl" \
        > "$KEEP/eval_${S}_s$i.log" 2>&1 &
      PIDS="$PIDS $!"
    done
  done
  for P in $PIDS; do wait "$P"; done
  echo "evaluation done at $(( $(date +%s) - START )) s"
  for S in $SETS; do
    for ((i = 0; i < SHARDS; i++)); do tail -n 1 "$KEEP/eval_${S}_s$i.log"; done
    # one file per set (a call brings back at most 8 files: 3 sets x 3 shards and the weights' parts did not fit)
    if compgen -G "$OUT/${TAG}_${S}_s*.jsonl" > /dev/null; then
      cat "$OUT/${TAG}_${S}"_s*.jsonl > "$OUT/${TAG}_${S}.jsonl" && rm -f "$OUT/${TAG}_${S}"_s*.jsonl
    fi
  done
  grep -h "capture failed" "$KEEP"/eval_*.log | sort | uniq -c
  python3 quality/eval_pic.py --report "$OUT"/"${TAG}"_*.jsonl
fi
# the weights just tuned, or (no TUNE) the model evaluated, e.g. MODEL=/tmp/kp/model from an earlier call
# (run 81 asked for PACK=1 without a tune and got nothing back)
if [ "${PACK:-0}" = 1 ]; then
  tar -cf - -C "$(dirname "$EVAL_MODEL")" "$(basename "$EVAL_MODEL")" | split -b 15000000 -d -a 1 - "$OUT/weights.tar.part"
fi
ls -la "$OUT"
echo "total $(( $(date +%s) - START )) s"
