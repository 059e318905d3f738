# session 38: timelines of the GPT b512 a GPU on 2 ranks and 2 devices of one process (timed buckets)
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j $OUT/tl /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 90 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; }
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 20"
r gpt512_1gpu python $D run $A --device wgpu
r gpt512_2rank $TR $D run $A --device wgpu --timeline $OUT/tl/gpt512_2rank.json
r gpt512_2dev python $D run $A --device gpus --timeline $OUT/tl/gpt512_2dev.json
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    print(f"{t:26s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms  bucket {d.get('bucket_mb')} MB {d.get('breakdown_ms')}")
P
cd $OUT/tl && tar czf $OUT/tl.tgz *.json* && rm -f *.json*
rm -rf $OUT/j
