# session 39: probe_readback (split vs bytes) and GPT-2 small GEMMs in HF's layout vs cuBLAS, one H100
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
timeout 100 python3 benchmarks/probe_readback.py --json $OUT/probe.json 2>&1 | tail -12
timeout 100 python3 benchmarks/probe_readback.py --mb 0.25 --json $OUT/probe_small.json 2>&1 | tail -8
timeout 400 python3 benchmarks/bench_kernels.py --sizes "" --batches "" --transformer gpt2s:hf --torch --variants tuned --seconds 0.3 --json $OUT/gemm_hf.json 2>&1 | grep -v "^\s*$" | tail -45
