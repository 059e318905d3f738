# session 42: ResNet-18 b512 f32 against f16 with the rule's tilings (no autotuning): the same kernels, kernel by kernel
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_AUTOTUNE=0
M="benchmarks/models.py --torch-cases none --repeats 3 --seconds 1 --timeout 200 --profile --top 60"
mkdir -p $OUT/j
for p in f32 f16; do
  timeout 200 python $M --models "resnet18:512" --precision $p --json $OUT/j/r18_$p.json > $OUT/j/r18_$p.log 2>&1 || echo "$p failed"
done
python - <<'P'
import json, os
ks = {}
for p in ("f32", "f16"):
    d = json.load(open(f"{os.environ['OUT']}/j/r18_{p}.json"))
    c = next(c for c in d["results"][0]["cases"] if c["framework"] == "anygrad")
    print(p, round(c.get("samples_per_s", 0)), "step_us", c["profile"]["step_ns"] / 1e3)
    ks[p] = [k for k in c["profile"]["kernels"] if k[0].startswith("Conv")]
print(len(ks["f32"]), len(ks["f16"]))
for a, b in zip(ks["f32"], ks["f16"]):
    print(f"{a[1] / 1e3:8.1f} {b[1] / 1e3:8.1f} {b[1] / a[1]:5.2f}  {a[0]} | {b[0]}")
P
