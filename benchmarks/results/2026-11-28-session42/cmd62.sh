# session 42: ResNet-50 224 px b64, f16 against f32 at main (each tuned fresh)
nvidia-smi --query-gpu=name --format=csv,noheader
M="benchmarks/models.py --torch-cases none --repeats 2 --seconds 1 --timeout 130"
mkdir -p $OUT/j
for p in f32 f16; do
  ANYGRAD_CACHE=/tmp/agc_$p timeout 135 python $M --models "resnet50:64" --precision $p --json $OUT/j/r50_$p.json > $OUT/j/r50_$p.log 2>&1 || echo "$p failed"
done
python - <<'P'
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/j/*.json")):
    d=json.load(open(f))
    for r in d["results"]:
        for c in r.get("cases", []):
            if c["framework"] == "anygrad":
                print(f"{os.path.basename(f):12s} {c.get('samples_per_s', 0):8.1f} [{c.get('samples_per_s_min', 0):.0f}-{c.get('samples_per_s_max', 0):.0f}] compile {c.get('compile_s', 0):5.1f} s planned {c.get('planned_mib', 0):7.1f} smi {c.get('smi_peak_mib')} kernels {c.get('kernels')}")
P
