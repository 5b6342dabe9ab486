from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "refstore._fastpath",
            sources=["src/refstore/_fastpath.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden"],
        )
    ],
)
