"""Test job: write the values of the named environment variables (null if unset) as JSON.

Usage: env_probe.py OUT_FILE NAME [NAME...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    out, *names = sys.argv[1:]
    Path(out).write_text(json.dumps({name: os.environ.get(name) for name in names}))


if __name__ == "__main__":
    main()
