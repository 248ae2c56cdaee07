"""Preprocessing: processor configs -> model inputs, computed by kernel graphs on the target.

    config = load_image_config(folder)                   # image_processor.json, preprocessor_config.json, ...
    features = driver.drive(image_features(backend, config, image, height, width))
    features.tensors["pixel_values"], features.values["image_grid_thw"]

Images arrive decoded (uint8 [h, w, 3] RGB; targets/media.py in CPython), waveforms as float32
mono samples at the extractor's sampling rate.
"""

from __future__ import annotations

from .audio import audio_features
from .config import AudioConfig, ImageConfig, audio_config, image_config, load_audio_config, load_image_config
from .features import Features
from .image import image_features, target_size

__all__ = ["AudioConfig", "Features", "ImageConfig", "audio_config", "audio_features", "image_config",
           "image_features", "load_audio_config", "load_image_config", "target_size"]
