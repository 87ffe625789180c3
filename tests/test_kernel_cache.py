"""kernel_cache.follow: a module's cached kernels never outlive a change to the kernels they call."""

import os

from mmreplay._native import kernel_cache


def _module_with_cache(tmp_path, cache_mtime):
    mod = tmp_path / "kernels.py"
    mod.write_text("x = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    files = [cache / "kernels.decode-10.py311.nbi", cache / "kernels.decode-10.py311.1.nbc"]
    other = cache / "other.decode-10.py311.nbi"
    for f in files + [other]:
        f.write_bytes(b"cached")
        os.utime(f, (cache_mtime, cache_mtime))
    return str(mod), files, other


def test_cache_older_than_a_dependency_is_dropped(tmp_path):
    dep = tmp_path / "dep.py"
    dep.write_text("y = 2\n")
    os.utime(dep, (2_000_000, 2_000_000))
    mod, files, other = _module_with_cache(tmp_path, 1_000_000)
    kernel_cache.follow(mod, str(dep))
    assert not any(f.exists() for f in files)
    assert other.exists()  # another module's cache is not this one's business


def test_cache_newer_than_every_dependency_is_kept(tmp_path):
    dep = tmp_path / "dep.py"
    dep.write_text("y = 2\n")
    os.utime(dep, (1_000_000, 1_000_000))
    mod, files, _ = _module_with_cache(tmp_path, 2_000_000)
    kernel_cache.follow(mod, str(dep))
    assert all(f.exists() for f in files)


def test_no_cache_or_missing_dependency_is_harmless(tmp_path):
    mod = tmp_path / "kernels.py"
    mod.write_text("x = 1\n")
    kernel_cache.follow(str(mod), str(tmp_path / "gone.py"))  # no cache: nothing to do
    mod, files, _ = _module_with_cache(tmp_path, 1_000_000)
    kernel_cache.follow(mod, str(tmp_path / "gone.py"))  # a dependency went away: numba decides as before
    assert all(f.exists() for f in files)
