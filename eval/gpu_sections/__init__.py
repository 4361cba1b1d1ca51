"""gpu_check sections kept in their own modules (eval/gpu_check.py imports each into SECTIONS)."""
