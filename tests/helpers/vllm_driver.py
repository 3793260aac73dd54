"""A vLLM engine driven by a test, one JSON command per stdin line (run in the vLLM venv).

``python -m tests.helpers.vllm_driver MODEL_DIR [TP]`` starts ``LLM(MODEL_DIR,
worker_extension_cls=WORKER_EXTENSION, tensor_parallel_size=TP)``, prints
``@zv {"event": "ready"}``, then answers each command line with one ``@zv {...}`` line
(vLLM's own logs go to the same stdout; the prefix tells replies apart):

* ``{"op": "attach", "name", "address", "shm_dir", "check_finite", "timeout"}``
* ``{"op": "update", "timeout"}`` -> ``{"version"}`` or ``{"error", "kind", "version"}``
* ``{"op": "generate", "prompts", "max_tokens"}`` -> ``{"tokens", "weight_versions"}``
* ``{"op": "tensors"}`` -> ``{"digests": [{name: sha256}, ...]}`` (one per rank): what the
  engine computes with
  (`tests.helpers.vllm_probe`), through ``collective_rpc``
* ``{"op": "detach"}``, ``{"op": "quit"}``
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

PREFIX = "@zv "


def reply(**fields: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(model: str, tp: int = 1) -> int:
    from vllm import LLM, SamplingParams

    from tests.helpers.vllm_probe import engine_digests
    from zmqsync.integrations import vllm as zv

    llm = LLM(model, worker_extension_cls=zv.WORKER_EXTENSION, dtype="bfloat16",
              max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=8,
              tensor_parallel_size=tp)  # fmt: skip
    engine: zv.Engine | None = None
    reply(event="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "attach":
                try:
                    engine = zv.attach(llm, **cmd)
                    reply(version=engine.version)
                except zv.UpdateFailed as exc:
                    reply(error=str(exc), kind=exc.kind, version=exc.version)
            elif op == "update":
                assert engine is not None
                try:
                    reply(version=engine.update(**cmd))
                except zv.UpdateFailed as exc:
                    reply(error=str(exc), kind=exc.kind, version=exc.version)
            elif op == "generate":
                params = SamplingParams(temperature=0, max_tokens=cmd.get("max_tokens", 16))
                outs = llm.generate(cmd["prompts"], params, use_tqdm=False)
                reply(
                    tokens=[list(o.outputs[0].token_ids) for o in outs],
                    weight_versions=[
                        [s.version for s in (o.outputs[0].weight_versions or [])] for o in outs
                    ],
                )
            elif op == "tensors":
                reply(digests=llm.collective_rpc(engine_digests))  # one dict per rank
            elif op == "detach":
                if engine is not None:
                    engine.close()
                engine = None
                reply(ok=True)
            elif op == "quit":
                reply(ok=True)
                break
            else:
                reply(error=f"unknown op {op!r}", kind="driver")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            reply(error=f"{type(exc).__name__}: {exc}", kind="driver",
                  trace=traceback.format_exc()[-3000:])  # fmt: skip
    if engine is not None:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(int, sys.argv[2:3])))
