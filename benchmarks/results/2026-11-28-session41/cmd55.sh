# session 41, main at the end (riders reverted: every write-back commits at once): GPT b512 on 1 GPU and 2 ranks (x4), replicas checked
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
timeout 60 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
timeout 40 python $D run $A --device wgpu --json $OUT/j/1gpu.json > /tmp/tl/1gpu.log 2>&1 || { echo 1gpu failed; tail -5 /tmp/tl/1gpu.log; }
for r in a b c d; do
  timeout 45 $TR $D run $A --device wgpu --json $OUT/j/2r_$r.json > /tmp/tl/2r_$r.log 2>&1 || { echo 2r failed; tail -5 /tmp/tl/2r_$r.log; }
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:12s} {d['samples_per_s']:9.0f} {d['step_ms']:7.2f} ms bucket {d.get('bucket_mb')} wb {b.get('write_back',0):5.2f} arw {b.get('all_reduce_wait',0):5.2f} upd {b.get('update',0):5.2f}")
P
grep -h -i "replica\|mismatch\|hash" /tmp/tl/2r_*.log | head -5
cd $OUT && tar czf dp.tgz j -C /tmp tl 2>/dev/null; rm -rf $OUT/j
