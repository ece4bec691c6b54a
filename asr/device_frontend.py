"""The feature frontend on the training device (data.frontend = "device"): loader workers only
decode audio into WaveBatches (asr.dataset.collate_waves), and the training step turns their
waveforms into features where the model runs: fbank (with dither in training), spectral warping,
gain and equaliser (data.augment.warp, .gain, .eq), CMVN, SpecAugment.

    frontend = DeviceFrontend(FeatureConfig(), CMVNStats.load("cmvn.json"), SpecAugmentConfig(), seed=0,
                              augment=AugmentConfig(warp=WarpConfig(prob=0.5))).to(device)
    feats, feat_lens = frontend(waves, wave_lens, indices, epoch, training=True)   # (B, N) -> (B, T, D)

Its randomness comes from (seed, epoch, dataset index) alone, one generator per utterance, so an
utterance gets the same dither and masks whatever batch it falls in, and a resumed run replays them:
- dither: a generator on the waveforms' device seeded as ASRDataset seeds its dither, so on the CPU
  the noise is the CPU frontend's own; on a GPU it is drawn there (a waveform's worth of numbers:
  drawn on the host they would sit on the training process's critical path, then be copied over).
- SpecAugment: CPU generators draw each utterance's few numbers (2 per mask or warp), copied to the
  device as one (B, K) tensor, and the masks are built there: the same masks on any device (a CPU
  generator's stream is the same everywhere), at the cost of B small host draws, not B kernel launches.
- warp, gain and equaliser: each utterance's factor, gain and curve are ASRDataset's
  (asr.augment.Augmenter.draw of the same seed, epoch and index), applied to the log-mels before CMVN
  as the dataset applies them, by one gather whose tables are copied over without a wait, and one
  (B, n_mels) shift copied the same way.
  (Noise and reverberation are the loader workers': they change the waveform, which is what the
  workers send.)
"""
from __future__ import annotations

import torch

from asr.augment import AugmentConfig, Augmenter, warp_rows
from asr.dataset import derive_seed
from asr.features import (
    CMVNStats,
    FeatureConfig,
    GlobalCMVN,
    SpecAugmentConfig,
    batched_fbank,
    frame_lengths,
    spec_augment_utterances,
)

__all__ = ["DeviceFrontend"]

_SPECAUG_STREAM = 1  # the 4th key of SpecAugment's seeds; dither's are (seed, epoch, index), as ASRDataset's


class DeviceFrontend(torch.nn.Module):
    """Padded waveforms -> CMVN-normalized (and, in training, dithered and SpecAugmented) fbank
    features on the waveforms' device, in float32 whatever autocast is on.

    Row b's frames equal ASRDataset's features of that utterance (fbank then CMVN) to float
    rounding (see asr.features.batched_fbank; with dither 0, or on the CPU with any dither);
    padded frames are zero. No parameters: `.to(device)` moves the CMVN statistics.
    """

    def __init__(self, features: FeatureConfig, cmvn: CMVNStats | GlobalCMVN | None,
                 specaug: SpecAugmentConfig | None = None, seed: int = 0, augment: AugmentConfig | None = None):
        super().__init__()
        self.features, self.specaug, self.seed = features, specaug, seed
        self.augmenter = Augmenter(augment, seed) if augment is not None and augment.on_features else None
        self.cmvn = GlobalCMVN(cmvn) if isinstance(cmvn, CMVNStats) else cmvn

    def forward(self, waves: torch.Tensor, wave_lens: torch.Tensor, indices: torch.Tensor, epoch: int,
                training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """waves (B, N) float zero-padded, wave_lens (B,) and indices (B,) int (dataset indices; keep
        both on the CPU, they are read on the host) -> (feats (B, T, D) float32, feat_lens (B,) int64),
        T = num_frames(N), on the waves' device. `training`: dither and SpecAugment."""
        keys = indices.tolist()
        if len(keys) != waves.shape[0]:
            raise ValueError(f"DeviceFrontend: {len(keys)} indices for {waves.shape[0]} waveforms")
        with torch.no_grad(), torch.autocast(waves.device.type, enabled=False):
            dither = None
            if training and self.features.dither > 0:
                dither = [torch.Generator(waves.device).manual_seed(derive_seed(self.seed, epoch, i)) for i in keys]
            feats, feat_lens = batched_fbank(waves, wave_lens, self.features, training=training, generators=dither)
            if training and self.augmenter is not None:
                draws = [self.augmenter.draw(epoch, i) for i in keys]
                feats = warp_rows(feats, [d.warp for d in draws])
                shifts = [self.augmenter.shift(d, feats.size(-1)) for d in draws]
                if any(s is not None for s in shifts):  # made on the host: a copy to the device, no sync
                    none = torch.zeros(feats.size(-1))
                    rows = torch.stack([none if s is None else s for s in shifts]).to(feats.dtype)
                    feats = feats + rows.to(feats.device, non_blocking=True)[:, None, :]
            if self.cmvn is not None:
                feats = self.cmvn(feats)
            padded = torch.arange(feats.shape[1], device=feats.device) >= feat_lens[:, None]  # (B, T)
            feats = feats.masked_fill_(padded[:, :, None], 0.0)  # the gain and CMVN reach them too
            if training and self.specaug is not None:
                masks = [torch.Generator().manual_seed(derive_seed(self.seed, epoch, i, _SPECAUG_STREAM)) for i in keys]
                host_lens = frame_lengths(wave_lens.cpu(), self.features)  # checked there without a sync
                feats = spec_augment_utterances(feats, host_lens, self.specaug, masks)
        return feats, feat_lens
