"""`GET /vamp/stats`: the live scheduler's VAMP snapshot, served on SGLang's HTTP port.

The HTTP server runs in the launcher process, which holds only copies of the settings; the pool,
tree and experts live in the scheduler processes. So the handler asks the scheduler through
SGLang's own internal-state request, to which our runtime hook adds the `vamp` entry.

Under DP attention each DP rank has its own scheduler, pool and decisions. SGLang 0.5.23 sends the request to
DP rank 0's leader, which broadcasts it over the whole TP group, and every DP rank's attention-TP rank 0
answers (`recv_requests`: control requests broadcast over tp_group; scheduler.init_ipc_channels: each
attention-TP rank 0 holds a socket to the tokenizer); the tokenizer manager waits for one answer per DP rank
(`FanOutCommunicator(..., num_dp_ranks)`, tokenizer_control_mixin.init_communicators), in arrival order. The
body is DP rank 0's snapshot, as on a server without DP, and `dp_ranks` lists every DP rank's, by `dp_rank`.
"""

from __future__ import annotations

from typing import Any

ROUTE = "/vamp/stats"


async def vamp_stats() -> Any:
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints import http_server

    state = http_server.get_global_state()
    if state is None:
        return JSONResponse({"error": "server is starting"}, status_code=503)
    internal = await state.tokenizer_manager.get_internal_state()
    snapshots = [s["vamp"] for s in internal if "vamp" in s]
    if not snapshots:
        return JSONResponse({"error": "no scheduler answered with VAMP stats"}, status_code=503)
    snapshots.sort(key=lambda snapshot: snapshot.get("dp_rank") or 0)
    body = dict(snapshots[0])
    if len(snapshots) > 1:
        body["dp_ranks"] = snapshots
    return body


def install() -> None:
    """Add the route to SGLang's FastAPI app (module level, before uvicorn starts)."""
    from sglang.srt.entrypoints.http_server import app

    if not any(getattr(r, "path", None) == ROUTE for r in app.router.routes):
        app.add_api_route(ROUTE, vamp_stats, methods=["GET"])
