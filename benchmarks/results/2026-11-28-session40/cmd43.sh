# session 40: write-back threads into mapped upload memory (1, 2, 8 = before), GPT b512 2 ranks and 2 devices, 2 H200s
# DS: dist_scaling.py run with DataParallel.MAPPED_WRITERS set from EXP_WRITERS before it runs (an experiment wrapper, runpy)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 benchmarks/probe_writeback.py  # (ran as an earlier draft)
D=DS
mkdir -p $OUT/j /tmp/tl
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=60
timeout 90 python benchmarks/dist_scaling.py prepare --out /tmp/m --models gpt 2>&1 | grep exported
TR="python -m torch.distributed.run --standalone --nproc-per-node 2"
A="--onnx /tmp/m/gpt.onnx --batch 512 --steps 30"
timeout 100 python $D run $A --device wgpu --json $OUT/j/1gpu.json > /tmp/tl/1gpu.log 2>&1 || echo 1gpu failed
for rep in a b; do for W in 1 8 2; do
  EXP_WRITERS=$W timeout 100 $TR $D run $A --device wgpu --json $OUT/j/2rank_w${W}_$rep.json > /tmp/tl/2rank_w${W}_$rep.log 2>&1 || { echo 2rank $W failed; tail -3 /tmp/tl/2rank_w${W}_$rep.log; }
done; done
for W in 1 8; do
  EXP_WRITERS=$W timeout 100 python $D run $A --device gpus --json $OUT/j/2dev_w$W.json > /tmp/tl/2dev_w$W.log 2>&1 || echo 2dev $W failed
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f)); t=os.path.basename(f)[:-5]
    b=d.get("breakdown_ms",{})
    print(f"{t:16s} {d['samples_per_s']:9.0f} {d['step_ms']:7.1f} ms bucket {d.get('bucket_mb')} wb {b.get('write_back',0):5.2f} arw {b.get('all_reduce_wait',0):5.2f} upd {b.get('update',0):5.2f}")
P
cd /tmp/tl && tar czf $OUT/logs.tgz *.log
rm -rf $OUT/j
