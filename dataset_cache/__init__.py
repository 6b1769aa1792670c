"""Turns text into a verified, hash-keyed token cache that every worker memory-maps."""
