"""Evaluation harness: session traces, workload importers, a streaming client, server orchestration,
ablation runners, plots and reports (paper section VI). Run modules with `python -m eval.<module>`."""
