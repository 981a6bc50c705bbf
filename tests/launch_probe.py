"""What a launched rank sees (tests/test_rank_server.py): argv, the launcher's variables, torch's threads,
the import path's head; written to OUT/rank{RANK}.json. Rank 1 exits with EXIT_CODE when it is given."""

import json
import os
import sys

import torch

out = sys.argv[-1]
seen = {"argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(), "threads": torch.get_num_threads(),
        "main": __name__, "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                   "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE",
                                                                   "LOCAL_SIZE", "PROBE_MARK")}}
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
print(f"rank {os.environ['RANK']} wrote", flush=True)
if os.environ["RANK"] == "1" and os.environ.get("EXIT_CODE"):
    sys.exit(int(os.environ["EXIT_CODE"]))
