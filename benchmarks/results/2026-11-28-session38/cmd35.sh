# session 38: bucket cuts with small last buckets (BucketCut.tail) against plain 2 MB, 2 H200s
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60 PYTHONPATH=$PWD/devpatch/exp38:$PYTHONPATH
timeout 150 python $D prepare --out /tmp/m --models gpt,resnet18 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; }
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
r gpt512_1gpu python $D run $A --device wgpu
EXP_CUTS=";3" r gpt512_2rank_tail3 $TR $D run $A --device wgpu
EXP_CUTS="0.25;" r gpt512_2rank_2mb $TR $D run $A --device wgpu
r gpt512_2rank_auto $TR $D run $A --device wgpu
EXP_CUTS=";3" r gpt512_2rank_tail3_b $TR $D run $A --device wgpu
r gpt512_2dev_auto python $D run $A --device gpus
A="--onnx /tmp/m/gpt.onnx --batch 128 --steps 30"
r gpt128_1gpu python $D run $A --device wgpu
r gpt128_2rank_auto $TR $D run $A --device wgpu
A="--onnx /tmp/m/resnet18.onnx --batch 512 --steps 30"
r resnet18512_1gpu python $D run $A --device wgpu
r resnet18512_2rank_auto $TR $D run $A --device wgpu
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:26s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms  {d.get('buckets')}  cw0 {b.get('compute_wait0',0):5.2f} rb0 {b.get('readback0',0):5.2f} wb {b.get('write_back',0):5.2f}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
rm -rf $OUT/j
