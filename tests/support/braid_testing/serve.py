"""`braid serve` with the faults BRAID_INJECT_FAULT asks for wrapped around the engine's ports:
`python -m braid_testing.serve serve --port ...`, as BraidProcess runs it when its environment
names a fault. A bad value ends the start with one line, as a bad flag does."""

from __future__ import annotations

import sys

from braid.server.cli import main
from braid_testing.faults import Faults

if __name__ == "__main__":
    try:
        faults = Faults.from_env()
    except ValueError as exc:
        print(f"braid: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(ports=faults))
