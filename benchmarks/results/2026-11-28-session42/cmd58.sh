# session 42: where ResNet-18 b512's f16 step loses to f32 (per-kernel GPU profile, both precisions, tuned)
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
M="benchmarks/models.py --torch-cases none --repeats 2 --seconds 1 --timeout 200 --profile --top 60"
mkdir -p $OUT/j
for p in f32 f16; do
  timeout 220 python $M --models "resnet18:512" --precision $p --json $OUT/j/r18_$p.json > $OUT/j/r18_$p.log 2>&1 || echo "$p failed"
done
python - <<'P'
import json, os
for p in ("f32", "f16"):
    d = json.load(open(f"{os.environ['OUT']}/j/r18_{p}.json"))
    c = next(c for c in d["results"][0]["cases"] if c["framework"] == "anygrad")
    prof = c.get("profile", {})
    print(p, round(c.get("samples_per_s", 0)), "step_us", prof.get("step_ns", 0) / 1e3, "kernel_us", prof.get("kernel_ns", 0) / 1e3)
    for kind, n, ns in prof.get("by_kind", [])[:16]:
        print(f"  {kind:28s} {n:4d} {ns / 1e3:9.1f} us")
P
