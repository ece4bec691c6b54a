"""A transformer speech recognition toolkit.

    import asr
    model = asr.load_model("exp/synth/model_avg.pt", device="cpu")
    results = model.transcribe(["a.flac", "b.wav"], beam_size=10)
"""

__version__ = "0.1.0"
__all__ = ["load_model", "transcribe", "__version__"]


def load_model(path, device="cpu"):
    """Load a model file written by `asr train` / `asr average`, or a folder written by `asr export`;
    returns a Recognizer (asr.api)."""
    from asr.api import load_model as _load

    return _load(path, device=device)


def transcribe(model_path, audio, **options):
    """One-shot helper: load `model_path` and transcribe `audio` (paths or (waveform, rate))."""
    return load_model(model_path, device=options.pop("device", "cpu")).transcribe(audio, **options)
