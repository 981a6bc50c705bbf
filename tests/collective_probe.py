"""Run train_grpo.py with a guard on torch.distributed's collectives, and record how vLLM was built.

    deepspeed --num_gpus 2 tests/collective_probe.py TRAINER_ARGS...   (or torchrun ... ; same args)

Under NCCL a collective only takes CUDA tensors; on the CPU (gloo) any tensor goes through, so a
reduction of a CPU tensor would pass every CPU test and fail on the first GPU node. The guard makes
the CPU run as strict as the code allows: a collective called from the project's own code must come
from distributed.all_reduce / all_gather_objects, which place the data on the backend's device.
Collectives made inside DeepSpeed, vLLM or torch are theirs and pass. Each rank writes what its
engine was built with to OUTPUT_DIR/probe_rankN.json, and digests of its random generators' states when
the engines start to be built, once vLLM's engine is built (its worker reseeds them) and when the run resumes
(restored by then).
"""

import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COLLECTIVES = ["all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
               "scatter", "scatter_object_list", "all_to_all", "all_to_all_single"]
ALLOWED = {("grpo_utils/distributed.py", "all_reduce"), ("grpo_utils/distributed.py", "all_gather_objects")}


def project_caller(frame) -> tuple[str, str, int] | None:
    """(file, function, line) of `frame` if it is the project's own code, else None."""
    path = Path(frame.f_code.co_filename).resolve()
    if not path.is_relative_to(ROOT) or any(p in path.parts for p in (".venv", "site-packages")):
        return None
    return str(path.relative_to(ROOT)), frame.f_code.co_name, frame.f_lineno


def install_guard() -> None:
    """Wrap every collective of torch.distributed; raise on one that the project's code calls
    directly anywhere but ALLOWED (DeepSpeed's and vLLM's own calls are theirs, and pass)."""
    def guarded(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            caller = project_caller(sys._getframe(1))
            if caller is not None and caller[:2] not in ALLOWED:
                raise RuntimeError(f"collective {fn.__name__} called at {caller[0]}:{caller[2]} ({caller[1]}) "
                                   "with data that did not go through distributed.all_reduce / all_gather_objects")
            return fn(*args, **kwargs)
        call.guarded = True
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name) and not getattr(getattr(dist, name), "guarded", False):
            setattr(dist, name, guarded(getattr(dist, name)))


def rng_digest() -> str:
    """A digest of Python's, NumPy's and torch's (CPU) generator states."""
    import hashlib
    import random

    import numpy as np

    state = (random.getstate(), [x.tolist() if hasattr(x, "tolist") else x for x in np.random.get_state()],
             torch.get_rng_state().tolist())
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


def record_engines() -> None:
    """Wrap train_grpo.make_vllm: each rank writes the executor its engine was built with; and build_engines
    and resume: the generators' digests around the build."""
    import train_grpo

    make, build, resume, load_data = (train_grpo.make_vllm, train_grpo.build_engines, train_grpo.resume,
                                      train_grpo.load_data)
    digests = {}

    def load_and_draw(*args, **kwargs):
        import random

        import numpy as np

        # a trainer that drew from its generators before the build: vLLM's reseed (to the very seed the trainer
        # seeds with) then shows, and so would a missing restore
        data = load_data(*args, **kwargs)
        random.random(), np.random.random(), torch.rand(1)
        return data

    def build_and_record(*args, **kwargs):
        digests["rng_at_build"] = rng_digest()
        return build(*args, **kwargs)

    def record_and_resume(engine, llm, checkpoints, rank, args):
        digests["rng_at_resume"] = rng_digest()
        path = Path(args.output_dir) / f"probe_rank{rank}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **digests}))
        return resume(engine, llm, checkpoints, rank, args)

    def make_and_record(model_path, args, rank, local_rank, *more):
        llm = make(model_path, args, rank, local_rank, *more)
        digests["rng_after_vllm"] = rng_digest()
        core = llm.llm_engine.engine_core.engine_core  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        info = {"backend": llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
                "executor": type(core.model_executor).__name__, "rank": rank, "local_rank": local_rank,
                "world": dist.get_world_size(), "device": str(core.model_executor.driver_worker.worker.device),
                "current_device": f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"}
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"probe_rank{rank}.json").write_text(json.dumps(info))
        return llm

    train_grpo.make_vllm = make_and_record
    train_grpo.build_engines, train_grpo.resume = build_and_record, record_and_resume
    train_grpo.load_data = load_and_draw  # main's name for loading.load_data


if __name__ == "__main__":
    import train_grpo

    install_guard()
    record_engines()
    train_grpo.main(sys.argv[1:])
    train_grpo.exit_without_teardown()
