"""Leader election on a coordination.k8s.io/v1 Lease, as client-go does it.

The candidate that creates the Lease, or updates it once it has expired, leads;
it renews `spec.renewTime` every `retry_period` and steps down when it has not
managed to for `renew_deadline`. Expiry is judged on the local clock from when
this candidate last saw the record change (not from renewTime, whose clock is
the holder's). On a clean stop the leader releases the Lease (holderIdentity
cleared) so another replica takes over at once. Every write carries the
resourceVersion it read: two candidates racing for an expired Lease get one
success and one 409.

Not kubernetes.leaderelection: it cannot be stopped, never releases, calls
sys.exit on settings below one second, and uses the global client.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from mtcfs.k8s.kube import LEASES, Kube, Obj

log = logging.getLogger("mtcfs.leader")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.leading = threading.Event()
        self._observed: tuple[str | None, str | None] | None = None  # (holder, renewTime)
        self._observed_at = 0.0
        # For the controller's probes: when it last tried, and last reached the API.
        self.attempted_at = time.monotonic()
        self.answered_at: float | None = None

    def is_leader(self) -> bool:
        return self.leading.is_set()

    def holder(self) -> str | None:
        lease = self.kube.get(LEASES, self.name, self.namespace)
        return ((lease or {}).get("spec") or {}).get("holderIdentity")

    def try_acquire_or_renew(self) -> bool:
        now = time.monotonic()
        lease = self.kube.get(LEASES, self.name, self.namespace)
        self.answered_at = now
        spec_new: Obj = {
            "holderIdentity": self.identity,
            # The API field is whole seconds; round up so nobody expires early.
            "leaseDurationSeconds": max(1, int(-(-self.lease_duration // 1))),
            "renewTime": _micro_now(),
        }
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**spec_new, "acquireTime": spec_new["renewTime"],
                         "leaseTransitions": 0},
            }
            try:
                self.kube.create(LEASES, body)
            except ApiException as e:
                if e.status == 409:
                    return False
                raise
            self._observe(self.identity, spec_new["renewTime"], now)
            return True

        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        record = (holder, spec.get("renewTime"))
        if record != self._observed:
            self._observe(holder, spec.get("renewTime"), now)
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if holder and holder != self.identity and self._observed_at + duration > now:
            return False  # someone else holds it and it has not expired
        if holder == self.identity:
            spec_new["acquireTime"] = spec.get("acquireTime") or spec_new["renewTime"]
            spec_new["leaseTransitions"] = spec.get("leaseTransitions", 0)
        else:
            spec_new["acquireTime"] = spec_new["renewTime"]
            spec_new["leaseTransitions"] = int(spec.get("leaseTransitions", 0)) + 1
        lease["spec"] = {**spec, **spec_new}
        try:
            self.kube.replace(LEASES, lease)  # carries the resourceVersion we read
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise
        self._observe(self.identity, spec_new["renewTime"], now)
        return True

    def _observe(self, holder: str | None, renew: str | None, at: float) -> None:
        self._observed = (holder, renew)
        self._observed_at = at

    def release(self) -> None:
        """Give the Lease up (only if still ours), so a follower need not wait it out."""
        self.leading.clear()
        try:
            lease = self.kube.get(LEASES, self.name, self.namespace)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = None
                lease["spec"]["leaseDurationSeconds"] = 1
                self.kube.replace(LEASES, lease)
        except (ApiException, OSError) as e:
            log.warning("could not release lease %s: %s", self.name, e)

    def run(
        self,
        stop: threading.Event,
        on_started: Callable[[], None] = lambda: None,
        on_stopped: Callable[[], None] = lambda: None,
        release_on_stop: bool = True,
    ) -> None:
        """Follow until elected, then lead until the lease is lost or `stop`."""
        while not stop.is_set():
            if not self._attempt():
                stop.wait(self.retry_period)
                continue
            log.info("%s: leading (lease %s/%s)", self.identity, self.namespace, self.name)
            self.leading.set()
            on_started()
            last_renew = time.monotonic()
            while not stop.wait(self.retry_period):
                if self._attempt():
                    last_renew = time.monotonic()
                elif time.monotonic() - last_renew > self.renew_deadline:
                    break
            self.leading.clear()
            if stop.is_set() and release_on_stop:
                self.release()
            log.info("%s: stopped leading", self.identity)
            on_stopped()
            return

    def _attempt(self) -> bool:
        self.attempted_at = time.monotonic()
        try:
            return self.try_acquire_or_renew()
        except Exception as e:  # API down: count as a failed attempt, keep trying
            log.warning("lease %s: %s", self.name, e)
            return False
