"""OpenAI Batch JSONL files answered offline by `moe-serve batch` (resumable, with k sweeps) and by the
server's Batch API (/v1/files, /v1/batches), on one shared runner (core.py)."""
