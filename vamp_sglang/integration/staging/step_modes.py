"""Which rows and which path a step's MoE layers take (issue 49): host-computed cold experts or staging,
and which top-k rows are the step's real tokens."""

from __future__ import annotations

from typing import Any

from vamp_sglang.memory.staging_choice import HOST


def host_step(experts: Any) -> bool:
    """Whether this step computes cold experts on the host (`ModelExperts`): every step under
    `--vamp-staging host` (also while a graph is captured), and the steps `auto` picks host for."""
    return experts.host is not None and HOST in (experts.engine.chooser.policy, experts.engine.step_mode)


def moe_sees_local_tokens() -> bool:
    """Whether the MoE kernel's top-k rows are this rank's own tokens, so rows past the step's token count
    are CUDA-graph padding: not under DP attention (rows gathered from every DP rank) nor an all-to-all
    dispatcher (tokens received from other ranks). SGLang masks padded rows itself only where
    `enable_num_token_non_padded()` (EP, DP gathers), not under plain TP, where a graph replayed at a
    larger batch routes its padded rows like tokens."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return not is_dp_attention_enabled() and get_moe_a2a_backend().is_none()
