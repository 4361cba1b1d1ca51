"""Every FusedMoE layer's offloaded experts staged back around its kernel, whole or routed."""
