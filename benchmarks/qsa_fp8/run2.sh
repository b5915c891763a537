#!/bin/bash
# call 2: Nsight Compute on the chunk kernel variants, then timings of two more candidates
set -o pipefail
export PYTHONUNBUFFERED=1
S=.gpu/qsa/shim-pristine
P=$S/sglang/srt/layers/attention/qsa/sparse_attn.py
C=.gpu/qsa/cand
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || ls /usr/local/cuda/bin/ncu)
echo "ncu: $NCU"
timeout 240 $NCU --clock-control none --profile-from-start off --set full --csv --page details \
  python3 scripts/gpu/qsa_fp8_profile.py --shim $S --variant pristine=$P --variant f32b=$C/cand3_f32b.py \
  --variant f16b=$C/cand3_f16b.py --variant mix=$C/cand3_mix.py \
  --launch pristine/bf16/default --launch pristine/fp8/default --launch f32b/fp8/16,1,1 \
  --launch f16b/fp8/16,1,1 --launch mix/fp8/default --launch f32b/fp8/16,1,2 > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu rc $? lines $(wc -l < $OUT/ncu.csv)"; tail -3 $OUT/ncu.err
python3 scripts/gpu/qsa_fp8_explore.py --shim $S --variant pristine=$P --variant f32h=$C/cand3_f32h.py \
  --variant mix=$C/cand3_mix.py --sweep mix --configs "16,1,2;16,1,1;16,1,3;32,4,1;64,4,2;64,8,2;32,4,3" \
  --shapes "64x512x65536;256x512x65536;2048x512x65536;8192x512x65536" --out $OUT/explore2.json 2>&1 | tee $OUT/explore2.log
