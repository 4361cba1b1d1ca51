"""The six CPU speculative-decoding ops SGLang 0.5.23 imports from `sgl_kernel`, in plain torch.

SGLang calls them under `is_cpu()` where a GPU launches their Triton twins, so the twins define what each
must do (sglang/kernels/ops/speculative/eagle.py:13-90, cache_locs.py:39-110 and 500-531,
spec_tree.py:52-318); the argument lists are those of the CPU call sites (eagle.py:40, 80;
cache_locs.py:99, 740; spec_tree.py:412, 510). Every op writes its outputs in place, as the kernels do.
The two tree ops walk one request at a time in Python: a CPU batch is a few requests of a few draft tokens.
"""

from __future__ import annotations

import torch

FULL_MASK, QLEN_ONLY = 0, 1  # spec_tree.TreeMaskMode values the Triton tree builder lays out


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """bonus_tokens[i] = request i's last accepted token: accept_tokens[i * stride + accept_lens[i] - 1]."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    flat = accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1]
    bonus_tokens.copy_(flat.to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """Pack the KV slots of accepted draft tokens: each accept_index entry != -1, in order, names the
    out_cache_loc entry that goes to the next free place of accept_out_cache_loc."""
    index = accept_index.reshape(-1)
    kept = index[index != -1].long()
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_cols: int) -> None:
    """Request i's topk * num_cols draft slots: its req->token row from column seq_lens[i] on."""
    width = topk * num_cols
    rows = req_to_token.reshape(-1, pool_len)[req_pool_indices.long()]
    columns = seq_lens.long().unsqueeze(1) + torch.arange(width, device=seq_lens.device)
    out_cache_loc[:rows.shape[0] * width] = torch.gather(rows, 1, columns).reshape(-1).to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Columns [start_offset[i], end_offset[i]) of request i's req->token row, requests back to back."""
    table = req_to_token.reshape(-1, pool_len)
    written = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(),
                               strict=True):
        out_cache_loc[written:written + end - start] = table[row, start:end].to(out_cache_loc.dtype)
        written += end - start


def _parent_position(selected: list[int], parents: list[int], slot: int, topk: int) -> int | None:
    """Where draft token `slot`'s parent sits among the drafts (0: the root); None if it is not there."""
    parent_block = selected[slot] // topk
    if parent_block == 0:
        return 0
    parent_token = parents[parent_block]
    return next((pp + 1 for pp, token in enumerate(selected) if token == parent_token), None)


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrieve_index: torch.Tensor,
                                    retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """The draft tree of each request: retrieval links (first child, next sibling), each token's
    position (seq_len + its depth) and its attention row over the draft tokens (itself and its
    ancestors). FULL_MASK rows also span the request's seq_len prefix columns (left as the caller set
    them); QLEN_ONLY rows hold the draft columns only. retrieve_next_* come in filled with -1."""
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY):
        raise ValueError(f"build_tree_kernel_efficient_cpu: tree_mask_mode {tree_mask_mode} is not laid out "
                         "on CPU")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    prefix_sums = [sum(seq_lens[:b]) for b in range(len(seq_lens))]
    mask, pos = tree_mask.reshape(-1), positions.reshape(-1)
    index, next_token, next_sibling = (t.reshape(-1) for t in (retrieve_index, retrieve_next_token,
                                                              retrieve_next_sibling))
    for b, seq_len in enumerate(seq_lens):
        selected = selected_index[b, :n - 1].tolist()
        parents = parent_list[b].tolist()
        base = b * n
        pos[base] = seq_len
        for i in range(n - 1, 0, -1):
            index[base + i] = base + i
            parent = _parent_position(selected, parents, i - 1, topk)
            if parent is not None:
                previous = int(next_token[base + parent])
                next_token[base + parent] = i
                if previous != -1:
                    next_sibling[base + i] = previous
        index[base] = base
        for x in range(n):
            if tree_mask_mode == FULL_MASK:  # after the rows of earlier requests, each seq_len + n wide
                row = n * n * b + prefix_sums[b] * n + (seq_len + n) * x + seq_len + 1
            else:
                row = n * n * b + n * x + 1
            mask[row - 1] = True
            mask[row:row + n - 1] = False
            if x == 0:
                continue
            slot, level = x - 1, 0
            for _ in range(depth):
                level += 1
                mask[row + slot] = True
                parent = _parent_position(selected, parents, slot, topk)
                if parent is None or parent == 0:
                    break
                slot = parent - 1
            pos[base + x] = seq_len + level


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor,
                           retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                           target_predict: torch.Tensor) -> None:
    """Greedy acceptance: from the root, follow the child (first child, then its siblings) whose draft
    token equals the target's prediction at the last accepted token, as long as one does. Writes the
    accepted tokens' retrieve indices (accept_index[b, 0] the root), their count (root excluded), and at
    each accepted position, and the last one, the target's token (predicts)."""
    batch = candidates.shape[0]
    spec_tokens = accept_index.shape[1]
    flat_predicts, flat_target = predicts.reshape(-1), target_predict.reshape(-1)
    for b in range(batch):
        index, tokens = retrive_index[b].tolist(), candidates[b].tolist()
        first_child, sibling = retrive_next_token[b].tolist(), retrive_next_sibling[b].tolist()
        last = index[0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, spec_tokens):
            cur = first_child[cur]
            target = int(flat_target[last])
            while cur != -1 and tokens[cur] != target:
                cur = sibling[cur]
            if cur == -1:
                break
            flat_predicts[last] = target
            accepted += 1
            accept_index[b, accepted] = index[cur]
            last = index[cur]
        accept_token_num[b] = accepted
        flat_predicts[last] = flat_target[last]
