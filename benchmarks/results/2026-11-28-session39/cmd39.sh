# session 39: autotuner split counts s/2, 4s/3, 2s for the two leaders: GEMMs and GPT-2 small's step, one H100
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
BK="python3 benchmarks/bench_kernels.py"
V=tuned
for s in 3 5 6 10 12 16; do V="$V,shared4k16+prefetch=1+splits=$s"; done
timeout 150 $BK --sizes "" --batches "" --transformer gpt2s:hf --only "proj dW" --torch --variants $V,shared8k16%128+prefetch=1+splits=6,shared8k16%128+prefetch=1+splits=3 --seconds 0.3 --json $OUT/projdw.json 2>&1 | grep -v "^\s*$" | grep -v tf32
timeout 100 $BK --sizes "" --batches "" --transformer gpt2s:hf --only "fc2 fwd" --torch --variants tuned --seconds 0.2 --json $OUT/fc2.json 2>&1 | grep -v "^\s*$" | grep -v tf32
rm -rf /tmp/agc
timeout 200 python3 benchmarks/models.py --models gpt2s:8 --torch-cases eager --json $OUT/gpt2s.json 2>&1 | grep -v "^\s*$" | tail -15
