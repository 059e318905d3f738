# session 39: fc2 forward (2048x3072x768) tilings x K splits, head dW in HF's layout, one H100
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
BK="python3 benchmarks/bench_kernels.py"
V=tuned
for s in 3 4 6 8 12 16; do V="$V,shared8k8+prefetch=1+splits=$s,shared8k16+prefetch=1+unroll=2+splits=$s,shared8k16+prefetch=1+tn=16+splits=$s,shared8k16+prefetch=2+splits=$s"; done
timeout 200 $BK --sizes "" --batches "" --transformer gpt2s:hf --only "fc2 fwd" --torch --variants $V --seconds 0.2 --json $OUT/fc2_variants.json 2>&1 | grep -v "^\s*$" | grep -v tf32
timeout 200 $BK --sizes "" --batches "" --transformer gpt2s:hf --only "head dW" --torch --variants tuned --seconds 0.2 --json $OUT/head_dw.json 2>&1 | grep -v "^\s*$" | grep -v tf32
timeout 100 $BK --sizes "" --batches "" --transformer gpt2s:hf --only "proj dW" --torch --variants tuned,tuned,tuned --seconds 0.3 2>&1 | grep -v "^\s*$" | grep -v tf32
