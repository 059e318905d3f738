# session 38: the GPT on 2 H200s at batch 128, 256 and 512 per GPU (1 GPU, 2 devices one process, 2 ranks), f32
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 90 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; grep -h "per step" /tmp/tl/$tag.log | cut -c1-300; }
for B in 128 512 256; do
A="--onnx /tmp/m/gpt.onnx --batch $B --steps 30"
r gpt${B}_1gpu python $D run $A --device wgpu
r gpt${B}_2dev python $D run $A --device gpus
r gpt${B}_2rank $TR $D run $A --device wgpu
r gpt${B}_1gpu_again python $D run $A --device wgpu
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    print(f"{t:18s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms loss {d.get('loss')}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
