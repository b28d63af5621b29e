"""`grace inspect`: what is inside a `.grace` package.

`describe(package)` turns a package (from `grace.formats.read_package`) into a plain JSON-able dict;
the keys are documented in docs/inspect.md and are stable within a format major version.
`render(description, console)` prints that dict as rich tables for people.

Imports numpy-free, torch-free: only rich (for `render`).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Mapping

__all__ = ["describe", "render", "human_bytes"]

TOP_ARENA_BUFFERS = 10


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def _version_str(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ".".join(str(x) for x in v)
    return str(v)


def _version_list(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [int(x) if isinstance(x, int) else x for x in v]
    return v


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x).hex()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def describe(package, path: str | os.PathLike | None = None) -> dict:
    """A JSON-able description of a package (see docs/inspect.md for the keys)."""
    m = package.manifest
    path = path if path is not None else getattr(package, "path", None)

    # --- I/O and the argument table ---------------------------------------------------------------
    slots = (m.get("table") or {}).get("slots", []) or []
    table_slots = []
    word = 0
    for i, s in enumerate(slots):
        rank = int(s.get("rank", 0))
        n = 1 + 2 * rank
        table_slots.append(
            {
                "slot": i,
                "name": s.get("name"),
                "role": s.get("role"),
                "offset": s.get("offset"),
                "rank": rank,
                "first_word": word,
                "words": n,
            }
        )
        word += n

    def io(entries):
        return [
            {"name": e.get("name"), "dtype": e.get("dtype"), "shape": _jsonable(e.get("shape")), "slot": e.get("slot")}
            for e in entries or []
        ]

    # --- memory plan -------------------------------------------------------------------------------
    weights = m.get("weights", []) or []
    arena_buffers = m.get("arena_buffers", []) or []
    largest = sorted(arena_buffers, key=lambda b: (-int(b.get("nbytes", 0)), int(b.get("offset", 0))))
    memory = {
        "regions": {k: int(v) for k, v in (m.get("regions") or {}).items()},
        "weights": {"count": len(weights), "nbytes": sum(int(w.get("nbytes", 0)) for w in weights)},
        "arena_buffers": {
            "count": len(arena_buffers),
            "nbytes": sum(int(b.get("nbytes", 0)) for b in arena_buffers),
            "largest": [
                {
                    "name": b.get("name"),
                    "offset": b.get("offset"),
                    "nbytes": b.get("nbytes"),
                    "first": b.get("first"),
                    "last": b.get("last"),
                }
                for b in largest[:TOP_ARENA_BUFFERS]
            ],
        },
    }

    # --- kernels and graphs -------------------------------------------------------------------------
    kernels = m.get("kernels", []) or []
    graphs = m.get("graphs", []) or []
    uses: Counter = Counter()
    grids: dict[int, list] = {}
    for g in graphs:
        for node in g.get("nodes", []) or []:
            k = node.get("kernel")
            uses[k] += 1
            grid = list(node.get("grid", []))
            seen = grids.setdefault(k, [])
            if grid not in seen:
                seen.append(grid)

    kernel_list = []
    for i, k in enumerate(kernels):
        kernel_list.append(
            {
                "index": i,
                "name": k.get("name"),
                "family": k.get("family"),
                "grids": grids.get(i, []),
                "num_warps": k.get("num_warps"),
                "num_stages": k.get("num_stages"),
                "shared": k.get("shared"),
                "archs": sorted((k.get("binaries") or {}).keys()),
                "source_sha256": k.get("source_sha256"),
                "has_source": bool(k.get("source")),
                "params": len(k.get("params", []) or []),
                "nodes": uses.get(i, 0),
            }
        )

    graph_list = []
    for g in graphs:
        nodes = g.get("nodes", []) or []
        fam: Counter = Counter()
        for node in nodes:
            k = node.get("kernel")
            fam[kernels[k].get("family", "?") if isinstance(k, int) and 0 <= k < len(kernels) else "?"] += 1
        graph_list.append(
            {
                "name": g.get("name"),
                "nodes": len(nodes),
                "unique_kernels": len({n.get("kernel") for n in nodes}),
                "edges": sum(len(n.get("deps", []) or []) for n in nodes),
                "families": dict(sorted(fam.items(), key=lambda kv: (-kv[1], str(kv[0])))),
                "stats": _jsonable(g.get("stats", {}) or {}),
            }
        )

    sections = [
        {"name": name, "offset": off, "nbytes": nbytes, "sha256": sha}
        for (name, off, nbytes, sha) in getattr(package, "section_info", []) or []
    ]
    file_nbytes = getattr(package, "nbytes", None)
    if file_nbytes is None and path is not None:
        try:
            file_nbytes = os.path.getsize(path)
        except OSError:
            file_nbytes = None

    return {
        "path": str(path) if path is not None else None,
        "file_nbytes": file_nbytes,
        "format_version": _version_list(getattr(package, "format_version", None) or m.get("format_version")),
        "model": _jsonable(m.get("model", {}) or {}),
        "producer": _jsonable(m.get("producer", {}) or {}),
        "archs": list(m.get("archs", []) or []),
        "options": _jsonable(m.get("options", {}) or {}),
        "inputs": io(m.get("inputs")),
        "outputs": io(m.get("outputs")),
        "table": {"nbytes": (m.get("table") or {}).get("nbytes"), "words": word, "slots": table_slots},
        "memory": memory,
        "kernels": kernel_list,
        "graphs": graph_list,
        "sections": sections,
    }


# ------------------------------------------------------------------------------------------------
# rendering
# ------------------------------------------------------------------------------------------------


def _shape(s) -> str:
    return "[" + ", ".join(str(d) for d in (s or [])) + "]"


def render(d: Mapping, console=None) -> None:
    """Print a description from `describe` as rich tables."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    def table(title, *cols, **kw):
        t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, **kw)
        for c in cols:
            justify = "right" if c.startswith(">") else "left"
            t.add_column(c.lstrip(">"), justify=justify)
        return t

    # header
    prod = d.get("producer", {}) or {}
    hdr = Table.grid(padding=(0, 2))
    hdr.add_column(style="bold cyan")
    hdr.add_column()
    hdr.add_row("model", str((d.get("model") or {}).get("name", "?")))
    if d.get("path"):
        hdr.add_row("file", str(d["path"]))
    hdr.add_row("format", _version_str(d.get("format_version")))
    hdr.add_row("producer", "  ".join(f"{k} {v}" for k, v in prod.items()) or "?")
    hdr.add_row("archs", ", ".join(d.get("archs", [])) or "-")
    if d.get("file_nbytes") is not None:
        hdr.add_row("size", f"{human_bytes(d['file_nbytes'])} ({d['file_nbytes']} bytes)")
    console.print(hdr)
    console.print()

    # inputs / outputs
    t = table("inputs / outputs", "kind", "name", "dtype", "shape", ">slot")
    for kind in ("inputs", "outputs"):
        for e in d.get(kind, []):
            t.add_row(kind[:-1], str(e["name"]), str(e["dtype"]), _shape(e["shape"]), str(e["slot"]))
    console.print(t)

    # argument table
    tab = d.get("table", {})
    t = table(
        f"argument table ({tab.get('nbytes')} bytes, {tab.get('words')} words)",
        ">slot", "name", "role", ">offset", ">rank", "words",
    )
    for s in tab.get("slots", []):
        first, n = s["first_word"], s["words"]
        t.add_row(str(s["slot"]), str(s["name"]), str(s["role"]), str(s["offset"]), str(s["rank"]),
                  f"{n} (w{first}..w{first + n - 1})")
    console.print(t)

    # memory plan
    mem = d.get("memory", {})
    t = table("memory plan", "region", ">size", ">bytes", "contents")
    w, ab = mem.get("weights", {}), mem.get("arena_buffers", {})
    notes = {
        "weights": f"{w.get('count', 0)} tensors",
        "arena": f"{ab.get('count', 0)} buffers ({human_bytes(ab.get('nbytes', 0))} before reuse)",
        "table": f"{len(tab.get('slots', []))} slots",
    }
    for name, nbytes in mem.get("regions", {}).items():
        t.add_row(name, human_bytes(nbytes), str(nbytes), notes.get(name, ""))
    console.print(t)
    if ab.get("largest"):
        t = table(f"largest arena buffers (top {len(ab['largest'])} of {ab.get('count')})",
                  "name", ">offset", ">size", "live (nodes)")
        for b in ab["largest"]:
            t.add_row(str(b["name"]), str(b["offset"]), human_bytes(b["nbytes"] or 0), f"{b['first']}..{b['last']}")
        console.print(t)

    # kernels
    t = table(f"kernels ({len(d.get('kernels', []))})", ">#", "name", "family", "grids", ">warps", ">stages",
              ">shared", "archs", "source", ">nodes")
    for k in d.get("kernels", []):
        grids = k.get("grids", [])
        g = ", ".join("x".join(str(v) for v in gr) for gr in grids[:3]) + (f" (+{len(grids) - 3})" if len(grids) > 3 else "")
        sha = (k.get("source_sha256") or "")[:12]
        t.add_row(str(k["index"]), str(k["name"]), str(k["family"]), g or "-", str(k["num_warps"]),
                  str(k["num_stages"]), human_bytes(k["shared"] or 0), ",".join(k["archs"]), sha or "-", str(k["nodes"]))
    console.print(t)

    # graphs
    for g in d.get("graphs", []):
        console.print(f"[bold]graph {g['name']!r}[/bold]: {g['nodes']} nodes, {g['unique_kernels']} unique kernels, "
                      f"{g['edges']} dependency edges", highlight=False)
        t = table(None, "family", ">nodes")
        for fam, n in g.get("families", {}).items():
            t.add_row(str(fam), str(n))
        console.print(t)
        if g.get("stats"):
            st = Table.grid(padding=(0, 2))
            st.add_column(style="cyan")
            st.add_column()
            for k, v in g["stats"].items():
                st.add_row(f"  {k}", str(v))
            console.print(st)
            console.print()
