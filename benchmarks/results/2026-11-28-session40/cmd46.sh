# session 40: issue 19's table at main: GPT-2 small b8 and ResNet-50 224 px b64 against PyTorch eager (defaults and FP32), memory, compile, GPU profile; one H200
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
timeout 470 python3 benchmarks/models.py --models "gpt2s:8 resnet50:64" --torch-cases eager,eager-fp32 --profile --top 8 --json $OUT/issue19.json 2>&1 | grep -v "^\s*$" | tail -60
