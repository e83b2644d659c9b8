import json
import os
import stat

import pytest

from clawray.records import JsonlRecords


def test_rotation_keeps_every_row_until_retention_and_mode_0600(tmp_path):
    path = tmp_path / "records" / "turns.jsonl"
    (tmp_path / "records").mkdir()
    path.write_text('{"old": true}\n')  # a previous run's rows are appended to, never truncated
    rec = JsonlRecords(str(path), max_bytes=60, keep_files=2)
    for i in range(7):
        rec.append({"i": i, "pad": "x" * 20})  # 31-byte rows: one per file after the first
    rows = lambda p: [json.loads(line) for line in open(p)]  # noqa: E731
    assert rows(path) == [{"i": 6, "pad": "x" * 20}]
    assert rows(f"{path}.1") == [{"i": 5, "pad": "x" * 20}]
    assert rows(f"{path}.2") == [{"i": 4, "pad": "x" * 20}]
    assert not os.path.exists(f"{path}.3") and rec.rotations == 6
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_bad_settings_raise():
    with pytest.raises(ValueError):
        JsonlRecords("/tmp/x.jsonl", 0, 1)


def test_a_row_holding_a_lone_surrogate_is_written_and_reads_back_the_same(tmp_path):
    """A judge's answer decoded from a ``"\\ud800"`` escape has no UTF-8 form: ``append`` raised
    UnicodeEncodeError (it caught only OSError) into the judging task. It is written as its JSON
    escape, which reads back as the same string."""
    path = tmp_path / "judgments.jsonl"
    rec = JsonlRecords(str(path), 1 << 20, 1)
    assert rec.append({"raw": "a\ud800b", "ok": "é"}) and rec.write_errors == 0
    line = path.read_bytes()
    assert line == b'{"raw": "a\\ud800b", "ok": "\xc3\xa9"}\n'
    assert json.loads(line) == {"raw": "a\ud800b", "ok": "é"}
