"""vamp-sglang: VAMP (value-aware expert/KV memory repartitioning) for SGLang 0.5.23.

Layers, each importable without SGLang except `integration`:
- `config`: the --vamp-* flags and how they reach SGLang's processes.
- `policy`: the cost model (paper Eqs. 1-5) and the planner.
- `cache`: per-node hit/recency statistics and cost-ordered eviction over a radix tree.
- `memory`: page backends, expert layout, KV growth, the repartitioner, staging.
- `controller`: TP ranks agree on a common remap count over ZMQ.
- `integration`: every line that touches SGLang (plugin hooks, radix backend, stats, metrics).
"""

__version__ = "0.1.0"
