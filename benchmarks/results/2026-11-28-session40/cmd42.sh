# session 40: the GPT at batch 512 per GPU on 2 H200s: 1 GPU, 2 ranks (default, bf16 compression), 2 devices one process; ResNet-18 b512
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j $OUT/tl /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 150 python $D prepare --out /tmp/m --models gpt,resnet18 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
for tag in gpt512_1gpu gpt512_2rank gpt512_2rank_bf16 gpt512_2dev gpt512_2rank_b gpt512_2rank_bf16_b gpt512_1gpu_b; do
  case $tag in
    *1gpu*) C="python $D run $A --device wgpu";;
    *2rank_bf16*) C="$TR $D run $A --device wgpu --grad-compression bf16";;
    *2rank*) C="$TR $D run $A --device wgpu";;
    *2dev*) C="python $D run $A --device gpus";;
  esac
  timeout 110 $C --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }
done
ANYGRAD_DP_TIMELINE=$OUT/tl/gpt512_2rank.json timeout 110 $TR $D run $A --device wgpu --json $OUT/j/gpt512_2rank_tl.json > /tmp/tl/tl.log 2>&1 || echo "tl failed"
A="--onnx /tmp/m/resnet18.onnx --batch 512 --steps 30"
timeout 110 python $D run $A --device wgpu --json $OUT/j/resnet18_512_1gpu.json > /tmp/tl/r1.log 2>&1 || echo r1 failed
timeout 110 $TR $D run $A --device wgpu --json $OUT/j/resnet18_512_2rank.json > /tmp/tl/r2.log 2>&1 || echo r2 failed
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:24s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms bucket {d.get('bucket_mb')} comp {d.get('grad_compression')} wb {b.get('write_back',0):5.2f} upd {b.get('update',0):5.2f}")
P
cd $OUT/tl && tar czf $OUT/tl.tgz *.json* 2>/dev/null; rm -f *.json*
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
