# session 38: bucket sizes for the GPT on 2 devices of one process (b512, b128) and 2 ranks (b512)
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 90 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; }
for B in 512 128; do
A="--onnx /tmp/m/gpt.onnx --batch $B --steps 30"
r gpt${B}_1gpu python $D run $A --device wgpu
for MB in 8 4 2 8 4 2; do ANYGRAD_BUCKET_MB=$MB r gpt${B}_2dev_${MB}mb_$RANDOM python $D run $A --device gpus; done
done
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
for MB in 8 4 2; do ANYGRAD_BUCKET_MB=$MB r gpt512_2rank_${MB}mb $TR $D run $A --device wgpu; done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:24s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms  wb {b.get('write_back',0):5.2f} upd {b.get('update',0):5.2f} run0 {b.get('run0',0):5.2f}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
rm -rf $OUT/j
