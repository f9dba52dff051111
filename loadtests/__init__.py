"""HTTP load generation against a running moe-serve server (loopback only)."""
