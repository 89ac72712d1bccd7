"""Conveyor: a TorchServe-compatible model server with continuous batching and stateful sequences."""

from setuptools import find_packages, setup

setup(
    name="conveyor-serve",
    version="0.1.0",
    description="Model server for PyTorch / Hugging Face models: continuous batching, sequences, TorchServe-compatible",
    python_requires=">=3.11",
    packages=find_packages(include=["backend*", "frontend*", "handlers*"]),
    include_package_data=True,
    package_data={"frontend": ["grpc/protos/*.proto"], "backend": ["ts_compat/**/*.py"]},
    install_requires=[
        # torch is pinned exactly: an unpinned torch pulls a multi-GB CUDA build.
        "torch==2.13.0",
        "transformers==5.24.0",
        "tokenizers>=0.22,<0.24",
        "aiohttp>=3.10,<4",
        "uvloop>=0.19,<1",
        "grpcio>=1.66,<2",
        "grpcio-tools>=1.66,<2",
        "protobuf>=5.28,<8",
        "prometheus-client>=0.20,<1",
        "pyyaml>=6.0,<7",
        "numpy>=1.26,<3",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-timeout>=2.3,<3",
            "requests>=2.31,<3",
            "openai>=1.40,<4",
            "torch-model-archiver==0.12.0",
        ],
    },
    entry_points={"console_scripts": ["conveyor=frontend.cli:main"]},
)
