"""Shared fixtures: the real-speech folder (skipped when absent), the data modules' small corpus and
character tokenizer (a test file with its own `corpus` or `tokenizer` fixture overrides them), and
the test markers."""
from __future__ import annotations

from pathlib import Path

import pytest

REALSPEECH = Path(__file__).resolve().parents[1].parent / "shared" / "realspeech"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds; run by .ci/run after the fast suite")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread: on a busy 2-core machine OpenMP threads spin."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def realspeech() -> Path:
    """../shared/realspeech beside the checkout: real recordings for preparation tests."""
    if not REALSPEECH.is_dir():
        pytest.skip("../shared/realspeech is absent")
    return REALSPEECH


@pytest.fixture
def corpus(tmp_path):
    """Four good utterances (WAV and FLAC), then four bad ones (data_helpers.make_corpus)."""
    from data_helpers import make_corpus

    return make_corpus(tmp_path)


@pytest.fixture
def tokenizer():
    """A character tokenizer of the corpus fixture's words."""
    from asr.tokenizer import train_tokenizer

    return train_tokenizer(["ONE TWO THREE FOUR X"], "char")


@pytest.fixture(scope="session")
def spoken_model(tmp_path_factory):
    """A small character model that has learned four eSpeak NG sentences by heart, its FLAC files
    and their transcripts (tests/spoken_model.py; ~10 s to make, once per session)."""
    pytest.importorskip("espeakng_loader")
    from spoken_model import train_spoken_model

    return train_spoken_model(tmp_path_factory.mktemp("spoken"))
