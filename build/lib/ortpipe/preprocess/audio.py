"""One waveform -> Whisper's log-mel input_features, as one kernel run (build/preprocess.py)."""

from __future__ import annotations

from ..execute.work import Backend, Handle, Run, Work, kernel
from .config import AudioConfig
from .features import Features


def audio_features(backend: Backend, config: AudioConfig, waveform: Handle, dtype: str = "float32") -> Work:
    """A float32 mono waveform at config.sampling_rate -> Features with `input_features`
    [1, feature_size, frames]: padded with silence or cut to chunk_length seconds first."""
    b = backend

    def one(value: int) -> Handle:
        return b.tensor([value], (1,), "int64")

    out = yield Run(kernel("log_mel", dtype), {
        "waveform": waveform, "samples": one(config.samples), "n_fft": one(config.n_fft),
        "hop_length": one(config.hop_length), "n_mels": one(config.feature_size),
        "sampling_rate": one(config.sampling_rate)}, ("input_features",))
    return Features({"input_features": out["input_features"]}, {})
