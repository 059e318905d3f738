# session 38: device-side bounce buffers for the gradient buckets (default) against ANYGRAD_WGPU_BOUNCE=0, 2 H200s
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
r ${M}${B}_2rank_bounce $TR $D run $A --device wgpu
ANYGRAD_WGPU_BOUNCE=0 r ${M}${B}_2rank_nobounce $TR $D run $A --device wgpu
r ${M}${B}_2dev_bounce python $D run $A --device gpus
if [ $M = gpt ] && [ $B = 512 ]; then
ANYGRAD_WGPU_BOUNCE=0 r ${M}${B}_2dev_nobounce python $D run $A --device gpus
r ${M}${B}_2rank_bounce_b $TR $D run $A --device wgpu
fi
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:28s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms  bucket {d.get('bucket_mb')} MB  cw0 {b.get('compute_wait0',0):5.2f} rb0 {b.get('readback0',0):5.2f} wb {b.get('write_back',0):5.2f} upd {b.get('update',0):5.2f} loss {d.get('loss')}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
rm -rf $OUT/j
