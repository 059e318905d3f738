# session 42: why f16 conv-gradient kernels are slower than f32 on an H200: raw 16-bit access patterns, then one ResNet stage profiled
nvidia-smi --query-gpu=name --format=csv,noheader
export ANYGRAD_CACHE=/tmp/agc
timeout 120 python devpatch/mem16.py 26 2>&1 | tee $OUT/mem16.txt
timeout 200 python devpatch/convlayer.py 512 f32,f16 2>&1 | grep -v "onnx\]" | tee $OUT/convlayer.txt
ANYGRAD_AUTOTUNE=0 timeout 150 python devpatch/convlayer.py 512 f32,f16 2>&1 | grep -v "onnx\]" | tee $OUT/convlayer_notune.txt
