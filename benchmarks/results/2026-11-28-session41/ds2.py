# dist_scaling with session 41's experiments: EXP_NORIDE=1 commits every write-back at once (no
# riders on the update's submission); EXP_SWI=s sets the GIL switch interval
import os
import runpy
import sys

if os.environ.get("EXP_SWI"):
    sys.setswitchinterval(float(os.environ["EXP_SWI"]))
if os.environ.get("EXP_NORIDE"):
    from anygrad.backends.wgpu import WgpuBackend
    plain = WgpuBackend.import_view
    def view(self, names):
        got = plain(self, names)
        if got is None:
            return None
        arr, commit = got
        def now(later=False):
            return commit()
        now.cancel = commit.cancel
        return arr, now
    WgpuBackend.import_view = view
sys.argv[0] = "benchmarks/dist_scaling.py"
runpy.run_path("benchmarks/dist_scaling.py", run_name="__main__")
