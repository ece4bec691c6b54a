"""Install the toolkit: `pip install -e .` (add `[dev]` for the test tools)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("asr/__init__.py").read_text()).group(1)

setup(
    name="asr",
    version=version,
    description="A transformer speech recognition toolkit: simple to read, fast to train and decode.",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["asr", "asr.*"]),
    package_data={"asr": ["web/*"]},  # the page of `asr serve`
    install_requires=[
        # torchaudio 2.11 is its last release and imports only beside a torch built for the
        # same CUDA: torch 2.11 to 2.14.
        "torch>=2.11,<2.15",
        "torchaudio==2.11.*",
        "soundfile>=0.12",
        "jiwer>=3.0",
        "sentencepiece>=0.2",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
    ],
    extras_require={
        "dev": ["pytest>=7.4", "hypothesis>=6.90", "ruff>=0.5", "selenium>=4.10"],  # selenium: the web page's tests
        "synth": ["espeakng-loader>=0.2"],
        # `asr serve`: aiohttp (server, multipart uploads, client for the load test)
        "serve": ["aiohttp>=3.9"],
        # `asr export` and transcription of exported models
        "export": ["onnx>=1.16", "onnxscript>=0.1", "onnxruntime>=1.18"],
        # tools/simulate_rirs.py: rooms' impulse responses by the image-source method
        "rir": ["pyroomacoustics>=0.7"],
        # recipes/synth/local/human.py: Asterisk's G.722 prompts decoded by FFmpeg through PyAV
        "human": ["av>=12"],
    },
    entry_points={"console_scripts": ["asr=asr.cli:main"]},
)
