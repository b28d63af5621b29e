"""The caps on every count, size, depth and integer of a package (SPEC.md §2.1, "Limits").

A package is input from anyone, and every number in its manifest ends up as an allocation, a loop
bound, a C integer handed to the CUDA driver or a recursion depth somewhere. Each cap here is what
keeps one of those bounded, chosen well above anything a real model needs: the reader refuses a
package beyond a cap (FormatError / ManifestError) before it allocates or launches anything, and
the writer refuses to write one. Compiler output of real models is far below all of them.

Pure constants, no imports: the reader (package.py, manifest.py, shapes.py), the runtime and the
tools read them from here, and SPEC.md lists the same numbers.
"""

# --- the manifest as msgpack (R12): bounded before and while it is decoded -----------------------
MAX_MANIFEST_NBYTES = 64 << 20    # a two-layer test decoder with 3 graphs: 59 KB
MAX_MANIFEST_ITEMS = 1 << 22      # maps + arrays + their entries (keys, values, elements)
MAX_MANIFEST_STR = 1 << 20        # bytes of one msgpack str or bin
MAX_MANIFEST_DEPTH = 32           # nesting of maps and arrays; a node argument sits at depth 6

# --- the weights and state sections as safetensors (R15) -----------------------------------------
MAX_SAFETENSORS_HEADER = 32 << 20  # JSON bytes; ~100 per tensor (safetensors itself allows 100 MB)
MAX_SAFETENSORS_CONTAINERS = 3 * (1 << 18) + 2   # '{' and '[' in it: 3 per tensor, 2 more

# --- sizes (R13) ---------------------------------------------------------------------------------
I64_MAX = 2**63 - 1               # table words, symbol values and codes are int64
MAX_REGION_NBYTES = 1 << 40       # each region (weights, arena, table, state), 1 TiB
MAX_TENSOR_NBYTES = MAX_REGION_NBYTES   # prod(max(dim, 1)) * itemsize of any tensor, I/O at its bounds
MAX_RANK = 64
MAX_SHARED_NBYTES = 232448        # dynamic shared memory per block: 227 KiB, the H100/H200 opt-in max
MAX_HIDDEN_PARAMS = 16            # Triton 3.6 appends 2
MAX_KERNEL_PARAMS = 4095          # params + hidden_params: CUDA's 32,764-byte parameter limit at 8 bytes each
MAX_NUM_STAGES = 64               # informative, but an int like every other
MAX_GRID = (2**31 - 1, 65535, 65535)   # CUDA gridDim limits
NUM_WARPS = (1, 2, 4, 8, 16, 32)  # 32 * num_warps <= 1024 threads per block

# --- counts (R13) --------------------------------------------------------------------------------
MAX_ARCHS = 16                    # manifest `archs`, and each graph's `archs` (3.5)
MAX_SM_COUNT = 4096               # a graph's compiled.target.sm_count (3.5); an H200 has 132
MAX_SYMBOLS = 64
MAX_IO = 1024                     # inputs, and outputs (the table has at most 2 * MAX_IO slots)
MAX_TENSORS = 1 << 18             # entries of weights, state and arena_buffers, each (an 8B model: 291)
MAX_KERNELS = 1 << 16
MAX_GRAPHS = 1024                 # one per bucket
MAX_NODES = 16384                 # per graph; the race check keeps a bitset per node
MAX_INDEX_CHECKS = 1 << 16

assert MAX_SAFETENSORS_CONTAINERS == 3 * MAX_TENSORS + 2

__all__ = [name for name in dir() if name.isupper()]
