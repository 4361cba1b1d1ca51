"""Growable KV and state pools over expert memory, compaction, and what may not run during a remap."""
