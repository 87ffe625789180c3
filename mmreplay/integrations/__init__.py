"""Adapters to the RL ecosystem; each depends on the core, never the other way round, and imports its
optional dependency only when used."""
