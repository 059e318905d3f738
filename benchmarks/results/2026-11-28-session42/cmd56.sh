# session 42: f16 FMA formulations on an H200 (does any reach the HFMA2 rate?)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
(sleep 8; nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader) &
timeout 300 python devpatch/fma_variants.py 16384 2>&1 | tee $OUT/fma_variants.txt
