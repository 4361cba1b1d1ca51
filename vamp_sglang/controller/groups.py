"""Which ranks hold one agreement round: the ranks that share one KV pool.

Under plain TP every TP rank runs the same batch on a replica of one pool, so the round spans the TP group.
Under DP attention (`--enable-dp-attention --dp-size D`) each DP rank has its own scheduler, radix tree and
KV pool and reaches the shortfall funnel on its own: the round spans that DP rank's attention-TP group,
SGLang's `get_dp_tp_group()` (layers/dp_attention.py), and its attention-CP peers, with rank 0 as leader and one
endpoint per DP rank (ipc socket `vamp-ctl-<g>.sock`, or TCP port + g). A DP rank therefore never waits on
another DP rank's round, and with attention-TP 1 (the DeepSeek/Kimi preset, tp 8 dp 8) there is no round.
Plain `--dp-size` replicas without DP attention are separate TP groups, one per replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoundGroup:
    rank: int  # this process's place in the group (0 leads)
    world_size: int  # ranks in the group; 1 holds no round and opens no socket
    group_id: int  # the group's endpoint index, unique among the groups sharing one ipc dir or TCP port
    dp_rank: int | None  # the DP rank whose pool the group holds (None: no data parallelism)


def round_group(tp_rank: int, tp_size: int, attn_tp_size: int, dp_attention: bool, attn_cp_size: int = 1,
                replica_dp_rank: int | None = None) -> RoundGroup:
    """The round group of TP rank `tp_rank`. SGLang lays ranks out (dp, cp, tp) with tp fastest
    (runtime_context.derive_attention_ranks), so one DP rank's ranks are `attn_tp_size * attn_cp_size`
    consecutive TP ranks. Its attention-CP peers run the same batch on the same pool, and SGLang checks
    that they and the attention-TP ranks agree (managers/scheduler.py init_rank_consensus_checker), so
    the round spans both: pools that grew apart there would make the replicated schedulers diverge."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}) (got {tp_rank})")
    if not dp_attention:
        return RoundGroup(tp_rank, tp_size, replica_dp_rank or 0, replica_dp_rank)
    if min(attn_tp_size, attn_cp_size) < 1 or tp_size % (attn_tp_size * attn_cp_size):
        raise ValueError(f"attention-TP size {attn_tp_size} x attention-CP size {attn_cp_size} must divide "
                         f"the TP size {tp_size}")
    span = attn_tp_size * attn_cp_size
    return RoundGroup(tp_rank % span, span, tp_rank // span, tp_rank // span)


def sglang_round_group() -> RoundGroup:
    """This scheduler process's round group, read from SGLang's published parallel state."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    dp_attention = bool(parallel.attn_dp_enabled)
    return round_group(parallel.tp_rank, parallel.tp_size, parallel.attn_tp_size, dp_attention,
                       parallel.attn_cp_size, None if dp_attention else _replica_dp_rank(parallel))


def _replica_dp_rank(parallel: Any) -> int | None:
    try:
        return parallel.dp_rank
    except RuntimeError:  # not written: no data-parallel controller
        return None
