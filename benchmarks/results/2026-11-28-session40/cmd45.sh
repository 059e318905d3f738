# session 40: LM head dW vs cuBLAS (one H200), then GPT b512 on 2 H200s with one thread writing into upload memory (main now)
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
timeout 150 python3 benchmarks/bench_kernels.py --sizes "" --batches "" --transformer gpt2s:hf --only "head dW" --torch --variants tuned --seconds 0.15 --json $OUT/gemm_head_dw.json 2>&1 | grep -v "^\s*$" | grep -v tf32 | tail -4
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j /tmp/tl
timeout 90 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
timeout 100 python $D run $A --device wgpu --json $OUT/j/1gpu.json > /tmp/tl/1gpu.log 2>&1 || echo 1gpu failed
for rep in a b c; do
  timeout 100 $TR $D run $A --device wgpu --json $OUT/j/2rank_$rep.json > /tmp/tl/2rank_$rep.log 2>&1 || { echo 2rank failed; tail -3 /tmp/tl/2rank_$rep.log; }
done
timeout 100 python $D run $A --device wgpu --json $OUT/j/1gpu_b.json > /tmp/tl/1gpu_b.log 2>&1 || echo 1gpu failed
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:10s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms bucket {d.get('bucket_mb')} wb {b.get('write_back',0):5.2f} arw {b.get('all_reduce_wait',0):5.2f} upd {b.get('update',0):5.2f}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
