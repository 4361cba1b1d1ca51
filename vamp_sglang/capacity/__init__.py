"""Capacity planner: what each offload ratio VAMP-r buys in KV pool and costs in staged bytes per decode
step, for a model on a GPU and TP degree, before deploying (`python -m vamp_sglang.capacity`)."""
