"""This toolkit's side of the peer benchmark: asr.model.ASRModel, asr.search's batched beam
search, the model's joint loss, and asr.dataset's dataset + collate (the code the training
loader's workers run). It imports the working tree's current code and nothing of the peers.
"""
from __future__ import annotations

import spec  # tools/bench_peers/spec.py: bench.py's folder is on sys.path
import torch

from asr.dataset import ASRDataset, collate
from asr.decoding import FEW_ROWS, intra_op_threads
from asr.features import FeatureConfig, GlobalCMVN
from asr.loader import compute_cmvn
from asr.manifest import Utterance
from asr.model import ASRModel, ModelConfig, count_parameters
from asr.search import SearchOptions, decode_memory, max_lengths


def model_config() -> ModelConfig:
    """The benchmark's transformer in our configuration vocabulary."""
    return ModelConfig(
        vocab_size=spec.VOCAB, n_mels=spec.N_MELS, subsampling=4, conv_channels=spec.CONV_CHANNELS,
        d_model=spec.D_MODEL, n_heads=spec.N_HEADS, ffn_dim=spec.FFN_DIM, encoder_layers=spec.ENCODER_LAYERS,
        decoder_layers=spec.DECODER_LAYERS, dropout=spec.DROPOUT, ctc_weight=spec.CTC_WEIGHT_TRAIN,
        lsm_weight=spec.LABEL_SMOOTHING,
    )


class Ours:
    """The spec.Toolkit of this toolkit."""

    name = "ours"

    def __init__(self, config: ModelConfig | None = None) -> None:
        """The benchmark's model, or `config` (a smaller one for tests; vocab_size spec.VOCAB)."""
        torch.manual_seed(0)
        self.model = ASRModel(config or model_config())
        if self.model.config.eos != spec.EOS:
            raise ValueError(f"our eos is {self.model.config.eos}, the benchmark's {spec.EOS}: vocab_size must be "
                             f"{spec.VOCAB}")
        with torch.no_grad():
            self.model.decoder.output.bias[self.model.config.eos] = spec.EOS_BIAS
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.LEARNING_RATE)
        self.cmvn: GlobalCMVN | None = None
        self.search_model = self.model  # what `decode` runs: ours_fast.py's variants put int8 or exported copies here

    def parameters(self) -> dict[str, int]:
        m = self.model
        return {"subsampling": count_parameters(m.encoder.subsampling), "encoder": count_parameters(m.encoder),
                "decoder": count_parameters(m.decoder), "ctc": count_parameters(m.ctc), "total": count_parameters(m)}

    @torch.no_grad()
    def decode(self, utts: spec.Utterances, *, beam_size: int, ctc_weight: float) -> list[list[int]]:
        """Encoder on the padded batch, then asr.search's beam search over batch x beam; the
        forced lengths are our max_len_ratio cut (spec.forced_lengths uses the same formula)."""
        self.search_model.eval()
        memory, memory_lens = self.search_model.encoder(utts.feats, utts.frames)
        if not torch.equal(max_lengths(memory_lens, spec.TOKENS_PER_FRAME), utts.lengths):
            raise AssertionError("our max_len_ratio cut differs from spec.forced_lengths")
        options = SearchOptions(mode="attention", beam_size=beam_size, ctc_weight=ctc_weight,
                                max_len_ratio=spec.TOKENS_PER_FRAME)
        few = memory.size(0) * beam_size <= FEW_ROWS and memory.device.type == "cpu"
        with intra_op_threads(1 if few else None):  # what `asr decode` / `asr transcribe` do by default
            nbests = decode_memory(self.search_model, memory, memory_lens, options)
        return [list(nbest[0].tokens) for nbest in nbests]

    def train_step(self, batch: spec.TrainBatch) -> float:
        self.model.train()
        out = self.model(batch.feats, batch.frames, batch.tokens, batch.token_lens)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    def prepare_loading(self, files: list[spec.AudioFile]) -> None:
        self.cmvn = GlobalCMVN(compute_cmvn(_utterances(files), FeatureConfig()))

    def load(self, files: list[spec.AudioFile], batch_size: int) -> int:
        """ASRDataset (read -> 16 kHz -> fbank, no dither -> CMVN) and collate, batch by batch."""
        dataset = ASRDataset(_utterances(files), None, features=FeatureConfig(), cmvn=self.cmvn)
        frames = 0
        for start in range(0, len(files), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(files)))])
            frames += int(batch.feat_lens.sum())
        return frames


def _utterances(files: list[spec.AudioFile]) -> list[Utterance]:
    return [Utterance(f"utt{k:03d}", f.path, f.seconds, "") for k, f in enumerate(files)]
