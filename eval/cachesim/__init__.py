"""`python -m eval.cachesim`: a prefix-cache simulator over SGLang's real radix tree, with the offline optimum.

Replays a session trace (eval/trace_format.py) through SGLang 0.5.23's `UnifiedRadixCache` at a
fixed KV pool size, with no model: SGLang's own eviction policies, VAMP's p_eff order (the
project's tree) and `opt`, the offline optimum under the radix constraint. Modules: `workload`
(token ids and the request order), `oracle` (the future: next uses, unbounded-cache hits, the
reusable footprint, `OptStrategy`), `tree` (the cache and one request's operations, shared with
eval.bench_tree), `sim` (one replay, the sweep), `__main__` (the CLI, JSON, plot). docs/cachesim.md.
"""
