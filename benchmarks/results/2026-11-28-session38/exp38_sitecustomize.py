# session 38 experiment (not in the package): EXP_DEFER=1 submits the gradient write-back copies
# with the update instead of mid-step; EXP_NOTAPS=1 reads every bucket after the step.
import os

if os.environ.get("EXP_DEFER") == "1" or os.environ.get("EXP_NOTAPS") == "1":
    from anygrad.backends.wgpu.runtime import WgpuBackend
    from anygrad.distributed import parallel as P

    if os.environ.get("EXP_DEFER") == "1":
        orig_import, orig_submit, orig_update = WgpuBackend.import_view, WgpuBackend.submit, P.DataParallel._update_job

        def import_view(self, names):
            got = orig_import(self, names)
            if got is None:
                return got
            view, commit = got

            def deferred():
                self._defer = True
                try:
                    commit()
                finally:
                    self._defer = False
            return view, deferred

        def submit(self, cb, hooks=()):
            if getattr(self, "_defer", False):
                self.__dict__.setdefault("_stash", []).append(cb)
                return
            orig_submit(self, cb, hooks)

        def update_job(self, r, i):
            stash = r.backend.__dict__.pop("_stash", None)
            if stash:
                r.backend.device.queue.submit(stash)
            return orig_update(self, r, i)
        WgpuBackend.import_view, WgpuBackend.submit, P.DataParallel._update_job = import_view, submit, update_job
    if os.environ.get("EXP_NOTAPS") == "1":
        P.DataParallel._ready_steps = lambda self, exe: {}

if os.environ.get("EXP_CUTS"):  # "scales;tails", e.g. "0.25;" or ";3": only these bucket cuts
    from anygrad.distributed import parallel as _P
    _sc, _tl = os.environ["EXP_CUTS"].split(";")
    _P.BUCKET_SCALES = tuple(float(v) for v in _sc.split(",") if v)
    _P.BUCKET_TAILS = tuple(int(v) for v in _tl.split(",") if v)
