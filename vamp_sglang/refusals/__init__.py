"""What the launcher refuses with VAMP on, one module per feature, read from argv and config.json alone.

Each module names the SGLang flags it reads (`add_flags`, for the launcher's SGLang-free view of the argv)
and returns a refusal naming the flag, with the reason and SGLang's file:line, or None. Nothing here imports
SGLang or torch: the launcher must answer in about a second, before anything loads.
"""
