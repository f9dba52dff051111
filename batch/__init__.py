"""`moe-serve batch`: OpenAI Batch JSONL files answered offline, resumable, with k sweeps."""
