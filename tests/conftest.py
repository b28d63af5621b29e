"""Settings for the whole test suite.

GRACE_VERIFY=1: every compile in the tests checks the IR at the stage boundaries (after lowering,
fusion, the memory plan and the dependency edges, aot/verify_ir.py), so a stage that breaks an
invariant fails the test that compiled the model, naming the kernel, instead of producing a wrong
number later. It costs a walk over each kernel's expressions (well under the lowering itself).
`setdefault`: a run can still switch it off with GRACE_VERIFY=0.
"""
import os

os.environ.setdefault("GRACE_VERIFY", "1")
