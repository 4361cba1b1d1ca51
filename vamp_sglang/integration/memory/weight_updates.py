"""Runtime weight updates refused while VAMP repartitions memory (issue 48, defect 9).

SGLang's `update_weights_from_disk`, `_from_tensor`, `_from_distributed` and `_from_ipc` write the new
values into the model's parameters in place (`FusedMoE.w13_weight` / `w2_weight` among them), and
`begin_weight_update` opens the session `_from_tensor` and `_from_distributed` run in, restoring
in-place-packed weights first. With
experts paged (moe_staging.py) the offloaded rows of those tensors are staging slots: a write there is
overwritten by the next staging copy from the expert's host copy, which nothing refreshes, and a restore maps
the old experts back. The server would then serve a mix of old and new experts, silently.

So with VAMP on (a positive --vamp-max-offload-ratio) each of these handlers of SGLang's scheduler-side
`SchedulerWeightUpdaterManager` answers with its own output type, `success=False` and a message naming the
operation, without touching a weight: the HTTP caller gets 400 with that message and the server goes on
serving. Every TP rank refuses the same way before any of SGLang's barriers, as SGLang's own rejections do
(sglang/srt/managers/scheduler_components/weight_updater.py:98, :192-197). With the ratio 0 (stock SGLang)
they run unchanged. Restoring every group first and refreshing the host copies after would make updates
possible; it is not built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vamp_sglang.integration.hooks import Hook

logger = logging.getLogger(__name__)

_MANAGER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
# handler -> its output type in sglang.srt.managers.io_struct
REFUSED = {
    "update_weights_from_disk": "UpdateWeightFromDiskReqOutput",
    "update_weights_from_tensor": "UpdateWeightsFromTensorReqOutput",
    "update_weights_from_distributed": "UpdateWeightsFromDistributedReqOutput",
    "update_weights_from_ipc": "UpdateWeightsFromIPCReqOutput",
    "begin_weight_update": "BeginWeightUpdateReqOutput",
}


def refusal_message(handler: str) -> str:
    return (f"vamp: {handler} is refused while VAMP pages the MoE experts (--vamp-max-offload-ratio > 0): "
            "offloaded experts are served from host copies an in-place update would not reach, so the server "
            "would mix old and new experts. Restart the server with the new weights instead.")


def _vamp_on() -> bool:
    from vamp_sglang.integration import runtime

    state = runtime.current()
    return state is not None and state.config.enabled


def _refusing(handler: str, output_type: str) -> Callable[..., Any]:
    def refuse(original: Callable, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        if not _vamp_on():
            return original(manager, recv_req, *args, **kwargs)
        from sglang.srt.managers import io_struct

        message = refusal_message(handler)
        logger.warning(message)
        return getattr(io_struct, output_type)(success=False, message=message)

    refuse.__name__ = f"refuse_{handler}"
    return refuse


HOOKS = [Hook(f"{_MANAGER}.{handler}", "around", _refusing(handler, output_type),
              f"VAMP on: refuse {handler} (it rewrites weights in place; offloaded experts' host copies would "
              "stay stale) with SGLang's own failure output, the server serving on")
         for handler, output_type in REFUSED.items()]
