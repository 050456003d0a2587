"""Run `relaytrain bench checkpoint` against local S3 and GCS servers.

The servers are the test suite's (tests/storage/servers.py: moto and fake-gcs-server, from the
`dev` and `storage` extras), started on 127.0.0.1 for this run and stopped after it; the
benchmark itself only measures the stores at the URLs it is given. Extra arguments go to the
benchmark (`--quick`, `--json`). From the repository root:

    .venv/bin/python scripts/bench_object_storage.py [--quick] [--json]
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relaytrain.cli import main  # noqa: E402
from tests.storage.servers import SERVERS  # noqa: E402


def run(argv: list[str]) -> int:
    with ExitStack() as servers:
        urls = []
        for cls in SERVERS.values():
            server = servers.enter_context(cls(bucket="relaytrain-bench"))
            os.environ.update(server.env)
            urls += ["--url", server.url("bench")]
        return main(["bench", "checkpoint", *urls, *argv])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
