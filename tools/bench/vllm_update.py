"""A vLLM engine (CPU build) taking new weights: zmqsync next to the other ways, one run.

(Not ``vllm.py``: tools/bench is on the path of the processes the harness starts, and of
a test process that imported a scenario, where a module of that name hides the vllm
package from whatever looks for it, torchrl's collectors included.)

    python -m tools.bench vllm                  # ~400 MB Llama; docs/bench/vllm.json
    python -m tools.bench vllm --layers 2 --hidden 256 --rounds 2   # a quick look

The harness side (this venv) builds or reuses the tests' vLLM venv
(tests/helpers/vllm_env.py), makes a Llama checkpoint locally (random bf16 weights, the
sizes below), and runs the measuring side in the vLLM venv (``python -m
tools.bench.vllm_update --engine ...``): one engine, a trainer (a `zmqsync.Publisher` in the
driver process) and, per round, in turn:

* **zmqsync**: ``publish(weights=other, max_lag=None)`` then ``Engine.update()``, both
  timed: the whole way from the trainer's tensors to the engine computing with them
  (update: fetch into each worker's memory, check, vLLM's in-place reload, prefix cache
  reset);
* **floor**: vLLM's own in-place reload from tensors already in the worker's memory
  (``model_runner.reload_weights(weights_iterator=...)``), what any way must pay;
* **disk**: ``safetensors.save_file`` of the tensors, then vLLM's reload from that
  directory (``reload_weights(weights_path=...)``) - the usual "checkpoint and reload";
* **pickle**: ``torch.save`` of the state_dict into bytes, sent over a plain ZeroMQ
  PUSH/PULL socket to the worker, ``torch.load(weights_only=True)`` there, then the
  same reload.

Then generation throughput: the same batch of greedy requests in a loop for
``--seconds``, with no update, and with the trainer publishing every ``--every`` seconds
and the loop calling ``update()`` between batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("zmqsync", "floor", "disk", "pickle")
PROMPTS = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(8)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.engine:
        return engine_side(args)
    sys.path.insert(0, str(ROOT))
    from tests.helpers import vllm_env

    venv = vllm_env.ensure()
    with tempfile.TemporaryDirectory(prefix="zs-bench-vllm-") as tmp:
        model = Path(tmp) / "model"
        sizes = [f"{k}={getattr(args, k)}" for k in ("hidden", "intermediate", "layers",
                                                     "heads", "kv_heads", "vocab")]  # fmt: skip
        subprocess.run([str(venv.python), "-m", "tests.helpers.vllm_model", str(model), "0",
                        *sizes], env=venv.env(), cwd=ROOT, check=True, timeout=900)  # fmt: skip
        out = Path(tmp) / "result.json"
        cmd = [str(venv.python), "-m", "tools.bench.vllm_update", "--engine", "--model", str(model),
               "--out", str(out), *argv]  # fmt: skip
        env = venv.env(VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # the bench's own callables
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=3600)
        result = json.loads(out.read_text())
    _report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the four ways")
    p.add_argument("--seconds", type=float, default=30.0, help="per throughput run")
    p.add_argument("--every", type=float, default=3.0, help="publish period (s)")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench" / "vllm.json"))
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def _report(result: dict[str, Any]) -> None:
    print(f"model: {result['mb']:.0f} MB bf16, {result['tensors']} tensors; "
          f"{result['rounds']} rounds, median (min) ms")  # fmt: skip
    for way in WAYS:
        times = result["ways"][way]
        print(
            f"  {way:<8} "
            + "  ".join(
                f"{k} {statistics.median(v) * 1e3:7.1f} ({min(v) * 1e3:.1f})"
                for k, v in times.items()
            )
        )
    for run, t in result["throughput"].items():
        print(f"  tokens/s {run:<14} {t['tokens_per_s']:8.1f}  ({t['updates']} updates)")


# --- the measuring side, in the vLLM venv ---------------------------------------------


def engine_side(args: argparse.Namespace) -> int:
    import torch
    import zmq
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    import zmqsync
    from tests.helpers.vllm_model import config, state_dict
    from zmqsync.integrations import vllm as zv

    cfg = config(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                 heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)  # fmt: skip
    versions = [state_dict(1, cfg), state_dict(2, cfg)]
    mb = sum(t.numel() * t.element_size() for t in versions[0].values()) / 2**20
    llm = LLM(args.model, worker_extension_cls=zv.WORKER_EXTENSION, dtype="bfloat16",
              max_model_len=256, enforce_eager=True, max_num_seqs=16)  # fmt: skip
    times: dict[str, dict[str, list[float]]] = {
        "zmqsync": {"publish": [], "update": [], "total": []},
        "floor": {"reload": []},
        "disk": {"save": [], "reload": [], "total": []},
        "pickle": {"send+load": [], "reload": [], "total": []},
    }
    ctx = zmq.Context()
    with zmqsync.Publisher(versions[0], name="bench-vllm") as pub:
        engine = zv.attach(llm, name="bench-vllm", timeout=60)
        for r in range(args.rounds):
            weights = versions[(r + 1) % 2]
            t0 = time.perf_counter()
            pub.publish(weights=weights, max_lag=None)
            t1 = time.perf_counter()
            engine.update(timeout=10)
            t2 = time.perf_counter()
            _add(times["zmqsync"], publish=t1 - t0, update=t2 - t1, total=t2 - t0)
            times["floor"]["reload"].append(llm.collective_rpc(_reload_held)[0])
            with tempfile.TemporaryDirectory(prefix="zs-bench-ckpt-") as ckpt:
                t0 = time.perf_counter()
                save_file(weights, f"{ckpt}/model.safetensors")
                t1 = time.perf_counter()
                llm.collective_rpc(_reload_from, args=(ckpt,))
                t2 = time.perf_counter()
            _add(times["disk"], save=t1 - t0, reload=t2 - t1, total=t2 - t0)
            _add(times["pickle"], **_pickle_round(llm, ctx, weights, torch))
        throughput = {
            "no updates": _generate(llm, SamplingParams, args.seconds, None, None),
            f"update/{args.every:g}s": _generate(llm, SamplingParams, args.seconds,
                                                  (pub, versions, args.every), engine),
        }  # fmt: skip
        engine.close()
    ctx.destroy(linger=0)
    result = {"mb": mb, "tensors": len(versions[0]), "rounds": args.rounds, "ways": times,
              "throughput": throughput, "config": cfg}  # fmt: skip
    Path(args.out).write_text(json.dumps(result))
    return 0


def _add(bucket: dict[str, list[float]], **seconds: float) -> None:
    for key, value in seconds.items():
        bucket[key].append(value)


def _reload_held(worker: Any) -> float:
    """The floor: vLLM's reload from tensors in this worker's memory (zmqsync's copy)."""
    follower = worker._zmqsync
    named = {".".join(k): t for k, t in follower.sub.tensors.items()}
    t0 = time.perf_counter()
    worker.model_runner.reload_weights(weights_iterator=iter(named.items()))
    return time.perf_counter() - t0


def _reload_from(worker: Any, path: str) -> None:
    worker.model_runner.reload_weights(weights_path=path)


def _pickle_round(llm: Any, ctx: Any, weights: dict[str, Any], torch: Any) -> dict[str, float]:
    """torch.save -> PUSH ... PULL -> torch.load(weights_only=True) -> reload."""
    import io
    import threading

    import zmq

    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tempfile.gettempdir()}/zs-bench-pickle-{time.monotonic_ns()}.sock"
    push.bind(address)
    started = time.perf_counter()

    def send() -> None:
        buf = io.BytesIO()
        torch.save(weights, buf)
        push.send(buf.getbuffer(), copy=False)

    sender = threading.Thread(target=send)
    sender.start()
    took = llm.collective_rpc(_receive_and_reload, args=(address,))[0]
    total = time.perf_counter() - started
    sender.join(60)
    push.close()
    return {"send+load": total - took, "reload": took, "total": total}


