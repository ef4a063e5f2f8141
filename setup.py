"""The optional compiled prefix cache. Everything else is in pyproject.toml.

`btb_lab/sim/_cachec.c` builds with the C compiler the interpreter was built with; where it
cannot, the install goes on without it and the simulator uses the pure-Python cache (the
same rules; `btb-lab run` records which one ran).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "btb_lab.sim._cachec",
            ["btb_lab/sim/_cachec.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11"],
        )
    ]
)
