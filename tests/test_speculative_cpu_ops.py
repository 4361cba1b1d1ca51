"""The CPU shim's six speculative ops against their Triton twins, which define what each must do.

The twins (SGLang 0.5.23's sglang/kernels/ops/speculative/{eagle,cache_locs,spec_tree}.py) run under
Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors) in a child process on the same hand-built inputs:
a chain draft (top-k 1, what a CPU server runs) and a top-k 2 tree with siblings. Each case is also
checked against values worked out by hand, so a twin that changed meaning would show too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from vamp_sglang.cpu import SHIM_DIR

# A chain (top-k 1, 3 steps, 4 draft tokens) and a top-k 2 tree (2 steps, 4 draft tokens: root, two
# children of the root, one grandchild under the first child), two requests each.
TREES = {
    "chain": {"parent_list": [[-1, 0, 1], [-1, 0, 1]], "selected": [[0, 1, 2], [0, 1, 2]],
              "seq_lens": [5, 3], "topk": 1, "depth": 3, "n": 4},
    "tree": {"parent_list": [[-1, 0, 1], [-1, 0, 1]], "selected": [[0, 1, 3], [0, 1, 4]],
             "seq_lens": [5, 3], "topk": 2, "depth": 2, "n": 4},
}
# Verify: candidates[b] = [root token, draft tokens...]; target_predict[b, i] = the target's next token
# after draft token i.
VERIFY = {"candidates": [[7, 11, 12, 13], [7, 21, 22, 23]],
          "target": [[11, 12, 99, 98], [21, 97, 96, 95]]}

TWINS = r"""
import json, sys, torch
from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree
cases = json.loads(sys.stdin.read())
out = {}
for name, t in cases["trees"].items():
    bs, n = len(t["seq_lens"]), t["n"]
    for mode in (0, 1):
        mask_len = sum(s * n + n * n for s in t["seq_lens"]) if mode == 0 else bs * n * n
        mask = torch.ones(mask_len, dtype=torch.bool)
        pos = torch.zeros(bs * n, dtype=torch.int64)
        idx, nxt, sib = (torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))
        spec_tree.sgl_build_tree_kernel_triton(torch.tensor(t["parent_list"]), torch.tensor(t["selected"]),
            torch.tensor(t["seq_lens"]), mask, pos, idx, nxt, sib, t["topk"], t["depth"], n,
            spec_tree.TreeMaskMode(mode))
        out[f"{name}/{mode}"] = [mask.int().tolist(), pos.tolist(), idx.tolist(), nxt.tolist(), sib.tolist()]
        if mode == 1:
            predicts = torch.zeros(bs * n, dtype=torch.int64)
            accept = torch.full((bs, t["depth"] + 1), -1, dtype=torch.int64)
            count = torch.zeros(bs, dtype=torch.int64)
            candidates, target = (torch.tensor(cases["verify"][key]) for key in ("candidates", "target"))
            spec_tree.verify_tree_greedy_triton(predicts, accept, count, candidates, idx, nxt, sib, target)
            out[f"{name}/verify"] = [predicts.tolist(), accept.tolist(), count.tolist()]
