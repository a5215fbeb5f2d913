"""keep_freed_memory, which every CPU rank applies as it joins its process group (trainers, servers and
generators alike): a freed activation-sized block stays in the process's heap, ready for the next
step, where glibc's default thresholds map it separately and unmap it on free (each reuse then
faults its pages in again). Read from glibc's own accounting (mallinfo2), in a fresh process per case;
the control pins glibc's default thresholds (128 KiB), as they stand before any dynamic adjustment."""
import subprocess
import sys

PROGRAM = """
import ctypes, sys, torch
from aligner.runtime import cpu_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "rank":
    from aligner.runtime import distributed
    distributed.init_process_group()
else:
    assert libc.mallopt(cpu_memory.M_MMAP_THRESHOLD, 128 * 1024) and libc.mallopt(cpu_memory.M_TRIM_THRESHOLD, 128 * 1024)
mapped = libc.mallinfo2().hblkhd
block = torch.ones(4 * 1024 * 1024)  # 16 MiB
mapped_for_block = libc.mallinfo2().hblkhd - mapped
del block
print(mapped_for_block, libc.mallinfo2().fordblks)
"""
MIB = 1024 * 1024


def _mapped_and_kept(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    mapped, free_in_heap = out.stdout.split()
    return int(mapped), int(free_in_heap)


def test_a_freed_block_stays_in_the_heap():
    mapped, free_in_heap = _mapped_and_kept("default")
    assert mapped >= 16 * MIB and free_in_heap < 16 * MIB  # its own mapping, returned on free
    mapped, free_in_heap = _mapped_and_kept("rank")
    assert mapped == 0 and free_in_heap >= 16 * MIB  # carved from the heap and kept there
