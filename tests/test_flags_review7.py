"""script_main and a closed stdout: any recipe script piped into `head` ends as Unix tools do
(exit 141, nothing on stderr), not with a BrokenPipeError traceback (compare_logs here)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.test_chat_cli import assert_quiet_after_head

ROOT = Path(__file__).resolve().parents[1]
LINE = ("step {s:05d}/20000 | loss {l:.4f} | lrm 1.000 | dt    100.0ms | tok/s      10,000 | mfu   n/a "
        "| util(bf16)   n/a | mem   1.00GiB\n")


def test_compare_logs_piped_into_head_ends_quietly(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("".join(LINE.format(s=s, l=5.0) for s in range(20000)))
    b.write_text("".join(LINE.format(s=s, l=5.5) for s in range(20000)))   # a row per step: far over a pipe
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-m", "scripts.compare_logs", str(a), str(b)], cwd=ROOT, env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert_quiet_after_head(child)


def test_a_broken_pipe_that_is_not_stdout_stays_an_error(tmp_path):
    """Only a closed stdout is the quiet `| head` case: a BrokenPipeError from another pipe (a dead
    worker's, a subprocess's) keeps its traceback and is no exit 141."""
    script = tmp_path / "t.py"
    script.write_text("import os\nfrom nanochat.flags import script_main\n\n"
                      "def run():\n    print('working', flush=True)\n"
                      "    r, w = os.pipe()\n    os.close(r)\n    os.write(w, b'x')\n\n"
                      "script_main('t', lambda: None, run)\n")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode not in (0, 141) and "BrokenPipeError" in out.stderr and out.stdout == "working\n"
