"""Child process of test_fuzz.py: run CLI cases one after the other in this process.

    python fuzz_child.py CASES.json RESULTS.jsonl

Before each case it appends {"id", "started": true} to RESULTS (flushed), after it
{"id", "rc", "stderr", "stdout", "traceback"}. A case with a start line and no
result line killed the process; ids already in RESULTS are skipped, so the parent
restarts this child after a crash and it carries on with the next case.
"""

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path


def run(cases_file: str, results_file: str) -> None:
    from flashnorm_mlx.cli import main as cli

    cases = json.loads(Path(cases_file).read_text())
    results = Path(results_file)
    seen = set()
    if results.exists():
        seen = {json.loads(line)["id"] for line in results.read_text().splitlines()}
    with open(results, "a") as log:
        for case in cases:
            if case["id"] in seen:
                continue
            log.write(json.dumps({"id": case["id"], "started": True}) + "\n")
            log.flush()
            out, err, tb = io.StringIO(), io.StringIO(), None
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli(case["argv"])
                except SystemExit as e:  # argparse exits this way
                    rc = e.code if isinstance(e.code, int) else 1
                except BaseException:  # what the real CLI would print as a traceback
                    rc, tb = None, traceback.format_exc()
            row = dict(
                id=case["id"],
                rc=rc,
                stderr=err.getvalue(),
                stdout=out.getvalue()[-4000:],
                traceback=tb,
            )
            log.write(json.dumps(row) + "\n")
            log.flush()


if __name__ == "__main__":
    run(*sys.argv[1:3])
