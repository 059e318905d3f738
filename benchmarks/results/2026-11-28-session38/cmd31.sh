# session 38: timed bucket sizes (default) against fixed 8 MB buckets, GPT b128/b512 and ResNet-18 32 px b512 a GPU, 2 H200s
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 150 python $D prepare --out /tmp/m --models gpt,resnet18 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; }
for row in gpt:512 gpt:128 resnet18:512; do
M=${row%%:*}; B=${row##*:}
A="--onnx /tmp/m/$M.onnx --batch $B --steps 30"
r ${M}${B}_1gpu python $D run $A --device wgpu
r ${M}${B}_2dev_auto python $D run $A --device gpus
ANYGRAD_BUCKET_MB=8 r ${M}${B}_2dev_8mb python $D run $A --device gpus
r ${M}${B}_2dev_auto_b python $D run $A --device gpus
r ${M}${B}_2rank_auto $TR $D run $A --device wgpu
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:26s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms  bucket {d.get('bucket_mb')} MB  wb {b.get('write_back',0):5.2f} run0 {b.get('run0',0):5.2f}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
rm -rf $OUT/j
