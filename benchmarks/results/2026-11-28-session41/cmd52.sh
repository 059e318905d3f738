# session 41: GPT b512 on 2 H200s with gloo pieces: the last buckets written back side by side (A/B against one
# after the other); then ResNet-18 32 px (pieces and uncut) and 224 px b512 per GPU on 1 GPU and 2 ranks
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
timeout 60 python $D prepare --out /tmp/m --models gpt,resnet18_224,resnet18 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
timeout 40 python $D run $A --device wgpu --json $OUT/j/1gpu.json > /tmp/tl/1gpu.log 2>&1 || { echo 1gpu failed; tail -5 /tmp/tl/1gpu.log; }
for r in a b; do
  timeout 45 $TR devpatch/ds3.py run $A --device wgpu --json $OUT/j/2r_side_$r.json > /tmp/tl/side_$r.log 2>&1 || { echo side failed; tail -5 /tmp/tl/side_$r.log; }
  EXP_SERIAL=1 timeout 45 $TR devpatch/ds3.py run $A --device wgpu --json $OUT/j/2r_serial_$r.json > /tmp/tl/serial_$r.log 2>&1 || { echo serial failed; tail -5 /tmp/tl/serial_$r.log; }
done
ANYGRAD_DP_TIMELINE=$OUT/tl.json timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_side_tl.json > /tmp/tl/2rank_tl.log 2>&1 || { echo 2rank tl failed; tail -5 /tmp/tl/2rank_tl.log; }
timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_side_c.json > /tmp/tl/side_c.log 2>&1 || echo side c failed
S="--onnx /tmp/m/resnet18.onnx --batch 512 --steps 30"
timeout 60 python $D run $S --device wgpu --json $OUT/j/r18s_1gpu.json > /tmp/tl/r18s_1gpu.log 2>&1 || { echo r18s 1gpu failed; tail -5 /tmp/tl/r18s_1gpu.log; }
timeout 60 $TR $D run $S --device wgpu --json $OUT/j/r18s_2r.json > /tmp/tl/r18s_2r.log 2>&1 || { echo r18s 2r failed; tail -5 /tmp/tl/r18s_2r.log; }
ANYGRAD_GLOO_PIECE_MB=64 timeout 60 $TR $D run $S --device wgpu --json $OUT/j/r18s_2r_uncut.json > /tmp/tl/r18s_2r_uncut.log 2>&1 || { echo r18s uncut failed; tail -5 /tmp/tl/r18s_2r_uncut.log; }
R="--onnx /tmp/m/resnet18_224.onnx --batch 512 --steps 10"
timeout 100 python $D run $R --device wgpu --json $OUT/j/r18_1gpu.json > /tmp/tl/r18_1gpu.log 2>&1 || { echo r18 1gpu failed; tail -5 /tmp/tl/r18_1gpu.log; }
timeout 120 $TR $D run $R --device wgpu --json $OUT/j/r18_2r.json > /tmp/tl/r18_2r.log 2>&1 || { echo r18 2r failed; tail -5 /tmp/tl/r18_2r.log; }
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:12s} {d['samples_per_s']:9.0f} {d['step_ms']:7.2f} ms bucket {d.get('bucket_mb')} up {b.get('upload0',0):5.2f} wb {b.get('write_back',0):5.2f} arw {b.get('all_reduce_wait',0):5.2f} upd {b.get('update',0):5.2f}")
P
cd $OUT && tar czf dp.tgz j tl.json* -C /tmp tl 2>/dev/null; rm -rf $OUT/j $OUT/tl.json*
