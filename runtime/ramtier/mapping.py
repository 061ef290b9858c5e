"""Find the memory mappings of a model file in this process (llama.cpp's, at run time).

llama.cpp maps the whole GGUF once (``mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0)``) and
may later unmap fragments whose tensors went to other buffers, so its mapping can show up in
``/proc/self/maps`` as several regions that share one base (``start - file_offset``). Other
code in the process (gguf-py's ``np.memmap``) may map the same file too; each distinct base is
one *copy*. All copies show the same page cache, so reads and ``mincore`` may use any copy that
covers a range, while eviction must unmap pages from every copy (a page still mapped anywhere
cannot be dropped from the page cache).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from runtime.ramtier import vm


@dataclass(frozen=True, slots=True)
class MapRegion:
    start: int      # virtual address of the region's first byte
    end: int        # one past the last byte
    offset: int     # file offset mapped at ``start``, bytes
    path: str

    @property
    def base(self) -> int:
        """Address that file offset 0 would have in this copy."""
        return self.start - self.offset

    @property
    def file_end(self) -> int:
        return self.offset + self.end - self.start


def read_proc_maps(path: str = "/proc/self/maps") -> list[tuple[MapRegion, int, int]]:
    """Every file-backed region of the process: ``(region, device, inode)``."""
    out: list[tuple[MapRegion, int, int]] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[4] == "0":
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            region = MapRegion(lo, hi, int(parts[2], 16), parts[5].rstrip("\n"))
            out.append((region, os.makedev(major, minor), int(parts[4])))
    return out


def _regions_of(path: str) -> list[MapRegion]:
    st = os.stat(path)
    return [r for r, dev, ino in read_proc_maps() if dev == st.st_dev and ino == st.st_ino]


class FileMapping:
    """The mapped copies of one file in this process, addressed by file offset."""

    def __init__(self, path: str, regions: list[MapRegion]):
        self.path = path
        self.file_bytes = os.path.getsize(path)
        self._set(regions)

    def _set(self, regions: list[MapRegion]) -> None:
        copies: dict[int, list[MapRegion]] = {}
        for region in sorted(regions, key=lambda r: r.start):
            copies.setdefault(region.base, []).append(region)
        # the primary copy is the one covering the most of the file (llama.cpp maps it whole)
        self.copies = sorted(copies.values(), key=lambda rs: -sum(r.end - r.start for r in rs))

    @classmethod
    def find(cls, path: str | os.PathLike) -> FileMapping:
        """The mappings of ``path`` now in ``/proc/self/maps`` (matched by device and inode)."""
        path = os.fspath(path)
        return cls(path, _regions_of(path))

    def refresh(self) -> None:
        """Re-read ``/proc/self/maps`` (a copy was unmapped or added)."""
        self._set(_regions_of(self.path))

    def __bool__(self) -> bool:
        return bool(self.copies)

    @property
    def n_copies(self) -> int:
        return len(self.copies)

    def address_spans(self, offset: int, length: int, *, every_copy: bool = False
                      ) -> list[tuple[int, int]]:
        """Address pieces ``(addr, length)`` mapping file bytes ``[offset, offset + length)``.

        From the first copy covering the bytes (all copies with ``every_copy``); bytes no copy
        maps are left out.
        """
        out: list[tuple[int, int]] = []
        end = offset + length
        for regions in self.copies:
            pieces = []
            for r in regions:
                lo, hi = max(offset, r.offset), min(end, r.file_end)
                if lo < hi:
                    pieces.append((r.base + lo, hi - lo))
            out.extend(pieces)
            if pieces and not every_copy and sum(n for _, n in pieces) == length:
                break
        return out

    def covers(self, offset: int, length: int) -> bool:
        """Whether some copy maps all of ``[offset, offset + length)``."""
        return sum(n for _, n in self.address_spans(offset, length)) >= length

    def resident_span(self, offset: int, length: int) -> np.ndarray:
        """``mincore`` of the file pages covering ``[offset, offset + length)``: (n_pages,)
        bool, element 0 = page ``offset // PAGE_SIZE``; pages no copy maps read False."""
        first = offset // vm.PAGE_SIZE
        last = (offset + length - 1) // vm.PAGE_SIZE
        vec = np.zeros(last - first + 1, dtype=bool)
        for addr, n in self.address_spans(offset, length):
            page = self._file_offset(addr) // vm.PAGE_SIZE
            got = vm.mincore(addr, n)
            vec[page - first:page - first + len(got)] = got
        return vec

    def _file_offset(self, addr: int) -> int:
        for regions in self.copies:
            for r in regions:
                if r.start <= addr < r.end:
                    return addr - r.base
        raise ValueError(f"address {addr:#x} is not in a mapping of {self.path}")

    def resident_pages(self) -> np.ndarray:
        """``mincore`` truth for every page of the file: (n_file_pages,) bool.

        Pages no copy maps read as not resident.
        """
        n_pages = -(-self.file_bytes // vm.PAGE_SIZE)
        vec = np.zeros(n_pages, dtype=bool)
        for regions in reversed(self.copies):   # primary copy last: it wins on overlap
            for r in regions:
                first = r.offset // vm.PAGE_SIZE
                pages = vm.mincore(r.start, r.end - r.start)
                vec[first:first + len(pages)] = pages[: n_pages - first]
        return vec
