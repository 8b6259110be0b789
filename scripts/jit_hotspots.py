"""Where a running process spends its time inside JIT-compiled code (Numba's kernels),
instruction by instruction.

``perf`` sees code that Numba compiled at run time as anonymous memory without symbols, so
``perf report`` lumps it into ``[unknown]``. This samples the process with ``perf record``,
copies its anonymous executable mappings out of ``/proc/PID/mem`` while it still runs,
disassembles them with ``objdump`` and prints, per mapping, its share of the samples and
its hottest instructions with the code before them (a sample usually lands on the
instruction after the one that stalled).

    python scripts/jit_hotspots.py PID [--seconds 4] [--top 12] [--context 8]

Start the workload first (say a loop of training steps) and give its PID. Needs ``perf``
and ``objdump`` on the PATH and the right to read the process's memory (the same user with
ptrace allowed, or root). A kernel's mapping is recognised by its share and its code: the
update's vector stores and prefetches, the grouping's histogram increments; Numba's
reference counting shows as a 4 KiB mapping of ``lock incq``/``lock decq`` stubs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Region:
    """An anonymous executable mapping: its first address and a copy of its bytes."""

    start: int
    code: bytes

    @property
    def end(self) -> int:
        return self.start + len(self.code)


def executable_regions(pid: int) -> list[Region]:
    """The anonymous executable mappings of process ``pid``, copied out of its memory."""
    regions = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as memory:
        for line in maps:
            fields = line.split()
            anonymous = len(fields) < 6 or fields[5].startswith("[anon")
            if "r" in fields[1] and "x" in fields[1] and anonymous:
                start, end = (int(a, 16) for a in fields[0].split("-"))
                memory.seek(start)
                regions.append(Region(start, memory.read(end - start)))
    return regions


def sampled_addresses(pid: int, seconds: float, workdir: Path) -> Counter[int]:
    """Instruction addresses ``perf record`` sampled in ``pid`` over ``seconds``, counted."""
    data = workdir / "perf.data"
    subprocess.run(["perf", "record", "-q", "-o", str(data), "-F", "4000", "-p", str(pid), "--", "sleep",
                    str(seconds)], check=True, capture_output=True)
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip"], check=True, capture_output=True,
                            text=True).stdout
    return Counter(int(line, 16) for line in script.split())


def disassembly(region: Region, workdir: Path) -> list[tuple[int, str]]:
    """``(address, instruction text)`` of every instruction in ``region``."""
    raw = workdir / f"{region.start:x}.bin"
    raw.write_bytes(region.code)
    listing = subprocess.run(["objdump", "-D", "-b", "binary", "-mi386:x86-64", f"--adjust-vma={region.start:#x}",
                              str(raw)], check=True, capture_output=True, text=True).stdout
    instructions = []
    for line in listing.splitlines():
        match = re.match(r"\s*([0-9a-f]+):\s+(?:[0-9a-f]{2} )+\s*(.*)", line)
        if match and match.group(2):
            instructions.append((int(match.group(1), 16), match.group(2).strip()))
    return instructions


def report(regions: list[Region], samples: Counter[int], workdir: Path, top: int, context: int) -> str:
    """Each sampled region's share of all samples, its ``top`` hottest instructions, and the
    ``context`` instructions before each of the hottest three."""
    total = sum(samples.values())
    lines = [f"{total} samples; in JIT code: {sum(n for a, n in samples.items() if _within(a, regions))}"]
    by_region = sorted(((sum(n for a, n in samples.items() if r.start <= a < r.end), r) for r in regions),
                       key=lambda x: -x[0])
    for count, region in by_region:
        if count == 0:
            continue
        lines.append(f"\n== {region.start:#x} ({len(region.code)} bytes): {count} samples, "
                     f"{100 * count / max(total, 1):.1f}%")
        instructions = disassembly(region, workdir)
        position = {address: i for i, (address, _) in enumerate(instructions)}
        hottest = sorted((a for a in samples if a in position), key=lambda a: -samples[a])[:top]
        for address in hottest:
            lines.append(f"  {samples[address]:6d}  {address:#x}  {instructions[position[address]][1]}")
        for address in hottest[:3]:
            lines.append(f"  -- before {address:#x}:")
            i = position[address]
            for before, text in instructions[max(0, i - context): i + 1]:
                lines.append(f"  {samples.get(before, 0):6d}  {before:#x}  {text}")
    return "\n".join(lines)


def _within(address: int, regions: list[Region]) -> bool:
    return any(r.start <= address < r.end for r in regions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--top", type=int, default=12, help="hottest instructions listed per mapping")
    parser.add_argument("--context", type=int, default=8, help="instructions shown before each of the hottest three")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        samples = sampled_addresses(args.pid, args.seconds, Path(workdir))
        print(report(executable_regions(args.pid), samples, Path(workdir), args.top, args.context))


if __name__ == "__main__":
    main()
