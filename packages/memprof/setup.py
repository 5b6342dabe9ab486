from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "memprof._core",
            sources=["src/memprof/_core.c"],
            extra_compile_args=[
                "-O2",
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
                "-fvisibility=hidden",
            ],
            libraries=["m", "dl"],
        )
    ],
)