def _receive_and_reload(worker: Any, address: str) -> float:
    import io

    import torch
    import zmq

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(address)
    try:
        if not pull.poll(120_000):
            raise TimeoutError("no pickled state_dict within 120 s")
        state = torch.load(io.BytesIO(pull.recv(copy=False).buffer), weights_only=True)
    finally:
        pull.close()
    t0 = time.perf_counter()
    worker.model_runner.reload_weights(weights_iterator=iter(state.items()))
    return time.perf_counter() - t0


def _generate(llm: Any, params_cls: Any, seconds: float, trainer: Any, engine: Any) -> dict:
    """Greedy batches for `seconds`; with `trainer`, a publish every few seconds from a
    thread and ``engine.update()`` between batches."""
    import threading

    params = params_cls(temperature=0, max_tokens=64, ignore_eos=True)
    stop = threading.Event()
    thread = None
    if trainer is not None:
        pub, versions, every = trainer

        def publish() -> None:
            i = 0
            while not stop.wait(every):
                i += 1
                pub.publish(weights=versions[i % 2], max_lag=None)

        thread = threading.Thread(target=publish)
        thread.start()
    tokens = updates = 0
    first = engine.version if engine is not None else 0
    end = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < end:
        if engine is not None:
            engine.update()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join(60)
    if engine is not None:
        updates = engine.version - first
    return {"tokens_per_s": tokens / elapsed, "updates": updates, "seconds": elapsed}


if __name__ == "__main__":
    sys.exit(main())
