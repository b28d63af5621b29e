"""How the GPU suite spreads over pytest-xdist workers.

    pytest -m gpu tests/gpu -n 8 --dist loadgroup

`--dist loadgroup` keeps together the tests of one xdist group. A test that names no group (the
`xdist_group` mark) is put in its file's: a file's tests share the packages its module fixtures
compile, as under `--dist loadfile`. Files whose cases compile packages of their own name finer
groups (the decode knobs, the CNN families), so that their long queue spreads over several
workers instead of being the suite's critical path on one.
"""
from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: before xdist's own hook, which reads the groups into the test ids
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
