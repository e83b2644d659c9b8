"""clawray.console: own lines on the terminal, everything else (ANSI-free) in the log file."""

import subprocess
import sys
import textwrap

from clawray.console import is_own_line, strip_ansi

SCRIPT = textwrap.dedent("""
    import logging, os, sys
    from clawray.console import capture, progress
    with capture(sys.argv[1]):
        print("[clawray] step 1/2 | reward +0.50", flush=True)
        print("\\x1b[36m(RolloutEngine pid=7)\\x1b[0m INFO vllm chatter", flush=True)
        print("(SimUserPool pid=9) [clawray] from a worker", flush=True)
        logging.getLogger("x").warning("a library warning")
        os.system("echo child process line")
        sys.stderr.write("clawray: an error for the user\\n")
        with progress(total=3, desc="eval") as bar:
            bar.update(3)
    print("after capture", flush=True)
""")


def test_capture_routes_lines(tmp_path):
    log = tmp_path / "logs" / "job.log"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[clawray] step 1/2 | reward +0.50",
        "(SimUserPool pid=9) [clawray] from a worker",
        "clawray: an error for the user",
        "after capture",
    ]
    text = log.read_text()
    assert "\x1b" not in text and "\r" not in text
    for line in (
        "[clawray] step 1/2",
        "(RolloutEngine pid=7) INFO vllm chatter",
        "a library warning",
        "child process line",
        "clawray: an error for the user",
    ):
        assert line in text
    assert "after capture" not in text and "eval" not in text  # the progress bar never reaches the file


def test_own_lines_and_ansi():
    assert is_own_line("[clawray] done") and is_own_line("\x1b[33m(Driver pid=1)\x1b[0m [clawray] x")
    assert is_own_line("clawray: config error: ...")
    assert not is_own_line("INFO [clawray] mentioned later") and not is_own_line("(pid=3) WARNING foo")
    assert strip_ansi("\x1b[1m\x1b[31mred\x1b[0m") == "red"
    assert strip_ansi("10%\r50%\r100%") == "100%"
