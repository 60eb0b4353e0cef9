#!/usr/bin/env bash
# Follow-up call on the still-warm device machine: pack the results that run_device.sh left in $KEEP.
# Usage: ARCH=kimi bash quality/fetch_device.sh
set -u
A=${ARCH:-kimi}; KEEP=${KEEP:-/tmp/keep}; OUT=${OUT:-out/device}
mkdir -p $OUT
ls -la $KEEP $KEEP/$A $KEEP/$A/model || exit 1
cp $KEEP/$A.log $OUT/${A}_stdout.log
[ -f $KEEP/$A/train_log.jsonl ] && cp $KEEP/$A/train_log.jsonl $OUT/${A}_train_log.jsonl
[ -f $KEEP/$A/eval.json ] && cp $KEEP/$A/eval.json $OUT/${A}_eval.json
tar -cf - -C $KEEP/$A model | split -b 15000000 -d -a 1 - $OUT/${A}_model.tar.part
ls -la $OUT
