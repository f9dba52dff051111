"""Building blocks of the MoE transformer: norms, positions, attention, FFNs, routers, the MoE block."""
