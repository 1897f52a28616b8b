"""services/heap.py: memory freed inside malloc's heap goes back to the system when asked, and a ready
service's start-up objects are frozen out of the collector's walks."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from services.heap import freeze_startup_heap

# 200 MB in 64 KB pieces (below malloc's mmap threshold: they live in its heap), all freed but the
# last, which keeps the heap's top in use so glibc cannot give the rest back on its own.
FREED_INSIDE_THE_HEAP = textwrap.dedent(
    """
    from services.heap import return_free_pages

    def rss_mb():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024

    pieces = [b"x" * (64 << 10) for _ in range(3200)]
    top = pieces[-1]
    del pieces
    before = rss_mb()
    return_free_pages()
    print(before, rss_mb())
    """
)


def test_pages_freed_inside_the_heap_go_back_to_the_system():
    answer = subprocess.run([sys.executable, "-c", FREED_INSIDE_THE_HEAP], capture_output=True, text=True, check=True)
    before, after = map(int, answer.stdout.split())
    assert before - after > 150, (before, after)


def test_freezing_leaves_start_up_objects_out_of_the_collectors_walks():
    gc.unfreeze()
    kept = [object() for _ in range(1000)]
    freeze_startup_heap()
    try:
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
