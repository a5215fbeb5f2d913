"""keep_freed_memory: blocks that are freed and allocated again stay mapped in the process. By
default glibc hands a block larger than any freed before to mmap and unmaps it on free, so every
step that outgrows the last faults its pages in afresh (the pattern of variable-length packed
batches); kept, only the growth is faulted in."""
import subprocess
import sys

PROGRAM = """
import resource, sys, torch
from aligner.runtime.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(10):  # a block of 4 + step MiB, written and freed
    block = torch.ones((4 + step) * 256 * 1024)
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
MIB_PAGES = 1024 * 1024 // 4096


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_freed_blocks_stay_mapped():
    assert _faults("default") >= 80 * MIB_PAGES  # sum of 4..13 MiB = 85 MiB: every block faulted in whole
    assert _faults("keep") <= 20 * MIB_PAGES  # the first block and each 1 MiB of growth
