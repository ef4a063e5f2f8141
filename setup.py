"""The optional compiled parts. Everything else is in pyproject.toml.

`btb_lab/sim/_cachec.c` (the prefix cache) and `btb_lab/workload/_hashc.c` (the block-id
hash) build with the C compiler the interpreter was built with; where they cannot, the
install goes on without them and btb-lab uses the pure-Python code (the same rules and
ids; `btb-lab run` records which cache ran).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "btb_lab.sim._cachec",
            ["btb_lab/sim/_cachec.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11"],
        ),
        Extension(
            "btb_lab.workload._hashc",
            ["btb_lab/workload/_hashc.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11"],
        ),
    ]
)
