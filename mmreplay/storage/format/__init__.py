"""The byte format: what a store's frame and column files hold and how they are written.

Invariant: nothing here knows about commits or crashes. A shard file written here is valid on its own (its
index and crc32c say what it holds); whether it is part of the store is durability/'s decision.
"""
