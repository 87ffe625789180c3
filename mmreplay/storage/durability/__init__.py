"""Crash durability: the commit log, the store's metadata, priority files and fork safety.

Invariant: a store is what its last complete commit says it is. Everything here is written atomically
(through storage/files.py), so a process killed at any instruction leaves the previous commit readable.
"""
