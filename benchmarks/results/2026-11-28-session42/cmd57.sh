# session 42: f16 steps with gradients consumed where made (hoist + no delaying sibling merge) against 4f76c67, alternating; then memory attribution
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
MS="resnet18:512 gpt:128"
M="benchmarks/models.py --torch-cases none --repeats 4 --seconds 1.2 --timeout 140"
mkdir -p $OUT/j
for r in base1 new1 base2 new2; do
  case $r in base*) P=$PWD/devpatch/base/src:$PYTHONPATH;; *) P=$PYTHONPATH;; esac
  PYTHONPATH=$P timeout 150 python $M --models "$MS" --precision f16 --json $OUT/j/$r.json > $OUT/j/$r.log 2>&1 || echo "$r failed"
done
timeout 100 python $M --models "$MS" --precision f32 --json $OUT/j/f32.json > $OUT/j/f32.log 2>&1 || echo f32 failed
ANYGRAD_AUTOTUNE=0 ANYGRAD_CACHE=/tmp/agc2 timeout 100 python $M --models "$MS" --precision f16 --json $OUT/j/f16_notune.json > $OUT/j/f16_notune.log 2>&1 || echo notune failed
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f))
    for r in d["results"]:
        for c in r["cases"]:
            if c["framework"] == "anygrad":
                print(f"{os.path.basename(f):18s} {r.get('model')}:{r.get('batch')} {c.get('samples_per_s', 0):9.1f} [{c.get('samples_per_s_min', 0):.0f}-{c.get('samples_per_s_max', 0):.0f}] planned {c.get('planned_mib', 0):7.1f} smi {c.get('smi_peak_mib')} kernels {c.get('kernels')}")
P
