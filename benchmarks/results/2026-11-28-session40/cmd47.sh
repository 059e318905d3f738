# session 40: ResNet-50 224 px b64 tuned in full in one compile (as after a few compiles with the tuning cache), against PyTorch eager with TF32 defaults; one H200
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc ANYGRAD_AUTOTUNE_SECONDS=150
timeout 280 python3 benchmarks/models.py --models "resnet50:64" --torch-cases eager --json $OUT/resnet50_full_tune.json 2>&1 | grep -v "^\s*$" | tail -8
