"""Source text for the sm_90 compile tests' subprocess scripts (they run without Triton's interpreter, which
the pytest process imports): `resources(fn, args, kw)` compiles @triton.jit `fn` for the H200 as a launch
with (args, kw) specializes it (Triton's own binder, then its _pack_args) and returns its registers and
spills (ptxas -v), shared memory and PTX. A script starts with `RESOURCES` and catches its launch's
arguments however it likes."""

RESOURCES = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)


def resources(fn, args, kw):
    backend = make_backend(TARGET)
    bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(re.search(pat, log).group(1))
    return dict(regs=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), smem=k.metadata.shared, ptx=k.asm["ptx"])
"""
