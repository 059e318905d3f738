"""The replicas' state under DataParallel: the model's state handed to them after a load, one
replica's state copied to the others after an update failed on some, the check that every
replica (every device, every rank) holds the same parameters, and the metric sums over them.
ReplicaState is DataParallel's half for what the replicas hold between steps; the steps
themselves are in parallel.py.
"""
from __future__ import annotations

import contextlib
import hashlib

import numpy as np

from ..errors import DeviceError
from ..model import Model


class ReplicaState:
    """State copied to, compared over and summed over the replicas, for DataParallel (which owns
    them: replicas, group, updates, the learning rates it last gave them in _lr)."""

    def _resync(self, failed: list[int]) -> None:
        """The update failed on devices `failed` and ran on the others: every replica takes the state
        of one that completed it (so the step counts as applied, as on that device), or device 0's
        when none did, so that they stay equal; left alone, they would train on apart until the
        next parameter check. Metric sums stay each replica's own. Best effort: a lost device
        cannot take it, and the step's own error is raised either way."""
        done = [i for i in range(len(self.replicas)) if i not in failed]
        source = self.replicas[done[0] if done else 0]
        own = self.model.metric_buffers()
        try:
            state = {n: v for n, v in source.full_state().items() if n not in own}
        except Exception:  # noqa: BLE001 - the source device failed too: nothing to copy from
            return
        for r in self.replicas:
            if r is source:
                continue
            with contextlib.suppress(Exception):  # a lost device: its next step fails on its own
                for name, value in state.items():
                    r.backend.set_state(name, value)

    def state_loaded(self, model: Model) -> None:
        """The model's state was overwritten (load_full_state): replicas take it."""
        for r in self.replicas[1:]:
            r.take_state(model)
        self._lr = model.group_lrs

    # -- equality of the replicas ---------------------------------------------------------------------
    def parameter_hash(self, r: Model) -> str:
        state = r.backend.get_states(list(r.graph.params))
        h = hashlib.sha256()
        for name in r.graph.params:
            h.update(np.ascontiguousarray(state[name]).tobytes())
        return h.hexdigest()[:16]

    def check_replicas(self) -> None:
        """Raise DeviceError unless every replica (every device, every rank) holds the same parameters."""
        hashes = [self.parameter_hash(r) for r in self.replicas]
        where = [f"device {i} ({r.backend.description})" for i, r in enumerate(self.replicas)]
        if self.group is not None and self.group.size > 1:
            gathered = self.group.gather_strings(";".join(hashes))
            hashes = [h for text in gathered for h in text.split(";")]
            where = [f"rank {k} {w}" for k in range(self.group.size) for w in where]
        if len(set(hashes)) > 1:
            odd = [w for w, h in zip(where, hashes) if h != hashes[0]]
            raise DeviceError(f"data-parallel replicas diverged after {self.updates} updates: the parameters of "
                              f"{', '.join(odd)} differ from {where[0]}'s. A device computes differently (driver "
                              "bug, non-deterministic kernel) or ranks run different settings; train on one device "
                              "to find which")

    # -- metrics (Model.read_metrics / reset_metrics) ----------------------------------------------
    def metric_sums(self, model: Model, names: list[str]) -> dict[str, float]:
        """The metric buffers `names` summed over every replica (every device, every rank)."""
        sums = np.zeros(len(names), np.float64)
        for r in self.replicas:
            sums += [float(r.backend.get_state(n)) if r.backend.has_state(n) else 0.0 for n in names]
        if self.group is not None and self.group.size > 1:
            sums = self.group.all_reduce_f64(sums)
        return dict(zip(names, sums.tolist()))

    def reset_metrics(self, model: Model, names: list[str]) -> None:
        """Zero the metric sums `names` on every replica (the model's own: every one)."""
        for name in names:
            model.backend.set_state(name, np.zeros((), np.float32))
        for r in self.replicas[1:]:
            for name in names:
                if r.backend.has_state(name):
                    r.backend.set_state(name, np.zeros((), np.float32))
