"""gpu_check section `grown_attention` (issue 48, defects 1, 2, 7): attention over an MLA latent buffer
(DeepSeek shapes: 512 latent + 64 RoPE per token, one KV head) that VAMP grows in place while a captured CUDA
graph holds the decode kernels. Each case captures at the start-up size, grows the buffer by one granule,
writes a distinctive row or page above the old size, points the captured index at it, replays, and compares
with the same call made eagerly on the grown buffer. What SGLang 0.5.23 would run:

- `fp8_to_bf16_captured` (defect 1; torch only): fa3 and flashinfer MLA convert the whole fp8 latent pool
  to bf16 at every decode call (flashattention_backend.py:2350, flashinfer_mla_backend.py:822). Captured,
  the conversion keeps its start-up row count: rows above it are never converted, and the kernels then read
  past the end of the graph-pool temporary. Reported, not failed: VAMP refuses fp8 latents on these backends.
- `triton_gather` (the path VAMP serves: pointer and stride reads, as SGLang's Triton MLA decode): a Triton
  kernel gathers the grown row by pointer inside the graph, fp8 -> bf16. Must equal eager.
- `flash_mla` (defect 2; needs the `flash_mla` module of the sgl-flash-mla wheel): dense bf16 decode over
  `[pages, 64, 1, 576]`; its TMA descriptor carries the page count of the capture. Reported, not failed.
- `fa3_page1` (needs `sgl_kernel`): FA3's absorbed-MLA decode at page size 1, 16 query heads (non-TMA): VAMP
  serves it, must equal eager. `fa3_tma_page64` (defect 7): page size 64 and 128 query heads per KV head,
  FA3's TMA path for paged KV. Reported, not failed.

A case whose module is missing reports what it needs and is skipped. No case indexes past a tensor's size
with a bounds-checked torch kernel (a device assert would end every later section)."""

from __future__ import annotations

import functools
import traceback

import torch

from vamp_sglang.memory.backend import PageBackend
from vamp_sglang.memory.kv_buffers import GrowableKVBuffers

LATENT, ROPE = 512, 64
HEAD_DIM = LATENT + ROPE
FP8 = torch.float8_e4m3fn
_OPEN: list[GrowableKVBuffers] = []  # the current case's buffers


def check(backend: PageBackend, gpu: bool) -> dict:
    """Attention over a grown KV / latent buffer inside a captured CUDA graph: fp8 -> bf16 conversion,
    Triton gather, flash_mla and FA3 (sgl_kernel) where importable; replay against eager."""
    cases = {"fp8_to_bf16_captured": lambda: _fp8_to_bf16_captured(backend),
             "triton_gather": lambda: _triton_gather(backend), "flash_mla": lambda: _flash_mla(backend),
             "fa3_page1": lambda: _fa3(backend, page_size=1, q_heads=16),
             "fa3_tma_page64": lambda: _fa3(backend, page_size=64, q_heads=128)}
    result = {name: _case(run) for name, run in cases.items()}
    served = ("triton_gather", "fa3_page1")  # what VAMP runs; the others are refused with VAMP on
    result["ok"] = all("error" not in result[name] and result[name].get("replay_equals_eager", True)
                       for name in served)
    return result


def _case(run) -> dict:
    """One case; an error is reported with it and its buffers closed, so the cases after it still run
    (a CUDA error ends them too)."""
    try:
        return run()
    except Exception:  # noqa: BLE001 - reported in the section's figures
        return {"error": traceback.format_exc()[-1500:]}
    finally:
        for kv in _OPEN:
            kv.close()  # a no-op for the ones the case closed
        _OPEN.clear()


def _latent(backend: PageBackend, dtype: torch.dtype, row_multiple: int = 1) -> GrowableKVBuffers:
    rows = backend.granularity_bytes // (HEAD_DIM * dtype.itemsize)
    _OPEN.append(GrowableKVBuffers(backend, layers=1, heads=1, head_dim=HEAD_DIM, dtype=dtype,
                                   initial_rows=rows // 2, max_rows=4 * rows, row_multiple=row_multiple,
                                   buffers_per_layer=1))
    return _OPEN[-1]


