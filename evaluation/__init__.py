"""Quality against k (`moe-serve eval`): offline datasets, metrics, tables and plots. An optional part:
the datasets and plots need the `eval` extra (`pip install 'moe-serve[eval]'`); serving never imports it."""
