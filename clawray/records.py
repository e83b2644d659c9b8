"""Append-only JSONL records with size-based rotation.

A record file is only ever appended to; when a row would grow it past ``max_bytes`` the file is
rotated (``name`` -> ``name.1`` -> ``name.2`` ...; the oldest beyond ``keep_files`` is deleted) and
a fresh one is started. Files are created with mode 0600: they hold users' conversations.
"""

from __future__ import annotations

import json
import os
from typing import Any


class JsonlRecords:
    """One rotating JSONL record.

    Args:
        path: the live file (e.g. ``runs/x/records/turns.jsonl``); its folder is created.
        max_bytes: rotate before a row would make the file larger than this (bytes); a single
            larger row still gets written, alone in its file.
        keep_files: rotated files kept (``path.1`` newest .. ``path.N`` oldest); >= 0.

    Raises:
        ValueError: ``max_bytes`` <= 0 or ``keep_files`` < 0.
    """

    def __init__(self, path: str, max_bytes: int, keep_files: int):
        if max_bytes <= 0 or keep_files < 0:
            raise ValueError(f"max_bytes must be > 0 and keep_files >= 0, got {max_bytes}, {keep_files}")
        self.path, self.max_bytes, self.keep_files = path, max_bytes, keep_files
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.rotations = 0

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one JSON line (rotating first when needed)."""
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            size = 0
        if size and size + len(line) > self.max_bytes:
            self._rotate()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, line)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        self.rotations += 1
        if self.keep_files == 0:
            os.remove(self.path)
            return
        oldest = f"{self.path}.{self.keep_files}"
        if os.path.exists(oldest):
            os.remove(oldest)
        for i in range(self.keep_files - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
