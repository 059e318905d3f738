# session 39: GPT-2 small's cold compile with split variants built in the background (compare cmd40), one H100
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc __GL_SHADER_DISK_CACHE_PATH=/tmp/glc
timeout 110 python3 benchmarks/models.py --models gpt2s:8 --torch-cases none --json $OUT/gpt2s_bgsplits.json 2>&1 | grep -v "^\s*$" | tail -6
