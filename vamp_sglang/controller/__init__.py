"""TP ranks agree over ZMQ on how many KV tokens to add, so every rank remaps that amount or none.

- `messages`: the wire messages (typed dataclasses) and their one strict msgpack serializer.
- `ipc`: the private 0700 directory that holds the sockets (one node).
- `tcp`, `keys`, `multinode`: across nodes, TCP with CURVE and a per-deployment key file
  (`python -m vamp_sglang.controller keygen PATH`), chosen and checked by the launcher.
- `agreement`: `RankController`, the two-phase agreement (`agree_min`, then `all_ok`).
- `groups`: which ranks hold a round: the TP group, or under DP attention each DP rank's attention-TP group.
"""

from vamp_sglang.controller.agreement import RankController
from vamp_sglang.controller.ipc import ControllerError, make_private_ipc_dir
from vamp_sglang.controller.messages import MalformedMessage

__all__ = ["ControllerError", "MalformedMessage", "RankController", "make_private_ipc_dir"]
