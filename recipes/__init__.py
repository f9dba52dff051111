"""Training recipes and training-time reference modules for the seed routing methods.

They produce checkpoints in the methods' official parameterisation and key layout, which the exporters
fold into serving artifacts. The serving runtime (moe_serve) never imports this package.
"""
