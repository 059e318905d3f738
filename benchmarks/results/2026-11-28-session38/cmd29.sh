# session 38: timelines of the GPT on 2 devices of one process, batch 512 and 128 per GPU
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j $OUT/tl /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 90 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; grep -h "per step" /tmp/tl/$tag.log | cut -c1-300; }
for B in 512 128; do
A="--onnx /tmp/m/gpt.onnx --batch $B --steps 20"
r gpt${B}_1gpu python $D run $A --device wgpu
r gpt${B}_2dev python $D run $A --device gpus --timeline $OUT/tl/gpt${B}_2dev.json
done
ls -la $OUT/tl
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    print(f"{t:18s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms")
P
cd $OUT/tl && tar czf $OUT/tl.tgz *.json* && rm -f *.json*
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
rm -rf $OUT/j
