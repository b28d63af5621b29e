#!/usr/bin/env bash
# Creates .venv and installs grace with the compiler and test extras, on a machine without a GPU.
# torch is installed first with an exact pin: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[aot,test]'
