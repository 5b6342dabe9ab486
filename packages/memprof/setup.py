from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "memprof._core",
            sources=["src/memprof/_core.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall"],
        )
    ],
)
