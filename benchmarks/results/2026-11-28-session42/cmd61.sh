# session 42: the autotuner times f16 candidates as the step runs them (f16 bindings) - f16 steps against HEAD 33f5e01, each with its own fresh tuning cache
nvidia-smi --query-gpu=name --format=csv,noheader
MS="resnet18:512 gpt:128"
M="benchmarks/models.py --torch-cases none --repeats 3 --seconds 1.2 --timeout 150"
mkdir -p $OUT/j
for r in base1 new1 base2 new2; do
  case $r in base*) P=$PWD/devpatch/base/src:$PYTHONPATH; C=/tmp/agc_base;; *) P=$PYTHONPATH; C=/tmp/agc_new;; esac
  ANYGRAD_CACHE=$C PYTHONPATH=$P timeout 170 python $M --models "$MS" --precision f16 --json $OUT/j/$r.json > $OUT/j/$r.log 2>&1 || echo "$r failed"
done
ANYGRAD_CACHE=/tmp/agc_f32 timeout 150 python $M --models "$MS" --precision f32 --json $OUT/j/f32.json > $OUT/j/f32.log 2>&1 || echo f32 failed
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f))
    for r in d["results"]:
        for c in r["cases"]:
            if c["framework"] == "anygrad":
                ct = c.get("compile_times", {})
                print(f"{os.path.basename(f):10s} {r.get('model')}:{r.get('batch')} {c.get('samples_per_s', 0):9.1f} [{c.get('samples_per_s_min', 0):.0f}-{c.get('samples_per_s_max', 0):.0f}] compile {c.get('compile_s', 0):5.1f} s planned {c.get('planned_mib', 0):7.1f} kernels {c.get('kernels')}")
P
cd $OUT && tar czf j.tgz j && rm -rf j
