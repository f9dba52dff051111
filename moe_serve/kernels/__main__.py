"""`python -m moe_serve.kernels`: builds (or finds) the CPU kernels ahead of time and says which
implementation serving will use."""

import logging

from moe_serve.kernels import cache_dir, cpu_extension

logging.basicConfig(level=logging.WARNING, format="%(message)s")
if cpu_extension() is not None:
    print(f"moe-serve CPU kernels ready ({cache_dir()})")
else:
    print("moe-serve will use the torch implementations (see the warning above)")
