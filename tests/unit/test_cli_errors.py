"""``clawray run`` and ``clawray serve`` say a failure that is the user's (or the machine's) to fix in
one line with its exit status, and keep a bug's traceback (``clawray.cli._said_in_one_line``)."""

import os

import pytest

from clawray.checkpoint import DamagedFileError
from clawray.cli import _said_in_one_line, main
from clawray.config import ConfigError
from clawray.serve.instance import ServerStartError


@pytest.mark.parametrize(
    "error, status, line",
    [
        (ConfigError("deploy.probe_file x.jsonl:3: not JSON"), 2, "clawray: config error: deploy.probe_file x.jsonl:3: not JSON"),
        (FileExistsError("model.path m exists but is not an HF folder"), 1, "clawray: FileExistsError: model.path m exists but is not an HF folder"),
        (TimeoutError("no batch in 60 s"), 1, "clawray: TimeoutError: no batch in 60 s"),
        (ServerStartError("the policy server failed to deploy: x"), 1, "clawray: the policy server failed to deploy: x"),
        (DamagedFileError("journal line 3"), 1, "clawray: journal line 3"),
        (RuntimeError("a bug"), None, ""),
        (ValueError("a bug"), None, ""),
        (KeyError("a bug"), None, ""),
    ],
)  # fmt: skip
def test_what_is_said_in_one_line_and_what_keeps_its_traceback(capsys, error, status, line):
    assert _said_in_one_line(error) == status
    assert capsys.readouterr().err.strip() == line


def test_learner_start_failures_are_said_in_one_line(capsys):
    from clawray.actors.learner import LearnerStartError

    assert _said_in_one_line(LearnerStartError("learner rank 1 of 2 failed to start: ValueError: x")) == 1
    assert capsys.readouterr().err.strip() == "clawray: learner rank 1 of 2 failed to start: ValueError: x"


def test_run_with_a_mistyped_resume_folder_creates_nothing_and_a_file_as_run_dir_is_one_line(tmp_path, capsys):
    """``resume=true`` with a mistyped ``run_dir`` created the folder and its job.log before refusing;
    ``run_dir=<a file>`` was a FileExistsError traceback."""
    umask = os.umask(0o022)  # main() sets the process umask to 077 for a run: restored after
    try:
        assert main(["run", "conf/rl.yaml", f"run_dir={tmp_path / 'typo'}", "resume=true"]) == 1
        assert "resume=true but there is no checkpoint in" in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "typo")
        damaged = tmp_path / "damaged" / "journal"
        damaged.mkdir(parents=True)
        (damaged / "samples.jsonl").write_text('{"op":"ack"\n{"op":"forget","step":3}\n')  # line 1 torn
        assert main(["run", "conf/rl.yaml", f"run_dir={tmp_path / 'damaged'}", "resume=true"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("clawray: ") and "samples.jsonl" in err and "Traceback" not in err
        a_file = tmp_path / "f"
        a_file.write_text("x")
        assert main(["run", "conf/rl.yaml", f"run_dir={a_file}"]) == 1
        err = capsys.readouterr().err
        assert err.strip().startswith("clawray: FileExistsError:") and "Traceback" not in err
        assert a_file.read_text() == "x"
    finally:
        os.umask(umask)
