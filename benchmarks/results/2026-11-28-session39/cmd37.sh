# session 39: GPT-2 small GEMMs in HF's layout vs cuBLAS (torch first), and tile variants for the 768x768 GEMMs, one H100
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
BK="python3 benchmarks/bench_kernels.py"
V="tuned,shared8k16%128+prefetch=1,shared8k16%128+prefetch=2,shared8k8%128+prefetch=2,shared4k16%128+prefetch=1,shared8k16+prefetch=1+tn=4,shared8k16+prefetch=2+tn=4,shared4k16+prefetch=1+tn=8,shared4k16+prefetch=1+splits=2,shared8k16%128+prefetch=1+splits=2,shared8k16%128+prefetch=1+splits=4,shared8k16%128+prefetch=2+splits=3,shared8k16%64+prefetch=1,shared4k16+prefetch=2"
timeout 170 $BK --sizes "" --batches "" --transformer gpt2s:hf --only proj --torch --variants $V --seconds 0.3 --json $OUT/proj_variants.json 2>&1 | grep -v "^\s*$"
timeout 390 $BK --sizes "" --batches "" --transformer gpt2s:hf --torch --variants tuned --seconds 0.15 --json $OUT/gemm_hf.json 2>&1 | grep -v "^\s*$" | tail -48
