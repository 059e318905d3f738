# dist_scaling with EXP_SERIAL=1: the step's last buckets written back one after the other (session
# 41's A/B against side by side)
import os
import runpy
import sys

if os.environ.get("EXP_SERIAL"):
    from anygrad.distributed.parallel import DataParallel
    plain = DataParallel._write_back
    def serial(self, mapped, jobs, later=False):
        for job in jobs:
            plain(self, mapped, [job], later)
    DataParallel._write_back = serial
sys.argv[0] = "benchmarks/dist_scaling.py"
runpy.run_path("benchmarks/dist_scaling.py", run_name="__main__")
