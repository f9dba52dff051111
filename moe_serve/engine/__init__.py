"""Engine: per-request state, KV-cache slots, sampling and the step loop (no HTTP code here)."""
