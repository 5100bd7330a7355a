"""KEDA external scaler: a gRPC service (KEDA's `externalscaler.proto`) that answers each
ScaledObject — one per request class / Deployment — with the metric that makes KEDA's HPA
reach the controller's replica count.

A ScaledObject's trigger names its class in the metadata (`class: <name>`, as in the
telemetry config). `GetMetricSpec` answers the metric `apex-bdq-<class>` with target 1
(AverageValue); `GetMetrics` answers the class's replicas from the newest decision
(`Controller.current`), so HPA's formula ceil(value / target) sets those replicas — once its
tolerance lets it (changes within 10 % wait unless the HPA's `behavior` sets `tolerance: 0`)
and with no stabilisation of its own (the manifests set the windows to 0: the policy holds).
With nothing to decide on (no telemetry and no replica count known) it answers UNAVAILABLE:
HPA keeps the replicas and KEDA applies the ScaledObject's `fallback` if one is set.
`IsActive` is true unless the class allows scale to zero (`allowZero: "true"` in the
metadata) and the newest reading shows it idle (no requests in flight; a class whose
telemetry is missing counts as active); `StreamIsActive` pushes it every `stream_s`.
The messages are built from the .proto at run time (grpcio-tools), nothing generated is
committed.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Optional

PROTO_DIR = Path(__file__).parent / "proto"
METRIC_PREFIX = "apex-bdq-"


def load_proto():
    """(messages, services) modules of externalscaler.proto (compiled in memory)."""
    import grpc
    if str(PROTO_DIR) not in sys.path:
        sys.path.append(str(PROTO_DIR))
    return grpc.protos_and_services("externalscaler.proto")


class ScalerError(ValueError):
    pass


def make_servicer(controller, stream_s: float = 5.0):
    pb, svc = load_proto()
    import grpc

    index = {c: k for k, c in enumerate(controller.classes)}

    def class_of(ref, context) -> int:
        name = ref.scalerMetadata.get("class", "")
        if name not in index:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"ScaledObject {ref.namespace}/{ref.name}: metadata class={name!r} is not one of "
                          f"{list(index)}")
        return index[name]

    def allow_zero(ref) -> bool:
        return ref.scalerMetadata.get("allowZero", "false").lower() == "true"

    class Servicer(svc.ExternalScalerServicer):
        def IsActive(self, request, context):
            k = class_of(request, context)
            d = controller.current()
            return pb.IsActiveResponse(result=not (allow_zero(request) and d.idle(k)))

        def StreamIsActive(self, request, context):
            k = class_of(request, context)
            while context.is_active():
                d = controller.current()
                yield pb.IsActiveResponse(result=not (allow_zero(request) and d.idle(k)))
                time.sleep(stream_s)

        def GetMetricSpec(self, request, context):
            k = class_of(request, context)
            return pb.GetMetricSpecResponse(metricSpecs=[pb.MetricSpec(
                metricName=METRIC_PREFIX + controller.classes[k], targetSize=1, targetSizeFloat=1.0)])

        def GetMetrics(self, request, context):
            k = class_of(request.scaledObjectRef, context)
            d = controller.current()
            if d.applied is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "no decision: telemetry missing and no replica count known ("
                              + "; ".join(d.problems[:3]) + ")")
            v = int(d.applied[k])
            return pb.GetMetricsResponse(metricValues=[pb.MetricValue(
                metricName=request.metricName or METRIC_PREFIX + controller.classes[k], metricValue=v,
                metricValueFloat=float(v))])

    return Servicer(), svc


class ScalerServer:
    """The gRPC server (insecure on `host`, or TLS with cert/key files) plus a loop that
    decides every `sync_s` even when KEDA does not ask (shadow mode logs on its own)."""

    def __init__(self, controller, host: str = "127.0.0.1", port: int = 0, tls: Optional[tuple] = None,
                 loop: bool = True, stream_s: float = 5.0, workers: Optional[int] = None) -> None:
        import grpc
        self.controller = controller
        servicer, svc = make_servicer(controller, stream_s)
        # Each open StreamIsActive holds a worker thread: room for one per class and as many calls.
        workers = workers or 2 * len(controller.classes) + 8
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="keda"))
        svc.add_ExternalScalerServicer_to_server(servicer, self.server)
        addr = f"{host}:{port}"
        if tls:
            cert, key = (Path(p).read_bytes() for p in tls)
            self.port = self.server.add_secure_port(addr, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise ScalerError(f"cannot listen on {addr}")
        self.server.start()
        self._stop = threading.Event()
        self._thread = None
        if loop:
            self._thread = threading.Thread(target=self._loop, name="decide", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.controller.current()
            except Exception as e:  # noqa: BLE001 - the loop logs and keeps deciding
                print(f"apex-bdq scaler: decision failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            self._stop.wait(min(1.0, self.controller.ctl.sync_s / 3))

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        self.server.stop(grace_s).wait()
        if self._thread is not None:
            self._thread.join(5)
        self.controller.close()


def client(target: str):
    """(stub, messages) for a scaler at host:port (what KEDA is, for tests and benches)."""
    import grpc
    pb, svc = load_proto()
    channel = grpc.insecure_channel(target)
    return svc.ExternalScalerStub(channel), pb, channel


class KedaHpa:
    """What KEDA and the HPA it creates do with this scaler, for tests, the replay demo and
    the bench: one ScaledObject per class (metadata `class`), GetMetricSpec once, then every
    sync period GetMetrics per class and HPA's formula for an AverageValue target
    (`control.hpa_desired`, tolerance 0.1 unless the HPA's behavior sets it)."""

    def __init__(self, target: str, classes, namespace: str = "default", tolerance: float = 0.1,
                 deployment_prefix: str = "") -> None:
        self.stub, self.pb, self.channel = client(target)
        self.tolerance = tolerance
        self.refs = [self.pb.ScaledObjectRef(name=f"{deployment_prefix}{c}", namespace=namespace,
                                             scalerMetadata={"class": c}) for c in classes]
        self.specs = [self.stub.GetMetricSpec(r).metricSpecs[0] for r in self.refs]

    def sync(self, current):
        """(replicas HPA sets [K], metric values KEDA read [K], seconds the K calls took)."""
        import numpy as np

        from apex_bdq.control import hpa_desired
        t = time.perf_counter()
        vals = np.array([self.stub.GetMetrics(self.pb.GetMetricsRequest(scaledObjectRef=r, metricName=s.metricName))
                         .metricValues[0].metricValueFloat for r, s in zip(self.refs, self.specs)])
        took = time.perf_counter() - t
        target = np.array([s.targetSizeFloat or float(s.targetSize) for s in self.specs])
        return hpa_desired(current, vals, target, self.tolerance), vals, took

    def close(self) -> None:
        self.channel.close()
