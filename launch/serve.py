"""Online decisions with Ray Serve: one deployment, FastAPI ingress, `@serve.batch`.

    python -m launch.serve --checkpoint runs/train/checkpoint.pt      # serve a checkpoint (and reload it when it changes)
    python -m launch.serve --follow --address auto                 # follow a running training run's weight store

The routes (/v1/decide, /v1/feedback, /healthz, /docs) and how a request is decided are
described in apex_bdq/serve_app.py, the deployment this command starts.
Ingress: HAProxy in front of the replicas (`RAY_SERVE_ENABLE_HA_PROXY=1`, the default here,
set before Ray starts; ~3x lower latency than Serve's Python proxy on this machine) or the
default proxy (`--ingress proxy`). Private by default: the service on 127.0.0.1 (`--host`),
HAProxy's stats page and exporter on loopback and its admin socket owner-only
(apex_bdq/haproxy_ingress.py; `--expose-haproxy-stats` keeps Ray's template), the token for
/v1/feedback and /v1/status from a file (`--token-file`, $APEX_BDQ_FEEDBACK_TOKEN_FILE) or
$APEX_BDQ_FEEDBACK_TOKEN, never from the command line.
"""

import argparse
import os
import sys
from typing import Optional

from ray import serve

from apex_bdq import serving as S
from apex_bdq.serve_app import ServeOptions, ensure_preference_actor, start

def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.serve", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint to serve (default runs/train/checkpoint.pt); reloaded on change")
    src.add_argument("--follow", action="store_true", help="follow the training run's weight store on this cluster")
    ap.add_argument("--address", default=None, help="Ray cluster (default: start a local one; 'auto': the running one)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default loopback; 0.0.0.0 to serve other machines)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy",
                    help="HAProxy in front of the replicas (default) or Serve's Python proxy; applies when this "
                         "command starts Ray")
    ap.add_argument("--no-batching", action="store_true")
    ap.add_argument("--max-batch-shards", type=int, default=1024, help="shards per batched forward pass")
    ap.add_argument("--batch-wait-ms", type=float, default=0.0)
    ap.add_argument("--max-ongoing", type=int, default=256, help="requests a replica works on at once")
    ap.add_argument("--max-queued", type=int, default=1024,
                    help="requests waiting for a replica; past it 503 with Retry-After")
    ap.add_argument("--expose-haproxy-stats", action="store_true",
                    help="leave HAProxy's stats page (8404) and exporter (9101) on every interface, as Ray's "
                         "template has them (default: loopback only)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--reload-s", type=float, default=2.0)
    ap.add_argument("--user-code-thread", action="store_true",
                    help="run the handler on a second event loop in its own thread (Serve's default; off here)")
    ap.add_argument("--token-file", default=None,
                    help="file holding the bearer token for /v1/feedback and /v1/status (mode 600, >= 16 chars; "
                         "default: $APEX_BDQ_FEEDBACK_TOKEN_FILE, else $APEX_BDQ_FEEDBACK_TOKEN; none = refused)")
    ap.add_argument("--no-guard", action="store_true",
                    help="serve the bare network's greedy actions (default: under the policy's guard)")
    ap.add_argument("--feedback-log", default=None,
                    help="start a preference actor writing this log when no training run provides one")
    a = ap.parse_args(argv)
    if a.feedback_log and a.follow:
        print("error: --feedback-log needs --checkpoint (a following server uses the run's preference actor)",
              file=sys.stderr)
        return 2
    checkpoint = None if a.follow else (a.checkpoint or "runs/train/checkpoint.pt")
    if checkpoint is not None and not os.path.isfile(checkpoint):
        print(f"error: checkpoint {checkpoint!r} does not exist (train one with `make run`, or pass --checkpoint "
              f"PATH / --follow)", file=sys.stderr)
        return 2
    try:
        opts = ServeOptions(checkpoint=checkpoint, follow=a.follow, batching=not a.no_batching,
                            max_batch_shards=a.max_batch_shards, batch_wait_s=a.batch_wait_ms / 1e3,
                            max_ongoing_requests=a.max_ongoing, max_queued_requests=a.max_queued,
                            replicas=a.replicas, replica_cpus=a.replica_cpus,
                            torch_threads=a.torch_threads, reload_s=a.reload_s,
                            feedback_token=S.load_token(a.token_file), user_code_thread=a.user_code_thread,
                            guard=not a.no_guard)
        if checkpoint is not None:  # a bad file (or a guard without its trace) fails here, not in a replica
            S.policy_from_checkpoint(checkpoint, guard=not a.no_guard)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.address is None:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1" if a.ingress == "haproxy" else "0"
        if a.ingress == "haproxy":
            from apex_bdq.haproxy_ingress import private_ingress_env
            os.environ.update(private_ingress_env(a.port, expose=a.expose_haproxy_stats))
    import ray
    ray.init(address=a.address, logging_level="ERROR")
    if a.feedback_log:
        from apex_bdq.checkpoint import load_checkpoint, net_config_of
        _, created = ensure_preference_actor(net_config_of(load_checkpoint(checkpoint)), a.feedback_log)
        print(f"feedback: {'started a preference actor writing' if created else 'a preference actor already runs;'} "
              f"{a.feedback_log if created else 'using it'}")
    import signal
    import threading
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored there)
        signal.signal(sig, lambda *_: stop.set())
    start(opts, port=a.port, host=a.host)
    print(f"serving {'the weight store' if a.follow else checkpoint} on http://{a.host}:{a.port} "
          f"(/v1/decide, /v1/feedback, /healthz, /docs); ingress {a.ingress}; Ctrl-C stops")
    while not stop.wait(0.5):  # a timed wait lets the signal handlers run
        pass
    print("stopping: Serve shuts down, then Ray")
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
