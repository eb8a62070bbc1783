"""How a process of a launched run ends (torch-free, so the `agentrl` command can use it for any subcommand)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def launched() -> bool:
    """Whether this process is one of several started by torchrun or accelerate launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def exit_process(code: int) -> NoReturn:
    """End the process with `code`. One of a launch skips the interpreter's teardown: its run is over, its files
    are written and its process group destroyed, but gloo's worker threads meeting a finalising interpreter can
    still abort it ("terminate called without an active exception"), and the launcher would then report a
    finished run as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    if launched():
        os._exit(code)
    sys.exit(code)
