# session 39: main's cold compile of GPT-2 small (baseline for cmd39), one H100
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
export ANYGRAD_CACHE=/tmp/agc __GL_SHADER_DISK_CACHE_PATH=/tmp/glc
timeout 200 python3 benchmarks/models.py --models gpt2s:8 --torch-cases none --json $OUT/gpt2s_main.json 2>&1 | grep -v "^\s*$" | tail -6