def _grow(backend: PageBackend, kv: GrowableKVBuffers) -> tuple[int, int]:
    """One more granule per buffer: (old rows, new rows)."""
    old = kv.row_capacity
    kv.grow([backend.create(backend.granularity_bytes) for _ in range(kv.n_buffers)])
    return old, kv.row_capacity


def _fp8_to_bf16_captured(backend: PageBackend) -> dict:
    kv = _latent(backend, torch.uint8)
    buf = kv.buffers[0]
    buf.copy_(torch.randn(buf.shape, device=buf.device).to(FP8).view(torch.uint8))
    static = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["bf16"] = buf.view(FP8).to(torch.bfloat16)
    old, new = _grow(backend, kv)
    buf = kv.buffers[0]  # the same object, regrown in place
    buf[old - 1].copy_(torch.full((1, HEAD_DIM), 2.0, device=buf.device).to(FP8).view(torch.uint8))
    buf[new - 1].copy_(torch.full((1, HEAD_DIM), 3.0, device=buf.device).to(FP8).view(torch.uint8))
    graph.replay()
    torch.cuda.synchronize()
    converted = static["bf16"]
    result = {"rows_before": old, "rows_after": new, "rows_converted_by_replay": int(converted.shape[0]),
              "old_row_converted": bool((converted[old - 1] == 2.0).all()),
              "grown_rows_converted": converted.shape[0] >= new,
              "eager_temporary_bytes": [old * HEAD_DIM * 2, new * HEAD_DIM * 2]}
    del graph, static, converted
    kv.close()
    return result


@functools.cache
def _gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(buf_ptr, idx_ptr, out_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
        """out[i] = bf16(buf[idx[i]]): pointer arithmetic only, like SGLang's Triton MLA decode."""
        i = tl.program_id(0)
        row = tl.load(idx_ptr + i).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(buf_ptr + row * ROW + offs, mask=offs < ROW)
        tl.store(out_ptr + i * ROW + offs, x.to(tl.bfloat16), mask=offs < ROW)

    return gather_rows


def _triton_gather(backend: PageBackend) -> dict:
    try:
        kernel = _gather_kernel()
    except (ImportError, OSError) as exc:  # OSError: its CUDA library does not load
        return {"skipped": f"needs triton ({exc})"}
    kv = _latent(backend, torch.uint8)
    buf = kv.buffers[0]
    buf.copy_(torch.randn(buf.shape, device=buf.device).to(FP8).view(torch.uint8))
    idx = torch.tensor([0, 1], dtype=torch.int32, device=buf.device)
    out = torch.empty(2, HEAD_DIM, dtype=torch.bfloat16, device=buf.device)

    def gather(rows: torch.Tensor) -> None:
        kernel[(2,)](rows.view(FP8), idx, out, ROW=HEAD_DIM, BLOCK=1024)

    gather(buf)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather(buf)
    old, new = _grow(backend, kv)
    buf[new - 1].copy_(torch.full((1, HEAD_DIM), 3.0, device=buf.device).to(FP8).view(torch.uint8))
    idx.copy_(torch.tensor([old - 1, new - 1], dtype=torch.int32))
    graph.replay()
    replayed = out.clone()
    gather(buf)
    torch.cuda.synchronize()
    result = {"rows_before": old, "rows_after": new, "replay_equals_eager": torch.equal(replayed, out),
              "grown_row_read": bool((replayed[1] == 3.0).all())}
    result["replay_equals_eager"] &= result["grown_row_read"]
    del graph
    kv.close()
    return result


def _pages(kv: GrowableKVBuffers, page_size: int) -> torch.Tensor:
    """The latent buffer as `[pages, page_size, 1, 576]` (SGLang's paged_view)."""
    return kv.buffers[0].unflatten(0, (-1, page_size))


def _reference(q: torch.Tensor, pages: torch.Tensor, table: list[int], scale: float) -> torch.Tensor:
    """Absorbed MLA decode in torch for one sequence over `table`'s pages: [heads, 512]."""
    kv = pages[table].reshape(-1, HEAD_DIM).float()
    scores = q.float() @ kv.T * scale
    return (scores.softmax(-1) @ kv[:, :LATENT]).to(torch.bfloat16)


def _fill_and_point(pages: torch.Tensor, table: torch.Tensor, old_pages: int) -> None:
    """Distinctive keys and values in the first grown page, and the sequence's last page pointed at it."""
    new_page = old_pages + 1
    pages[new_page].copy_(torch.randn_like(pages[new_page], dtype=torch.float32).mul_(4).to(pages.dtype))
    table[0, -1] = new_page


def _flash_mla(backend: PageBackend) -> dict:
    try:
        import flash_mla
    except (ImportError, OSError) as exc:  # OSError: its CUDA library does not load
        return {"skipped": f"needs flash_mla (pip install sgl-flash-mla; {exc})"}
    kv = _latent(backend, torch.bfloat16, row_multiple=64)
    pages = _pages(kv, 64)
    pages.copy_(torch.randn_like(pages, dtype=torch.float32).to(torch.bfloat16))
    dev, heads, scale = pages.device, 128, HEAD_DIM ** -0.5
    q = torch.randn(1, 1, heads, HEAD_DIM, device=dev).to(torch.bfloat16)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=dev)
    seqlens = torch.tensor([128], dtype=torch.int32, device=dev)
    meta = flash_mla.get_mla_metadata()[0]

    def decode(k_pages: torch.Tensor) -> torch.Tensor:
        return flash_mla.flash_mla_with_kvcache(q, k_pages, table, seqlens, LATENT, meta, softmax_scale=scale,
                                                causal=True, use_legacy=True)[0]

    decode(pages)  # the schedule is filled here, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(pages)
    old_pages = pages.shape[0]
    _grow(backend, kv)
    pages = _pages(kv, 64)
    _fill_and_point(pages, table, old_pages)
    graph.replay()
    replayed = out.clone()
    eager = decode(pages)
    torch.cuda.synchronize()
    want = _reference(q[0, 0], pages, table[0].tolist(), scale)
    result = {"pages_before": old_pages, "pages_after": pages.shape[0],
              "eager_matches_torch": torch.allclose(eager[0, 0].float(), want.float(), atol=3e-2, rtol=3e-2),
              "replay_equals_eager": torch.equal(replayed, eager)}
    del graph, out
    kv.close()
    return result


