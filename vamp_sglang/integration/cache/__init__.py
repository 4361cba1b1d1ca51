"""The radix tree with VAMP's reuse statistics, its eviction order and price, and HiCache's host tier."""
