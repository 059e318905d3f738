# session 38 experiment: write-back copies deferred to the update, bucket taps off; GPT b512 on 2 ranks and 2 devices
nvidia-smi --query-gpu=name --format=csv,noheader
D=benchmarks/dist_scaling.py
mkdir -p $OUT/j $OUT/tl /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60 PYTHONPATH=$PWD/devpatch/exp38:$PYTHONPATH
timeout 90 python $D prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
r() { tag=$1; shift; timeout 100 "$@" --json $OUT/j/$tag.json > /tmp/tl/$tag.log 2>&1 || { echo "$tag failed"; tail -5 /tmp/tl/$tag.log; }; }
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 20"
r gpt512_1gpu python $D run $A --device wgpu
for v in base defer notaps both base2 defer2; do
  case $v in base*) E="";; defer*) E="EXP_DEFER=1";; notaps) E="EXP_NOTAPS=1";; both) E="EXP_DEFER=1 EXP_NOTAPS=1";; esac
  env $E bash -c "true"; 
  env $E python -m torch.distributed.run --standalone --nproc-per-node 2 $D run $A --device wgpu --json $OUT/j/gpt512_2rank_$v.json --timeline $OUT/tl/r_$v.json > /tmp/tl/r_$v.log 2>&1 || { echo "$v failed"; tail -5 /tmp/tl/r_$v.log; }
done
for v in base defer; do
  case $v in base*) E="";; defer*) E="EXP_DEFER=1";; esac
  env $E python $D run $A --device gpus --json $OUT/j/gpt512_2dev_$v.json > /tmp/tl/d_$v.log 2>&1 || { echo "$v failed"; tail -5 /tmp/tl/d_$v.log; }
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    print(f"{t:26s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms  bucket {d.get('bucket_mb')} MB {d.get('breakdown_ms')}")
P
cd $OUT/tl && tar czf $OUT/tl.tgz *.json* && rm -f *.json*
rm -rf $OUT/j
