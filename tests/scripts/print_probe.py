"""Test module (run with -m): each rank prints its rank and its process title, then exits."""

import os
import sys

title = open(f"/proc/{os.getpid()}/cmdline", encoding="utf-8").read().replace("\0", " ").strip()
print(f"probe rank={os.environ['RANK']} role={os.environ['ROLE_NAME']} argv={sys.argv[1:]} title={title}", flush=True)