def _fa3(backend: PageBackend, page_size: int, q_heads: int) -> dict:
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
    except (ImportError, OSError) as exc:  # OSError: its CUDA library does not load
        return {"skipped": f"needs sgl_kernel (pip install sglang-kernel; {exc})"}
    kv = _latent(backend, torch.bfloat16, row_multiple=64)
    pages = _pages(kv, page_size)
    pages.copy_(torch.randn_like(pages, dtype=torch.float32).to(torch.bfloat16))
    dev, scale = pages.device, HEAD_DIM ** -0.5
    q = torch.randn(1, q_heads, HEAD_DIM, device=dev).to(torch.bfloat16)
    per_seq = 128 // page_size
    table = torch.arange(per_seq, dtype=torch.int32, device=dev).view(1, per_seq)
    seqlens = torch.tensor([128], dtype=torch.int32, device=dev)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)

    def decode(k_pages: torch.Tensor) -> torch.Tensor:
        return flash_attn_with_kvcache(q=q[:, :, LATENT:], k_cache=k_pages[..., LATENT:],
                                       v_cache=k_pages[..., :LATENT], qv=q[:, :, :LATENT], page_table=table,
                                       cache_seqlens=seqlens, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                       softmax_scale=scale, causal=True)

    decode(pages)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(pages)
    old_pages = pages.shape[0]
    _grow(backend, kv)
    pages = _pages(kv, page_size)
    _fill_and_point(pages, table, old_pages)
    graph.replay()
    replayed = out.clone()
    eager = decode(pages)
    torch.cuda.synchronize()
    want = _reference(q[0], pages, table[0].tolist(), scale)
    result = {"page_size": page_size, "q_heads_per_kv_head": q_heads, "pages_before": old_pages,
              "pages_after": pages.shape[0],
              "eager_matches_torch": torch.allclose(eager[0].float(), want.float(), atol=3e-2, rtol=3e-2),
              "replay_equals_eager": torch.equal(replayed, eager)}
    del graph, out
    kv.close()
    return result
