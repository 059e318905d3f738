# session 40: GPT-2 small cold compile with SPLIT_FACTORS (3s/4, 4s/3), and its GEMMs in HF's layout vs cuBLAS (tuned), one H200 of 2
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc __GL_SHADER_DISK_CACHE_PATH=/tmp/glc
timeout 130 python3 benchmarks/models.py --models gpt2s:8 --torch-cases eager --json $OUT/gpt2s_cold.json 2>&1 | grep -v "^\s*$" | tail -8
timeout 420 python3 benchmarks/bench_kernels.py --sizes "" --batches "" --transformer gpt2s:hf --torch --variants tuned --seconds 0.15 --json $OUT/gemm_hf.json 2>&1 | grep -v "^\s*$" | tail -40
