"""Score a correct and a wrong stdin/stdout program through rewards.compute_rewards, as whichever user runs it
(tests/test_sandbox_isolation.py runs it as an unprivileged one): prints the scores as JSON, or the one line
that refuses code rewards (exit status 3)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rewards  # noqa: E402
from sandboxed.sandbox import SandboxUnavailable  # noqa: E402

TESTS = {"stdio": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]}
PROGRAMS = ["a, b = map(int, input().split())\nprint(a + b)", "print(3)"]

if __name__ == "__main__":
    if sys.argv[1:] == ["--ready"]:  # this user can run this Python, read the checkout and see the installation
        # the interpreter's own directory (what bubblewrap binds into a sandbox unprivileged)
        print("ready" if os.path.realpath(sys.executable).startswith(sys.base_prefix + os.sep) else "not ready")
        sys.exit(0)
    try:
        scores = rewards.compute_rewards([f"```python\n{p}\n```" for p in PROGRAMS], [TESTS] * 2, ["code"] * 2,
                                         num_workers=1)
    except SandboxUnavailable as e:
        print(e)
        sys.exit(3)
    print(json.dumps(scores))
