"""The CSI Identity service: who we are, and whether the plugin itself works."""

from __future__ import annotations

import logging

import grpc
from google.protobuf import wrappers_pb2

from mtcfs import __version__
from mtcfs.csi import DRIVER_NAME
from mtcfs.csi.node import RebindLoop
from mtcfs.csi.rpc import handler
from mtcfs.csi.v1 import csi_pb2, csi_pb2_grpc

log = logging.getLogger("mtcfs.csi")


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def __init__(self, rebind: RebindLoop) -> None:
        self.rebind = rebind
        self._last_ready: bool | None = None

    @handler()
    def GetPluginInfo(self, request: csi_pb2.GetPluginInfoRequest,
                      context: grpc.ServicerContext) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @handler()
    def GetPluginCapabilities(self, request: csi_pb2.GetPluginCapabilitiesRequest,
                              context: grpc.ServicerContext
                              ) -> csi_pb2.GetPluginCapabilitiesResponse:
        # Node service only: no controller, no topology constraints.
        return csi_pb2.GetPluginCapabilitiesResponse()

    @handler(level=logging.DEBUG)  # the liveness probe sidecar calls it every few seconds
    def Probe(self, request: csi_pb2.ProbeRequest,
              context: grpc.ServicerContext) -> csi_pb2.ProbeResponse:
        # The livenessprobe sidecar restarts the plugin when this fails, so it
        # reports the plugin's own health: it answers, and its re-bind loop runs.
        # Not the node daemon's: restarting the plugin cannot help a daemon that is
        # down, and the kubelet's back-off would delay the re-binds after it returns
        # (NodePublishVolume answers UNAVAILABLE meanwhile).
        ready = self.rebind.alive()
        if ready != self._last_ready:
            if not ready:
                log.error("not ready: the re-bind loop has stopped")
            self._last_ready = ready
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=ready))
