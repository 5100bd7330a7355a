"""The floor of the serving benchmark: the same decision work in a bare ASGI server, no Ray.

`python -m launch._bare_asgi --checkpoint PATH --port N` runs uvicorn (httptools, uvloop when
installed: what a Serve replica's HTTP server picks too) with FastAPI and two routes:

    POST /v1/decide  the decision service's own work: read the body, decode it, validate the
                     observations, one forward pass under the policy's guard, check and encode
                     the answer (apex_bdq.serving, as the Serve replica calls it); the same
                     `x-apex-clock` stamps as the replica when asked
    POST /v1/empty   reads the body and answers a constant: the HTTP server alone

`launch.bench serve` measures both with the same client as the Serve ingresses, so each Serve
figure stands beside what the machine does without Serve.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request).
import argparse
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from apex_bdq import serving as S
from apex_bdq.serve_app import CLOCK_HEADER, clock_stamps


def make_app(checkpoint: str) -> FastAPI:
    import torch

    from apex_bdq.checkpoint import load_checkpoint
    from apex_bdq.config import sim_config_from_dict
    torch.set_num_threads(1)  # as a replica (ServeOptions.torch_threads)
    policy = S.policy_from_checkpoint(checkpoint)
    branches = sim_config_from_dict(load_checkpoint(checkpoint)["config"]["sim"]).branch_names
    app = FastAPI()
    empty = S.encode_body({"ok": True}, S.MSGPACK)

    @app.post("/v1/decide")
    async def decide(request: Request) -> Response:
        t0 = time.perf_counter()
        mt = S.media_type(request.headers.get("content-type"))
        raw = await request.body()
        macro, micro, include_q = S.parse_decide(S.decode_body(raw, mt), policy.net.cfg)
        t1 = time.perf_counter()
        actions, q = policy.decide(macro, micro)
        S.check_output(q)
        t2 = time.perf_counter()
        out_mt = S.MSGPACK if mt in S.MSGPACK_TYPES else S.JSON
        body = S.encode_body(S.decision_doc(actions, q if include_q else None, policy.version, out_mt, branches), out_mt)
        t3 = time.perf_counter()
        headers = {CLOCK_HEADER: clock_stamps(t0, t1, t2, t3)} if CLOCK_HEADER in request.headers else None
        return Response(body, media_type=out_mt, headers=headers)

    @app.post("/v1/empty")
    async def empty_route(request: Request) -> Response:
        await request.body()
        return Response(empty, media_type=S.MSGPACK)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "version": policy.version}

    return app


def main(argv=None) -> int:
    import uvicorn
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    uvicorn.run(make_app(a.checkpoint), host="127.0.0.1", port=a.port, access_log=False, log_level="warning",
                lifespan="off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
