"""Data files shipped with the package: ``atari_fixture.npz``, real Atari transitions for ``mmreplay bench``
(a copy of ``tests/data/atari_fixture.npz``, made by ``scripts/make_atari_fixture.py``; a test keeps the
two identical)."""
