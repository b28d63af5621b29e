"""Run one package through the CPU reference executor on several input sets, in a process of its
own (Triton's interpreter must be switched on before triton is imported).

    python tests/interpret_cases.py PACKAGE CASES.npz RESULT.npz [session]

CASES.npz holds arrays named `<case>/<input>`; RESULT.npz gets `<case>/<output>` for every output
plus `<case>/graph` (the graph that ran) — or `<case>/error` with the message when the run was
refused (an out-of-range size, say). With `session`, the cases run in order in one session, so
session state (a mutated buffer) carries from one case to the next; otherwise each starts afresh."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402


def main(package: str, cases_path: str, result_path: str, mode: str = "") -> None:
    from grace.formats import read_package
    from grace.tools.interpret import InterpretSession, run_package

    pkg = read_package(package)
    cases: dict[str, dict] = {}
    with np.load(cases_path) as data:
        for key in data.files:
            case, name = key.split("/", 1)
            cases.setdefault(case, {})[name] = data[key]
    result = {}
    session = InterpretSession(pkg) if mode == "session" else None
    for case, inputs in sorted(cases.items()):
        try:
            out = session.run(inputs) if session else run_package(pkg, inputs, poison=True)
        except Exception as exc:  # reported to the test, which decides
            result[f"{case}/error"] = np.array(f"{type(exc).__name__}: {exc}")
            continue
        result[f"{case}/graph"] = np.array(out.graph)
        for name, value in out.items():
            result[f"{case}/{name}"] = value
    np.savez(result_path, **result)


if __name__ == "__main__":
    main(*sys.argv[1:5])
