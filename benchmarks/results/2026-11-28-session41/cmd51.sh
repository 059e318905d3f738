# session 41: GPT b512 on 2 H200s: gloo sums cut into 1 MB pieces over the 4 groups (A/B against uncut, 64 MB pieces)
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
timeout 40 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
timeout 40 python $D run $A --device wgpu --json $OUT/j/1gpu.json > /tmp/tl/1gpu.log 2>&1 || { echo 1gpu failed; tail -5 /tmp/tl/1gpu.log; }
for r in a b; do
  timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_p1_$r.json > /tmp/tl/p1_$r.log 2>&1 || { echo p1 failed; tail -5 /tmp/tl/p1_$r.log; }
  ANYGRAD_GLOO_PIECE_MB=64 timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_uncut_$r.json > /tmp/tl/uncut_$r.log 2>&1 || { echo uncut failed; tail -5 /tmp/tl/uncut_$r.log; }
done
ANYGRAD_GLOO_PIECE_MB=0.5 timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_p05.json > /tmp/tl/p05.log 2>&1 || echo p05 failed
ANYGRAD_DP_TIMELINE=$OUT/tl.json timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_p1_tl.json > /tmp/tl/2rank_tl.log 2>&1 || { echo 2rank tl failed; tail -5 /tmp/tl/2rank_tl.log; }
timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_p1_c.json > /tmp/tl/p1_c.log 2>&1 || echo p1c failed
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:12s} {d['samples_per_s']:9.0f} {d['step_ms']:7.2f} ms bucket {d.get('bucket_mb')} up {b.get('upload0',0):5.2f} wb {b.get('write_back',0):5.2f} arw {b.get('all_reduce_wait',0):5.2f} upd {b.get('update',0):5.2f}")
P
cd $OUT && tar czf dp.tgz j tl.json* -C /tmp tl 2>/dev/null; rm -rf $OUT/j $OUT/tl.json*
