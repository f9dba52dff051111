"""Checkpoint converters (offline only): `python -m exporters FORMAT SRC DST`. The runtime never imports them."""
