"""`agentrl --help` and each subcommand's `--help` answer without importing torch or transformers (they cost
seconds to import; a help text needs neither)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")
PROBE = """
import json, sys
from agentrl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (HEAVY,)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["eval", "--help"], ["envs", "--help"],
                                  ["view", "--help"], ["replay", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv, tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    *help_lines, result = done.stdout.strip().splitlines()
    assert json.loads(result) == {"code": 0, "heavy": []}
    assert help_lines[0].startswith("usage: agentrl")
