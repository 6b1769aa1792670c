"""gpuherd's benchmark suite: `python -m bench [--quick] [--only NAME]`."""