table = torch.arange(40, dtype=torch.int32).view(4, 10) + 100
rows, lens = torch.tensor([2, 0]), torch.tensor([3, 6])
locs = torch.zeros(8, dtype=torch.int64)
cache_locs.assign_draft_cache_locs_contiguous[(2,)](rows, table, lens, locs, 10, 2, 2)
out["draft_locs"] = locs.tolist()
ext = torch.zeros(64, dtype=torch.int64)  # room for the interpreter's whole 32-lane block per request
cache_locs.assign_extend_cache_locs[(2,)](rows, table, lens, torch.tensor([7, 10]), ext, 10, 2)
out["extend_locs"] = ext[:8].tolist()
acc = torch.full((6,), -7, dtype=torch.int64)
eagle.fill_accept_out_cache_loc[(6,)](torch.tensor([0, -1, 2, 3, -1, 5]), torch.arange(6) * 10, acc, 8)
out["accept_locs"] = acc.tolist()
bonus = torch.zeros(2, dtype=torch.int64)
eagle.fill_bonus_tokens[(2,)](torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.tensor([2, 3]), bonus, 3)
out["bonus"] = bonus.tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("vamp_test_sgl_kernel_speculative",
                                                  SHIM_DIR / "sgl_kernel" / "speculative.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def twins():
    """The Triton kernels' outputs, interpreted on CPU (outside CPU mode: SGLang imports no sgl_kernel)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE")}
    env |= {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cases = json.dumps({"trees": TREES, "verify": VERIFY})
    result = subprocess.run([sys.executable, "-c", TWINS], input=cases, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def build(ops, t, mode):
    bs, n = len(t["seq_lens"]), t["n"]
    mask_len = sum(s * n + n * n for s in t["seq_lens"]) if mode == 0 else bs * n * n
    mask = torch.ones(mask_len, dtype=torch.bool)
    pos = torch.zeros(bs * n, dtype=torch.int64)
    idx, nxt, sib = (torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))
    ops.build_tree_kernel_efficient_cpu(torch.tensor(t["parent_list"]), torch.tensor(t["selected"]),
                                        torch.tensor(t["seq_lens"]), mask, pos, idx, nxt, sib, t["topk"],
                                        t["depth"], n, mode)
    return mask, pos, idx, nxt, sib


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("mode", [0, 1])
def test_build_tree_matches_triton(ops, twins, name, mode):
    mask, pos, idx, nxt, sib = build(ops, TREES[name], mode)
    built = [mask.int().tolist(), pos.tolist(), idx.tolist(), nxt.tolist(), sib.tolist()]
    assert built == twins[f"{name}/{mode}"]


def test_chain_tree_is_causal_and_positions_count_up(ops):
    mask, pos, idx, nxt, sib = build(ops, TREES["chain"], 1)
    assert torch.equal(mask.view(2, 4, 4), torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(2, 4, 4))
    assert pos.tolist() == [5, 6, 7, 8, 3, 4, 5, 6]
    assert nxt.tolist() == [[1, 2, 3, -1]] * 2 and sib.tolist() == [[-1] * 4] * 2
    assert idx.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_tree_links_siblings_and_depths(ops):
    _, pos, _, nxt, sib = build(ops, TREES["tree"], 1)
    # request 0: root -> {1, 2}, 1 -> 3 (grandchild); request 1: root -> {1, 2}, 2 -> 3
    assert nxt.tolist() == [[1, 3, -1, -1], [1, -1, 3, -1]]
    assert sib.tolist() == [[-1, 2, -1, -1], [-1, 2, -1, -1]]  # the first child links to its next sibling
    assert pos.tolist() == [5, 6, 6, 7, 3, 4, 4, 5]


@pytest.mark.parametrize("name", sorted(TREES))
def test_verify_greedy_matches_triton(ops, twins, name):
    t = TREES[name]
    _, _, idx, nxt, sib = build(ops, t, 1)
    predicts = torch.zeros(8, dtype=torch.int64)
    accept = torch.full((2, t["depth"] + 1), -1, dtype=torch.int64)
    count = torch.zeros(2, dtype=torch.int64)
    ops.verify_tree_greedy_cpu(predicts, accept, count, torch.tensor(VERIFY["candidates"]), idx, nxt, sib,
                               torch.tensor(VERIFY["target"]))
    assert [predicts.tolist(), accept.tolist(), count.tolist()] == twins[f"{name}/verify"]
    if name == "chain":  # request 0 accepts drafts 11 and 12 then gets 99; request 1 accepts 21 then 97
        assert count.tolist() == [2, 1] and accept.tolist() == [[0, 1, 2, -1], [4, 5, -1, -1]]
        assert predicts.tolist() == [11, 12, 99, 0, 21, 97, 0, 0]


def test_cache_loc_and_accept_ops_match_triton(ops, twins):
    table = torch.arange(40, dtype=torch.int32).view(4, 10) + 100
    rows, lens = torch.tensor([2, 0]), torch.tensor([3, 6])
    locs = torch.zeros(8, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rows, table, lens, locs, 10, 2, 2)
    assert locs.tolist() == twins["draft_locs"] == [123, 124, 125, 126, 106, 107, 108, 109]
    ext = torch.zeros(8, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rows, table, lens, torch.tensor([7, 10]), ext, 10)
    assert ext.tolist() == twins["extend_locs"] == [123, 124, 125, 126, 106, 107, 108, 109]
    acc = torch.full((6,), -7, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(torch.tensor([0, -1, 2, 3, -1, 5]), torch.arange(6) * 10, acc)
    assert acc.tolist() == twins["accept_locs"] == [0, 20, 30, 50, -7, -7]
    bonus = torch.zeros(2, dtype=torch.int64)
    ops.fill_bonus_tokens_cpu(torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == twins["bonus"] == [5, 9]


def test_bitpacked_tree_masks_are_refused_by_name(ops):
    t = TREES["chain"]
    with pytest.raises(ValueError, match="tree_mask_mode 2"):
        ops.build_tree_kernel_efficient_cpu(torch.tensor(t["parent_list"]), torch.tensor(t["selected"]),
                                            torch.tensor(t["seq_lens"]), torch.ones(32, dtype=torch.bool),
                                            torch.zeros(8, dtype=torch.int64), *(torch.full((2, 4), -1)
                                                                                 for _ in range(3)),
                                            1, 3, 4, 2)
