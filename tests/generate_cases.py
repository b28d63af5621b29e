"""Drive a `--generate` package through the CPU reference executor, in a process of its own
(Triton's interpreter must be switched on before triton is imported).

    python tests/generate_cases.py PACKAGE SPEC.npz RESULT.npz

SPEC.npz: `prompt<i>` (int64 [P]) and `new` (tokens per generate call). RESULT.npz:
  gen<i>                 generate(prompt<i>, new) of one session
  prefill, decode        logits of session A: run(prompt0) then run(next token at position P0)
  stateA/<name>          session A's state after those two calls
  other                  session B's logits of run(prompt1), made after them
  stateA_after/<name>    session A's state after session B ran (must be unchanged)
  reset/<name>           session A's state after reset_state()
  error_long, error_past the messages of a prompt longer than the cache and of a generation that
                         would run past it"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402


def main(package: str, spec_path: str, result_path: str) -> None:
    from grace.formats import read_package
    from grace.tools.interpret import InterpretError, InterpretSession

    pkg = read_package(package)
    gen = pkg.manifest["generate"]
    tok, pos = gen["tokens"], gen["positions"]
    with np.load(spec_path) as data:
        spec = {k: data[k] for k in data.files}
    prompts = [spec[k] for k in sorted(k for k in spec if k.startswith("prompt"))]
    new = int(spec["new"])
    out = {}
    a = InterpretSession(pkg)
    for i, p in enumerate(prompts):
        out[f"gen{i}"] = a.generate(p, new)
    a.reset_state()
    p0 = prompts[0]
    out["prefill"] = a.run({tok: p0[None], pos: np.arange(len(p0))})["out"]
    nxt = int(np.argmax(out["prefill"][0, -1]))
    out["decode"] = a.run({tok: np.array([[nxt]]), pos: np.array([len(p0)])})["out"]
    for name, v in a.read_state().items():
        out[f"stateA/{name}"] = v
    b = InterpretSession(pkg)
    out["other"] = b.run({tok: prompts[1][None], pos: np.arange(len(prompts[1]))})["out"]
    for name, v in a.read_state().items():
        out[f"stateA_after/{name}"] = v
    a.reset_state()
    for name, v in a.read_state().items():
        out[f"reset/{name}"] = v
    cap = gen["capacity"]
    for key, (prompt, n) in {"error_long": (np.zeros(cap + 1, np.int64), 1),
                             "error_past": (p0, cap - len(p0) + 2)}.items():
        try:
            a.generate(prompt, n)
            out[key] = np.array("no error")
        except InterpretError as e:
            out[key] = np.array(str(e))
    np.savez(result_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
