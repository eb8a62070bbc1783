"""`python -m agentrl ...` runs the `agentrl` command."""

import sys

from agentrl.cli import main

sys.exit(main())
